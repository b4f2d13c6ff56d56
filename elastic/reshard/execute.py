"""Reshard executor: move the bytes of a :class:`ReshardPlan` between live workers.

What it is for: every member of the plan (old workers union new workers) calls
:func:`prepare` while training still runs its last steps (allocate and pre-touch the
new tensors, build the round schedule), then :func:`execute` at the step boundary.
``execute`` runs the plan's rounds as batched point-to-point ``isend``/``irecv``
straight into the preallocated new tensors, does the worker's local copies while the
network operations are in flight, optionally verifies every message by checksum, and
returns the worker's new state (``{}`` for a leaver) after dropping what it no longer
owns. A leaver's caller should then call :func:`fast_exit`.

What it must not do: plan (the planner decides who sends what, see
``elastic/reshard/plan.py``), read or modify old values in ``prepare`` (training may
still be stepping on them), or move a byte before the plan has been checked against the
worker's state: every plan/state mismatch raises :class:`ReshardError` first and leaves
the old state intact.

Why the details matter: on CPU, 1 GB moves peer to peer over loopback gloo in a fraction
of a second, but first touch of fresh pages costs seconds per GB, and a normal
interpreter exit of a process holding GBs of tensors takes seconds too. Hence: pre-touch
in ``prepare``, receive directly into the destination view whenever it is a contiguous
slab (no staging copy), reuse old tensors whose region does not change (same object,
zero copy), recycle the memory of shards that are simply dropped (already touched), and
let leavers ``os._exit``.

Wire protocol (both sides derive it from the plan and the per-kind dtypes alone, so
they always agree): per round and per ordered pair (sender, receiver), the plan's
messages in plan order; messages smaller than ``PACK_BELOW_BYTES`` travel together in
one flat buffer (the first wire), every larger message travels alone (the next wires,
tags counting up), each as the row-major bytes of its region in its kind's dtype. Each
side independently decides whether its end can use the tensor view directly
(contiguous) or needs a staging slice.

Mixed precision (``MIXED_KINDS``: bf16 ``param``, fp32 ``master``/moments): every kind
has its own dtype (``prepare(dtypes=...)``, or inferred from the old state). The wire
is bytes: every buffer goes on the wire as a flat ``uint8`` view, and a packed wire lays
its messages out by byte offset, largest element size first (stable in plan order), so
an fp32 message never follows a bf16 one with an odd element count and every message
starts aligned to its element size without padding (offsets are still rounded up to
the element size, so the layout stays correct for any dtype mix). Why bytes rather
than one packed wire per (pair, round, dtype): it keeps one packed wire per pair and
round (the fixed cost per gloo op is what packing saves), one staging pool (``uint8``,
wires 16-byte aligned, viewed as each message's dtype) and one code path for NCCL and
gloo; the bytes are the same either way. Checksums are CRC-32 over each message's
bytes, so they work for any dtype, and each one carries a code of the sender's dtype so
``verify=True`` also catches two members that disagree on a kind's dtype (bf16 vs fp16
have the same size: the wire alone would not notice). Dropped old shards are recycled
at byte level too: a new bf16 tensor may live in the memory of a dropped fp32 one.

Byte accounting: ``ReshardStats`` counts real bytes per kind dtype. The planner's
``plan.bytes_per_element`` is one number for every kind, so for mixed kinds its byte
figures (``bytes_planned``, ``send_bytes``...) are element counts times that number, not
the bytes on the wire; see :func:`wire_bytes` for the exact figure.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.reshard.plan import ReshardError
from elastic.reshard.spec import FP32_KINDS, Box, box_numel, box_shape
from elastic.reshard.types import LocalCopy, Message, ReshardPlan

__all__ = [
    "PACK_BELOW_BYTES",
    "AllocBudgetExceeded",
    "Prepared",
    "ReshardError",
    "ReshardStats",
    "State",
    "execute",
    "fast_exit",
    "prepare",
    "reshard_group",
    "wire_bytes",
]

State = dict[tuple[str, str], torch.Tensor]
Key = tuple[str, str]

PACK_BELOW_BYTES = 256 * 1024
"""Messages below this size share one flat buffer per (round, pair). A gloo op costs
tens of microseconds of fixed overhead; copying 256 KiB costs about as much, so packing
pays below it and a message above it is better sent alone (no copy at all when both
views are contiguous)."""

WIRE_ALIGN = 16
"""Byte alignment of every wire inside the staging pool, so a slice of it can be viewed
as any dtype (``Tensor.view(dtype)`` needs the offset to be a multiple of the element size)."""

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Public data
# --------------------------------------------------------------------------------------------


@dataclass
class ReshardStats:
    """What one worker moved and how long each phase took (seconds, wall clock)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0  # copied inside this worker (plan.local_copies not kept in place)
    bytes_reused: int = 0  # kept in place: the old tensor object is the new one, zero copy
    bytes_allocated: int = 0  # fresh, pre-touched memory allocated in prepare
    bytes_recycled: int = 0  # new tensors placed in the memory of dropped shards
    wire_ops: int = 0  # isend + irecv operations posted
    rounds: int = 0
    prepare_seconds: float = 0.0
    exchange_seconds: float = 0.0  # all rounds, including packing/unpacking and local copies
    local_copy_seconds: float = 0.0  # part of exchange_seconds, overlapped with network ops
    verify_seconds: float = 0.0
    free_seconds: float = 0.0

    @property
    def execute_seconds(self) -> float:
        """Time inside :func:`execute` (the pause a worker sees)."""
        return self.exchange_seconds + self.verify_seconds + self.free_seconds


