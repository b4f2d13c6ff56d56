"""Planning speed of the reshard planner on production-sized models (goal: under 2 s each).

Prints, per case, the wall and CPU seconds of ``plan_reshard`` (the decisions: rank map, byte
counts, every message's sender, region and round, in compact form) and, separately, of building
all Message/LocalCopy/NewShard objects (lazy in the plan; an executor only needs its own).
On a shared machine wall time includes waiting for a core: the CPU seconds are the planner's cost.

    .venv/bin/python benchmarks/reshard_plan_bench.py [--json]
"""

from __future__ import annotations

import json
import sys
import time

from elastic.model import MODEL_PRESETS, Layout
from elastic.reshard.plan import estimate_reshard_bytes, plan_reshard

CASES = [
    ("gpt3-175b", "tp8.pp16.dp16", "tp8.pp8.dp24"),
    ("deepseek-v3", "tp1.pp16.dp128.ep64.z1", "tp1.pp16.dp96.ep32.z1"),
]
GOAL_SECONDS = 2.0


def run_case(model_name: str, old: str, new: str) -> dict:
    m = MODEL_PRESETS[model_name]
    A, B = Layout.parse(old), Layout.parse(new)
    ws = [f"w{i}" for i in range(A.world_size)]
    s = min(A.world_size, B.world_size)
    new_workers = ws[:s] + [f"w{A.world_size + i}" for i in range(B.world_size - s)]
    old_ranks = {w: i for i, w in enumerate(ws)}
    w0, c0 = time.perf_counter(), time.process_time()
    plan = plan_reshard(m, A, old_ranks, B, new_workers)
    w1, c1 = time.perf_counter(), time.process_time()
    n_objects = sum(1 for _ in plan.messages) + sum(1 for _ in plan.local_copies) + sum(1 for _ in plan.new_shards)
    w2, c2 = time.perf_counter(), time.process_time()
    estimate = estimate_reshard_bytes(m, A, B)
    w3, c3 = time.perf_counter(), time.process_time()
    return {
        "case": f"{model_name} {old} -> {new}",
        "plan_seconds": round(w1 - w0, 3),
        "plan_cpu_seconds": round(c1 - c0, 3),
        "materialize_seconds": round(w2 - w1, 3),
        "materialize_cpu_seconds": round(c2 - c1, 3),
        "estimate_seconds": round(w3 - w2, 3),
        "estimate_cpu_seconds": round(c3 - c2, 3),
        "objects": n_objects,
        "messages": len(plan.messages),
        "local_copies": len(plan.local_copies),
        "new_shards": len(plan.new_shards),
        "rounds": plan.rounds,
        "bytes_needed": plan.bytes_needed,
        "bytes_lower_bound": plan.bytes_lower_bound,
        "bytes_lower_bound_without_remap": plan.bytes_lower_bound_without_remap,
        "bytes_planned": plan.bytes_planned,
        "estimate_bytes": estimate,
        "max_send_bytes": plan.max_send_bytes,
        "max_recv_bytes": plan.max_recv_bytes,
        "meets_goal": (c1 - c0) < GOAL_SECONDS,
    }


def main() -> None:
    results = [run_case(*c) for c in CASES]
    if "--json" in sys.argv:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        print(f"{r['case']}: plan {r['plan_seconds']:.2f} s wall / {r['plan_cpu_seconds']:.2f} s CPU "
              f"(goal < {GOAL_SECONDS} s: {'ok' if r['meets_goal'] else 'MISSED'}); "
              f"materialize {r['objects']:,} objects {r['materialize_cpu_seconds']:.2f} s CPU; "
              f"estimate {r['estimate_cpu_seconds']:.2f} s CPU")
        print(f"    messages {r['messages']:,}  local copies {r['local_copies']:,}  new shards {r['new_shards']:,}  "
              f"rounds {r['rounds']}")
        print(f"    lower bound {r['bytes_lower_bound'] / 1e9:,.1f} GB (no remap {r['bytes_lower_bound_without_remap'] / 1e9:,.1f} GB)"
              f"  planned {r['bytes_planned'] / 1e9:,.1f} GB  max send {r['max_send_bytes'] / 1e9:.2f} GB "
              f"max recv {r['max_recv_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
