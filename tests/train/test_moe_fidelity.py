"""Fidelity of the mixture-of-experts trainer: expert-parallel layouts follow the single process.

``tiny-moe`` is DeepSeek-shaped (one dense layer, then MoE layers of 8 routed experts, top 2,
and a shared expert; sequence-wise balance loss, see ``elastic.train.moe``); ``tiny-moe-gelu``
has gelu experts with biases, tied embeddings and top-1 routing. Four gloo
processes run each layout; rank 0 also runs the single-process reference (tp1.pp1.dp1). The
layouts split the experts over 2 or 4 dp ranks (``ep``), with tensor parallelism inside the
experts, a pipeline (plain and interleaved), and ZeRO-1 whose expert slices are shared among
the ranks holding the same experts only. In float64 only the order of floating-point
reductions differs from the reference, so the losses agree to 1e-9 relative (float32: 1e-4).
Every run ends with all ranks' state gathered (replicas bitwise equal, every expert held by
some rank), each rank's state bytes equal to the spec's, and the measured weights counting
the rank's experts.

The routing and the balance loss are also checked against their definitions on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elastic.model import Layout
from elastic.reshard.spec import sharding_spec
from elastic.train.groups import Comm
from elastic.train.model import GPTStage
from elastic.train.moe import balance_loss, route
from tests.train._mp import (
    MODELS,
    assert_matches_reference,
    assert_state_bytes_equal_spec,
    make_cfg,
    run_layouts,
    run_workers,
)

STEPS = 10
DROP = {"tiny-moe": 0.2, "tiny-moe-gelu": 0.1}

RUNS = [
    ("tp1.pp1.dp4.ep4", {"dtype": "float64", "model": "tiny-moe"}),
    ("tp1.pp2.dp2.ep2", {"dtype": "float64", "model": "tiny-moe"}),
    ("tp2.pp1.dp2.ep2", {"dtype": "float64", "model": "tiny-moe"}),
    ("tp1.pp1.dp4.ep2.z1", {"dtype": "float64", "model": "tiny-moe"}),
    ("tp1.pp2.dp2.ep2.vpp2", {"dtype": "float64", "model": "tiny-moe"}),
    ("tp2.pp1.dp2.ep2", {"dtype": "float32", "model": "tiny-moe"}),
    ("tp2.pp1.dp2.ep2", {"dtype": "float64", "model": "tiny-moe-gelu"}),
    ("tp1.pp2.dp2.ep2", {"dtype": "float64", "model": "tiny-moe-gelu"}),
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(run_layouts, 4, RUNS, STEPS, timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", RUNS, ids=[f"{lay}-{kw['dtype']}" for lay, kw in RUNS])
def test_expert_parallel_layout_matches_single_process(results: list[dict], layout: str, kw: dict) -> None:
    assert_matches_reference(results, layout, kw, STEPS, DROP)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", RUNS, ids=[f"{lay}-{kw['dtype']}" for lay, kw in RUNS])
def test_state_and_measured_weights_hold_the_ranks_experts(results: list[dict], layout: str, kw: dict) -> None:
    assert_state_bytes_equal_spec(results, layout, kw)
    key = f"{layout}/{sorted(kw.items())}"
    for res in results:
        measured, spec = res["weight_elements"][key]
        assert measured == spec > 0


def test_ep_splits_the_experts_and_keeps_the_rest() -> None:
    """At ep4 a rank holds 2 of the 8 experts of each MoE layer and all of everything else."""
    model = MODELS["tiny-moe"]
    one = sharding_spec(model, Layout(1, 1, 4)).rank_pieces(0)
    four = sharding_spec(model, Layout(1, 1, 4, ep=4)).rank_pieces(3)
    for (name, kind), box in one.items():
        if ".moe.experts." in name:
            assert box[0] == (0, 8) and four[(name, kind)][0] == (6, 8), name
        else:
            assert four[(name, kind)] == box, name


def test_route_breaks_ties_by_the_lower_expert_index() -> None:
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.7], [0.9, 0.1, 0.9, 0.2], [0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    chosen, weights = route(scores, 2)
    assert chosen.tolist() == [[1, 2], [0, 2], [0, 1]]
    assert torch.allclose(weights.sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-15)
    assert weights[1].tolist() == [0.5, 0.5]


def test_balance_loss_is_deepseek_v3s_sequence_wise_term() -> None:
    g = torch.Generator().manual_seed(0)
    experts, top_k, seqs, seq = 4, 2, 3, 5
    scores = torch.rand(seqs * seq, experts, generator=g, dtype=torch.float64)
    chosen, _ = route(scores, top_k)
    want = 0.0
    for s in range(seqs):
        rows = range(s * seq, (s + 1) * seq)
        for i in range(experts):
            f = experts / (top_k * seq) * sum(int(i in chosen[t].tolist()) for t in rows)
            p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / seq
            want += f * p / seqs
    assert abs(float(balance_loss(scores, chosen, experts, top_k, seqs)) - want) < 1e-12
    # balanced choices and uniform scores give exactly 1 (the minimum DeepSeek-V3 aims at)
    uniform = torch.full((4, 4), 0.5, dtype=torch.float64)
    picks = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(balance_loss(uniform, picks, 4, 2, 1)) == pytest.approx(1.0, abs=1e-15)


def test_moe_layer_equals_its_definition_token_by_token() -> None:
    """One process, float64: the MoE block's output is shared(x) + sum_k g_k expert_k(x) per token."""
    cfg = make_cfg(model="tiny-moe", dtype="float64")
    spec = sharding_spec(cfg.model, Layout(1, 1, 1), cfg.kinds)
    stage = GPTStage(spec, 0, Comm.solo(0), torch.float64, "cpu")
    g = torch.Generator().manual_seed(1)
    for p in stage.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    moe = stage.layers["1"].moe
    x = torch.randn(2, 16, cfg.model.hidden, generator=g, dtype=torch.float64)
    got = moe(x).detach().reshape(-1, cfg.model.hidden)
    with torch.no_grad():
        tokens = x.reshape(-1, cfg.model.hidden)
        scores = torch.sigmoid(tokens @ moe.router.weight.T)
        ex = moe.experts
        for t in range(tokens.shape[0]):
            order = sorted(range(8), key=lambda e: (-float(scores[t, e]), e))[:2]
            total = sum(float(scores[t, e]) for e in order)
            want = moe.shared(tokens[t:t + 1])[0]
            for e in order:
                u = tokens[t]
                h = F.silu(ex.gate.weight[e] @ u) * (ex.up.weight[e] @ u)
                want = want + float(scores[t, e]) / total * (ex.down.weight[e] @ h)
            assert torch.allclose(got[t], want, rtol=1e-12, atol=1e-12), t


