"""Regions: the exact set of global elements one worker holds of a tensor, and where they sit locally. Pure.

What it is for: the generic reshard planner (``plan_regions.py``) and ``elastic.torch`` describe
every worker's piece of every tensor as a :data:`Region`, whatever produced the sharding
(DTensor placements, FSDP2, a pipeline stage, a plain replicated tensor, explicit boxes).

A region is, per tensor dimension, a sorted tuple of disjoint half-open *runs*
``(start, stop)`` of global indices. The worker's local tensor holds the cartesian product of
its dims' index sets in ascending order, so local index ``k`` along a dim is the ``k``-th global
index of that dim's runs. Almost every real shard has one run per dim (a box); a bare
``_StridedShard`` yields several runs (rows {0, 4} of 8 at one coordinate), which is still
addressable: any global box that stays inside one run per dim is one contiguous *local* box.

Placements follow torch's own rules (``torch.distributed.tensor``): mesh dims are applied
left to right; ``Shard(d)`` cuts the current local index list of dim ``d`` like ``torch.chunk``
(10 over 4 -> 3, 3, 3, 1; trailing chunks may be empty: 6 over 4 -> 2, 2, 2, 0), not the
balanced split of ``elastic/reshard/spec.py``; ``_StridedShard(d, sf)`` first chunks the list into
``sf`` pieces, then each piece over the mesh dim, and the shard is the concatenation of its
chunk of every piece; ``Replicate()`` keeps everything; ``Partial`` is refused (a pending
reduction is not a piece of a tensor). Placements are read by duck typing (``is_shard()``,
``is_replicate()``, ``is_partial()``, ``dim``, ``split_factor``) or given as plain tuples
(``("shard", d)``, ``("strided", d, sf)``, ``("replicate",)``), so this module imports no torch.

Must not: import torch or anything that does I/O, or read the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from elastic.model import SpecError

__all__ = [
    "PlacementError",
    "Region",
    "Run",
    "chunk_bounds",
    "full_region",
    "normalize_placements",
    "region_boxes",
    "region_numel",
    "region_shape",
    "shard_region",
]

Run = tuple[int, int]
Region = tuple[tuple[Run, ...], ...]
"""Per dim, sorted disjoint runs of global indices; see the module docstring."""

Norm = tuple[Any, ...]  # ("shard", d) | ("strided", d, sf) | ("replicate",)


class PlacementError(SpecError):
    """A placement this reshard cannot move (raised before any byte moves)."""


def chunk_bounds(length: int, chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``length`` elements are cut like ``torch.chunk``.

    The chunk size is ``ceil(length / chunks)``; trailing chunks are short or empty.
    """
    if chunks <= 0:
        raise PlacementError(f"a mesh dimension of size {chunks} cannot shard anything; mesh sizes are >= 1")
    if not 0 <= index < chunks:
        raise PlacementError(f"mesh coordinate {index} is outside a mesh dimension of size {chunks}")
    size = -(-length // chunks)
    return min(length, size * index), min(length, size * (index + 1))


def _take(runs: tuple[Run, ...], a: int, b: int) -> tuple[Run, ...]:
    """Elements ``[a, b)`` (in local order) of an index set given as runs."""
    out: list[Run] = []
    pos = 0
    for s, e in runs:
        n = e - s
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append((s + lo - pos, s + hi - pos))
        pos += n
        if pos >= b:
            break
    return tuple(out)


def _merge(runs: Sequence[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for s, e in runs:
        if e <= s:
            continue
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return tuple(out)


def _length(runs: tuple[Run, ...]) -> int:
    return sum(e - s for s, e in runs)


def normalize_placements(placements: Sequence[Any], ndim: int) -> tuple[Norm, ...]:
    """Plain tuples for torch placements (or tuples already); refuses ``Partial`` and unknowns."""
    return tuple(_normalize(p, ndim, i) for i, p in enumerate(placements))


def _normalize(p: Any, ndim: int, mesh_dim: int) -> Norm:
    if isinstance(p, tuple):
        kind = p[0] if p else None
        if kind == "replicate" and len(p) == 1:
            return p
        if kind == "shard" and len(p) == 2:
            return ("shard", _dim(p[1], ndim, mesh_dim))
        if kind == "strided" and len(p) == 3 and int(p[2]) >= 1:
            return ("strided", _dim(p[1], ndim, mesh_dim), int(p[2]))
        raise PlacementError(
            f"placement {p!r} on mesh dim {mesh_dim}: use ('shard', dim), ('strided', dim, split_factor) "
            "or ('replicate',)"
        )
    if getattr(p, "is_partial", lambda: False)():
        raise PlacementError(
            f"placement {p!r} on mesh dim {mesh_dim} is Partial: the values are a pending reduction, "
            "not a piece of the tensor; reduce it first (dt.redistribute(placements=[... Replicate() ...])) "
            "or keep Partial tensors out of the state to reshard"
        )
    if hasattr(p, "split_factor"):  # _StridedShard (checked before Shard: it is one)
        sf = int(p.split_factor)
        return ("strided", _dim(p.dim, ndim, mesh_dim), sf) if sf > 1 else ("shard", _dim(p.dim, ndim, mesh_dim))
    if getattr(p, "is_shard", lambda: False)():
        return ("shard", _dim(p.dim, ndim, mesh_dim))
    if getattr(p, "is_replicate", lambda: False)():
        return ("replicate",)
    raise PlacementError(
        f"placement {p!r} ({type(p).__name__}) on mesh dim {mesh_dim} is not Shard, _StridedShard or "
        "Replicate; redistribute the tensor to one of those before resharding"
    )


def _dim(d: int, ndim: int, mesh_dim: int) -> int:
    if not -ndim <= d < ndim:
        raise PlacementError(f"placement on mesh dim {mesh_dim} shards tensor dim {d}, but the tensor has {ndim} dims")
    return d % ndim


def shard_region(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Any]) -> Region:
    """The region that ``coordinate`` of a mesh of ``mesh_shape`` holds of a tensor of ``global_shape``."""
    shape = tuple(int(s) for s in global_shape)
    mesh = tuple(int(s) for s in mesh_shape)
    coord = tuple(int(c) for c in coordinate)
    if len(mesh) != len(coord):
        raise PlacementError(f"coordinate {list(coord)} has {len(coord)} dims, the mesh {list(mesh)} {len(mesh)}")
    if len(placements) != len(mesh):
        raise PlacementError(
            f"{len(placements)} placements for a {len(mesh)}-dim mesh {list(mesh)}; give one placement per mesh dim"
        )
    return _region(shape, mesh, coord, normalize_placements(placements, len(shape)))


@lru_cache(maxsize=65536)
def _region(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...], norm: tuple[Norm, ...]) -> Region:
    dims: list[tuple[Run, ...]] = [((0, s),) if s > 0 else () for s in shape]
    for mesh_dim, p in enumerate(norm):
        if p[0] == "replicate":
            continue
        d, n, i = p[1], mesh[mesh_dim], coord[mesh_dim]
        runs = dims[d]
        length = _length(runs)
        if p[0] == "shard":
            a, b = chunk_bounds(length, n, i)
            dims[d] = _take(runs, a, b)
        else:
            sf = p[2]
            parts: list[Run] = []
            for j in range(sf):
                ps, pe = chunk_bounds(length, sf, j)
                a, b = chunk_bounds(pe - ps, n, i)
                parts += _take(runs, ps + a, ps + b)
            dims[d] = _merge(parts)
    if any(_length(r) == 0 for r in dims):
        return tuple(() for _ in shape)
    return tuple(dims)


def full_region(shape: Sequence[int]) -> Region:
    """The whole tensor (a plain, replicated tensor); empty for a tensor with a zero dim."""
    if any(s == 0 for s in shape):
        return tuple(() for _ in shape)
    return tuple(((0, int(s)),) for s in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    """The local tensor's shape."""
    return tuple(_length(r) for r in region)


def region_numel(region: Region) -> int:
    n = 1
    for r in region:
        n *= _length(r)
    return n


def region_boxes(region: Region) -> list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """The region as boxes: ``(global box, local origin)`` for every combination of runs.

    The local box of a piece is its global box shifted to ``local origin`` (one contiguous
    local box per piece). A region with one run per dim is one box at local origin 0.
    """
    if region_numel(region) == 0:
        return []
    out: list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = [((), ())]
    for runs in region:
        nxt = []
        pos, starts = 0, []
        for s, e in runs:
            starts.append(pos)
            pos += e - s
        for box, origin in out:
            for (s, e), lo in zip(runs, starts, strict=True):
                nxt.append((box + ((s, e),), origin + (lo,)))
        out = nxt
    return out