@dataclass(frozen=True)
class _Wire:
    """One isend or irecv of ``nbytes`` bytes: ``msgs`` at byte ``offsets`` (see the module docstring)."""

    peer: str
    tag: int
    nbytes: int
    msgs: tuple[Message, ...]
    offsets: tuple[int, ...]  # byte offset of each message inside the wire, a multiple of its element size
    dtype: torch.dtype  # the dtype every message shares, or torch.uint8 when they mix
    direct: bool  # my end is one contiguous tensor view: no staging, no copy
    stage_offset: int  # byte offset into the (uint8) staging pool when not direct


@dataclass(frozen=True)
class _Round:
    sends: tuple[_Wire, ...]
    recvs: tuple[_Wire, ...]


class AllocBudgetExceeded(ReshardError):
    """:func:`prepare` would allocate more than its ``max_alloc_bytes`` (nothing was allocated)."""

    def __init__(self, need: int, budget: int) -> None:
        super().__init__(f"the new tensors and staging need {need / 2**20:.1f} MiB, over the "
                         f"{budget / 2**20:.1f} MiB allowed; prepare after the step instead")
        self.need, self.budget = need, budget


@dataclass
class Prepared:
    """Everything :func:`execute` needs; built by :func:`prepare`. Use once."""

    plan: ReshardPlan
    me: str
    device: torch.device
    dtypes: dict[str, torch.dtype]  # kind -> dtype of its tensors (old and new, and on the wire)
    old_state: State  # the caller's dict; execute empties it
    fresh: State  # new tensors allocated (and pre-touched) in prepare
    reused: tuple[Key, ...]  # new tensors that are the old tensor objects themselves
    recycled: dict[Key, tuple[Key, int]]  # new key -> (dropped old key, byte offset in its storage)
    new_shapes: dict[Key, tuple[int, ...]]
    local_copies: tuple[LocalCopy, ...]  # those that still have to run
    rounds: tuple[_Round, ...]
    staging: torch.Tensor | None  # uint8 pool, big enough for the largest round's staged wires
    readers: dict[Key, int] = field(default_factory=dict)  # send wires + local copies reading each old tensor
    stats: ReshardStats = field(default_factory=ReshardStats)
    used: bool = False
    # A leaver's old tensors after execute: still referenced, so they are not freed one by one
    # inside the pause; its exit unmaps them at once (or drop the Prepared to free them).
    leftover: State = field(default_factory=dict)
    # Position of each of my messages in its (sender, receiver) pair's plan order: both ends
    # derive the same numbering, so checksums are matched without a global message index.
    seq: dict[Message, int] = field(default_factory=dict)
    pair_sent: dict[str, int] = field(default_factory=dict)  # receiver -> messages I send it
    pair_recv: dict[str, int] = field(default_factory=dict)  # sender -> messages I receive from it
    into: bool = False  # the new tensors are the caller's (prepare(into=...))

    @property
    def is_leaver(self) -> bool:
        return not self.plan.is_new(self.me)

    @property
    def dtype(self) -> torch.dtype | None:
        """The one dtype of every kind, or ``None`` in mixed precision (see ``dtypes``)."""
        kinds = set(self.dtypes.values())
        return kinds.pop() if len(kinds) == 1 else None


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------


