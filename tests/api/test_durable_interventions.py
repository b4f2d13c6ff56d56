"""Interventions outlive the controller: a pause, an override and a layout pin made through the API
are on record with who and when; a controller built again on the same database (SQLite file,
PostgreSQL) is still paused, keeps the override and the pin, and the API shows them; an override
that ran out meanwhile is dropped. A write to a spec the config file declares says the file wins."""

from __future__ import annotations

from datetime import UTC, datetime

from elastic import store as db

from .conftest import ADMIN, T0, Clock, close_env, make_env

UNTIL = datetime.fromtimestamp(T0 + 3600, UTC).isoformat().replace("+00:00", "Z")


def _restart(env, db_url: str, clock_at: float):  # noqa: ANN001, ANN202
    """Stop the first controller (handing its lease back, as ``elastic serve`` does) and build another."""
    env.ctl.release_lease()
    close_env(env)
    return make_env(db_url, clock=Clock(clock_at))


def test_pause_override_and_pin_survive_a_restart_with_who_and_when(db_url: str) -> None:
    env = make_env(db_url)
    try:
        env.tick(10.0)
        assert env.send("PUT", "/api/v1/services/chat/override", ADMIN,
                        json={"replicas": 3, "until": UNTIL}).status_code == 200
        assert env.send("POST", "/api/v1/jobs/pretrain/rescale", ADMIN, json={"layout": "tp1.pp1.dp2"}).status_code == 202
        assert env.send("POST", "/api/v1/controller/pause", ADMIN).status_code == 200
        env = _restart(env, db_url, T0 + 100)
        status = env.get("/api/v1/controller").json()
        assert status["paused"] is True
        assert status["overrides"]["chat"]["replicas"] == 3 and status["overrides"]["chat"]["by"] == "alice"
        assert status["pinned"] == {"pretrain": "tp1.pp1.dp2"}
        kinds = {(i["kind"], i["target"], i["by"]) for i in status["interventions"]}
        assert kinds == {("pause", "p", "alice"), ("override", "chat", "alice"), ("pin", "pretrain", "alice")}
        assert all(i["at"] for i in status["interventions"])
        env.clock.t += 20
        assert env.ctl.tick().reason == "Paused"  # a paused controller stays paused after a restart
        assert env.send("POST", "/api/v1/controller/resume", ADMIN).status_code == 200
        res = env.tick(10.0)
        assert str(res.replica_decisions["chat"].reason) == "Override" and res.replica_decisions["chat"].replicas == 3
        assert len(env.backend.jobs["pretrain"].gpus) == 2  # the pin holds: tp1.pp1.dp2
        env = _restart(env, db_url, T0 + 200)
        assert env.ctl.paused is False  # the resume is on record too
    finally:
        close_env(env)


def test_an_override_that_ran_out_while_down_is_dropped(db_url: str) -> None:
    env = make_env(db_url)
    try:
        soon = datetime.fromtimestamp(T0 + 60, UTC).isoformat()
        assert env.send("PUT", "/api/v1/services/chat/override", ADMIN,
                        json={"replicas": 2, "until": soon}).status_code == 200
        env = _restart(env, db_url, T0 + 500)
        assert env.get("/api/v1/controller").json()["overrides"] == {}
        assert [i.kind for i in db.list_interventions(env.store, "p")] == ["override"]  # until the leader acts
        env.tick(10.0)
        assert db.list_interventions(env.store, "p") == []
    finally:
        close_env(env)


def test_replacing_a_config_declared_spec_says_the_config_file_wins(db_url: str) -> None:
    env = make_env(db_url)
    try:
        env.ctl.config_source = "/etc/elastic/pool.yaml"
        spec = {"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 2,
                "metric": {"preset": "vllm-running", "target": 10}}
        before = db.get_service(env.store, "chat").spec
        r = env.send("PUT", "/api/v1/services/chat", ADMIN, json={"pool": "p", "spec": spec})
        assert r.status_code == 409 and r.headers["elastic-spec-source"] == "config", r.text
        assert "/etc/elastic/pool.yaml" in r.json()["detail"] and "config file wins" in r.json()["detail"]
        assert db.get_service(env.store, "chat").spec == before
    finally:
        close_env(env)
