"""Every endpoint of the admin API over a real uvicorn server on loopback, a real store
(SQLite and PostgreSQL) and a real controller driving the fake backend."""

from __future__ import annotations

import pytest

from elastic import store as db

from .conftest import ADMIN, READER, Env, assert_problem, close_env, controller_state, db_state, make_env

SERVICE = {"pool": "p", "spec": {"name": "summarise", "gpus_per_replica": 1, "min_replicas": 0, "max_replicas": 2,
                                 "metric": {"preset": "vllm-running", "target": 5}}}
JOB = {"pool": "p", "spec": {"name": "finetune", "model": "tiny", "min_gpus": 1, "max_gpus": 2, "global_batch": 8}}


def _audit(env: Env) -> list[db.AuditRecord]:
    return db.list_audit(env.store, limit=100)


def test_reads_show_pools_services_jobs_and_controller(env: Env) -> None:
    env.tick(10.0)
    pools = env.get("/api/v1/pools").json()["items"]
    assert [p["name"] for p in pools] == ["p"]
    assert pools[0]["total_gpus"] == 8 and pools[0]["leader"] == "ctl-a"
    assert sum(pools[0]["allocated_gpus"].values()) == 7  # 1 chat replica + pretrain on 6 (no 7-GPU layout)
    assert env.get("/api/v1/pools/p").json()["name"] == "p"
    services = env.get("/api/v1/services").json()["items"]
    assert [s["name"] for s in services] == ["chat"] and services[0]["status"]["desiredReplicas"] == 1
    assert env.get("/api/v1/services", params={"pool": "nope"}).json()["items"] == []
    chat = env.get("/api/v1/services/chat").json()
    assert chat["spec"]["max_replicas"] == 6 and chat["pool"] == "p"
    jobs = {j["name"]: j for j in env.get("/api/v1/jobs").json()["items"]}
    assert set(jobs) == {"big", "pretrain"}
    assert env.get("/api/v1/jobs/pretrain").json()["status"]["layout"] == "tp1.pp3.dp2.z1"
    ctl = env.get("/api/v1/controller").json()
    assert ctl["leader"] and ctl["ready"] and not ctl["paused"] and ctl["last_tick"]["acted"]
    for path, needle in [("/api/v1/pools/nope", "pool 'nope'"), ("/api/v1/services/nope", "service 'nope'"),
                         ("/api/v1/jobs/nope", "job 'nope'"), ("/api/v1/jobs/nope/reshards", "job 'nope'"),
                         ("/api/v1/nothing-here", "")]:
        assert_problem(env.get(path), 404, needle=needle)


def test_health_ready_metrics_openapi(env: Env) -> None:
    assert env.get("/healthz").json()["status"] == "ok"
    # before the first tick the controller has not shown it can reach the backend: not ready
    assert_problem(env.get("/readyz"), 503, needle="controller: not acting")
    assert_problem(env.get("/readyz", READER), 503, needle="controller: no successful tick yet")
    env.tick(10.0)
    assert env.get("/readyz").json() == {"status": "ready", "checks": {"database": "ok", "controller": "ok"}}
    env.backend.set_reachable(False)
    env.clock.t += 5
    env.ctl.tick()
    assert_problem(env.get("/readyz", READER), 503, needle="fake cluster unreachable")
    # a probe without a token learns which check failed, not why (no names of hosts or databases)
    assert "fake cluster" not in env.get("/readyz").text
    env.backend.set_reachable(True)
    env.tick(10.0)
    metrics = env.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'elastic_gpus{pool="p",state="inference"} 1.0' in metrics.text
    spec = env.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {"/api/v1/pools", "/api/v1/services/{name}", "/api/v1/jobs/{name}/rescale", "/api/v1/decisions",
            "/api/v1/services/{name}/override", "/api/v1/controller/pause", "/api/v1/controller/resume",
            "/readyz", "/healthz", "/metrics"} <= paths


