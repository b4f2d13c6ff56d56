"""Step 3 of the reshard planner: the diff (local copies, demands, new shards). Pure.

For each ``(tensor, kind)``, the new cells intersected with the old ones: what a new member
already holds becomes a local copy, the rest a demand with its possible senders (or a fixed
message when only one live worker holds it). Tensors of one signature on the same stages diff
identically up to their name, so each distinct diff (a template) is computed once.

This module must not import torch, ray or anything that does I/O, and never reads the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from elastic.model import Layout
from elastic.reshard.errors import ReshardError
from elastic.reshard.plan_boxes import _LayoutView, _Pair, _pairs, _PosBoxes
from elastic.reshard.spec import Box, Kind, TensorSpec


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
