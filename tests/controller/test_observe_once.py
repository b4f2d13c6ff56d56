"""One tick observes each job once: a ``job_runtime`` call per job at step 1, and one more per job
only after the tick acted on it (a start, rescale, stop, pause or relayout). What a tick records for
a job it acted on is that job after the action, never the runtime step 1 saw before it.

Fake backend at our own boundary (counting its ``job_runtime`` reads), real store on SQLite and
PostgreSQL."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from elastic import store as db
from elastic.backends.base import JobRuntime
from elastic.config import load_config
from elastic.controller import Controller
from elastic.controller.observe import Observed
from elastic.metrics import InProcessSource
from elastic.model import GPU, Layout
from elastic.phases import JobPhase
from tests.fakes import Clock, tick

from .fake_backend import FakeBackend
from .test_controller import CONFIG as BASE_CONFIG

# 8 GPUs: one chat replica at load 10 leaves 7 for the two jobs ("first" before "second" by
# priority); each step of 10 in load takes one more GPU for chat, off the lower-priority job first
CONFIG = {**BASE_CONFIG,
          "jobs": [{"name": "first", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 4, "global_batch": 64,
                    "priority": 10},
                   {"name": "second", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 4, "global_batch": 64}]}
JOBS = ("first", "second")


class CountingBackend(FakeBackend):
    """The fake, plus: every ``job_runtime`` read in order (``reads``), to count them per tick."""

    def __init__(self, nodes: dict[str, int]) -> None:
        super().__init__(nodes)
        self.reads: list[str] = []

    def job_runtime(self, job: str) -> JobRuntime | None:
        self.reads.append(job)
        return super().job_runtime(job)


@dataclass
class Env:
    ctl: Controller
    backend: CountingBackend
    source: InProcessSource
    clock: Clock
    store: db.Store

    def tick(self, load: float) -> tuple[Any, list[str]]:
        """One tick at ``load``; its result and the jobs it read, in order."""
        self.backend.reads.clear()
        res = tick(self.ctl, self.source, self.clock, load)
        return res, list(self.backend.reads)

    def settle(self, load: float) -> None:
        """Tick at ``load`` until a tick changes nothing."""
        for _ in range(5):
            res, _ = self.tick(load)
            if not res.applied and all(st.action == "noop" for st in res.plan.steps):
                return
        raise AssertionError(f"no steady state at load {load}: {res.applied}")

    def status(self, job: str) -> dict[str, Any]:
        rec = db.get_job(self.store, job)
        assert rec is not None and rec.status is not None
        return rec.status


@pytest.fixture
def second(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings of the job ``second`` over CONFIG's (a test parametrizes it indirectly)."""
    return dict(getattr(request, "param", {}))


