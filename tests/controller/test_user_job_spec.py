"""A job spec that names the user's own code (``entrypoint``), everywhere a job is declared:
``TrainingSpec``'s rules, the ``elastic serve`` config, the controller's view of it, and what the
Ray and Kubernetes backends hand its workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller, job_throughput_tables
from elastic.metrics import InProcessSource
from elastic.model import GPU, Layout, SpecError, TrainingSpec
from tests.fakes import Clock

from .fake_backend import FakeBackend

ENTRY = "elastic.torch.run:main"  # any module this process can find
USER: dict[str, Any] = {"name": "llama", "model": "tiny", "global_batch": 8, "entrypoint": ENTRY}


# ---- TrainingSpec ------------------------------------------------------------------------------

# (extra fields, on_below_minimum, allowed_tp, allowed_pp) after validation
GOOD: list[tuple[dict[str, Any], str, list[int] | None, list[int] | None]] = [
    ({}, "pause", None, [1]),  # default mesh {dp: dp_shard, tp: tp}: no pp dim
    ({"on_below_minimum": "preempt"}, "preempt", None, [1]),
    ({"on_below_minimum": "pause"}, "pause", None, [1]),
    ({"mesh_dims": {"dp": "dp_replicate"}, "dp_replicas": True}, "pause", [1], [1]),
    ({"mesh_dims": {"dp": "dp"}, "allowed_tp": [1], "allowed_pp": None}, "pause", [1], [1]),
    ({"mesh_dims": {"pp": "pp", "dp": "dp", "tp": "tp"}, "allowed_tp": [1, 2]}, "pause", [1, 2], None),
    ({"entrypoint": "train.py", "args": ["--lr", "3e-4"], "seed": 5}, "pause", None, [1]),
]


@pytest.mark.parametrize(("extra", "below", "tp", "pp"), GOOD)
def test_a_user_job_is_held_to_what_its_code_can_do(extra: dict[str, Any], below: str, tp: Any, pp: Any) -> None:
    spec = TrainingSpec(**{**USER, **extra})
    assert (spec.on_below_minimum, spec.allowed_tp, spec.allowed_pp) == (below, tp, pp)
    # what the store and the API hold reads back as the same spec, with or without the derived fields
    assert TrainingSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert TrainingSpec.model_validate(spec.model_dump(mode="json", exclude_unset=True)) == spec


def test_a_reference_job_keeps_its_defaults() -> None:
    spec = TrainingSpec(name="ref", model="tiny", seed=3)
    assert (spec.entrypoint, spec.args, spec.mesh_dims, spec.dp_replicas, spec.seed) == (None, [], None, False, 3)
    assert (spec.on_below_minimum, spec.allowed_tp, spec.allowed_pp) == ("pause", None, None)


# (fields, the field named, a phrase of the message)
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({**USER, "entrypoint": "train"}, "entrypoint", "neither 'package.module:function'"),
    ({**USER, "entrypoint": "pkg.mod:1fn"}, "entrypoint", "neither 'package.module:function'"),
    ({**USER, "entrypoint": "  "}, "entrypoint", "empty"),
    ({**USER, "checkpoint": {"dir": "/ckpt"}}, "checkpoint", "remove checkpoint"),
    ({**USER, "zero": 1}, "zero", "set zero: 0"),
    ({**USER, "mesh_dims": {"tp": "tp"}}, "mesh_dims", "data-parallel axis 'dp'"),
    ({**USER, "mesh_dims": {"dp": "dp", "cp": "cp"}}, "mesh_dims", "unknown axis 'cp'"),
    ({**USER, "mesh_dims": {"dp": "x", "tp": "x"}}, "mesh_dims", "distinct identifiers"),
    ({**USER, "mesh_dims": {"dp": "dp"}, "allowed_tp": [2]}, "allowed_tp", "add a tp dim to mesh_dims"),
    ({**USER, "allowed_pp": [1, 2]}, "allowed_pp", "set allowed_pp: [1]"),
    ({"name": "ref", "model": "tiny", "args": ["--x"]}, "args", "set entrypoint or remove args"),
    ({"name": "ref", "model": "tiny", "mesh_dims": {"dp": "dp"}}, "mesh_dims", "set entrypoint or remove mesh_dims"),
    ({"name": "ref", "model": "tiny", "dp_replicas": True}, "dp_replicas", "set entrypoint or remove dp_replicas"),
]


@pytest.mark.parametrize(("fields", "field", "needle"), BAD, ids=[f"{f}-{n[:24]}" for _, f, n in BAD])
def test_a_bad_user_job_is_refused_naming_its_field(fields: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as e:
        TrainingSpec(**fields)
    err = e.value.errors()[0]
    assert err["ctx"]["field"] == field and err["msg"].startswith(field), err
    assert needle in err["msg"], err["msg"]


# ---- elastic serve's config --------------------------------------------------------------------

def _config(**job: Any) -> dict[str, Any]:
    return {"pool": {"name": "p", "nodes": 1, "gpus_per_node": 4},
            "jobs": [{"name": "llama", "model": "tiny", "global_batch": 8, **job}]}


def test_config_takes_a_user_job_whose_code_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("print('training')\n")
    monkeypatch.chdir(tmp_path)  # a relative script is looked for where the controller (and its workers) run
    for entry in (ENTRY, "train.py", str(tmp_path / "train.py")):
        job = load_config(data=_config(entrypoint=entry, args=["--steps", "3"])).jobs[0]
        assert (job.entrypoint, job.args, job.on_below_minimum) == (entry, ["--steps", "3"], "pause")


@pytest.mark.parametrize(("entry", "needle"), [
    ("no_such_package_xyz.train:main", "No module named 'no_such_package_xyz'"),
    ("elastic.no_such_module:main", "no module named 'elastic.no_such_module'"),
    ("missing.py", "script 'missing.py' does not exist"),
    ("train", "neither 'package.module:function'"),
])
def test_config_refuses_an_entrypoint_that_does_not_load(entry: str, needle: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as e:
        load_config(data=_config(entrypoint=entry))
    assert str(e.value).startswith("config: jobs[0].entrypoint: ") and needle in str(e.value), str(e.value)


@pytest.mark.parametrize(("job", "text"), [
    ({"entrypoint": ENTRY, "checkpoint": {"dir": "/c"}}, "config: jobs[0].checkpoint: a job with an entrypoint"),
    ({"args": ["--x"]}, "config: jobs[0].args: only a job with an entrypoint"),
    ({"entrypoint": ENTRY, "model": "gpt-99t"}, "config: jobs[0].model: unknown model"),
])
def test_config_names_the_job_and_field_of_a_user_job_rule(job: dict[str, Any], text: str) -> None:
    with pytest.raises(SpecError) as e:
        load_config(data=_config(**job))
    assert str(e.value).startswith(text), str(e.value)


# ---- the controller ----------------------------------------------------------------------------

POOL = {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g", "rescale_interval_seconds": 0,
        "gain_threshold": 0.0}


def test_a_user_job_never_gets_a_zero1_layout() -> None:
    job = {"model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}
    cfg = load_config(data={"pool": POOL, "jobs": [
        {"name": "ref", **job}, {"name": "user", **job, "entrypoint": ENTRY, "mesh_dims": {"pp": "pp", "dp": "dp"}}]})
    tables = job_throughput_tables(cfg)
    assert any(lay.zero for lay, _ in tables["ref"].values())  # the planner would choose ZeRO-1
    assert tables["user"] and not any(lay.zero for lay, _ in tables["user"].values())
    assert all(lay.tp == 1 for lay, _ in tables["user"].values())  # no tp dim in its mesh



@pytest.mark.parametrize(("user", "below"), [(False, "pause"), (True, "pause"), (True, "preempt")],
                         ids=["reference", "user", "user-preempt"])
def test_below_its_minimum_a_user_job_is_paused_into_keepers_like_any_job(db_url: str, user: bool, below: str) -> None:
    """The fake backend can pause jobs into keepers: a user job (its keepers hold the state its code
    built) is paused as the reference trainer's is, unless it asks to be preempted."""
    cfg = load_config(data={
        "pool": {**POOL, "nodes": 1},
        "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 4,
                      "metric": {"preset": "vllm-running", "target": 10},
                      "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
        "jobs": [{"name": "job", "model": "gpt-1.3b", "min_gpus": 2, "max_gpus": 3, "global_batch": 64,
                  "on_below_minimum": below,
                  **({"entrypoint": ENTRY, "mesh_dims": {"pp": "pp", "dp": "dp"}} if user else {})}]})
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    try:
        clock, source, backend = Clock(), InProcessSource(max_age=60), FakeBackend({"n0": 4})
        ctl = Controller(cfg, backend, store, {"chat": source}, owner="ctl-a", clock=clock)
        for load in (10.0, 40.0):  # one replica, then four: the job's 2-GPU minimum no longer fits
            clock.t += 20.0
            source.set("chat", load, clock.t)
            assert ctl.tick().error is None
            if load == 10.0:
                assert len(backend.jobs["job"].gpus) == 3
        assert len(backend.service_gpus("chat")) == 4
        if below == "preempt":  # stopped, its GPUs back in the pool
            assert ("job", "job", 0) in backend.calls and "job" not in backend.jobs, backend.calls
            assert not any(c[0] == "pause" for c in backend.calls), backend.calls
        else:  # paused into keepers, its layout kept
            assert ("pause", "job", 0) in backend.calls and backend.jobs["job"].phase == "Paused", backend.calls
    finally:
        store.dispose()


