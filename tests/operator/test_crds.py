"""CR spec -> controller spec mapping, and the errors that name the field to fix."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.crds import (
    CRError,
    ElasticTrainingJobSpec,
    GPUPoolSpec,
    InferenceServiceSpec,
    parse_spec,
    to_inference_spec,
    to_pool_spec,
    to_training_spec,
)
from elastic.model import MODEL_PRESETS

SVC = {"pool": "a", "scaleTargetRef": {"name": "vllm"}, "metric": {"preset": "vllm-requests", "target": 8},
       "minReplicas": 1, "maxReplicas": 4, "gpusPerReplica": 2,
       "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60,
                                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": 30}]}}}
JOB = {"pool": "a", "model": "tiny", "minGPUs": 2, "maxGPUs": 8, "globalBatch": 32, "microBatch": 2,
       "allowedTP": [1, 2], "template": {"image": "elastic:dev"}}


def test_maps_camel_case_specs_onto_the_controller_types(tmp_path) -> None:
    pool = to_pool_spec("a", parse_spec(GPUPoolSpec, {"gpusPerNode": 4, "hardware": "cpu", "headroomGPUs": 1}), 3)
    assert (pool.nodes, pool.gpus_per_node, pool.total_gpus, pool.headroom_gpus) == (3, 4, 12, 1)
    svc = to_inference_spec("ml/chat", parse_spec(InferenceServiceSpec, SVC))
    assert (svc.name, svc.gpus_per_replica, svc.max_replicas, svc.metric.preset) == ("ml/chat", 2, 4, "vllm-requests")
    assert svc.behavior.scale_down.stabilization_window_seconds == 60
    assert svc.behavior.scale_down.policies[0].period_seconds == 30
    svc = to_inference_spec("ml/chat", parse_spec(InferenceServiceSpec, {
        **SVC, "metric": {**SVC["metric"], "windowSeconds": 3, "noiseMargin": 0.5}}))
    assert (svc.metric.window_seconds, svc.metric.noise_margin) == (3, 0.5)
    job = to_training_spec("ml/train", parse_spec(ElasticTrainingJobSpec, JOB))
    assert (job.min_gpus, job.max_gpus, job.global_batch, job.micro_batch, job.allowed_tp) == (2, 8, 32, 2, [1, 2])
    assert job.on_below_minimum == "pause"
    job = to_training_spec("ml/train", parse_spec(ElasticTrainingJobSpec, {**JOB, "onBelowMinimum": "preempt"}))
    assert job.on_below_minimum == "preempt" and job.checkpoint is None
    job = to_training_spec("ml/train", parse_spec(ElasticTrainingJobSpec, {
        **JOB, "checkpoint": {"dir": "/ckpt", "everySteps": 50}}))
    assert (job.checkpoint.dir, job.checkpoint.every_steps, job.checkpoint.keep) == ("/ckpt", 50, 2)
    job = to_training_spec("ml/train", parse_spec(ElasticTrainingJobSpec, {
        **JOB, "checkpoint": {"dir": "/ckpt", "everySteps": None, "everySeconds": 1800}}))
    assert (job.checkpoint.every_steps, job.checkpoint.every_seconds) == (None, 1800.0)
    tiny = {k: v for k, v in MODEL_PRESETS["tiny"].model_dump(mode="json").items() if k != "name"}
    inline = {**JOB, "model": None, "modelSpec": tiny}
    job = to_training_spec("ml/inline", parse_spec(ElasticTrainingJobSpec, inline), tmp_path)
    assert job.model.endswith(".json") and (tmp_path / "ml_inline.json").exists()


USER = {**JOB, "allowedTP": None, "entrypoint": "myteam.train:main", "args": ["--lr", "3e-4"],
        "meshDims": {"dp": "dp_shard"}, "dpReplicas": True, "seed": 3}


def test_maps_a_user_job_without_looking_for_its_code() -> None:
    """The code lives in the worker image: the operator checks the entrypoint's form, not that it imports."""
    job = to_training_spec("ml/u", parse_spec(ElasticTrainingJobSpec, USER))
    assert (job.entrypoint, job.args, job.mesh_dims, job.dp_replicas, job.seed) == (
        "myteam.train:main", ["--lr", "3e-4"], {"dp": "dp_shard"}, True, 3)
    # paused into keepers below its minimum, as any job; no tp or pp dim in its mesh: both held at 1
    assert (job.on_below_minimum, job.allowed_tp, job.allowed_pp, job.checkpoint) == ("pause", [1], [1], None)
    job = to_training_spec("ml/u", parse_spec(ElasticTrainingJobSpec, {
        **USER, "meshDims": None, "allowedTP": [1, 2], "onBelowMinimum": "preempt"}))
    assert (job.mesh_dims, job.allowed_tp, job.allowed_pp) == (None, [1, 2], [1])
    job = to_training_spec("ml/r", parse_spec(ElasticTrainingJobSpec, JOB))
    assert (job.entrypoint, job.args, job.mesh_dims, job.dp_replicas, job.seed) == (None, [], None, False, 0)


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("job", {**USER, "checkpoint": {"dir": "/c"}}, "spec.checkpoint", "InvalidCheckpoint"),
    ("job", {**USER, "zero": 1}, "spec.zero", "InvalidZero"),
    ("job", {**USER, "allowedTP": [1, 2]}, "spec.allowedTP", "InvalidAllowedTP"),
    ("job", {**USER, "allowedPP": [2]}, "spec.allowedPP", "InvalidAllowedPP"),
    ("job", {**USER, "meshDims": {"tp": "tp"}}, "spec.meshDims", "InvalidMeshDims"),
    ("job", {**USER, "meshDims": {"dp": "x", "tp": "x"}}, "spec.meshDims", "InvalidMeshDims"),
    ("job", {**USER, "entrypoint": "train"}, "spec.entrypoint", "InvalidEntrypoint"),
    ("job", {**USER, "entrypoint": ""}, "spec.entrypoint", "InvalidEntrypoint"),
    ("job", {**USER, "seed": -1}, "spec.seed", "InvalidSeed"),
    ("job", {**JOB, "args": ["--x"]}, "spec.args", "InvalidArgs"),
    ("job", {**JOB, "meshDims": {"dp": "dp"}}, "spec.meshDims", "InvalidMeshDims"),
    ("job", {**JOB, "dpReplicas": True}, "spec.dpReplicas", "InvalidDpReplicas"),
    ("job", {**JOB, "minGPUs": 9}, "spec.minGPUs", "InvalidMinGPUs"),
    ("job", {**JOB, "model": "nope"}, "spec.model", "InvalidModel"),
    ("job", {**JOB, "model": None}, "spec.model", "InvalidModel"),
    ("job", {**JOB, "microBatch": 64}, "spec.microBatch", "InvalidMicroBatch"),
    ("job", {**JOB, "allowedTP": []}, "spec.allowedTP", "InvalidAllowedTP"),
    ("job", {**JOB, "template": {}}, "spec.template.image", "InvalidTemplateImage"),
    ("job", {**JOB, "modelSpec": None, "model": None}, "spec.model", "InvalidModel"),
    ("job", {**JOB, "onBelowMinimum": "drop"}, "spec.onBelowMinimum", "InvalidOnBelowMinimum"),
    ("job", {**JOB, "checkpoint": {"dir": "/c", "everySteps": 0}}, "spec.checkpoint.everySteps",
     "InvalidCheckpointEverySteps"),
    ("job", {**JOB, "checkpoint": {"everySteps": 5}}, "spec.checkpoint.dir", "InvalidCheckpointDir"),
    ("job", {**JOB, "checkpoint": {"dir": "/c", "everySteps": None}}, "spec.checkpoint.everySteps",
     "InvalidCheckpointEverySteps"),
    ("job", {**JOB, "checkpoint": {"dir": "/c", "everySeconds": 0}}, "spec.checkpoint.everySeconds",
     "InvalidCheckpointEverySeconds"),
    ("svc", {**SVC, "minReplicas": 5}, "spec.minReplicas", "InvalidMinReplicas"),
    ("svc", {**SVC, "metric": {"preset": "nope", "target": 1}}, "spec.metric.preset", "InvalidMetricPreset"),
    ("svc", {**SVC, "metric": {"query": "up", "target": 1}}, "spec.metric.prometheus", "InvalidMetricPrometheus"),
    ("svc", {**SVC, "metric": {"preset": "vllm-kv-cache", "target": 0.8}}, "spec.metric.type", "InvalidMetricType"),
    ("svc", {**SVC, "metric": {"preset": "vllm-requests", "target": 0}}, "spec.metric.target", "InvalidMetricTarget"),
    ("svc", {**SVC, "metric": {"preset": "vllm-kv-cache", "type": "Utilization", "target": 0.8, "noiseMargin": 0.5}},
     "spec.metric.noiseMargin", "InvalidMetricNoiseMargin"),
    ("svc", {**SVC, "scaleTargetRef": {"name": "x", "kind": "StatefulSet"}}, "spec.scaleTargetRef.kind",
     "InvalidScaleTargetRefKind"),
    ("pool", {"hardware": "tpu9"}, "spec.hardware", "InvalidHardware"),
    ("pool", {"gpusPerNode": 0}, "spec.gpusPerNode", "InvalidGpusPerNode"),
]


