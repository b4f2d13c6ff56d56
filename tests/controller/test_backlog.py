"""The controller reads a rate metric's backlog beside it and the policy serves it.

A ``request-rate`` metric says how fast requests finish, not how many wait: the controller also
reads the requests waiting (the preset's ``vllm-waiting``, from the same source) and hands them
to the replica policy as its backlog. A backlog read that fails, hangs or is stale is left out:
the rate alone decides, and the tick goes on."""

from __future__ import annotations

import threading

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource, MetricSample
from tests.fakes import Clock

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g"},
    # 10 requests/s a replica; replicas ready 60 s after they are ordered
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 8,
                  "startup_seconds": 60, "metric": {"preset": "request-rate", "target": 10},
                  "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [],
}


def _controller(tmp_path, source) -> tuple[Controller, Clock]:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    db.upgrade(url)
    clock = Clock()
    ctl = Controller(load_config(data=CONFIG), FakeBackend({"n0": 8}), db.Store.from_url(url), {"chat": source},
                     owner="ctl", clock=clock)
    return ctl, clock


def _tick(ctl, source, clock, rate: float, waiting: float | None):
    clock.t += 20
    source.set("chat", rate, clock.t)
    if waiting is not None:
        source.set_backlog("chat", waiting, clock.t)
    res = ctl.tick()
    assert res.error is None, res.error
    return res.replica_decisions["chat"]


def test_a_backlog_beside_the_rate_adds_the_replicas_that_serve_it(tmp_path) -> None:
    src = InProcessSource(max_age=60)
    ctl, clock = _controller(tmp_path, src)
    _tick(ctl, src, clock, 20.0, None)  # from none: the minimum first (bounds before metrics)
    assert _tick(ctl, src, clock, 20.0, None).replicas == 2  # the rate alone: 20/s on 10/s replicas
    # 1200 waiting, served over the 60 s start-up: +20/s -> 40/s -> 4 replicas
    d = _tick(ctl, src, clock, 20.0, 1200.0)
    assert d.replicas == 4 and "backlog 1200 waiting" in d.message, d.message


class _Failing(InProcessSource):
    def __init__(self, how: str) -> None:
        super().__init__(max_age=60)
        self.how, self.release = how, threading.Event()

    def backlog(self, service: str, now: float) -> MetricSample | None:
        if self.how == "raises":
            raise ConnectionError("waiting gauge: connection refused")
        if self.how == "hangs":
            self.release.wait(30)
        return MetricSample(5000.0, now - 3600, "in-process")  # "stale": an hour old


def test_a_backlog_read_that_fails_hangs_or_is_stale_is_left_out(tmp_path) -> None:
    for i, how in enumerate(("raises", "stale", "hangs")):
        src = _Failing(how)
        d = tmp_path / str(i)
        d.mkdir()
        ctl, clock = _controller(d, src)
        try:
            _tick(ctl, src, clock, 20.0, None)  # from none: the minimum first
            dec = _tick(ctl, src, clock, 20.0, None)
            assert dec.replicas == 2 and "backlog" not in dec.message, (how, dec.message)
        finally:
            src.release.set()
