"""torchtitan's llama3 debug model trains identically under FSDP2 x TP2, FSDP4 and one process.

This is the ground the in-place reshard tests stand on: the helper in ``_titan.py`` must give
every layout the same global weights, train them with torchtitan's own TP plan and FSDP2
wrapping on gloo, and leave the parameters in the placements a resharder will see. Each
layout runs as one job on a pool of spawned processes (see ``tests/reshard/_mp.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.reshard._mp import Pool, free_port
from tests.torch._titan import train_job

pytestmark = pytest.mark.slow

STEPS = 3
#: (dp_shard, tp, processes)
LAYOUTS = {"fsdp2_tp2": (2, 2, 4), "fsdp4": (4, 1, 4), "single": (1, 1, 1)}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, list[dict[str, Any]]]]:
    pool = Pool(4)
    try:
        yield {name: pool.run(train_job, n, free_port(), dp, tp, STEPS, 0, 4, timeout=120)
               for name, (dp, tp, n) in LAYOUTS.items()}
    finally:
        pool.close()


def test_every_layout_starts_from_the_same_global_weights(runs: dict[str, list[dict[str, Any]]]) -> None:
    want = runs["single"][0]["initial"]
    for name, ranks in runs.items():
        for r, res in enumerate(ranks):
            assert res["initial"] == want, f"{name} rank {r}"


def test_losses_agree_across_layouts_and_training_learns(runs: dict[str, list[dict[str, Any]]]) -> None:
    ref = runs["single"][0]["losses"]
    assert len(ref) == STEPS
    for name, ranks in runs.items():
        for r, res in enumerate(ranks):
            for step, (got, want) in enumerate(zip(res["losses"], ref, strict=True)):
                assert abs(got - want) <= 1e-9 * abs(want), f"{name} rank {r} step {step}: {got!r} != {want!r}"
            # step 0's batch was trained on: its loss must have dropped, the same everywhere
            assert res["step0_after"] < ref[0], f"{name} rank {r}"
            assert abs(res["step0_after"] - runs["single"][0]["step0_after"]) <= 1e-9 * ref[0]


def test_fsdp2_tp2_placements_are_torchtitans(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The layout a resharder starts from: column-parallel weights (the fused wqkv, w1, w3, the
    vocab-parallel embedding and lm_head) are FSDP-strided on top of TP's row shard; wo and w2
    are row-parallel; the sequence-parallel norms are replicated across TP."""
    params = {name: (kind, placements, local, mesh) for name, kind, placements, local, mesh
              in runs["fsdp2_tp2"][0]["params"]}
    column = (_StridedShard(0, split_factor=2), Shard(0))
    want = {
        "tok_embeddings.weight": (column, (512, 256)),
        "layers.0.attention.qkv_linear.wqkv.weight": (column, (192, 256)),
        "layers.0.attention.wo.weight": ((Shard(0), Shard(1)), (128, 128)),
        "layers.0.feed_forward.w1.weight": (column, (192, 256)),
        "layers.0.feed_forward.w2.weight": ((Shard(0), Shard(1)), (128, 384)),
        "layers.0.feed_forward.w3.weight": (column, (192, 256)),
        "layers.0.attention_norm.weight": ((Shard(0), Replicate()), (128,)),
        "norm.weight": ((Shard(0), Replicate()), (128,)),
        "lm_head.weight": (column, (512, 256)),
    }
    for name, (placements, local) in want.items():
        assert params[name] == ("DTensor", placements, local, ("fsdp", "tp")), name
    assert all(kind == "DTensor" and mesh == ("fsdp", "tp") for kind, _, _, mesh in params.values())
    # FSDP4: plain 1-D Shard(0) on "fsdp"
    for _name, kind, placements, _local, mesh in runs["fsdp4"][0]["params"]:
        assert (kind, placements, mesh) == ("DTensor", (Shard(0),), ("fsdp",))
