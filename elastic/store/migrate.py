"""Schema migrations: apply the Alembic revisions shipped in ``migrations/`` to a database.

What this module is for: ``upgrade(url)`` (what ``elastic db upgrade`` runs) and the
revision look-ups behind it, with Alembic configured in code so no ``alembic.ini`` is
needed at run time. Every schema change is a new file in ``migrations/versions``.

What it must not do: create tables any other way (no ``metadata.create_all``): the
migrations are the schema's single source of truth, and a test checks the ORM models
agree with them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from elastic.store.engine import Store

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
#: pg_advisory_lock key held while migrating, so two controllers starting at once do not
#: both run the same DDL ("elastic" in ASCII, as a number).
_PG_LOCK_KEY = 0x656C6173746963
_LOCAL_LOCK = threading.Lock()


@dataclass(frozen=True)
class UpgradeResult:
    url: str  # password masked
    before: str | None  # revision before (None = empty database)
    after: str | None
    applied: tuple[str, ...]  # revisions applied, oldest first; empty = nothing to do

    def describe(self) -> str:
        if not self.applied:
            return f"database {self.url} is up to date at revision {self.after}; nothing to do"
        return (f"database {self.url}: upgraded {self.before or '<empty>'} -> {self.after} "
                f"(applied {', '.join(self.applied)})")


def alembic_config(url: str | None = None) -> Config:
    """An Alembic ``Config`` pointing at the shipped migrations (for ``alembic`` API calls)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision shipped with this version of elastic."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, f"no migrations found in {MIGRATIONS_DIR}"
    return head


def current_revision(store: Store) -> str | None:
    """The database's revision (None for an empty database)."""
    with store.translate_errors(), store.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _pending(before: str | None, after: str | None) -> tuple[str, ...]:
    """Revision ids from ``before`` (exclusive) to ``after`` (inclusive), oldest first."""
    if after is None or before == after:
        return ()
    script = ScriptDirectory.from_config(alembic_config())
    revs = script.iterate_revisions(after, before or "base")
    return tuple(reversed([r.revision for r in revs]))


def upgrade(target: str | Store, revision: str = "head") -> UpgradeResult:
    """Apply every migration up to ``revision`` (default: head). Idempotent.

    Steps: 1. connect (``StoreUnavailable`` if unreachable); 2. on PostgreSQL take an
    advisory lock; 3. read the current revision; 4. run Alembic on the same connection;
    5. report what was applied.
    """
    store = Store.from_url(target) if isinstance(target, str) else target
    try:
        # Alembic's ``context`` is a process-wide proxy: one migration at a time per process.
        # Across processes: PostgreSQL advisory lock below; SQLite's BEGIN IMMEDIATE.
        with _LOCAL_LOCK, store.translate_errors(), store.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()
            try:
                before = MigrationContext.configure(conn).get_current_revision()
                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
                conn.commit()
                after = MigrationContext.configure(conn).get_current_revision()
            finally:
                if conn.dialect.name == "postgresql":
                    conn.rollback()
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                    conn.commit()
        return UpgradeResult(url=store.url, before=before, after=after, applied=_pending(before, after))
    finally:
        if isinstance(target, str):
            store.dispose()
