"""The leader lease of a pool and its fencing token (the epoch): take, renew, check, release,
and ``FencedStore``, a ``Store`` whose every write first checks the lease in its own transaction.

What it must not do: decide who leads or when to step down. It answers, atomically, whether a
lease is held and at which epoch; the controller decides what to do with the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from elastic.store.common import DB, _insert, _now, _tx
from elastic.store.engine import LeaseLost, Store
from elastic.store.models import Lease
from elastic.store.records import LeaseRecord, _record

# --------------------------------------------------------------------------------------------
# Leader lease
# --------------------------------------------------------------------------------------------


def _ttl(ttl_seconds: float) -> timedelta:
    if not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds={ttl_seconds} must be > 0")
    return timedelta(seconds=ttl_seconds)


def take_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None, *,
               epoch: Any = ...) -> int | None:
    """Take or extend the pool's lease: the epoch ``owner`` holds it at until ``now + ttl``, or None.

    ``epoch``: the epoch the caller holds (it renews only that one), or None when it holds none
    (it takes the lease only once it is free or expired, even from a holder of the same name:
    two processes given one identity never both lead). Left out: any lease of ``owner`` is
    renewed (``acquire_lease``).

    One atomic statement, safe with concurrent writers on PostgreSQL (the ON CONFLICT
    row lock serialises racers and the WHERE is re-checked on the latest row):

        INSERT INTO leases ... ON CONFLICT (pool) DO UPDATE SET owner, expires_at, epoch, ...
        WHERE leases.expires_at < :now OR leases.owner = :owner RETURNING owner, epoch

    A row comes back only if we inserted or the WHERE let us update. The epoch (the fencing
    token) stays on a renewal of a live lease and grows by one on any other take: a takeover,
    or the same owner again after its lease expired (it may have been stalled meanwhile).
    """
    t = _now(now)
    expires = t + _ttl(ttl_seconds)
    with _tx(db) as s:
        ins = _insert(s, Lease).values(pool=pool, owner=owner, acquired_at=t, expires_at=expires, epoch=1)
        mine: Any = Lease.owner == owner
        if epoch is None:
            mine = sa.false()
        elif epoch is not ...:
            mine = sa.and_(mine, Lease.epoch == int(epoch))
        renewal = sa.and_(mine, Lease.expires_at >= t)
        stmt = ins.on_conflict_do_update(
            index_elements=[Lease.pool],
            set_={
                "owner": ins.excluded.owner,
                "expires_at": ins.excluded.expires_at,
                # keep "holder since" across renewals by the same owner
                "acquired_at": sa.case((Lease.owner == ins.excluded.owner, Lease.acquired_at),
                                       else_=ins.excluded.acquired_at),
                "epoch": sa.case((renewal, Lease.epoch), else_=Lease.epoch + 1),
            },
            where=sa.or_(Lease.expires_at < t, mine),
        ).returning(Lease.owner, Lease.epoch)
        row = s.execute(stmt).first()
        return int(row[1]) if row is not None and row[0] == owner else None


def acquire_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None) -> bool:
    """Take or extend the pool's lease; True iff ``owner`` holds it until ``now + ttl`` (``take_lease``)."""
    return take_lease(db, pool, owner, ttl_seconds, now) is not None


def renew_lease(db: DB, pool: str, owner: str, ttl_seconds: float, now: datetime | None = None,
                epoch: int | None = None) -> bool:
    """Extend a lease ``owner`` still holds (unexpired at ``now``, at ``epoch`` when given); False
    means leadership is lost."""
    t = _now(now)
    expires = t + _ttl(ttl_seconds)
    cond = [Lease.pool == pool, Lease.owner == owner, Lease.expires_at >= t]
    if epoch is not None:
        cond.append(Lease.epoch == epoch)
    with _tx(db) as s:
        res = s.execute(sa.update(Lease).where(*cond).values(expires_at=expires))
        return res.rowcount == 1


def check_lease(db: DB, pool: str, owner: str, epoch: int) -> None:
    """``LeaseLost`` unless ``owner`` still holds the pool's lease at ``epoch``. Inside a write
    transaction the lease row stays locked until it commits (PostgreSQL ``FOR UPDATE``; SQLite's
    ``BEGIN IMMEDIATE`` serialises every writer), so no takeover lands between check and write."""
    with _tx(db) as s:
        row = s.execute(sa.select(Lease.owner, Lease.epoch).where(Lease.pool == pool).with_for_update()).first()
        if row is None or row[0] != owner or int(row[1]) != epoch:
            holder = "nobody" if row is None else f"{row[0]} at epoch {row[1]}"
            raise LeaseLost(f"the lease of pool {pool} is no longer {owner}'s at epoch {epoch} (now {holder}); "
                            "write refused")


class FencedStore:
    """A ``Store`` for a leader's writes: every write transaction first runs ``guard()`` (a local
    check, e.g. the lease's deadline on this host's clock) and ``check_lease`` in the same
    transaction, so a leader that lost its lease writes nothing. Reads pass through unchecked.
    ``epoch`` None (not leading) refuses every write."""

    def __init__(self, store: Store, pool: str, owner: str, guard: Callable[[], None] | None = None) -> None:
        self.store, self.pool, self.owner, self.guard = store, pool, owner, guard
        self.epoch: int | None = None

    @contextmanager
    def session(self, read_only: bool = False) -> Iterator[Session]:
        if not read_only and self.guard is not None:
            self.guard()
        with self.store.session(read_only=read_only) as s:
            if not read_only:
                if self.epoch is None:
                    raise LeaseLost(f"{self.owner} does not hold the lease of pool {self.pool}; write refused")
                check_lease(s, self.pool, self.owner, self.epoch)
            yield s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


#: what a released lease expires at: before any clock a taker may have
_RELEASED = datetime(1970, 1, 1, tzinfo=UTC)


def release_lease(db: DB, pool: str, owner: str, epoch: int | None = None) -> bool:
    """Give the lease up (clean shutdown) so a standby takes over without waiting for expiry;
    ``epoch``: only the lease held at that epoch (a process sharing ``owner``'s name that took it
    over meanwhile keeps it). The row stays, expired, with its epoch: the next take goes on from
    it, so the fencing token never repeats (a deleted row would start again at 1, and a stalled
    leader of that epoch and name would pass the fence)."""
    cond = [Lease.pool == pool, Lease.owner == owner, Lease.expires_at > _RELEASED]
    if epoch is not None:
        cond.append(Lease.epoch == epoch)
    with _tx(db) as s:
        return s.execute(sa.update(Lease).where(*cond).values(expires_at=_RELEASED)).rowcount == 1


def lease_holder(db: DB, pool: str, now: datetime | None = None) -> LeaseRecord | None:
    """The current, unexpired lease of the pool, or None."""
    t = _now(now)
    with _tx(db, read=True) as s:
        row = s.get(Lease, pool, populate_existing=True)
        if row is None or row.expires_at < t:
            return None
        return _record(LeaseRecord, row)
