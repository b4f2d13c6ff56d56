"""Operations hygiene of the controller: a quiet log, a decision log of changes, bounded history.

An hour of ``elastic serve`` on ``examples/pool.yaml`` is driven here as 720 ticks with an
injected clock (5 s apart, no waiting) against the fake backend (our boundary) and a real
SQLite store: steady load with a few real changes (a load rise, its fall, a metrics gap).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from tests.fakes import Clock

from .fake_backend import FakeBackend

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pool.yaml"



class Lines(logging.Handler):
    """Every record our loggers emit at INFO or above, as the log would show it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> list[str]:
        return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records]


@pytest.fixture
def lines():
    h, logger = Lines(), logging.getLogger("elastic")
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    yield h
    logger.removeHandler(h)
    logger.setLevel(old)


def _controller(tmp_path: Path, data: dict | None = None, owner: str = "ctl-a", store=None):
    cfg = load_config(EXAMPLE) if data is None else load_config(data=data)
    url = f"sqlite:///{tmp_path / 'elastic.db'}"
    if store is None:
        db.upgrade(url)
        store = db.Store.from_url(url)
    clock, source = Clock(1_700_000_000.0), InProcessSource(max_age=60)
    ctl = Controller(cfg, FakeBackend({"n0": cfg.pool.gpus_per_node}), store, {"chat": source}, owner=owner,
                     clock=clock)
    return ctl, store, clock, source


def _load(t: int) -> float | None:
    """Replica load over the hour (seconds from the start): steady around 5 (target 6.5 per
    replica), a rise to 3-4 replicas' worth at 15 min, back at 30 min, metrics gone 45-47 min."""
    wobble = ((t * 7919) % 13) / 10.0 - 0.6  # deterministic noise, +-0.6
    if 45 * 60 <= t < 47 * 60:
        return None
    if 15 * 60 <= t < 30 * 60:
        return 21.0 + wobble
    return 5.0 + wobble


def test_an_hour_of_serve_writes_few_log_lines_and_decision_rows_and_every_change_with_its_reason(
        tmp_path, lines) -> None:
    ctl, store, clock, source = _controller(tmp_path)
    acted: list[tuple[float, list[str]]] = []
    try:
        for i in range(720):
            clock.t += 5
            load = _load(i * 5)
            if load is None:
                source.clear("chat")
            else:
                source.set("chat", load, clock.t)
            res = ctl.tick()
            assert res.error is None, res.error
            changes = [a for a in res.applied if not a.startswith("drain_ahead")]
            if changes:
                acted.append((clock.t, changes))
            ctl.housekeep()
        rows = db.list_decisions(store, 1000, pool="local")
        reshards = db.list_reshards(store, job="gpt-tiny", limit=1000)
    finally:
        store.dispose()
    log = lines.text()
    print(f"\n720 ticks: {len(log)} INFO+ lines, {len(rows)} decision rows, {len(acted)} ticks acted, "
          f"{len(reshards)} reshards\n" + "\n".join(log))

    assert len(log) < 100 and len(rows) < 100
    assert sum(r.count for r in rows) == 720  # every tick is on record, in a row of its own or a run
    # a few real changes happened: replicas up for the rise, down after it, training around them
    kinds = {a.split()[0] for _, applied in acted for a in applied}
    assert {"scale_inference_up", "scale_inference_down", "shrink_training", "grow_training"} <= kinds, kinds
    # every tick that changed something is a change row of its own, at that tick, with its reason and steps
    changes = {r.tick_at.timestamp(): r for r in rows if r.hold is None and r.reason != "Recovered"}
    assert sorted(changes) == [t for t, _ in acted]
    for t, applied in acted:
        rec = changes[t]
        assert rec.count == 1 and rec.reason and rec.message
        steps = {f"{s['action']} {s['workload']}": s for s in rec.plan["steps"]}
        for a in applied:
            assert a in steps and steps[a]["reason"] and steps[a]["message"], (a, rec.plan)
    # every rescale is in the reshard history with its bytes and pause, and in the log with them
    assert reshards and all(r.status == "done" and r.bytes_moved and r.pause_seconds is not None for r in reshards)
    rescaled = [m for m in log if "rescaled gpt-tiny" in m]
    assert len(rescaled) == len(reshards)
    assert all(" moved " in m and "paused" in m for m in rescaled)
    assert len([m for m in log if " decision " in m or ": decision " in m]) == len(acted)
    # the metrics gap is a fail-safe hold of its own, logged once when it starts
    gap = [r for r in rows if r.hold is not None and "MetricsMissing" in str(r.inputs)]
    assert len(gap) == 1 and gap[0].count >= 20
    assert len([m for m in log if "holding" in m and "MetricsMissing" in m]) == 1
    # no line for a plain steady tick; the lease is gained once
    assert len([m for m in log if "leading pool local" in m]) == 1


