"""The status of the ``elastic.dev`` custom resources: what the operator writes under ``.status``.

What it is for: one pydantic model per status, one docstring per field; ``elastic.crds`` turns them
into the CRDs' status schemas next to the specs. Field names are snake_case here and camelCase on
the wire (``CRModel``'s alias generator), as the Kubernetes API conventions ask.

What it must not do: talk to a cluster. Pure data only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class CRModel(BaseModel):
    """Base of every custom resource model: unknown fields refused, camelCase on the wire, field
    docstrings as schema descriptions."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              use_attribute_docstrings=True)


class Condition(CRModel):
    """One observation of the resource's state (Kubernetes API conventions)."""

    type: str
    """Condition type in CamelCase, e.g. ``Ready``."""
    status: Literal["True", "False", "Unknown"]
    """``True``, ``False`` or ``Unknown``."""
    reason: str
    """Machine-readable reason code in CamelCase (the controller's decision reason)."""
    message: str = ""
    """Human-readable explanation; names the field to fix when the spec is refused."""
    observed_generation: int = 0
    """``metadata.generation`` of the spec this condition was computed from."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When ``status`` last changed (RFC 3339)."""


class GPUPoolStatus(CRModel):
    nodes: int = 0
    """Nodes matching the selector with allocatable GPUs."""
    gpus: int = 0
    """GPUs in the pool."""
    inference_gpus: int = Field(default=0, alias="inferenceGPUs")
    """GPUs held by inference replicas."""
    training_gpus: int = Field(default=0, alias="trainingGPUs")
    """GPUs held by training workers."""
    leader: str = ""
    """Operator replica holding the pool's lease (the only one that acts)."""
    last_decision: str = ""
    """Reason of the last reconcile cycle's plan."""
    last_tick_time: str | None = None
    """When the last reconcile cycle ran (RFC 3339)."""
    observed_generation: int = 0
    """``metadata.generation`` last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """``Ready``: the pool is reconciled; ``False`` with the reason when it cannot act."""


class InferenceServiceStatus(CRModel):
    replicas: int = 0
    """Replicas the controller has set on the Deployment (``/scale`` status)."""
    ready_replicas: int = 0
    """Replicas the Deployment reports ready."""
    desired_replicas: int = 0
    """Replicas the policy wants (before the pool's limits)."""
    observed_value: float | None = None
    """Last metric value read (none when missing)."""
    selector: str = ""
    """Label selector of the target's pods (for the ``/scale`` subresource)."""
    gpus: list[str] = Field(default_factory=list)
    """GPUs (``node/index``) the controller books for the replicas."""
    observed_generation: int = 0
    """``metadata.generation`` last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """``Ready`` (spec accepted and scaled) and ``ScalingLimited`` (policy held back, with reason)."""


class LastReshard(CRModel):
    """The most recent in-place rescale."""

    from_layout: str = ""
    """Layout before."""
    to_layout: str = ""
    """Layout after."""
    seconds: float = 0.0
    """Training pause (last old step done -> first new step begun)."""
    bytes: int = 0
    """Bytes moved between workers."""
    time: str | None = None
    """When it finished (RFC 3339)."""


class PredictedMemory(CRModel):
    """The planner's per-GPU bytes for what the measured rank ran (its layout, pipeline stage and
    micro-batch), by component."""

    weights: int = 0
    """Parameters."""
    gradients: int = 0
    """Gradients."""
    optimizer: int = 0
    """Optimizer state on the GPU."""
    activations: int = 0
    """Activations held for backward at the stage's peak."""
    total: int = 0
    """The four above together (without the reserve)."""


class MeasuredMemoryStatus(CRModel):
    """The current layout's most loaded rank, as the reference trainer measures it (bytes), beside the
    planner's prediction and the per-GPU budget."""

    layout: str = ""
    """The layout measured."""
    rank: int = 0
    """The rank that peaked highest."""
    step: int = 0
    """The step measured (a layout's first steps and every 100th)."""
    weights: int = 0
    """Parameters held."""
    gradients: int = 0
    """Gradients held after the step's reduction."""
    optimizer: int = 0
    """Optimizer state held."""
    activations: int = 0
    """Peak bytes saved for backward during the step."""
    total: int = 0
    """The four above together."""
    device_peak: int | None = None
    """The GPU allocator's peak over the step (absent on CPU)."""
    predicted: PredictedMemory | None = None
    """The planner's bytes for the same rank (absent when the planner cannot evaluate the layout)."""
    budget_bytes: int | None = None
    """Per-GPU bytes a layout may use (device memory less the planner's reserve); a step over it drops the layout."""


class DroppedLayout(CRModel):
    """A layout the job never runs again: its step went over the per-GPU memory budget, or a worker
    ran out of memory on it."""

    layout: str = ""
    """The dropped layout."""
    reason: str = ""
    """``MemoryExceeded`` or ``OutOfMemory``."""
    peak_bytes: int | None = None
    """The measured peak (absent when it failed before a measurement)."""
    budget_bytes: int = 0
    """The per-GPU budget: the GPU's memory less the planner's reserve."""
    message: str = ""
    """What the decision log says of it."""
    at: float = 0.0
    """When it was dropped (seconds since the epoch)."""


class ElasticTrainingJobStatus(CRModel):
    phase: str = "Pending"
    """Pending, Running, Rescaling, Paused, Failed or Stopped."""
    layout: str = ""
    """Current layout, e.g. ``tp2.pp2.dp2``."""
    generation: int = 0
    """Layout generation (grows by one per rescale)."""
    world_size: int = 0
    """Workers (= GPUs) in the current layout."""
    step: int = 0
    """Last optimizer step."""
    tokens_per_second: float = 0.0
    """Training throughput."""
    loss: float | None = None
    """Last training loss."""
    last_reshard: LastReshard | None = None
    """The most recent in-place rescale."""
    workers: list[str] = Field(default_factory=list)
    """Worker pods of the current generation."""
    memory: MeasuredMemoryStatus | None = None
    """The current layout's measured memory (reference trainer jobs)."""
    dropped_layouts: list[DroppedLayout] = Field(default_factory=list)
    """Layouts dropped for their memory, for the rest of the job's life."""
    observed_generation: int = 0
    """``metadata.generation`` last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """``Ready`` (spec accepted) and ``Scheduled`` (GPUs granted, with the scheduler's reason)."""
