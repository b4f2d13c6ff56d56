"""Repository round trips on SQLite and PostgreSQL (every test runs on both via ``db_url``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from elastic.model import GPU, Allocation, PoolSpec
from elastic.store import (
    NotFound,
    Store,
    StoreConflict,
    allocation_history,
    begin_action,
    current_allocation,
    current_allocations,
    delete_service,
    finish_action,
    finish_reshard,
    get_decision,
    get_job,
    get_pool,
    get_reshard,
    get_service,
    in_flight_reshards,
    list_audit,
    list_decisions,
    list_jobs,
    list_reshards,
    list_services,
    mark_reshard_running,
    open_actions,
    record_audit,
    record_decision,
    release_allocation,
    set_allocation,
    set_job_status,
    set_service_status,
    start_reshard,
    upsert_job,
    upsert_pool,
    upsert_service,
)
from tests.store.timeline import T0


def test_pool_roundtrip_from_pydantic_spec(store: Store) -> None:
    spec = PoolSpec(name="p", nodes=2, gpus_per_node=4)
    rec = upsert_pool(store, "p", spec, now=T0)
    assert rec.spec == spec.model_dump(mode="json")
    assert (rec.created_at, rec.updated_at) == (T0, T0)
    later = T0 + timedelta(minutes=1)
    rec2 = upsert_pool(store, "p", {"nodes": 3}, now=later)
    assert rec2.spec == {"nodes": 3}
    assert (rec2.created_at, rec2.updated_at) == (T0, later)  # created_at kept on update
    assert get_pool(store, "p") == rec2
    assert get_pool(store, "nope") is None


def test_service_upsert_keeps_status_unless_given(store: Store) -> None:
    spec = {"model": "tiny", "min_replicas": 1, "max_replicas": 4, "tags": ("a", "b")}
    rec = upsert_service(store, "chat", "p", spec, now=T0)
    assert rec.spec["tags"] == ["a", "b"]  # tuples come back as JSON lists on every backend
    assert rec.status == {}
    status = {"current_replicas": 2, "desired_replicas": 3, "observed_value": 41.5, "updated_at": T0.isoformat()}
    set_service_status(store, "chat", status, now=T0 + timedelta(seconds=10))
    rec = upsert_service(store, "chat", "p", {**spec, "max_replicas": 8}, now=T0 + timedelta(seconds=20))
    assert rec.status == status, "upsert without status must keep the recorded status"
    assert rec.spec["max_replicas"] == 8
    rec = upsert_service(store, "chat", "p2", spec, status={"current_replicas": 0}, now=T0 + timedelta(seconds=30))
    assert (rec.pool, rec.status) == ("p2", {"current_replicas": 0})
    assert get_service(store, "chat") == rec
    assert delete_service(store, "chat") is True
    assert get_service(store, "chat") is None
    assert delete_service(store, "chat") is False


def test_list_services_and_jobs_filter_by_pool(store: Store) -> None:
    for name, pool in [("b", "p1"), ("a", "p1"), ("c", "p2")]:
        upsert_service(store, name, pool, {}, now=T0)
        upsert_job(store, f"job-{name}", pool, {}, now=T0)
    assert [r.name for r in list_services(store)] == ["a", "b", "c"]
    assert [r.name for r in list_services(store, pool="p1")] == ["a", "b"]
    assert [r.name for r in list_jobs(store, pool="p2")] == ["job-c"]


def test_job_status_roundtrip_and_missing_job(store: Store) -> None:
    upsert_job(store, "gpt", "p", {"model": "gpt-100m", "global_batch": 64}, now=T0)
    status = {"layout": "tp2.pp2.dp2", "generation": 4, "step": 1200, "phase": "Running"}
    set_job_status(store, "gpt", status, now=T0)
    assert get_job(store, "gpt").status == status
    with pytest.raises(NotFound, match="training job 'ghost' not found"):
        set_job_status(store, "ghost", status, now=T0)


@pytest.mark.parametrize(
    ("value", "field", "error"),
    [
        ([1, 2], "spec", "must be a JSON object"),
        ({"x": object()}, "spec", "not JSON-serialisable"),
        ({"x": float("nan")}, "spec", "not JSON-serialisable"),
    ],
)
def test_bad_json_documents_are_refused_before_writing(store: Store, value: object, field: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        upsert_service(store, "s", "p", value, now=T0)
    assert list_services(store) == []


@pytest.mark.parametrize(
    ("now", "ok"),
    [
        (datetime(2026, 1, 1, 12, 0), False),  # naive: refused (would shift by the UTC offset)
        (datetime(2026, 1, 1, 13, 0, tzinfo=timezone(timedelta(hours=1))), True),  # same instant as T0
        (T0, True),
    ],
)
def test_times_are_utc_aware(store: Store, now: datetime, ok: bool) -> None:
    if not ok:
        with pytest.raises(ValueError, match="naive"):
            upsert_pool(store, "p", {}, now=now)
        return
    rec = upsert_pool(store, "p", {}, now=now)
    assert rec.updated_at == T0 and rec.updated_at.tzinfo == UTC
    assert get_pool(store, "p").updated_at.utcoffset() == timedelta(0)


def test_allocation_history_and_current(store: Store) -> None:
    g = [GPU("n0", i) for i in range(4)]
    a1 = set_allocation(store, "p", "gpt", g[:2], 1, kind="training", now=T0)
    same = set_allocation(store, "p", "gpt", [("n0", 0), ("n0", 1)], 1, kind="training", now=T0 + timedelta(1))
    assert same == a1, "identical allocation must not add history"
    set_allocation(store, "p", "chat", g[2:], 0, kind="inference", now=T0)
    t1 = T0 + timedelta(seconds=60)
    a2 = set_allocation(store, "p", "gpt", g[:1], 2, kind="training", now=t1)
    assert a2.id != a1.id and a2.gpus == (g[0],) and a2.generation == 2

    cur = current_allocations(store, "p")
    assert list(cur) == ["chat", "gpt"]
    assert cur["gpt"].gpus == (g[0],) and cur["gpt"].valid_to is None
    assert current_allocation(store, "p") == Allocation(holdings={"chat": (g[2], g[3]), "gpt": (g[0],)})
    hist = allocation_history(store, "p", "gpt")
    assert [(h.generation, h.valid_to) for h in hist] == [(1, t1), (2, None)]

    assert set_allocation(store, "p", "chat", [], 0, kind="inference", now=t1) is None  # empty = release
    assert release_allocation(store, "p", "gpt", now=t1) is True
    assert release_allocation(store, "p", "gpt", now=t1) is False
    assert current_allocations(store, "p") == {}
    assert current_allocations(store, "other") == {}


def test_allocation_kind_is_checked(store: Store) -> None:
    with pytest.raises(ValueError, match="kind='batch' must be one of inference, training"):
        set_allocation(store, "p", "w", [GPU("n0", 0)], 1, kind="batch", now=T0)


def test_grouped_writes_are_one_transaction(store: Store) -> None:
    """A tick's decision and its allocation commit together or not at all."""
    with pytest.raises(RuntimeError, match="backend died"):
        with store.session() as s:
            record_decision(s, pool="p", tick_at=T0, reason="scale_up", message="m", plan={}, inputs={})
            set_allocation(s, "p", "chat", [GPU("n0", 0)], 1, kind="inference", now=T0)
            raise RuntimeError("backend died")
    assert list_decisions(store) == [] and current_allocations(store, "p") == {}
    with store.session() as s:
        did = record_decision(s, pool="p", tick_at=T0, reason="scale_up", message="m", plan={}, inputs={})
        set_allocation(s, "p", "chat", [GPU("n0", 0)], 1, kind="inference", now=T0)
    assert get_decision(store, did) is not None and "chat" in current_allocations(store, "p")


