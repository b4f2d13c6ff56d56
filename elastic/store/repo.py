"""Repository functions: every read and write of the state store, small and explicit.

What this module is for: the only code that builds SQL against the tables in
``models.py``. Each function takes ``db`` first: a ``Store`` (the call is one
transaction of its own) or a ``Session`` from ``store.session()`` (the caller groups
several writes into one transaction, e.g. a tick's decision plus its allocations).
Results are frozen ``*Record`` dataclasses, safe to keep after the transaction ends.

What it must not do: decide anything. No scheduling rule, no policy, no retries with
judgement; it records what the controller decided and hands back what was recorded.
``now`` is a parameter everywhere (defaulting to the UTC wall clock only here, at the
edge); decision code passes its snapshot's time.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from elastic.model import GPU, Allocation
from elastic.store.engine import LeaseLost, NotFound, Store, StoreConflict
from elastic.store.models import (
    IN_FLIGHT,
    INTERVENTION_KINDS,
    WORKLOAD_KINDS,
    AllocationRow,
    AuditEntry,
    Base,
    DecisionRow,
    InferenceService,
    Intervention,
    Lease,
    PendingAction,
    Pool,
    ReshardEvent,
    SigningKey,
    TrainingJob,
)

DB = Store | Session
MAX_PAGE = 1000

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


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@contextmanager
def _tx(db: DB, read: bool = False) -> Iterator[Session]:
    """A session: the caller's (no commit here) or a fresh one-call transaction (``read``: read-only)."""
    if isinstance(db, Session):
        yield db
    else:
        with db.session(read_only=read) as s:
            yield s


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"now={now.isoformat()} is naive; pass a timezone-aware UTC time")
    return now.astimezone(UTC)


def _doc(value: Any, field: str) -> dict[str, Any]:
    """A JSON object from a mapping, pydantic model or dataclass; round-tripped so that
    what is stored equals what is read back (tuples become lists) on every backend."""
    if value is None:
        return {}
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be a JSON object (mapping), got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} is not JSON-serialisable: {e}") from None


def _insert(s: Session, table: type[Base]) -> Any:
    """``INSERT`` with ``ON CONFLICT`` support for the session's dialect."""
    name = s.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"store supports sqlite and postgresql, not {name}")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit={limit} must be between 1 and {MAX_PAGE}")


def _page(stmt: sa.Select[Any], id_col: Any, limit: int, after_id: int | None, newest_first: bool) -> sa.Select[Any]:
    """Keyset pagination: rows after the cursor ``after_id`` in the chosen order.

    Stable under concurrent inserts (unlike OFFSET): page 2 starts after the last id of
    page 1 whatever was written in between.
    """
    _check_limit(limit)
    if after_id is not None:
        stmt = stmt.where(id_col < after_id if newest_first else id_col > after_id)
    return stmt.order_by(id_col.desc() if newest_first else id_col.asc()).limit(limit)


# --------------------------------------------------------------------------------------------
# Pools
# --------------------------------------------------------------------------------------------


def upsert_pool(db: DB, name: str, spec: Any, now: datetime | None = None) -> PoolRecord:
    """Create or replace a pool's spec."""
    t, doc = _now(now), _doc(spec, "pool spec")
    with _tx(db) as s:
        ins = _insert(s, Pool).values(name=name, spec=doc, created_at=t, updated_at=t)
        s.execute(ins.on_conflict_do_update(index_elements=[Pool.name], set_={"spec": doc, "updated_at": t}))
        return _record(PoolRecord, s.get_one(Pool, name, populate_existing=True))


def get_pool(db: DB, name: str) -> PoolRecord | None:
    with _tx(db, read=True) as s:
        row = s.get(Pool, name)
        return _record(PoolRecord, row) if row else None


def list_pools(db: DB) -> list[PoolRecord]:
    with _tx(db, read=True) as s:
        return [_record(PoolRecord, r) for r in s.scalars(sa.select(Pool).order_by(Pool.name))]


# --------------------------------------------------------------------------------------------
# Inference services and training jobs (same shape, two tables)
# --------------------------------------------------------------------------------------------


