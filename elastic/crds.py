"""Custom resources of the ``elastic.dev`` API group: declared once, CRDs generated from them.

What it is for: the three kinds users apply with kubectl (``GPUPool``, ``InferenceService``,
``ElasticTrainingJob``) are pydantic models here, one docstring per field; ``crd_manifests()``
turns them into ``apiextensions.k8s.io/v1`` CRDs whose ``openAPIV3Schema`` is the models' JSON
schema converted to a *structural* OpenAPI v3 schema (``$ref`` inlined, ``anyOf [X, null]`` ->
``nullable``, free-form maps -> ``x-kubernetes-preserve-unknown-fields``), plus status schemas,
``/status`` and ``/scale`` subresources, printer columns and CEL cross-field rules.
``elastic crds`` writes them to ``manifests/crds/``; a test fails when the committed YAML drifts.

It also maps a CR's spec to the controller's ``PoolSpec`` / ``InferenceSpec`` / ``TrainingSpec``
(``to_pool_spec`` ...), raising ``CRError`` whose ``field`` and ``reason`` name what to fix: the
operator turns it into a ``Ready=False`` condition. CEL rules and these checks say the same
thing twice on purpose: the API server refuses bad input at ``kubectl apply`` time, and the
operator still refuses it when a cluster runs without CRD validation (or an emulator).

What it must not do: talk to a cluster. Pure data and conversions only.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from elastic.crd_status import (
    Condition,
    CRModel,
    DroppedLayout,
    ElasticTrainingJobStatus,
    GPUPoolStatus,
    InferenceServiceStatus,
    LastReshard,
    MeasuredMemoryStatus,
    PredictedMemory,
)
from elastic.model import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    Behavior,
    CheckpointSpec,
    InferenceSpec,
    MetricTarget,
    ModelSpec,
    PoolSpec,
    SpecError,
    TrainingSpec,
)

# the status models live in elastic.crd_status; these names stay importable from here
__all__ = ["Condition", "DroppedLayout", "ElasticTrainingJobStatus", "GPUPoolStatus", "InferenceServiceStatus",
           "LastReshard", "MeasuredMemoryStatus", "PredictedMemory"]

GROUP = "elastic.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
WORKER_COMMAND = ["python", "-m", "elastic.train.worker"]


class CRError(SpecError):
    """A custom resource the operator refuses: ``field`` (e.g. ``spec.minGPUs``) and a ``reason`` code."""

    def __init__(self, field: str, reason: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = reason


_CR = CRModel


# --------------------------------------------------------------------------------------------
# GPUPool (cluster-scoped)
# --------------------------------------------------------------------------------------------


class GPUPoolSpec(_CR):
    """A set of GPU nodes shared by inference services and elastic training jobs."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a node must carry to belong to the pool (all must match; empty = every node with GPUs)."""
    gpus_per_node: int = Field(default=8, ge=1, le=64, alias="gpusPerNode")
    """GPUs per node the pool may use; a node offering fewer allocatable ``nvidia.com/gpu`` gives what it has."""
    hardware: str = "h100-80g"
    """Hardware preset for the layout planner's memory and throughput model (e.g. ``h100-80g``, ``cpu``)."""
    rescale_interval_seconds: float = Field(default=60.0, ge=0)
    """Minimum seconds between two rescales of one training job (damps flapping)."""
    gain_threshold: float = Field(default=0.1, ge=0)
    """Minimum relative throughput gain that justifies growing a training job (0.1 = 10%)."""
    headroom_gpus: int = Field(default=0, ge=0, alias="headroomGPUs")
    """GPUs kept free for inference bursts (never lent to training)."""
    tick_seconds: float = Field(default=5.0, gt=0, le=3600)
    """Seconds between two reconcile cycles of this pool."""


# --------------------------------------------------------------------------------------------
# InferenceService
# --------------------------------------------------------------------------------------------


