"""A workload the running controller manages from its config file: deleting it through the API is
refused (409, naming the file), and one deleted from the store behind the API's back costs its
status line, never the tick. Interventions on the running controller go one at a time, so the
live one is the one audited last."""

from __future__ import annotations

import logging

import pytest

from elastic import store as db

from .conftest import ADMIN, Env

SPEC = {"name": "summarise", "min_replicas": 0, "max_replicas": 2, "metric": {"preset": "vllm-running", "target": 5}}


@pytest.mark.parametrize("path", ["/api/v1/services/chat", "/api/v1/jobs/pretrain"])
def test_deleting_a_config_declared_workload_is_refused_and_nothing_changes(env: Env, path: str) -> None:
    env.ctl.config_source = "/etc/elastic/pool.yaml"
    env.tick(5.0)
    r = env.send("DELETE", path, ADMIN)
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["type"].endswith("declared-in-config") and "/etc/elastic/pool.yaml" in body["detail"]
    assert db.get_service(env.store, "chat") is not None and db.get_job(env.store, "pretrain") is not None
    res = env.tick(5.0)
    assert res.error is None


def test_a_workload_created_through_the_api_is_still_deleted(env: Env) -> None:
    assert env.send("POST", "/api/v1/services", ADMIN, json={"pool": "p", "spec": SPEC}).status_code == 201
    assert env.send("DELETE", "/api/v1/services/summarise", ADMIN).status_code == 204
    assert db.get_service(env.store, "summarise") is None


def test_a_declared_workload_gone_from_the_store_never_kills_the_tick(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.tick(5.0)
    with env.store.session() as s:
        assert db.delete_service(s, "chat") and db.delete_job(s, "pretrain")
    with caplog.at_level(logging.WARNING, logger="elastic.controller"):
        for _ in range(3):
            res = env.ctl.tick()
            assert res.error is None and res.reason != "Unavailable", res
    gone = [r.getMessage() for r in caplog.records if "is gone from the store" in r.getMessage()]
    assert len(gone) == 2, gone  # once per workload, not every tick


def test_parallel_overrides_leave_live_the_one_audited_last(env: Env) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    env.tick(5.0)

    def put(replicas: int) -> int:
        with httpx.Client(base_url=env.url, timeout=30) as c:
            return c.put("/api/v1/services/chat/override", headers={"Authorization": f"Bearer {ADMIN}"},
                         json={"replicas": replicas, "until": "2099-01-01T00:00:00Z"}).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(put, [1 + i % 6 for i in range(24)]))
    assert codes == [200] * 24
    last = db.list_audit(env.store, limit=1, newest_first=True)[0]
    assert last.action == "service.override"
    assert env.ctl.overrides["chat"][0] == last.detail["request"]["replicas"]
