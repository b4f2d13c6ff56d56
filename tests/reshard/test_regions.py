"""Regions of DTensor placements: torch's chunking rule, strided shards, refusals (pure, no process group).

The reference is torch itself: ``_compute_local_shape_and_global_offset`` (any coordinate, no
process group) for shapes and first offsets, and ``_StridedShard.local_shard_size_and_offset``
for the full index set of a strided shard. Real DTensors' local shards are checked in
``tests/torch/test_reshard_torch.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from elastic.reshard.regions import (
    PlacementError,
    chunk_bounds,
    full_region,
    region_boxes,
    region_numel,
    region_shape,
    shard_region,
)


@pytest.mark.parametrize("length, chunks, sizes", [
    (10, 4, [3, 3, 3, 1]),  # torch.chunk, not a balanced split (2, 3, 2, 3)
    (6, 4, [2, 2, 2, 0]),  # trailing chunks may be empty
    (5, 4, [2, 2, 1, 0]),
    (8, 4, [2, 2, 2, 2]),
    (1, 3, [1, 0, 0]),
    (0, 2, [0, 0]),
])
def test_chunks_follow_torch_chunk(length: int, chunks: int, sizes: list[int]) -> None:
    got = [chunk_bounds(length, chunks, i) for i in range(chunks)]
    assert [b - a for a, b in got] == sizes
    want = [c.numel() for c in torch.arange(length).chunk(chunks)] if length else []
    assert sizes[:len(want)] == want and all(s == 0 for s in sizes[len(want):])
    # contiguous and in order
    assert all(got[i][1] == got[i + 1][0] for i in range(chunks - 1) if sizes[i + 1])


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    kinds = ["S", "R", "SS"]
    for _ in range(n):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 6, 7, 8, 10, 12, 16]) for _ in range(ndim))
        mdims = rng.randint(1, 3)
        mesh = tuple(rng.randint(1, 4) for _ in range(mdims))
        pls = []
        for _m in range(mdims):
            k = rng.choice(kinds)
            d = rng.randrange(ndim)
            if k == "S":
                pls.append(Shard(d))
            elif k == "R":
                pls.append(Replicate())
            else:
                pls.append(_StridedShard(d, split_factor=rng.randint(2, 4)))
        yield shape, mesh, pls


def _torch_index_sets(shape, mesh, coord, pls) -> list[list[int]] | None:
    """The global indices per dim that torch's own rules give a coordinate (from its helpers)."""
    sets = [list(range(s)) for s in shape]
    for m, p in enumerate(pls):
        if isinstance(p, Replicate):
            continue
        d = p.dim
        cur = sets[d]
        if isinstance(p, _StridedShard):
            size, offs = p.local_shard_size_and_offset(len(cur), mesh[m], coord[m], _StridedShardOffsetMode.ALL)
            idx = list(offs)[:size] if size else []
        else:
            size, off = Shard.local_shard_size_and_offset(len(cur), mesh[m], coord[m])
            idx = list(range(off, off + size))
        sets[d] = [cur[i] for i in idx]
    return sets


@pytest.mark.parametrize("seed", range(4))
def test_regions_match_torch_for_random_placements(seed: int) -> None:
    checked = 0
    for shape, mesh, pls in _cases(seed, 60):
        for coord in itertools.product(*(range(m) for m in mesh)):
            region = shard_region(shape, mesh, coord, pls)
            want_sets = _torch_index_sets(shape, mesh, coord, pls)
            t_shape, t_off = _compute_local_shape_and_global_offset(shape, mesh, list(coord), pls)
            if any(s == 0 for s in t_shape):
                assert region_numel(region) == 0, (shape, mesh, coord, pls, region)
                continue
            assert region_shape(region) == tuple(t_shape), (shape, mesh, coord, pls)
            got_sets = [[i for a, b in runs for i in range(a, b)] for runs in region]
            assert got_sets == [sorted(s) for s in want_sets], (shape, mesh, coord, pls)
            # torch reports the first index of each dim as the offset
            assert tuple(s[0] for s in got_sets) == tuple(t_off)
            checked += 1
    assert checked > 100


def test_fsdp_by_tp_strided_shard_is_one_box_per_coordinate() -> None:
    # FSDP2 x TP column-parallel weight: (_StridedShard(0, sf=2), Shard(0)) on a (2, 2) mesh
    pl = [_StridedShard(0, split_factor=2), Shard(0)]
    got = {c: shard_region((8, 4), (2, 2), c, pl) for c in itertools.product(range(2), range(2))}
    assert got == {
        (0, 0): (((0, 2),), ((0, 4),)), (1, 0): (((2, 4),), ((0, 4),)),
        (0, 1): (((4, 6),), ((0, 4),)), (1, 1): (((6, 8),), ((0, 4),)),
    }


def test_a_bare_strided_shard_is_several_runs_with_one_local_box_each() -> None:
    region = shard_region((8, 3), (4,), (0,), [_StridedShard(0, split_factor=2)])
    assert region == (((0, 1), (4, 5)), ((0, 3),))
    assert region_shape(region) == (2, 3)
    assert region_boxes(region) == [(((0, 1), (0, 3)), (0, 0)), (((4, 5), (0, 3)), (1, 0))]


def test_uneven_and_empty_shards() -> None:
    rows = [region_shape(shard_region((6, 2), (4,), (i,), [Shard(0)]))[0] for i in range(4)]
    assert rows == [2, 2, 2, 0]
    assert shard_region((6, 2), (4,), (3,), [Shard(0)]) == ((), ())
    assert region_numel(full_region((0, 3))) == 0


def test_plain_tuple_placements_equal_torch_objects() -> None:
    a = shard_region((10, 6), (2, 3), (1, 2), [("strided", 0, 3), ("shard", 0)])
    b = shard_region((10, 6), (2, 3), (1, 2), [_StridedShard(0, split_factor=3), Shard(0)])
    assert a == b


@pytest.mark.parametrize("placements, needle", [
    ([Partial()], "Partial"),
    ([Shard(2)], "tensor dim 2"),
    ([Shard(0), Shard(1)], "2 placements for a 1-dim mesh"),
    ([("bogus", 0)], "use ('shard', dim)"),
    ([object()], "not Shard, _StridedShard or Replicate"),
])
def test_unmovable_placements_are_refused_by_name(placements, needle: str) -> None:
    with pytest.raises(PlacementError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        shard_region((4, 4), (2,), (0,), placements)
