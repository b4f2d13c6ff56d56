"""Communicators of one layout generation: TP, DP, PP, the tied-embedding group and, with
experts split (``ep > 1``), the expert-parallel and expert-data-parallel groups.

What it is for: given the process group of a layout's members (``pg``; None = the default
group) and a :class:`~elastic.model.Layout`, build one small communicator per parallel axis
this rank belongs to, and wrap the few collectives the trainer needs (all-reduce,
broadcast, all-gather, all-to-all, point-to-point) behind :class:`Comm`, addressed by *index inside the
group* so callers never juggle global ranks.

Why not ``torch.distributed.new_group``: it needs every process of the *default* group to
enter it, and its ``use_local_synchronization`` variant names a group by a process-local
counter, so members with different histories (a worker that idled through a generation)
disagree on the name and hang. Instead the members agree on a fresh nonce (broadcast by
rank 0 of ``pg``) and construct each backend directly on ``pg``'s store under the prefix
``elastic/groups/<nonce>/<axis>/<ranks>``: only the layout's members take part, and a new
generation never reads an earlier one's rendezvous keys.

Layout rank ``r`` is rank ``r`` of ``pg`` (create ``pg`` with ``sort_ranks=False`` when the
order of its members is not ascending).

Must not: touch the default group's membership, allocate model state, or read the clock.
Groups of one rank are *solo* communicators whose collectives return at once, so a 1-GPU
layout needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.model import Layout, SpecError
from elastic.train.abortable import before_group

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""A peer silent this long fails the collective (a dead worker surfaces as an error, not a hang)."""


class StepInterrupted(RuntimeError):
    """The step was given up before its commit because a peer was reported lost.

    Raised by an engine told (``interrupt()``) that the job is recovering from a lost worker:
    computing on would only end at a collective with the dead peer. Nothing of the state has
    changed; the agent treats it like a collective broken by the loss.
    """


class StepGivenUp(RuntimeError):
    """Every rank gave the step up together, before its commit, because a rescale asked for it.

    Raised by an engine with give-up checks on (``TrainEngine.give_up_checks``) at the
    micro-batch where any rank had been told to give ``step`` up (``give_up(step)``): a
    one-float MAX all-reduce over every rank before each micro-batch makes the decision the
    same on all of them, so none waits in a collective for a peer that stopped. Nothing of
    the state has changed (gradients are dropped); the step is redone on the next layout.
    ``seconds``: how long this rank had computed on it; ``carry``: the work of the ``micro``
    micro-batches done, when the engine keeps it (``TrainEngine.keep_given_up``; an
    ``elastic.train.engine.PartialStep``), else None: that work is thrown away.
    """

    def __init__(self, step: int, micro: int, seconds: float, rank: int, carry: object | None = None) -> None:
        super().__init__(f"rank {rank}: step {step} given up at micro-batch {micro} after {seconds:.2f} s "
                         f"(a shrink did not wait for it; its work {'kept' if carry is not None else 'dropped'})")
        self.step, self.micro, self.seconds, self.carry = step, micro, seconds, carry


