"""Sharding specs: every element of every tensor is held, TP/PP/DP/ZeRO rules as Megatron's."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.model import MODEL_PRESETS, Layout, ModelSpec
from elastic.parallel.partition import partition_layers
from elastic.reshard.spec import FP32_KINDS, box_numel, sharding_spec, split_range

TINY = MODEL_PRESETS["tiny"]
GELU = ModelSpec(name="g", layers=3, hidden=32, ffn_hidden=80, heads=4, kv_heads=4, vocab=50, seq_len=8, mlp="gelu",
                 tie_embeddings=True)


@pytest.mark.parametrize("model", [TINY, GELU], ids=["tiny", "gelu-tied"])
@pytest.mark.parametrize("layout", ["tp1.pp1.dp1", "tp2.pp2.dp2", "tp2.pp1.dp3.z1", "tp1.pp3.dp2.z1", "tp2.pp2.dp1"])
def test_every_element_held_by_the_expected_number_of_ranks(model: ModelSpec, layout: str) -> None:
    L = Layout.parse(layout)
    if L.pp > model.layers:
        pytest.skip("more stages than layers")
    s = sharding_spec(model, L, FP32_KINDS)
    count = {(t.name, k): np.zeros(t.shape, dtype=np.int64) for t in s.tensors for k in s.kinds}
    for _rank, name, kind, box in s.iter_pieces():
        count[(name, kind)][tuple(slice(a, b) for a, b in box)] += 1
    for t in s.tensors:
        stages = len(s.pp_ranks_of(t))
        for k in s.kinds:
            c = count[(t.name, k)]
            replicas = L.dp if (k == "param" or not L.zero) else 1
            want = stages * replicas * (1 if t.tp_dim is not None else L.tp)
            assert (c == want).all(), f"{t.name}/{k}: held {c.min()}..{c.max()} times, want {want}"


def test_tp_splits_follow_megatron() -> None:
    s = sharding_spec(TINY, Layout.parse("tp2.pp1.dp1"))
    r1 = s.rank_pieces(1)
    hd = TINY.head_dim
    assert r1[("layers.0.attn.q.weight", "param")] == ((2 * hd, 4 * hd), (0, 64))  # column: dim 0, whole heads
    assert r1[("layers.0.attn.k.weight", "param")] == ((hd, 2 * hd), (0, 64))  # GQA: 2 kv heads over 2 ranks
    assert r1[("layers.0.attn.o.weight", "param")] == ((0, 64), (2 * hd, 4 * hd))  # row: dim 1
    assert r1[("layers.0.mlp.down.weight", "param")] == ((0, 64), (88, 176))
    assert r1[("embed.weight", "param")] == ((128, 256), (0, 64))  # vocab-parallel
    assert r1[("layers.0.attn_norm.weight", "param")] == ((0, 64),)  # replicated


def test_zero1_splits_optimizer_state_on_dim0_across_dp() -> None:
    s = sharding_spec(TINY, Layout.parse("tp1.pp1.dp3.z1"))
    boxes = [s.rank_pieces(r)[("layers.1.mlp.up.weight", "exp_avg")] for r in range(3)]
    assert [b[0] for b in boxes] == [(0, 58), (58, 117), (117, 176)]
    assert all(s.rank_pieces(r)[("layers.1.mlp.up.weight", "param")] == ((0, 176), (0, 64)) for r in range(3))
    assert sum(box_numel(b) for b in boxes) == 176 * 64


def test_virtual_layers_for_deepseek_v3_pp16() -> None:
    p = partition_layers(61, 16)
    assert p.slots_per_chunk == 4 and sum(p.virtual) == 3
    assert sum(p.stage_layers()) == 61 and min(p.stage_layers()) == 3
    assert p.virtual[0] == 1 and p.virtual[-1] == 1  # embedding and head stages carry the padding


def test_interleaved_chunks_round_robin() -> None:
    p = partition_layers(8, 2, 2)
    assert p.layers_of_rank(0) == (0, 1, 4, 5) and p.layers_of_rank(1) == (2, 3, 6, 7)


@pytest.mark.parametrize("n,k", [(10, 3), (7, 7), (176, 2), (5, 8)])
def test_split_range_is_balanced_and_covers(n: int, k: int) -> None:
    parts = [split_range(n, k, i) for i in range(k)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(parts[i][1] == parts[i + 1][0] for i in range(k - 1))
    sizes = [b - a for a, b in parts]
    assert max(sizes) - min(sizes) <= 1
