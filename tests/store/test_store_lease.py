"""Leader lease: single-holder semantics, expiry takeover, and real concurrent races.

The race tests use two ``Store`` objects (two connection pools) in two threads hitting
the same row at the same instant, many rounds; on PostgreSQL that is two server
backends contending on the ON CONFLICT row lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest

from elastic.store import Store, acquire_lease, lease_holder, release_lease, renew_lease
from tests.store.timeline import T0

TTL = 30.0


def _at(seconds: float):
    return T0 + timedelta(seconds=seconds)


# (action, owner, at seconds after T0, expected result, holder after)
LEASE_STORY = [
    ("acquire", "a", 0, True, "a"),
    ("acquire", "b", 10, False, "a"),     # a holds until 30
    ("renew", "b", 10, False, "a"),       # b never held it
    ("acquire", "a", 20, True, "a"),      # a extends to 50 by acquiring again
    ("renew", "a", 40, True, "a"),        # a extends to 70
    ("acquire", "b", 69, False, "a"),
    ("acquire", "b", 70, False, "a"),     # expires_at == now still counts as held
    ("acquire", "b", 71, True, "b"),      # expired: b takes over until 101
    ("renew", "a", 72, False, "b"),       # a learns it lost leadership
    ("release", "a", 73, False, "b"),     # a cannot release b's lease
    ("release", "b", 74, True, None),     # clean hand-over ...
    ("acquire", "a", 75, True, "a"),      # ... no need to wait for expiry
    ("renew", "a", 200, False, None),     # renewing after expiry fails; the lease shows as free
]


def test_lease_story(store: Store) -> None:
    for action, owner, at, expected, holder in LEASE_STORY:
        if action == "acquire":
            got = acquire_lease(store, "p", owner, TTL, now=_at(at))
        elif action == "renew":
            got = renew_lease(store, "p", owner, TTL, now=_at(at))
        else:
            got = release_lease(store, "p", owner)
        assert got is expected, f"{action}({owner}) at +{at}s"
        rec = lease_holder(store, "p", now=_at(at))
        assert (rec.owner if rec else None) == holder, f"holder after {action}({owner}) at +{at}s"


def test_holder_since_survives_renewal(store: Store) -> None:
    assert acquire_lease(store, "p", "a", TTL, now=_at(0))
    assert acquire_lease(store, "p", "a", TTL, now=_at(20))
    rec = lease_holder(store, "p", now=_at(21))
    assert (rec.acquired_at, rec.expires_at) == (_at(0), _at(50))
    assert acquire_lease(store, "p", "b", TTL, now=_at(60))
    assert lease_holder(store, "p", now=_at(61)).acquired_at == _at(60)


def test_pools_have_independent_leases(store: Store) -> None:
    assert acquire_lease(store, "p1", "a", TTL, now=T0)
    assert acquire_lease(store, "p2", "b", TTL, now=T0)
    assert lease_holder(store, "p1", now=T0).owner == "a"
    assert lease_holder(store, "p2", now=T0).owner == "b"


@pytest.mark.parametrize("ttl", [0, -1.0])
def test_ttl_must_be_positive(store: Store, ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        acquire_lease(store, "p", "a", ttl, now=T0)


def _race(url: str, rounds: int, pool_of, now_of) -> list[tuple[bool, bool]]:
    """Two threads, two Stores: each round both call acquire_lease at once (barrier)."""
    stores = [Store.from_url(url) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=30)
    results: list[list[bool | None]] = [[None] * rounds, [None] * rounds]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait()
                results[i][r] = acquire_lease(stores[i], pool_of(r), f"owner-{i}", TTL, now=now_of(r))
        except BaseException as e:  # surface in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for s in stores:
        s.dispose()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "race threads hung"
    return list(zip(results[0], results[1], strict=True))


ROUNDS = 60


def test_race_on_new_lease_exactly_one_wins(store: Store, db_url: str) -> None:
    outcome = _race(db_url, ROUNDS, pool_of=lambda r: f"fresh-{r}", now_of=lambda r: T0)
    for r, (a, b) in enumerate(outcome):
        assert a != b, f"round {r}: owner-0 {a}, owner-1 {b}; exactly one must win"
        assert lease_holder(store, f"fresh-{r}", now=T0).owner == ("owner-0" if a else "owner-1")
    print(f"new-lease race on {store.dialect}: wins {Counter('owner-0' if a else 'owner-1' for a, _ in outcome)}")


def test_race_on_expired_lease_exactly_one_takes_over(store: Store, db_url: str) -> None:
    # Each round a stale leader's lease has expired; both standbys try to take over at once.
    for r in range(ROUNDS):
        assert acquire_lease(store, f"stale-{r}", "dead-leader", TTL, now=T0)
    after_expiry = _at(TTL + 1)
    outcome = _race(db_url, ROUNDS, pool_of=lambda r: f"stale-{r}", now_of=lambda r: after_expiry)
    for r, (a, b) in enumerate(outcome):
        assert a != b, f"round {r}: owner-0 {a}, owner-1 {b}; exactly one must take over"
        assert lease_holder(store, f"stale-{r}", now=after_expiry).owner == ("owner-0" if a else "owner-1")


def test_race_same_lease_over_time_then_expiry_hands_over(store: Store, db_url: str) -> None:
    """One pool, many ticks: whoever wins first keeps winning until its lease expires."""
    # tick r at T0 + r seconds; neither renews beyond acquire, so the first winner holds
    # until TTL and re-acquires each tick (it is the owner), the other always loses.
    outcome = _race(db_url, 20, pool_of=lambda r: "shared", now_of=lambda r: _at(r))
    first = 0 if outcome[0][0] else 1
    assert all(res[first] and not res[1 - first] for res in outcome), outcome
    # the winner stops renewing (crash); after expiry the other takes over
    last_expiry = _at(19 + TTL)
    loser = f"owner-{1 - first}"
    assert not acquire_lease(store, "shared", loser, TTL, now=last_expiry)
    assert acquire_lease(store, "shared", loser, TTL, now=last_expiry + timedelta(microseconds=1))
    assert lease_holder(store, "shared", now=last_expiry + timedelta(seconds=1)).owner == loser
