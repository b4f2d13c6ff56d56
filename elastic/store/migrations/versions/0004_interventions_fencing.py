"""Durable interventions, a fencing token on the lease, shared signing keys.

* ``interventions``: a controller's pause, a service's replica override and a job's layout pin,
  with who set them and when, so that a restarted (or newly elected) controller keeps them.
* ``leases.epoch``: the fencing token; it grows by one every time a lease is taken, and a
  leader's writes are refused once the epoch it took is no longer the row's.
* ``signing_keys``: random keys shared by the servers of one database (the API's continue
  tokens), so that no key is derived from anything a server shows.

Revision ID: 0004
Revises: 0003

Self-contained (see 0001). Existing leases start at epoch 0: the next takeover makes it 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("leases") as b:
        b.add_column(sa.Column("epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    op.create_table(
        "interventions",
        sa.Column("pool", sa.String(length=253), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=253), nullable=False),
        sa.Column("value", _json(), nullable=False),
        sa.Column("actor", sa.String(length=253), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("kind IN ('pause', 'override', 'pin')", name=op.f("ck_interventions_kind")),
        sa.PrimaryKeyConstraint("pool", "kind", "target", name="pk_interventions"),
    )
    op.create_table(
        "signing_keys",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_signing_keys"),
    )


def downgrade() -> None:
    op.drop_table("signing_keys")
    op.drop_table("interventions")
    with op.batch_alter_table("leases") as b:
        b.drop_column("epoch")
