"""Two controller PROCESSES against one PostgreSQL: only the lease holder acts; when it is killed
(SIGKILL, no goodbye) the other takes over within the lease period."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic import store as db

from ._lease_driver import LEASE_SECONDS, TICK_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, tmp: Path, url: str, owner: str, pool: str) -> None:
        self.log = tmp / f"{owner}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.controller._lease_driver", url, owner, pool],
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdout=open(self.log, "w"), stderr=open(tmp / f"{owner}.err", "w"),
                                     start_new_session=True)

    def ticks(self) -> list[dict]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]

    def wait(self, pred, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = [t for t in self.ticks() if pred(t)]
            if hit:
                return hit[0]
            assert self.proc.poll() is None, f"{self.log.stem} exited: {self.log.with_suffix('.err').read_text()}"
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last: {self.ticks()[-3:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def test_only_the_lease_holder_acts_and_the_standby_takes_over_after_a_kill(postgres_url, tmp_path) -> None:
    db.upgrade(postgres_url)
    pool = f"lease{os.getpid()}"
    a = Proc(tmp_path, postgres_url, "ctl-a", pool)
    b = None
    try:
        a.wait(lambda t: t["acted"], 60, "ctl-a to act")
        b = Proc(tmp_path, postgres_url, "ctl-b", pool)
        b.wait(lambda t: t["reason"] == "NotLeader", 60, "ctl-b to stand by")
        time.sleep(4 * TICK_SECONDS * 2)  # several ticks of both
        assert not any(t["acted"] or t["leader"] for t in b.ticks()), "the standby acted while the leader lived"
        assert all(t["acted"] for t in a.ticks()), [t for t in a.ticks() if not t["acted"]]
        killed_at = time.time()
        a.kill()
        first = b.wait(lambda t: t["acted"], 60, "ctl-b to take over")
        took = first["t"] - killed_at
        # the lease lasts LEASE_SECONDS from ctl-a's last renewal (<= killed_at), plus one standby tick
        assert 0 < took <= LEASE_SECONDS + 2 * TICK_SECONDS + 1.0, f"takeover after {took:.2f} s"
        assert not any(t["acted"] for t in b.ticks() if t["t"] < killed_at)
        holder = db.lease_holder(db.Store.from_url(postgres_url), pool)
        assert holder is not None and holder.owner == "ctl-b"
        print(f"takeover {took:.2f} s after SIGKILL (lease {LEASE_SECONDS} s)")
    finally:
        a.kill()
        if b is not None:
            b.kill()
