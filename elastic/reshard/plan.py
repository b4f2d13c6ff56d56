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

This module must not import torch, ray or anything that does I/O, and never reads the clock
(``plan_seconds`` is measured by the caller).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from elastic.model import Layout, ModelSpec, SpecError, check_layout
from elastic.reshard.spec import (
    FP32_KINDS,
    Box,
    Kind,
    ShardingSpec,
    TensorSpec,
    sharding_spec,
    split_range,
)
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


class ReshardError(SpecError):
    """The reshard cannot be planned (raised before any byte moves; the old state stays intact)."""


# --------------------------------------------------------------------------------------------
# Boxes per position (the per-structure core)
# --------------------------------------------------------------------------------------------

Signature = tuple[tuple[int, ...], int | None, int, bool]


def _signature(t: TensorSpec) -> Signature:
    return (t.shape, t.tp_dim, t.tp_unit, t.expert)


@dataclass
class _PosBoxes:
    """The boxes of one (signature, kind) at every position ``q`` of a stage, grouped into cells.

    A *cell* is a distinct non-empty box; the cells of a (signature, kind) partition the tensor
    (TP, EP and ZeRO splits are all balanced partitions), and each is held by every position in
    ``cell_pos[c]`` on every stage that holds the tensor.
    """

    lo: np.ndarray  # [Q, ndim] int64
    hi: np.ndarray  # [Q, ndim] int64 (hi == lo somewhere: empty box)
    cell_of: np.ndarray  # [Q] cell index, -1 for an empty box
    cells: list[Box]
    cell_pos: list[list[int]]


class _LayoutView:
    """One layout's sharding, answered per (signature, kind) and per position, with caches."""

    def __init__(self, spec: ShardingSpec) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.Q = spec.layout.tp * spec.layout.dp  # positions per stage
        self._pos: dict[tuple[Signature, Kind], _PosBoxes] = {}
        self._stages: dict[str, tuple[int, ...]] = {}

    def stages(self, t: TensorSpec) -> tuple[int, ...]:
        s = self._stages.get(t.name)
        if s is None:
            s = self._stages[t.name] = self.spec.pp_ranks_of(t)
        return s

    def pos(self, t: TensorSpec, kind: Kind) -> _PosBoxes:
        key = (_signature(t), "opt" if (kind != "param" and self.layout.zero) else "param")
        pb = self._pos.get(key)  # type: ignore[arg-type]
        if pb is None:
            pb = self._pos[key] = self._build(t, kind)  # type: ignore[index]
        return pb

    def _build(self, t: TensorSpec, kind: Kind) -> _PosBoxes:
        L, spec = self.layout, self.spec
        zero_split = kind != "param" and L.zero == 1
        nd = len(t.shape)
        lo = np.zeros((self.Q, nd), dtype=np.int64)
        hi = np.zeros((self.Q, nd), dtype=np.int64)
        cell_of = np.full(self.Q, -1, dtype=np.int64)
        cells: list[Box] = []
        index: dict[Box, int] = {}
        cell_pos: list[list[int]] = []
        for dp_rank in range(L.dp):
            for tp_rank in range(L.tp):
                q = tp_rank + L.tp * dp_rank
                box = spec.param_box(t, tp_rank, dp_rank)
                if zero_split:
                    idx, count = spec.replica_group(t, dp_rank)
                    a, b = box[0]
                    zlo, zhi = split_range(b - a, count, idx)
                    box = ((a + zlo, a + zhi),) + box[1:]
                lo[q] = [a for a, _ in box]
                hi[q] = [b for _, b in box]
                if any(b <= a for a, b in box):
                    continue
                c = index.get(box)
                if c is None:
                    c = index[box] = len(cells)
                    cells.append(box)
                    cell_pos.append([])
                cell_of[q] = c
                cell_pos[c].append(q)
        return _PosBoxes(lo, hi, cell_of, cells, cell_pos)


@dataclass
class _Pair:
    """Old cell ``i`` intersected with new cell ``j`` of one (signature, kind)."""

    i: int
    region: Box
    src_box: Box  # region in the old cell's local coordinates
    dst_box: Box  # region in the new cell's local coordinates
    numel: int
    row_numel: int  # elements per index of dim 0 (a "row", the unit of splitting)