def prepare(
    plan: ReshardPlan,
    me: str,
    old_state: State,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    recycle_dropped: bool = True,
    pack_below_bytes: int = PACK_BELOW_BYTES,
    max_alloc_bytes: int | None = None,
    into: State | None = None,
) -> Prepared:
    """Check the plan against ``old_state``, allocate the new tensors, build the schedule.

    Reads only the shapes, dtypes and devices of ``old_state`` (never values), so it can
    run while training still steps on it. Raises :class:`ReshardError` on any mismatch.

    Dtypes, per kind of ``plan.kinds``: ``dtypes[kind]`` if given (mixed precision:
    ``{"param": torch.bfloat16, "master": torch.float32, ...}``), else ``dtype`` if given
    (one dtype for every kind, as before), else the dtype of this worker's old tensors of
    that kind. A kind this worker holds nothing of (a joiner) falls back to fp32 for an
    all-fp32 plan (``FP32_KINDS``, the contract's CPU state) and is an error otherwise:
    a mixed-precision joiner must be told its dtypes. Every member must end up with the
    same dtype per kind (``verify=True`` checks it).
    ``recycle_dropped``: new tensors may live in the memory of old shards this worker
    drops without sending (placed there by :func:`execute`, after the step boundary).
    ``max_alloc_bytes``: raise :class:`AllocBudgetExceeded` before allocating anything when the
    new tensors and the staging pool need more (preparing beside a running step on a GPU whose
    free memory the step's own peak may need: the caller prepares after the step instead).
    ``into``: the new tensors already exist (a model built on the new mesh): every new shard of
    this worker is ``into[(tensor, kind)]``, of its local shape, kind dtype and device (any
    strides). Receives and local copies land straight in them; nothing is allocated but staging,
    no old tensor is reused or recycled, and old tensors may be strided (sends copy them).
    """
    t0 = time.perf_counter()
    dev = torch.device(device)
    # 1. the plan must describe this worker and agree with its state
    sends, recvs, copies, shards = _my_part(plan, me)
    kind_dtypes = _resolve_dtypes(plan, me, old_state, dtype, dtypes)
    _check_state(plan, me, old_state, sends, copies, dev, kind_dtypes, strided_ok=into is not None)
    new_shapes = _check_new(plan, me, shards, recvs, copies)
    strided: set[Key] = set()
    if into is not None:
        _check_into(me, into, new_shapes, dev, kind_dtypes)
        strided = {k for k in new_shapes if not into[k].is_contiguous()}
        strided |= {k for k in old_state if not old_state[k].is_contiguous()}
    # 2. which new tensors are old tensors untouched (zero copy), which old ones are dropped
    reused = _identity_keys(old_state, new_shapes, recvs, copies) if into is None else set()
    pending_copies = tuple(c for c in copies if (c.tensor, c.kind) not in reused)
    sources = {(m.tensor, m.kind) for m in sends} | {(c.tensor, c.kind) for c in pending_copies}
    to_place = [k for k in new_shapes if k not in reused] if into is None else []
    recycled: dict[Key, tuple[Key, int]] = {}
    if recycle_dropped and into is None:
        donors = [k for k in old_state if k not in reused and k not in sources and k not in new_shapes]
        recycled = _place_in_donors(to_place, new_shapes, donors, old_state, kind_dtypes)
    # 3. the round schedule and the (byte) staging pool its largest round needs
    old_shapes = {k: tuple(t.shape) for k, t in old_state.items()}
    rounds, staging_bytes = _schedule(plan, sends, recvs, old_shapes, new_shapes, kind_dtypes, pack_below_bytes,
                                      strided)
    nbytes = _bytes_of(kind_dtypes)
    if max_alloc_bytes is not None:
        need = sum(nbytes(k, _numel(new_shapes[k])) for k in to_place if k not in recycled) + staging_bytes
        if need > max_alloc_bytes:
            raise AllocBudgetExceeded(need, max_alloc_bytes)
    # 4. allocate and pre-touch them now, off the critical path
    fresh = {k: _alloc(new_shapes[k], dev, kind_dtypes[k[1]]) for k in to_place if k not in recycled}
    staging = _alloc((staging_bytes,), dev, torch.uint8) if staging_bytes else None
    stats = ReshardStats(
        bytes_reused=sum(nbytes(k, _numel(new_shapes[k])) for k in reused),
        bytes_allocated=sum(t.numel() * t.element_size() for t in fresh.values()) + staging_bytes,
        bytes_recycled=sum(nbytes(k, _numel(new_shapes[k])) for k in recycled),
        rounds=len(rounds),
    )
    readers: dict[Key, int] = defaultdict(int)
    for w in (w for r in rounds for w in r.sends):
        for key in {(m.tensor, m.kind) for m in w.msgs}:
            readers[key] += 1
    for c in pending_copies:
        readers[(c.tensor, c.kind)] += 1
    seq, pair_sent, pair_recv = _pair_order(sends, recvs)
    stats.prepare_seconds = time.perf_counter() - t0
    return Prepared(plan, me, dev, kind_dtypes, old_state, dict(into) if into is not None else fresh,
                    tuple(sorted(reused)), recycled, new_shapes, pending_copies, rounds, staging, dict(readers),
                    stats, seq=seq, pair_sent=pair_sent, pair_recv=pair_recv, into=into is not None)


def _my_part(plan: ReshardPlan, me: str) -> tuple[list[Message], list[Message], list[LocalCopy], list]:
    if not (plan.is_old(me) or plan.is_new(me)):
        members = [str(w) for w in plan.members]
        raise ReshardError(
            f"worker '{me}' is not a member of the plan {plan.describe()} "
            f"(members: {', '.join(members[:16])}{' ...' if len(members) > 16 else ''}); call prepare with one of them"
        )
    sends, recvs = plan.messages_for(me)
    return sends, recvs, plan.local_copies_for(me), plan.new_shards_for(me)


def _pair_order(sends: Sequence[Message], recvs: Sequence[Message]) -> tuple[dict[Message, int], dict, dict]:
    seq: dict[Message, int] = {}
    sent: dict[str, int] = defaultdict(int)
    got: dict[str, int] = defaultdict(int)
    for m in sends:
        seq[m] = sent[m.dst]
        sent[m.dst] += 1
    for m in recvs:
        seq[m] = got[m.src]
        got[m.src] += 1
    return seq, dict(sent), dict(got)


def _check_into(me: str, into: State, new_shapes: dict[Key, tuple[int, ...]], dev: torch.device,
                dtypes: Mapping[str, torch.dtype]) -> None:
    """The caller's new tensors are exactly the plan's new shards of this worker."""
    missing = [k for k in new_shapes if k not in into]
    extra = [k for k in into if k not in new_shapes]
    if missing or extra:
        raise ReshardError(
            f"worker '{me}': into= has {len(into)} tensors but the plan gives it {len(new_shapes)} new shards"
            + (f"; missing {missing[:3]}" if missing else "") + (f"; not in the plan {extra[:3]}" if extra else "")
        )
    for key, shape in new_shapes.items():
        t = into[key]
        # an empty region is () on every dim; torch keeps the other dims of an empty shard ((0, 10))
        same = tuple(t.shape) == tuple(shape) or (t.numel() == 0 and math.prod(shape) == 0)
        if not same or t.dtype != dtypes[key[1]] or t.device.type != dev.type:
            raise ReshardError(
                f"worker '{me}': into[{key[0]!r}] is {list(t.shape)} {t.dtype} on {t.device}; the plan needs "
                f"{list(shape)} {dtypes[key[1]]} on {dev}"
            )


