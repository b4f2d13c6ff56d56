"""The per-structure core of the reshard planner: the boxes one layout gives each position. Pure.

Everything here works per *sharding signature* (shape, tp dim, tp unit, expert) and per *position*
``q = tp_rank + tp * dp_rank`` inside a pipeline stage (see ``plan.py``, step 3): a
:class:`_LayoutView` answers, per (signature, kind), the box every position holds, grouped into
*cells*; :func:`_pairs` intersects the cells of an old and a new layout.

This module must not import torch, ray or anything that does I/O, and never reads the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic.reshard.spec import Box, Kind, ShardingSpec, TensorSpec, split_range

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
