"""Benchmark: how soon a shrink gives its GPUs back, with and without waiting for the new layout's first step.

A live job of real worker processes (``ProcessJobHandle``, gloo on loopback), the ``tiny`` model
with the demo's batch (global batch 420, per-layout micro-batches) so a step takes about what it
takes in the demo. Alternately, on the same job, ``--rounds`` times: shrink ``tp1.pp1.dp3`` ->
``dp2`` with ``wait_first_step=True`` (the call returns after the new layout's first step) and
``False`` (what the backends ask for: it returns once the new layout has begun that step and the
leaver is gone), each timed from the call to its return -- the decision to the GPU being free --
and grown back to ``dp3`` untimed between them. The first step after a shrink is what the early
return saves, so the ratio grows with the step length.

Prints medians, the step length and ``wait / early``; writes ``benchmarks/results/shrink.json``.
Goal: the early return is faster. Run: ``make bench`` or ``.venv/bin/python benchmarks/shrink_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)

    from elastic.config import load_config
    from elastic.demo import _trainer_config, demo_config
    from elastic.train.launch import LaunchOptions, ProcessJobHandle

    cfg = _trainer_config(load_config(data=demo_config(5.0, 2.0)).jobs[0])  # the demo's job, as the demo runs it
    opts = LaunchOptions(pg_timeout_s=300, heartbeat_timeout_s=60, join_timeout_s=300, rescale_timeout_s=300)
    logs = tempfile.mkdtemp(prefix="shrink-bench-")
    h = ProcessJobHandle("shrink-bench", cfg, options=opts, log_dir=logs)
    out: dict[str, list[float]] = {"wait_first_step": [], "early": []}
    n = 3
    workers = ["w0", "w1", "w2"]
    try:
        h.start("tp1.pp1.dp3", workers, timeout=300)
        h.wait_step(2, timeout=300)
        for _ in range(a.rounds):
            for kind in ("wait_first_step", "early"):
                t0 = time.perf_counter()
                h.rescale("tp1.pp1.dp2", workers[:2], timeout=300, wait_first_step=kind == "wait_first_step")
                out[kind].append(time.perf_counter() - t0)
                workers = [*workers[:2], f"w{n}"]  # a new joiner each time: a name is never reused
                n += 1
                h.rescale("tp1.pp1.dp3", workers, timeout=300)
                h.wait_step(h.status().step + 2, timeout=300)
        step_s = statistics.median(r.seconds for r in h.history()[1:] if r.layout == "tp1.pp1.dp2")
    finally:
        st = h.stop()
    if st.error:
        print(f"!! job failed: {st.error} (worker logs in {logs})", file=sys.stderr)
        return 1
    w, e = statistics.median(out["wait_first_step"]), statistics.median(out["early"])
    print(f"shrink dp3 -> dp2, call to return (medians of {a.rounds}): wait for the first step {w:.2f} s, "
          f"early {e:.2f} s, wait / early {w / e:.2f}; a dp2 step {step_s:.2f} s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shrink.json").write_text(json.dumps({**out, "wait_median": w, "early_median": e, "ratio": w / e,
                                                     "dp2_step_seconds": step_s}, indent=2))
    if not w > e:
        print("!! the early return was not faster", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