# ---- backends: the trainer config and the workers' environment ---------------------------------

def test_ray_gives_a_user_job_its_user_job_config() -> None:
    from elastic.backends.ray_jobs import default_trainer_config, trainer_config_for
    from elastic.train.engine import TrainConfig
    from elastic.train.userjob import UserJobConfig

    spec = TrainingSpec(**{**USER, "args": ["--steps", "3"], "mesh_dims": {"dp": "dp_replicate"},
                           "dp_replicas": True, "seed": 9, "micro_batch": 2})
    cfg = default_trainer_config(spec)
    assert isinstance(cfg, UserJobConfig)
    assert (cfg.model.name, cfg.global_batch, cfg.micro_batch, cfg.entrypoint, cfg.args, cfg.seed,
            dict(cfg.mesh_dims), cfg.dp_replicas) == ("tiny", 8, 2, ENTRY, ("--steps", "3"), 9,
                                                      {"dp": "dp_replicate"}, True)
    assert isinstance(default_trainer_config(TrainingSpec(name="ref", model="tiny")), TrainConfig)

    def tuned(spec: TrainingSpec) -> Any:
        return ("tuned", spec.name)

    choose = trainer_config_for(tuned)  # a caller's tuning of the reference trainer never hides user code
    assert choose(TrainingSpec(name="ref", model="tiny")) == ("tuned", "ref")
    assert isinstance(choose(spec), UserJobConfig)
    assert trainer_config_for(None) is default_trainer_config


