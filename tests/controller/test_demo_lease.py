"""The demo and the pool's lease: a run waits out the lease a killed earlier run left in the
same database, and hands its own back when it ends (so the next run starts at once).

Real store (SQLite and PostgreSQL), the real controller, the fake backend at our boundary."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from rich.console import Console

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.demo import _first_tick
from elastic.metrics import InProcessSource

from .fake_backend import FakeBackend
from .test_controller import CONFIG


def _controller(store, owner: str, lease_seconds: float) -> Controller:
    cfg = load_config(data={**CONFIG, "controller": {"tick_seconds": 0.2, "lease_seconds": lease_seconds}})
    return Controller(cfg, FakeBackend({"n0": 4, "n1": 4}), store, {"chat": InProcessSource(max_age=60)},
                      owner=owner, clock=time.time)


def test_a_run_waits_out_a_dead_runs_lease_then_hands_its_own_back(db_url: str) -> None:
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    try:
        # a demo killed with -9 a moment ago left its lease behind: the new run finds it held and says whose
        assert db.acquire_lease(store, "p", "demo-dead", 60.0, now=datetime.now(UTC))
        ctl = _controller(store, "demo-new", lease_seconds=5.0)
        console = Console(record=True, width=200)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_first_tick, ctl, console, 30.0, 0.2)
            deadline = time.monotonic() + 30.0
            while "lease held by demo-dead" not in console.export_text(clear=False):
                assert not fut.done() and time.monotonic() < deadline, "the new run never said whose lease it waits for"
                time.sleep(0.02)
            # the dead run's lease has 1.5 s left from here (its last renewal): the new run waits it out
            t0 = time.monotonic()
            assert db.acquire_lease(store, "p", "demo-dead", 1.5, now=datetime.now(UTC))
            res = fut.result(timeout=60)
        waited = time.monotonic() - t0
        assert ctl.is_leader and res.reason != "NotLeader", res
        assert 1.0 < waited < 15.0, waited  # the dead run's remaining lease (1.5 s), far from the 30 s wait cap
        # the end of a run hands the lease back: the next run leads on its first tick
        ctl.release_lease()
        nxt = _controller(store, "demo-next", lease_seconds=60.0)
        assert _first_tick(nxt, Console(record=True), wait_s=10.0, tick_seconds=0.2) is not None and nxt.is_leader
        # and a run that cannot get the lease gives up after its wait, saying who holds it: still not
        # leading, it did not wait until demo-next's 60 s lease ran out
        late = _controller(store, "demo-late", lease_seconds=5.0)
        res = _first_tick(late, Console(record=True), wait_s=0.5, tick_seconds=0.2)
        assert not late.is_leader and res.reason == "NotLeader" and "demo-next" in res.message
    finally:
        store.dispose()
