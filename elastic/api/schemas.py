"""Request and response bodies of the admin API (pydantic v2; they generate ``/openapi.json``).

Request bodies forbid unknown fields (a typo such as ``min_replica`` is a 422 naming it,
never silently ignored). Workload specs reuse the domain types ``InferenceSpec`` and
``TrainingSpec``, so the API accepts exactly what the YAML config and the custom resources
accept. Responses are plain documents; ``spec``/``status`` are the JSON the store holds.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from elastic.model import InferenceSpec, TrainingSpec


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests ----------------------------------------------------------------------------------

class ServiceWrite(_In):
    """Create or replace an inference service."""

    pool: str = Field(min_length=1, description="name of an existing pool (GET /api/v1/pools)")
    spec: InferenceSpec


class JobWrite(_In):
    """Create or replace a training job."""

    pool: str = Field(min_length=1, description="name of an existing pool (GET /api/v1/pools)")
    spec: TrainingSpec


class RescaleRequest(_In):
    """Pin a training job to a layout (``null`` unpins and lets the co-scheduler choose again)."""

    layout: str | None = Field(description="e.g. 'tp2.pp2.dp2'; validated by the planner against the pool's hardware",
                               examples=["tp2.pp2.dp2"])


class CheckpointRequest(_In):
    """Save a running training job's state now (at its next step boundary)."""

    wait_seconds: float = Field(default=0.0, ge=0, le=3600,
                                description="wait up to this long for every rank to write it (0: ask and return; "
                                            "the job's checkpointStep shows when it is complete)")


class OverrideRequest(_In):
    """Pin an inference service's replica count until a time."""

    replicas: int = Field(ge=0, description="replica count to hold (within the service's min/max)")
    until: AwareDatetime = Field(description="RFC 3339 time with offset, in the future, e.g. 2030-01-01T12:00:00Z")

    @field_validator("until")
    @classmethod
    def _representable(cls, v: AwareDatetime) -> AwareDatetime:
        # 9999-12-31T23:59:59-23:59 is year 10000 in UTC: every later read of it would fail
        try:
            v.astimezone(UTC).timestamp()
        except (OverflowError, ValueError):
            raise ValueError("too far in the future: give a time before 9999-12-31 in UTC") from None
        return v


# ---- responses ---------------------------------------------------------------------------------

class Pool(BaseModel):
    name: str
    spec: dict[str, Any]
    total_gpus: int | None = Field(default=None, description="nodes x gpus_per_node from the spec")
    allocated_gpus: dict[str, int] = Field(description="workload -> GPUs it holds now")
    leader: str | None = Field(description="owner of the controller lease, or null when none holds it")
    created_at: datetime
    updated_at: datetime


class Workload(BaseModel):
    """An inference service or a training job."""

    name: str
    pool: str
    spec: dict[str, Any]
    status: dict[str, Any]
    created_at: datetime
    updated_at: datetime


class ListMeta(BaseModel):
    continue_: str | None = Field(default=None, alias="continue",
                                  description="opaque token for the next page; null on the last page")

    model_config = ConfigDict(populate_by_name=True)


class PoolList(BaseModel):
    items: list[Pool]


class WorkloadList(BaseModel):
    items: list[Workload]


class Decision(BaseModel):
    """A change (``hold`` false, ``count`` 1), or a run of ``count`` identical holds (ticks that
    changed nothing, for the same reason) from ``first_at`` to ``last_at``."""

    id: int
    tick_at: datetime = Field(description="the row's first tick (same as first_at)")
    pool: str
    reason: str = Field(description="machine-readable reason code, e.g. InferenceDemand")
    message: str
    inputs: dict[str, Any] = Field(description="what the (latest) tick saw")
    plan: dict[str, Any]
    hold: bool = Field(default=False, description="true: ticks that changed nothing (a run of them)")
    count: int = Field(default=1, description="ticks this row stands for")
    first_at: datetime | None = None
    last_at: datetime | None = None


class DecisionList(BaseModel):
    items: list[Decision]
    metadata: ListMeta


class TableInfo(BaseModel):
    table: str = Field(description="history table: decisions, allocations, actions, audit, reshards")
    rows: int
    oldest: datetime | None = Field(description="the oldest kept row by the time retention judges it by (a run "
                                                "of holds: its last tick; an allocation, reshard or action: when "
                                                "it ended); null while no row has ended")
    retention_days: float | None = Field(description="rows older than this are deleted; null: kept (or no "
                                                     "controller in this process to say)")


class Database(BaseModel):
    dialect: str = Field(description="sqlite or postgresql")
    url: str = Field(description="the database URL, password masked")
    size_bytes: int = Field(description="SQLite: the file's pages; PostgreSQL: elastic's tables with indexes")
    tables: list[TableInfo]


class Reshard(BaseModel):
    id: int
    job: str
    pool: str
    generation: int
    from_layout: str
    to_layout: str
    bytes_planned: int
    bytes_lower_bound: int
    bytes_moved: int | None
    started_at: datetime
    finished_at: datetime | None
    pause_seconds: float | None
    status: str
    error: str | None


class ReshardList(BaseModel):
    items: list[Reshard]
    metadata: ListMeta


class RescaleResult(BaseModel):
    job: str
    layout: str | None = Field(description="the pinned layout; null when unpinned")
    world_size: int | None
    tokens_per_second: float | None = Field(description="planner estimate for the pinned layout")
    gpu_memory_bytes: int | None = Field(description="planner estimate of the busiest GPU's memory")
    message: str


class CheckpointResult(BaseModel):
    job: str
    previous_step: int = Field(description="the newest complete checkpoint's step when asked (-1: none)")
    step: int | None = Field(description="the new checkpoint's step, complete on every rank; null: not waited for")
    message: str


class Override(BaseModel):
    service: str
    replicas: int | None
    until: datetime | None
    message: str


class LastTick(BaseModel):
    at: datetime
    acted: bool
    reason: str
    message: str
    seconds: float
    error: str | None


class Intervention(BaseModel):
    """An operator's intervention on record (kept across restarts and failovers)."""

    kind: str = Field(description="pause, override (a service's replicas) or pin (a job's layout)")
    target: str = Field(description="the pool (pause), the service (override) or the job (pin)")
    value: dict[str, Any] = Field(description="override: {replicas}; pin: {layout}; pause: {}")
    by: str = Field(description="the name of the API token that set it")
    at: datetime = Field(description="when it was set")
    until: datetime | None = Field(default=None, description="an override ends by itself then")


class JobBackoff(BaseModel):
    """A job whose start or grow failed: it gets no more GPUs before ``next_attempt_at``."""

    failures: int = Field(description="failures in a row")
    reason: str = Field(description="the last failure")
    next_attempt_at: datetime


class ControllerStatus(BaseModel):
    pool: str
    owner: str
    leader: bool
    paused: bool
    ready: bool
    last_error: str | None
    last_tick: LastTick | None
    overrides: dict[str, Any] = Field(description="service -> {replicas, until, by, at}")
    pinned: dict[str, str] = Field(description="job -> pinned layout")
    interventions: list[Intervention] = Field(default_factory=list, description="pause, overrides and pins on "
                                              "record, with who set them and when (they survive a restart)")
    backoff: dict[str, JobBackoff] = Field(default_factory=dict, description="jobs backing off from failed starts")


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)
