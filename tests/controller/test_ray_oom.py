"""Never out of memory, end to end: the controller on real local Ray, real training workers (gloo),
a real SQLite store, the reference trainer under a per-rank memory limit below what the planner's
first layout needs.

The planner puts the job on ``tp1.pp2.dp1`` (it predicts it fits an H100 easily); the workers'
limit (``TrainConfig.memory_limit_bytes``, standing in for the device's capacity on CPU) is
below what its first pipeline stage holds (1F1B keeps two micro-batches in flight there), so step
0 fails out of memory on that stage while the other waits on it. Nothing fails: both members
give the step up with their state intact and wait; the controller drops the layout (an
``OutOfMemory`` drop on record, naming the layout, the peak the stage reached and the error), moves
the job in place onto the planner's next layout of two GPUs predicted to need less
(``tp2.pp1.dp1``, which fits the limit), which redoes step 0 on the same samples; every loss
equals the never-rescaled single-process run (float64, 1e-9). The dropped layout stays out of
the job's table for later ticks and for a restarted controller, and ``droppedLayouts`` is in the
job's status.
"""

from __future__ import annotations

import pytest
import torch

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.model import Layout, load_model
from elastic.parallel.memory_report import MeasuredMemory, measured_peak
from tests.fakes import Clock
from tests.train._mp import wait_out_of_memory_hold

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(420)]

JOB = "oom-job"
CONFIG = {
    "pool": {"name": "ray-oom", "nodes": 1, "gpus_per_node": 2, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [],
    "jobs": [{"name": JOB, "model": "tiny", "min_gpus": 2, "max_gpus": 2, "global_batch": 8, "micro_batch": 1}],
    "controller": {"tick_seconds": 1},
}
# per rank, float64, this batch: tp1.pp2.dp1 stage 0 4.59 MB, stage 1 4.13 MB; tp2.pp1.dp1 4.11 MB
LIMIT = 4_360_000
STEPS = 6


def _trainer_config(spec):
    from elastic.train.engine import TrainConfig

    return TrainConfig(model=load_model(spec.model), global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                       seed=3, lr=3e-3, dtype=torch.float64, memory_limit_bytes=LIMIT)


def _reference(steps: int) -> list[float]:
    """The never-rescaled run: one process, the same config without the limit."""
    import dataclasses

    from elastic.train.engine import TrainEngine

    cfg = dataclasses.replace(_trainer_config(load_config(data=CONFIG).jobs[0]), memory_limit_bytes=None)
    eng = TrainEngine(cfg, Layout(1, 1, 1), 0)
    return [eng.train_step(s).loss for s in range(steps)]


@pytest.fixture(scope="module")
def ray_local():
    from elastic.train.ray_handle import init_local_ray

    ray = init_local_ray(num_gpus=2, num_cpus=2)
    yield ray
    ray.shutdown()


def test_a_layout_that_runs_out_of_memory_is_dropped_and_the_job_moves_in_place_on_the_same_curve(
        ray_local, tmp_path) -> None:
    from elastic.backends.ray import RayBackend
    from elastic.train.launch import LaunchOptions

    url = f"sqlite:///{tmp_path}/state.db"
    db.upgrade(url)
    store = db.Store.from_url(url)
    cfg = load_config(data=CONFIG)
    backend = RayBackend(cfg.pool, trainer_config=_trainer_config,
                         train_options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120))
    clock = Clock(2_000_000.0)
    ctl = Controller(cfg, backend, store, {}, owner="t", clock=clock)

    def tick():
        clock.t += 5
        res = ctl.tick()
        assert res.error is None, res.error
        return res

    try:
        # 1. the planner's layout of two GPUs; its first step runs out of memory on stage 0
        assert ctl._layout_table(JOB)[2][0] == Layout.parse("tp1.pp2.dp1")
        tick()
        handle = backend.jobs[JOB].handle
        st = wait_out_of_memory_hold(handle, 120)
        assert (st.phase, st.layout, st.step) == ("recovering", Layout.parse("tp1.pp2.dp1"), -1)
        assert (st.out_of_memory["rank"], st.out_of_memory["step"]) == (0, 0)
        peak = measured_peak(MeasuredMemory.from_json(st.out_of_memory["memory"], "out_of_memory.memory"))
        assert peak > LIMIT
        rt = backend.job_runtime(JOB)
        assert rt.phase == "Recovering" and "OutOfMemory" in rt.error

        # 2. the next tick drops the layout and moves the job in place onto one that fits
        res = tick()
        assert any(a.startswith(f"relayout_training {JOB}: tp1.pp2.dp1 -> tp2.pp1.dp1") for a in res.applied), \
            res.applied
        assert backend.jobs[JOB].handle is handle, "the job was restarted, not moved in place"
        handle.wait_step(STEPS - 1, timeout=120)
        hist = handle.history()[:STEPS]
        assert [r.step for r in hist] == list(range(STEPS)) and {r.layout for r in hist} == {Layout.parse("tp2.pp1.dp1")}
        for r, want in zip(hist, _reference(STEPS), strict=True):
            assert r.loss == pytest.approx(want, rel=1e-9, abs=0), f"step {r.step}: {r.loss} vs {want}"

        # 3. on record: the decision names the layout, the measured peak and the reason
        drops = [d for d in db.list_decisions(store, limit=50, pool="ray-oom") if d.reason == "MemoryExceeded"]
        assert len(drops) == 1, [d.message for d in db.list_decisions(store, limit=50, pool="ray-oom")]
        msg, dropped = drops[0].message, drops[0].plan["dropped"]
        print("decision:", msg)
        assert (dropped["layout"], dropped["reason"], dropped["peakBytes"]) == ("tp1.pp2.dp1", "OutOfMemory", peak)
        assert drops[0].plan["to"] == "tp2.pp1.dp1"
        assert f"{peak / 1024**2:.2f} MiB" in msg and "ran out of memory on rank 0 (stage 0)" in msg
        assert "memory_limit_bytes" in msg and "it moves in place to tp2.pp1.dp1" in msg
        (reshard,) = db.list_reshards(store, job=JOB)
        assert (reshard.from_layout, reshard.to_layout, reshard.status) == ("tp1.pp2.dp1", "tp2.pp1.dp1", "done")

        # 4. it trains on: later ticks leave it there, the status carries the drop and the new peak
        tick()
        rt = backend.job_runtime(JOB)
        assert (rt.phase, str(rt.layout)) == ("Running", "tp2.pp1.dp1")
        status = db.get_job(store, JOB).status
        assert [(x["layout"], x["reason"], x["peakBytes"]) for x in status["droppedLayouts"]] == [
            ("tp1.pp2.dp1", "OutOfMemory", peak)]
        assert status["layout"] == "tp2.pp1.dp1" and status["memory"]["layout"] == "tp2.pp1.dp1"
        assert measured_peak(MeasuredMemory.from_json(rt.memory, "memory")) <= LIMIT

        # 5. never picked again: not by this controller's table, nor by a restarted one's
        assert ctl._layout_table(JOB)[2][0] == Layout.parse("tp2.pp1.dp1")
        again = Controller(cfg, backend, store, {}, owner="t2", clock=clock)
        assert again._layout_table(JOB)[2][0] == Layout.parse("tp2.pp1.dp1")
        assert Layout.parse("tp1.pp2.dp1") in again._dropped(JOB)
    finally:
        backend.shutdown()
        store.dispose()
