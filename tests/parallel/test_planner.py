"""Planner: published configurations fit (or not), enumeration rules, ranking, best-by-count."""

from __future__ import annotations

import math

import pytest

from elastic.model import Layout, SpecError, load_hardware, load_model
from elastic.parallel.planner import PlanOptions, best_by_gpu_count, evaluate, feasible_layouts, plan

A100 = load_hardware("a100-80g")
H100 = load_hardware("h100-80g")
H800 = load_hardware("h800-80g")

# Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: A100-80GB, full activation recompute,
# sequence 2,048. Micro-batch 1 is assumed here (the table does not list it). Last column: the
# achieved TFLOP/s per GPU, which the throughput model must land near (+-25%).
TABLE1 = [
    ("megatron-1.7b", "tp1.pp1.dp32", 512, 137),
    ("megatron-3.6b", "tp2.pp1.dp32", 512, 138),
    ("megatron-7.5b", "tp4.pp1.dp32", 512, 142),
    ("megatron-18.4b", "tp8.pp1.dp32", 1024, 135),
    ("megatron-145.6b", "tp8.pp8.dp24", 2304, 148),
    ("megatron-1t", "tp8.pp64.dp6", 3072, 163),
]


@pytest.mark.parametrize(("name", "layout", "batch", "tflops"), TABLE1)
def test_megatron_table1_rows_fit_and_run_near_published_speed(name: str, layout: str, batch: int,
                                                               tflops: float) -> None:
    model = load_model(name)
    p = evaluate(model, Layout.parse(layout), A100, global_batch=batch, micro_batch=1, recompute="full",
                 offload=False)
    assert p.fits, p.reason
    s, n_l, h, v = model.seq_len, model.layers, model.hidden, model.vocab
    flops = 96 * batch * s * n_l * h * h * (1 + s / (6 * h) + v / (16 * n_l * h))  # the paper's F (with recompute)
    achieved = flops / p.step_seconds / p.gpus_used / 1e12
    assert achieved == pytest.approx(tflops, rel=0.25)
    # the planner, free to choose, also finds the layout feasible
    assert evaluate(model, Layout.parse(layout), A100, global_batch=batch).fits


def test_megatron_18b_without_model_parallelism_does_not_fit() -> None:
    p = evaluate(load_model("megatron-18.4b"), Layout(1, 1, 256), A100, global_batch=1024)
    assert not p.fits
    assert "does not fit" in p.reason or "host memory" in p.reason
    p0 = evaluate(load_model("megatron-18.4b"), Layout(1, 1, 256), A100, global_batch=1024, offload=False)
    assert not p0.fits and p0.memory.total > A100.memory_bytes


def test_llama3_405b_tp8_pp16_fits_on_h100() -> None:
    """Llama 3 paper, Table 4: 8,192 H100-80GB, TP8 PP16 DP64, sequence 8,192, 16M-token batches."""
    p = evaluate(load_model("llama3-405b"), Layout.parse("tp8.pp16.dp64.z1"), H100, global_batch=2048, seq_len=8192)
    assert p.fits, p.reason
    assert p.stage_layers and sum(p.stage_layers) == 126 and len(p.stage_layers) == 16


def test_deepseek_v3_2048_h800_has_a_pp16_plan_with_64_slots() -> None:
    plans = feasible_layouts(load_model("deepseek-v3"), 2048, H800)
    pp16 = [p for p in plans if p.layout.pp == 16 and p.layout.vpp == 1]
    assert pp16, [str(p.layout) for p in plans[:10]]
    p = pp16[0]
    assert (p.layer_slots, p.virtual_layers, sum(p.stage_layers)) == (64, 3, 61)
    assert max(p.stage_layers) == 4
    assert p.imbalance < 1.35  # the LM head shares its stage with virtual slots


def test_deepseek_v3_reported_layout_fits() -> None:
    """DeepSeek-V3 report: 2,048 H800, PP16, EP64, ZeRO-1 DP, TP1."""
    p = evaluate(load_model("deepseek-v3"), Layout.parse("tp1.pp16.dp128.ep64.z1"), H800, global_batch=15360)
    assert p.fits, p.reason