def test_readyz_is_503_when_the_database_is_gone(tmp_path) -> None:
    e = make_env(f"sqlite:///{tmp_path / 'gone.db'}")
    try:
        e.tick(10.0)
        assert e.get("/readyz").status_code == 200
        # the API's store now points at a directory that cannot hold a database: every connection fails
        import sqlalchemy as sa

        api = e.server.config.app.state.api
        api.store = db.Store(sa.create_engine(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"))
        anonymous = assert_problem(e.get("/readyz"), 503, needle="database: unavailable")
        assert "missing-dir" not in str(anonymous)
        assert_problem(e.get("/readyz", READER), 503, needle="missing-dir")
        assert_problem(e.get("/api/v1/pools"), 503, needle="unavailable")
    finally:
        close_env(e)


@pytest.mark.parametrize("path, key", [("/api/v1/decisions", "decisions"), ("/api/v1/jobs/pretrain/reshards", "reshards")])
def test_pagination_walks_every_row_once_across_pages(env: Env, path: str, key: str) -> None:
    for load in (10, 40, 10, 40, 10, 40, 10):
        env.tick(float(load))
    expected = ([d.id for d in db.list_decisions(env.store, 100, newest_first=True)] if key == "decisions"
                else [r.id for r in db.list_reshards(env.store, "pretrain", 100, newest_first=True)])
    assert len(expected) >= 5, expected
    seen, token, pages = [], None, 0
    while True:
        params = {"limit": 2} | ({"continue": token} if token else {})
        body = env.get(path, params=params).json()
        seen += [item["id"] for item in body["items"]]
        pages += 1
        token = body["metadata"].get("continue")
        if not token:
            assert body["metadata"] == {"continue": None}, body["metadata"]  # as the schema says
            break
        assert len(body["items"]) == 2
    assert seen == expected and pages == (len(expected) + 1) // 2
    asc = [i["id"] for i in env.get(path, params={"limit": 100, "order": "asc"}).json()["items"]]
    assert asc == sorted(expected)
    # a token replayed with other parameters, or edited, is refused
    first = env.get(path, params={"limit": 1}).json()["metadata"]["continue"]
    assert_problem(env.get(path, params={"limit": 1, "continue": first, "order": "asc"}), 400, field="continue")
    flipped = first[:-3] + ("A" if first[-3] != "A" else "B") + first[-2:]
    assert_problem(env.get(path, params={"limit": 1, "continue": flipped}), 400, field="continue",
                   needle="invalid continue token")
    assert_problem(env.get(path, params={"limit": 1, "continue": "!!not-base64!!"}), 400, field="continue")
    assert_problem(env.get(path, params={"limit": 0}), 422, field="query.limit")
    assert_problem(env.get(path, params={"limit": 501}), 422, field="query.limit")


def test_create_replace_delete_service_and_job_are_audited(env: Env) -> None:
    r = env.send("POST", "/api/v1/services", json=SERVICE)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["max_replicas"] == 2
    assert_problem(env.send("POST", "/api/v1/services", json=SERVICE), 409, needle="already exists")
    changed = {"pool": "p", "spec": {**SERVICE["spec"], "max_replicas": 3}}
    r = env.send("PUT", "/api/v1/services/summarise", json=changed)
    assert r.status_code == 200 and r.json()["spec"]["max_replicas"] == 3
    assert db.get_service(env.store, "summarise").spec["max_replicas"] == 3
    assert env.send("DELETE", "/api/v1/services/summarise").status_code == 204
    assert db.get_service(env.store, "summarise") is None
    assert_problem(env.send("DELETE", "/api/v1/services/summarise"), 404)
    assert_problem(env.send("PUT", "/api/v1/services/summarise", json=changed), 404, needle="POST")

    assert env.send("POST", "/api/v1/jobs", json=JOB).status_code == 201
    r = env.send("PUT", "/api/v1/jobs/finetune", json={"pool": "p", "spec": {**JOB["spec"], "max_gpus": 4}})
    assert r.status_code == 200 and r.json()["spec"]["max_gpus"] == 4
    assert_problem(env.send("POST", "/api/v1/services", json={"pool": "p", "spec": {"name": "finetune"}}), 409,
                   needle="already a training job")
    assert env.send("DELETE", "/api/v1/jobs/finetune").status_code == 204

    log = [(a.actor, a.action, a.target) for a in _audit(env)]
    assert log == [("alice", "service.create", "service/summarise"), ("alice", "service.replace", "service/summarise"),
                   ("alice", "service.delete", "service/summarise"), ("alice", "job.create", "job/finetune"),
                   ("alice", "job.replace", "job/finetune"), ("alice", "job.delete", "job/finetune")]
    assert _audit(env)[0].detail["request"]["spec"]["name"] == "summarise"


def test_rescale_pins_a_feasible_layout_and_the_next_tick_applies_it(env: Env) -> None:
    env.tick(10.0)
    r = env.send("POST", "/api/v1/jobs/pretrain/rescale", json={"layout": "tp2.pp1.dp2"})
    assert r.status_code == 202, r.text
    assert r.json()["layout"] == "tp2.pp1.dp2" and r.json()["world_size"] == 4 and r.json()["tokens_per_second"] > 0
    assert env.get("/api/v1/controller").json()["pinned"] == {"pretrain": "tp2.pp1.dp2"}
    env.tick(10.0)
    assert str(env.backend.jobs["pretrain"].layout) == "tp2.pp1.dp2"
    r = env.send("POST", "/api/v1/jobs/pretrain/rescale", json={"layout": None})
    assert r.status_code == 202 and r.json()["layout"] is None and env.ctl.pinned == {}
    assert [a.action for a in _audit(env)] == ["job.rescale", "job.rescale"]


def test_checkpoint_on_demand_asks_or_waits_and_names_what_stands_in_the_way(env: Env) -> None:
    from elastic.backends.base import CheckpointNotSaved

    env.tick(10.0)
    assert env.backend.jobs["pretrain"].checkpoint_step == 0
    r = env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={})
    assert r.status_code == 202, r.text
    assert r.json()["step"] is None and r.json()["previous_step"] == 0 and "asked for" in r.json()["message"]
    r = env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={"wait_seconds": 30})
    assert r.status_code == 200, r.text
    assert (r.json()["step"], r.json()["message"]) == (1, "saved at step 1 on every rank")
    env.backend.checkpoint_raises = CheckpointNotSaved("job pretrain: the checkpoint could not be written (w1: disk full)")
    r = env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={"wait_seconds": 30})
    assert r.status_code == 502 and "disk full" in r.json()["detail"], r.text
    env.backend.checkpoint_raises = TimeoutError("job pretrain: no checkpoint after step 1 within 30 s (a rescale is "
                                                 "in flight)")
    r = env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={"wait_seconds": 30})
    assert r.status_code == 504 and "rescale is in flight" in r.json()["detail"] and "checkpointStep" in r.json()["detail"]
    # 'big' has no checkpoint settings (said first, though it does not run at this load either), an
    # unknown job is not found
    r = env.send("POST", "/api/v1/jobs/big/checkpoint", json={})
    assert r.status_code == 409 and r.json()["type"].endswith("no-checkpoint"), r.text
    assert "checkpoint.dir" in r.json()["detail"] and ("checkpoint", "big", 0) not in env.backend.calls
    assert env.send("POST", "/api/v1/jobs/nope/checkpoint", json={}).status_code == 404
    r = env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={"wait_seconds": -1})
    assert r.status_code == 422 and r.json()["field"] == "wait_seconds", r.text
    assert env.send("POST", "/api/v1/jobs/pretrain/checkpoint", json={}, token=READER).status_code == 403
    assert [a.action for a in _audit(env)] == ["job.checkpoint"] * 5  # every request that got past validation