def _upsert_workload(db: DB, table: type[InferenceService] | type[TrainingJob], name: str, pool: str,
                     spec: Any, status: Any | None, now: datetime | None) -> WorkloadRecord:
    t, doc = _now(now), _doc(spec, "spec")
    with _tx(db) as s:
        new_status = _doc(status, "status") if status is not None else {}
        update: dict[str, Any] = {"pool": pool, "spec": doc, "updated_at": t}
        if status is not None:  # None keeps the recorded status of an existing row
            update["status"] = new_status
        ins = _insert(s, table).values(name=name, pool=pool, spec=doc, status=new_status, created_at=t, updated_at=t)
        s.execute(ins.on_conflict_do_update(index_elements=[table.name], set_=update))
        return _record(WorkloadRecord, s.get_one(table, name, populate_existing=True))


def _set_status(db: DB, table: type[InferenceService] | type[TrainingJob], name: str, status: Any,
                now: datetime | None, what: str) -> WorkloadRecord:
    t, doc = _now(now), _doc(status, "status")
    with _tx(db) as s:
        row = s.get(table, name, with_for_update=True)
        if row is None:
            raise NotFound(f"{what} '{name}' not found; create it first")
        row.status, row.updated_at = doc, t
        s.flush()
        return _record(WorkloadRecord, row)


def _get_workload(db: DB, table: type[InferenceService] | type[TrainingJob], name: str) -> WorkloadRecord | None:
    with _tx(db, read=True) as s:
        row = s.get(table, name)
        return _record(WorkloadRecord, row) if row else None


def _list_workloads(db: DB, table: type[InferenceService] | type[TrainingJob], pool: str | None) -> list[WorkloadRecord]:
    stmt = sa.select(table).order_by(table.name)
    if pool is not None:
        stmt = stmt.where(table.pool == pool)
    with _tx(db, read=True) as s:
        return [_record(WorkloadRecord, r) for r in s.scalars(stmt)]


def _delete_workload(db: DB, table: type[InferenceService] | type[TrainingJob], name: str) -> bool:
    with _tx(db) as s:
        return s.execute(sa.delete(table).where(table.name == name)).rowcount == 1


def upsert_service(db: DB, name: str, pool: str, spec: Any, status: Any | None = None,
                   now: datetime | None = None) -> ServiceRecord:
    """Create or update an inference service. ``status=None`` keeps the recorded status."""
    return _upsert_workload(db, InferenceService, name, pool, spec, status, now)


def set_service_status(db: DB, name: str, status: Any, now: datetime | None = None) -> ServiceRecord:
    """Replace a service's status document, e.g. ``{"current_replicas": 2, "desired_replicas": 3,
    "observed_value": 41.5}``. Raises ``NotFound``."""
    return _set_status(db, InferenceService, name, status, now, "inference service")


def get_service(db: DB, name: str) -> ServiceRecord | None:
    return _get_workload(db, InferenceService, name)


def list_services(db: DB, pool: str | None = None) -> list[ServiceRecord]:
    return _list_workloads(db, InferenceService, pool)


def delete_service(db: DB, name: str) -> bool:
    return _delete_workload(db, InferenceService, name)


def upsert_job(db: DB, name: str, pool: str, spec: Any, status: Any | None = None,
               now: datetime | None = None) -> JobRecord:
    """Create or update a training job. ``status=None`` keeps the recorded status."""
    return _upsert_workload(db, TrainingJob, name, pool, spec, status, now)


def set_job_status(db: DB, name: str, status: Any, now: datetime | None = None) -> JobRecord:
    """Replace a job's status document, e.g. ``{"layout": "tp2.pp2.dp2", "generation": 4,
    "step": 1200, "phase": "Running"}``. Raises ``NotFound``."""
    return _set_status(db, TrainingJob, name, status, now, "training job")


def get_job(db: DB, name: str) -> JobRecord | None:
    return _get_workload(db, TrainingJob, name)


def list_jobs(db: DB, pool: str | None = None) -> list[JobRecord]:
    return _list_workloads(db, TrainingJob, pool)


def delete_job(db: DB, name: str) -> bool:
    return _delete_workload(db, TrainingJob, name)


# --------------------------------------------------------------------------------------------
# Allocations (history of who held which GPUs)
# --------------------------------------------------------------------------------------------


def _gpu_docs(gpus: Iterable[GPU | tuple[str, int]]) -> list[dict[str, Any]]:
    out = []
    for g in gpus:
        node, index = (g.node, g.index) if isinstance(g, GPU) else g
        out.append({"node": str(node), "index": int(index)})
    return out


def _alloc_record(row: AllocationRow) -> AllocationRecord:
    gpus = tuple(GPU(d["node"], int(d["index"])) for d in row.gpus)
    return _record(AllocationRecord, row, gpus=gpus)


