"""Retention and size: the history tables retention may purge (``HISTORY``), purges in small
batches that never delete an open allocation or work still in flight, and how many rows and
bytes the state takes.

What it must not do: choose what to keep. How old a row may get and how many go per batch are
the caller's settings; this deletes what it is told to, within those bounds.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from elastic.store.common import DB, _now, _tx
from elastic.store.models import (
    IN_FLIGHT,
    AllocationRow,
    AuditEntry,
    Base,
    DecisionRow,
    PendingAction,
    ReshardEvent,
)

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