def _resolve_dtypes(plan: ReshardPlan, me: str, old_state: State, dtype: torch.dtype | None,
                    dtypes: Mapping[str, torch.dtype] | None) -> dict[str, torch.dtype]:
    """The dtype of every kind of the plan: ``dtypes[kind]``, else ``dtype``, else the old state's."""
    given = dict(dtypes or {})
    unknown = sorted(set(given) - set(plan.kinds))
    if unknown:
        raise ReshardError(
            f"worker '{me}': dtypes names kinds {unknown} that the plan does not move; "
            f"its kinds are {list(plan.kinds)}"
        )
    held: dict[str, set[torch.dtype]] = defaultdict(set)
    for (_name, kind), t in old_state.items():
        held[kind].add(t.dtype)
    out: dict[str, torch.dtype] = {}
    for kind in plan.kinds:
        if kind in given:
            out[kind] = given[kind]
        elif dtype is not None:
            out[kind] = dtype
        elif len(held[kind]) == 1:
            out[kind] = next(iter(held[kind]))
        elif held[kind]:
            raise ReshardError(
                f"worker '{me}': its old [{kind}] tensors mix dtypes {sorted(map(str, held[kind]))}; one dtype per "
                f"kind is moved: convert the state or pass dtypes={{'{kind}': ...}}"
            )
        elif set(plan.kinds) <= set(FP32_KINDS):
            out[kind] = torch.float32  # the contract's all-fp32 state: nothing to guess
        else:
            raise ReshardError(
                f"worker '{me}' holds no [{kind}] tensor to infer its dtype from (a joiner?); pass "
                f"dtypes={{'{kind}': ...}} for every kind of the plan {list(plan.kinds)} "
                "(mixed precision: bf16 param, fp32 master/exp_avg/exp_avg_sq)"
            )
    for kind, dt in out.items():
        if not isinstance(dt, torch.dtype):
            raise ReshardError(f"worker '{me}': dtype for [{kind}] is {dt!r}, not a torch.dtype")
    return out


def _bytes_of(dtypes: Mapping[str, torch.dtype]) -> Callable[[Key, int], int]:
    """``nbytes(key, numel)``: the bytes of ``numel`` elements of ``key``'s kind."""
    sizes = {kind: _elsize(dt) for kind, dt in dtypes.items()}
    return lambda key, numel: numel * sizes[key[1]]


def wire_bytes(plan: ReshardPlan, dtypes: Mapping[str, torch.dtype]) -> int:
    """Bytes the plan's messages really carry when each kind moves as ``dtypes[kind]``.

    ``plan.bytes_planned`` is elements times one ``bytes_per_element``; with mixed kinds
    (bf16 param, fp32 master/moments) this is the true figure the stats add up to.
    """
    return sum(m.numel * _elsize(dtypes[m.kind]) for m in plan.messages)


def _check_state(
    plan: ReshardPlan, me: str, old_state: State, sends: Sequence[Message], copies: Sequence[LocalCopy],
    dev: torch.device, dtypes: Mapping[str, torch.dtype], strided_ok: bool = False,
) -> None:
    """Every tensor this worker reads must exist, have its kind's dtype, the device and contain the box."""
    for item in (*sends, *copies):
        key = (item.tensor, item.kind)
        t = old_state.get(key)
        what = f"{'message' if isinstance(item, Message) else 'local copy'} of {key[0]} [{key[1]}]"
        if t is None:
            raise ReshardError(
                f"worker '{me}': the plan has it send/copy {key[0]} [{key[1]}] but its old state has no such "
                f"tensor ({len(old_state)} tensors held); the state does not match the plan {plan.describe()}"
            )
        dtype = dtypes[key[1]]
        if t.dtype != dtype or t.device.type != dev.type:
            raise ReshardError(
                f"worker '{me}': {key[0]} [{key[1]}] is {t.dtype} on {t.device}, the reshard moves {key[1]} as "
                f"{dtype} on {dev}; pass dtype=/dtypes={{'{key[1]}': ...}}/device= matching the state"
            )
        if not t.is_contiguous() and not strided_ok:
            raise ReshardError(f"worker '{me}': {key[0]} [{key[1]}] is not contiguous; the state must be row-major")
        _check_box(me, what, item.src_box, tuple(t.shape), "old")


def _check_box(me: str, what: str, box: Box, shape: tuple[int, ...], side: str) -> None:
    ok = len(box) == len(shape) and all(0 <= a < b <= s for (a, b), s in zip(box, shape, strict=False))
    if not ok:
        raise ReshardError(
            f"worker '{me}': {what} needs box {list(box)} of its {side} local tensor, whose shape is "
            f"{list(shape)}; the state does not match the plan (wrong layout or rank map?)"
        )


def _check_new(plan: ReshardPlan, me: str, shards: Sequence, recvs: Sequence[Message],
               copies: Sequence[LocalCopy]) -> dict[Key, tuple[int, ...]]:
    """The new local shapes, and every byte written lands inside one of them."""
    new_shapes: dict[Key, tuple[int, ...]] = {}
    for s in shards:
        key = (s.tensor, s.kind)
        if key in new_shapes:
            raise ReshardError(f"plan lists new shard {key[0]} [{key[1]}] twice for worker '{me}'")
        new_shapes[key] = s.local_shape
    written = 0
    for item in (*recvs, *copies):
        key = (item.tensor, item.kind)
        if key not in new_shapes:
            raise ReshardError(
                f"plan writes {key[0]} [{key[1]}] on worker '{me}' but lists no new shard for it (planner bug)"
            )
        _check_box(me, f"write of {key[0]} [{key[1]}]", item.dst_box, new_shapes[key], "new")
        written += box_numel(item.dst_box)
    need = sum(_numel(s) for s in new_shapes.values())
    if written != need:
        raise ReshardError(
            f"plan fills {written} of the {need} elements worker '{me}' must hold after the reshard "
            "(planner bug: every new element must be received or copied exactly once)"
        )
    return new_shapes


