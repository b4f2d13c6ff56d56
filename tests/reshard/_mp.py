"""Multi-process harness for reshard tests: a pool of spawned gloo workers and state builders.

The pool is started once per test module from a forkserver that has imported torch
(``import torch`` costs ~1.5 s per process on these VMs) and runs one job at a time on its first ``n`` processes; every job builds and
destroys its own process group on a fresh loopback port. A job that hangs past its
timeout kills the pool (the next job gets a fresh one), so a failure never hangs pytest.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from elastic.model import Layout, ModelSpec
from elastic.reshard.spec import Kind, TensorSpec, sharding_spec

State = dict[tuple[str, str], torch.Tensor]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# State builders
# --------------------------------------------------------------------------------------------


def global_tensor(t: TensorSpec, kind: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The deterministic global value of ``(t, kind)``: every process rebuilds the same bits."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{t.name}/{kind}".encode()))
    return torch.randn(t.shape, generator=g, dtype=torch.float32).to(dtype)


def local_state(model: ModelSpec, layout: Layout, rank: int, kinds: tuple[Kind, ...], seed: int,
                dtype: torch.dtype = torch.float32) -> State:
    """What ``rank`` holds under ``layout``: slices of the global reference, contiguous."""
    spec = sharding_spec(model, layout, kinds)
    out: State = {}
    cache: dict[tuple[str, str], torch.Tensor] = {}
    for (name, kind), box in spec.rank_pieces(rank).items():
        if (name, kind) not in cache:
            cache[(name, kind)] = global_tensor(spec.tensor(name), kind, seed, dtype)
        out[(name, kind)] = cache[(name, kind)][tuple(slice(a, b) for a, b in box)].clone()
    return out


def bitwise_diff(got: State, want: State) -> list[str]:
    """Human-readable differences; empty when ``got`` equals ``want`` bit for bit."""
    out = []
    if set(got) != set(want):
        out.append(f"keys: missing {sorted(set(want) - set(got))[:3]}, extra {sorted(set(got) - set(want))[:3]}")
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{k}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            out.append(f"{k}: values differ")
    return out


# --------------------------------------------------------------------------------------------
# Worker pool
# --------------------------------------------------------------------------------------------


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "elastic.reshard.execute",
                      "elastic.train.engine", "tests.reshard._mp", "tests.train._mp"]
"""What this pytest process's one forkserver imports, for this pool and tests.train._mp's workers
alike (whichever starts it first sets the list; sympy: autograd imports it on a pipeline stage's
first backward)."""


def _loop(index: int, inbox: Any, outbox: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # 8 processes on 2 cores: no intra-op thread oversubscription
    while True:
        job = inbox.get()
        if job is None:
            return
        job_id, fn, n, args = job
        try:
            outbox.put((job_id, index, True, fn(index, n, *args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            outbox.put((job_id, index, False, traceback.format_exc()))


class Pool:
    """``size`` spawned processes; ``run(fn, n, *args)`` calls ``fn(rank, n, *args)`` on ranks 0..n-1."""

    def __init__(self, size: int):
        self.size = size
        self._procs: list[Any] = []
        self._job = 0

    def _start(self) -> None:
        # forkserver with torch preloaded: one ``import torch`` instead of one per process
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(self.size)]
        self._procs = [ctx.Process(target=_loop, args=(i, self._in[i], self._out), daemon=True)
                       for i in range(self.size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0) -> list[Any]:
        assert n <= self.size, f"job needs {n} processes, the pool has {self.size}"
        if not self._procs or not all(p.is_alive() for p in self._procs[:n]):
            self.close()
            self._start()
        self._job += 1
        for i in range(n):
            self._in[i].put((self._job, fn, n, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < n:
            try:
                job_id, i, ok, value = self._out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"reshard job timed out after {timeout:.0f} s; ranks done: {sorted(results)}; "
                                   f"errors: {errors}") from None
            if job_id != self._job:
                continue
            if ok:
                results[i] = value
            else:
                errors.append(f"rank {i}:\n{value}")
        if errors:
            self.close()  # a failed collective can leave peers wedged: start clean next time
            raise AssertionError("\n".join(errors))
        return [results[i] for i in range(n)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []


# --------------------------------------------------------------------------------------------
# A deliberately naive plan builder (identity rank map, first holder sends). It exists so the
# executor can be tested on hand-shaped plans (several rounds, forced senders) independently
# of the real planner's choices; the real planner is tested against the same executor.
# --------------------------------------------------------------------------------------------


def _intersect(a: tuple, b: tuple) -> tuple | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _subtract(a: tuple, b: tuple) -> list[tuple]:
    """``a`` minus ``b`` as disjoint boxes (``b`` inside ``a``)."""
    out, rest = [], list(a)
    for d, ((a0, a1), (b0, b1)) in enumerate(zip(a, b, strict=True)):
        if a0 < b0:
            out.append(tuple(rest[:d]) + ((a0, b0),) + tuple(rest[d + 1:]))
        if b1 < a1:
            out.append(tuple(rest[:d]) + ((b1, a1),) + tuple(rest[d + 1:]))
        rest[d] = (b0, b1)
    return out


def _shift(box: tuple, origin: tuple) -> tuple:
    return tuple((lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(box, origin, strict=True))


def naive_plan(model: ModelSpec, old: str, old_ranks: dict[str, int], new: str, new_workers: list[str],
               kinds: tuple[Kind, ...], rounds: int = 1, prefer: Callable[[str], int] | None = None) -> Any:
    """Identity rank map; local bytes first, then the first old holder (ordered by ``prefer``)."""
    from elastic.reshard.types import LocalCopy, Message, NewShard, ReshardPlan

    A, B = Layout.parse(old), Layout.parse(new)
    sa, sb = sharding_spec(model, A, kinds), sharding_spec(model, B, kinds)
    held = {w: sa.rank_pieces(r) for w, r in old_ranks.items()}
    holders = sorted(old_ranks, key=prefer or (lambda w: (w not in new_workers, w)))
    new_ranks = {w: i for i, w in enumerate(new_workers)}
    msgs, copies, shards = [], [], []
    for w, r in new_ranks.items():
        for key, box in sb.rank_pieces(r).items():
            shards.append(NewShard(w, key[0], key[1], box))
            todo = [box]
            for h in ([w] if w in held else []) + [x for x in holders if x != w]:
                if key not in held[h]:
                    continue
                hb, nxt = held[h][key], []
                for piece in todo:
                    cut = _intersect(piece, hb)
                    if cut is None:
                        nxt.append(piece)
                        continue
                    src, dst = _shift(cut, hb), _shift(cut, box)
                    if h == w:
                        copies.append(LocalCopy(w, key[0], key[1], cut, src, dst))
                    else:
                        msgs.append(Message(h, w, key[0], key[1], cut, src, dst, len(msgs) % rounds))
                    nxt += _subtract(piece, cut)
                todo = nxt
            assert not todo, f"nobody holds {key} {todo}"
    el = 4
    send: dict[str, int] = {}
    recv: dict[str, int] = {}
    for m in msgs:
        send[m.src] = send.get(m.src, 0) + m.numel * el
        recv[m.dst] = recv.get(m.dst, 0) + m.numel * el
    planned = sum(m.numel for m in msgs) * el
    return ReshardPlan(
        model=model.name, old_layout=str(A), new_layout=str(B), kinds=kinds, bytes_per_element=el,
        old_ranks=dict(old_ranks), new_ranks=new_ranks, leavers=tuple(sorted(set(old_ranks) - set(new_ranks))),
        joiners=tuple(sorted(set(new_ranks) - set(old_ranks))), messages=tuple(msgs), local_copies=tuple(copies),
        new_shards=tuple(shards), rounds=rounds, bytes_total_state=0, bytes_needed=0, bytes_lower_bound=planned,
        bytes_lower_bound_without_remap=planned, bytes_planned=planned, send_bytes=send, recv_bytes=recv,
    )


# --------------------------------------------------------------------------------------------
# The reshard job every process of a case runs
# --------------------------------------------------------------------------------------------


def reshard_job(rank: int, n: int, model: ModelSpec, plan: Any, port: int, seed: int, group: str = "default",
                corrupt: bool = False, pack_below_bytes: int | None = None) -> dict[str, Any]:
    """Member ``rank`` of ``plan.members``: build old state, prepare, execute, check bitwise.

    ``group``: "default" = ``init_process_group`` over all members (pg=None);
    "transient" = :func:`reshard_group` next to a default group of the old members only.
    ``corrupt``: flip one value in every outgoing buffer after it was checksummed.
    """
    import datetime

    import torch.distributed as dist

    from elastic.reshard import execute as ex

    members = list(plan.members)
    assert n == len(members), f"job for {len(members)} members started on {n} processes"
    me = members[rank]
    kinds = tuple(plan.kinds)
    old = local_state(model, Layout.parse(plan.old_layout), plan.old_ranks[me], kinds, seed) \
        if me in plan.old_ranks else {}
    old_ids = {k: id(t) for k, t in old.items()}
    kw = {} if pack_below_bytes is None else {"pack_below_bytes": pack_below_bytes}
    prepared = ex.prepare(plan, me, old, **kw)
    timeout = datetime.timedelta(seconds=30)
    if group == "default":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=timeout)
        pg, ranks = None, {w: i for i, w in enumerate(members)}
    else:
        olds = [w for w in members if w in plan.old_ranks]
        if me in plan.old_ranks:  # the "training" group the old members already share
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 1}", rank=olds.index(me),
                                    world_size=len(olds), timeout=timeout)
        pg, ranks = ex.reshard_group(members, me, "127.0.0.1", port, generation=7, timeout_s=30)
    if corrupt:
        orig = ex._Comm.post

        def post(self: Any, ops: list) -> list:
            for is_send, t, _peer, _tag in ops:
                if is_send and t.numel() and t.dtype == torch.float32:
                    t.view(-1)[0] += 1.0
            return orig(self, ops)

        ex._Comm.post = post  # type: ignore[method-assign]
    try:
        new = ex.execute(prepared, pg, ranks, verify=True)
        error = None
    except ex.ReshardError as e:
        new, error = {}, str(e)
    finally:
        if corrupt:
            ex._Comm.post = orig  # type: ignore[method-assign]
        if dist.is_initialized():
            dist.destroy_process_group()
    want = local_state(model, Layout.parse(plan.new_layout), plan.new_ranks[me], kinds, seed) \
        if me in plan.new_ranks and error is None else {}
    st = prepared.stats
    return {
        "me": me, "error": error, "diff": bitwise_diff(new, want), "old_left": len(old),
        # a leaver's old tensors wait for its exit in prepared.leftover (not freed one by one)
        "leftover_same": sorted(prepared.leftover) == sorted(old_ids)
        and all(id(t) == old_ids[k] for k, t in prepared.leftover.items()),
        "leftover": len(prepared.leftover),
        "kept_objects": sum(1 for k, t in new.items() if old_ids.get(k) == id(t)),
        "new_tensors": len(new), "reused": len(prepared.reused), "recycled": len(prepared.recycled),
        "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received, "bytes_local": st.bytes_local,
        "wire_ops": st.wire_ops, "rounds": st.rounds,
    }


# --------------------------------------------------------------------------------------------
# Mixed precision: one dtype per kind (bf16 param, fp32 master/moments)
# --------------------------------------------------------------------------------------------


def mixed_local_state(model: ModelSpec, layout: Layout, rank: int, kinds: tuple[Kind, ...], seed: int,
                      dtypes: dict[str, torch.dtype]) -> State:
    """:func:`local_state` with each kind in its own dtype (the global values rounded to it)."""
    spec = sharding_spec(model, layout, kinds)
    out: State = {}
    for (name, kind), box in spec.rank_pieces(rank).items():
        full = global_tensor(spec.tensor(name), kind, seed, dtypes[kind])
        out[(name, kind)] = full[tuple(slice(a, b) for a, b in box)].clone()
    return out


def mixed_reshard_job(rank: int, n: int, model: ModelSpec, plan: Any, port: int, seed: int,
                      dtypes: dict[str, torch.dtype], joiner_dtypes: dict[str, torch.dtype] | None = None,
                      corrupt_dtype: torch.dtype | None = None,
                      pack_below_bytes: int | None = None) -> dict[str, Any]:
    """Member ``rank`` of ``plan.members`` in mixed precision: old members let ``prepare`` infer
    the dtypes from their state, joiners pass ``joiner_dtypes`` (default ``dtypes``).

    ``corrupt_dtype``: bump the first element of every outgoing buffer of that dtype after
    it was checksummed. Returns the error (if any), the bitwise diff against the reference
    (dtypes included) and the stats.
    """
    import datetime

    import torch.distributed as dist

    from elastic.reshard import execute as ex

    members = list(plan.members)
    me = members[rank]
    kinds = tuple(plan.kinds)
    old = mixed_local_state(model, Layout.parse(plan.old_layout), plan.old_ranks[me], kinds, seed, dtypes) \
        if me in plan.old_ranks else {}
    kw: dict[str, Any] = {} if me in plan.old_ranks else {"dtypes": joiner_dtypes or dtypes}
    if pack_below_bytes is not None:
        kw["pack_below_bytes"] = pack_below_bytes
    prepared = ex.prepare(plan, me, old, **kw)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=30))
    orig = ex._Comm.post
    if corrupt_dtype is not None:
        def post(self: Any, ops: list) -> list:
            for is_send, t, _peer, _tag in ops:
                if is_send and t.numel() and t.dtype == corrupt_dtype:
                    t.view(-1)[0] += 1.0
            return orig(self, ops)

        ex._Comm.post = post  # type: ignore[method-assign]
    try:
        new = ex.execute(prepared, None, {w: i for i, w in enumerate(members)}, verify=True)
        error = None
    except ex.ReshardError as e:
        new, error = {}, str(e)
    finally:
        ex._Comm.post = orig  # type: ignore[method-assign]
        dist.destroy_process_group()
    want = mixed_local_state(model, Layout.parse(plan.new_layout), plan.new_ranks[me], kinds, seed, dtypes) \
        if me in plan.new_ranks and error is None else {}
    st = prepared.stats
    return {
        "me": me, "error": error, "diff": bitwise_diff(new, want), "old_left": len(old),
        "new_dtypes": sorted({(k[1], str(t.dtype)) for k, t in new.items()}),
        "prepared_dtypes": {k: str(v) for k, v in prepared.dtypes.items()},
        "new_tensors": len(new), "recycled": len(prepared.recycled),
        "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received, "wire_ops": st.wire_ops,
    }
