"""Hostile names and files, and the continue-token key.

Names follow Kubernetes' DNS-1123 label rule in the API and the config file (a 422 or one line
naming the field); model files named through the API come from the model directory only; the
continue tokens' key is random and kept in the database (a token made with a key derived from
what the server shows is refused, and a second API server over the same database accepts the
first one's tokens)."""

from __future__ import annotations

import hashlib
import json
import re

import httpx
import pytest

from elastic.api import TokenSet, create_app, serve_api
from elastic.api.pagination import ContinueCodec
from elastic.config import load_config
from elastic.model import MODEL_PRESETS, SpecError

from .conftest import ADMIN, CONFIG, TOKEN_FILE, Env, assert_problem, close_env, db_state, make_env

SERVICE = {"gpus_per_replica": 1, "min_replicas": 0, "max_replicas": 2, "metric": {"preset": "vllm-running", "target": 5}}
JOB = {"model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 4, "global_batch": 64}
BAD_NAMES = ["../etc", "a/b", "Chat", "chat_1", "-chat", "chat-", "a\x00b", "x" * 64, "chat.v2", ""]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_that_is_not_a_dns_label_is_refused_and_nothing_is_stored(env: Env, name: str) -> None:
    before = db_state(env.store)
    for path, spec in (("/api/v1/services", SERVICE), ("/api/v1/jobs", JOB)):
        r = env.send("POST", path, ADMIN, json={"pool": "p", "spec": {**spec, "name": name}})
        assert_problem(r, 422, field="spec.name")
        assert len(r.text) < 3000
    assert db_state(env.store) == before


def test_a_dns_label_of_63_characters_is_taken(env: Env) -> None:
    name = "a" * 62 + "1"
    r = env.send("POST", "/api/v1/services", ADMIN, json={"pool": "p", "spec": {**SERVICE, "name": name}})
    assert r.status_code == 201, r.text
    assert env.send("DELETE", f"/api/v1/services/{name}", ADMIN).status_code == 204


def test_a_pool_name_that_is_not_a_dns_label_is_refused(env: Env) -> None:
    r = env.send("POST", "/api/v1/jobs", ADMIN, json={"pool": "../p", "spec": {**JOB, "name": "ok"}})
    assert_problem(r, 422, field="pool", needle="DNS-1123")


@pytest.mark.parametrize("where,value", [("pool", {"name": "Pool_A"}),
                                         ("services[0]", {"name": "chat/x"}),
                                         ("jobs[0]", {"name": "x" * 64})])
def test_the_config_file_takes_dns_labels_only(where: str, value: dict) -> None:
    data = json.loads(json.dumps(CONFIG))
    if where == "pool":
        data["pool"].update(value)
    else:
        key, i = where.split("[")
        data[key][int(i[0])].update(value)
    with pytest.raises(SpecError, match=re.escape(where) + r"\.name: .*(DNS-1123|at most 63)"):
        load_config(data=data)


def test_model_files_come_from_the_model_directory_only(db_url: str, tmp_path, monkeypatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    model = {**MODEL_PRESETS["gpt-1.3b"].model_dump(mode="json"), "name": "small"}
    (models / "small.json").write_text(json.dumps(model))
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(model))
    monkeypatch.setenv("ELASTIC_MODEL_DIR", str(models))
    env = make_env(db_url)
    try:
        for path in (str(outside), "../outside.json", "/etc/passwd.yaml"):
            r = env.send("POST", "/api/v1/jobs", ADMIN, json={"pool": "p", "spec": {**JOB, "name": "j",
                                                                                      "model": path}})
            assert_problem(r, 422, field="spec.model", needle=f"read from {models}")
        r = env.send("POST", "/api/v1/jobs", ADMIN, json={"pool": "p", "spec": {**JOB, "name": "j",
                                                                                  "model": "small.json"}})
        assert r.status_code == 201, r.text
    finally:
        close_env(env)


def test_the_continue_key_is_random_kept_in_the_database_and_shared(db_url: str) -> None:
    env = make_env(db_url)
    try:
        for load in (10.0, 40.0, 10.0):
            env.tick(load)
        query = {"pool": None, "order": "desc"}
        forged = ContinueCodec(hashlib.sha256(env.store.url.encode()).digest()).encode(10**6, query)
        assert_problem(env.get(f"/api/v1/decisions?limit=1&continue={forged}"), 400, field="continue")
        token = env.get("/api/v1/decisions?limit=1").json()["metadata"]["continue"]
        other = create_app(env.store, None, tokens=TokenSet.parse(TOKEN_FILE, "test tokens"))
        server, _ = serve_api(other, "127.0.0.1", 0)
        try:
            r = httpx.get(f"{server.url}/api/v1/decisions", params={"limit": 1, "continue": token}, timeout=10)
            assert r.status_code == 200 and r.json()["items"], r.text
        finally:
            server.stop()
    finally:
        close_env(env)
