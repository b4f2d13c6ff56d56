"""Operator interventions (a pool's pause, a service's override, a job's pin) and the signing
keys every server of one database shares.

What it must not do: apply an intervention. It is recorded here and read back; the controller
takes it into account on its next tick.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from elastic.store.common import DB, _doc, _insert, _now, _tx
from elastic.store.models import INTERVENTION_KINDS, Intervention, SigningKey
from elastic.store.records import InterventionRecord, _record

# --------------------------------------------------------------------------------------------
# Interventions (pause, overrides, pins) and signing keys
# --------------------------------------------------------------------------------------------


def set_intervention(db: DB, *, pool: str, kind: str, target: str, actor: str, value: Any = None,
                     until: datetime | None = None, now: datetime | None = None) -> InterventionRecord:
    """Create or replace the pool's ``kind`` intervention on ``target``, set by ``actor`` at ``now``."""
    if kind not in INTERVENTION_KINDS:
        raise ValueError(f"kind='{kind}' must be one of {', '.join(INTERVENTION_KINDS)}")
    t, doc = _now(now), _doc(value, "value")
    end = None if until is None else _now(until)
    with _tx(db) as s:
        ins = _insert(s, Intervention).values(pool=pool, kind=kind, target=target, value=doc, actor=actor, at=t,
                                              until=end)
        s.execute(ins.on_conflict_do_update(index_elements=[Intervention.pool, Intervention.kind, Intervention.target],
                                            set_={"value": doc, "actor": actor, "at": t, "until": end}))
        return _record(InterventionRecord, s.get_one(Intervention, (pool, kind, target), populate_existing=True))


def clear_intervention(db: DB, *, pool: str, kind: str, target: str) -> bool:
    """Remove an intervention; False if there was none."""
    with _tx(db) as s:
        return s.execute(sa.delete(Intervention).where(Intervention.pool == pool, Intervention.kind == kind,
                                                       Intervention.target == target)).rowcount == 1


def drop_expired_overrides(db: DB, pool: str, now: datetime | None = None) -> int:
    """Delete the pool's overrides that ended at or before ``now``; returns how many."""
    t = _now(now)
    with _tx(db) as s:
        return s.execute(sa.delete(Intervention).where(Intervention.pool == pool, Intervention.kind == "override",
                                                       Intervention.until <= t)).rowcount or 0


def list_interventions(db: DB, pool: str) -> list[InterventionRecord]:
    """The pool's interventions (expired overrides included: the caller drops them)."""
    stmt = sa.select(Intervention).where(Intervention.pool == pool).order_by(Intervention.kind, Intervention.target)
    with _tx(db, read=True) as s:
        return [_record(InterventionRecord, r) for r in s.scalars(stmt)]


def signing_key(db: DB, name: str, now: datetime | None = None) -> bytes:
    """The random key named ``name`` (32 bytes), created on first use; the first writer's key wins,
    so every server of one database uses the same one."""
    t = _now(now)
    with _tx(db) as s:
        ins = _insert(s, SigningKey).values(name=name, key=secrets.token_hex(32), created_at=t)
        s.execute(ins.on_conflict_do_nothing(index_elements=[SigningKey.name]))
        return bytes.fromhex(s.execute(sa.select(SigningKey.key).where(SigningKey.name == name)).scalar_one())
