"""Benchmark: what a periodic checkpoint costs a step, and what a start from one costs, side by side.

One process, gloo world of one, fp32 on CPU, the ~100M-parameter ``gpt-100m`` (and ``tiny``), with
the memory settings training workers get (``elastic/train/procenv.py``: huge pages):

* ``step_s``: the median seconds of a training step (``TrainEngine`` at ``tp1.pp1.dp1``);
* ``snapshot_s``: the part of a checkpoint the step loop waits for (the agent copies the
  pieces its rank owns into host buffers it keeps from one checkpoint to the next; the write
  runs in a background thread) and ``snapshot / step``, the fraction of one step it costs
  (paid once every ``every_steps`` steps); ``first_snapshot_s``: the first one, which also
  allocates those buffers, next to ``prepared_first_snapshot_s``, the first one into buffers the
  agent prepared in the background after the start or rescale (``prepare_s``, off the step);
* ``write_s`` and ``MB/s``: the background write of that rank file (temporary name, fsync,
  rename) into a temporary directory on this machine's disk;
* ``load_same_s`` / ``load_tp2_s``: reading a rank's state back on the saved layout, and rank
  0 of ``tp2.pp1.dp1`` out of it (boxes by intersection, memory-mapped): the state part of a
  start from a checkpoint, next to the in-place rescale pauses ``make bench-train`` reports.

Prints a table and writes ``benchmarks/results/checkpoint.json``. Run: ``make bench``
(all benchmarks) or ``.venv/bin/python benchmarks/checkpoint_bench.py``.
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
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic.model import Layout, load_model  # noqa: E402
from elastic.reshard.spec import sharding_spec  # noqa: E402
from elastic.train import checkpoint as ck  # noqa: E402
from elastic.train.engine import TrainConfig, TrainEngine  # noqa: E402

GOAL_SNAPSHOT_X_STEP = 0.5
"""A checkpoint's synchronous part must cost under half a step (it is paid once per ``every_steps``)."""


def run_model(name: str, steps: int, repeats: int) -> dict[str, Any]:
    cfg = TrainConfig(model=load_model(name), global_batch=2, micro_batch=1)
    layout = Layout.parse("tp1.pp1.dp1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eng = TrainEngine(cfg, layout, 0)
        secs = []
        for s in range(steps):
            secs.append(eng.train_step(s).seconds)
        step_s = statistics.median(secs[1:] or secs)
        spec = sharding_spec(cfg.model, layout, cfg.kinds)
        # after a start or a rescale the agent prepares the buffers in the background (prepare_s, off the
        # step); the first snapshot then fills them (prepared_snapshot_s). Without: it allocates them
        # itself (first_s). Side by side; the prepared ones stay alive so the second cannot reuse their pages.
        t0 = time.perf_counter()
        prepared = ck.host_buffers(ck.buffer_shapes(spec, 0, eng.state()))
        prepare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ck.snapshot(spec, 0, eng.state(), into=prepared)
        prepared_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pieces = ck.snapshot(spec, 0, eng.state())  # the first one allocates its host buffers
        first_s = time.perf_counter() - t0
        del prepared
        snaps = []
        for _ in range(repeats):  # every later one refills them
            t0 = time.perf_counter()
            pieces = ck.snapshot(spec, 0, eng.state(), into=pieces)
            snaps.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in pieces.values())
        with tempfile.TemporaryDirectory(prefix=f"ckpt-bench-{name}-") as root:
            t0 = time.perf_counter()
            ck.write_rank(root, steps, spec, 0, pieces, job=name)
            write_s = time.perf_counter() - t0
            ref = ck.latest(root)
            assert ref is not None
            dtypes = {k: cfg.kind_dtype(k) for k in cfg.kinds}
            t0 = time.perf_counter()
            same = ck.load_rank(ref, cfg.model, layout, 0, dtypes)
            load_same_s = time.perf_counter() - t0
            live = eng.state()
            assert all(torch.equal(same[k], live[k]) for k in live), "the checkpoint does not read back as saved"
            t0 = time.perf_counter()
            ck.load_rank(ref, cfg.model, Layout.parse("tp2.pp1.dp1"), 0, dtypes)
            load_tp2_s = time.perf_counter() - t0
        eng.close()
    finally:
        dist.destroy_process_group()
    snapshot_s = statistics.median(snaps)
    return {"bytes": nbytes, "step_s": step_s, "first_snapshot_s": first_s, "prepare_s": prepare_s,
            "prepared_first_snapshot_s": prepared_s, "snapshot_s": snapshot_s,
            "snapshot_x_step": snapshot_s / step_s,
            "write_s": write_s, "write_MBps": nbytes / write_s / 1e6, "load_same_s": load_same_s,
            "load_tp2_s": load_tp2_s}


def main(argv: list[str] | None = None) -> int:
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:  # the memory settings workers run with (read at start)
        from elastic.train.procenv import worker_memory_env

        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **worker_memory_env(os.environ)})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,gpt-100m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    results = {m: run_model(m, a.steps, a.repeats) for m in a.models.split(",") if m}
    print(f"{'model':<10}{'MB':>8}{'step s':>9}{'1st snap s':>11}{'prep s':>8}{'1st prepared':>13}"
          f"{'snapshot s':>12}{'snap/step':>11}{'write s':>9}{'MB/s':>8}{'load s':>8}{'load tp2 s':>11}")
    ok = True
    for m, r in results.items():
        print(f"{m:<10}{r['bytes'] / 1e6:>8.1f}{r['step_s']:>9.3f}{r['first_snapshot_s']:>11.3f}"
              f"{r['prepare_s']:>8.3f}{r['prepared_first_snapshot_s']:>13.3f}{r['snapshot_s']:>12.4f}{r['snapshot_x_step']:>11.3f}"
              f"{r['write_s']:>9.3f}{r['write_MBps']:>8.0f}{r['load_same_s']:>8.3f}{r['load_tp2_s']:>11.3f}")
        ok &= r["snapshot_x_step"] < GOAL_SNAPSHOT_X_STEP
    print(f"goal: snapshot / step < {GOAL_SNAPSHOT_X_STEP} on every model: {'met' if ok else 'MISSED'}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