def _k8s_backend(job_runtime: str) -> Any:
    from kubernetes import client

    from elastic.backends.kubernetes import JobTarget, KubernetesBackend

    b = KubernetesBackend(api_client=client.ApiClient(), job_runtime=job_runtime)
    b.set_job("llama", JobTarget("ml", "llama", {"image": "team/llama:1", "env": [{"name": "HF_HOME",
                                                                                   "value": "/hf"}]}))
    return b


def _env(manifest: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in manifest["spec"]["containers"][0]["env"] if "value" in e}


def test_a_user_jobs_pod_runs_its_entrypoint() -> None:
    b = _k8s_backend("pods")
    spec = TrainingSpec(**{**USER, "args": ["--steps", "3"]})
    pod = b.worker_pod_manifest(spec, "llama-w0", GPU("n0", 0), Layout.parse("tp1.pp1.dp1"), 1, env={})
    env = _env(pod)
    assert (env["ELASTIC_ENTRYPOINT"], json.loads(env["ELASTIC_ARGS"])) == (ENTRY, ["--steps", "3"])
    assert (env["ELASTIC_JOB"], env["ELASTIC_WORKER_ID"], env["HF_HOME"]) == ("llama", "llama-w0", "/hf")
    assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "elastic.train.worker"]
    ref = b.worker_pod_manifest(TrainingSpec(name="llama", model="tiny"), "llama-w0", GPU("n0", 0),
                                Layout.parse("tp1.pp1.dp1"), 1, env={})
    assert not {"ELASTIC_ENTRYPOINT", "ELASTIC_ARGS"} & set(_env(ref))