def test_decision_roundtrip(store: Store) -> None:
    plan = {"steps": [{"action": "shrink_training", "workload": "gpt", "reason": "inference_pressure"}]}
    inputs = {"chat": {"observed": 91.0, "target": 60.0, "replicas": 2}}
    did = record_decision(store, pool="p", tick_at=T0, reason="inference_pressure",
                          message="chat at 91/60 -> 3 replicas; shrink gpt dp4->dp2", plan=plan, inputs=inputs)
    rec = get_decision(store, did)
    assert (rec.pool, rec.tick_at, rec.plan, rec.inputs, rec.reason) == ("p", T0, plan, inputs, "inference_pressure")
    assert rec.message.startswith("chat at 91/60")


def _all_pages(fetch, limit: int) -> list[list[int]]:
    pages, cursor = [], None
    while True:
        page = fetch(limit=limit, after_id=cursor)
        if not page:
            return pages
        pages.append([r.id for r in page])
        cursor = page[-1].id


def test_decisions_keyset_pagination(store: Store) -> None:
    ids = {"a": [], "b": []}
    for i in range(25):
        pool = "a" if i % 3 else "b"
        ids[pool].append(record_decision(store, pool=pool, tick_at=T0 + timedelta(seconds=i), reason="noop",
                                         message=str(i), plan={}, inputs={}))
    every = sorted(ids["a"] + ids["b"])

    pages = _all_pages(lambda **kw: list_decisions(store, **kw), limit=10)
    assert [len(p) for p in pages] == [10, 10, 5]
    assert sum(pages, []) == every

    pages_a = _all_pages(lambda **kw: list_decisions(store, pool="a", **kw), limit=7)
    assert sum(pages_a, []) == ids["a"] and all(len(p) <= 7 for p in pages_a)

    newest = _all_pages(lambda **kw: list_decisions(store, newest_first=True, **kw), limit=10)
    assert sum(newest, []) == every[::-1]

    # A write between pages neither repeats nor skips rows (OFFSET paging would).
    first = list_decisions(store, limit=10)
    new_id = record_decision(store, pool="a", tick_at=T0, reason="noop", message="late", plan={}, inputs={})
    rest = list_decisions(store, limit=1000, after_id=first[-1].id)
    assert [r.id for r in first + rest] == every + [new_id]


