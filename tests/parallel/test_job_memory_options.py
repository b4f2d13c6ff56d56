"""The planner sizes what a job's trainer holds: its precision, the micro-batch its cap picks, and a
per-GPU memory limit under the device's budget."""

from __future__ import annotations

import pytest

from elastic.model import Layout, SpecError, load_hardware, load_model
from elastic.parallel.memory import PRECISIONS
from elastic.parallel.planner import PlanOptions, capped_micro_batch, evaluate, feasible_layouts

TINY = load_model("tiny")
H100 = load_hardware("h100-80g")


@pytest.mark.parametrize(("per_replica", "cap", "pp", "vpp", "want"), [
    (420, 36, 1, 1, 35),   # the largest divisor <= the cap
    (84, 36, 1, 1, 28),
    (60, 36, 1, 1, 30),
    (60, 64, 1, 1, 60),    # one pass
    (60, 64, 2, 1, 30),    # at least pp micro-batches: the pipeline fills
    (12, 8, 2, 2, 6),      # interleaved: a multiple of pp micro-batches (12/6 = 2)
    (12, 8, 4, 2, 3),      # 12/4 = 3 is not a multiple of 4; 12/3 = 4 is
    (7, 5, 1, 1, 1),       # a prime per-replica batch: micro-batch 1
    (3, 8, 4, 2, None),    # no size gives a multiple of pp micro-batches
])
def test_capped_micro_batch_is_the_trainers_rule(per_replica, cap, pp, vpp, want) -> None:
    assert capped_micro_batch(per_replica, cap, pp, vpp) == want


def test_the_engine_picks_the_same_micro_batch() -> None:
    from elastic.train.engine import TrainConfig

    cfg = TrainConfig(model=TINY, global_batch=420, micro_batch_cap=36)
    for text in ("tp1.pp1.dp1", "tp1.pp1.dp5", "tp1.pp2.dp3", "tp1.pp1.dp7"):
        L = Layout.parse(text)
        assert cfg.micro_batch_for(L) == capped_micro_batch(420 // L.dp, 36, L.pp, L.vpp)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "fp64"])
def test_precision_sets_the_bytes_of_every_component(precision) -> None:
    base = evaluate(TINY, Layout(1, 2, 1), H100, global_batch=8, micro_batch=2, recompute="selective", offload=False)
    p = evaluate(TINY, Layout(1, 2, 1), H100, global_batch=8, micro_batch=2, recompute="selective", offload=False,
                 precision=precision)
    b = PRECISIONS[precision]
    params = base.memory.weights // 2  # bf16: 2 bytes a weight
    assert (p.memory.weights, p.memory.gradients, p.memory.optimizer) == (
        params * b.weight, params * b.gradient, params * b.optimizer)
    assert p.memory.stage == base.memory.stage == 0  # 1F1B: the first stage holds two micro-batches
    assert p.memory.activations == pytest.approx(base.memory.activations * b.activations, rel=1e-6)


def test_a_memory_limit_refuses_exactly_above_it_and_names_it() -> None:
    o = PlanOptions(global_batch=420, precision="fp32", micro_batch_cap=36, recompute=("selective",), offload=(False,))
    need = evaluate(TINY, Layout(1, 1, 3, zero=1), H100, options=o)
    tensors = need.memory.total - need.memory.reserve
    at = evaluate(TINY, Layout(1, 1, 3, zero=1), H100, memory_limit_bytes=tensors, options=o)
    below = evaluate(TINY, Layout(1, 1, 3, zero=1), H100, memory_limit_bytes=tensors - 1, options=o)
    assert need.micro_batch == 35 and at.fits and not below.fits
    assert "> the job's memory limit of" in below.reason
    # a limit above the device's budget changes nothing
    assert evaluate(TINY, Layout(1, 1, 3, zero=1), H100, memory_limit_bytes=10**15, options=o).fits
    # on two GPUs under the demo's limit only a split of the layers fits
    fits = {str(p.layout) for p in feasible_layouts(TINY, 2, H100, memory_limit_bytes=22_700_000, options=o)
            if p.gpus_used == 2}
    assert "tp1.pp2.dp1" in fits and not any(t.startswith("tp1.pp1.dp2") for t in fits)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"precision": "fp16"}, "precision='fp16': choose from bf16-mixed, fp32, fp64"),
    ({"memory_limit_bytes": 0}, "memory_limit_bytes=0: must be >= 1"),
    ({"micro_batch_cap": 0}, "micro_batch_cap=0: must be >= 1"),
])
def test_bad_options_are_refused_naming_the_field(kw, needle) -> None:
    with pytest.raises(SpecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        PlanOptions(**kw)