def _shift(region: Box, origin: Box) -> Box:
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(region, origin, strict=True))


def _pairs(old: _PosBoxes, new: _PosBoxes) -> list[list[_Pair]]:
    """For each new cell, the old cells it overlaps: per-dimension interval arithmetic over the
    cells of one signature (vectorised over old cells), never over ranks or tensors."""
    if not old.cells:
        return [[] for _ in new.cells]
    olo = np.array([[a for a, _ in c] for c in old.cells], dtype=np.int64)
    ohi = np.array([[b for _, b in c] for c in old.cells], dtype=np.int64)
    out: list[list[_Pair]] = []
    for nbox in new.cells:
        nlo = np.array([a for a, _ in nbox], dtype=np.int64)
        nhi = np.array([b for _, b in nbox], dtype=np.int64)
        ilo = np.maximum(olo, nlo)
        ihi = np.minimum(ohi, nhi)
        hits = np.nonzero(np.all(ihi > ilo, axis=1))[0]
        row: list[_Pair] = []
        for i in hits.tolist():
            region = tuple(zip(ilo[i].tolist(), ihi[i].tolist(), strict=True))
            ext = [b - a for a, b in region]
            rown = 1
            for e in ext[1:]:
                rown *= e
            row.append(_Pair(i, region, _shift(region, old.cells[i]), _shift(region, nbox), rown * ext[0], rown))
        out.append(row)
    return out


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
# Step 2: rank remap
# --------------------------------------------------------------------------------------------


def _local_bytes_matrix(tensors: Sequence[TensorSpec], kinds: Sequence[Kind], old: _LayoutView,
                        new: _LayoutView) -> np.ndarray:
    """``W[old_rank, new_rank]`` = elements of state a worker at ``old_rank`` already holds of what
    ``new_rank`` needs. Built as a sum over signatures of (stage-pair counts) x (position overlaps):
    ``W[(po, qo), (pn, qn)] = sum_sig C_sig[po, pn] * OV_sig[qo, qn]``."""
    Po, Pn = old.layout.pp, new.layout.pp
    counts: dict[Signature, np.ndarray] = {}
    rep: dict[Signature, TensorSpec] = {}
    for t in tensors:
        sig = _signature(t)
        c = counts.get(sig)
        if c is None:
            c = counts[sig] = np.zeros((Po, Pn), dtype=np.int64)
            rep[sig] = t
        c[np.ix_(old.stages(t), new.stages(t))] += 1
    sigs = list(counts)
    C = np.stack([counts[sig].reshape(-1) for sig in sigs]).astype(np.float64)  # [S, Po*Pn]
    OV = np.zeros((len(sigs), old.Q, new.Q), dtype=np.float64)
    for n, sig in enumerate(sigs):
        for k in kinds:
            a, b = old.pos(rep[sig], k), new.pos(rep[sig], k)
            ext = np.minimum(a.hi[:, None, :], b.hi[None, :, :]) - np.maximum(a.lo[:, None, :], b.lo[None, :, :])
            OV[n] += np.prod(np.clip(ext, 0, None), axis=2)
    # One matmul over signatures (exact: integers far below 2**53), then (po, pn, qo, qn) -> (po, qo, pn, qn).
    W = (C.T @ OV.reshape(len(sigs), -1)).reshape(Po, Pn, old.Q, new.Q).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(W).reshape(Po * old.Q, Pn * new.Q)


def _remap(
    W: np.ndarray,
    old_ranks: dict[str, int],
    new_layout: Layout,
    new_workers: Sequence[str],
    nodes: dict[str, str] | None,
    remap: bool,
) -> dict[str, int]:
    identity = {w: r for r, w in enumerate(new_workers)}
    if nodes is not None:
        _check_tp_nodes(identity, new_layout, nodes, required=not remap)
    if not remap:
        return identity
    survivors = [w for w in new_workers if w in old_ranks]
    if nodes is not None:
        chosen = _assign_by_node(W, old_ranks, new_layout, new_workers, nodes, identity)
    elif survivors:
        chosen = _assign_free(W, old_ranks, survivors, new_workers, identity)
    else:
        return identity
    # Safety net: never worse than the identity map (the node heuristic is not exact). The identity
    # map keeps every survivor on its rank, so at equal local elements it wins the tie-break.
    def local(m: dict[str, int]) -> int:
        return sum(int(W[old_ranks[w], m[w]]) for w in survivors)
    if local(chosen) <= local(identity) and (nodes is None or _check_tp_nodes(identity, new_layout, nodes, False)):
        return identity
    return chosen