def _open_allocation(s: Session, pool: str, workload: str) -> AllocationRow | None:
    stmt = sa.select(AllocationRow).where(
        AllocationRow.pool == pool, AllocationRow.workload == workload, AllocationRow.valid_to.is_(None)
    )
    return s.scalars(stmt.with_for_update()).one_or_none()


def set_allocation(db: DB, pool: str, workload: str, gpus: Sequence[GPU | tuple[str, int]], generation: int,
                   *, kind: str, now: datetime | None = None) -> AllocationRecord | None:
    """Record that ``workload`` holds exactly ``gpus`` from ``now`` on.

    Steps: 1. find the open row; 2. unchanged (same GPUs, generation, kind) -> return it,
    no new history; 3. close it at ``now``; 4. open a new row unless ``gpus`` is empty
    (empty = released, returns None).
    """
    if kind not in WORKLOAD_KINDS:
        raise ValueError(f"kind='{kind}' must be one of {', '.join(WORKLOAD_KINDS)}")
    t, docs = _now(now), _gpu_docs(gpus)
    with _tx(db) as s:
        current = _open_allocation(s, pool, workload)
        if current is not None and (current.gpus, current.generation, current.kind) == (docs, generation, kind):
            return _alloc_record(current)
        if current is not None:
            current.valid_to = t
            s.flush()  # close before opening: the partial unique index allows one open row
        if not docs:
            return None
        row = AllocationRow(pool=pool, workload=workload, kind=kind, gpus=docs, generation=generation,
                            valid_from=t, valid_to=None)
        s.add(row)
        s.flush()
        return _alloc_record(row)


def release_allocation(db: DB, pool: str, workload: str, now: datetime | None = None) -> bool:
    """Close ``workload``'s open allocation; False if it held none."""
    t = _now(now)
    with _tx(db) as s:
        current = _open_allocation(s, pool, workload)
        if current is None:
            return False
        current.valid_to = t
        return True


def current_allocations(db: DB, pool: str) -> dict[str, AllocationRecord]:
    """Open allocations of a pool: workload name -> record (sorted by name)."""
    stmt = (sa.select(AllocationRow).where(AllocationRow.pool == pool, AllocationRow.valid_to.is_(None))
            .order_by(AllocationRow.workload))
    with _tx(db, read=True) as s:
        return {r.workload: _alloc_record(r) for r in s.scalars(stmt)}


def current_allocation(db: DB, pool: str) -> Allocation:
    """The pool's open allocations as the domain ``Allocation`` the scheduler consumes."""
    return Allocation(holdings={w: r.gpus for w, r in current_allocations(db, pool).items()})


def allocation_history(db: DB, pool: str, workload: str | None = None, *, limit: int = 100,
                       after_id: int | None = None, newest_first: bool = False) -> list[AllocationRecord]:
    stmt = sa.select(AllocationRow).where(AllocationRow.pool == pool)
    if workload is not None:
        stmt = stmt.where(AllocationRow.workload == workload)
    with _tx(db, read=True) as s:
        return [_alloc_record(r) for r in s.scalars(_page(stmt, AllocationRow.id, limit, after_id, newest_first))]


# --------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------


def record_decision(db: DB, *, pool: str, tick_at: datetime, reason: str, message: str,
                    plan: Any, inputs: Any, hold: str | None = None) -> int:
    """Record one tick's decision; returns the id of the row that holds it (monotonic, the
    pagination cursor).

    ``hold`` None: a change, always a new row. ``hold`` given (a digest of what a tick that
    changed nothing held on): when the pool's newest row is a hold with the same digest, that
    row stands for this tick too (``count`` + 1, ``last_at`` = ``tick_at``, ``inputs`` the
    latest); otherwise a new run starts.
    """
    t, ins, doc = _now(tick_at), _doc(inputs, "inputs"), _doc(plan, "plan")
    if hold is not None and not 1 <= len(hold) <= 64:
        raise ValueError(f"hold={hold!r} must be 1-64 characters (a digest of what the tick held on)")
    with _tx(db) as s:
        if hold is not None:
            newest = s.scalars(sa.select(DecisionRow).where(DecisionRow.pool == pool)
                               .order_by(DecisionRow.id.desc()).limit(1).with_for_update()).first()
            if newest is not None and newest.hold == hold and newest.reason == reason:
                newest.count += 1
                newest.last_at = max(t, newest.last_at)
                newest.inputs = ins
                s.flush()
                return newest.id
        row = DecisionRow(tick_at=t, pool=pool, inputs=ins, plan=doc, reason=reason, message=message,
                          count=1, last_at=t, hold=hold)
        s.add(row)
        s.flush()
        return row.id


