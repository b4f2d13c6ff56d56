"""Step 0 of a tick, lead: the pool's DB lease, its renewal while a tick works, and the fence.

A controller without the lease does nothing. While a tick works a background thread renews it
(every third of the lease), and every backend action and DB write of the tick is fenced: it goes
ahead only while the lease is still this controller's at the epoch it took (the DB refuses a write
with a stale epoch in the same transaction; locally, a lease not renewed in time stops the tick
before its next action). Taking the lease at a new epoch loads the interventions on record.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from elastic import store as db
from elastic.backends.base import BackendUnavailable
from elastic.controller.base import _call_within, _dt, log
from elastic.controller.interventions import Interventions

#: the share of the lease this controller counts on from the moment it asked for it (the rest is
#: slack for clock rates and the DB's delay)
_LEASE_MARGIN = 0.9


class Leading(Interventions):
    """Takes, renews, checks and hands back the pool's lease; fences the tick's backend actions."""

    def _lead(self, now: float) -> bool:
        """Take or renew the pool's lease. A new epoch (a takeover, or ours again after it ran out)
        loads the interventions on record: a predecessor may have paused or pinned meanwhile."""
        ttl = self.cfg.controller.lease_seconds
        asked = time.monotonic()  # the lease runs from no later than this, whatever the DB's delay
        epoch = db.take_lease(self.store, self.pool, self.owner, ttl, now=_dt(now), epoch=self.db.epoch)
        if epoch is None:
            self._stand_down(None)  # said by _lease_changed, with the holder's name
            return False
        self._lost, self._lead_until = None, asked + ttl * _LEASE_MARGIN
        if epoch != self.db.epoch:
            self.db.epoch = epoch
            self._load_interventions()
        self.is_leader = True
        return True

    def _stand_down(self, why: str | None) -> None:
        """No longer the leader: nothing more is acted or written until the lease is ours again,
        and then the DB's state is recovered first (another leader acted meanwhile)."""
        if self.db.epoch is not None and why is not None:
            log.warning("lost the lease of pool %s: %s; stopped before the next action, standing by", self.pool, why)
            self._lease_state = False
        self.db.epoch, self.is_leader, self.recovered, self._hold = None, False, False, None

    def _check_lead(self) -> None:
        """The local half of the fence, before every backend action and DB write of a tick:
        ``LeaseLost`` once a renewal was refused, or once the lease may have run out on this
        host's clock (a process stalled past it, e.g. stopped, must not act on waking)."""
        if self._lost is not None:
            raise db.LeaseLost(self._lost)
        if self.db.epoch is None:
            raise db.LeaseLost(f"{self.owner} does not hold the lease of pool {self.pool}")
        late = time.monotonic() - self._lead_until
        if late > 0:
            raise db.LeaseLost(f"the lease of pool {self.pool} was not renewed in time ({late:.1f} s past its "
                               "deadline on this host)")

    @contextlib.contextmanager
    def _heartbeat(self) -> Iterator[None]:
        """Renew the lease every third of its length while the tick works (a long rescale keeps it);
        a refused renewal marks it lost (``_check_lead`` then stops the tick at its next step)."""
        ttl = self.cfg.controller.lease_seconds
        done = threading.Event()
        epoch = self.db.epoch

        def beat() -> None:
            while not done.wait(ttl / 3):
                asked = time.monotonic()
                try:
                    ok = db.renew_lease(self.store, self.pool, self.owner, ttl, now=_dt(self.clock()), epoch=epoch)
                except db.StoreError as e:  # the deadline decides if the DB stays away
                    log.warning("could not renew the lease of pool %s: %s", self.pool, e)
                    continue
                if not ok:
                    self._lost = f"the lease of pool {self.pool} could not be renewed: another controller holds it"
                    return
                self._lead_until = asked + ttl * _LEASE_MARGIN

        t = threading.Thread(target=beat, name=f"lease-{self.pool}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

    def _act(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A backend action, fenced: only while the lease is still ours."""
        self._check_lead()
        return fn(*args)

    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """A backend read that must not hold the tick: ``BackendUnavailable`` after
        ``backend_timeout_seconds`` (the call is left to finish on its own)."""
        return _call_within(fn, self.cfg.controller.backend_timeout(), what, BackendUnavailable)

    def _lease_changed(self, leader: bool, holder: str) -> None:
        """One line when this controller gains or loses the pool's lease (or starts as a standby)."""
        was, self._lease_state = self._lease_state, leader
        if was == leader:
            return
        if leader:
            log.info("leading pool %s: lease taken by %s at epoch %s (%g s, renewed while a tick works)", self.pool,
                     self.owner, self.db.epoch, self.cfg.controller.lease_seconds)
        elif was:
            log.warning("lost the lease of pool %s to %s: standing by, not acting", self.pool, holder)
        else:
            log.info("standing by: the lease of pool %s is held by %s", self.pool, holder)

    def release_lease(self) -> None:
        """Hand the pool's lease back now if we hold it, so a successor need not wait for it
        to expire; a failure is only logged (the lease expires on its own). Only at our epoch: if
        we were stalled and a process of the same name took it over, its lease stays."""
        if not self.is_leader or self.db.epoch is None:
            return
        try:
            db.release_lease(self.store, self.pool, self.owner, epoch=self.db.epoch)
        except Exception as e:  # noqa: BLE001 - it expires on its own
            log.warning("could not release the lease of pool %s: %s", self.pool, e)
        # the released row keeps our name and epoch until someone takes it: our own fence must
        # refuse from now on, not the DB's
        self._stand_down(None)