@pytest.mark.parametrize(("kind", "spec", "field", "reason"), BAD)
def test_bad_specs_name_the_field(kind: str, spec: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(CRError) as e:
        if kind == "job":
            to_training_spec("ml/j", parse_spec(ElasticTrainingJobSpec, spec))
        elif kind == "svc":
            to_inference_spec("ml/s", parse_spec(InferenceServiceSpec, spec))
        else:
            to_pool_spec("p", parse_spec(GPUPoolSpec, spec), 1)
    assert e.value.field == field and e.value.reason == reason, (e.value.field, e.value.reason, str(e.value))
    assert str(e.value).startswith(field)
    assert not any(snake in str(e.value) for snake in ("on_below_minimum", "allowed_tp", "mesh_dims", "dp_replicas"))


def test_user_job_messages_use_the_custom_resources_words() -> None:
    with pytest.raises(CRError) as e:
        to_training_spec("ml/u", parse_spec(ElasticTrainingJobSpec, {**USER, "allowedPP": [1, 2]}))
    assert "set allowedPP: [1]" in str(e.value) and "meshDims" in str(e.value), str(e.value)


@pytest.mark.parametrize(("change", "message"), [
    ({}, None),
    ({"onBelowMinimum": "preempt"}, None),
    ({"checkpoint": {"dir": "/c"}}, "spec: a job with an entrypoint keeps its own checkpoints; remove checkpoint"),
    ({"zero": 1}, "spec: a job with an entrypoint shards its optimizer state its own way; set zero: 0"),
    ({"onBelowMinimum": "pause"}, None),
])
def test_cel_rules_refuse_what_a_user_job_cannot_do(change: dict[str, Any], message: str | None) -> None:
    """``kubectl apply`` refuses it already; ``to_training_spec`` says the same where CEL does not run."""
    from tests.operator.test_manifests import _cel_failures, _defaulted, _spec_schema

    schema = _spec_schema("ElasticTrainingJob")["properties"]["spec"]
    spec = {k: v for k, v in _defaulted(schema, {**USER, **change}).items() if v is not None}
    assert _cel_failures(schema, spec) == ([message] if message else [])
    reference = {k: v for k, v in _defaulted(schema, {**JOB, **change}).items() if v is not None}
    assert _cel_failures(schema, reference) == []
