"""What every repository module shares: ``DB`` (a ``Store`` or a caller's ``Session``), the
transaction (``_tx``), the clock at the edge (``_now``), JSON documents (``_doc``), the dialect's
``INSERT ... ON CONFLICT`` (``_insert``) and keyset pagination (``_page``).

What it must not do: build a query of its own. Each helper works on the table or statement its
caller hands it; the queries live in ``repo.py`` and its siblings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from elastic.store.engine import Store
from elastic.store.models import Base

DB = Store | Session
MAX_PAGE = 1000


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@contextmanager
def _tx(db: DB, read: bool = False) -> Iterator[Session]:
    """A session: the caller's (no commit here) or a fresh one-call transaction (``read``: read-only)."""
    if isinstance(db, Session):
        yield db
    else:
        with db.session(read_only=read) as s:
            yield s


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"now={now.isoformat()} is naive; pass a timezone-aware UTC time")
    return now.astimezone(UTC)


def _doc(value: Any, field: str) -> dict[str, Any]:
    """A JSON object from a mapping, pydantic model or dataclass; round-tripped so that
    what is stored equals what is read back (tuples become lists) on every backend."""
    if value is None:
        return {}
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be a JSON object (mapping), got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} is not JSON-serialisable: {e}") from None


def _insert(s: Session, table: type[Base]) -> Any:
    """``INSERT`` with ``ON CONFLICT`` support for the session's dialect."""
    name = s.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"store supports sqlite and postgresql, not {name}")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit={limit} must be between 1 and {MAX_PAGE}")


def _page(stmt: sa.Select[Any], id_col: Any, limit: int, after_id: int | None, newest_first: bool) -> sa.Select[Any]:
    """Keyset pagination: rows after the cursor ``after_id`` in the chosen order.

    Stable under concurrent inserts (unlike OFFSET): page 2 starts after the last id of
    page 1 whatever was written in between.
    """
    _check_limit(limit)
    if after_id is not None:
        stmt = stmt.where(id_col < after_id if newest_first else id_col > after_id)
    return stmt.order_by(id_col.desc() if newest_first else id_col.asc()).limit(limit)