class Comm:
    """A communicator over ``ranks`` (layout ranks, in group order); this rank is ``ranks[index]``."""

    def __init__(self, ranks: tuple[int, ...], index: int, backend: dist.ProcessGroup | None) -> None:
        if backend is None and len(ranks) != 1:
            raise ValueError(f"communicator over {ranks} needs a backend")
        self.ranks = ranks
        self.index = index
        self.backend = backend

    @classmethod
    def solo(cls, rank: int) -> Comm:
        return cls((rank,), 0, None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ---- collectives (in place; no-ops on a solo communicator) -------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.backend is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            self.backend.allreduce([t], opts).wait()
        return t

    def broadcast(self, t: torch.Tensor, src_index: int) -> torch.Tensor:
        if self.backend is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src_index
            self.backend.broadcast([t], opts).wait()
        return t

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> list[torch.Tensor]:
        """``out[i]`` := member ``i``'s ``t`` (all the same shape)."""
        if self.backend is None:
            out[0].copy_(t)
        else:
            self.backend.allgather([out], [t]).wait()
        return out

    def all_to_all(self, t: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        """Member ``i`` gets the ``send_rows[i]`` rows of ``t`` (dim 0) that follow those for members
        ``< i``; returns the ``sum(recv_rows)`` rows received, member by member. Rows may be 0."""
        if self.backend is None:
            return t.clone()
        out = t.new_empty((sum(recv_rows), *t.shape[1:]))
        self.backend.alltoall_base(out, t.contiguous(), list(recv_rows), list(send_rows),
                                   dist.AllToAllOptions()).wait()
        return out

    def isend(self, t: torch.Tensor, peer_index: int, tag: int = 0) -> dist.Work:
        if self.backend is None:
            raise RuntimeError("a solo communicator has no peer to send to")
        return self.backend.send([t], peer_index, tag)

    def irecv(self, t: torch.Tensor, peer_index: int, tag: int = 0) -> dist.Work:
        if self.backend is None:
            raise RuntimeError("a solo communicator has no peer to receive from")
        return self.backend.recv([t], peer_index, tag)

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.shutdown()
            except Exception:  # noqa: BLE001 - a backend that is already down needs no shutdown
                pass
            self.backend = None

    def __repr__(self) -> str:
        return f"Comm(ranks={self.ranks}, index={self.index})"


@dataclass
class ParallelGroups:
    """The communicators of ``rank`` under ``layout``.

    ``embed`` links the first and last pipeline stage of the same (tp, dp) coordinate when
    embeddings are tied and pp > 1 (Megatron's embedding group); None otherwise.

    Experts (``elastic.reshard.spec``: ``ep`` consecutive dp ranks hold one copy of all experts
    between them, expert rank ``dp_rank % ep``): ``ep`` links those ranks (token dispatch and
    combine), ``edp`` the ``dp / ep`` ranks that hold the same experts (their gradients are
    reduced there). With ``ep == 1``: ``ep`` is solo and ``edp`` is ``dp`` itself.
    """

    layout: Layout
    rank: int
    tp: Comm
    dp: Comm
    pp: Comm
    embed: Comm | None
    # every rank of the layout: the parent group itself (not owned: close() leaves it to its creator)
    world: Comm | None = None
    ep: Comm | None = None
    edp: Comm | None = None

    def close(self) -> None:
        for c in (self.tp, self.dp, self.pp, self.embed, self.ep, self.edp):
            if c is not None:
                c.close()
        if self.world is not None:
            self.world.backend = None  # forget, do not shut down: the parent group is not ours


def expert_dp_group(layout: Layout, rank: int) -> list[int]:
    """Ranks holding the same experts as ``rank``: the dp ranks with the same ``dp_rank % ep``."""
    t, d, p = layout.coords(rank)
    return [layout.rank(t, d % layout.ep + j * layout.ep, p) for j in range(layout.dp // layout.ep)]


def _embed_ranks(layout: Layout, rank: int) -> list[int]:
    t, d, _ = layout.coords(rank)
    return [layout.rank(t, d, 0), layout.rank(t, d, layout.pp - 1)]


def build_groups(
    layout: Layout,
    rank: int,
    pg: dist.ProcessGroup | None = None,
    *,
    tied_embeddings: bool = False,
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: str = "cpu",
) -> ParallelGroups:
    """Build this rank's communicators. Every member of ``pg`` must call it (same layout).

    Steps: 1. check ``pg`` matches the layout; 2. agree on a nonce; 3. create the TP, DP, PP,
    embedding and (``ep > 1``) expert communicators, in that order on every rank (so no two ranks wait on each
    other's groups in opposite orders).
    """
    # 1. a 1-rank layout needs no process group at all
    layout.coords(rank)  # validates the rank
    want_embed = tied_embeddings and layout.pp > 1
    if layout.world_size == 1:
        dp1 = Comm.solo(rank)
        return ParallelGroups(layout, rank, Comm.solo(rank), dp1, Comm.solo(rank), None, Comm.solo(rank),
                              ep=Comm.solo(rank), edp=dp1)
    parent = _check_parent(layout, rank, pg)

    # 2. the nonce keeps this generation's rendezvous keys apart from every earlier one
    box = [int.from_bytes(os.urandom(7), "little")] if dist.get_rank(parent) == 0 else [None]
    dist.broadcast_object_list(box, group_src=0, group=parent)
    prefix = f"elastic/groups/{box[0]:x}"
    store = parent.get_group_store()

    # 3. one communicator per axis, created in a fixed order
    def make(axis: str, ranks: list[int]) -> Comm:
        if len(ranks) == 1:
            return Comm.solo(rank)
        key = f"{prefix}/{axis}/{'-'.join(map(str, ranks))}"
        backend = _new_backend(dist.PrefixStore(key, store), ranks.index(rank), len(ranks), timeout, device)
        return Comm(tuple(ranks), ranks.index(rank), backend)

    tp = make("tp", layout.tp_group(rank))
    dp = make("dp", layout.dp_group(rank))
    pp = make("pp", layout.pp_group(rank))
    _, _, p = layout.coords(rank)
    embed = make("embed", _embed_ranks(layout, rank)) if want_embed and p in (0, layout.pp - 1) else None
    if layout.ep > 1:
        ep, edp = make("ep", layout.ep_group(rank)), make("edp", expert_dp_group(layout, rank))
    else:
        ep, edp = Comm.solo(rank), dp
    # the parent (default) group is gloo: its CPU backend carries the step's commit (a few bytes)
    world = Comm(tuple(range(layout.world_size)), rank, parent._get_backend(torch.device("cpu")))
    return ParallelGroups(layout, rank, tp, dp, pp, embed, world, ep=ep, edp=edp)


def _check_parent(layout: Layout, rank: int, pg: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise SpecError(
            f"layout {layout} has {layout.world_size} ranks but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group (or pass pg=) before building the engine"
        )
    parent = pg if pg is not None else dist.group.WORLD
    assert parent is not None
    if parent.size() != layout.world_size:
        raise SpecError(
            f"process group has {parent.size()} members but layout {layout} needs "
            f"tp*pp*dp={layout.tp}*{layout.pp}*{layout.dp}={layout.world_size}; pass the group of exactly "
            "the new layout's members"
        )
    if dist.get_rank(parent) != rank:
        raise SpecError(
            f"rank={rank} but this process is rank {dist.get_rank(parent)} of its process group; layout rank r "
            "must be group rank r (create the group with sort_ranks=False in layout-rank order)"
        )
    return parent


def _new_backend(store: dist.Store, index: int, size: int, timeout: timedelta, device: str) -> dist.ProcessGroup:
    # a worker's agent may have made this rendezvous abortable (its peers' loss is told, not waited out)
    before_group(store, index, size)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, index, size, opts)
    return dist.ProcessGroupGloo(store, index, size, timeout)