@pytest.mark.parametrize("model,layout", [
    ("tiny-moe", "tp2.pp2.dp2.ep2"), ("tiny-moe", "tp1.pp1.dp4.ep4"), ("tiny-moe", "tp2.pp1.dp4.ep2.z1"),
    ("tiny-moe", "tp1.pp2.dp4.ep4.vpp2"), ("tiny-moe-gelu", "tp2.pp2.dp2.ep2"), ("tiny-moe-gelu", "tp1.pp1.dp4.ep4"),
])
def test_every_ranks_stage_holds_exactly_its_spec_boxes(model: str, layout: str) -> None:
    lay = Layout.parse(layout)
    spec = sharding_spec(MODELS[model], lay)
    experts = 0
    for rank in range(lay.world_size):
        tp_rank, dp_rank, _ = lay.coords(rank)
        tp = Comm(tuple(range(lay.tp)), tp_rank, object() if lay.tp > 1 else None)  # shapes only
        ep = Comm(tuple(range(lay.ep)), dp_rank % lay.ep, object() if lay.ep > 1 else None)
        stage = GPTStage(spec, rank, tp, torch.float32, "cpu", ep=ep)  # raises if names or shapes differ
        experts += sum(p.shape[0] for n, p in stage.named_parameters() if n.endswith("moe.experts.up.weight")
                       or n.endswith("moe.experts.fc1.weight"))
    moe_layers = sum(MODELS[model].is_moe_layer(i) for i in range(MODELS[model].layers))
    # every expert of every MoE layer is held dp/ep * tp times (TP ranks each hold a slice of it)
    assert experts == MODELS[model].moe.experts * moe_layers * (lay.dp // lay.ep) * lay.tp
