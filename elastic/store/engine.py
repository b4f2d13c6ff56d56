"""Connecting to the state store: ``Store`` (an Engine + sessionmaker), URL checks, errors.

What this module is for: turning a database URL into a working, bounded connection
(connect timeout, pre-ping, SQLite busy timeout, PostgreSQL's end to a transaction left open by
a stalled process), and turning driver failures into
``StoreError``s whose one-line message names the URL with the password masked.

What it must not do: know any table or scheduling rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_URL = "sqlite:///./elastic.db"
#: Seconds to wait for a TCP connection (PostgreSQL) before calling the DB unreachable.
DEFAULT_CONNECT_TIMEOUT = 5
#: Seconds a SQLite writer waits for another writer's lock before failing.
SQLITE_BUSY_TIMEOUT = 15
#: Seconds PostgreSQL keeps a session that sits inside an open transaction without sending
#: anything before it ends the session (rolling the transaction back). Our transactions are
#: milliseconds of work; one left open that long belongs to a stalled process (stopped, frozen,
#: cut off), and the row locks it holds (the lease row, during a renewal) would otherwise keep
#: every standby from taking over until the stalled process moves again.
IDLE_IN_TRANSACTION_TIMEOUT = 5


class StoreError(Exception):
    """A state-store failure with a one-line, user-facing message (CLI: exit 2)."""


class StoreUnavailable(StoreError):
    """The database cannot be reached or opened (fail safe: stop acting)."""


class StoreConflict(StoreError):
    """A write broke a uniqueness rule (e.g. a second in-flight reshard of one job)."""


class LeaseLost(StoreError):
    """A leader's write was refused: the pool's lease is no longer its own (another controller
    took it, or it expired while this one was stalled). The writer stops acting; nothing of the
    refused transaction was written."""


class NotFound(StoreError):
    """The named row does not exist."""


def mask_url(url: str | URL) -> str:
    """The URL as text with any password replaced by ``***`` (works on unparsable text too)."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # malformed: mask "scheme://user:secret@" by hand
        return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def first_line(e: BaseException) -> str:
    """The driver's own message, first line only, without SQLAlchemy's boilerplate."""
    orig = getattr(e, "orig", None) or e
    text = str(orig).strip().splitlines()
    line = text[0].strip() if text else type(orig).__name__
    line = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", line)
    return line or type(orig).__name__


def parse_url(url: str) -> URL:
    """Parse and normalise a database URL, or raise ``StoreError`` naming it.

    ``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``: psycopg 3 is
    the driver we ship (SQLAlchemy's default for bare ``postgresql`` is psycopg2).
    """
    if not url or not url.strip():
        raise StoreError(f"empty database URL; pass --db or set ELASTIC_DB_URL, e.g. {DEFAULT_URL}")
    try:
        u = make_url(url.strip())
    except (sa_exc.ArgumentError, ValueError):  # ValueError: e.g. a non-numeric port
        raise StoreError(
            f"malformed database URL '{mask_url(url)}'; expected e.g. {DEFAULT_URL} or "
            "postgresql+psycopg://user:password@host:5432/dbname"
        ) from None
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(
            f"unsupported database '{u.get_backend_name()}' in URL '{mask_url(u)}'; use sqlite:/// or postgresql+psycopg://"
        )
    return u


def _engine_kwargs(u: URL, connect_timeout: float) -> dict[str, Any]:
    if u.get_backend_name() == "postgresql":
        return {"pool_pre_ping": True, "connect_args": {"connect_timeout": max(1, int(connect_timeout))}}
    return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT}}


def _check_sqlite_dir(u: URL) -> None:
    """SQLite creates the file but not its directory: say which directory is missing."""
    path = u.database or ""
    if path in ("", ":memory:") or path.startswith("file:"):
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise StoreUnavailable(
            f"database {mask_url(u)} is unavailable: directory {parent} does not exist; create it or pass another --db"
        )


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # We emit BEGIN ourselves (see _sqlite_on_begin); pysqlite's own implicit BEGIN comes
    # only before DML, leaving the reads of a read-then-write transaction outside it.
    dbapi_conn.isolation_level = None
    # WAL: readers of committed data (admin API) do not block the controller's writes.
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA journal_mode=WAL")
    except Exception:  # in-memory databases answer "memory"; read-only media refuse: both fine
        pass
    finally:
        cur.close()