def get_decision(db: DB, decision_id: int) -> DecisionRecord | None:
    with _tx(db, read=True) as s:
        row = s.get(DecisionRow, decision_id)
        return _record(DecisionRecord, row) if row else None


def list_decisions(db: DB, limit: int = 50, after_id: int | None = None, *, pool: str | None = None,
                   newest_first: bool = False, reason: str | None = None,
                   up_to_id: int | None = None, changes_only: bool = False) -> list[DecisionRecord]:
    """A page of decisions after the cursor ``after_id`` (oldest first unless ``newest_first``),
    optionally only those with ``reason``, ids up to ``up_to_id``, and only changes (no holds)."""
    stmt = sa.select(DecisionRow)
    if pool is not None:
        stmt = stmt.where(DecisionRow.pool == pool)
    if changes_only:
        stmt = stmt.where(DecisionRow.hold.is_(None))
    if reason is not None:
        stmt = stmt.where(DecisionRow.reason == reason)
    if up_to_id is not None:
        stmt = stmt.where(DecisionRow.id <= up_to_id)
    with _tx(db, read=True) as s:
        return [_record(DecisionRecord, r) for r in s.scalars(_page(stmt, DecisionRow.id, limit, after_id, newest_first))]


# --------------------------------------------------------------------------------------------
# Reshard events (in flight while pending/running)
# --------------------------------------------------------------------------------------------


def start_reshard(db: DB, *, job: str, pool: str, generation: int, from_layout: str, to_layout: str,
                  bytes_planned: int, bytes_lower_bound: int, now: datetime | None = None,
                  status: str = "running") -> int:
    """Record a reshard as in flight (``running``, or ``pending`` if not yet started); returns its id.

    Raises ``StoreConflict`` if the job already has one in flight: finish or fail it first.
    """
    if status not in IN_FLIGHT:
        raise ValueError(f"status='{status}' must be one of {', '.join(IN_FLIGHT)} for a new reshard")
    t = _now(now)
    with _tx(db) as s:
        busy = s.scalars(sa.select(ReshardEvent.id).where(ReshardEvent.job == job,
                                                          ReshardEvent.status.in_(IN_FLIGHT))).first()
        if busy is not None:
            raise StoreConflict(f"job '{job}' already has reshard {busy} in flight; finish_reshard({busy}) first")
        row = ReshardEvent(job=job, pool=pool, generation=generation, from_layout=str(from_layout),
                           to_layout=str(to_layout), bytes_planned=bytes_planned,
                           bytes_lower_bound=bytes_lower_bound, started_at=t, status=status)
        s.add(row)
        s.flush()
        return row.id


def _in_flight_row(s: Session, reshard_id: int) -> ReshardEvent:
    row = s.get(ReshardEvent, reshard_id, with_for_update=True)
    if row is None:
        raise NotFound(f"reshard event {reshard_id} not found")
    if row.status not in IN_FLIGHT:
        raise StoreConflict(f"reshard event {reshard_id} is already {row.status}")
    return row


def mark_reshard_running(db: DB, reshard_id: int, now: datetime | None = None) -> ReshardRecord:
    """``pending`` -> ``running`` (started_at becomes ``now``)."""
    t = _now(now)
    with _tx(db) as s:
        row = _in_flight_row(s, reshard_id)
        row.status, row.started_at = "running", t
        s.flush()
        return _record(ReshardRecord, row)


def _outcome(error: str | None, cancelled: bool) -> str:
    """Any ``error`` given (even an empty message) means the work did not get done."""
    if cancelled and error is None:
        raise ValueError("cancelled=True needs error= (why it was called off)")
    return "cancelled" if cancelled else "failed" if error is not None else "done"