def _identity_keys(old_state: State, new_shapes: dict[Key, tuple[int, ...]], recvs: Sequence[Message],
                   copies: Sequence[LocalCopy]) -> set[Key]:
    """New tensors equal to the old tensor as a whole: every element copied to the same place."""
    received = {(m.tensor, m.kind) for m in recvs}
    by_key: dict[Key, list[LocalCopy]] = defaultdict(list)
    for c in copies:
        by_key[(c.tensor, c.kind)].append(c)
    out: set[Key] = set()
    for key, cs in by_key.items():
        old = old_state.get(key)
        if key in received or old is None or tuple(old.shape) != new_shapes[key]:
            continue
        if all(c.src_box == c.dst_box for c in cs) and sum(c.numel for c in cs) == old.numel():
            out.add(key)
    return out


def _place_in_donors(to_place: Sequence[Key], new_shapes: dict[Key, tuple[int, ...]], donors: Sequence[Key],
                     old_state: State, dtypes: Mapping[str, torch.dtype]) -> dict[Key, tuple[Key, int]]:
    """First-fit decreasing, in bytes, of new tensors into dropped old tensors (already touched memory).

    Bytes, not elements: a new bf16 ``param`` may live in a dropped fp32 ``exp_avg``. Each
    placement starts at a byte address that is a multiple of its element size.
    """
    free = {d: old_state[d].numel() * old_state[d].element_size() for d in donors if old_state[d].is_contiguous()}
    base = {d: old_state[d].storage_offset() * old_state[d].element_size() for d in free}
    used = dict.fromkeys(free, 0)
    nbytes = _bytes_of(dtypes)
    out: dict[Key, tuple[Key, int]] = {}
    for key in sorted(to_place, key=lambda k: -nbytes(k, _numel(new_shapes[k]))):
        n, el = nbytes(key, _numel(new_shapes[key])), _elsize(dtypes[key[1]])
        for d in sorted(free, key=lambda d: -(free[d] - used[d])):
            start = _round_up(base[d] + used[d], el) - base[d]
            if free[d] - start >= n:
                out[key] = (d, start)
                used[d] = start + n
                break
    return out


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _alloc(shape: tuple[int, ...], dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Pre-touch: zero-filling faults every page in now (seconds per GB on CPU) instead of
    # during the exchange. On a GPU the allocator's memory is already mapped.
    if dev.type == "cpu":
        return torch.zeros(shape, dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def _schedule(
    plan: ReshardPlan, sends: Sequence[Message], recvs: Sequence[Message],
    old_shapes: dict[Key, tuple[int, ...]], new_shapes: dict[Key, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype], pack_below_bytes: int, strided: set[Key] = frozenset(),  # type: ignore[assignment]
) -> tuple[tuple[_Round, ...], int]:
    """Wires per round (same grouping and byte layout on both ends) and the staging bytes the biggest round needs.

    ``strided``: this worker's tensors that are not row-major; their ends of a wire always stage.
    """
    n_rounds = max(1, plan.rounds, 1 + max((m.round for m in (*sends, *recvs)), default=0))
    nbytes = _bytes_of(dtypes)

    def size(m: Message) -> int:
        return nbytes((m.tensor, m.kind), m.numel)

    rounds: list[_Round] = []
    staging = 0
    for r in range(n_rounds):
        offset = 0
        round_wires: dict[str, list[_Wire]] = {}
        for side, msgs, shapes in (("send", sends, old_shapes), ("recv", recvs, new_shapes)):
            wires: list[_Wire] = []
            for peer, group in _by_peer([m for m in msgs if m.round == r], side).items():
                for tag, part in enumerate(_split_wire(group, pack_below_bytes, size)):
                    part, offsets, total = _layout(part, dtypes)
                    box = part[0].src_box if side == "send" else part[0].dst_box
                    key = (part[0].tensor, part[0].kind)
                    direct = len(part) == 1 and key not in strided and _contiguous(shapes[key], box)
                    kinds = {dtypes[m.kind] for m in part}
                    dt = kinds.pop() if len(kinds) == 1 else torch.uint8
                    wires.append(_Wire(peer, tag, total, part, offsets, dt, direct, -1 if direct else offset))
                    offset += 0 if direct else _round_up(total, WIRE_ALIGN)
            round_wires[side] = wires
        staging = max(staging, offset)
        rounds.append(_Round(tuple(round_wires["send"]), tuple(round_wires["recv"])))
    return tuple(rounds), staging


def _layout(part: Sequence[Message], dtypes: Mapping[str, torch.dtype]) -> tuple[tuple[Message, ...], tuple[int, ...], int]:
    """Messages of one wire in wire order (largest element first, then plan order), their byte offsets, total.

    Element sizes are powers of two, so with the largest first every offset is already a
    multiple of its element size (fp32 ×3 then bf16 ×5: offsets 0, 12; 22 bytes); the
    rounding up only guards exotic mixes.
    """
    ordered = tuple(sorted(part, key=lambda m: -_elsize(dtypes[m.kind])))  # stable: plan order within a size
    offsets, off = [], 0
    for m in ordered:
        el = _elsize(dtypes[m.kind])
        off = _round_up(off, el)
        offsets.append(off)
        off += m.numel * el
    return ordered, tuple(offsets), off


def _by_peer(msgs: Iterable[Message], side: str) -> dict[str, list[Message]]:
    out: dict[str, list[Message]] = defaultdict(list)
    for m in msgs:  # plan order: the sender and the receiver see the same order
        out[m.dst if side == "send" else m.src].append(m)
    return dict(sorted(out.items()))


def _split_wire(group: list[Message], pack_below: int,
                size: Callable[[Message], int] | None = None) -> list[list[Message]]:
    """First wire: every small message packed together; then each big message alone.

    ``size(m)`` is compared with ``pack_below``: bytes in the executor, elements by default.
    """
    size = size or (lambda m: m.numel)
    small = [m for m in group if size(m) < pack_below]
    big = [[m] for m in group if size(m) >= pack_below]
    return ([small] if small else []) + big


def _contiguous(shape: tuple[int, ...], box: Box) -> bool:
    """Is ``t[box]`` one contiguous run of a row-major tensor of ``shape``?

    True iff, after leading dims of extent 1, the first wider dim may be partial and every
    later dim is full: rows 8..16 of a [64, 32] tensor are, columns 8..16 are not.
    """
    i = 0
    while i < len(box) and box[i][1] - box[i][0] == 1:
        i += 1
    return all(box[j] == (0, shape[j]) for j in range(i + 1, len(box)))


# --------------------------------------------------------------------------------------------
# execute
# --------------------------------------------------------------------------------------------


def execute(
    prepared: Prepared,
    pg: object | None,
    group_rank: dict[str, int],
    *,
    verify: bool = False,
) -> State:
    """Run the exchange; return this worker's new state (``{}`` for a leaver).

    Every member of ``plan.members`` must call it with the same plan. ``pg`` is a process
    group holding all members (``None`` = the default group) or a raw backend made by
    :func:`reshard_group`; ``group_rank[w]`` is worker ``w``'s rank in it. With
    ``verify=True`` every message and local copy is checksummed on both ends and any
    mismatch raises :class:`ReshardError` on every member. On return the dict passed to
    :func:`prepare` is empty (the new state holds the tensors that were kept; a leaver's old
    tensors stay in ``prepared.leftover`` for its exit to unmap: munmap of GBs, tensor by
    tensor, would compete with its own sends for the CPU). Old tensors
    this worker neither keeps nor sends may be overwritten: their memory is recycled for
    new tensors, so the caller must not use its old references after the step boundary.
    """
    p = prepared
    if p.used:
        raise ReshardError(f"worker '{p.me}': this Prepared was already executed; call prepare again")
    missing = [w for w in p.plan.members if w not in group_rank][:8]
    if missing:
        raise ReshardError(f"group_rank lacks members {missing}; every member of the plan needs a rank in pg")
    p.used = True
    comm = _Comm(pg, group_rank, p.device)
    st = p.stats
    t0 = time.perf_counter()
    if comm.nccl:
        # NCCL: the first operation on a communicator must involve every rank, and a worker
        # may have nothing to send or receive in round 0.
        comm.sync_count(0)
    # 1. the new state: fresh tensors, old objects kept as they are, views into dropped shards
    new_state = _materialize(p)
    checks: dict[tuple[str, str, int], int] = {}  # (src, dst, message index) -> crc
    local_bad: list[str] = []
    # 2. rounds: post receives and sends, do local copies while they fly, unpack
    index = p.seq
    release = _Releaser(p)
    for r, rnd in enumerate(p.rounds):
        works = _post(p, comm, rnd, new_state, checks if verify else None, index, release)
        if r == 0:
            tc = time.perf_counter()
            local_bad = _local_copies(p, new_state, verify, release)
            st.local_copy_seconds = time.perf_counter() - tc
        _complete(p, rnd, works, new_state, checks if verify else None, index, release)
    if not p.rounds:
        local_bad = _local_copies(p, new_state, verify, release)
    st.exchange_seconds = time.perf_counter() - t0
    # 3. verification and a final all-member sync: leavers must not exit before their bytes landed
    t1 = time.perf_counter()
    bad = _verify(p, comm, checks) + local_bad if verify else []
    failed = comm.sync_count(len(bad))
    st.verify_seconds = time.perf_counter() - t1
    if failed:
        raise ReshardError(
            f"worker '{p.me}': reshard verification failed ({failed} mismatches across all members)"
            + (f"; here: {'; '.join(bad[:5])}" if bad else "; none on this worker")
        )
    # 4. free what this worker no longer owns (a leaver: hand it to its exit, see Prepared.leftover)
    t2 = time.perf_counter()
    if p.is_leaver:
        p.leftover = dict(p.old_state)
    p.old_state.clear()
    p.fresh = {}
    p.staging = None
    if p.is_leaver:
        new_state = {}
    st.free_seconds = time.perf_counter() - t2
    return new_state


def _materialize(p: Prepared) -> State:
    out: State = {}
    for key, shape in p.new_shapes.items():
        if key in p.fresh:
            out[key] = p.fresh[key]
        elif key in p.reused:
            out[key] = p.old_state[key]
        else:
            donor, off = p.recycled[key]
            dt = p.dtypes[key[1]]
            out[key] = _as_bytes(p.old_state[donor])[off: off + _numel(shape) * _elsize(dt)].view(dt).view(shape)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The flat ``uint8`` view of a contiguous tensor (no copy): what goes on the wire."""
    return t.reshape(-1).view(torch.uint8)


def _view(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def _post(p: Prepared, comm: _Comm, rnd: _Round, new_state: State, checks: dict | None,
          index: dict[Message, int], release: _Releaser) -> list:
    """Receives first (so a fast sender never waits on us), then sends; pack where needed."""
    ops: list[tuple[bool, torch.Tensor, str, int]] = []
    for w in rnd.recvs:
        m = w.msgs[0]
        buf = _view(new_state[(m.tensor, m.kind)], m.dst_box) if w.direct else _stage(p, w)
        ops.append((False, buf, w.peer, w.tag))
        p.stats.bytes_received += w.nbytes
    for w in rnd.sends:
        if w.direct:
            m = w.msgs[0]
            buf = _view(p.old_state[(m.tensor, m.kind)], m.src_box)
        else:
            buf = _stage(p, w)
            for i, m in enumerate(w.msgs):
                _staged_msg(p, w, i).copy_(_view(p.old_state[(m.tensor, m.kind)], m.src_box))
            release.wire(w)  # the bytes are in staging now
        if checks is not None:
            _checksum_wire(p, checks, w, buf, index)
        ops.append((True, buf, w.peer, w.tag))
        p.stats.bytes_sent += w.nbytes
    p.stats.wire_ops += len(ops)
    return comm.post(ops)


def _stage(p: Prepared, w: _Wire) -> torch.Tensor:
    """The wire's staging slice, typed when its messages share a dtype (``uint8`` when they mix)."""
    assert p.staging is not None
    return p.staging[w.stage_offset: w.stage_offset + w.nbytes].view(w.dtype)


def _staged_msg(p: Prepared, w: _Wire, i: int) -> torch.Tensor:
    """Message ``i`` of a staged wire, as its kind's dtype and its region's shape."""
    assert p.staging is not None
    m, dt = w.msgs[i], p.dtypes[w.msgs[i].kind]
    start = w.stage_offset + w.offsets[i]
    return p.staging[start: start + m.numel * _elsize(dt)].view(dt).view(box_shape(m.region))


class _Releaser:
    """Drops an old tensor the moment its last reader is done and nobody keeps it.

    Freeing 0.5 GB costs ~0.1-0.3 s here; doing it while other wires are still in flight
    instead of after the exchange takes it off a survivor's pause. A leaver frees nothing
    here: its process exit unmaps everything at once, cheaper than munmap per tensor while
    its sends still need the CPU (measured: its execute 10-20 % shorter).
    """

    def __init__(self, p: Prepared):
        self.p = p
        self.left = dict(p.readers)
        self.keep = set(p.reused) | {d for d, _ in p.recycled.values()}
        self.leaver = p.is_leaver

    def wire(self, w: _Wire) -> None:
        for key in {(m.tensor, m.kind) for m in w.msgs}:
            self.done(key)

    def done(self, key: Key) -> None:
        if self.leaver:
            return  # its exit frees everything in one go; freeing here would slow its sends
        self.left[key] -= 1
        if self.left[key] == 0 and key not in self.keep:
            self.p.old_state.pop(key, None)


def _complete(p: Prepared, rnd: _Round, works: list, new_state: State, checks: dict | None,
              index: dict[Message, int], release: _Releaser) -> None:
    """Wait wire by wire: unpack each staged receive, release each direct send's source."""
    wires = [(False, w) for w in rnd.recvs] + [(True, w) for w in rnd.sends]
    if len(works) != len(wires):  # a coalesced batch (NCCL) answers with one work for all
        for work in works:
            work.wait()
        works = [None] * len(wires)
    for i, (is_send, w) in enumerate(wires):
        if works[i] is not None:
            works[i].wait()
            works[i] = None  # the work holds its tensor: drop it so release can free memory
        if is_send:
            if w.direct:
                release.wire(w)
            continue
        if not w.direct:
            for j, m in enumerate(w.msgs):
                _view(new_state[(m.tensor, m.kind)], m.dst_box).copy_(_staged_msg(p, w, j))
        if checks is not None:
            for m in w.msgs:  # checksum where the bytes finally live, catching unpack bugs too
                got = _view(new_state[(m.tensor, m.kind)], m.dst_box)
                checks[(m.src, m.dst, index[m])] = _signed_crc(got)


def _local_copies(p: Prepared, new_state: State, verify: bool, release: _Releaser) -> list[str]:
    bad: list[str] = []
    for c in p.local_copies:
        src = _view(p.old_state[(c.tensor, c.kind)], c.src_box)
        dst = _view(new_state[(c.tensor, c.kind)], c.dst_box)
        dst.copy_(src)
        p.stats.bytes_local += c.numel * dst.element_size()
        if verify and _crc(src) != _crc(dst):
            bad.append(f"local copy of {c.tensor} [{c.kind}] region {list(c.region)} on '{p.me}'")
        del src
        release.done((c.tensor, c.kind))
    return bad


def _checksum_wire(p: Prepared, checks: dict, w: _Wire, buf: torch.Tensor, index: dict[Message, int]) -> None:
    """Sender side: the checksum of each message as it goes on the wire."""
    for i, m in enumerate(w.msgs):
        checks[(m.src, m.dst, index[m])] = _signed_crc(buf if w.direct else _staged_msg(p, w, i))


_CRC_BITS = 32


def _signed_crc(t: torch.Tensor) -> int:
    """CRC-32 of the bytes in the low 32 bits, a code of the dtype above them (fits an int64).

    Two members that disagree on a kind's dtype move the same bytes when the sizes match
    (bf16 vs fp16); the dtype code makes ``verify`` catch that too.
    """
    return (_dtype_code(t.dtype) << _CRC_BITS) | _crc(t)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFF_FFFF  # 31 bits: the int64 stays positive


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of the row-major bytes (exact and order-sensitive, unlike float sums)."""
    c = t.detach().contiguous().reshape(-1)
    if c.device.type != "cpu":
        c = c.cpu()
    return zlib.crc32(memoryview(c.view(torch.uint8).numpy()))


def _verify(p: Prepared, comm: _Comm, checks: dict[tuple[str, str, int], int]) -> list[str]:
    """Senders ship their checksums to each receiver (one small message per pair); compare."""
    ops, inbox = [], {}
    dev = comm.sync_device
    for dst, n in sorted(p.pair_sent.items()):
        ops.append((True, torch.tensor([checks[(p.me, dst, i)] for i in range(n)], dtype=torch.int64, device=dev),
                    dst, 0))
    for src, n in sorted(p.pair_recv.items()):
        inbox[src] = torch.zeros(n, dtype=torch.int64, device=dev)
        ops.append((False, inbox[src], src, 0))
    for w in comm.post(ops):
        w.wait()
    received = {(m.src, i): m for m, i in p.seq.items() if m.dst == p.me}
    bad = []
    for src in sorted(p.pair_recv):
        for i, c in enumerate(inbox[src].tolist()):
            mine = checks[(src, p.me, i)]
            if mine != c:
                m = received[(src, i)]
                why = "" if mine >> _CRC_BITS == c >> _CRC_BITS else (
                    f" (the sender moves [{m.kind}] as another dtype than {p.dtypes[m.kind]}: pass the same "
                    "dtypes= on every member)")
                bad.append(f"{m.tensor} [{m.kind}] region {list(m.region)} from '{m.src}' to '{m.dst}'{why}")
    return bad


# --------------------------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------------------------


class _Comm:
    """isend/irecv on either a registered process group or a raw backend (transient group)."""

    def __init__(self, pg: object | None, group_rank: dict[str, int], device: torch.device):
        self.pg = pg
        self.rank = group_rank
        self.raw = pg is not None and not isinstance(pg, dist.ProcessGroup)
        self.nccl = device.type == "cuda"
        self.sync_device = device if self.nccl else torch.device("cpu")

    def post(self, ops: list[tuple[bool, torch.Tensor, str, int]]) -> list:
        """Post every op; each tensor (contiguous, any dtype) travels as its bytes."""
        if not ops:
            return []
        if self.raw:
            works = []
            for is_send, t, peer, tag in ops:
                fn = self.pg.send if is_send else self.pg.recv  # type: ignore[attr-defined]
                works.append(fn([_as_bytes(t)], self.rank[peer], tag))
            return works
        p2p = [dist.P2POp(dist.isend if s else dist.irecv, _as_bytes(t), group=self.pg, tag=tag,
                          group_peer=self.rank[peer])
               for s, t, peer, tag in ops]
        return dist.batch_isend_irecv(p2p)

    def sync_count(self, n: int) -> int:
        """All-reduce (sum) of ``n`` over every member: a barrier that also carries failures."""
        t = torch.tensor([n], dtype=torch.int64, device=self.sync_device)
        if self.raw:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self.pg.allreduce([t], opts).wait()  # type: ignore[attr-defined]
        else:
            dist.all_reduce(t, group=self.pg)
        return int(t.item())


def reshard_group(
    members: Sequence[str],
    me: str,
    store_addr: str,
    port: int,
    generation: int,
    backend: str | None = None,
    *,
    timeout_s: float = 120.0,
) -> tuple[object, dict[str, int]]:
    """A transient process group of ``members`` for one reshard, next to any existing group.

    ``members[0]`` hosts the TCPStore on ``store_addr:port``; keys live under
    ``reshard/<generation>/`` so one store can serve successive generations. Returns the
    group (a raw gloo/NCCL backend, to pass as ``pg`` to :func:`execute`) and the group
    rank of every member (position in ``members``). ``backend``: ``"gloo"`` (CPU tensors)
    or ``"nccl"`` (CUDA tensors); default gloo unless CUDA is available.
    """
    if me not in members:
        raise ReshardError(f"worker '{me}' is not in the reshard members {list(members)}")
    if len(set(members)) != len(members):
        raise ReshardError(f"reshard members contain duplicates: {list(members)}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ranks = {w: i for i, w in enumerate(members)}
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_addr, port, len(members), is_master=ranks[me] == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"reshard/{generation}/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, ranks[me], len(members), timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, ranks[me], len(members), opts)
    else:
        raise ReshardError(f"backend '{backend}': use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors)")
    return pg, ranks


def fast_exit(code: int = 0) -> None:
    """Leave now: flush output and logs, then ``os._exit`` without interpreter teardown.

    A normal exit of a process holding GBs of tensors takes seconds (freeing and
    finalizers); ``os._exit`` after flushing takes a fraction of that. Call it in a leaver after
    :func:`execute` returned.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep a leaver alive
            pass
    logging.shutdown()
    os._exit(code)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
