"""Initial schema: pools, services, jobs, allocations, decisions, reshard events,
pending actions, audit log, leader leases.

Revision ID: 0001
Revises:

Self-contained on purpose (no import of ``elastic.store.models``): a migration is a
frozen record of one schema step and must not change when the models do.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUS_CHECK = "status IN ('pending', 'running', 'done', 'failed')"


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _name(name: str = "name") -> sa.Column:
    return sa.Column(name, sa.String(length=253), nullable=False)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), autoincrement=True, nullable=False)


def upgrade() -> None:
    op.create_table(
        "pools",
        _name(),
        sa.Column("spec", _json(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("name", name="pk_pools"),
    )
    for table in ("inference_services", "training_jobs"):
        op.create_table(
            table,
            _name(),
            _name("pool"),
            sa.Column("spec", _json(), nullable=False),
            sa.Column("status", _json(), nullable=False),
            _ts("created_at"),
            _ts("updated_at"),
            sa.PrimaryKeyConstraint("name", name=f"pk_{table}"),
        )
        op.create_index(f"ix_{table}_pool", table, ["pool"])

    op.create_table(
        "allocations",
        _id(),
        _name("pool"),
        _name("workload"),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("gpus", _json(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        _ts("valid_from"),
        _ts("valid_to", nullable=True),
        sa.CheckConstraint("kind IN ('inference', 'training')", name="ck_allocations_kind"),
        sa.PrimaryKeyConstraint("id", name="pk_allocations"),
    )
    op.create_index("ix_allocations_pool_valid_to", "allocations", ["pool", "valid_to"])
    op.create_index("uq_allocations_open", "allocations", ["pool", "workload"], unique=True,
                    sqlite_where=sa.text("valid_to IS NULL"), postgresql_where=sa.text("valid_to IS NULL"))

    op.create_table(
        "decisions",
        _id(),
        _ts("tick_at"),
        _name("pool"),
        sa.Column("inputs", _json(), nullable=False),
        sa.Column("plan", _json(), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
    )
    op.create_index("ix_decisions_pool_id", "decisions", ["pool", "id"])

    op.create_table(
        "reshard_events",
        _id(),
        _name("job"),
        _name("pool"),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("from_layout", sa.String(length=64), nullable=False),
        sa.Column("to_layout", sa.String(length=64), nullable=False),
        sa.Column("bytes_planned", sa.BigInteger(), nullable=False),
        sa.Column("bytes_lower_bound", sa.BigInteger(), nullable=False),
        sa.Column("bytes_moved", sa.BigInteger(), nullable=True),
        _ts("started_at"),
        _ts("finished_at", nullable=True),
        sa.Column("pause_seconds", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(STATUS_CHECK, name="ck_reshard_events_status"),
        sa.PrimaryKeyConstraint("id", name="pk_reshard_events"),
    )
    op.create_index("ix_reshard_events_job_id", "reshard_events", ["job", "id"])
    in_flight = "status IN ('pending', 'running')"
    op.create_index("uq_reshard_events_in_flight", "reshard_events", ["job"], unique=True,
                    sqlite_where=sa.text(in_flight), postgresql_where=sa.text(in_flight))

    op.create_table(
        "pending_actions",
        _id(),
        _name("pool"),
        sa.Column("kind", sa.String(length=64), nullable=False),
        _name("workload"),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(STATUS_CHECK, name="ck_pending_actions_status"),
        sa.PrimaryKeyConstraint("id", name="pk_pending_actions"),
    )
    op.create_index("ix_pending_actions_pool_status", "pending_actions", ["pool", "status"])

    op.create_table(
        "audit_log",
        _id(),
        _ts("at"),
        _name("actor"),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=253), nullable=True),
        sa.Column("detail", _json(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])

    op.create_table(
        "leases",
        _name("pool"),
        _name("owner"),
        _ts("acquired_at"),
        _ts("expires_at"),
        sa.PrimaryKeyConstraint("pool", name="pk_leases"),
    )


def downgrade() -> None:
    for table in ("leases", "audit_log", "pending_actions", "reshard_events", "decisions", "allocations",
                  "training_jobs", "inference_services", "pools"):
        op.drop_table(table)
