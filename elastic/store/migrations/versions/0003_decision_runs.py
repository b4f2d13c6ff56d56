"""Runs of identical holds as one decision row: ``count``, ``last_at`` and ``hold`` on ``decisions``.

A tick that changes nothing used to add a row each time (17,000 a day per pool at 5 s ticks).
Now a run of identical holds is one row: ``tick_at`` is its first tick, ``last_at`` its last,
``count`` how many ticks it stands for, ``hold`` a digest of what it held on (NULL for a
change). ``ix_decisions_last_at`` serves retention (oldest rows first by age).

Revision ID: 0003
Revises: 0002

Rows written before are one tick each (``count`` 1, ``last_at`` = ``tick_at``); those with
reason ``Steady`` are holds (that reason meant no step), marked ``hold = 'Steady'`` so the
decision log's "changes only" view leaves them out. Self-contained (see 0001); SQLite cannot
make a column NOT NULL in place: ``last_at`` is added, filled, then tightened in batch mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as b:
        b.add_column(sa.Column("count", sa.Integer(), server_default=sa.text("1"), nullable=False))
        b.add_column(sa.Column("last_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("hold", sa.String(64), nullable=True))
    op.execute(sa.text("UPDATE decisions SET last_at = tick_at, hold = CASE WHEN reason = 'Steady' "
                       "THEN 'Steady' END"))
    with op.batch_alter_table("decisions") as b:
        b.alter_column("last_at", existing_type=sa.DateTime(timezone=True), nullable=False)
    op.create_index("ix_decisions_last_at", "decisions", ["last_at"])


def downgrade() -> None:
    op.drop_index("ix_decisions_last_at", table_name="decisions")
    with op.batch_alter_table("decisions") as b:
        b.drop_column("hold")
        b.drop_column("last_at")
        b.drop_column("count")
