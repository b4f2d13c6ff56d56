"""Taking a leaving inference replica out gently: wait until it has finished its requests, or ask
it to hand them off. A backend calls these after the replica left the load balancer's targets and
before it stops the replica."""

from __future__ import annotations

import time
from collections.abc import Sequence


def wait_drained(urls: Sequence[str], timeout: float, poll: float = 0.1) -> list[str]:
    """Wait until the replicas at ``urls`` (already out of the load balancer's targets) have
    finished every request they had, running or waiting, at most ``timeout`` seconds; returns
    those still busy then. Their servers give what is left a second's grace before cutting
    it, so set the timeout above the longest request served (as Kubernetes'
    ``terminationGracePeriodSeconds``). A replica counts as drained once it read idle twice
    in a row: a request routed to it just before it left the targets is not cut. An
    unreachable replica has nothing left to drain."""
    deadline = time.monotonic() + timeout
    idle = {u: 0 for u in urls}  # idle readings in a row; 2 = drained
    while True:
        _read_idle(idle)
        if all(n == 2 for n in idle.values()) or time.monotonic() > deadline:
            break
        time.sleep(poll)
    if any(n == 1 for n in idle.values()):
        # one that read idle once at the deadline gets its second reading: on a slow machine the
        # first round of reads can take the whole timeout, and only a replica still busy is reported
        time.sleep(poll)
        _read_idle(idle, only=1)
    return [u for u, n in idle.items() if n < 2]


def _read_idle(idle: dict[str, int], only: int | None = None) -> None:
    """One round of ``wait_drained``'s reads: ``idle[url]`` counts idle readings in a row, 2 when
    drained (an unreachable replica has nothing left). ``only``: read just those at that count."""
    from elastic.metrics.scrape import scrape_sum

    for u, n in idle.items():
        if n < 2 and only in (None, n):
            busy = scrape_sum(u, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
            idle[u] = 2 if busy is None else (n + 1 if not busy else 0)


def hand_off(urls: Sequence[str], timeout: float = 2.0) -> dict[str, int | None]:
    """Ask each replica at ``urls`` (already out of the balancer's targets) to hand its requests
    off (``POST /admin/handoff``, see elastic.serve.server): url -> requests handed off, None
    where it could not (no such endpoint, unreachable); those are drained as usual."""
    import httpx

    from elastic.metrics.scrape import shared_client

    out: dict[str, int | None] = {}
    for u in urls:
        try:
            r = shared_client().post(f"{u.rstrip('/')}/admin/handoff", timeout=timeout)
            out[u] = int(r.json()["handed_off"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            out[u] = None
    return out
