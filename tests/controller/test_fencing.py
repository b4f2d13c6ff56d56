"""Fenced leadership: two controllers over one store (SQLite and PostgreSQL) and one cluster.

The cluster is the fake backend at our boundary, seen through one view per controller (its
truth shared, so a GPU given twice is refused loudly) that logs who did what. A view can hold
one call at its slow part (the joiners starting) until the test lets it go; at the call's
commit point it asks the controller's fence, as a backend that supports fencing does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource

from .fake_backend import FakeBackend

LEASE = 2.0
WAIT = 30.0  # bound on every wait for an event; none is expected to take more than a few seconds

CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
    "controller": {"tick_seconds": 0.1, "lease_seconds": LEASE},
}


class View(FakeBackend):
    """One controller's view of the shared cluster ``truth``; ``hold`` stops its next job call
    at the slow part until ``release`` is set."""

    def __init__(self, truth: FakeBackend, who: str, log: list[tuple[str, str, str, int]]) -> None:
        super().__init__(truth.nodes)
        self.services, self.jobs = truth.services, truth.jobs  # one truth
        self.who, self.log = who, log
        self.fence: Any = None  # set by the controller
        self.hold = False
        self.entered, self.release = threading.Event(), threading.Event()

    def set_service_gpus(self, spec, gpus) -> None:  # noqa: ANN001
        self.fence()
        super().set_service_gpus(spec, gpus)
        self.log.append((self.who, "service", spec.name, len(gpus)))

    def set_job_gpus(self, spec, gpus, layout):  # noqa: ANN001
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.release.wait(WAIT), "the test never let the held call go"
        self.fence()  # the commit point: nothing has changed in the cluster before it
        out = super().set_job_gpus(spec, gpus, layout)
        self.log.append((self.who, "job", spec.name, len(gpus)))
        return out


def _controller(db_url: str, truth: FakeBackend, who: str, log: list, *, owner: str | None = None
                ) -> tuple[Controller, View, InProcessSource]:
    source = InProcessSource(max_age=600)
    view = View(truth, who, log)
    ctl = Controller(load_config(data=CONFIG), view, db.Store.from_url(db_url), {"chat": source},
                     owner=owner or who)
    return ctl, view, source


def _tick(ctl: Controller, source: InProcessSource, load: float = 10.0) -> Any:
    source.set("chat", load, time.time())
    return ctl.tick()


def _until(pred, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def cluster(db_url: str):
    db.upgrade(db_url)
    truth = FakeBackend({"n0": 4, "n1": 4})
    log: list[tuple[str, str, str, int]] = []
    made: list[Controller] = []

    def make(who: str, owner: str | None = None) -> tuple[Controller, View, InProcessSource]:
        c = _controller(db_url, truth, who, log, owner=owner)
        made.append(c[0])
        return c

    yield make, truth, log
    for c in made:
        c.store.dispose()


def test_a_stalled_leader_taken_over_mid_apply_performs_no_further_action(cluster, caplog) -> None:
    """A's heartbeat stalls (as a stopped process's would) while its apply step waits longer than the
    lease; B takes over and acts; A, let go, performs nothing more, writes nothing and does not crash."""
    make, truth, log = cluster
    a, va, sa = make("a")
    b, vb, sb = make("b")
    a._heartbeat = contextlib.nullcontext  # type: ignore[method-assign] - stalled: no renewal while it waits
    va.hold = True
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("a", _tick(a, sa)))
    t.start()
    assert va.entered.wait(WAIT), "A never reached its job start"
    _until(lambda: _tick(b, sb).acted, "B to take over and act")
    assert b.is_leader and ("b", "job", "pretrain", len(truth.jobs["pretrain"].gpus)) in log
    b_actions = list(log)
    va.release.set()
    t.join(WAIT)
    res = result["a"]
    assert (res.acted, res.reason) == (False, "LeaseLost"), res
    assert not a.is_leader and res.error is None
    assert log == b_actions, log  # nothing of A's landed after B took over
    # A's in-flight action was closed by B's recovery; A wrote nothing after B took over
    actions = db.open_actions(b.store, "p")
    assert actions == [], actions
    holder = db.lease_holder(b.store, "p")
    assert holder is not None and holder.owner == "b"
    # A ticks again: a standby now, no traceback, nothing done
    n = len(log)
    res = _tick(a, sa)
    assert res.reason == "NotLeader" and len(log) == n
    assert not [r for r in caplog.records if r.exc_info]


def test_the_lease_is_renewed_while_a_long_apply_works_so_nobody_takes_over(cluster) -> None:
    """A's apply waits three leases long; its heartbeat keeps the lease: B stands by throughout."""
    make, truth, log = cluster
    a, va, sa = make("a")
    b, _, sb = make("b")
    va.hold = True
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("a", _tick(a, sa)))
    t.start()
    assert va.entered.wait(WAIT)
    epoch = db.lease_holder(a.store, "p").epoch
    deadline = time.monotonic() + 3 * LEASE
    seen = []
    while time.monotonic() < deadline:  # B keeps trying for three lease periods
        seen.append(_tick(b, sb).reason)
        time.sleep(0.05)
    assert set(seen) == {"NotLeader"}, seen
    va.release.set()
    t.join(WAIT)
    assert result["a"].acted and result["a"].error is None, result["a"]
    assert all(e[0] == "a" for e in log) and ("a", "job", "pretrain", len(truth.jobs["pretrain"].gpus)) in log
    assert db.lease_holder(a.store, "p").epoch == epoch  # renewed, never re-taken


