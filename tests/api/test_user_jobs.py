"""A job that runs the user's own code: the API stores and shows its fields, and refuses a bad one
with a 4xx naming the field (``spec.entrypoint``, ``spec.checkpoint`` ...), storing nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import Env, assert_problem, db_state

USER = {"name": "llama", "model": "tiny", "min_gpus": 1, "max_gpus": 4, "global_batch": 8,
        "entrypoint": "elastic.torch.run:main", "args": ["--steps", "10"], "mesh_dims": {"dp": "dp", "tp": "tp"},
        "dp_replicas": True, "seed": 7}
REFERENCE = {"name": "ref", "model": "tiny", "min_gpus": 1, "max_gpus": 2, "global_batch": 8}


def test_a_user_job_is_stored_and_shown_with_its_fields(env: Env, tmp_path: Path) -> None:
    r = env.send("POST", "/api/v1/jobs", json={"pool": "p", "spec": USER})
    assert r.status_code == 201, r.text
    spec = env.get("/api/v1/jobs/llama").json()["spec"]
    assert {k: spec[k] for k in ("entrypoint", "args", "mesh_dims", "dp_replicas", "seed")} == \
        {"entrypoint": "elastic.torch.run:main", "args": ["--steps", "10"], "mesh_dims": {"dp": "dp", "tp": "tp"},
         "dp_replicas": True, "seed": 7}
    # paused into keepers below its minimum, as any job, and an axis its mesh does not name stays at 1
    assert (spec["on_below_minimum"], spec["allowed_pp"], spec["allowed_tp"]) == ("pause", [1], None)
    assert "llama" in [w["name"] for w in env.get("/api/v1/jobs").json()["items"]]

    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    r = env.send("PUT", "/api/v1/jobs/llama", json={"pool": "p", "spec": {**USER, "entrypoint": str(script),
                                                                         "args": []}})
    assert r.status_code == 200, r.text
    assert (r.json()["spec"]["entrypoint"], r.json()["spec"]["args"]) == (str(script), [])

    # a pinned layout must be one the user's mesh can express: no ZeRO-1
    assert_problem(env.send("POST", "/api/v1/jobs/llama/rescale", json={"layout": "tp1.pp1.dp2.z1"}), 422,
                   field="layout", needle="no ep, vpp or z")


def test_a_reference_job_shows_the_user_fields_at_their_defaults(env: Env) -> None:
    assert env.send("POST", "/api/v1/jobs", json={"pool": "p", "spec": REFERENCE}).status_code == 201
    spec = env.get("/api/v1/jobs/ref").json()["spec"]
    assert {k: spec[k] for k in ("entrypoint", "args", "mesh_dims", "dp_replicas", "seed")} == \
        {"entrypoint": None, "args": [], "mesh_dims": None, "dp_replicas": False, "seed": 0}


# (method, spec, field, needle)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("POST", {**USER, "entrypoint": "no_such_package_xyz.train:main"}, "spec.entrypoint", "does not import"),
    ("POST", {**USER, "entrypoint": "/no/such/dir/train.py"}, "spec.entrypoint", "does not exist"),
    ("PUT", {**USER, "entrypoint": "no_such_package_xyz:main"}, "spec.entrypoint", "does not import"),
    ("POST", {**USER, "entrypoint": "train"}, "spec.entrypoint", "neither 'package.module:function'"),
    ("POST", {**USER, "entrypoint": ""}, "spec.entrypoint", "empty"),
    ("POST", {**USER, "checkpoint": {"dir": "/ckpt"}}, "spec.checkpoint", "keeps its own checkpoints"),
    ("POST", {**USER, "zero": 1}, "spec.zero", "set zero: 0"),
    ("POST", {**USER, "mesh_dims": {"tp": "tp"}}, "spec.mesh_dims", "data-parallel axis 'dp'"),
    ("POST", {**USER, "mesh_dims": {"dp": "dp", "ep": "ep"}}, "spec.mesh_dims", "unknown axis 'ep'"),
    ("POST", {**USER, "mesh_dims": {"dp": "dp"}, "allowed_tp": [1, 2]}, "spec.allowed_tp", "names no tp dim"),
    ("POST", {**USER, "allowed_pp": [2]}, "spec.allowed_pp", "names no pp dim"),
    ("POST", {**USER, "seed": -1}, "spec.seed", "greater than or equal to 0"),
    ("POST", {**USER, "args": "--steps 10"}, "spec.args", "valid list"),
    ("POST", {**REFERENCE, "args": ["--x"]}, "spec.args", "only a job with an entrypoint"),
    ("POST", {**REFERENCE, "mesh_dims": {"dp": "dp"}}, "spec.mesh_dims", "only a job with an entrypoint"),
    ("POST", {**REFERENCE, "dp_replicas": True}, "spec.dp_replicas", "only a job with an entrypoint"),
]


@pytest.mark.parametrize(("method", "spec", "field", "needle"), BAD,
                         ids=[f"{m}-{f}-{n[:20]}" for m, _, f, n in BAD])
def test_a_bad_user_job_is_a_422_naming_the_field_and_stores_nothing(env: Env, method: str, spec: dict[str, Any],
                                                                     field: str, needle: str) -> None:
    if method == "PUT":
        assert env.send("POST", "/api/v1/jobs", json={"pool": "p", "spec": USER}).status_code == 201
    before = db_state(env.store)
    path = "/api/v1/jobs" if method == "POST" else f"/api/v1/jobs/{spec['name']}"
    body = assert_problem(env.send(method, path, json={"pool": "p", "spec": spec}), 422, field=field, needle=needle)
    assert body["errors"][0]["field"] == field
    assert db_state(env.store) == before
