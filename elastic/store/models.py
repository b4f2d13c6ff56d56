"""SQLAlchemy 2.x ORM models: the tables of elastic's state store.

What this module is for: declaring each table once, typed (``Mapped[...]``), so that
the Alembic migrations under ``migrations/versions`` can be checked against it (a test
diffs the two on SQLite and PostgreSQL).

What it must not do: hold behaviour. Reads and writes live in ``repo.py`` and the modules it re-exports; scheduling
logic lives in the pure packages and never sees a row.

Conventions:

* Every timestamp is stored as UTC. ``UTCDateTime`` refuses naive datetimes (a naive
  local time would silently shift a lease by the UTC offset) and always hands back
  timezone-aware UTC values, on SQLite too, which keeps no zone.
* Free-form documents (specs, status, plans) are JSON (JSONB on PostgreSQL).
* There are no foreign keys on purpose: history (decisions, reshard events,
  allocations) outlives the workloads it talks about, and a pool's lease exists before
  its spec row does. Names are the join keys.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint / index names, identical on every backend, so migrations can
# refer to them by name (ALTER ... DROP CONSTRAINT needs one).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: JSON document column: JSONB on PostgreSQL (comparable, indexable), JSON text elsewhere.
JSONDoc = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

# ``cancelled``: called off before anything moved (a grow inference wanted the GPUs back from)
RESHARD_STATUSES = ("pending", "running", "done", "failed", "cancelled")
ACTION_STATUSES = ("pending", "running", "done", "failed", "cancelled")
WORKLOAD_KINDS = ("inference", "training")
IN_FLIGHT = ("pending", "running")
FINISHED = ("done", "failed", "cancelled")


def _status_check(statuses: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")"


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC datetime on every backend (stored as naive UTC on SQLite)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value.isoformat()} given to the store; pass a timezone-aware "
                "UTC time, e.g. datetime.now(UTC)"
            )
        value = value.astimezone(UTC)
        # SQLite keeps no zone: store naive UTC so string order == time order.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONDoc}


class Pool(Base):
    """A GPU pool and its spec (``PoolSpec`` as JSON)."""

    __tablename__ = "pools"

    name: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class InferenceService(Base):
    """An inference service: desired spec plus last observed/decided status."""

    __tablename__ = "inference_services"

    name: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    pool: Mapped[str] = mapped_column(sa.String(253), index=True)
    spec: Mapped[dict[str, Any]]
    #: e.g. {"current_replicas": 2, "desired_replicas": 3, "observed_value": 41.5, "updated_at": "..."}
    status: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class TrainingJob(Base):
    """A training job: desired spec plus status (layout, generation, step, phase, ...)."""

    __tablename__ = "training_jobs"

    name: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    pool: Mapped[str] = mapped_column(sa.String(253), index=True)
    spec: Mapped[dict[str, Any]]
    #: e.g. {"layout": "tp2.pp2.dp2", "generation": 4, "step": 1200, "phase": "Running"}
    status: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class AllocationRow(Base):
    """Which GPUs one workload held from ``valid_from`` until ``valid_to`` (NULL = now).

    Rows are never updated except to close them, so the table is the allocation
    history; at most one open row per (pool, workload), enforced by a partial index.
    """

    __tablename__ = "allocations"
    __table_args__ = (
        sa.CheckConstraint("kind IN ('inference', 'training')", name="kind"),
        sa.Index(
            "uq_allocations_open", "pool", "workload", unique=True,
            sqlite_where=sa.text("valid_to IS NULL"), postgresql_where=sa.text("valid_to IS NULL"),
        ),
        sa.Index("ix_allocations_pool_valid_to", "pool", "valid_to"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(sa.String(253))
    workload: Mapped[str] = mapped_column(sa.String(253))
    kind: Mapped[str] = mapped_column(sa.String(16))
    #: [{"node": "n0", "index": 3}, ...] in the order given
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSONDoc)
    generation: Mapped[int]
    valid_from: Mapped[datetime]
    valid_to: Mapped[datetime | None]


class DecisionRow(Base):
    """A controller decision: what it saw (summary), what it planned, and why.

    A change is one row per tick; a run of identical holds (ticks that changed nothing, for the
    same reason) is one row whose ``count`` and ``last_at`` grow with every tick of the run.
    """

    __tablename__ = "decisions"
    __table_args__ = (sa.Index("ix_decisions_pool_id", "pool", "id"), sa.Index("ix_decisions_last_at", "last_at"))

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    #: the first tick of the row (a run of identical holds spans ``tick_at`` .. ``last_at``)
    tick_at: Mapped[datetime]
    pool: Mapped[str] = mapped_column(sa.String(253))
    inputs: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any]]
    reason: Mapped[str] = mapped_column(sa.String(64))
    message: Mapped[str] = mapped_column(sa.Text)
    #: ticks this row stands for: 1 for a change; n for a run of n identical holds
    count: Mapped[int] = mapped_column(sa.Integer, server_default=sa.text("1"))
    last_at: Mapped[datetime]
    #: NULL for a change (a decision that acted, failed or recovered); for a hold (a tick that
    #: changed nothing), a digest of what it held on: the next identical hold extends this row
    hold: Mapped[str | None] = mapped_column(sa.String(64))


class ReshardEvent(Base):
    """One in-place rescale of a training job, from plan to outcome.

    A row in ``pending``/``running`` is an in-flight action: a restarted controller
    finds it with ``in_flight_reshards`` and resumes or fails it. At most one such
    row per job (partial unique index).
    """

    __tablename__ = "reshard_events"
    __table_args__ = (
        sa.CheckConstraint(_status_check(RESHARD_STATUSES), name="status"),
        sa.Index(
            "uq_reshard_events_in_flight", "job", unique=True,
            sqlite_where=sa.text("status IN ('pending', 'running')"),
            postgresql_where=sa.text("status IN ('pending', 'running')"),
        ),
        sa.Index("ix_reshard_events_job_id", "job", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(sa.String(253))
    pool: Mapped[str] = mapped_column(sa.String(253))
    generation: Mapped[int]
    from_layout: Mapped[str] = mapped_column(sa.String(64))
    to_layout: Mapped[str] = mapped_column(sa.String(64))
    bytes_planned: Mapped[int] = mapped_column(sa.BigInteger)
    bytes_lower_bound: Mapped[int] = mapped_column(sa.BigInteger)
    bytes_moved: Mapped[int | None] = mapped_column(sa.BigInteger)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    pause_seconds: Mapped[float | None] = mapped_column(sa.Float)
    status: Mapped[str] = mapped_column(sa.String(16))
    error: Mapped[str | None] = mapped_column(sa.Text)


class PendingAction(Base):
    """A backend action the controller started and has not seen finish (crash recovery).

    Written before acting (``begin_action``) and closed after (``finish_action``); on
    start-up the controller lists the open ones and reconciles them with the backend.
    """

    __tablename__ = "pending_actions"
    __table_args__ = (
        sa.CheckConstraint(_status_check(ACTION_STATUSES), name="status"),
        sa.Index("ix_pending_actions_pool_status", "pool", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(sa.String(253))
    kind: Mapped[str] = mapped_column(sa.String(64))
    workload: Mapped[str] = mapped_column(sa.String(253))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(sa.String(16))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    error: Mapped[str | None] = mapped_column(sa.Text)


class AuditEntry(Base):
    """An admin write (API or CLI): who did what, when."""

    __tablename__ = "audit_log"
    __table_args__ = (sa.Index("ix_audit_log_at", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(sa.String(253))
    action: Mapped[str] = mapped_column(sa.String(64))
    target: Mapped[str | None] = mapped_column(sa.String(253))
    detail: Mapped[dict[str, Any]]


class Lease(Base):
    """Leader lease of one pool: ``owner`` leads until ``expires_at``.

    ``epoch`` is the fencing token: it grows by one every time the lease is taken (by another
    owner, or again after it expired), never on a renewal. A leader's writes carry the epoch it
    took; once someone else took the lease they are refused (``check_lease``)."""

    __tablename__ = "leases"

    pool: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    owner: Mapped[str] = mapped_column(sa.String(253))
    acquired_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    epoch: Mapped[int] = mapped_column(sa.BigInteger, server_default=sa.text("0"))


INTERVENTION_KINDS = ("pause", "override", "pin")


class Intervention(Base):
    """An operator's intervention on a pool's controller that must outlive the process: a pause
    (``target`` is the pool), a service's replica override until ``until``, a job's layout pin.
    One row per (pool, kind, target); ``actor`` is the API token's name that set it, ``at`` when."""

    __tablename__ = "interventions"
    __table_args__ = (sa.CheckConstraint("kind IN ('pause', 'override', 'pin')", name="kind"),)

    pool: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    target: Mapped[str] = mapped_column(sa.String(253), primary_key=True)
    #: override: {"replicas": 3}; pin: {"layout": "tp2.pp1.dp2"}; pause: {}
    value: Mapped[dict[str, Any]]
    actor: Mapped[str] = mapped_column(sa.String(253))
    at: Mapped[datetime]
    #: an override ends by itself at this time; NULL for the others
    until: Mapped[datetime | None]


class SigningKey(Base):
    """A random key the servers of one database share (e.g. the API's continue-token tag):
    created once by whoever needs it first, never derived from anything a server shows."""

    __tablename__ = "signing_keys"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    key: Mapped[str] = mapped_column(sa.String(128))
    created_at: Mapped[datetime]
