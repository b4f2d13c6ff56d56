"""Planner speed: every layout of a 1T-parameter model on 3,072 GPUs (memory + throughput) in under 1 s.

Run: ``.venv/bin/python benchmarks/plan_bench.py``. Prints the cold time (empty caches), the
warm time, and best_by_gpu_count over a range of counts as the co-scheduler calls it.
"""

from __future__ import annotations

import os
import time

from elastic.model import load_hardware, load_model
from elastic.parallel import memory, params, planner


def _clear() -> None:
    for f in (planner._planned, planner._structure, planner._imbalance, planner._best_by_count,
              memory.stage_profiles, memory.stage_mixes, memory.activation_terms, memory._partition,
              params._group_counts):
        f.cache_clear()


def main() -> None:
    hw = load_hardware("a100-80g")
    cases = [("megatron-1t", 3072, 3072, hw), ("deepseek-v3", 2048, 15360, load_hardware("h800-80g"))]
    for name, gpus, batch, h in cases:
        model = load_model(name)
        _clear()
        t0, c0 = time.perf_counter(), time.process_time()
        res = planner.plan(model, gpus, h, global_batch=batch)
        cold, cpu = time.perf_counter() - t0, time.process_time() - c0
        t0 = time.perf_counter()
        planner.plan(model, gpus, h, global_batch=batch)
        warm = time.perf_counter() - t0
        best = res.plans[0]
        print(f"plan {name} on {gpus} x {h.name}: {res.evaluated} layouts evaluated, {len(res.plans)} fit, "
              f"cold {cold:.3f} s (CPU {cpu:.3f} s), warm {warm:.3f} s; best {best.layout} mb{best.micro_batch} {best.recompute} "
              f"{best.tokens_per_second:,.0f} tok/s MFU {best.mfu:.1%}"
              + ("  [GOAL MET: < 1 s]" if name == "megatron-1t" and cold < 1 else "")
              + (f"  [machine busy: load average {os.getloadavg()[0]:.1f}]" if cold > 1.5 * cpu else ""))
    model = load_model("llama3-70b")
    _clear()
    t0 = time.perf_counter()
    best = planner.best_by_gpu_count(model, load_hardware("h100-80g"), 256, global_batch=1024)
    print(f"best_by_gpu_count llama3-70b 1..256 GPUs: {len(best)} counts with a plan, "
          f"{time.perf_counter() - t0:.3f} s cold")


if __name__ == "__main__":
    main()
