"""The reshard planner: which bytes move from which worker to which, to go from layout A to B. Pure.

Input: the model, the old layout with the live old workers (``worker -> old rank``), the new
layout with its members (survivors + joiners). Output: a :class:`ReshardPlan` (see
``elastic/reshard/types.py``) that the executor runs without knowing anything about layouts.

Steps (:func:`plan_reshard`):

1. validate the input (layouts the model can take, world sizes, duplicate ids, node limits);
2. **rank remap**: give surviving workers the new ranks whose state they already hold most of
   (max-weight bipartite assignment; staying on one's rank in ``new_workers`` only breaks ties
   between maps that keep as many elements local; with ``nodes``, at TP-group granularity per
   node so that no TP group spans nodes);
3. **diff**: for each ``(tensor, kind)`` intersect the new boxes with the old ones. Everything
   here works per *sharding signature* (shape, tp dim, tp unit, expert) and per *position*
   ``q = tp_rank + tp * dp_rank`` inside a pipeline stage: the box a rank holds depends only on
   ``q`` and whether its stage holds the tensor, so the boxes of one signature are computed once
   and reused by every layer and every stage (GPT-3 175B at tp8.pp16.dp16 has 2,048 ranks but 16
   signatures x 128 positions);
4. **senders**: DP replicas hold identical boxes; pick for each piece the holder that keeps the
   largest per-worker send volume lowest (largest pieces first, big pieces split along dim 0
   across replicas, leavers only when that lowers the makespan);
5. **rounds**: split pieces larger than the staging cap along dim 0 and pack messages into
   rounds so no worker sends + receives more than the cap in one round.

Step 1 and the orchestration are here; the per-structure core (boxes per position) is in
``plan_boxes.py``, step 2 in ``plan_remap.py``, step 3 in ``plan_diff.py``, steps 4 and 5 in
``plan_senders.py``.

This module must not import torch, ray or anything that does I/O, and never reads the clock
(``plan_seconds`` is measured by the caller).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from elastic.model import Layout, ModelSpec, SpecError, check_layout
from elastic.reshard.errors import ReshardError
from elastic.reshard.plan_boxes import _LayoutView
from elastic.reshard.plan_diff import _Demand as _Demand  # re-exported: plan_regions.py imports it from here
from elastic.reshard.plan_diff import _diff
from elastic.reshard.plan_remap import _lex_max_assignment as _lex_max_assignment  # re-exported, as _Demand
from elastic.reshard.plan_remap import _local_bytes_matrix, _remap
from elastic.reshard.plan_senders import _check_cap, _choose_senders, _pack_rounds, _split_to_cap
from elastic.reshard.spec import FP32_KINDS, Kind, TensorSpec, sharding_spec
from elastic.reshard.types import LocalCopy, Message, NewShard, ReshardPlan

__all__ = [
    "ReshardError",
    "plan_reshard",
    "estimate_reshard_bytes",
    "example_plans",
    "LazyTuple",
    "DEFAULT_SPLIT_MIN_BYTES",
]

DEFAULT_SPLIT_MIN_BYTES = 4 << 20
"""Pieces smaller than this are sent whole by one replica; bigger ones may be split along dim 0
across replicas to balance send volume (4 MiB: below it, per-message overhead beats balance)."""


class LazyTuple(Sequence):
    """An immutable sequence whose items are built on first use (then kept).

    A GPT-3 175B reshard has ~10^6 messages, local copies and new shards; building them as
    dataclass instances costs more than planning them, and a worker's executor only needs its
    own. The plan therefore keeps compact tuples and builds the objects once, on first access.
    Compares equal to a tuple with the same items.
    """

    __slots__ = ("_n", "_build", "_items")

    def __init__(self, n: int, build: Callable[[], Iterable]) -> None:
        self._n = n
        self._build: Callable[[], Iterable] | None = build
        self._items: tuple | None = None

    def _get(self) -> tuple:
        if self._items is None:
            assert self._build is not None
            self._items = tuple(self._build())
            self._build = None
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self) -> Iterator:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTuple):
            other = other._get()
        return isinstance(other, tuple) and self._get() == other

    def __hash__(self) -> int:
        return hash(self._get())

    def __reduce__(self) -> tuple:
        # Pickles (to another process, a Ray actor) as the plain tuple it stands for.
        return (tuple, (self._get(),))

    def __repr__(self) -> str:
        return f"LazyTuple({self._n} items{', built' if self._items is not None else ''})"


# --------------------------------------------------------------------------------------------
# Step 1: validation
# --------------------------------------------------------------------------------------------


def _validate(
    model: ModelSpec,
    old_layout: Layout,
    old_ranks: dict[str, int],
    new_layout: Layout,
    new_workers: Sequence[str],
    nodes: dict[str, str] | None,
    staging_cap_bytes: int | None,
) -> None:
    for which, lay in (("old", old_layout), ("new", new_layout)):
        try:
            check_layout(model, lay)
        except SpecError as e:
            raise ReshardError(f"{which} layout: {e}") from None
    if len(new_workers) != new_layout.world_size:
        raise ReshardError(
            f"new_workers has {len(new_workers)} workers but layout {new_layout} needs world size "
            f"{new_layout.tp}*{new_layout.pp}*{new_layout.dp}={new_layout.world_size}; add joiners or drop workers"
        )
    seen: set[str] = set()
    dups = sorted({w for w in new_workers if w in seen or seen.add(w)})  # type: ignore[func-returns-value]
    if dups:
        raise ReshardError(f"new_workers lists {', '.join(dups[:5])} more than once; worker ids must be unique")
    by_rank: dict[int, str] = {}
    for w, r in old_ranks.items():
        if not (isinstance(r, int) and 0 <= r < old_layout.world_size):
            raise ReshardError(f"old_ranks[{w!r}]={r!r} is outside old layout {old_layout} (ranks 0..{old_layout.world_size - 1})")
        if r in by_rank:
            raise ReshardError(f"old_ranks gives rank {r} to both {by_rank[r]!r} and {w!r}; each old rank has one worker")
        by_rank[r] = w
    if staging_cap_bytes is not None and staging_cap_bytes <= 0:
        raise ReshardError(f"staging_cap_bytes={staging_cap_bytes} must be positive (or None for no cap)")
    if nodes is not None:
        missing = [w for w in new_workers if w not in nodes]
        if missing:
            raise ReshardError(f"nodes has no entry for new worker(s) {', '.join(missing[:5])}; give every new member a node")


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def plan_reshard(
    model: ModelSpec,
    old_layout: Layout,
    old_ranks: dict[str, int],
    new_layout: Layout,
    new_workers: Sequence[str],
    *,
    kinds: tuple[Kind, ...] = FP32_KINDS,
    bytes_per_element: int = 4,
    nodes: dict[str, str] | None = None,
    staging_cap_bytes: int | None = None,
    remap: bool = True,
    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES,
) -> ReshardPlan:
    """Plan moving ``model``'s state from ``old_layout`` to ``new_layout``.

    ``old_ranks`` maps each *live* old worker to its old rank (a rank missing from it, e.g. a
    failed worker, holds nothing); ``new_workers`` are the new layout's members, survivors and
    joiners (``len == new_layout.world_size``). Old workers not in ``new_workers`` are leavers:
    they send what only they hold, then exit. ``nodes`` (worker -> node id, joiners included)
    keeps every new TP group inside one node. ``staging_cap_bytes`` bounds what one worker
    sends + receives per round. Raises :class:`ReshardError` when the plan is impossible.
    """
    # Millions of small objects: the cyclic GC would rescan them again and again (it made GPT-3
    # 175B planning 5x slower); they hold no cycles, so pause it while planning.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(model, old_layout, old_ranks, new_layout, new_workers, kinds, bytes_per_element, nodes,
                     staging_cap_bytes, remap, split_min_bytes)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(
    model: ModelSpec,
    old_layout: Layout,
    old_ranks: dict[str, int],
    new_layout: Layout,
    new_workers: Sequence[str],
    kinds: tuple[Kind, ...],
    bytes_per_element: int,
    nodes: dict[str, str] | None,
    staging_cap_bytes: int | None,
    remap: bool,
    split_min_bytes: int,
) -> ReshardPlan:
    # 1. validate
    _validate(model, old_layout, old_ranks, new_layout, new_workers, nodes, staging_cap_bytes)
    kinds = tuple(kinds)
    old = _LayoutView(sharding_spec(model, old_layout, kinds))
    new = _LayoutView(sharding_spec(model, new_layout, kinds))
    tensors = old.spec.tensors
    bpe = bytes_per_element
    cap_numel = None if staging_cap_bytes is None else staging_cap_bytes // bpe

    # 2. rank remap (W: elements each old rank already holds of each new rank's state)
    W = _local_bytes_matrix(tensors, kinds, old, new)
    new_ranks = _remap(W, old_ranks, new_layout, new_workers, nodes, remap)
    local_identity = sum(int(W[old_ranks[w], r]) for r, w in enumerate(new_workers) if w in old_ranks)

    # 3. diff
    workers = sorted(set(old_ranks) | set(new_workers))
    widx = {w: i for i, w in enumerate(workers)}
    diff = _diff(tensors, kinds, old, new, old_ranks, new_ranks, widx)
    if cap_numel is not None:
        _check_cap(diff.demands, diff.fixed, cap_numel, bpe)

    # 4. senders
    new_set = set(new_workers)
    leaver = [w not in new_set for w in workers]
    raw = _choose_senders(diff.demands, diff.fixed, len(workers), leaver, max(1, split_min_bytes // bpe))

    # 5. rounds
    if cap_numel is not None:
        raw = _split_to_cap(raw, cap_numel)
    rounds = _pack_rounds(raw, len(workers), cap_numel)
    order = sorted(range(len(raw)), key=rounds.__getitem__) if cap_numel is not None else range(len(raw))
    messages = LazyTuple(len(raw), lambda: (
        Message(workers[m[0]], workers[m[1]], m[2], m[3], m[4], m[5], m[6], rounds[i])  # type: ignore[arg-type]
        for i in order for m in (raw[i],)))
    send = dict.fromkeys(workers, 0)
    recv = dict.fromkeys(workers, 0)
    planned = 0
    for m in raw:
        b = m[7] * bpe
        send[workers[m[0]]] += b
        recv[workers[m[1]]] += b
        planned += b

    state_numel = sum(t.numel for t in tensors) * len(kinds)
    return ReshardPlan(
        model=model.name,
        old_layout=str(old_layout),
        new_layout=str(new_layout),
        kinds=kinds,
        bytes_per_element=bpe,
        old_ranks=dict(old_ranks),
        new_ranks=dict(sorted(new_ranks.items(), key=lambda x: x[1])),
        leavers=tuple(w for w in sorted(old_ranks) if w not in new_set),
        joiners=tuple(w for w in new_workers if w not in old_ranks),
        messages=messages,  # type: ignore[arg-type]
        local_copies=LazyTuple(  # type: ignore[arg-type]
            len(diff.local_copies), lambda: (LocalCopy(*c) for c in diff.local_copies)),
        new_shards=LazyTuple(  # type: ignore[arg-type]
            len(diff.new_shards), lambda: (NewShard(*c) for c in diff.new_shards)),
        rounds=(max(rounds) + 1) if rounds else 0,
        bytes_total_state=state_numel * bpe,
        bytes_needed=diff.needed * bpe,
        bytes_lower_bound=(diff.needed - diff.local) * bpe,
        bytes_lower_bound_without_remap=(diff.needed - local_identity) * bpe,
        bytes_planned=planned,
        send_bytes=send,
        recv_bytes=recv,
        staging_cap_bytes=staging_cap_bytes,
    )


# --------------------------------------------------------------------------------------------
# Cheap estimate for the simulator
# --------------------------------------------------------------------------------------------


def estimate_reshard_bytes(
    model: ModelSpec,
    old_layout: Layout,
    new_layout: Layout,
    *,
    kinds: tuple[Kind, ...] = FP32_KINDS,
    bytes_per_element: int = 4,
    survivors: int | None = None,
) -> int:
    """Bytes a reshard must move (the lower bound under the best rank map), without building
    messages: the rank remap on the structural matrix only. Old workers are ranks ``0..n-1`` and
    the first ``survivors`` of them (default: as many as the new layout uses) stay. Runs in well
    under a second even for GPT-3 175B at 2,048 ranks."""
    check_layout(model, old_layout)
    check_layout(model, new_layout)
    kinds = tuple(kinds)
    old = _LayoutView(sharding_spec(model, old_layout, kinds))
    new = _LayoutView(sharding_spec(model, new_layout, kinds))
    W = _local_bytes_matrix(old.spec.tensors, kinds, old, new)
    n_old, n_new = old_layout.world_size, new_layout.world_size
    s = min(n_old, n_new) if survivors is None else min(survivors, n_old, n_new)
    needed = _needed_numel(old.spec.tensors, kinds, new)
    if s == 0:
        return needed * bytes_per_element
    r, c = linear_sum_assignment(W[:s, :], maximize=True)
    return int(needed - W[r, c].sum()) * bytes_per_element


def _needed_numel(tensors: Sequence[TensorSpec], kinds: Sequence[Kind], view: _LayoutView) -> int:
    total = 0
    for t in tensors:
        n_stages = len(view.stages(t))
        for k in kinds:
            pb = view.pos(t, k)
            total += int(np.prod(np.clip(pb.hi - pb.lo, 0, None), axis=1).sum()) * n_stages
    return total


# --------------------------------------------------------------------------------------------
# Tiny examples (for the executor's tests and docs)
# --------------------------------------------------------------------------------------------


def example_plans(model: ModelSpec | None = None) -> dict[str, ReshardPlan]:
    """A few small plans over the ``tiny`` preset: the reshards the gloo tests run.

    * ``tp2pp2dp1->tp1pp2dp2``: same 4 workers, TP folded into DP;
    * ``dp4->tp2dp1 (2 leave)``: ``w2``/``w3`` leave after sending;
    * ``tp2pp2dp2z1->tp2pp1dp3z1 (+1 joiner)``: 8 workers, ZeRO-1; ``w5..w7`` leave, ``w8`` joins.
    """
    from elastic.model import MODEL_PRESETS

    m = model or MODEL_PRESETS["tiny"]
    P = Layout.parse
    ws = [f"w{i}" for i in range(8)]
    return {
        "tp2.pp2.dp1->tp1.pp2.dp2": plan_reshard(m, P("tp2.pp2.dp1"), {w: i for i, w in enumerate(ws[:4])},
                                                 P("tp1.pp2.dp2"), ws[:4]),
        "tp1.pp1.dp4->tp2.pp1.dp1": plan_reshard(m, P("tp1.pp1.dp4"), {w: i for i, w in enumerate(ws[:4])},
                                                 P("tp2.pp1.dp1"), ws[:2]),
        "tp2.pp2.dp2.z1->tp2.pp1.dp3.z1": plan_reshard(m, P("tp2.pp2.dp2.z1"), {w: i for i, w in enumerate(ws)},
                                                       P("tp2.pp1.dp3.z1"), ws[:5] + ["w8"]),
    }
