"""Admin API read throughput and latency on loopback (a benchmark, printed; not a test).

Goal (issue 9): the read endpoints sustain >= 300 requests/s with p99 < 100 ms on a 2-core
machine. Setup: a SQLite store, a controller over the fake backend that has ticked a few
times (so lists and history are non-trivial), the API served by uvicorn (``serve_api``) in a
child process (as in ``elastic serve``; a load generator in the same process would share its
GIL), and a bounded closed-loop load: ``--requests`` GETs spread round-robin over the read
endpoints by ``--concurrency`` client threads, each with its own keep-alive connection.

    .venv/bin/python benchmarks/api_bench.py [--requests 3000] [--concurrency 8] [--db URL]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic import store as db  # noqa: E402
from elastic.api import TokenSet, create_app, serve_api  # noqa: E402
from elastic.config import load_config  # noqa: E402
from elastic.controller import Controller  # noqa: E402
from elastic.metrics import InProcessSource  # noqa: E402
from elastic.metrics.exporter import Exporter  # noqa: E402
from tests.controller.fake_backend import FakeBackend  # noqa: E402

READS = ["/api/v1/pools", "/api/v1/services", "/api/v1/services/chat", "/api/v1/jobs", "/api/v1/jobs/pretrain",
         "/api/v1/decisions?limit=20", "/api/v1/jobs/pretrain/reshards?limit=20", "/api/v1/controller", "/healthz"]
CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g", "rescale_interval_seconds": 0,
             "gain_threshold": 0.0},
    "services": [{"name": "chat", "min_replicas": 1, "max_replicas": 6, "metric": {"preset": "vllm-running", "target": 10},
                  "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
}


def setup(url: str, ticks: int) -> tuple[object, db.Store]:
    db.upgrade(url)
    store = db.Store.from_url(url)
    t = [1_700_000_000.0]
    source = InProcessSource(max_age=60)
    ctl = Controller(load_config(data=CONFIG), FakeBackend({"n0": 4, "n1": 4}), store, {"chat": source},
                     owner="bench", clock=lambda: t[0])
    exporter = Exporter()
    for i in range(ticks):
        t[0] += 20
        source.set("chat", (10.0, 40.0)[i % 2], t[0])
        exporter.observe_tick(ctl.tick(), ctl)
    app = create_app(store, ctl, tokens=TokenSet(), registry=exporter.registry)
    server, _ = serve_api(app, "127.0.0.1", 0)
    return server, store


def load(base: str, requests: int, concurrency: int) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        mine: list[float] = []
        with httpx.Client(base_url=base, timeout=10) as c:
            for i in counter:  # shared iterator: exactly `requests` GETs in total
                t0 = time.perf_counter()
                r = c.get(READS[i % len(READS)])
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    with lock:
                        errors[0] += 1
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return latencies, time.perf_counter() - start, errors[0]


def serve(url: str, ticks: int) -> int:
    """Child process: set up, print the base URL, serve until stdin closes."""
    server, store = setup(url, ticks)
    print(server.url, flush=True)
    sys.stdin.read()
    server.stop()
    store.dispose()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=40, help="controller ticks of history before the load")
    ap.add_argument("--db", default=None, help="database URL (default: a temporary SQLite file)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    url = args.db or f"sqlite:///{tempfile.mkdtemp(prefix='api-bench-')}/bench.db"
    if args.serve:
        return serve(url, args.ticks)
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--db", url, "--ticks", str(args.ticks)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base = child.stdout.readline().strip()
        if not base.startswith("http://"):
            raise SystemExit(f"API server did not start (got {base!r})")
        load(base, 200, args.concurrency)  # warm-up: connections, caches
        lat, wall, errors = load(base, args.requests, args.concurrency)
    finally:
        child.stdin.close()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
    lat.sort()
    q = statistics.quantiles(lat, n=100)
    rps = len(lat) / wall
    print(f"admin API reads on {db.mask_url(url).split(':')[0]}: {len(lat)} requests over {len(READS)} endpoints, "
          f"concurrency {args.concurrency}")
    print(f"  throughput {rps:.0f} req/s   p50 {q[49] * 1000:.1f} ms   p99 {q[98] * 1000:.1f} ms   "
          f"max {lat[-1] * 1000:.1f} ms   non-200: {errors}")
    ok = rps >= 300 and q[98] < 0.100 and errors == 0
    print(f"  goal >= 300 req/s with p99 < 100 ms: {'MET' if ok else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
