"""A status of its own for called-off work: ``cancelled`` on reshard events and pending actions.

A training grow called off before its directive (inference wanted the GPUs back; nothing
moved) was recorded as ``failed`` with a ``cancelled: `` prefix on its error. It now ends as
``cancelled``, with the reason in ``error``; rows written before keep their status and are
converted here (``failed`` + prefix -> ``cancelled``, prefix dropped).

Revision ID: 0002
Revises: 0001

Also gives every CHECK constraint the name the models declare (``ck_<table>_<name>``): 0001
ran its names through the naming convention a second time (``ck_<table>_ck_<table>_<name>``).

Self-contained (see 0001). SQLite cannot alter a CHECK constraint: the table is rebuilt in
batch mode; the partial unique indexes are dropped first and created again after, so the
rebuild cannot lose their ``WHERE`` clauses.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "status IN ('pending', 'running', 'done', 'failed')"
NEW = "status IN ('pending', 'running', 'done', 'failed', 'cancelled')"
KIND = "kind IN ('inference', 'training')"
PREFIX = "cancelled: "
# table -> (column the check is on, its SQL before, after)
CHECKS = {"allocations": ("kind", KIND, KIND), "reshard_events": ("status", OLD, NEW),
          "pending_actions": ("status", OLD, NEW)}
# partial unique indexes on the rebuilt tables: name -> (table, columns, WHERE)
PARTIAL = {"uq_allocations_open": ("allocations", ["pool", "workload"], "valid_to IS NULL"),
           "uq_reshard_events_in_flight": ("reshard_events", ["job"], "status IN ('pending', 'running')")}


def _check(table: str, column: str, sql: str, name: str) -> None:
    """Replace the table's CHECK on ``column`` by ``sql`` named ``name`` (as is: ``op.f``)."""
    existing = [c["name"] for c in sa.inspect(op.get_bind()).get_check_constraints(table)
                if column in (c.get("sqltext") or "") and c.get("name")]
    with op.batch_alter_table(table, recreate="auto") as b:
        for old in existing:
            b.drop_constraint(op.f(old), type_="check")
        b.create_check_constraint(op.f(name), sa.text(sql))


def _partial_indexes(create: bool) -> None:
    for name, (table, cols, where) in PARTIAL.items():
        if create:
            op.create_index(name, table, cols, unique=True, sqlite_where=sa.text(where),
                            postgresql_where=sa.text(where))
        else:
            op.drop_index(name, table_name=table)


def upgrade() -> None:
    _partial_indexes(create=False)
    for table, (column, _, new) in CHECKS.items():
        _check(table, column, new, f"ck_{table}_{column}")
        if column == "status":
            op.execute(sa.text(
                f"UPDATE {table} SET status = 'cancelled', error = substr(error, {len(PREFIX) + 1}) "
                f"WHERE status = 'failed' AND error LIKE '{PREFIX}%'"))
    _partial_indexes(create=True)


def downgrade() -> None:
    _partial_indexes(create=False)
    for table, (column, old, _) in CHECKS.items():
        if column == "status":
            op.execute(sa.text(f"UPDATE {table} SET status = 'failed', error = '{PREFIX}' || coalesce(error, '') "
                               "WHERE status = 'cancelled'"))
        _check(table, column, old, f"ck_{table}_ck_{table}_{column}")  # as 0001 left it
    _partial_indexes(create=True)