def test_lease_gained_and_lost_are_logged_once_each(tmp_path, lines) -> None:
    a, store, clock, source = _controller(tmp_path)
    b, _, _, _ = _controller(tmp_path, owner="ctl-b", store=store)
    b.clock = a.clock
    b.sources = a.sources
    try:
        for _ in range(3):
            clock.t += 5
            source.set("chat", 5.0, clock.t)
            a.tick()
            b.tick()
        clock.t += 60  # a stops renewing; b takes over
        source.set("chat", 5.0, clock.t)
        b.tick()
        a.tick()
        a.tick()
    finally:
        store.dispose()
    log = lines.text()
    assert len([m for m in log if "leading pool local: lease taken by ctl-a" in m]) == 1
    assert len([m for m in log if "standing by: the lease of pool local is held by ctl-a" in m]) == 1
    assert len([m for m in log if "leading pool local: lease taken by ctl-b" in m]) == 1
    lost = [r for r in lines.records if "lost the lease of pool local to ctl-b" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING


def test_an_unreachable_backend_is_logged_when_it_starts_and_ends_not_every_tick(tmp_path, lines) -> None:
    ctl, store, clock, source = _controller(tmp_path)
    try:
        clock.t += 5
        source.set("chat", 5.0, clock.t)
        ctl.tick()
        ctl.backend.set_reachable(False)
        for _ in range(10):
            clock.t += 5
            assert ctl.tick().reason == "Unavailable"
        ctl.backend.set_reachable(True)
        clock.t += 5
        source.set("chat", 5.0, clock.t)
        assert ctl.tick().error is None
    finally:
        store.dispose()
    log = lines.text()
    assert len([m for m in log if "not acting" in m]) == 1
    assert len([m for m in log if "acting again" in m]) == 1


RETAINED = {"pool": {"name": "p", "nodes": 1, "gpus_per_node": 2, "hardware": "h100-80g"},
            "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 1,
                          "metric": {"preset": "vllm-running", "target": 10}}],
            "controller": {"tick_seconds": 5, "retention": {"decisions_days": 1, "allocations_days": 1,
                                                            "actions_days": 1, "batch_rows": 4,
                                                            "interval_seconds": 600}}}


def test_retention_runs_on_the_lease_holder_between_ticks_in_small_batches(tmp_path, lines) -> None:
    """Old history goes (the leader's passes, at most every interval_seconds, batch_rows at a
    time); a standby's pass deletes nothing; what is younger than the limit stays."""
    ctl, store, clock, source = _controller(tmp_path, data=RETAINED)
    standby, _, _, _ = _controller(tmp_path, data=RETAINED, owner="ctl-b", store=store)
    standby.clock = ctl.clock
    try:
        for k in range(10):  # ten old changes, two days ago
            db.record_decision(store, pool="p", tick_at=_utc(clock.t - 2 * 86400 + k), reason="InferenceDemand",
                               message="old", plan={}, inputs={})
        clock.t += 5
        source.set("chat", 5.0, clock.t)
        assert ctl.tick().error is None and ctl.is_leader
        standby.tick()
        assert not standby.is_leader and standby.housekeep(force=True) == {}
        assert len([d for d in db.list_decisions(store, 100) if d.message == "old"]) == 10
        first = ctl.housekeep()
        assert first["decisions"] == 10  # 4 + 4 + 2: three statements of at most batch_rows
        assert not [d for d in db.list_decisions(store, 100) if d.message == "old"]
        assert db.list_decisions(store, 100)  # this tick's decision stays
        clock.t += 5
        assert ctl.housekeep() == {}  # within interval_seconds: no pass
        clock.t += 600
        assert ctl.housekeep() == {"decisions": 0, "allocations": 0, "actions": 0, "audit": 0}
    finally:
        store.dispose()
    assert len([m for m in lines.text() if "retention: deleted 10 decisions older than 1 d" in m]) == 1


def _utc(t: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, tz=UTC)
