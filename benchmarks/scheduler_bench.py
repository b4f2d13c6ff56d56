"""One co-scheduler decision at scale: 10,000 GPUs (1,250 nodes x 8), 500 services, 50 jobs.

Goal (issue 10): under 100 ms. Prints the median and worst of several decisions, each after
the inference demand moved (some services up, some down), from the previous allocation.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.model import Allocation, Layout  # noqa: E402
from elastic.scheduler import JobState, Knobs, ServiceDemand, Snapshot, decide  # noqa: E402


def main() -> None:
    rng = random.Random(0)
    nodes = {f"node{i:04d}": 8 for i in range(1250)}
    gpr = [1, 2, 4, 8]
    shapes = [(f"svc{i:03d}", rng.choice(gpr), rng.randint(0, 3)) for i in range(500)]
    jobs = []
    for i in range(50):
        tp = rng.choice([1, 2, 4, 8])
        step = tp * rng.choice([1, 2, 4])
        per = rng.uniform(500, 2000)
        table = {n: (Layout(tp, 1, n // tp), per * n * 0.995 ** (n // step)) for n in range(step, 1025, step)}
        jobs.append(JobState(f"job{i:02d}", table, min_gpus=step, max_gpus=1024, priority=rng.randint(0, 5)))
    knobs = Knobs(rescale_interval_seconds=0.0, gain_threshold=0.02)

    def demand() -> tuple[ServiceDemand, ...]:
        # about 6,000 GPUs of inference, moving by up to +-30% per service between decisions
        return tuple(ServiceDemand(n, max(0, round(12 / g * rng.uniform(0.7, 1.3))), g, p) for n, g, p in shapes)

    prev = Allocation({})
    times = []
    for k in range(12):
        snap = Snapshot(float(k * 60), nodes, demand(), tuple(jobs), prev, knobs)
        t0 = time.perf_counter()
        plan = decide(snap)
        times.append(time.perf_counter() - t0)
        plan.allocation.check_disjoint()
        prev = plan.allocation
    steady = times[1:]  # the first decision places everything from scratch
    print("  per decision (ms):", " ".join(f"{t * 1e3:.0f}" for t in times))
    inf = sum(plan.gpus_of(n) for n, _, _ in shapes)
    trn = sum(plan.gpus_of(j.name) for j in jobs)
    print(f"co-scheduler decision, 10,000 GPUs / 500 services / 50 jobs: median {statistics.median(steady) * 1e3:.1f} ms, "
          f"max {max(steady) * 1e3:.1f} ms (first, from empty: {times[0] * 1e3:.1f} ms); goal < 100 ms")
    print(f"  last plan: inference {inf} GPUs, training {trn} GPUs, idle {plan.idle_gpus}, {len(plan.steps)} steps")
    sys.exit(0 if statistics.median(steady) < 0.1 else 1)


if __name__ == "__main__":
    main()