@pytest.mark.parametrize("limit", [0, -1, 1001])
def test_page_limit_bounds(store: Store, limit: int) -> None:
    with pytest.raises(ValueError, match=f"limit={limit} must be between 1 and 1000"):
        list_decisions(store, limit=limit)


def test_reshard_lifecycle_and_in_flight(store: Store) -> None:
    rid = start_reshard(store, job="gpt", pool="p", generation=3, from_layout="tp2.pp2.dp2",
                        to_layout="tp2.pp2.dp1", bytes_planned=5 * 2**30, bytes_lower_bound=4 * 2**30,
                        now=T0, status="pending")
    assert [r.id for r in in_flight_reshards(store)] == [rid]
    with pytest.raises(StoreConflict, match=f"job 'gpt' already has reshard {rid} in flight"):
        start_reshard(store, job="gpt", pool="p", generation=4, from_layout="a", to_layout="b",
                      bytes_planned=0, bytes_lower_bound=0, now=T0)
    t1 = T0 + timedelta(seconds=5)
    assert mark_reshard_running(store, rid, now=t1).status == "running"
    done = finish_reshard(store, rid, bytes_moved=5 * 2**30, pause_seconds=2.5, now=t1 + timedelta(seconds=3))
    assert (done.status, done.bytes_moved, done.pause_seconds, done.error) == ("done", 5 * 2**30, 2.5, None)
    assert (done.started_at, done.finished_at) == (t1, t1 + timedelta(seconds=3))
    assert in_flight_reshards(store) == []
    with pytest.raises(StoreConflict, match=f"reshard event {rid} is already done"):
        finish_reshard(store, rid, bytes_moved=0, pause_seconds=0, now=t1)

    rid2 = start_reshard(store, job="gpt", pool="p", generation=4, from_layout="tp2.pp2.dp1",
                         to_layout="tp2.pp2.dp2", bytes_planned=1, bytes_lower_bound=1, now=t1)
    failed = finish_reshard(store, rid2, bytes_moved=None, pause_seconds=None, error="worker 3 lost", now=t1)
    assert (failed.status, failed.error) == ("failed", "worker 3 lost")
    assert get_reshard(store, rid2) == failed
    with pytest.raises(NotFound):
        finish_reshard(store, 10_000, bytes_moved=0, pause_seconds=0, now=t1)