class ScaleTargetRef(_CR):
    """The workload whose replicas this service scales (through its ``/scale`` subresource)."""

    api_version: str = "apps/v1"
    """API version of the target; only ``apps/v1`` is supported."""
    kind: Literal["Deployment"] = "Deployment"
    """Kind of the target; only ``Deployment`` is supported."""
    name: str = Field(min_length=1)
    """Name of the Deployment in the service's namespace."""


class Metric(_CR):
    """What to measure and the value to hold it at (one of ``preset`` or ``query``)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "has(self.preset) != has(self.query)", "message": "give exactly one of preset or query"},
    ]})

    preset: str | None = None
    """Named query for common servers, e.g. ``vllm-requests``, ``vllm-running``, ``sglang-queue``."""
    query: str | None = None
    """PromQL returning one series (instead of ``preset``); needs ``prometheus``."""
    prometheus: str | None = None
    """Prometheus base URL, e.g. ``http://prometheus.monitoring:9090``."""
    type: Literal["AverageValue", "Value", "Utilization"] = "AverageValue"
    """``AverageValue``: target per replica (HPA v2 semantics); ``Value``/``Utilization``: per-replica average."""
    target: float = Field(gt=0)
    """Target value (per replica for ``AverageValue``)."""
    activation_threshold: float = Field(default=0.0, ge=0)
    """With ``minReplicas: 0``: leave zero only when the metric is above this value (KEDA semantics)."""
    window_seconds: float = Field(default=0.0, ge=0, le=3600)
    """Scale down on the mean of this many seconds of readings (scale up on the latest); 0 = off."""
    noise_margin: float = Field(default=0.0, ge=0, le=5)
    """Scale down only when load + noiseMargin x sqrt(load) fits the smaller count (a count of requests
    in flight scatters by about sqrt(load)); ``AverageValue`` only; 0 = off."""


class ScalingPolicyCR(_CR):
    """One HPA v2 rate policy."""

    type: Literal["Pods", "Percent"]
    """``Pods``: absolute replicas per period; ``Percent``: percent of current replicas per period."""
    value: int = Field(gt=0)
    """Replicas or percent allowed per period."""
    period_seconds: int = Field(gt=0, le=1800)
    """Length of the window the policy holds over."""


class ScalingRulesCR(_CR):
    """HPA v2 ``behavior.scaleUp`` / ``behavior.scaleDown``."""

    stabilization_window_seconds: int | None = Field(default=None, ge=0, le=3600)
    """Look-back window: scale down to the highest (up: lowest) recommendation in it."""
    select_policy: Literal["Max", "Min", "Disabled"] = "Max"
    """Which policy wins when several apply; ``Disabled`` forbids scaling in this direction."""
    policies: list[ScalingPolicyCR] | None = None
    """Rate limits."""
    tolerance: float | None = Field(default=None, ge=0, lt=1)
    """Ratio band around 1.0 inside which nothing changes (default 0.1)."""


class BehaviorCR(_CR):
    """HPA v2 scaling behaviour."""

    scale_up: ScalingRulesCR | None = None
    """Rules for scaling up."""
    scale_down: ScalingRulesCR | None = None
    """Rules for scaling down."""


class InferenceServiceSpec(_CR):
    """An inference server (e.g. a vLLM Deployment) whose replicas follow its load."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must be <= maxReplicas",
         "fieldPath": ".minReplicas"},
        {"rule": "!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
         "message": "replicas must lie within [minReplicas, maxReplicas]", "fieldPath": ".replicas"},
    ]})

    pool: str = Field(min_length=1)
    """Name of the ``GPUPool`` this service runs in."""
    scale_target_ref: ScaleTargetRef
    """The Deployment to scale; it must exist in this namespace."""
    metric: Metric
    """The load signal and its target."""
    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas (0 allows scale to zero)."""
    max_replicas: int = Field(default=8, ge=1)
    """Most replicas."""
    replicas: int | None = Field(default=None, ge=0)
    """Pinned replica count (``kubectl scale`` writes it through ``/scale``); unset = follow the metric."""
    behavior: BehaviorCR | None = None
    """HPA v2 scaling behaviour (stabilisation windows, rate policies, tolerance)."""
    gpus_per_replica: int = Field(default=1, ge=1, alias="gpusPerReplica")
    """GPUs each replica needs (e.g. vLLM ``--tensor-parallel-size``)."""
    priority: int = 100
    """Higher wins GPUs first; inference above training by default."""
    startup_seconds: float = Field(default=30.0, ge=0)
    """Typical seconds from scale-up to a ready replica (the forecast looks this far ahead)."""
    forecast: Literal["off", "trend", "holt-winters"] = "off"
    """Short-horizon load forecast used to scale up ahead of a ramp."""
    drain_ahead_seconds: float = Field(default=0.0, ge=0, le=3600)
    """Take the replicas a coming scale-down removes out of the load balancer this many seconds
    before the scale-down window lets them go (they finish their requests, keep their GPUs and
    serve again the moment the load rises); 0 = off. Needs the annotation ``elastic.dev/drain:
    "true"`` and a Service that selects ``elastic.dev/serving: "true"``."""