def _postgres_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # a SET (not a startup option: connection poolers such as PgBouncer refuse those), committed so
    # that it holds for the session
    with dbapi_conn.cursor() as cur:
        cur.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_TIMEOUT}s'")
    dbapi_conn.commit()


def _sqlite_on_begin(conn: sa.Connection) -> None:
    # IMMEDIATE takes the write lock up front, so SQLite transactions are serialisable:
    # a read-then-write (set_allocation, start_reshard, migrations) cannot interleave with
    # another writer, and a second writer waits (busy timeout) instead of failing with
    # SQLITE_BUSY half-way. Transactions here are milliseconds long, so the cost is small.
    # Read-only sessions (the admin API's reads) take a plain deferred BEGIN: under WAL they
    # read a snapshot without queueing behind the controller's writes.
    if conn.get_execution_options().get("elastic_read_only"):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class Store:
    """The state store: one Engine and a sessionmaker. Thread-safe; one per process.

    ``with store.session() as s:`` is one transaction: committed on success, rolled
    back on any exception. Repository functions in ``repo.py`` (and the modules it
    re-exports) accept a ``Store`` (one
    transaction per call) or a ``Session`` (compose several writes atomically).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.url = mask_url(engine.url)
        # a SQLite file removed (or replaced) under a running store: its connections would go on
        # writing to the unlinked inode, and a restart would find an empty database. Its identity
        # is noted when first seen and checked before every transaction.
        path = (engine.url.database or "") if engine.dialect.name == "sqlite" else ""
        self._sqlite_path = None if path in ("", ":memory:") or path.startswith("file:") else \
            Path(path).expanduser().resolve()
        self._sqlite_id: tuple[int, int] | None = None
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(engine.execution_options(elastic_read_only=True), expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, echo: bool = False) -> Store:
        """Build a Store; connects lazily (call ``ping()`` to check reachability)."""
        u = parse_url(url)
        try:
            engine = sa.create_engine(u, echo=echo, **_engine_kwargs(u, connect_timeout))
        except (ImportError, sa_exc.NoSuchModuleError) as e:
            raise StoreError(f"database driver for '{mask_url(u)}' is not installed: {first_line(e)}") from None
        except sa_exc.ArgumentError as e:
            raise StoreError(f"invalid database URL '{mask_url(u)}': {first_line(e)}") from None
        if u.get_backend_name() == "sqlite":
            _check_sqlite_dir(u)
            sa.event.listen(engine, "connect", _sqlite_on_connect)
            sa.event.listen(engine, "begin", _sqlite_on_begin)
        else:
            sa.event.listen(engine, "connect", _postgres_on_connect)
        return cls(engine)

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self.engine.dialect.name

    def _check_file(self) -> None:
        """``StoreUnavailable`` when the SQLite file this store has used is gone or another file."""
        if self._sqlite_path is None:
            return
        try:
            st = self._sqlite_path.stat()
        except FileNotFoundError:
            if self._sqlite_id is None:
                return  # not created yet: SQLite creates it on the first connection
            raise StoreUnavailable(f"database {self.url} is unavailable: its file {self._sqlite_path} was removed "
                                   "while in use; restore it, or restart to begin on a new one") from None
        ident = (st.st_dev, st.st_ino)
        if self._sqlite_id is None:
            self._sqlite_id = ident
        elif ident != self._sqlite_id:
            raise StoreUnavailable(f"database {self.url} is unavailable: its file {self._sqlite_path} was replaced "
                                   "by another while in use; restart to use the new one")

    def ping(self) -> None:
        """Run ``SELECT 1``; raise ``StoreUnavailable`` (one line, URL masked) if it fails."""
        self._check_file()
        with self.translate_errors():
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))

    @contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Map driver errors to ``StoreUnavailable`` / ``StoreConflict`` with this store's URL."""
        try:
            yield
        except sa_exc.IntegrityError as e:
            raise StoreConflict(f"conflicting write to {self.url}: {first_line(e)}") from e
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as e:
            raise StoreUnavailable(f"database {self.url} is unavailable: {first_line(e)}") from e

    @contextmanager
    def session(self, read_only: bool = False) -> Iterator[Session]:
        """One transaction: commit on success, roll back on error. ``read_only``: a snapshot
        read that never waits for writers (SQLite; PostgreSQL reads never do)."""
        self._check_file()
        with self.translate_errors():
            with (self._read_sessions if read_only else self._sessions).begin() as s:
                yield s

    session_scope = session

    def dispose(self) -> None:
        """Close every pooled connection (call at shutdown and in tests)."""
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"Store({self.url})"
