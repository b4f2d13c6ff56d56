"""The workload specs users write: inference services (with their metric and HPA-style scaling
rules), training jobs (with checkpoints and user code) and the pool they share.

Pure pydantic models that validate themselves; each error names the field and the fix. A training
job's model is named here and read by :func:`elastic.model.load_model`; only a job with its own
training code loads ``elastic.train.userjob`` (inside its validator) for the rules its workers
apply.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic.errors import SpecError
from elastic.hardware import HARDWARE_PRESETS


class _Spec(BaseModel):
    # no inf or NaN in any float field (1e999 reads as inf): they would only fail later, deep inside
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


class ScalingPolicy(_Spec):
    """One HPA v2 rate policy."""

    type: Literal["Pods", "Percent"]
    value: int = Field(gt=0)
    period_seconds: int = Field(gt=0, le=1800, alias="periodSeconds")


class ScalingRules(_Spec):
    """HPA v2 ``behavior.scaleUp`` / ``behavior.scaleDown``."""

    stabilization_window_seconds: int | None = Field(default=None, ge=0, le=3600, alias="stabilizationWindowSeconds")
    select_policy: Literal["Max", "Min", "Disabled"] = Field(default="Max", alias="selectPolicy")
    policies: list[ScalingPolicy] | None = None
    # HPA v2 (Kubernetes 1.33+) per-direction tolerance; None = the HPA's cluster default 0.1.
    tolerance: float | None = Field(default=None, ge=0, lt=1)


class Behavior(_Spec):
    scale_up: ScalingRules | None = Field(default=None, alias="scaleUp")
    scale_down: ScalingRules | None = Field(default=None, alias="scaleDown")


class MetricTarget(_Spec):
    """What to measure and the value per replica (or in total) to hold it at."""

    preset: str | None = Field(default=None, description="e.g. 'vllm-running', 'sglang-queue', 'request-rate'")
    query: str | None = Field(default=None, description="PromQL instead of a preset")
    prometheus: str | None = Field(default=None, description="Prometheus base URL; none = scrape replicas directly")
    type: Literal["AverageValue", "Value", "Utilization"] = "AverageValue"
    target: float = Field(gt=0, description="target value (per replica for AverageValue)")
    # KEDA's activationThreshold: with min_replicas=0 the service leaves zero only when the
    # metric is strictly above this value, and returns to zero when it is at or below it.
    activation_threshold: float = Field(default=0.0, ge=0, alias="activationThreshold")
    # Shrink only on the mean of the readings of the last windowSeconds (grow on the latest
    # reading as before): an instantaneous gauge such as requests running jitters by
    # +-sqrt(load), and the scale-down window keeps the highest of those jitters, which holds
    # replicas the load does not need. Decided value = max(latest, window mean). 0 = off
    # (the HPA's behaviour: every reading on its own).
    window_seconds: float = Field(default=0.0, ge=0, le=3600, alias="windowSeconds",
                                  description="scale down on the mean of this many seconds of readings "
                                              "(scale up on the latest); 0 = off")
    # A count of requests in flight (Poisson arrivals) scatters by about the square root of its
    # value: at 70 requests a reading of 62 is one standard deviation, not a fall. A scale-down to
    # n replicas needs load + noiseMargin * sqrt(load) <= n * target, so a dip that size does not
    # drain a replica the load still needs (and start it again seconds later). AverageValue only.
    noise_margin: float = Field(default=0.0, ge=0, le=5, alias="noiseMargin",
                                description="scale down only when load + noiseMargin * sqrt(load) fits the "
                                            "smaller count (count metrics: their noise is about sqrt(load)); "
                                            "0 = off")

    @model_validator(mode="after")
    def _one_source(self) -> MetricTarget:
        if (self.preset is None) == (self.query is None):
            raise ValueError("metric: give exactly one of 'preset' or 'query'")
        if self.noise_margin > 0 and self.type != "AverageValue":
            raise ValueError(f"metric.noiseMargin applies to a count summed over replicas (type AverageValue); "
                             f"with type {self.type} set noiseMargin to 0")
        return self


class InferenceSpec(_Spec):
    name: str = Field(min_length=1)
    gpus_per_replica: int = Field(default=1, gt=0, le=4096)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=8, gt=0)
    priority: int = Field(default=100)
    metric: MetricTarget | None = None
    behavior: Behavior | None = None
    startup_seconds: float = Field(default=30.0, ge=0)
    # Short-horizon forecast (elastic.policy.forecast): scale up `startup_seconds` ahead of a ramp.
    forecast: Literal["off", "trend", "holt-winters"] = "off"
    forecast_window_seconds: float = Field(default=600.0, gt=0, description="trend: regression window")
    forecast_season_seconds: float = Field(default=86400.0, gt=0, description="holt-winters: season length")
    drain_ahead_seconds: float = Field(
        default=0.0, ge=0,
        description="take the replica a scale-down will remove out of the load balancer this many seconds "
                    "before the scale-down window lets it go, so its requests are done when it leaves and its "
                    "GPU goes to training at once (set it near the longest request you serve); it is put "
                    "back the moment the load rises again. 0 = off (drain only once the window has passed). "
                    "The Ray backend does it, and the Kubernetes backend for a service with the annotation "
                    "elastic.dev/drain: \"true\" (spec.drainAheadSeconds)")
    handoff: bool = Field(
        default=False,
        description="a leaving replica hands its requests back to the load balancer, which resumes each on "
                    "another replica from the tokens it had (Llumnix-style migration by recompute), instead of "
                    "finishing them: its GPU is free within a second of the scale-down rather than after its "
                    "longest request, and no request is cut. Needs replicas with POST /admin/handoff (the "
                    "reference replica) and a balancer that resumes handed-off streams (elastic's load "
                    "generator); a replica without the endpoint is drained as usual. The Ray backend does it; "
                    "Kubernetes ignores it")

    @model_validator(mode="after")
    def _bounds(self) -> InferenceSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}; raise max_replicas or lower min_replicas"
            )
        return self


class CheckpointSpec(_Spec):
    """Periodic sharded checkpoints of a training job (``elastic.train.checkpoint``)."""

    dir: str = Field(min_length=1, description="a directory every worker can write (a shared volume); the job's "
                                               "checkpoints go into <dir>/<job name>")
    every_steps: int | None = Field(default=100, gt=0, description="save at every multiple of this many steps (the "
                                                                   "step's tensors are copied, then written in the "
                                                                   "background); null: by time only")
    every_seconds: float | None = Field(default=None, gt=0, description="also save once this many seconds have passed "
                                                                       "since the last checkpoint began")
    keep: int = Field(default=2, gt=0, description="complete checkpoints kept; older ones are deleted")

    @model_validator(mode="after")
    def _one_interval(self) -> CheckpointSpec:
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("neither every_steps nor every_seconds is set; give at least one (e.g. every_steps: 100)")
        return self


class TrainingSpec(_Spec):
    name: str = Field(min_length=1)
    model: str = Field(description="preset name or path to a model file")
    min_gpus: int = Field(default=1, gt=0)
    max_gpus: int = Field(default=8, gt=0)
    priority: int = Field(default=0)
    on_below_minimum: Literal["pause", "preempt"] = Field(
        default="pause",
        description="when inference needs GPUs the job cannot spare above min_gpus: 'pause' moves its state "
                    "off-GPU into keepers and resumes it at the same step later; 'preempt' stops it (state dropped, "
                    "it starts again from step 0)")
    global_batch: int = Field(default=16, gt=0)
    micro_batch: int = Field(default=1, gt=0)
    micro_batch_cap: int | None = Field(
        default=None, gt=0,
        description="the reference trainer picks each layout's micro-batch: the largest size up to this cap that "
                    "splits its replica's share of the global batch evenly (fewer, larger micro-batches at small "
                    "dp); the planner sizes memory for that same micro-batch. None: micro_batch at every layout. "
                    "Not with an entrypoint (its micro_batch is already a cap)")
    precision: Literal["bf16-mixed", "fp32", "fp64"] | None = Field(
        default=None,
        description="what the job trains in, which the planner sizes its memory for: 'bf16-mixed' (bf16 weights "
                    "and activations, fp32 gradients, master copy and Adam moments), 'fp32' or 'fp64'; the "
                    "reference trainer runs it. None: the planner counts bf16-mixed and the reference trainer "
                    "runs fp32 (a CPU's)")
    memory_limit_bytes: int | None = Field(
        default=None, gt=0,
        description="the bytes each of the job's GPUs may hold in its tensors (weights, gradients, optimizer state, "
                    "activations), below what the device leaves: the planner offers only layouts that fit under "
                    "it, a layout whose measured step goes over is dropped, and the reference trainer refuses a "
                    "step that would (out of memory, the step given up). None: the device's memory less the "
                    "planner's reserve")
    recompute: Literal["none", "selective", "full"] | None = Field(
        default=None,
        description="the activation recompute the job's trainer runs, which the planner sizes activations for: "
                    "'none' (every activation kept, attention scores included), 'selective' (attention's scores "
                    "recomputed, or never stored by a flash-attention kernel: what the reference trainer holds), "
                    "'full' (only each layer's input kept). None: the planner picks per layout")
    offload: bool | None = Field(
        default=None,
        description="whether the job's trainer keeps its optimizer state in host memory; the planner counts it "
                    "there. None: the planner offloads only a layout that fits no other way")
    allowed_tp: list[int] | None = None
    allowed_pp: list[int] | None = None

    zero: int = Field(default=0, ge=0, le=1)
    replicate_optimizer: bool = Field(
        default=False,
        description="never shard the optimizer state (no ZeRO-1) so that every data-parallel replica holds "
                    "a full copy: a lost worker is then recovered from its replica without a restart; costs "
                    "optimizer memory (GPU counts where only ZeRO-1 fits drop out)")
    checkpoint: CheckpointSpec | None = Field(
        default=None,
        description="a safety net for losses no replica covers (dp = 1, ZeRO-1, two losses): the job then starts "
                    "again from its newest complete checkpoint, on any layout, instead of from step 0. Rescales "
                    "never use it (they move the state between live workers). None: no checkpoints")
    entrypoint: str | None = Field(
        default=None,
        description="the user's own training code, run under elastic.torch.Manager by every worker: "
                    "'package.module:function' (called with no arguments) or a script path ending in .py (run as "
                    "__main__). The declared model is what the planner sizes the job from. None: the reference "
                    "trainer")
    args: list[str] = Field(
        default_factory=list,
        description="command-line arguments of the entrypoint (its sys.argv[1:]); only with an entrypoint")
    mesh_dims: dict[str, str] | None = Field(
        default=None,
        description="the name of the user's device mesh dim for each controller axis it shards over (dp, tp, pp), "
                    "e.g. {dp: dp_shard, tp: tp}; an axis without a name always has degree 1 (allowed_tp/allowed_pp "
                    "become [1]). Only with an entrypoint; None: {dp: dp_shard, tp: tp}")
    dp_replicas: bool = Field(
        default=False,
        description="with an entrypoint: the data-parallel ranks hold full copies of the state (DDP-style), so a "
                    "lost worker is recovered in place from a copy; false: they hold shards (FSDP-style) and a "
                    "lost worker fails the job")
    seed: int = Field(default=0, ge=0, description="seed of the data order (the reference trainer may ignore it)")

    @field_validator("allowed_tp", "allowed_pp")
    @classmethod
    def _degrees(cls, v: list[int] | None, info: Any) -> list[int] | None:
        for d in v or ():
            if not 1 <= d <= 65536:
                raise ValueError(f"{info.field_name} contains {d}; degrees are from 1 to 65536")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> TrainingSpec:
        if self.zero and self.replicate_optimizer:
            raise ValueError("zero=1 shards the optimizer state and replicate_optimizer=true forbids it; "
                             "choose one")
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus={self.min_gpus} > max_gpus={self.max_gpus}; raise max_gpus or lower min_gpus")
        return self

    @model_validator(mode="after")
    def _user_code(self) -> TrainingSpec:
        """With an entrypoint: the rules of ``elastic.train.userjob`` plus what a user job cannot do
        (elastic's checkpoints, ZeRO-1); an axis ``mesh_dims`` does not name is held at 1. Without one: the user-job fields stay unset.
        Each error carries the offending field in its context (``ctx["field"]``)."""
        err = self._field_error
        if self.entrypoint is None:
            for name, default in (("args", []), ("mesh_dims", None), ("dp_replicas", False)):
                if getattr(self, name) != default:
                    raise err(name, f"{name}: only a job with an entrypoint (its own training code) takes it; "
                                    f"set entrypoint or remove {name}")
            return self
        # the workers apply these same rules; imported here, so only a user job loads elastic.train
        from elastic.train.userjob import DEFAULT_MESH_DIMS, check_mesh_dims, parse_entrypoint

        try:
            parse_entrypoint(self.entrypoint, "entrypoint")
        except SpecError as e:
            raise err("entrypoint", str(e)) from None
        try:
            dims = check_mesh_dims(self.mesh_dims if self.mesh_dims is not None else DEFAULT_MESH_DIMS)
        except SpecError as e:
            raise err("mesh_dims", str(e)) from None
        if self.micro_batch_cap is not None:
            raise err("micro_batch_cap", f"micro_batch_cap={self.micro_batch_cap}: a job with an entrypoint takes "
                                         "micro_batch as the most samples a rank computes at once; remove "
                                         "micro_batch_cap and set micro_batch")
        if self.checkpoint is not None:
            raise err("checkpoint", "checkpoint: a job with an entrypoint keeps its own checkpoints (elastic "
                                    "saves none of its state); remove checkpoint")
        if self.zero:
            raise err("zero", f"zero={self.zero}: a job with an entrypoint shards its optimizer state its own way "
                              "(ZeRO-1 is the reference trainer's); set zero: 0")
        held: dict[str, Any] = {}
        for axis, name in (("tp", "allowed_tp"), ("pp", "allowed_pp")):
            allowed = getattr(self, name)
            if axis in dims:
                continue
            if allowed not in (None, [1]):
                raise err(name, f"{name}={allowed}: mesh_dims {dims} names no {axis} dim, so the job runs {axis}=1 "
                                f"only; set {name}: [1] (or leave it out), or add a {axis} dim to mesh_dims "
                                f"(e.g. {axis}: {axis})")
            held[name] = [1]
        for name, value in held.items():  # derived, not set: a dump with exclude_unset stays as written
            object.__setattr__(self, name, value)
        return self

    def planner_options(self) -> dict[str, Any]:
        """What the planner sizes this job by, as ``controller.tables.throughput_table``'s keywords
        (the same names ``controller.memory.alternatives`` takes)."""
        return {"global_batch": self.global_batch, "allowed_tp": self.allowed_tp, "allowed_pp": self.allowed_pp,
                "zero": self.zero, "replicate_optimizer": self.no_zero1,
                "precision": self.precision or "bf16-mixed", "micro_batch_cap": self.micro_batch_cap,
                "memory_limit_bytes": self.memory_limit_bytes, "recompute": self.recompute, "offload": self.offload}

    @property
    def no_zero1(self) -> bool:
        """The planner must not shard this job's optimizer state: replicas are to stay whole
        (``replicate_optimizer``), or the optimizer is the user's own (a job with an entrypoint)."""
        return self.replicate_optimizer or self.entrypoint is not None

    @staticmethod
    def _field_error(field_name: str, message: str) -> Exception:
        """An error about one field: ``ctx["field"]`` lets the API and the operator name it."""
        from pydantic_core import PydanticCustomError

        return PydanticCustomError("user_job", message, {"field": field_name})


class PoolSpec(_Spec):
    name: str = Field(default="default", min_length=1)
    nodes: int = Field(default=1, gt=0)
    gpus_per_node: int = Field(default=8, gt=0)
    hardware: str = "cpu"
    rescale_interval_seconds: float = Field(default=60.0, ge=0)
    gain_threshold: float = Field(default=0.1, ge=0)
    headroom_gpus: int = Field(default=0, ge=0)

    @field_validator("hardware")
    @classmethod
    def _hw(cls, v: str) -> str:
        if v not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware '{v}'; use one of {', '.join(HARDWARE_PRESETS)}")
        return v

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node
