"""The decision log keeps changes and runs of holds; retention bounds every history table.

Real SQLite and the throwaway PostgreSQL (``db_url``), no fakes.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from elastic import store as db
from elastic.model import GPU
from elastic.store.repo import HISTORY

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOLD_A, HOLD_B = "a" * 40, "b" * 40


def _decide(store, t: datetime, reason: str = "Steady", hold: str | None = HOLD_A, pool: str = "p",
            inputs: dict | None = None) -> int:
    return db.record_decision(store, pool=pool, tick_at=t, reason=reason, message=f"{reason} message",
                              plan={"steps": []}, inputs=inputs or {}, hold=hold)


def test_identical_holds_are_one_row_and_a_change_or_another_hold_starts_a_new_one(store) -> None:
    first = _decide(store, T0, inputs={"tick": 0})
    for i in range(1, 5):
        assert _decide(store, T0 + timedelta(seconds=5 * i), inputs={"tick": i}) == first
    other_pool = _decide(store, T0 + timedelta(seconds=21), pool="q")
    assert other_pool != first and _decide(store, T0 + timedelta(seconds=25), inputs={"tick": 5}) == first
    change = _decide(store, T0 + timedelta(seconds=30), reason="InferenceDemand", hold=None)
    after = _decide(store, T0 + timedelta(seconds=35))
    fail_safe = _decide(store, T0 + timedelta(seconds=40), hold=HOLD_B)
    assert len({first, change, after, fail_safe}) == 4  # a change, then the same hold again: a new run

    rows = db.list_decisions(store, pool="p")
    assert [(r.id, r.count, r.tick_at, r.last_at) for r in rows] == [
        (first, 6, T0, T0 + timedelta(seconds=25)), (change, 1, T0 + timedelta(seconds=30), T0 + timedelta(seconds=30)),
        (after, 1, T0 + timedelta(seconds=35), T0 + timedelta(seconds=35)),
        (fail_safe, 1, T0 + timedelta(seconds=40), T0 + timedelta(seconds=40))]
    assert rows[0].inputs == {"tick": 5}  # the run's latest tick's inputs
    assert [r.id for r in db.list_decisions(store, pool="p", changes_only=True)] == [change]
    assert [r.id for r in db.list_decisions(store, pool="p", changes_only=True, newest_first=True)] == [change]
    with pytest.raises(ValueError, match="hold="):
        _decide(store, T0, hold="")


def _history(store, t: datetime, n: int) -> None:
    """``n`` of each history row at ``t``, every one finished/closed, plus one open/in-flight each."""
    for i in range(n):
        _decide(store, t + timedelta(seconds=i), reason="InferenceDemand", hold=None)
        db.set_allocation(store, "p", f"w{i}", [GPU("n0", 0)], 1, kind="inference", now=t)
        db.release_allocation(store, "p", f"w{i}", now=t + timedelta(seconds=1))
        rid = db.start_reshard(store, job=f"j{i}", pool="p", generation=1, from_layout="tp1.pp1.dp1",
                               to_layout="tp1.pp1.dp2", bytes_planned=0, bytes_lower_bound=0, now=t)
        db.finish_reshard(store, rid, bytes_moved=1, pause_seconds=0.1, now=t)
        db.finish_action(store, db.begin_action(store, pool="p", kind="k", workload="w", now=t), now=t)
        db.record_audit(store, actor="me", action="a", now=t)


def test_purge_deletes_old_rows_in_bounded_batches_and_never_what_is_open(store) -> None:
    _history(store, T0, 7)
    db.set_allocation(store, "p", "held", [GPU("n1", 0)], 1, kind="training", now=T0)  # open: stays
    db.start_reshard(store, job="busy", pool="p", generation=1, from_layout="a", to_layout="b", bytes_planned=0,
                     bytes_lower_bound=0, now=T0)  # in flight: stays
    db.begin_action(store, pool="p", kind="k", workload="busy", now=T0)  # in flight: stays
    _history(store, T0 + timedelta(days=40), 2)  # young: stays
    cutoff = T0 + timedelta(days=30)
    for table in HISTORY:
        batches = []
        while (n := db.purge_history(store, table, cutoff, limit=3)) > 0:
            batches.append(n)
        assert batches == [3, 3, 1], (table, batches)  # 7 old rows in batches of at most 3
    stats = {s.table: s for s in db.history_stats(store)}
    assert {t: s.rows for t, s in stats.items()} == {"decisions": 2, "allocations": 3, "audit": 2, "reshards": 3,
                                                     "actions": 3}
    assert stats["decisions"].oldest == T0 + timedelta(days=40)
    assert stats["allocations"].oldest == T0 + timedelta(days=40, seconds=1)  # the open one has not ended
    assert db.current_allocations(store, "p")["held"].gpus == (GPU("n1", 0),)
    assert [r.job for r in db.in_flight_reshards(store, "p")] == ["busy"]
    assert [a.workload for a in db.open_actions(store, "p")] == ["busy"]
    with pytest.raises(ValueError, match="one of decisions"):
        db.purge_history(store, "pools", cutoff)
    with pytest.raises(ValueError, match="limit=0"):
        db.purge_history(store, "decisions", cutoff, limit=0)


def test_stats_and_size_of_an_empty_and_a_used_store(store) -> None:
    assert all(s.rows == 0 and s.oldest is None for s in db.history_stats(store))
    empty = db.database_size(store)
    assert empty > 0
    _history(store, T0, 50)
    assert db.database_size(store) > empty


# ---- a simulated month ---------------------------------------------------------------------------------

TICK_S = 5
CHANGE_EVERY_S = 3600  # a busy diurnal pool: a real change (a rescale) every hour, steady between
RETENTION_DAYS = 30
MONTH_BOUND_BYTES = 8 * 2**20  # what a month of such a pool may take, retention enforced
MONTH_GROWTH_BYTES = 2**20  # what a further month may add (the kept reshard events)
PLAN = {"steps": [{"action": "shrink_training", "workload": "pretrain", "reason": "InferenceDemand",
                   "message": "tp1.pp2.dp3 -> tp1.pp2.dp2 for 2 more replicas of chat"},
                  {"action": "scale_inference_up", "workload": "chat", "reason": "InferenceDemand",
                   "message": "scale up 1 -> 3 replicas (1 GPUs each)"}],
        "allocation": {"chat": [f"n0:{i}" for i in range(3)], "pretrain": [f"n1:{i}" for i in range(4)]},
        "applied": ["shrink_training pretrain", "scale_inference_up chat"], "error": None,
        "jobs": {"pretrain": {"name": "pretrain", "gpus_before": 6, "gpus": 4, "layout": "tp1.pp2.dp2",
                             "tokens_per_second": 123456.7, "status": "running", "reason": "InferenceDemand",
                             "message": "shrinks for inference"}}}
INPUTS = {"metrics": {"chat": {"value": 31.5, "stale": False}},
          "replicas": {"chat": {"current": 1, "desired": 3, "leaving": 0, "reason": "ScaledUp",
                                "message": "load 31.5 / target 10 per replica -> 3 replicas"}}}


def _simulate(store, start: datetime, days: int) -> int:
    """What the controller writes for ``days`` of a pool whose load changes every hour: per
    change one decision, two allocations (closing the previous ones), a reshard and two actions,
    and between changes a run of holds, of which the first and the last tick are written here
    (every tick in between extends the same row, as the last one does), one transaction per
    simulated hour. A retention pass runs once a simulated day (the lease holder's run every
    few minutes), followed on PostgreSQL by what autovacuum does.
    Returns the ticks simulated."""
    runs = days * 86400 // CHANGE_EVERY_S
    steady = {"steps": [], "allocation": PLAN["allocation"], "applied": [], "error": None, "jobs": PLAN["jobs"]}
    for k in range(runs):
        t = start + timedelta(seconds=k * CHANGE_EVERY_S)
        with store.session() as s:
            db.record_decision(s, pool="p", tick_at=t, reason="InferenceDemand", message="m", plan=PLAN,
                               inputs=INPUTS)
            db.set_allocation(s, "p", "chat", [GPU("n0", i) for i in range(1 + k % 3)], k, kind="inference", now=t)
            db.set_allocation(s, "p", "pretrain", [GPU("n1", i) for i in range(4 + k % 2)], k, kind="training",
                              now=t)
            rid = db.start_reshard(s, job="pretrain", pool="p", generation=k + 1, from_layout="tp1.pp2.dp2",
                                   to_layout="tp1.pp2.dp3", bytes_planned=2**30, bytes_lower_bound=2**29, now=t)
            db.finish_reshard(s, rid, bytes_moved=2**30, pause_seconds=1.5, now=t)
            for w in ("pretrain", "chat"):
                db.finish_action(s, db.begin_action(s, pool="p", kind="scale", workload=w, payload=PLAN["steps"][0],
                                                    now=t), now=t)
            if k % 24 == 0:
                db.record_audit(s, actor="ops", action="service.override", target="service/chat", detail=INPUTS,
                                now=t)
            for tick in (t + timedelta(seconds=TICK_S), t + timedelta(seconds=CHANGE_EVERY_S - TICK_S)):
                db.record_decision(s, pool="p", tick_at=tick, reason="Steady", message="steady", plan=steady,
                                   inputs=INPUTS, hold=HOLD_A)
        if (k + 1) % (86400 // CHANGE_EVERY_S) == 0:
            _retention(store, t + timedelta(seconds=CHANGE_EVERY_S))
            _settle(store)
    return runs * CHANGE_EVERY_S // TICK_S


def _retention(store, now: datetime) -> None:
    """What the lease holder's passes do, run to the end (500-row batches)."""
    for table, days in {"decisions": RETENTION_DAYS, "allocations": RETENTION_DAYS, "actions": RETENTION_DAYS,
                        "audit": 365}.items():
        while db.purge_history(store, table, now - timedelta(days=days), 500) == 500:
            pass