@pytest.mark.parametrize(("name", "gpus", "batch", "gpn"), [
    ("llama3-8b", 40, 1024, 8),
    ("llama2-70b", 96, 512, 8),
    ("deepseek-v3", 256, 1024, 8),
    ("megatron-145.6b", 1000, 2304, 8),
    ("llama3-8b", 12, 96, 4),
])
def test_every_enumerated_layout_obeys_the_rules(name: str, gpus: int, batch: int, gpn: int) -> None:
    model = load_model(name)
    res = plan(model, gpus, H100, global_batch=batch, gpus_per_node=gpn)
    assert res.plans, res.reason
    for p in res.plans:
        L = p.layout
        assert model.heads % L.tp == 0 and (model.mla or model.kv_heads % L.tp == 0)
        assert L.tp <= gpn and gpn % L.tp == 0
        assert L.pp * L.vpp <= model.layers
        assert p.gpus_used == L.world_size <= gpus and p.leftover_gpus == gpus - p.gpus_used
        assert batch == L.dp * p.micro_batch * p.grad_accum
        if L.ep > 1:
            assert model.moe and model.moe.experts % L.ep == 0 and L.dp % L.ep == 0
        if L.vpp > 1:
            assert p.grad_accum % L.pp == 0
        assert p.fits and p.memory.total <= p.gpu_memory_bytes
        assert p.mfu < 1 and p.tokens_per_second > 0
    tps = [p.tokens_per_second for p in res.plans]
    assert all(a >= b * 0.998 for a, b in zip(tps, tps[1:], strict=False)), "sorted by tokens/s"


def test_leftover_gpus_are_reported_when_the_batch_does_not_split() -> None:
    # 40 GPUs, batch 1024: dp must divide 1024, so tp8 gives dp4 (8 GPUs idle), not dp5
    res = plan(load_model("llama3-8b"), 40, H100, global_batch=1024)
    tp8pp1 = [p for p in res.plans if (p.layout.tp, p.layout.pp) == (8, 1)]
    assert tp8pp1 and all(p.layout.dp == 4 and p.leftover_gpus == 8 for p in tp8pp1)


def test_ties_go_to_fewer_gpus_then_smaller_tp() -> None:
    # tiny on the cpu preset: every layout is dominated by fixed costs; equal speeds must order
    # by GPUs used then tp
    res = plan(load_model("tiny"), 8, load_hardware("cpu"), global_batch=8)
    keys = [(round(math.log(p.tokens_per_second) / math.log(1.001)), p.gpus_used, p.layout.tp) for p in res.plans]
    for (t1, g1, tp1), (t2, g2, tp2) in zip(keys, keys[1:], strict=False):
        if t1 == t2:
            assert (g1, tp1) <= (g2, tp2)


def test_best_by_gpu_count_is_monotone_and_matches_single_counts() -> None:
    model = load_model("llama3-8b")
    best = best_by_gpu_count(model, H100, 64, global_batch=512)
    assert min(best) >= 1 and max(best) == 64
    counts = sorted(best)
    speeds = [best[n].tokens_per_second for n in counts]
    assert all(b >= a for a, b in zip(speeds, speeds[1:], strict=False)), "more GPUs never plan slower"
    for n in (8, 24, 40, 64):
        single = feasible_layouts(model, n, H100, global_batch=512)
        assert best[n].tokens_per_second >= single[0].tokens_per_second * 0.999
        assert best[n].gpus_used <= n and best[n].leftover_gpus == n - best[n].gpus_used
    assert best_by_gpu_count(model, H100, 64, global_batch=512) == best  # memoised, same answer


def test_nothing_fits_explains_what_would() -> None:
    res = plan(load_model("gpt3-175b"), 8, H100)
    assert not res.plans
    assert "more GPUs" in res.reason and "gpt3-175b" in res.reason
    res = plan(load_model("gpt3-175b"), 8, H100, options=PlanOptions(recompute=("none",), offload=(False,)))
    assert "full activation recompute" in res.reason and "offload" in res.reason


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: plan(load_model("tiny"), 0, H100), "at least 1 GPU"),
    (lambda: evaluate(load_model("gpt3-175b"), Layout(16, 1, 1), H100), "gpus_per_node"),
    (lambda: evaluate(load_model("llama3-8b"), Layout(8, 1, 3), H100, global_batch=1024), "does not divide global_batch"),
    (lambda: evaluate(load_model("llama3-8b"), Layout(8, 1, 4), H100, n_gpus=16), "needs 32 GPUs"),
    (lambda: evaluate(load_model("llama3-8b"), Layout(8, 2, 4, vpp=2), H100, global_batch=4), "interleaved"),
    (lambda: PlanOptions(recompute=("some",)), "recompute"),
])
def test_bad_input_raises_spec_error(call, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        call()
