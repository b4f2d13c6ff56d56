"""A training job that fails under the controller (a worker crashed): its GPUs are reclaimed with the
reason on record, never left held by a dead job, and it starts afresh when GPUs allow. Fake backend (our
boundary) with a failed runtime injected; real store on SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.phases import JobPhase

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10},
                  "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
}


class Recording(FakeBackend):
    """The fake, plus: a stop request for a failed job is what a real backend would get."""

    def set_job_gpus(self, spec, gpus, layout):
        rt = self.jobs.get(spec.name)
        if rt is not None and rt.phase == "Failed" and gpus:
            raise AssertionError("a failed job must be stopped, not rescaled")
        return super().set_job_gpus(spec, gpus, layout)


@pytest.mark.parametrize("load_after", [10.0, 40.0])
def test_failed_job_is_reclaimed_with_its_reason_and_restarted(db_url: str, load_after: float) -> None:
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    backend, source, t = Recording({"n0": 4, "n1": 4}), InProcessSource(max_age=600), [1_000_000.0]
    ctl = Controller(load_config(data=CONFIG), backend, store, {"chat": source}, owner="a", clock=lambda: t[0])
    source.set("chat", 10.0, t[0])
    assert ctl.tick().error is None and backend.jobs["pretrain"].gpus
    # 1. a worker dies: the backend reports the job Failed, still "holding" its GPUs
    backend.jobs["pretrain"] = replace(backend.jobs["pretrain"], phase=JobPhase.FAILED, error="worker w3 exited with code -9")
    backend.calls.clear()
    t[0] += 30
    source.set("chat", load_after, t[0])
    res = ctl.tick()
    # 2. the job was stopped first (its GPUs back in the pool), then the plan ran, and it started afresh
    assert res.error is None, res.error
    assert res.applied[0] == "stop_failed_training pretrain: worker w3 exited with code -9", res.applied
    assert backend.calls[0] == ("job", "pretrain", 0), backend.calls
    rt = backend.jobs.get("pretrain")
    assert rt is not None and rt.phase == "Running" and rt.generation == 0, rt  # a fresh start
    # 3. nobody holds a GPU twice; the action carries the reason
    held = [g for gs in backend.services.values() for g in gs] + list(rt.gpus)
    assert len(held) == len(set(held)) <= 8
    if load_after > 10:
        assert len(backend.services["chat"]) == 4
    assert db.open_actions(store, "p") == []
    store.dispose()