# --------------------------------------------------------------------------------------------
# ElasticTrainingJob
# --------------------------------------------------------------------------------------------


class EnvVar(_CR):
    """One environment variable of the worker container."""

    name: str = Field(min_length=1)
    """Variable name."""
    value: str = ""
    """Variable value."""


class WorkerTemplate(_CR):
    """How each worker pod runs (one GPU per worker)."""

    image: str = Field(min_length=1)
    """Container image with elastic (or a trainer implementing the worker agent protocol)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes image pull policy."""
    command: list[str] = Field(default_factory=lambda: list(WORKER_COMMAND))
    """Container command; the default runs elastic's worker agent (the reference trainer, or the job's
    ``entrypoint`` when it names one)."""
    args: list[str] = Field(default_factory=list)
    """Arguments to ``command``."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment (the operator sets ``ELASTIC_JOB``, ``ELASTIC_WORKER_ID``, ``ELASTIC_RENDEZVOUS_URL``, and
    for a job with an ``entrypoint`` ``ELASTIC_ENTRYPOINT`` and ``ELASTIC_ARGS``)."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """Container resources (``requests``/``limits``); ``nvidia.com/gpu: 1`` is always added."""
    service_account_name: str | None = None
    """Service account of the worker pods."""
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    """Pod volumes (Kubernetes ``Volume`` objects), e.g. the shared volume ``checkpoint.dir`` lives on."""
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    """Mounts of ``volumes`` into the worker container (Kubernetes ``VolumeMount`` objects)."""


class CheckpointPolicy(_CR):
    """Periodic sharded checkpoints: a loss no replica covers restarts the job here, not at step 0."""

    dir: str = Field(min_length=1)
    """Directory inside the worker pods, on a volume every worker mounts read-write (``template.volumes``);
    the job's checkpoints go to ``<dir>/<job name>``."""
    every_steps: int | None = Field(default=100, ge=1)
    """Save at every multiple of this many steps (the step waits only for a copy to host memory);
    null: by time only."""
    every_seconds: float | None = Field(default=None, gt=0)
    """Also save once this many seconds have passed since the last checkpoint began."""
    keep: int = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""


