"""A controller PROCESS for the two-controller test: the real Controller and store (PostgreSQL), the
fake backend (our boundary), a constant load. One JSON line per tick: who acted and why.

    python -m tests.controller._lease_driver DB_URL OWNER POOL
"""

from __future__ import annotations

import json
import sys
import time

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from tests.controller.fake_backend import FakeBackend

LEASE_SECONDS = 3.0
TICK_SECONDS = 0.25


def config(pool: str) -> dict:
    return {
        "pool": {"name": pool, "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
                 "rescale_interval_seconds": 0, "gain_threshold": 0.0},
        "services": [{"name": f"{pool}-chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                      "metric": {"preset": "vllm-running", "target": 10}}],
        "jobs": [{"name": f"{pool}-job", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
        "controller": {"tick_seconds": TICK_SECONDS, "lease_seconds": LEASE_SECONDS},
    }


def main(url: str, owner: str, pool: str) -> None:
    cfg = load_config(data=config(pool))
    store = db.Store.from_url(url)
    source = InProcessSource(max_age=60)
    ctl = Controller(cfg, FakeBackend({"n0": 4, "n1": 4}), store, {f"{pool}-chat": source}, owner=owner)
    while True:
        source.set(f"{pool}-chat", 10.0, time.time())
        res = ctl.tick()
        print(json.dumps({"t": time.time(), "owner": owner, "acted": res.acted, "reason": res.reason,
                          "leader": ctl.is_leader, "error": res.error}), flush=True)
        time.sleep(TICK_SECONDS)


if __name__ == "__main__":
    main(*sys.argv[1:4])