def _assign_free(W: np.ndarray, old_ranks: dict[str, int], survivors: list[str], new_workers: Sequence[str],
                 identity: dict[str, int]) -> dict[str, int]:
    rows = np.array([old_ranks[w] for w in survivors])
    # Among the maps that keep the most elements local, keep the most workers where they are: the
    # optimum is then never worse than the identity map, which is one of the candidates.
    bonus = np.zeros((len(survivors), len(new_workers)))
    bonus[np.arange(len(survivors)), [identity[w] for w in survivors]] = 1
    r, c = _lex_max_assignment(W[rows, :], bonus, len(survivors))
    out = {survivors[i]: int(j) for i, j in zip(r.tolist(), c.tolist(), strict=True)}
    free = sorted(set(range(len(new_workers))) - set(out.values()))
    joiners = [w for w in new_workers if w not in out]
    out.update(zip(joiners, free, strict=True))
    return out


def _lex_max_assignment(W: np.ndarray, bonus: np.ndarray, max_bonus: int,
                        exact_below: int = 2**53) -> tuple[np.ndarray, np.ndarray]:
    """Rows -> distinct columns with the largest total ``W`` and, among those, the largest total
    ``bonus`` (``W`` and ``bonus`` hold non-negative integers, ``rows <= columns``; no assignment
    collects more than ``max_bonus``).

    One solve of ``W * (max_bonus + 1) + bonus`` is lexicographic: a unit of ``W`` outweighs any
    bonus. The solver (scipy's shortest augmenting path) works in float64; with entries of
    magnitude at most ``C``, its row and column potentials move by at most ``C`` per row added,
    so every value it forms is an integer of magnitude below ``(2 * size + 4) * C``: exact while
    ``4 * (size + 1) * C`` stays under ``exact_below``. Past that (GPT-3 175B's fp32 Adam state
    at tp8.pp16 is 4.3e9 elements per rank: past ~700 survivors), ``W`` alone is solved as well
    (no scale factor: exact far longer) and the scaled solution is kept only if its totals,
    summed as Python integers, are at least as high: the elements kept local stay the most, the
    bonus is then best effort.
    """
    n = max(W.shape)
    top = float(W.max()) if W.size else 0.0
    if max_bonus == 0 or not bonus.any():
        return linear_sum_assignment(W, maximize=True)
    scale = max_bonus + 1
    lex = linear_sum_assignment(W * scale + bonus, maximize=True)
    if 4 * (n + 1) * (top * scale + max_bonus) < exact_below:
        return lex
    plain = linear_sum_assignment(W, maximize=True)

    def total(m: np.ndarray, rc: tuple[np.ndarray, np.ndarray]) -> int:
        return sum(int(x) for x in m[rc])

    return lex if (total(W, lex), total(bonus, lex)) >= (total(W, plain), total(bonus, plain)) else plain