def test_override_pins_replicas_until_a_time_and_clear_removes_it(env: Env) -> None:
    env.tick(10.0)
    r = env.send("PUT", "/api/v1/services/chat/override", json={"replicas": 3, "until": "2030-01-01T00:00:00Z"})
    assert r.status_code == 200, r.text
    env.tick(10.0)
    assert len(env.backend.service_gpus("chat")) == 3  # the policy alone says 1 at this load
    assert env.get("/api/v1/controller").json()["overrides"]["chat"]["replicas"] == 3
    assert env.send("DELETE", "/api/v1/services/chat/override").status_code == 200
    env.tick(10.0)
    assert len(env.backend.service_gpus("chat")) == 1
    assert [a.action for a in _audit(env)] == ["service.override", "service.override.clear"]


def test_pause_and_resume(env: Env) -> None:
    env.tick(10.0)
    r = env.send("POST", "/api/v1/controller/pause")
    assert r.status_code == 200 and r.json()["paused"] is True
    env.clock.t += 20
    assert env.ctl.tick().reason == "Paused"
    r = env.send("POST", "/api/v1/controller/resume")
    assert r.status_code == 200 and r.json()["paused"] is False
    assert env.tick(40.0).acted
    assert [(a.actor, a.action, a.target) for a in _audit(env)] == [("alice", "controller.pause", "pool/p"),
                                                                      ("alice", "controller.resume", "pool/p")]


