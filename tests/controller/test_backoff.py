"""A job whose start keeps failing is tried again after 10, 20, 40, ... seconds (capped), not on every
tick; the reason and the next attempt are in its status, the admin API and ``/metrics``; one that
then runs long enough starts afresh. The failures are injected at our boundary (the fake backend)."""

from __future__ import annotations

from datetime import datetime

import pytest

from elastic import store as db
from elastic.backends.base import BackendError
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from tests.fakes import Clock

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
    "controller": {"tick_seconds": 5, "start_backoff_seconds": 10, "start_backoff_max_seconds": 40},
}


class OOMBackend(FakeBackend):
    """Starting the job fails (its workers are killed) while ``failing``."""

    def __init__(self, nodes: dict[str, int]) -> None:
        super().__init__(nodes)
        self.failing = True
        self.attempts: list[float] = []
        self.now = 0.0

    def set_job_gpus(self, spec, gpus, layout):  # noqa: ANN001, ANN201
        if gpus and spec.name not in self.jobs:
            self.attempts.append(self.now)
            if self.failing:
                raise BackendError(f"{spec.name}: workers OOM-killed while starting")
        return super().set_job_gpus(spec, gpus, layout)



@pytest.fixture
def env(db_url: str):
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock, backend, source = Clock(), OOMBackend({"n0": 4, "n1": 4}), InProcessSource(max_age=60)
    ctl = Controller(load_config(data=CONFIG), backend, store, {"chat": source}, owner="ctl-a", clock=clock)

    def tick():  # noqa: ANN202
        clock.t += 5
        backend.now = clock.t - 1_000_000.0
        source.set("chat", 10.0, clock.t)
        return ctl.tick()

    yield ctl, backend, tick, store
    store.dispose()


def test_a_failing_start_backs_off_exponentially_up_to_the_cap(env) -> None:
    ctl, backend, tick, store = env
    for _ in range(40):  # 200 s of 5 s ticks
        tick()
    # first at 5 s, then 10, 20, 40, 40, ... later: not 40 attempts
    assert backend.attempts == [5, 15, 35, 75, 115, 155, 195], backend.attempts
    status = db.get_job(store, "pretrain").status
    assert status["backoff"]["failures"] == 7 and "OOM-killed" in status["backoff"]["reason"]
    assert status["reason"] == "BackingOff" and "next attempt at" in status["message"]
    nxt = datetime.fromisoformat(status["backoff"]["nextAttemptAt"]).timestamp()
    assert nxt == ctl.clock() - 5 + 40


def test_a_job_that_runs_long_enough_after_a_failure_starts_afresh(env) -> None:
    ctl, backend, tick, store = env
    tick()  # fails once
    backend.failing = False
    while len(backend.attempts) < 2:
        tick()
    assert backend.attempts == [5, 15] and ctl.backoff["pretrain"].failures == 1
    for _ in range(8):  # 40 s of running: the cap
        tick()
    assert "pretrain" not in ctl.backoff and db.get_job(store, "pretrain").status["backoff"] is None
