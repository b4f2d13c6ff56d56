"""Bad input gets a 4xx problem naming the field, and changes nothing in the DB or the controller."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Env, assert_problem, controller_state, db_state

SPEC = {"name": "summarise", "min_replicas": 0, "max_replicas": 2, "metric": {"preset": "vllm-running", "target": 5}}
JOB = {"name": "finetune", "model": "tiny", "min_gpus": 1, "max_gpus": 2, "global_batch": 8}
FUTURE = "2030-01-01T00:00:00Z"

# (method, path, body (dict -> JSON, bytes -> raw JSON text), status, field, needle)
CASES: list[tuple[str, str, Any, int, str, str]] = [
    ("POST", "/api/v1/services", b'{"pool": "p", "spec": {', 400, "body", "malformed JSON"),
    ("POST", "/api/v1/services", b"[1, 2", 400, "body", "malformed JSON"),
    ("POST", "/api/v1/services", {"pool": "p", "spec": {**SPEC, "min_replicas": "two"}}, 422, "spec.min_replicas",
     "valid integer"),
    ("POST", "/api/v1/services", {"pool": "p", "spec": SPEC, "replicas": 3}, 422, "replicas", "unknown field"),
    ("POST", "/api/v1/services", {"pool": "p", "spec": {**SPEC, "min_replica": 1}}, 422, "spec.min_replica",
     "unknown field"),
    ("POST", "/api/v1/services", {"pool": "p", "spec": {**SPEC, "min_replicas": 3}}, 422, "spec",
     "min_replicas=3 > max_replicas=2"),
    ("POST", "/api/v1/services", {"pool": "nope", "spec": SPEC}, 422, "pool", "unknown pool 'nope'; known pools: p"),
    ("POST", "/api/v1/services", {"pool": "p", "spec": {**SPEC, "min_replicas": 9, "max_replicas": 9}}, 422,
     "spec.min_replicas", "exceeds pool"),
    ("POST", "/api/v1/services", {"spec": SPEC}, 422, "pool", "field required"),
    ("POST", "/api/v1/jobs", {"pool": "p", "spec": {**JOB, "model": "gpt-99t"}}, 422, "spec.model",
     "unknown model"),
    ("POST", "/api/v1/jobs", {"pool": "p", "spec": {**JOB, "min_gpus": 0}}, 422, "spec.min_gpus", "greater than 0"),
    ("PUT", "/api/v1/jobs/pretrain", {"pool": "p", "spec": JOB}, 422, "spec.name", "differs from the path"),
    ("POST", "/api/v1/jobs/big/rescale", {"layout": "tp2.pp2.dp2"}, 422, "layout", "does not fit"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp2.pq2.dp1"}, 422, "layout", "cannot read 'pq2'"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp3.pp1.dp1"}, 422, "layout", "does not divide heads"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp1.pp1.dp3"}, 422, "layout", "does not divide global_batch"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp2.pp2.dp4"}, 422, "layout", "outside the job's [1, 8]"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": 5}, 422, "layout", "valid string"),
    ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp1.pp1.dp2", "force": True}, 422, "force",
     "unknown field"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 2, "until": "2020-01-01T00:00:00Z"}, 422, "until",
     "not in the future"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 2, "until": "2030-01-01T00:00:00"}, 422, "until",
     "timezone"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 2, "until": "next tuesday"}, 422, "until", "datetime"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 7, "until": FUTURE}, 422, "replicas",
     "outside [1, 6]"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": "many", "until": FUTURE}, 422, "replicas",
     "valid integer"),
    ("PUT", "/api/v1/services/chat/override", {"replicas": 2}, 422, "until", "field required"),
]


def _send(env: Env, method: str, path: str, body: Any):
    if isinstance(body, bytes):
        return env.send(method, path, content=body, headers={"Content-Type": "application/json"})
    return env.send(method, path, json=body)


def test_every_bad_input_is_a_4xx_naming_the_field_and_changes_nothing(env: Env) -> None:
    env.tick(10.0)
    before, ctl_before = db_state(env.store), controller_state(env.ctl)
    for method, path, body, status, field, needle in CASES:
        try:
            assert_problem(_send(env, method, path, body), status, field=field, needle=needle)
        except AssertionError as e:
            raise AssertionError(f"{method} {path} {body!r}: {e}") from None
    assert db_state(env.store) == before
    assert controller_state(env.ctl) == ctl_before


@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_a_body_that_is_not_json_is_415(env: Env, content_type: str | None) -> None:
    before = db_state(env.store)
    headers = {"Content-Type": content_type} if content_type else {}
    r = env.send("POST", "/api/v1/jobs/pretrain/rescale", content=b"layout=tp1.pp1.dp2", headers=headers)
    assert_problem(r, 415, field="body", needle="application/json")
    assert db_state(env.store) == before


def test_a_failed_audit_write_undoes_the_intervention(env: Env) -> None:
    """The audit entry and its effect go together: if the DB refuses the audit, nothing changes."""
    import sqlalchemy as sa

    env.tick(10.0)
    ctl_before = controller_state(env.ctl)
    with env.store.engine.begin() as conn:  # make every audit insert fail at the DB
        conn.execute(sa.text("DROP TABLE audit_log"))
    for method, path, body in [("POST", "/api/v1/controller/pause", None),
                               ("PUT", "/api/v1/services/chat/override", {"replicas": 2, "until": FUTURE}),
                               ("POST", "/api/v1/jobs/pretrain/rescale", {"layout": "tp1.pp1.dp2"})]:
        r = env.send(method, path, json=body) if body else env.send(method, path)
        assert r.status_code >= 500 and r.headers["content-type"].startswith("application/problem+json"), r.text
        assert controller_state(env.ctl) == ctl_before, (method, path)