def _settle(store) -> None:
    """PostgreSQL: what autovacuum does in production (deleted rows' space becomes reusable)."""
    if store.dialect == "postgresql":
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            for table in ("decisions", "allocations", "pending_actions", "audit_log", "reshard_events"):
                c.exec_driver_sql(f"VACUUM {table}")


def test_a_simulated_month_of_ticks_stays_under_the_stated_size(store, capsys) -> None:
    """Two months of a busy pool at 5 s ticks (over a million ticks): after each month, with the
    retention defaults enforced, the database is under ``MONTH_BOUND_BYTES`` and the second month
    adds little: deleted rows' space is reused, and what grows is the reshard history the
    defaults keep."""
    t0 = time.monotonic()
    month = timedelta(days=RETENTION_DAYS)
    ticks = _simulate(store, T0, RETENTION_DAYS + 1)
    now = T0 + month + timedelta(days=1)
    _settle(store)
    first = db.database_size(store)
    stats = {s.table: s for s in db.history_stats(store)}
    ticks += _simulate(store, now, RETENTION_DAYS)
    now += month
    _settle(store)
    second = db.database_size(store)
    stats2 = {s.table: s for s in db.history_stats(store)}
    with capsys.disabled():
        print(f"\n{store.dialect}: {ticks} ticks simulated; {first / 2**20:.1f} MiB after month 1, "
              f"{second / 2**20:.1f} MiB after month 2; rows {({t: s.rows for t, s in stats2.items()})}; "
              f"{time.monotonic() - t0:.1f} s")
    changes_per_month = RETENTION_DAYS * 86400 // CHANGE_EVERY_S
    day = 86400 // CHANGE_EVERY_S
    # a month (and at most a day) of changes and hold runs: two rows an hour, not 720
    assert stats2["decisions"].rows <= 2 * (changes_per_month + day)
    assert stats2["decisions"].oldest >= now - month - timedelta(days=1)
    assert stats2["allocations"].rows <= 2 * (changes_per_month + day) + 2
    assert stats2["reshards"].rows == stats["reshards"].rows + changes_per_month  # kept
    assert first < MONTH_BOUND_BYTES and second < MONTH_BOUND_BYTES
    assert second - first < MONTH_GROWTH_BYTES, (first, second)