def finish_reshard(db: DB, reshard_id: int, *, bytes_moved: int | None, pause_seconds: float | None,
                   error: str | None = None, now: datetime | None = None, bytes_planned: int | None = None,
                   bytes_lower_bound: int | None = None, cancelled: bool = False) -> ReshardRecord:
    """Close an in-flight reshard: ``done``; ``failed`` when ``error`` is given; ``cancelled``
    (with ``error`` saying why) when it was called off before anything moved.

    ``bytes_planned`` / ``bytes_lower_bound`` overwrite the figures given at start when the
    plan was only made by the workers (the in-place reshard plans at the step boundary)."""
    t = _now(now)
    status = _outcome(error, cancelled)
    with _tx(db) as s:
        row = _in_flight_row(s, reshard_id)
        row.status = status
        row.finished_at, row.bytes_moved, row.pause_seconds, row.error = t, bytes_moved, pause_seconds, error
        if bytes_planned is not None:
            row.bytes_planned = bytes_planned
        if bytes_lower_bound is not None:
            row.bytes_lower_bound = bytes_lower_bound
        s.flush()
        return _record(ReshardRecord, row)


def get_reshard(db: DB, reshard_id: int) -> ReshardRecord | None:
    with _tx(db, read=True) as s:
        row = s.get(ReshardEvent, reshard_id)
        return _record(ReshardRecord, row) if row else None


def list_reshards(db: DB, job: str | None = None, limit: int = 50, after_id: int | None = None, *,
                  newest_first: bool = False) -> list[ReshardRecord]:
    stmt = sa.select(ReshardEvent)
    if job is not None:
        stmt = stmt.where(ReshardEvent.job == job)
    with _tx(db, read=True) as s:
        return [_record(ReshardRecord, r) for r in s.scalars(_page(stmt, ReshardEvent.id, limit, after_id, newest_first))]


def in_flight_reshards(db: DB, pool: str | None = None) -> list[ReshardRecord]:
    """Reshards a crashed controller left pending/running (oldest first)."""
    stmt = sa.select(ReshardEvent).where(ReshardEvent.status.in_(IN_FLIGHT)).order_by(ReshardEvent.id)
    if pool is not None:
        stmt = stmt.where(ReshardEvent.pool == pool)
    with _tx(db, read=True) as s:
        return [_record(ReshardRecord, r) for r in s.scalars(stmt)]


# --------------------------------------------------------------------------------------------
# Pending actions (write-ahead record of backend actions)
# --------------------------------------------------------------------------------------------


def begin_action(db: DB, *, pool: str, kind: str, workload: str, payload: Any = None,
                 now: datetime | None = None) -> int:
    """Record an action about to be sent to a backend (status ``running``); returns its id."""
    t = _now(now)
    row = PendingAction(pool=pool, kind=kind, workload=workload, payload=_doc(payload, "payload"),
                        status="running", created_at=t, updated_at=t)
    with _tx(db) as s:
        s.add(row)
        s.flush()
        return row.id


def finish_action(db: DB, action_id: int, *, error: str | None = None, now: datetime | None = None,
                  cancelled: bool = False) -> ActionRecord:
    """Close an action: ``done``; ``failed`` when ``error`` is given; ``cancelled`` (with
    ``error`` saying why) when it was called off."""
    t = _now(now)
    status = _outcome(error, cancelled)
    with _tx(db) as s:
        row = s.get(PendingAction, action_id, with_for_update=True)
        if row is None:
            raise NotFound(f"action {action_id} not found")
        if row.status not in IN_FLIGHT:
            raise StoreConflict(f"action {action_id} is already {row.status}")
        row.status, row.updated_at, row.error = status, t, error
        s.flush()
        return _record(ActionRecord, row)


def open_actions(db: DB, pool: str | None = None) -> list[ActionRecord]:
    """Actions begun and never finished (oldest first): what a restarted controller reconciles."""
    stmt = sa.select(PendingAction).where(PendingAction.status.in_(IN_FLIGHT)).order_by(PendingAction.id)
    if pool is not None:
        stmt = stmt.where(PendingAction.pool == pool)
    with _tx(db, read=True) as s:
        return [_record(ActionRecord, r) for r in s.scalars(stmt)]


# --------------------------------------------------------------------------------------------
# Audit log
# --------------------------------------------------------------------------------------------


def record_audit(db: DB, *, actor: str, action: str, detail: Any = None, target: str | None = None,
                 now: datetime | None = None) -> int:
    """Append an admin write (who, what, on which target, with which payload)."""
    row = AuditEntry(at=_now(now), actor=actor, action=action, target=target, detail=_doc(detail, "detail"))
    with _tx(db) as s:
        s.add(row)
        s.flush()
        return row.id


def list_audit(db: DB, limit: int = 50, after_id: int | None = None, *, newest_first: bool = False) -> list[AuditRecord]:
    with _tx(db, read=True) as s:
        stmt = _page(sa.select(AuditEntry), AuditEntry.id, limit, after_id, newest_first)
        return [_record(AuditRecord, r) for r in s.scalars(stmt)]


