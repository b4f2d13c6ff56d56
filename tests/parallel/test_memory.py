"""Memory model against published formulas and against the sharding spec (what the trainer allocates)."""

from __future__ import annotations

import pytest
import torch

from elastic.model import Layout, MLASpec, ModelSpec, MoESpec, load_hardware, load_model
from elastic.parallel.memory import (
    chunks_in_flight,
    layer_activation,
    layer_bytes_per_token,
)
from elastic.parallel.params import rank_params
from elastic.parallel.planner import evaluate
from elastic.reshard.spec import box_numel, box_shape, sharding_spec

MiB = 2**20
A100 = load_hardware("a100-80g")
GPT3 = load_model("gpt3-175b")


# --------------------------------------------------------------------------------------------
# Megatron-LM megatron/training/theoretical_memory_usage.py worked values (shared/REFERENCE.md):
# GPT-3 175B, TP8 PP8, micro-batch 1, 64 micro-batches, sequence parallel + selective recompute.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("layout", "global_batch", "component", "mib"), [
    ("tp8.pp8.dp1", 64, "weights+optimizer", 48_007),
    ("tp8.pp8.dp8.z1", 512, "weights+optimizer", 20_003),  # distributed optimizer, DP8
    ("tp8.pp8.dp1", 64, "activations", 9_816),
    ("tp8.pp8.dp1.vpp3", 64, "activations", 12_679),  # interleaved, vpp=3
    ("tp8.pp8.dp1", 4, "activations", 4_908),  # only 4 micro-batches in flight
])
def test_megatron_theoretical_memory_worked_examples(layout: str, global_batch: int, component: str,
                                                     mib: int) -> None:
    p = evaluate(GPT3, Layout.parse(layout), A100, global_batch=global_batch, micro_batch=1,
                 recompute="selective", offload=False)
    m = p.memory
    assert m.stage == 0  # the first stage decides, as Megatron's formula assumes
    got = (m.weights + m.gradients + m.optimizer) if component == "weights+optimizer" else m.activations
    assert got / MiB == pytest.approx(mib, rel=0.05), f"{component}: {got / MiB:,.0f} MiB vs Megatron {mib:,} MiB"


@pytest.mark.parametrize("dp", [8, 64])
def test_zero1_matches_zero_paper_components(dp: int) -> None:
    """ZeRO (Rajbhandari et al.) stage 1: weights 2P, optimizer 12P/N (our fp32 gradients: 4P, Megatron's)."""
    model = load_model("megatron-7.5b")
    P = model.total_params()
    base = evaluate(model, Layout(1, 1, dp), A100, global_batch=dp, recompute="full", offload=False)
    z1 = evaluate(model, Layout(1, 1, dp, zero=1), A100, global_batch=dp, recompute="full", offload=False)
    assert base.memory.weights == 2 * P
    assert base.memory.gradients == 4 * P
    assert base.memory.optimizer == 12 * P
    assert z1.memory.optimizer == pytest.approx(12 * P / dp, rel=0.01)
    # Megatron's distributed optimizer: 6 + 12/dp bytes per parameter
    assert (z1.memory.weights + z1.memory.gradients + z1.memory.optimizer) / P == pytest.approx(6 + 12 / dp, rel=0.01)


# --------------------------------------------------------------------------------------------
# Korthikanti et al. 2022, Table 2 (GPT: ffn = 4h, MHA), bytes per layer / (s*b*h)
# --------------------------------------------------------------------------------------------

_GPT = ModelSpec(name="gpt-k", layers=4, hidden=1024, ffn_hidden=4096, heads=16, kv_heads=16, vocab=1000,
                 seq_len=2048, mlp="gelu")


@pytest.mark.parametrize(("tp", "recompute", "expected"), [
    (1, "none", lambda a, s, h, t: 34 + 5 * a * s / h),
    (4, "none", lambda a, s, h, t: (34 + 5 * a * s / h) / t),  # TP + sequence parallel
    (1, "selective", lambda a, s, h, t: 34),
    (8, "selective", lambda a, s, h, t: 34 / t),  # TP + SP + selective
    (1, "full", lambda a, s, h, t: 2),
    (8, "full", lambda a, s, h, t: 2 / t),  # layer input only, sequence-sharded
])
def test_korthikanti_per_layer_activations(tp: int, recompute: str, expected) -> None:
    s, h, a = 2048, _GPT.hidden, _GPT.heads
    got = layer_bytes_per_token(layer_activation(_GPT, False), tp, s, recompute, h) / h  # type: ignore[arg-type]
    assert got == pytest.approx(expected(a, s, h, tp))


