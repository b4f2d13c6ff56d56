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

Where: :func:`prepare` and its checks in ``execute_prepare.py``, the wire protocol (which
messages travel together, at which byte offsets) in ``execute_wire.py``, the transport (process
groups, ``isend``/``irecv``) in ``execute_comm.py``; :func:`execute` here.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import zlib

import torch

from elastic.reshard.errors import ReshardError
from elastic.reshard.execute_comm import _Comm, reshard_group
from elastic.reshard.execute_prepare import AllocBudgetExceeded, Prepared, ReshardStats, prepare
from elastic.reshard.execute_prepare import _place_in_donors as _place_in_donors  # re-exported (tests)
from elastic.reshard.execute_wire import (
    PACK_BELOW_BYTES,
    Key,
    State,
    _as_bytes,
    _elsize,
    _numel,
    _Round,
    _Wire,
    wire_bytes,
)
from elastic.reshard.execute_wire import _contiguous as _contiguous  # re-exported (tests)
from elastic.reshard.execute_wire import _layout as _layout  # re-exported (tests)
from elastic.reshard.execute_wire import _split_wire as _split_wire  # re-exported (tests)
from elastic.reshard.spec import Box, box_shape
from elastic.reshard.types import Message

__all__ = [
    "PACK_BELOW_BYTES",
    "AllocBudgetExceeded",
    "Prepared",
    "ReshardError",
    "ReshardStats",
    "State",
    "execute",
    "execute_local",
    "fast_exit",
    "prepare",
    "reshard_group",
    "wire_bytes",
]

log = logging.getLogger(__name__)


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
    return _free(p, new_state)


def execute_local(prepared: Prepared, *, verify: bool = False) -> State:
    """:func:`execute` for a plan with no message at all (every member keeps what it needs, e.g.
    data-parallel replicas shrinking): this worker's local copies, no group and no final sync,
    since no member waits for another's bytes. The caller knows the whole plan has no message
    (``plan.n_messages == 0``, the same plan on every member); a worker with rounds to run
    raises before anything is copied."""
    p = prepared
    if p.used:
        raise ReshardError(f"worker '{p.me}': this Prepared was already executed; call prepare again")
    if any(r.sends or r.recvs for r in p.rounds):
        raise ReshardError(f"worker '{p.me}': the plan moves bytes between workers; run it with execute()")
    p.used = True
    t0 = time.perf_counter()
    new_state = _materialize(p)
    bad = _local_copies(p, new_state, verify, _Releaser(p))
    p.stats.exchange_seconds = p.stats.local_copy_seconds = time.perf_counter() - t0
    if bad:
        raise ReshardError(f"worker '{p.me}': reshard verification failed here: {'; '.join(bad[:5])}")
    return _free(p, new_state)


def _free(p: Prepared, new_state: State) -> State:
    """Drop what this worker no longer owns (a leaver's old tensors go to its exit, see
    ``Prepared.leftover``); this worker's new state."""
    t2 = time.perf_counter()
    if p.is_leaver:
        p.leftover = dict(p.old_state)
    p.old_state.clear()
    p.fresh = {}
    p.staging = None
    if p.is_leaver:
        new_state = {}
    p.stats.free_seconds = time.perf_counter() - t2
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