# --------------------------------------------------------------------------------------------
# Leader lease
# --------------------------------------------------------------------------------------------


def _ttl(ttl_seconds: float) -> timedelta:
    if not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds={ttl_seconds} must be > 0")
    return timedelta(seconds=ttl_seconds)


def take_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None, *,
               epoch: Any = ...) -> int | None:
    """Take or extend the pool's lease: the epoch ``owner`` holds it at until ``now + ttl``, or None.

    ``epoch``: the epoch the caller holds (it renews only that one), or None when it holds none
    (it takes the lease only once it is free or expired, even from a holder of the same name:
    two processes given one identity never both lead). Left out: any lease of ``owner`` is
    renewed (``acquire_lease``).

    One atomic statement, safe with concurrent writers on PostgreSQL (the ON CONFLICT
    row lock serialises racers and the WHERE is re-checked on the latest row):

        INSERT INTO leases ... ON CONFLICT (pool) DO UPDATE SET owner, expires_at, epoch, ...
        WHERE leases.expires_at < :now OR leases.owner = :owner RETURNING owner, epoch

    A row comes back only if we inserted or the WHERE let us update. The epoch (the fencing
    token) stays on a renewal of a live lease and grows by one on any other take: a takeover,
    or the same owner again after its lease expired (it may have been stalled meanwhile).
    """
    t = _now(now)
    expires = t + _ttl(ttl_seconds)
    with _tx(db) as s:
        ins = _insert(s, Lease).values(pool=pool, owner=owner, acquired_at=t, expires_at=expires, epoch=1)
        mine: Any = Lease.owner == owner
        if epoch is None:
            mine = sa.false()
        elif epoch is not ...:
            mine = sa.and_(mine, Lease.epoch == int(epoch))
        renewal = sa.and_(mine, Lease.expires_at >= t)
        stmt = ins.on_conflict_do_update(
            index_elements=[Lease.pool],
            set_={
                "owner": ins.excluded.owner,
                "expires_at": ins.excluded.expires_at,
                # keep "holder since" across renewals by the same owner
                "acquired_at": sa.case((Lease.owner == ins.excluded.owner, Lease.acquired_at),
                                       else_=ins.excluded.acquired_at),
                "epoch": sa.case((renewal, Lease.epoch), else_=Lease.epoch + 1),
            },
            where=sa.or_(Lease.expires_at < t, mine),
        ).returning(Lease.owner, Lease.epoch)
        row = s.execute(stmt).first()
        return int(row[1]) if row is not None and row[0] == owner else None


def acquire_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None) -> bool:
    """Take or extend the pool's lease; True iff ``owner`` holds it until ``now + ttl`` (``take_lease``)."""
    return take_lease(db, pool, owner, ttl_seconds, now) is not None


def renew_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None,
                epoch: int | None = None) -> bool:
    """Extend a lease ``owner`` still holds (unexpired at ``now``, at ``epoch`` when given); False
    means leadership is lost."""
    t = _now(now)
    expires = t + _ttl(ttl_seconds)
    cond = [Lease.pool == pool, Lease.owner == owner, Lease.expires_at >= t]
    if epoch is not None:
        cond.append(Lease.epoch == epoch)
    with _tx(db) as s:
        res = s.execute(sa.update(Lease).where(*cond).values(expires_at=expires))
        return res.rowcount == 1


def check_lease(db: DB, pool: str, owner: str, epoch: int) -> None:
    """``LeaseLost`` unless ``owner`` still holds the pool's lease at ``epoch``. Inside a write
    transaction the lease row stays locked until it commits (PostgreSQL ``FOR UPDATE``; SQLite's
    ``BEGIN IMMEDIATE`` serialises every writer), so no takeover lands between check and write."""
    with _tx(db) as s:
        row = s.execute(sa.select(Lease.owner, Lease.epoch).where(Lease.pool == pool).with_for_update()).first()
        if row is None or row[0] != owner or int(row[1]) != epoch:
            holder = "nobody" if row is None else f"{row[0]} at epoch {row[1]}"
            raise LeaseLost(f"the lease of pool {pool} is no longer {owner}'s at epoch {epoch} (now {holder}); "
                            "write refused")


