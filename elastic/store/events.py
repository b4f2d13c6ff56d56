"""Reshard events and pending actions: work recorded as in flight (``pending`` / ``running``)
before it starts and closed (``done``, ``failed``, ``cancelled``) when it ends, so a restarted
controller finds what a crash left open.

What it must not do: decide what to do about open work. Reconciling a reshard or an action a
crash left in flight is the controller's job; this records it and hands it back.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from elastic.store.common import DB, _doc, _now, _page, _tx
from elastic.store.engine import NotFound, StoreConflict
from elastic.store.models import IN_FLIGHT, PendingAction, ReshardEvent
from elastic.store.records import ActionRecord, ReshardRecord, _record

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