def test_list_reshards_by_job_paginates(store: Store) -> None:
    ids = []
    for i in range(7):
        job = "gpt" if i % 2 == 0 else "llama"
        rid = start_reshard(store, job=job, pool="p", generation=i, from_layout="x", to_layout="y",
                            bytes_planned=2**40, bytes_lower_bound=2**39, now=T0)  # > 2**31: BigInteger
        finish_reshard(store, rid, bytes_moved=2**40, pause_seconds=1.0, now=T0)
        ids.append((job, rid))
    gpt = [rid for job, rid in ids if job == "gpt"]
    pages = _all_pages(lambda **kw: list_reshards(store, "gpt", **kw), limit=3)
    assert sum(pages, []) == gpt and [len(p) for p in pages] == [3, 1]
    assert list_reshards(store, "gpt", limit=1)[0].bytes_planned == 2**40


def test_pending_actions_survive_for_recovery(store: Store) -> None:
    a1 = begin_action(store, pool="p", kind="scale_inference", workload="chat", payload={"to": 3}, now=T0)
    a2 = begin_action(store, pool="p", kind="start_training", workload="gpt", now=T0)
    begin_action(store, pool="q", kind="scale_inference", workload="x", now=T0)
    # a "restarted controller" with a new Store sees what the old one left open
    again = Store.from_url(store.engine.url.render_as_string(hide_password=False))
    try:
        assert [(a.id, a.payload) for a in open_actions(again, pool="p")] == [(a1, {"to": 3}), (a2, {})]
        assert finish_action(again, a1, now=T0).status == "done"
        assert finish_action(again, a2, error="timeout", now=T0).status == "failed"
        assert open_actions(again, pool="p") == []
        with pytest.raises(StoreConflict, match="already done"):
            finish_action(again, a1, now=T0)
    finally:
        again.dispose()


def test_audit_log(store: Store) -> None:
    ids = [record_audit(store, actor="alice", action="set_replicas", target=f"svc-{i}", detail={"replicas": i},
                        now=T0 + timedelta(seconds=i)) for i in range(5)]
    page = list_audit(store, limit=2, newest_first=True)
    assert [e.id for e in page] == ids[::-1][:2]
    assert (page[0].actor, page[0].target, page[0].detail, page[0].at) == (
        "alice", "svc-4", {"replicas": 4}, T0 + timedelta(seconds=4))
    assert [e.id for e in list_audit(store, limit=10, after_id=page[-1].id, newest_first=True)] == ids[::-1][2:]


def test_called_off_work_ends_cancelled_with_its_reason(store) -> None:
    from elastic import store as db

    rid = db.start_reshard(store, job="j", pool="p", generation=1, from_layout="tp1.pp1.dp2",
                           to_layout="tp1.pp1.dp4", bytes_planned=0, bytes_lower_bound=0)
    with pytest.raises(ValueError, match="needs error="):
        db.finish_reshard(store, rid, bytes_moved=None, pause_seconds=None, cancelled=True)
    r = db.finish_reshard(store, rid, bytes_moved=None, pause_seconds=None, error="inference wants them", cancelled=True)
    assert (r.status, r.error, r.bytes_moved) == ("cancelled", "inference wants them", None)
    assert db.in_flight_reshards(store) == []  # finished: a restarted controller has nothing to resume
    aid = db.begin_action(store, pool="p", kind="grow", workload="j")
    a = db.finish_action(store, aid, error="called off", cancelled=True)
    assert a.status == "cancelled" and db.open_actions(store) == []


def test_an_empty_error_message_still_records_a_failure(store) -> None:
    # ``str(e)`` of an exception without a message is "": the work still did not get done
    from elastic import store as db

    rid = db.start_reshard(store, job="j", pool="p", generation=1, from_layout="tp1.pp1.dp2",
                           to_layout="tp1.pp1.dp4", bytes_planned=0, bytes_lower_bound=0)
    assert db.finish_reshard(store, rid, bytes_moved=None, pause_seconds=None, error="").status == "failed"
    aid = db.begin_action(store, pool="p", kind="grow", workload="j")
    assert db.finish_action(store, aid, error="", cancelled=True).status == "cancelled"