class FencedStore:
    """A ``Store`` for a leader's writes: every write transaction first runs ``guard()`` (a local
    check, e.g. the lease's deadline on this host's clock) and ``check_lease`` in the same
    transaction, so a leader that lost its lease writes nothing. Reads pass through unchecked.
    ``epoch`` None (not leading) refuses every write."""

    def __init__(self, store: Store, pool: str, owner: str, guard: Callable[[], None] | None = None) -> None:
        self.store, self.pool, self.owner, self.guard = store, pool, owner, guard
        self.epoch: int | None = None

    @contextmanager
    def session(self, read_only: bool = False) -> Iterator[Session]:
        if not read_only and self.guard is not None:
            self.guard()
        with self.store.session(read_only=read_only) as s:
            if not read_only:
                if self.epoch is None:
                    raise LeaseLost(f"{self.owner} does not hold the lease of pool {self.pool}; write refused")
                check_lease(s, self.pool, self.owner, self.epoch)
            yield s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


#: what a released lease expires at: before any clock a taker may have
_RELEASED = datetime(1970, 1, 1, tzinfo=UTC)


def release_lease(db: DB, pool: str, owner: str, epoch: int | None = None) -> bool:
    """Give the lease up (clean shutdown) so a standby takes over without waiting for expiry;
    ``epoch``: only the lease held at that epoch (a process sharing ``owner``'s name that took it
    over meanwhile keeps it). The row stays, expired, with its epoch: the next take goes on from
    it, so the fencing token never repeats (a deleted row would start again at 1, and a stalled
    leader of that epoch and name would pass the fence)."""
    cond = [Lease.pool == pool, Lease.owner == owner, Lease.expires_at > _RELEASED]
    if epoch is not None:
        cond.append(Lease.epoch == epoch)
    with _tx(db) as s:
        return s.execute(sa.update(Lease).where(*cond).values(expires_at=_RELEASED)).rowcount == 1


def lease_holder(db: DB, pool: str, now: datetime | None = None) -> LeaseRecord | None:
    """The current, unexpired lease of the pool, or None."""
    t = _now(now)
    with _tx(db, read=True) as s:
        row = s.get(Lease, pool, populate_existing=True)
        if row is None or row.expires_at < t:
            return None
        return _record(LeaseRecord, row)


# --------------------------------------------------------------------------------------------
# Interventions (pause, overrides, pins) and signing keys
# --------------------------------------------------------------------------------------------


def set_intervention(db: DB, *, pool: str, kind: str, target: str, actor: str, value: Any = None,
                     until: datetime | None = None, now: datetime | None = None) -> InterventionRecord:
    """Create or replace the pool's ``kind`` intervention on ``target``, set by ``actor`` at ``now``."""
    if kind not in INTERVENTION_KINDS:
        raise ValueError(f"kind='{kind}' must be one of {', '.join(INTERVENTION_KINDS)}")
    t, doc = _now(now), _doc(value, "value")
    end = None if until is None else _now(until)
    with _tx(db) as s:
        ins = _insert(s, Intervention).values(pool=pool, kind=kind, target=target, value=doc, actor=actor, at=t,
                                              until=end)
        s.execute(ins.on_conflict_do_update(index_elements=[Intervention.pool, Intervention.kind, Intervention.target],
                                            set_={"value": doc, "actor": actor, "at": t, "until": end}))
        return _record(InterventionRecord, s.get_one(Intervention, (pool, kind, target), populate_existing=True))


def clear_intervention(db: DB, *, pool: str, kind: str, target: str) -> bool:
    """Remove an intervention; False if there was none."""
    with _tx(db) as s:
        return s.execute(sa.delete(Intervention).where(Intervention.pool == pool, Intervention.kind == kind,
                                                       Intervention.target == target)).rowcount == 1


def drop_expired_overrides(db: DB, pool: str, now: datetime | None = None) -> int:
    """Delete the pool's overrides that ended at or before ``now``; returns how many."""
    t = _now(now)
    with _tx(db) as s:
        return s.execute(sa.delete(Intervention).where(Intervention.pool == pool, Intervention.kind == "override",
                                                       Intervention.until <= t)).rowcount or 0


def list_interventions(db: DB, pool: str) -> list[InterventionRecord]:
    """The pool's interventions (expired overrides included: the caller drops them)."""
    stmt = sa.select(Intervention).where(Intervention.pool == pool).order_by(Intervention.kind, Intervention.target)
    with _tx(db, read=True) as s:
        return [_record(InterventionRecord, r) for r in s.scalars(stmt)]


