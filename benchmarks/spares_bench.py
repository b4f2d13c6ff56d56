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

Then the GPU changing hands (``elastic.ray_gpu_lease.LeaseDesk``), spares on, ``--rounds`` times
alternately with the leaver's lease given back to Ray first (``new lease``: the next holder asks
Ray for one, as before the handover existed) and handed over (``handover``):

* ``grow_after_scale_down_s``: a replica holding GPU 6 through a lease leaves (untimed), then
  ``set_job_gpus`` grows the job from ``dp2`` onto GPU 6 (decision to the first step on ``dp3``);
* ``scale_up_after_shrink_s``: the job shrinks back off GPU 6 (untimed), then ``set_service_gpus``
  starts a replica there (until it is in the balancer).

Before each timed spare round the spare has finished warming up (in the demo the time between
rescales does that). Prints medians and the ratio of the columns; writes
``benchmarks/results/spares.json``.
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
                                              "scale_up_s": {"fresh": [], "spare": []},
                                              "grow_after_scale_down_s": {"new lease": [], "handover": []},
                                              "scale_up_after_shrink_s": {"new lease": [], "handover": []}}
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
                backend.leases.release()  # this section compares starts: no lease handed over
                t0 = time.perf_counter()
                backend.set_job_gpus(job, gpus[:3], dp3)
                out["grow_s"][kind].append(time.perf_counter() - t0)
                backend.set_job_gpus(job, gpus[:2], dp2)
                backend.leases.release()
                t0 = time.perf_counter()
                backend.set_service_gpus(svc, gpus[6:])
                out["scale_up_s"][kind].append(time.perf_counter() - t0)
                backend.set_service_gpus(svc, gpus[7:])
                if aside:
                    handle.spares, backend._spare_reps[svc.name] = aside
                    handle.spares_wanted, backend.spare_replicas = 1, 1
        backend.leases.release()
        g6, handed_before = gpus[6], backend.leases.handed_over
        for _ in range(a.rounds):
            for kind in ("new lease", "handover"):
                for _, ref in handle.spares + backend._spare_reps[svc.name]:
                    ray.get(ref, timeout=120)
                backend.set_service_gpus(svc, gpus[6:])  # a spare replica on GPU 6, holding it by a lease
                assert any(r.gpu == g6 and r.lease is not None for r in backend.replicas[svc.name])
                for _, ref in handle.spares:
                    ray.get(ref, timeout=120)
                backend.set_service_gpus(svc, gpus[7:])  # it leaves: its lease parked for GPU 6's next holder
                if kind == "new lease":
                    backend.leases.release()
                t0 = time.perf_counter()
                backend.set_job_gpus(job, (*gpus[:2], g6), dp3)
                out["grow_after_scale_down_s"][kind].append(time.perf_counter() - t0)
                for _, ref in backend._spare_reps[svc.name]:
                    ray.get(ref, timeout=120)
                backend.set_job_gpus(job, gpus[:2], dp2)  # the joiner leaves: its lease parked
                if kind == "new lease":
                    backend.leases.release()
                t0 = time.perf_counter()
                backend.set_service_gpus(svc, gpus[6:])
                out["scale_up_after_shrink_s"][kind].append(time.perf_counter() - t0)
                backend.set_service_gpus(svc, gpus[7:])
                backend.leases.release()
        handed = backend.leases.handed_over - handed_before
    finally:
        backend.shutdown()
        ray.shutdown()
    rows: dict[str, dict[str, object]] = {}
    for what, d in out.items():
        (ka, va), (kb, vb) = d.items()
        if what in ("grow_s", "grow_after_scale_down_s"):
            print(f"\n{'':24} {ka + ' s':>11} {kb + ' s':>11} {ka + '/' + kb:>20}   (medians of {a.rounds})")
        ma, mb = statistics.median(va), statistics.median(vb)
        rows[what] = {ka: va, kb: vb, f"{ka}_median": ma, f"{kb}_median": mb, "ratio": ma / mb}
        print(f"{what:24} {ma:11.2f} {mb:11.2f} {ma / mb:20.2f}")
    print(f"leases handed over: {handed} (one per handover round: {2 * a.rounds} expected)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spares.json").write_text(json.dumps(rows, indent=2))
    # the goals: a spare is faster than a fresh start, for a joiner and for a replica; a GPU handed over
    # with its lease reaches its next holder faster than through a new lease
    ok = all(r["ratio"] > 1.0 for r in rows.values()) and handed == 2 * a.rounds
    if not ok:
        print("!! a spare was not faster than a fresh start, or a handover not faster than a new lease",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
