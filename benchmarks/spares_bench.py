"""Benchmark: a grow's joiner and a scale-up's replica from a spare, side by side with a fresh start.

The embedded Ray backend (``RayBackend``, 8 logical GPUs, work on CPU) with the ``tiny`` job of
the demo (global batch 420, no ZeRO-1, the demo's trainer config) and reference replicas, on an
otherwise idle machine (the demo adds load: there a grow took 4.4-6.2 s fresh, 2.9-4.5 s spare). Alternately, on the
same Ray and the same job, ``--rounds`` times:

* ``grow_s``: ``set_job_gpus`` from ``tp1.pp1.dp2`` to ``dp3`` (decision to the first step on the
  new layout), with ``spare_workers=0`` (the joiner is a new actor: a process start, then torch
  and the trainer imported) and ``spare_workers=1`` (the joiner is a spare started ahead without a
  GPU; a GPU lease is created and it trains once Ray grants it); then back to ``dp2``, untimed;
* ``scale_up_s``: ``set_service_gpus`` from one replica to two (until the new one is in the
  balancer), with ``spare_replicas=0`` and ``=1``; then back to one, untimed.

Before each timed spare round the spare has finished warming up (in the demo the time between
rescales does that). Prints medians and ``fresh / spare``; writes ``benchmarks/results/spares.json``.
Run: ``make bench`` (all benchmarks) or ``.venv/bin/python benchmarks/spares_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for k, v in {"RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
    os.environ.setdefault(k, v)

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

    import ray

    from elastic.backends.ray import RayBackend
    from elastic.config import load_config
    from elastic.model import GPU, Layout
    from elastic.serve.server import ReplicaConfig
    from elastic.train.launch import LaunchOptions
    from elastic.train.ray_handle import init_local_ray

    cfg = load_config(data={
        "pool": {"name": "bench", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g"},
        "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6}],
        "jobs": [{"name": "gpt-tiny", "model": "tiny", "min_gpus": 1, "max_gpus": 7, "global_batch": 420,
                  "micro_batch": 1, "replicate_optimizer": True}],
    })
    svc, job = cfg.services[0], cfg.jobs[0]
    gpus = tuple(GPU("local", i) for i in range(8))
    init_local_ray(num_gpus=8, num_cpus=2)
    from elastic.demo import _trainer_config  # the demo's: per-layout micro-batches keep a step short

    backend = RayBackend(cfg.pool, replica_config=ReplicaConfig(model="tiny", max_running=16),
                         trainer_config=_trainer_config,
                         train_options=LaunchOptions(heartbeat_timeout_s=60.0, join_timeout_s=90.0))
    out: dict[str, dict[str, list[float]]] = {"grow_s": {"fresh": [], "spare": []},
                                              "scale_up_s": {"fresh": [], "spare": []}}
    dp2, dp3 = Layout.parse("tp1.pp1.dp2"), Layout.parse("tp1.pp1.dp3")
    try:
        backend.set_job_gpus(job, gpus[:2], dp2)
        backend.set_service_gpus(svc, gpus[7:])
        handle = backend.jobs[job.name].handle
        handle.spares_wanted, backend.spare_replicas = 1, 1
        for _ in range(a.rounds):
            for kind in ("fresh", "spare"):
                # the spares are set aside for a fresh round (and not replaced meanwhile)
                handle.keep_spares()
                backend._keep_spare_replicas(svc)
                for _, ref in handle.spares + backend._spare_reps[svc.name]:
                    ray.get(ref, timeout=120)  # warm, as the time between rescales makes them
                aside = (handle.spares, backend._spare_reps[svc.name]) if kind == "fresh" else None
                if aside:
                    handle.spares, backend._spare_reps[svc.name] = [], []
                    handle.spares_wanted, backend.spare_replicas = 0, 0
                t0 = time.perf_counter()
                backend.set_job_gpus(job, gpus[:3], dp3)
                out["grow_s"][kind].append(time.perf_counter() - t0)
                backend.set_job_gpus(job, gpus[:2], dp2)
                t0 = time.perf_counter()
                backend.set_service_gpus(svc, gpus[6:])
                out["scale_up_s"][kind].append(time.perf_counter() - t0)
                backend.set_service_gpus(svc, gpus[7:])
                if aside:
                    handle.spares, backend._spare_reps[svc.name] = aside
                    handle.spares_wanted, backend.spare_replicas = 1, 1
    finally:
        backend.shutdown()
        ray.shutdown()
    rows = {}
    print(f"{'':12} {'fresh s':>9} {'spare s':>9} {'fresh/spare':>12}   (medians of {a.rounds})")
    for what, d in out.items():
        f, s = statistics.median(d["fresh"]), statistics.median(d["spare"])
        rows[what] = {"fresh": d["fresh"], "spare": d["spare"], "fresh_median": f, "spare_median": s,
                      "ratio": f / s}
        print(f"{what:12} {f:9.2f} {s:9.2f} {f / s:12.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spares.json").write_text(json.dumps(rows, indent=2))
    # the goal: a spare is faster than a fresh start, for a joiner and for a replica
    ok = all(r["ratio"] > 1.0 for r in rows.values())
    if not ok:
        print("!! a spare was not faster than a fresh start", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