def signing_key(db: DB, name: str, now: datetime | None = None) -> bytes:
    """The random key named ``name`` (32 bytes), created on first use; the first writer's key wins,
    so every server of one database uses the same one."""
    t = _now(now)
    with _tx(db) as s:
        ins = _insert(s, SigningKey).values(name=name, key=secrets.token_hex(32), created_at=t)
        s.execute(ins.on_conflict_do_nothing(index_elements=[SigningKey.name]))
        return bytes.fromhex(s.execute(sa.select(SigningKey.key).where(SigningKey.name == name)).scalar_one())


# --------------------------------------------------------------------------------------------
# Retention and size
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _History:
    """A history table as retention sees it: its age column and which rows may ever go."""

    model: Any
    age: Any  # a row is as old as this column says (NULL: open or in flight, never purged)
    done: Any = None  # rows that must stay whatever their age (open, in flight) fail this


#: retention name -> table; open allocations, in-flight reshards and actions are never purged
HISTORY: dict[str, _History] = {
    "decisions": _History(DecisionRow, DecisionRow.last_at),  # a run of holds: as old as its last tick
    "allocations": _History(AllocationRow, AllocationRow.valid_to, AllocationRow.valid_to.is_not(None)),
    "audit": _History(AuditEntry, AuditEntry.at),
    "reshards": _History(ReshardEvent, ReshardEvent.finished_at, ReshardEvent.status.not_in(IN_FLIGHT)),
    "actions": _History(PendingAction, PendingAction.updated_at, PendingAction.status.not_in(IN_FLIGHT)),
}


@dataclasses.dataclass(frozen=True)
class TableStats:
    table: str  # the retention name (decisions, allocations, audit, reshards, actions)
    rows: int
    #: the oldest kept row by the time retention judges it by (a run of holds: its last tick; an
    #: allocation, reshard or action: when it ended); None when no row has ended yet
    oldest: datetime | None


def purge_history(db: DB, table: str, before: datetime, limit: int = 500) -> int:
    """Delete at most ``limit`` of ``table``'s oldest rows older than ``before``; returns how many.

    One bounded statement (``DELETE ... WHERE id IN (SELECT id ... ORDER BY id LIMIT n)``), so a
    caller deletes in small batches and never holds a long write lock. Rows still open or in
    flight (an allocation held now, a reshard or action not finished) are never deleted.
    """
    h = HISTORY.get(table)
    if h is None:
        raise ValueError(f"table='{table}' has no retention; one of {', '.join(HISTORY)}")
    if not 1 <= limit <= 10_000:
        raise ValueError(f"limit={limit} must be between 1 and 10000 rows per batch")
    t = _now(before)
    cond = [h.age < t] + ([h.done] if h.done is not None else [])
    ids = sa.select(h.model.id).where(*cond).order_by(h.model.id).limit(limit).scalar_subquery()
    with _tx(db) as s:
        return s.execute(sa.delete(h.model).where(h.model.id.in_(ids))).rowcount or 0


def history_stats(db: DB) -> list[TableStats]:
    """Rows and oldest kept row of every history table (retention's view of the store)."""
    out = []
    with _tx(db, read=True) as s:
        for name, h in HISTORY.items():
            rows, oldest = s.execute(sa.select(sa.func.count(), sa.func.min(h.age)).select_from(h.model)).one()
            if oldest is not None and not isinstance(oldest, datetime):  # SQLite's MIN gives the stored text
                oldest = datetime.fromisoformat(str(oldest))
            if oldest is not None:
                oldest = oldest.replace(tzinfo=UTC) if oldest.tzinfo is None else oldest.astimezone(UTC)
            out.append(TableStats(name, int(rows), oldest))
    return out


def database_size(db: DB) -> int:
    """Bytes the state takes: the SQLite file's pages (freed pages are reused, never returned
    to the disk without VACUUM), or on PostgreSQL the elastic tables with their indexes and TOAST."""
    with _tx(db, read=True) as s:
        dialect = s.get_bind().dialect.name
        if dialect == "sqlite":
            pages = s.execute(sa.text("PRAGMA page_count")).scalar_one()
            size = s.execute(sa.text("PRAGMA page_size")).scalar_one()
            return int(pages) * int(size)
        total = 0
        for table in Base.metadata.sorted_tables:
            total += int(s.execute(sa.text("SELECT pg_total_relation_size(CAST(:t AS regclass))"),
                                   {"t": table.name}).scalar_one() or 0)
        return total