class ElasticTrainingJobSpec(_CR):
    """A 3D-parallel training job that grows and shrinks in place on the pool's idle GPUs."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.minGPUs <= self.maxGPUs", "message": "minGPUs must be <= maxGPUs", "fieldPath": ".minGPUs"},
        {"rule": "has(self.model) != has(self.modelSpec)", "message": "give exactly one of model or modelSpec"},
        {"rule": "self.microBatch <= self.globalBatch", "message": "microBatch must be <= globalBatch",
         "fieldPath": ".microBatch"},
        {"rule": "!has(self.entrypoint) || !has(self.checkpoint)",
         "message": "a job with an entrypoint keeps its own checkpoints; remove checkpoint", "fieldPath": ".checkpoint"},
        {"rule": "!has(self.entrypoint) || self.zero == 0",
         "message": "a job with an entrypoint shards its optimizer state its own way; set zero: 0", "fieldPath": ".zero"},
    ]})

    pool: str = Field(min_length=1)
    """Name of the ``GPUPool`` this job runs in."""
    model: str | None = None
    """Model preset name (e.g. ``gpt-100m``, ``llama3-8b``); or give ``modelSpec``."""
    model_spec: dict[str, Any] | None = None
    """Inline model architecture (the ModelSpec keys: layers, hidden, heads, ...) instead of a preset."""
    allowed_tp: list[int] | None = Field(default=None, alias="allowedTP")
    """Tensor-parallel degrees the planner may use (default: any that divides the heads)."""
    allowed_pp: list[int] | None = Field(default=None, alias="allowedPP")
    """Pipeline-parallel degrees the planner may use (default: any)."""
    min_gpus: int = Field(default=1, ge=1, alias="minGPUs")
    """Fewest GPUs the job runs on; below it the job pauses (see onBelowMinimum)."""
    on_below_minimum: Literal["pause", "preempt"] | None = Field(default=None, alias="onBelowMinimum")
    """When inference needs GPUs the job cannot spare above minGPUs: ``pause`` keeps its state off-GPU and
    resumes it at the same step later (on backends that can; else it is preempted); ``preempt`` stops it
    (state dropped, it starts again from step 0). Omitted: ``pause``."""
    max_gpus: int = Field(default=8, ge=1, alias="maxGPUs")
    """Most GPUs the job takes."""
    global_batch: int = Field(default=16, ge=1)
    """Sequences per optimizer step; invariant across rescales (``dp * microBatch * gradAccum``)."""
    micro_batch: int = Field(default=1, ge=1)
    """Sequences per micro-batch."""
    micro_batch_cap: int | None = Field(default=None, ge=1)
    """The reference trainer picks each layout's micro-batch: the largest size up to this cap that splits its
    replica's share of the global batch evenly; the planner sizes memory for that micro-batch. Omit:
    ``microBatch`` at every layout. Not with an entrypoint."""
    precision: Literal["bf16-mixed", "fp32", "fp64"] | None = None
    """What the job trains in, which the planner sizes its memory for (``bf16-mixed``: bf16 weights and
    activations, fp32 gradients, master copy and Adam moments); the reference trainer runs it. Omit: the
    planner counts ``bf16-mixed``."""
    recompute: Literal["none", "selective", "full"] | None = None
    """The activation recompute the job's trainer runs, which the planner sizes activations for. Omit: the
    planner picks per layout."""
    offload: bool | None = None
    """Whether the job's trainer keeps its optimizer state in host memory. Omit: the planner offloads only a
    layout that fits no other way."""
    memory_limit_bytes: int | None = Field(default=None, ge=1)
    """Bytes each of the job's GPUs may hold in its tensors (weights, gradients, optimizer state, activations),
    below what the device leaves: the planner offers only layouts that fit under it and a layout whose
    measured step goes over is dropped. Omit: the device's memory less the planner's reserve."""
    zero: int = Field(default=0, ge=0, le=1)
    """1 = ZeRO-1 (optimizer state sharded across data-parallel ranks)."""
    replicate_optimizer: bool = Field(default=False, alias="replicateOptimizer")
    """Never shard the optimizer state, so every data-parallel replica holds a full copy and a lost worker
    is recovered from its replica without a restart (costs optimizer memory)."""
    priority: int = 0
    """Higher wins GPUs first among training jobs; inference defaults to 100."""
    checkpoint: CheckpointPolicy | None = None
    """Periodic checkpoints, for losses no data-parallel replica covers (``dp = 1``, ZeRO-1, two losses):
    the job then starts again from the newest complete one, on any layout. Omit: it starts from step 0."""
    entrypoint: str | None = Field(default=None, min_length=1)
    """The user's own training code, run by every worker under ``elastic.torch.Manager``:
    ``package.module:function`` or a script path ending in ``.py``, as the worker image has it (the
    operator does not look inside the image: a worker that cannot load it fails the job with the import
    error). ``model``/``modelSpec`` still declares the model the planner sizes the job from. Omit: the
    reference trainer."""
    args: list[str] = Field(default_factory=list)
    """Command-line arguments of ``entrypoint`` (its ``sys.argv[1:]``); only with an entrypoint."""
    mesh_dims: dict[str, str] | None = None
    """With an entrypoint: the name of the user's device mesh dim for each axis it shards over (keys ``dp``,
    ``tp``, ``pp``), e.g. ``{dp: dp_shard, tp: tp}`` (the default); an axis without a name has degree 1."""
    dp_replicas: bool = False
    """With an entrypoint: the data-parallel ranks hold full copies of the state (DDP-style), so a lost worker
    is recovered in place; false: they hold shards (FSDP-style) and a lost worker fails the job."""
    seed: int = Field(default=0, ge=0)
    """Seed of the data order (the reference trainer may ignore it)."""
    template: WorkerTemplate
    """Worker pod template."""


# --------------------------------------------------------------------------------------------
# CRD generation
# --------------------------------------------------------------------------------------------

_DROP = {"title", "additionalProperties"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Convert a pydantic (JSON Schema 2020-12) schema to a structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})

    def conv(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if "$ref" in node:  # inline; keep the referencing field's description
            target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
            node = {**target, **{k: v for k, v in node.items() if k in ("description", "default")}}
        if "anyOf" in node:
            options = node.pop("anyOf")
            non_null = [o for o in options if o.get("type") != "null"]
            if len(non_null) != 1:
                raise ValueError(f"cannot express anyOf {options} structurally")
            node = conv({**non_null[0], **node})
            if len(non_null) < len(options):
                node["nullable"] = True
            return node
        if node.get("default", 0) is None:
            node.pop("default")
        if "const" in node:
            node["enum"] = [node.pop("const")]
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node and not isinstance(node[bound], bool):
                node["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
                node[bound] = True
        free_map = node.get("type") == "object" and "properties" not in node and (
            node.get("additionalProperties") in (True, None) or node.get("additionalProperties") == {})
        if free_map:
            node["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = conv(node["additionalProperties"])
            return {k: v for k, v in node.items() if k != "title"}
        node = {k: v for k, v in node.items() if k not in _DROP and k != "$defs"}
        if "properties" in node:
            node["properties"] = {k: conv(v) for k, v in node["properties"].items()}
        if "items" in node:
            node["items"] = conv(node["items"])
        return node

    return conv(schema)


def _schema(model: type[BaseModel], *, defaults: bool = True) -> dict[str, Any]:
    text = json.dumps(model.model_json_schema(by_alias=True, mode="validation")).replace("``", "`")
    schema = structural(json.loads(text))
    return schema if defaults else _without_defaults(schema)


def _without_defaults(node: Any) -> Any:
    """Status is written by the operator only: no defaulting there."""
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def _conditions_map_list(status: dict[str, Any]) -> dict[str, Any]:
    cond = status["properties"]["conditions"]
    cond["x-kubernetes-list-type"] = "map"
    cond["x-kubernetes-list-map-keys"] = ["type"]
    return status


def _ready(column: str = "READY") -> dict[str, Any]:
    return {"name": column, "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'}


_AGE = {"name": "AGE", "type": "date", "jsonPath": ".metadata.creationTimestamp"}

KINDS: dict[str, dict[str, Any]] = {
    "GPUPool": {
        "plural": "gpupools", "singular": "gpupool", "short": ["gpool"], "scope": "Cluster",
        "spec": GPUPoolSpec, "status": GPUPoolStatus,
        "columns": [
            {"name": "NODES", "type": "integer", "jsonPath": ".status.nodes"},
            {"name": "GPUS", "type": "integer", "jsonPath": ".status.gpus"},
            {"name": "INFERENCE", "type": "integer", "jsonPath": ".status.inferenceGPUs"},
            {"name": "TRAINING", "type": "integer", "jsonPath": ".status.trainingGPUs"},
            {"name": "DECISION", "type": "string", "jsonPath": ".status.lastDecision"},
            _ready(), _AGE],
    },
    "InferenceService": {
        "plural": "inferenceservices", "singular": "inferenceservice", "short": ["isvc", "esvc"],
        "scope": "Namespaced", "spec": InferenceServiceSpec, "status": InferenceServiceStatus,
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"},
        "columns": [
            {"name": "POOL", "type": "string", "jsonPath": ".spec.pool"},
            {"name": "REPLICAS", "type": "integer", "jsonPath": ".status.replicas"},
            {"name": "DESIRED", "type": "integer", "jsonPath": ".status.desiredReplicas"},
            {"name": "LOAD", "type": "number", "jsonPath": ".status.observedValue"},
            {"name": "TARGET", "type": "number", "jsonPath": ".spec.metric.target"},
            _ready(), _AGE],
    },
    "ElasticTrainingJob": {
        "plural": "elastictrainingjobs", "singular": "elastictrainingjob", "short": ["etj"],
        "scope": "Namespaced", "spec": ElasticTrainingJobSpec, "status": ElasticTrainingJobStatus,
        "columns": [
            {"name": "POOL", "type": "string", "jsonPath": ".spec.pool"},
            {"name": "LAYOUT", "type": "string", "jsonPath": ".status.layout"},
            {"name": "GPUS", "type": "integer", "jsonPath": ".status.worldSize"},
            {"name": "STEP", "type": "integer", "jsonPath": ".status.step"},
            {"name": "TOKENS/S", "type": "number", "jsonPath": ".status.tokensPerSecond"},
            {"name": "PHASE", "type": "string", "jsonPath": ".status.phase"},
            _AGE],
    },
}


def crd_manifest(kind: str) -> dict[str, Any]:
    """The CRD of one kind (``apiextensions.k8s.io/v1``)."""
    k = KINDS[kind]
    spec_schema = _schema(k["spec"])
    spec_schema["description"] = (k["spec"].__doc__ or "").strip()
    status_schema = _conditions_map_list(_schema(k["status"], defaults=False))
    status_schema["description"] = f"Observed state of the {kind}, written by the operator."
    subresources: dict[str, Any] = {"status": {}}
    if "scale" in k:
        subresources["scale"] = dict(k["scale"])
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{k['plural']}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "elastic"}},
        "spec": {
            "group": GROUP,
            "scope": k["scope"],
            "names": {"kind": kind, "plural": k["plural"], "singular": k["singular"], "shortNames": k["short"],
                      "categories": ["elastic"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": subresources,
                "additionalPrinterColumns": k["columns"],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": f"{kind}: {(k['spec'].__doc__ or '').strip()}",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema, "status": status_schema,
                    },
                }},
            }],
        },
    }


def crd_manifests() -> list[dict[str, Any]]:
    return [crd_manifest(kind) for kind in KINDS]


def crd_yaml(kind: str) -> str:
    import yaml

    header = "# Generated by `elastic crds` from elastic/crds.py; do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(kind), sort_keys=False, width=120)


def crd_filename(kind: str) -> str:
    return f"{GROUP}_{KINDS[kind]['plural']}.yaml"


def write_crds(out: str | Path) -> list[Path]:
    """Write one YAML file per CRD into ``out``; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in KINDS:
        p = out / crd_filename(kind)
        p.write_text(crd_yaml(kind))
        paths.append(p)
    return paths


