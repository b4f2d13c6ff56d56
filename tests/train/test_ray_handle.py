"""Real local Ray with 8 logical GPUs: a job started on 4 worker actors, grown to 8 and shrunk to 2
through ``TrainingJobHandle.rescale``; Ray reports the leavers' GPUs available again after each shrink,
and every worker ends by returning its exit code (no actor "died unexpectedly")."""

from __future__ import annotations

import os

import pytest

from elastic.model import Layout, load_model
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions
from tests.train import _mp

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(480)]

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)
MEMORY_VARS = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")
ENV_BEFORE: dict[str, str | None] = {}  # the driver's values before init_local_ray


@pytest.fixture(scope="module")
def ray_local():
    from elastic.train.ray_handle import init_local_ray

    ENV_BEFORE.update({k: os.environ.get(k) for k in MEMORY_VARS})
    ray = init_local_ray(num_gpus=8, num_cpus=2)
    yield ray
    ray.shutdown()


def test_local_ray_workers_start_with_the_memory_settings(ray_local) -> None:
    from elastic.train.procenv import worker_memory_env

    @ray_local.remote(num_cpus=0)
    def env() -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in MEMORY_VARS}

    assert ray_local.get(env.remote()) == worker_memory_env(os.environ)
    # the driver's own environment is as it was before init_local_ray
    assert {k: os.environ.get(k) for k in MEMORY_VARS} == ENV_BEFORE and ENV_BEFORE


def free_gpus(ray) -> float:
    return ray.available_resources().get("GPU", 0.0)


def test_start_4_grow_8_shrink_2_frees_gpus_in_ray(ray_local) -> None:
    from elastic.train.ray_handle import TrainingJobHandle

    ray = ray_local
    assert free_gpus(ray) == 8
    h = TrainingJobHandle("ray-job", CFG, options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60))
    try:
        h.start("tp1.pp2.dp2", [f"w{i}" for i in range(4)], timeout=240)
        assert free_gpus(ray) == 4
        grow = h.rescale("tp2.pp2.dp2", [f"w{i}" for i in range(8)], timeout=300)
        assert grow.to_layout == Layout.parse("tp2.pp2.dp2") and sorted(grow.record.joiners) == [f"w{i}" for i in range(4, 8)]
        assert free_gpus(ray) == 0
        shrink = h.rescale("tp1.pp1.dp2", ["w5", "w2"], timeout=300)
        assert len(shrink.record.leavers) == 6 and shrink.bytes_moved > 0
        assert free_gpus(ray) == 6, "the six leavers' GPUs must be free in Ray once rescale() returns"
        # a leaver returns from run() and the handle ends its actor: no "worker died ... unexpected system
        # error" from Ray, and the exit code comes back (os._exit inside the actor read as a crash)
        assert {w: h.exit_reasons.get(w) for w in shrink.record.leavers} == {
            w: "exited with code 0" for w in shrink.record.leavers}
        h.wait_step(shrink.switch_step + 1, timeout=120)
        st = h.status()
        assert (st.phase, st.generation, st.layout, sorted(st.workers)) == ("running", 3, Layout.parse("tp1.pp1.dp2"), ["w2", "w5"])
        assert st.last_rescale is not None and st.last_rescale.pause_seconds is not None
    finally:
        final = h.stop()
    assert free_gpus(ray) == 8 and final.error is None
    assert {h.exit_reasons.get(w) for w in ("w2", "w5")} == {"exited with code 0"}  # stopped, not killed
    hist = h.history()
    assert [r.step for r in hist] == list(range(len(hist)))
    ref = _mp.reference_losses(CFG, len(hist))  # one intra-op thread: fast on a busy 2-core VM
    for r in hist:
        assert r.loss == pytest.approx(ref[r.step], abs=1e-4), f"step {r.step} ({r.layout})"