WRITES = [
    ("POST", "/api/v1/services", SERVICE),
    ("PUT", "/api/v1/services/chat", {"pool": "p", "spec": {"name": "chat"}}),
    ("DELETE", "/api/v1/services/chat", None),
    ("POST", "/api/v1/jobs", JOB),
    ("PUT", "/api/v1/jobs/pretrain", {"pool": "p", "spec": {"name": "pretrain", "model": "tiny"}}),
    ("DELETE", "/api/v1/jobs/pretrain", None),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp1.pp1.dp2"}),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 2, "until": "2030-01-01T00:00:00Z"}),
    ("DELETE", "/api/v1/services/chat/override", None),
    ("POST", "/api/v1/controller/pause", None),
    ("POST", "/api/v1/controller/resume", None),
]


UNAUTHORISED = [
    (None, 401, "writes need an 'admin' bearer token"),
    ("not-a-known-token-at-all", 401, "unknown bearer token"),
    (READER, 403, "role 'read'"),
]


def test_writes_refuse_missing_unknown_and_read_only_tokens_and_change_nothing(env: Env) -> None:
    env.tick(10.0)
    before, ctl_before = db_state(env.store), controller_state(env.ctl)
    for token, status, needle in UNAUTHORISED:
        for method, path, body in WRITES:
            kw = {"json": body} if body is not None else {}
            r = env.send(method, path, token=token, **kw)
            assert_problem(r, status, needle=needle)
            if status == 401:
                assert r.headers["www-authenticate"].startswith("Bearer"), (method, path)
        # malformed JSON from an unauthorised client gets the auth answer: auth runs before the body is read
        r = env.send("POST", "/api/v1/services", token=token, content=b"{nope",
                     headers={"Content-Type": "application/json"})
        assert r.status_code == status
    assert db_state(env.store) == before and controller_state(env.ctl) == ctl_before


def test_reads_are_open_by_default_and_closed_when_required(db_url: str) -> None:
    e = make_env(db_url, require_auth_for_reads=True)
    try:
        for path in ("/api/v1/pools", "/api/v1/services", "/api/v1/decisions", "/api/v1/controller"):
            assert_problem(e.get(path), 401, needle="reads need a bearer token")
            assert e.get(path, token=READER).status_code == 200
            assert e.get(path, token=ADMIN).status_code == 200
        assert e.get("/healthz").status_code == 200 and e.get("/metrics").status_code == 200
    finally:
        close_env(e)


def test_operator_mode_refuses_spec_writes_with_a_kubectl_hint(db_url: str) -> None:
    e = make_env(db_url, operator_mode=True)
    try:
        e.tick(10.0)
        before = db_state(e.store)
        for method, path, body in WRITES[:6]:
            r = e.send(method, path, json=body) if body is not None else e.send(method, path)
            assert_problem(r, 409, needle="kubectl")
        assert db_state(e.store) == before
        # interventions stay available in operator mode
        assert e.send("POST", "/api/v1/controller/pause").status_code == 200
        assert e.get("/api/v1/services/chat").status_code == 200
    finally:
        close_env(e)