def test_two_controllers_given_one_identity_never_both_lead(cluster) -> None:
    """Two processes on one host given the same lease identity: the second waits out the first's
    lease instead of renewing it as its own."""
    make, truth, log = cluster
    a, _, sa = make("a", owner="host-1")
    b, _, sb = make("b", owner="host-1")
    assert _tick(a, sa).acted
    for _ in range(5):
        res_b, res_a = _tick(b, sb), _tick(a, sa)
        assert (res_b.reason, res_a.acted) == ("NotLeader", True), (res_b, res_a)
    assert all(e[0] == "a" for e in log), log


def test_a_write_with_a_stale_epoch_is_refused_in_its_own_transaction(db_url: str) -> None:
    """The DB half of the fence: once B took the lease, A's write fails and leaves nothing behind."""
    from datetime import UTC, datetime, timedelta

    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    try:
        t = datetime(2030, 1, 1, tzinfo=UTC)
        a = db.FencedStore(store, "p", "a")
        a.epoch = db.take_lease(store, "p", "a", 5, now=t, epoch=None)
        assert a.epoch == 1
        db.record_decision(a, pool="p", tick_at=t, reason="Steady", message="a leads", plan={}, inputs={})
        assert db.take_lease(store, "p", "b", 5, now=t + timedelta(seconds=1), epoch=None) is None
        assert db.take_lease(store, "p", "b", 5, now=t + timedelta(seconds=6), epoch=None) == 2
        with pytest.raises(db.LeaseLost, match="b at epoch 2"):
            db.record_decision(a, pool="p", tick_at=t, reason="Steady", message="a again", plan={}, inputs={})
        assert [d.message for d in db.list_decisions(store, pool="p")] == ["a leads"]
        assert not db.renew_lease(store, "p", "a", 5, now=t + timedelta(seconds=7), epoch=1)
        # renewals keep the epoch; the same owner again after expiry is a new one
        assert db.take_lease(store, "p", "b", 5, now=t + timedelta(seconds=8), epoch=2) == 2
        assert db.take_lease(store, "p", "b", 5, now=t + timedelta(seconds=30), epoch=2) == 3
    finally:
        store.dispose()


def test_timeouts_must_be_below_the_lease() -> None:
    from elastic.model import SpecError

    bad = {**CONFIG, "controller": {"lease_seconds": 3, "metrics_timeout_seconds": 3}}
    with pytest.raises(SpecError, match="metrics_timeout_seconds=3 must be below lease_seconds=3"):
        load_config(data=bad)
    cfg = load_config(data={**CONFIG, "controller": {"lease_seconds": 3}})
    assert cfg.controller.metrics_timeout() == 1.0 and cfg.controller.backend_timeout() == 1.0


def test_a_metric_read_that_never_answers_is_missing_data_within_its_timeout(cluster) -> None:
    """A source that accepts and never answers holds the tick for its timeout, not the lease."""
    make, truth, log = cluster
    a, _, sa = make("a")
    stuck = threading.Event()

    class Hanging:
        def sample(self, service: str, now: float):  # noqa: ANN201
            stuck.wait(WAIT)

    a.sources["chat"] = Hanging()
    started = time.monotonic()
    res = a.tick()
    took = time.monotonic() - started
    stuck.set()
    assert res.error is None, res
    recorded = db.list_decisions(a.store, pool="p", limit=1, newest_first=True)[0]
    assert recorded.inputs["metrics"]["chat"] is None  # missing data (never zero), recorded as such
    assert took < WAIT / 2, took  # the source was not waited out
