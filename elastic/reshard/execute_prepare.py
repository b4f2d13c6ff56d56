"""The reshard executor's first half: :func:`prepare`, run while training still steps.

Check the plan against this worker's state (every mismatch raises :class:`ReshardError` before
anything is allocated), choose which new tensors are old ones kept as they are and which live in
the memory of dropped shards, allocate and pre-touch the rest, and build the round schedule.
Reads only shapes, dtypes and devices of the old state, never values; moves nothing (that is
:func:`elastic.reshard.execute.execute`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from elastic.reshard.errors import ReshardError
from elastic.reshard.execute_wire import (
    PACK_BELOW_BYTES,
    Key,
    State,
    _bytes_of,
    _elsize,
    _numel,
    _Round,
    _round_up,
    _schedule,
)
from elastic.reshard.spec import FP32_KINDS, Box, box_numel
from elastic.reshard.types import LocalCopy, Message, ReshardPlan


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


def _alloc(shape: tuple[int, ...], dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Pre-touch: zero-filling faults every page in now (seconds per GB on CPU) instead of
    # during the exchange. On a GPU the allocator's memory is already mapped.
    if dev.type == "cpu":
        return torch.zeros(shape, dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)