@pytest.fixture
def env(db_url: str, second: dict[str, Any]) -> Iterator[Env]:
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()
    backend = CountingBackend({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    data = copy.deepcopy(CONFIG)
    data["jobs"][1].update(second)
    ctl = Controller(load_config(data=data), backend, store, {"chat": source}, owner="ctl-a", clock=clock)
    yield Env(ctl, backend, source, clock, store)
    store.dispose()


def _training_steps(res: Any) -> dict[str, str]:
    return {st.workload: st.action for st in res.plan.steps if st.action.endswith("training")}


def _status_of(rt: JobRuntime) -> tuple[str, str, int, int]:
    """(phase, layout, generation, world size) as a job's status must show ``rt``."""
    assert rt.layout is not None
    layout = f"paused:{rt.layout}" if rt.phase == JobPhase.PAUSED else str(rt.layout)
    return rt.phase, layout, rt.generation, len(rt.gpus)


def _recorded(env: Env, job: str) -> tuple[str, str, int, int]:
    s = env.status(job)
    return s["phase"], s["layout"], s["generation"], s["worldSize"]


@pytest.mark.parametrize(("second", "load", "acted"), [
    pytest.param({}, 10.0, {}, id="steady"),
    # one more chat replica: its GPU comes off the lower-priority job
    pytest.param({}, 20.0, {"second": "shrink_training"}, id="shrink"),
    # four more: "second" cannot keep its minimum of 3 and is paused, "first" shrinks
    pytest.param({"min_gpus": 3}, 50.0, {"first": "shrink_training", "second": "pause_training"}, id="pause"),
], indirect=["second"])
def test_a_tick_reads_each_job_once_and_once_more_after_acting_on_it(env: Env, second: Any, load: float,
                                                                      acted: dict[str, str]) -> None:
    env.settle(10.0)
    before = {j: env.backend.jobs[j] for j in JOBS}
    res, reads = env.tick(load)
    assert _training_steps(res) == acted, res.plan.steps
    # step 1 reads each job; the record step each job acted on once more, after the action
    assert reads == list(JOBS) + [j for j in JOBS if j in acted]
    for job in JOBS:
        now = env.backend.jobs[job]
        # the action changed what the status shows (so a status from step 1's read would differ)
        assert (_status_of(now) != _status_of(before[job])) == (job in acted), (job, before[job], now)
        # a job acted on is recorded as it is after the action; one left alone as step 1 saw it
        assert _recorded(env, job) == _status_of(now), job


def test_a_reaped_and_restarted_job_is_read_after_each_action(env: Env) -> None:
    env.settle(10.0)
    env.backend.jobs["second"] = replace(env.backend.jobs["second"], phase=JobPhase.FAILED, error="worker w1 exited")
    res, reads = env.tick(10.0)
    assert res.applied[0] == "stop_failed_training second: worker w1 exited", res.applied
    assert _training_steps(res) == {"second": "grow_training"}, res.plan.steps  # afresh, on the GPUs it freed
    # step 1 reads both; the failed job again before its start (its stop acted on it) and after it
    assert reads == ["first", "second", "second", "second"]
    assert _recorded(env, "second") == _status_of(env.backend.jobs["second"])


def _rt(name: str, generation: int) -> JobRuntime:
    return JobRuntime(name, JobPhase.RUNNING, Layout(1, 1, 1), (GPU("n0", 0),), generation)


@pytest.mark.parametrize(("growing_at_read", "growing_at_use", "act", "reads"), [
    # (jobs growing when step 1 reads, jobs growing at the later uses, acted on between, reads after step 1)
    pytest.param(set(), set(), None, [], id="left-alone"),
    pytest.param(set(), set(), "a", ["a"], id="acted-on"),
    pytest.param(set(), set(), "chat", [], id="a-service-acted-on"),
    pytest.param({"a"}, {"a"}, None, [], id="grow-still-in-flight"),
    pytest.param({"a"}, set(), None, ["a"], id="grow-ended-since"),
    pytest.param({"a"}, set(), "a", ["a"], id="grow-ended-and-acted-on"),
])
def test_observed_reads_a_job_again_once_after_it_moved(growing_at_read: set[str], growing_at_use: set[str],
                                                         act: str | None, reads: list[str]) -> None:
    """``Observed`` alone: each use after step 1 reads the backend only for a job that moved since."""
    generation = {"a": 0, "b": 0}
    calls: list[str] = []

    def read(job: str) -> JobRuntime:
        calls.append(job)
        return _rt(job, generation[job])

    growing = set(growing_at_read)
    obs = Observed(read, ["a", "b"], lambda job: job in growing)
    assert calls == ["a", "b"]
    generation["a"] = generation["b"] = 1  # both moved in the backend meanwhile
    growing = set(growing_at_use)
    if act is not None:
        obs.acted(act)
    calls.clear()

    def generation_seen(job: str) -> int:
        rt = obs.runtime(job)
        assert rt is not None
        return rt.generation

    seen = {job: [generation_seen(job) for _ in range(3)] for job in ("a", "b")}
    assert calls == reads
    assert seen == {job: [1 if job in reads else 0] * 3 for job in ("a", "b")}