def test_the_coordinator_runtime_launches_user_code_with_its_config() -> None:
    """The job handle's config is the user job's, and the pod it spawns carries the entrypoint."""
    from elastic.train.agent import config_json
    from elastic.train.rendezvous import Coordinator
    from elastic.train.userjob import UserJobConfig

    b = _k8s_backend("coordinator")
    spec = TrainingSpec(**{**USER, "args": ["a b", "c"], "dp_replicas": True})
    applied: list[dict[str, Any]] = []
    b.apply_worker_pod = lambda *a, **kw: applied.append(b.worker_pod_manifest(*a, **kw))  # type: ignore[method-assign]
    pods: list[dict[str, Any]] = []

    def start_coordinator(spec: TrainingSpec, cfg: Any, opts: Any) -> Any:
        # what the backend would apply, and a coordinator on loopback standing in for the pod's
        pods.append(b.coordinator_pod_manifest(spec, cfg, opts))
        return Coordinator(spec.name, secret="s" * 32).start()

    b.start_coordinator = start_coordinator  # type: ignore[method-assign]
    handle = b._new_handle(spec)
    try:
        assert isinstance(handle.cfg, UserJobConfig) and handle.cfg.args == ("a b", "c") and handle.cfg.dp_replicas
        handle.placement = {"llama-w0": (GPU("n0", 0), Layout.parse("tp1.pp1.dp1"))}
        handle._launch("llama-w0")
    finally:
        handle.coordinator.stop()
    env = _env(applied[0])
    assert (env["ELASTIC_ENTRYPOINT"], json.loads(env["ELASTIC_ARGS"])) == (ENTRY, ["a b", "c"])
    assert env["ELASTIC_RENDEZVOUS_URL"] == handle.coordinator.url
    # the job's coordinator secret is in the job's Secret: the pods only name it
    assert "ELASTIC_JOB_SECRET" not in env
    (ref,) = [e for e in applied[0]["spec"]["containers"][0]["env"] if e["name"] == "ELASTIC_JOB_SECRET"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "llama-rendezvous", "key": "secret"}
    # the coordinator pod: the job's image running the coordinator host, no GPU, the user job's config
    (pod,) = pods
    ctr = pod["spec"]["containers"][0]
    assert ctr["image"] == "team/llama:1" and ctr["command"] == ["python", "-m", "elastic.train.rendezvous.host"]
    assert "nvidia.com/gpu" not in json.dumps(ctr["resources"]) and pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"]["elastic.dev/coordinator"] == "llama" and "elastic.dev/job" not in pod[
        "metadata"]["labels"]
    cenv = _env(pod)
    doc = json.loads(cenv["ELASTIC_COORDINATOR_SPEC"])
    assert doc["config"] == config_json(handle.cfg) and doc["settings"]["prepare_beside_step"] is False  # a user job
    assert (cenv["ELASTIC_JOB"], cenv["HF_HOME"]) == ("llama", "/hf") and "ELASTIC_JOB_SECRET" not in cenv
    (ref,) = [e for e in ctr["env"] if e["name"] == "ELASTIC_JOB_SECRET"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "llama-rendezvous", "key": "secret"}


def test_the_example_user_job_config_loads_and_every_gpu_count_has_a_layout() -> None:
    from elastic.controller import check_feasible

    cfg = load_config("examples/llama/job.yaml")
    (job,) = cfg.jobs
    assert job.entrypoint == "examples.llama.job:main" and job.on_below_minimum == "pause"
    tables = job_throughput_tables(cfg)
    check_feasible(cfg, tables)
    assert sorted(tables["llama"]) == list(range(1, 8))
    for n, (layout, _) in tables["llama"].items():
        assert job.global_batch % layout.dp == 0, (n, layout)


def test_a_global_batch_no_allowed_layout_divides_is_refused_naming_it() -> None:
    from elastic.controller import check_feasible

    cfg = load_config(data={"pool": {"name": "p", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g"},
                            "jobs": [{**USER, "model": "examples/llama/model.json", "min_gpus": 2, "max_gpus": 4,
                                      "global_batch": 7, "allowed_tp": [1]}]})
    with pytest.raises(SpecError, match=r"jobs\[0\] 'llama': no layout .* global_batch=7 .* min_gpus=2"):
        check_feasible(cfg, job_throughput_tables(cfg))
