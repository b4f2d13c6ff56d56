"""The demo's training job under its per-GPU memory limit, run by the real trainer (gloo processes).

The demo gives the reference trainer a memory limit (``elastic.demo.config.DEMO_MEMORY_LIMIT``)
at which the planner offers ``tp1.pp2.dp1`` on two GPUs and data parallelism with ZeRO-1 from three
up. Here the trainer built from the demo's own job spec (``default_trainer_config``: fp32, the
micro-batches of ``micro_batch_cap``, the limit) runs one step of the layouts the planner chose, and
the layout it refused at two GPUs:

* every chosen layout's step fits: each rank's measured peak is under the limit, so the controller's
  check (``controller.memory.check_measured``) keeps it, and it runs the micro-batch the planner sized;
* weights, gradients and optimizer state are the planner's fp32 bytes exactly, and the worst rank's
  total is within 10% under the planner's prediction (it errs on the large side);
* the planner refuses ``tp1.pp1.dp2.z1`` on two GPUs, naming the job's limit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic.backends.base import default_trainer_config
from elastic.config import load_config
from elastic.controller.memory import budget_bytes, check_measured, predicted_stage
from elastic.controller.tables import job_throughput_tables
from elastic.demo.config import DEMO_MEMORY_LIMIT, demo_config
from elastic.model import Layout, load_hardware, load_model
from elastic.parallel.memory_report import MeasuredMemory, measured_peak
from elastic.parallel.planner import PlanOptions, evaluate
from elastic.train.engine import TrainEngine
from tests.train._mp import run_workers

CFG = load_config(data=demo_config(5.0, 2.0))
SPEC = CFG.jobs[0]
HW = load_hardware(CFG.pool.hardware)


def _planner_kw() -> dict[str, Any]:
    """The job's planner options as ``PlanOptions`` fields."""
    kw = SPEC.planner_options()
    return {"global_batch": kw["global_batch"], "precision": kw["precision"], "micro_batch_cap": kw["micro_batch_cap"],
            "memory_limit_bytes": kw["memory_limit_bytes"], "recompute": (kw["recompute"],),
            "offload": (kw["offload"],), "vpps": (1,)}


def _step(rank: int, world: int, layout: str) -> dict[str, Any]:
    """One step of the demo job's trainer on ``layout``: this rank's measured memory, or the error."""
    torch.set_num_threads(1)
    eng = TrainEngine(default_trainer_config(SPEC), Layout.parse(layout), rank)
    try:
        eng.train_step(0)
    except torch.OutOfMemoryError as e:
        return {"oom": str(e)}
    finally:
        eng.close()
    assert eng.memory is not None
    return {"memory": eng.memory.as_json()}


def test_the_demo_table_changes_pipeline_depth_and_covers_every_count_training_gets() -> None:
    table = {n: lay for n, (lay, _) in job_throughput_tables(CFG)[SPEC.name].items()}
    assert SPEC.memory_limit_bytes == DEMO_MEMORY_LIMIT and not SPEC.replicate_optimizer
    # inference keeps 1-6 GPUs of 8: training gets 2-7, each with a layout using all of them
    assert all(n in table and table[n].world_size == n for n in range(2, 8)), table
    assert table[2] == Layout.parse("tp1.pp2.dp1"), table
    assert all(table[n] == Layout(1, 1, n, zero=1) for n in range(3, 8)), table
    # two GPUs cannot shard the optimizer enough: the planner says why, naming the job's limit
    o = PlanOptions(gpus_per_node=CFG.pool.gpus_per_node, **_planner_kw())
    p = evaluate(load_model(SPEC.model), Layout.parse("tp1.pp1.dp2.z1"), HW, options=o)
    assert not p.fits and "the job's memory limit" in p.reason, p.reason


@pytest.mark.parametrize("layout", ["tp1.pp2.dp1", "tp1.pp1.dp3.z1"])
def test_a_layout_the_planner_chose_runs_under_the_limit(layout: str) -> None:
    lay = Layout.parse(layout)
    out = run_workers(_step, lay.world_size, layout, timeout=300)
    assert all("memory" in r for r in out), out
    budget = budget_bytes(HW, memory_limit_bytes=SPEC.memory_limit_bytes)
    assert budget == DEMO_MEMORY_LIMIT
    ms = [MeasuredMemory.from_json(r["memory"]) for r in out]
    worst = max(ms, key=measured_peak)
    model = load_model(SPEC.model)
    pred = predicted_stage(model, worst, HW, gpus_per_node=CFG.pool.gpus_per_node)
    assert pred is not None
    trainer = default_trainer_config(SPEC)
    assert worst.micro_batch == trainer.micro_batch_for(lay) and worst.dtype == "float32"
    # exact components in fp32; activations at or a little under the planner's count
    assert (worst.weights, worst.gradients, worst.optimizer) == (pred.weights, pred.gradients, pred.optimizer)
    predicted_total = pred.total - pred.reserve
    print(f"\n{layout}: worst rank {worst.rank} (stage {worst.pp_rank}) measured {measured_peak(worst)} B, "
          f"predicted {predicted_total} B, limit {budget} B")
    assert 0.9 * predicted_total <= measured_peak(worst) <= predicted_total <= budget
    assert all(check_measured(m, budget, 0.0) is None for m in ms)