def _check_tp_nodes(ranks: dict[str, int], layout: Layout, nodes: dict[str, str], required: bool) -> bool:
    by_group: dict[int, set[str]] = {}
    for w, r in ranks.items():
        by_group.setdefault(r // layout.tp, set()).add(nodes[w])
    for g, ns in by_group.items():
        if len(ns) > 1:
            if required:
                raise ReshardError(
                    f"with remap off, TP group {g} of {layout} (ranks {g * layout.tp}..{g * layout.tp + layout.tp - 1}) "
                    f"spans nodes {', '.join(sorted(ns))}; a TP group never spans nodes: reorder new_workers or allow remap"
                )
            return False
    return True


def _assign_by_node(W: np.ndarray, old_ranks: dict[str, int], layout: Layout, new_workers: Sequence[str],
                    nodes: dict[str, str], identity: dict[str, int]) -> dict[str, int]:
    """Assign whole TP groups: each node's members are cut into bundles of ``tp`` workers (survivors
    in old-rank order, then joiners), and bundles are assigned to new TP groups by max weight."""
    tp = layout.tp
    per_node: dict[str, list[str]] = {}
    for w in new_workers:
        per_node.setdefault(nodes[w], []).append(w)
    bundles: list[list[str]] = []
    for node, ws in per_node.items():
        if len(ws) % tp:
            raise ReshardError(
                f"node {node} has {len(ws)} workers in the new layout {layout}, not a multiple of tp={tp}; "
                "a TP group never spans nodes: add or remove workers on that node"
            )
        surv = sorted((w for w in ws if w in old_ranks), key=lambda w: old_ranks[w])
        ws = surv + [w for w in ws if w not in old_ranks]
        bundles += [ws[i:i + tp] for i in range(0, len(ws), tp)]
    n_groups = layout.world_size // tp
    B = np.zeros((len(bundles), n_groups), dtype=np.float64)
    bonus = np.zeros((len(bundles), n_groups), dtype=np.float64)
    n_surv = 0
    for b, members in enumerate(bundles):
        for j, w in enumerate(members):
            if w in old_ranks:
                n_surv += 1
                # new rank of TP slot j in group g is g*tp + j
                B[b] += W[old_ranks[w], j::tp][:n_groups]
                if identity[w] % tp == j:
                    bonus[b, identity[w] // tp] += 1
    # Staying on one's rank only breaks ties between bundle maps that keep as many elements local.
    r, c = _lex_max_assignment(B, bonus, n_surv)
    out: dict[str, int] = {}
    for b, g in zip(r.tolist(), c.tolist(), strict=True):
        for j, w in enumerate(bundles[b]):
            out[w] = g * tp + j
    return out


# --------------------------------------------------------------------------------------------
# Step 3: diff (local copies, demands, new shards)
# --------------------------------------------------------------------------------------------


@dataclass
class _Demand:
    """One region of one (tensor, kind) that several receivers need, and who can send it."""

    numel: int
    row_numel: int
    tensor: str
    kind: Kind
    region: Box
    src_box: Box
    dst_box: Box
    holders: list[int]  # worker indices
    receivers: list[int]


@dataclass
class _Diff:
    local_copies: list[tuple] = field(default_factory=list)  # LocalCopy fields, built lazily
    new_shards: list[tuple] = field(default_factory=list)  # NewShard fields, built lazily
    demands: list[_Demand] = field(default_factory=list)  # pieces with a choice of sender
    fixed: list[tuple] = field(default_factory=list)  # raw messages of pieces with one holder
    needed: int = 0
    local: int = 0


def _diff(
    tensors: Sequence[TensorSpec],
    kinds: Sequence[Kind],
    old: _LayoutView,
    new: _LayoutView,
    old_ranks: dict[str, int],
    new_ranks: dict[str, int],
    widx: dict[str, int],
) -> _Diff:
    out = _Diff()
    new_of_rank = [""] * new.layout.world_size
    for w, r in new_ranks.items():
        new_of_rank[r] = w
    old_of_rank: list[str | None] = [None] * old.layout.world_size
    for w, r in old_ranks.items():
        old_of_rank[r] = w
    # old (stage, position) of every new member, (-1, -1) for a joiner
    old_pq = {w: divmod(old_ranks[w], old.Q) if w in old_ranks else (-1, -1) for w in new_ranks}
    pair_cache: dict[tuple[int, int], list[list[_Pair]]] = {}
    holder_cache: dict[tuple[tuple[int, ...], int, int], list[int]] = {}
    templates: dict[tuple, _Template] = {}
    for t in tensors:
        po_set, pn = old.stages(t), new.stages(t)
        name = t.name
        for k in kinds:
            ob, nb = old.pos(t, k), new.pos(t, k)
            # Tensors of one signature on the same (old stages, new stages) diff identically up to
            # their name: GPT-3's 96 layers x 16 tensors x 3 kinds need ~100 distinct diffs.
            tkey = (id(ob), id(nb), po_set, pn)
            tp_ = templates.get(tkey)
            if tp_ is None:
                pkey = (id(ob), id(nb))
                pairs = pair_cache.get(pkey)
                if pairs is None:
                    pairs = pair_cache[pkey] = _pairs(ob, nb)
                tp_ = templates[tkey] = _template(ob, nb, pairs, po_set, pn, old, new, new_of_rank, old_of_rank,
                                                  old_pq, widx, holder_cache)
            out.needed += tp_.needed
            out.local += tp_.local
            out.new_shards += [(w, name, k, box) for w, box in tp_.shards]
            out.local_copies += [(w, name, k, r, sb, db) for w, r, sb, db in tp_.copies]
            out.fixed += [(h, r, name, k, reg, sb, db, n, row) for h, r, reg, sb, db, n, row in tp_.fixed]
            for pr, holders, receivers in tp_.demands:
                if not holders:
                    raise _missing_state(t, k, pr.region, po_set, old.layout)
                out.demands.append(_Demand(pr.numel, pr.row_numel, name, k, pr.region, pr.src_box, pr.dst_box,
                                           holders, receivers))
    return out


@dataclass
class _Template:
    """The diff of one (signature, kind class, old stages, new stages), without the tensor name."""

    needed: int = 0
    local: int = 0
    shards: list[tuple[str, Box]] = field(default_factory=list)
    copies: list[tuple[str, Box, Box, Box]] = field(default_factory=list)
    demands: list[tuple[_Pair, list[int], list[int]]] = field(default_factory=list)
    fixed: list[tuple[int, int, Box, Box, Box, int, int]] = field(default_factory=list)


def _template(ob: _PosBoxes, nb: _PosBoxes, pairs: list[list[_Pair]], po_set: tuple[int, ...], pn: tuple[int, ...],
              old: _LayoutView, new: _LayoutView, new_of_rank: list[str], old_of_rank: list[str | None],
              old_pq: dict[str, tuple[int, int]], widx: dict[str, int],
              holder_cache: dict[tuple[tuple[int, ...], int, int], list[int]]) -> _Template:
    out = _Template()
    for j, nbox in enumerate(nb.cells):
        needers = [new_of_rank[p * new.Q + q] for p in pn for q in nb.cell_pos[j]]
        out.needed += sum(pr.numel for pr in pairs[j]) * len(needers)
        out.shards += [(w, nbox) for w in needers]
        # which old cell of this tensor each needer already holds (-1: none)
        held = []
        for w in needers:
            p, q = old_pq[w]
            held.append(int(ob.cell_of[q]) if p in po_set else -1)
        for pr in pairs[j]:
            receivers = [widx[w] for w, i0 in zip(needers, held, strict=True) if i0 != pr.i]
            for w, i0 in zip(needers, held, strict=True):
                if i0 == pr.i:
                    out.local += pr.numel
                    out.copies.append((w, pr.region, pr.src_box, pr.dst_box))
            if not receivers:
                continue
            hk = (po_set, id(ob), pr.i)
            holders = holder_cache.get(hk)
            if holders is None:
                holders = holder_cache[hk] = [
                    widx[owner] for p in po_set for q in ob.cell_pos[pr.i]
                    if (owner := old_of_rank[p * old.Q + q]) is not None
                ]
            if len(holders) == 1:  # one holder (a ZeRO shard): no choice to make
                h = holders[0]
                out.fixed += [(h, r, pr.region, pr.src_box, pr.dst_box, pr.numel, pr.row_numel) for r in receivers]
            else:
                out.demands.append((pr, holders, receivers))
    return out


def _missing_state(t: TensorSpec, kind: Kind, region: Box, stages: tuple[int, ...], layout: Layout) -> ReshardError:
    return ReshardError(
        f"no live old worker holds {t.name} ({kind}) region {list(region)}: every replica of it under {layout} "
        f"(pipeline stage {'/'.join(map(str, stages))}) is gone; the new layout cannot be built from the "
        "survivors (restore that stage from a checkpoint)"
    )


# --------------------------------------------------------------------------------------------
# Step 4: senders
# --------------------------------------------------------------------------------------------

_Raw = tuple[int, int, str, str, Box, Box, Box, int, int]  # src, dst, tensor, kind, region, sbox, dbox, numel, row


def _choose_senders(demands: list[_Demand], fixed: list[_Raw], n_workers: int, leaver: list[bool],
                    split_min_numel: int) -> list[_Raw]:
    """Largest pieces first onto the least-loaded holder. A piece is split along dim 0 across
    replicas (water-filling, McNaughton's wrap-around: at most one extra cut per holder) only when
    it is big: at least ``split_min_numel`` elements and more than 1/16 of what each replica of its
    holder group sends in total, so whole-piece placement could leave a replica >6% over the
    others. (GPT-3 175B tp8.pp16.dp16 -> tp8.pp8.dp24: a 302 MB fc1 slice against ~25 GB per
    sender is sent whole.) Leavers send only when that lowers the makespan."""
    load = [0] * n_workers
    for m in fixed:  # forced sends count first
        load[m[0]] += m[7]
    makespan = max(load, default=0)
    out: list[_Raw] = fixed
    group_total: dict[int, int] = {}
    heaps: dict[int, tuple[list, list]] = {}
    for d in demands:
        group_total[id(d.holders)] = group_total.get(id(d.holders), 0) + d.numel * len(d.receivers)
    demands.sort(key=lambda d: -d.numel)
    for d in demands:
        if len(d.holders) == 1:
            h = d.holders[0]
            out += [(h, r, d.tensor, d.kind, d.region, d.src_box, d.dst_box, d.numel, d.row_numel)
                    for r in d.receivers]
            load[h] += d.numel * len(d.receivers)
            makespan = max(makespan, load[h])
        elif (d.numel < split_min_numel or d.numel == d.row_numel
              or 16 * len(d.holders) * d.numel < group_total[id(d.holders)]):
            makespan = _whole_pieces(d, load, leaver, makespan, out, heaps)
        else:
            makespan = _split_pieces(d, load, leaver, makespan, out)
    return out


def _whole_pieces(d: _Demand, load: list[int], leaver: list[bool], makespan: int, out: list[_Raw],
                  heaps: dict[int, tuple[list, list]]) -> int:
    s = d.numel
    hp = heaps.get(id(d.holders))
    if hp is None:
        hp = heaps[id(d.holders)] = (
            [(load[h], h) for h in d.holders if not leaver[h]], [(load[h], h) for h in d.holders if leaver[h]])
        heapq.heapify(hp[0])
        heapq.heapify(hp[1])
    surv, leav = hp
    for r in d.receivers:
        heap = surv if surv else leav
        h = _least_loaded(heap, load)
        if surv and leav and load[h] + s > makespan:
            # a survivor would raise the makespan: a leaver may do better
            v = _least_loaded(leav, load)
            if load[v] < load[h]:
                h, heap = v, leav
        load[h] += s
        heapq.heapreplace(heap, (load[h], h))
        if load[h] > makespan:
            makespan = load[h]
        out.append((h, r, d.tensor, d.kind, d.region, d.src_box, d.dst_box, s, d.row_numel))
    return makespan


def _least_loaded(heap: list[tuple[int, int]], load: list[int]) -> int:
    """The top of a heap of (load, worker) whose entries may be stale: loads only grow (other
    holder groups share workers), so a stale top is refreshed and pushed down until it is true."""
    while True:
        lv, h = heap[0]
        if lv == load[h]:
            return h
        heapq.heapreplace(heap, (load[h], h))


def _split_pieces(d: _Demand, load: list[int], leaver: list[bool], makespan: int, out: list[_Raw]) -> int:
    rows = d.numel // d.row_numel
    total_rows = rows * len(d.receivers)
    rb = d.row_numel
    # Phase A: survivors below the current makespan absorb rows for free (no makespan increase).
    cap: dict[int, int] = {}
    left = total_rows
    for h in sorted((h for h in d.holders if not leaver[h]), key=lambda h: load[h]):
        room = min(left, (makespan - load[h]) // rb)
        if room > 0:
            cap[h] = room
            left -= room
    # Phase B: water-fill the rest over every holder (survivors and leavers).
    if left:
        cur = {h: load[h] + cap.get(h, 0) * rb for h in d.holders}
        for h, extra in _water_fill(cur, left, rb, leaver).items():
            cap[h] = cap.get(h, 0) + extra
    # McNaughton wrap: stream receivers' rows across holders in order of capacity given.
    holders = [h for h in sorted(cap, key=lambda h: (leaver[h], load[h])) if cap[h] > 0]
    hi, used = 0, 0
    for r in d.receivers:
        start = 0
        while start < rows:
            h = holders[hi]
            n = min(rows - start, cap[h] - used)
            out.append(_cut(h, r, d, start, start + n))
            load[h] += n * rb
            makespan = max(makespan, load[h])
            start += n
            used += n
            if used == cap[h]:
                hi, used = hi + 1, 0
    return makespan


def _water_fill(cur: dict[int, int], rows: int, rb: int, leaver: list[bool]) -> dict[int, int]:
    """Give ``rows`` rows of ``rb`` elements to the least-loaded holders so their loads rise to a
    common level (ties go to survivors)."""
    order = sorted(cur, key=lambda h: (cur[h], leaver[h]))
    total = rows * rb
    level, n = 0.0, 0
    acc = 0
    for n_ in range(1, len(order) + 1):
        acc += cur[order[n_ - 1]]
        lvl = (total + acc) / n_
        if n_ == len(order) or lvl <= cur[order[n_]]:
            level, n = lvl, n_
            break
    give = {h: int((level - cur[h]) // rb) for h in order[:n]}
    short = rows - sum(give.values())
    for h in order[:n]:  # rounding leftovers, one row each, least loaded first
        if short <= 0:
            break
        give[h] += 1
        short -= 1
    give[order[0]] += max(0, short)
    return give


def _cut(src: int, dst: int, d: _Demand, a: int, b: int) -> _Raw:
    """Rows ``[a, b)`` of the piece (along dim 0)."""
    (r0, r1), rest = d.region[0], d.region[1:]
    if a == 0 and b == r1 - r0:
        return (src, dst, d.tensor, d.kind, d.region, d.src_box, d.dst_box, d.numel, d.row_numel)
    s0, d0 = d.src_box[0][0], d.dst_box[0][0]
    return (src, dst, d.tensor, d.kind, ((r0 + a, r0 + b),) + rest, ((s0 + a, s0 + b),) + d.src_box[1:],
            ((d0 + a, d0 + b),) + d.dst_box[1:], (b - a) * d.row_numel, d.row_numel)


# --------------------------------------------------------------------------------------------
# Step 5: rounds
# --------------------------------------------------------------------------------------------


def _split_to_cap(raw: list[_Raw], cap_numel: int) -> list[_Raw]:
    out: list[_Raw] = []
    for m in raw:
        numel, rown = m[7], m[8]
        if numel <= cap_numel:
            out.append(m)
            continue
        rows_per = cap_numel // rown
        (r0, r1), (s0, _), (d0, _) = m[4][0], m[5][0], m[6][0]
        for a in range(0, r1 - r0, rows_per):
            b = min(a + rows_per, r1 - r0)
            out.append((m[0], m[1], m[2], m[3], ((r0 + a, r0 + b),) + m[4][1:], ((s0 + a, s0 + b),) + m[5][1:],
                        ((d0 + a, d0 + b),) + m[6][1:], (b - a) * rown, rown))
    return out


def _pack_rounds(raw: list[_Raw], n_workers: int, cap_numel: int | None) -> list[int]:
    """First-fit decreasing: each message goes to the first round where neither its sender nor
    its receiver would exceed the cap (a worker's send + receive volume in one round)."""
    if cap_numel is None:
        return [0] * len(raw)
    used: list[list[int]] = [[] for _ in range(n_workers)]
    rounds = [0] * len(raw)
    for idx in sorted(range(len(raw)), key=lambda i: -raw[i][7]):
        s, d, n = raw[idx][0], raw[idx][1], raw[idx][7]
        us, ud = used[s], used[d]
        r = 0
        while True:
            a = us[r] if r < len(us) else 0
            b = ud[r] if r < len(ud) else 0
            if a + n <= cap_numel and b + n <= cap_numel:
                break
            r += 1
        for u in (us, ud):
            while len(u) <= r:
                u.append(0)
            u[r] += n
        rounds[idx] = r
    return rounds


def _check_cap(demands: list[_Demand], fixed: list[_Raw], cap_numel: int, bpe: int) -> None:
    rows = [(d.row_numel, d.tensor, d.kind) for d in demands] + [(m[8], m[2], m[3]) for m in fixed]
    if not rows:
        return
    row, tensor, kind = max(rows)
    if row > cap_numel:
        raise ReshardError(
            f"staging cap {cap_numel * bpe} bytes is smaller than one row of {tensor} ({kind}): "
            f"{row} elements x {bpe} bytes = {row * bpe} bytes, the smallest piece that can "
            f"move; raise the staging cap to at least {row * bpe} bytes"
        )


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

