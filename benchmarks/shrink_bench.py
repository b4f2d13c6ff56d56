"""Benchmark: how soon a shrink gives its GPUs back: waiting for the step in progress and the new
layout's first step, or not.

A live job of real worker processes (``ProcessJobHandle``, gloo on loopback), the ``tiny`` model
as the demo trains it (per-layout micro-batches of at most 36 samples) with ``--batch-scale`` times
its global batch of 420: alone on the machine a step then takes about what the demo's take with
six replicas and the load generator on the same cores (1.5-6 s at its peak on a 2-core VM). Alternately, on the same job, ``--rounds`` times, a shrink ``tp1.pp1.dp3`` ->
``dp2`` posted at a random point of a step, three ways:

* ``wait_first_step``: the step in progress is finished and the call returns after the new
  layout's first step (``wait_first_step=True, give_up_step=False``);
* ``finish_step``: the step in progress is finished, the call returns once the new layout has
  begun its first step and the leaver is gone (``wait_first_step=False, give_up_step=False``);
* ``give_up``: as ``finish_step``, but the members give the step in progress up at their next
  micro-batch (``give_up_step=True``; what the backends get by default), keeping the work of the
  micro-batches done, and the new layout finishes the step from it (computing only the rest).

Each is timed from the call to its return (the decision to the GPU being free) and grown back to
``dp3`` untimed between them. Prints medians, the step length, ``wait_first_step / finish_step``
and ``finish_step / give_up``, and for ``give_up`` the micro-batches kept, the work thrown away and
how long the finished step took against a whole dp2 step; writes ``benchmarks/results/shrink.json``. Goal: each is faster than
the one before. Run: ``make bench`` or ``.venv/bin/python benchmarks/shrink_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-scale", type=int, default=8, help="global batch = 420 x this (default 8)")
    a = p.parse_args(argv)

    from elastic.config import load_config
    from elastic.demo import _trainer_config, demo_config
    from elastic.train.launch import LaunchOptions, ProcessJobHandle

    spec = load_config(data=demo_config(5.0, 2.0)).jobs[0]  # the demo's job, as the demo runs it
    cfg = replace(_trainer_config(spec), global_batch=spec.global_batch * a.batch_scale)
    opts = LaunchOptions(pg_timeout_s=300, heartbeat_timeout_s=60, join_timeout_s=300, rescale_timeout_s=300)
    logs = tempfile.mkdtemp(prefix="shrink-bench-")
    h = ProcessJobHandle("shrink-bench", cfg, options=opts, log_dir=logs)
    kinds = ("wait_first_step", "finish_step", "give_up")
    out: dict[str, list[float]] = {k: [] for k in kinds}
    lost: list[float] = []  # give_up: the part of the step given up (the record's gave_up_seconds)
    kept: list[int] = []  # give_up: of it, the micro-batches per replica whose work the new layout kept
    finished_at: list[int] = []  # give_up: the step the new layout finished from the kept work
    rng = random.Random(0)
    n = 3
    workers = ["w0", "w1", "w2"]
    try:
        h.start("tp1.pp1.dp3", workers, timeout=300)
        h.wait_step(2, timeout=300)
        dp3_step = statistics.median(r.seconds for r in h.history()[1:])
        for _ in range(a.rounds):
            for kind in kinds:
                h.wait_step(h.status().step + 1, timeout=300)  # a step just begun: post somewhere inside it
                time.sleep(rng.uniform(0.0, 0.8) * dp3_step)
                t0 = time.perf_counter()
                res = h.rescale("tp1.pp1.dp2", workers[:2], timeout=300, wait_first_step=kind == "wait_first_step",
                                give_up_step=kind == "give_up")  # the engines check either way
                out[kind].append(time.perf_counter() - t0)
                if kind == "give_up":
                    lost.append(res.record.gave_up_seconds)
                    kept.append(res.record.kept_micro_batches)
                    finished_at.append(res.switch_step)
                workers = [*workers[:2], f"w{n}"]  # a new joiner each time: a name is never reused
                n += 1
                h.rescale("tp1.pp1.dp3", workers, timeout=300)
                h.wait_step(h.status().step + 2, timeout=300)
        hist = h.history()
        dp2 = _layout("tp1.pp1.dp2")
        step_s = statistics.median(r.seconds for r in hist[1:] if r.layout == dp2 and r.step not in finished_at)
        finished_s = [r.seconds for r in hist if r.step in finished_at and r.layout == dp2]
    finally:
        st = h.stop()
    if st.error:
        print(f"!! job failed: {st.error} (worker logs in {logs})", file=sys.stderr)
        return 1
    w, f, g = (statistics.median(out[k]) for k in kinds)
    print(f"shrink dp3 -> dp2 posted inside a step, call to return (medians of {a.rounds}): wait for the first "
          f"step {w:.2f} s, finish the step in progress {f:.2f} s, give it up {g:.2f} s; wait / finish {w / f:.2f}, "
          f"finish / give up {f / g:.2f}; work given up {statistics.median(lost):.2f} s of a {dp3_step:.2f} s "
          f"dp3 step; a dp2 step {step_s:.2f} s")
    thrown = [0.0 if k else s for k, s in zip(kept, lost, strict=True)]
    print(f"give up: micro-batches kept {kept} (of {cfg.grad_accum(_layout('tp1.pp1.dp3'))} a replica), work thrown "
          f"away {sum(thrown):.2f} s in all; the steps finished from the kept work took "
          f"{', '.join(f'{x:.2f}' for x in finished_s)} s against {step_s:.2f} s for a whole dp2 step")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shrink.json").write_text(json.dumps({**out, "wait_median": w, "finish_median": f, "give_up_median": g,
                                                     "wait_over_finish": w / f, "finish_over_give_up": f / g,
                                                     "gave_up_seconds": lost, "dp3_step_seconds": dp3_step,
                                                     "dp2_step_seconds": step_s, "kept_micro_batches": kept,
                                                     "thrown_away_seconds": thrown,
                                                     "finished_step_seconds": finished_s}, indent=2))
    if not w > f > g:
        print("!! not each faster than the one before", file=sys.stderr)
        return 1
    return 0


def _layout(text: str):  # noqa: ANN202 - elastic.model imports torch: only once main() runs
    from elastic.model import Layout

    return Layout.parse(text)


if __name__ == "__main__":
    sys.exit(main())