def drifted(out: str | Path) -> list[str]:
    """Files under ``out`` that differ from what ``write_crds`` would write (missing counts)."""
    out = Path(out)
    return [crd_filename(k) for k in KINDS
            if not (out / crd_filename(k)).exists() or (out / crd_filename(k)).read_text() != crd_yaml(k)]


# --------------------------------------------------------------------------------------------
# CR spec -> controller spec
# --------------------------------------------------------------------------------------------


def _reason_for(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    return "Invalid" + "".join(p[:1].upper() + p[1:] for p in parts[-2:]) if parts else "InvalidSpec"


def parse_spec(model: type[BaseModel], spec: dict[str, Any] | None) -> Any:
    """Validate a CR's spec; the first error becomes a CRError naming the field (camelCase)."""
    try:
        return model.model_validate(spec or {})
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        field = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        raise CRError(field, _reason_for(loc), err["msg"]) from None


def to_pool_spec(name: str, spec: GPUPoolSpec, nodes: int) -> PoolSpec:
    """The controller's pool (``nodes`` comes from the inventory: matching nodes with GPUs)."""
    if spec.hardware not in HARDWARE_PRESETS:
        raise CRError("spec.hardware", "InvalidHardware",
                      f"unknown hardware preset '{spec.hardware}'; use one of {', '.join(HARDWARE_PRESETS)}")
    return PoolSpec(name=name, nodes=max(nodes, 1), gpus_per_node=spec.gpus_per_node, hardware=spec.hardware,
                    rescale_interval_seconds=spec.rescale_interval_seconds, gain_threshold=spec.gain_threshold,
                    headroom_gpus=spec.headroom_gpus)


def to_inference_spec(workload: str, spec: InferenceServiceSpec) -> InferenceSpec:
    """The controller's service spec; the metric preset is checked here (unknown -> CRError)."""
    from elastic.metrics.presets import PRESETS, check_metric
    from elastic.metrics.sample import MetricQueryError

    if spec.min_replicas > spec.max_replicas:
        raise CRError("spec.minReplicas", "InvalidMinReplicas",
                      f"minReplicas={spec.min_replicas} > maxReplicas={spec.max_replicas}; "
                      "raise maxReplicas or lower minReplicas")
    m = spec.metric
    if (m.preset is None) == (m.query is None):
        raise CRError("spec.metric", "InvalidMetric", "give exactly one of metric.preset or metric.query")
    if m.preset is not None and m.preset not in PRESETS:
        raise CRError("spec.metric.preset", "InvalidMetricPreset",
                      f"unknown preset '{m.preset}'; known presets: {', '.join(PRESETS)}")
    if m.query is not None and not m.prometheus:
        raise CRError("spec.metric.prometheus", "InvalidMetricPrometheus",
                      "a PromQL query needs metric.prometheus (the Prometheus base URL)")
    if m.noise_margin > 0 and m.type != "AverageValue":
        raise CRError("spec.metric.noiseMargin", "InvalidMetricNoiseMargin",
                      f"noiseMargin applies to a count summed over replicas (type AverageValue); with type {m.type} "
                      "set it to 0")
    metric = MetricTarget(preset=m.preset, query=m.query, prometheus=m.prometheus, type=m.type, target=m.target,
                          activation_threshold=m.activation_threshold, window_seconds=m.window_seconds,
                          noise_margin=m.noise_margin)
    try:
        check_metric(metric)
    except MetricQueryError as e:
        raise CRError("spec.metric.type", "InvalidMetricType", str(e).split(": ", 1)[-1]) from None
    behavior = None
    if spec.behavior is not None:
        behavior = Behavior.model_validate(spec.behavior.model_dump(by_alias=True, exclude_none=True))
    return InferenceSpec(name=workload, gpus_per_replica=spec.gpus_per_replica, min_replicas=spec.min_replicas,
                         max_replicas=spec.max_replicas, priority=spec.priority, metric=metric, behavior=behavior,
                         startup_seconds=spec.startup_seconds, forecast=spec.forecast,
                         drain_ahead_seconds=spec.drain_ahead_seconds)


def to_training_spec(workload: str, spec: ElasticTrainingJobSpec, model_dir: str | Path | None = None) -> TrainingSpec:
    """The controller's job spec. An inline ``modelSpec`` is validated and written to ``model_dir``
    (``load_model`` reads models by preset name or file)."""
    if spec.min_gpus > spec.max_gpus:
        raise CRError("spec.minGPUs", "InvalidMinGPUs",
                      f"minGPUs={spec.min_gpus} > maxGPUs={spec.max_gpus}; raise maxGPUs or lower minGPUs")
    if (spec.model is None) == (spec.model_spec is None):
        raise CRError("spec.model", "InvalidModel", "give exactly one of model (a preset) or modelSpec (inline)")
    if spec.micro_batch > spec.global_batch:
        raise CRError("spec.microBatch", "InvalidMicroBatch",
                      f"microBatch={spec.micro_batch} > globalBatch={spec.global_batch}")
    model_ref = spec.model
    if model_ref is not None and model_ref not in MODEL_PRESETS:
        raise CRError("spec.model", "InvalidModel",
                      f"unknown model preset '{model_ref}'; use one of {', '.join(MODEL_PRESETS)} or give modelSpec")
    if spec.model_spec is not None:
        model_ref = _inline_model(workload, spec.model_spec, model_dir)
    for fname, values in (("allowedTP", spec.allowed_tp), ("allowedPP", spec.allowed_pp)):
        if values is not None and (not values or any(v < 1 for v in values)):
            raise CRError(f"spec.{fname}", f"Invalid{fname[0].upper()}{fname[1:]}", f"{values}: give degrees >= 1 (or omit the field)")
    if spec.checkpoint is not None and spec.checkpoint.every_steps is None and spec.checkpoint.every_seconds is None:
        raise CRError("spec.checkpoint.everySteps", "InvalidCheckpointEverySteps",
                      "neither everySteps nor everySeconds is set; give at least one (e.g. everySteps: 100)")
    assert model_ref is not None
    # omitted, onBelowMinimum is TrainingSpec's to choose (pause; preempt for a user job)
    below = {} if spec.on_below_minimum is None else {"on_below_minimum": spec.on_below_minimum}
    try:
        return TrainingSpec(name=workload, model=model_ref, min_gpus=spec.min_gpus, max_gpus=spec.max_gpus,
                            priority=spec.priority, global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                            micro_batch_cap=spec.micro_batch_cap, precision=spec.precision,
                            recompute=spec.recompute, offload=spec.offload,
                            memory_limit_bytes=spec.memory_limit_bytes,
                            allowed_tp=spec.allowed_tp, allowed_pp=spec.allowed_pp, zero=spec.zero,
                            replicate_optimizer=spec.replicate_optimizer, **below,
                            checkpoint=CheckpointSpec(dir=spec.checkpoint.dir, every_steps=spec.checkpoint.every_steps,
                                                      every_seconds=spec.checkpoint.every_seconds,
                                                      keep=spec.checkpoint.keep) if spec.checkpoint else None,
                            entrypoint=spec.entrypoint, args=spec.args, mesh_dims=spec.mesh_dims,
                            dp_replicas=spec.dp_replicas, seed=spec.seed)
    except ValidationError as e:  # a check across fields (a user job's rules): name the CR's field
        raise _training_error(e) from None


def _training_error(e: ValidationError) -> CRError:
    """The first of ``TrainingSpec``'s errors, at the CR's camelCase field (``spec.onBelowMinimum``),
    its text in the CR's words."""
    err = e.errors()[0]
    named = (err.get("ctx") or {}).get("field") or next((str(p) for p in err["loc"] if isinstance(p, str)), "")
    fields = ElasticTrainingJobSpec.model_fields
    alias = (fields[named].alias or named) if named in fields else to_camel(named) if named else ""
    message = err["msg"].removeprefix("Value error, ")
    for snake, info in fields.items():  # on_below_minimum=pause -> onBelowMinimum=pause
        if "_" in snake and info.alias:
            message = re.sub(rf"\b{snake}\b", info.alias, message)
    message = message.removeprefix(f"{alias}: ")
    return CRError(f"spec.{alias}" if alias else "spec", _reason_for((alias,) if alias else ()), message)


def _inline_model(workload: str, data: dict[str, Any], model_dir: str | Path | None) -> str:
    import json
    import tempfile

    try:
        model = ModelSpec.model_validate({"name": workload.replace("/", "-"), **data})
    except (ValidationError, SpecError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
        loc = ".".join(str(p) for p in first["loc"])
        raise CRError(f"spec.modelSpec{'.' + loc if loc else ''}", "InvalidModelSpec", first["msg"]) from None
    d = Path(model_dir) if model_dir else Path(tempfile.gettempdir()) / "elastic-models"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{workload.replace('/', '_')}.json"
    p.write_text(json.dumps(model.model_dump(mode="json")))
    return str(p)
