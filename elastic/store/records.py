"""The records the repository functions hand back: frozen dataclasses, safe to keep after the
transaction that read them ends.

What this module is for: the shape of what ``repo.py`` and its siblings return, declared once,
and ``_record``, which copies a row's columns into one.

What it must not do: hold behaviour or build SQL. A record is a row's values and nothing else.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, TypeVar

from elastic.model import GPU
from elastic.store.models import Base

# --------------------------------------------------------------------------------------------
# Records handed back to callers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolRecord:
    name: str
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime


@dataclasses.dataclass(frozen=True)
class WorkloadRecord:
    """An inference service or a training job (same shape)."""

    name: str
    pool: str
    spec: dict[str, Any]
    status: dict[str, Any]
    created_at: datetime
    updated_at: datetime


ServiceRecord = WorkloadRecord
JobRecord = WorkloadRecord


@dataclasses.dataclass(frozen=True)
class AllocationRecord:
    id: int
    pool: str
    workload: str
    kind: str
    gpus: tuple[GPU, ...]
    generation: int
    valid_from: datetime
    valid_to: datetime | None


@dataclasses.dataclass(frozen=True)
class DecisionRecord:
    """A change (``hold`` None, ``count`` 1) or a run of ``count`` identical holds from
    ``tick_at`` (its first tick) to ``last_at``; ``inputs`` are the run's latest tick's."""

    id: int
    tick_at: datetime
    pool: str
    inputs: dict[str, Any]
    plan: dict[str, Any]
    reason: str
    message: str
    count: int = 1
    last_at: datetime | None = None
    hold: str | None = None


@dataclasses.dataclass(frozen=True)
class ReshardRecord:
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


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    id: int
    pool: str
    kind: str
    workload: str
    payload: dict[str, Any]
    status: str
    created_at: datetime
    updated_at: datetime
    error: str | None


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    detail: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    pool: str
    owner: str
    acquired_at: datetime
    expires_at: datetime
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class InterventionRecord:
    pool: str
    kind: str  # pause | override | pin
    target: str  # the pool (pause), the service (override) or the job (pin)
    value: dict[str, Any]
    actor: str
    at: datetime
    until: datetime | None


R = TypeVar("R")


def _record(cls: type[R], row: Base, **override: Any) -> R:
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values = {n: getattr(row, n) for n in names if n not in override}
    return cls(**values, **override)