@pytest.mark.parametrize(("pp", "vpp", "m", "rank", "held"), [
    (8, 1, 64, 0, 8),  # 1F1B: stage 0 holds pp micro-batches
    (8, 1, 64, 7, 1),  # the last stage holds one
    (8, 1, 4, 0, 4),  # fewer micro-batches than stages
    (8, 3, 64, 0, 31),  # interleaved: pp*vpp + pp - 1 chunks = pp*vpp*(1 + (pp-1)/(pp*vpp))
    (8, 3, 64, 7, 17),
    (1, 1, 16, 0, 1),
])
def test_chunks_in_flight(pp: int, vpp: int, m: int, rank: int, held: int) -> None:
    assert chunks_in_flight(pp, vpp, m, rank) == held


# --------------------------------------------------------------------------------------------
# Parameters per rank == elastic.reshard.spec boxes == a plain torch allocation of those shapes
# --------------------------------------------------------------------------------------------

TINY = load_model("tiny")
TINY_MOE = ModelSpec(name="tiny-moe", layers=4, hidden=64, ffn_hidden=176, heads=4, kv_heads=2, vocab=256, seq_len=32,
                     moe=MoESpec(experts=4, top_k=2, expert_ffn_hidden=32, shared_experts=1, dense_layers=1))
TINY_GELU = ModelSpec(name="tiny-gelu", layers=5, hidden=48, ffn_hidden=192, heads=4, kv_heads=4, vocab=250,
                      seq_len=32, mlp="gelu", tie_embeddings=True)  # biases, tied embedding, vocab % 4 != 0
TINY_MLA = ModelSpec(name="tiny-mla", layers=3, hidden=64, ffn_hidden=128, heads=4, kv_heads=4, vocab=128, seq_len=16,
                     mla=MLASpec(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                 v_head_dim=8),
                     moe=MoESpec(experts=4, top_k=1, expert_ffn_hidden=16, dense_layers=1))

CASES = [
    (TINY, "tp1.pp1.dp1"), (TINY, "tp2.pp2.dp2"), (TINY, "tp2.pp1.dp4.z1"), (TINY, "tp1.pp4.dp2.z1"),
    (TINY, "tp2.pp2.dp2.vpp2.z1"), (TINY, "tp1.pp3.dp3.z1"),
    (TINY_MOE, "tp2.pp2.dp4.ep2.z1"), (TINY_MOE, "tp1.pp3.dp4.ep4"),
    (TINY_GELU, "tp4.pp2.dp3.z1"), (TINY_GELU, "tp2.pp3.dp1"),
    (TINY_MLA, "tp2.pp2.dp2.ep2.z1"),
]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m.name}-{L}" for m, L in CASES])
def test_rank_params_equal_spec_boxes_for_every_rank(model: ModelSpec, layout: str) -> None:
    L = Layout.parse(layout)
    spec = sharding_spec(model, L, kinds=("param", "exp_avg"))
    most: dict[int, int] = {}
    for r in range(L.world_size):
        t, d, p = L.coords(r)
        pieces = spec.rank_pieces(r)
        want_param = sum(box_numel(b) for (_, k), b in pieces.items() if k == "param")
        want_opt = sum(box_numel(b) for (_, k), b in pieces.items() if k == "exp_avg")
        got = rank_params(model, L, p, tp_rank=t, dp_rank=d)
        assert (got.params, got.optimizer_elements) == (want_param, want_opt), f"rank {r} {(t, d, p)}"
        most[p] = max(most.get(p, 0), want_param)
    # the default (tp-1, dp-1) rank is the most loaded of its stage
    for p, n in most.items():
        assert rank_params(model, L, p).params == n


@pytest.mark.parametrize(("model", "layout"), [(TINY, "tp2.pp2.dp2.z1"), (TINY, "tp1.pp1.dp1"),
                                               (TINY_GELU, "tp4.pp2.dp3.z1"), (TINY_MOE, "tp2.pp2.dp4.ep2.z1")])
def test_weight_and_optimizer_bytes_equal_a_torch_allocation(model: ModelSpec, layout: str) -> None:
    """Allocate what the spec says the most-loaded rank holds (bf16 weights, fp32 grads, 3 fp32 optimizer kinds)."""
    L = Layout.parse(layout)
    planned = evaluate(model, L, load_hardware("cpu"), global_batch=L.dp * 4, offload=False)
    spec = sharding_spec(model, L, kinds=("param", "master", "exp_avg", "exp_avg_sq"))
    stage = planned.memory.stage
    rank = L.rank(L.tp - 1, L.dp - 1, stage)
    weights = grads = optimizer = 0
    for (_, kind), box in spec.rank_pieces(rank).items():
        if kind == "param":
            weights += torch.empty(box_shape(box), dtype=torch.bfloat16).nbytes
            grads += torch.empty(box_shape(box), dtype=torch.float32).nbytes
        else:
            optimizer += torch.empty(box_shape(box), dtype=torch.float32).nbytes
    m = planned.memory
    assert (m.weights, m.gradients, m.optimizer) == (weights, grads, optimizer)
