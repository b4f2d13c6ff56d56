"""Repository functions: every read and write of the state store, small and explicit.

What this module is for (with its siblings below): the only code that builds SQL against
the tables in ``models.py``. Each function takes ``db`` first: a ``Store`` (the call is one
transaction of its own) or a ``Session`` from ``store.session()`` (the caller groups
several writes into one transaction, e.g. a tick's decision plus its allocations).
Results are frozen ``*Record`` dataclasses, safe to keep after the transaction ends.

What it must not do: decide anything. No scheduling rule, no policy, no retries with
judgement; it records what the controller decided and hands back what was recorded.
``now`` is a parameter everywhere (defaulting to the UTC wall clock only in the store, at
the edge); decision code passes its snapshot's time.

Where each part lives (every public name re-exported here, so ``from elastic.store.repo import ...``
names them all): the ``*Record`` dataclasses in ``records.py``; what every module shares (the
transaction, the clock, JSON documents, keyset pages) in ``common.py``; reshard events and
pending actions in ``events.py``; the leader lease and ``FencedStore`` in ``leases.py``;
interventions and signing keys in ``interventions.py``; retention and size in ``retention.py``;
pools, services, jobs, allocations, decisions and the audit log here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from elastic.model import GPU, Allocation
from elastic.store.common import DB, MAX_PAGE, _doc, _insert, _now, _page, _tx
from elastic.store.engine import NotFound
from elastic.store.events import (
    begin_action,
    finish_action,
    finish_reshard,
    get_reshard,
    in_flight_reshards,
    list_reshards,
    mark_reshard_running,
    open_actions,
    start_reshard,
)
from elastic.store.interventions import (
    clear_intervention,
    drop_expired_overrides,
    list_interventions,
    set_intervention,
    signing_key,
)
from elastic.store.leases import (
    FencedStore,
    acquire_lease,
    check_lease,
    lease_holder,
    release_lease,
    renew_lease,
    take_lease,
)
from elastic.store.models import (
    WORKLOAD_KINDS,
    AllocationRow,
    AuditEntry,
    DecisionRow,
    InferenceService,
    Pool,
    TrainingJob,
)
from elastic.store.records import (
    ActionRecord,
    AllocationRecord,
    AuditRecord,
    DecisionRecord,
    InterventionRecord,
    JobRecord,
    LeaseRecord,
    PoolRecord,
    ReshardRecord,
    ServiceRecord,
    WorkloadRecord,
    _record,
)
from elastic.store.retention import HISTORY, TableStats, database_size, history_stats, purge_history

__all__ = [
    "DB", "HISTORY", "MAX_PAGE", "ActionRecord", "AllocationRecord", "AuditRecord", "DecisionRecord", "FencedStore",
    "InterventionRecord", "JobRecord", "LeaseRecord", "PoolRecord", "ReshardRecord", "ServiceRecord", "TableStats",
    "WorkloadRecord", "acquire_lease", "allocation_history", "begin_action", "check_lease", "clear_intervention",
    "current_allocation", "current_allocations", "database_size", "delete_job", "delete_service",
    "drop_expired_overrides", "finish_action", "finish_reshard", "get_decision", "get_job", "get_pool",
    "get_reshard", "get_service", "history_stats", "in_flight_reshards", "lease_holder", "list_audit",
    "list_decisions", "list_interventions", "list_jobs", "list_pools", "list_reshards", "list_services",
    "mark_reshard_running", "open_actions", "purge_history", "record_audit", "record_decision",
    "release_allocation", "release_lease", "renew_lease", "set_allocation", "set_intervention", "set_job_status",
    "set_service_status", "signing_key", "start_reshard", "take_lease", "upsert_job", "upsert_pool",
    "upsert_service",
]

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
