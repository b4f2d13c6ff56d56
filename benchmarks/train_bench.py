"""Benchmark: step time of the elastic trainer at several layouts, and the pause of each in-place rescale.

For each model (``tiny`` and the ~100M-parameter ``gpt-100m``) one live job of real worker
processes (``python -m elastic.train.worker`` through the local-process launcher, gloo on
loopback, fp32 on CPU) walks a sequence of layouts with ``rescale()``. At every layout it
runs ``--steps`` steps; the step time is the median of those after the first. Each
rescale reports:

* ``pause_seconds``: training stopped -- from the moment the last old worker reached the
  step boundary to the moment the last new worker began the first step of the new layout
  (meeting, the reshard itself, tearing down and rebuilding the process groups and engine);
* ``pause_x_step``: that pause as a multiple of the new layout's step time;
* ``bytes_moved`` (sent over gloo) vs the plan's lower bound;
* the pause's breakdown: per phase, the slowest worker's seconds (``RescaleRecord.worker_stats``):
  ``prepare`` (what an old member still spent on the plan and its receive buffers at the
  boundary: the coordinator's heartbeat tells the members of a rescale the moment it is posted
  and they prepare beside the step in progress, so only what that step left undone lands in the
  pause; a joiner prepares before the old members reach the boundary and is not counted here),
  ``alloc`` (not a phase of the pause: the slowest member's whole allocate-and-zero-fill time,
  wherever it ran),
  ``meet`` (arrive -> go, of the last member to arrive), ``group`` (the reshard process group; 0 when no worker joins: the old
  default group carries the exchange), ``exchange`` (the bytes), ``close`` (old engine and
  groups), ``init_pg`` (the new default group; 0 when the ranks do not change), ``engine`` (the
  new engine and its TP/DP/PP groups);
* ``leave_seconds``: new layout running -> every leaver's process gone.

Then the job goes to two data-parallel replicas and one worker is SIGKILLed half-way through
a step: ``recovery`` reports ``pause_seconds`` (the coordinator's: from seeing the loss to the
first step begun on the remaining replica, state kept in place, no checkpoint), ``seconds``
(from the kill until that first step is done and on record, so it includes one step), the
steps redone (the one in flight, or none when the survivors had passed its commit) and the
bytes moved. Without
recovery the job would start again from step 0; restarting from a checkpoint costs 7-10 s
for 2 GB of state on these machines (REFERENCE.md) plus the steps since the checkpoint.

A rescale of a job whose state is replicated (dp >= 2, no ZeRO) is *transactional* by
default: members keep their old state whole until every member has exchanged its part, so a
worker lost mid-exchange rolls the job back instead of failing it. ``transactional`` measures
what that costs, side by side on two fresh jobs of the same model (one with
``LaunchOptions.transactional_rescale=False``): the pause of ``tp1.pp1.dp2 -> tp2.pp1.dp2``
(two joiners: the new default group is built after the commit instead of during the
exchange) and back (two leavers), and the ratio transactional / in place.

``prepare`` measures what preparing beside the step in progress buys, the same way: the same
two rescales on two fresh jobs, the members told of the directive on their heartbeat (the
default) and not (``LaunchOptions.prepare_beside_step=False``: they prepare at the switch). The
grow is posted when its joiners are up, at a random point of a step; the shrink gives its step
up at the next micro-batch, which leaves it little time to prepare beside.

The same kill once more on a job of 4 micro-batches per replica (``recovery_many``, a fresh job
with a larger global batch): there the survivor does not finish the step but gives it up at
its next micro-batch, told by the coordinator through its heartbeat; ``given_up_at`` is the
micro-batch it stopped at (from its log).

Prints a table and writes ``benchmarks/results/train.json``. Run: ``make bench-train``.
Figures on the 2-core project VMs are dominated by CPU sharing between the workers; on
real GPUs the step time shrinks far more than the pause does.
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

from elastic.model import load_model  # noqa: E402
from elastic.train.engine import TrainConfig  # noqa: E402
from elastic.train.launch import LaunchOptions, ProcessJobHandle  # noqa: E402

# model -> (global batch, layouts in the order the job walks them). Workers: w0..w{n-1}.
SCENARIOS: dict[str, tuple[int, list[str]]] = {
    "tiny": (8, ["tp1.pp1.dp1", "tp1.pp1.dp2", "tp2.pp1.dp2", "tp1.pp2.dp2", "tp2.pp2.dp1", "tp1.pp1.dp1"]),
    "gpt-100m": (2, ["tp1.pp1.dp1", "tp2.pp1.dp1", "tp1.pp2.dp1", "tp1.pp1.dp2", "tp1.pp1.dp1"]),
}


def _workers(layout: str, prev: list[str]) -> list[str]:
    """Keep the first workers of the previous layout, add fresh ids as needed (so some join, some leave)."""
    from elastic.model import Layout

    n = Layout.parse(layout).world_size
    keep = prev[:n]
    nxt = max((int(w[1:]) for w in prev), default=-1) + 1
    while len(keep) < n:
        keep.append(f"w{nxt}")
        nxt += 1
    return keep


def _steps_of(h: ProcessJobHandle, generation: int) -> list[float]:
    return [r.seconds for r in h.history() if r.generation == generation]


PHASES = ("prepare", "meet", "group", "exchange", "commit", "close", "init_pg", "engine", "alloc")
_KEYS = {"prepare": "prepare_wait_seconds", "alloc": "prepare_seconds"}  # else f"{phase}_seconds"


def _phases(worker_stats: dict[str, dict[str, Any]], joiners: list[str] | tuple[str, ...] = ()) -> dict[str, float]:
    """Per phase of the transition, the slowest worker's seconds; for ``meet`` the fastest one's
    (the last member to arrive waits least: its meet is the decision latency, the others' include
    waiting for it -- a joiner arrives long before the old members reach the boundary); for
    ``prepare`` the slowest old member's (a joiner prepares before the boundary)."""
    def pick(p: str) -> float:
        vals = [float(s.get(_KEYS.get(p, f"{p}_seconds"), 0.0)) for w, s in worker_stats.items()
                if not (p == "prepare" and w in joiners)]
        return (min if p == "meet" else max)(vals, default=0.0)

    return {p: pick(p) for p in PHASES}


def run_model(name: str, steps: int, timeout: float) -> dict[str, Any]:
    global_batch, layouts = SCENARIOS[name]
    cfg = TrainConfig(model=load_model(name), global_batch=global_batch, micro_batch=1)
    opts = LaunchOptions(pg_timeout_s=600, heartbeat_timeout_s=120, join_timeout_s=600, rescale_timeout_s=timeout)
    logs = tempfile.mkdtemp(prefix=f"train-bench-{name}-")
    h = ProcessJobHandle(f"bench-{name}", cfg, options=opts, log_dir=logs)
    rows: list[dict[str, Any]] = []
    rescales: list[dict[str, Any]] = []
    workers: list[str] = []
    try:
        for i, layout in enumerate(layouts):
            workers = _workers(layout, workers)
            if i == 0:
                res = h.start(layout, workers, timeout=timeout)
            else:
                res = h.rescale(layout, workers, remap=True, timeout=timeout)
            h.wait_step(res.switch_step + steps - 1, timeout=timeout)
            secs = _steps_of(h, res.generation)
            step_s = statistics.median(secs[1:steps] or secs)
            rows.append({"model": name, "layout": layout, "workers": len(workers), "step_seconds": step_s,
                         "tokens_per_second": global_batch * cfg.model.seq_len / step_s})
            if i > 0:
                rescales.append({
                    "model": name, "from": str(res.from_layout), "to": layout, "pause_seconds": res.pause_seconds,
                    "pause_x_step": (res.pause_seconds or 0.0) / step_s, "bytes_moved": res.bytes_moved,
                    "planned_bytes": res.planned_bytes, "lower_bound_bytes": res.lower_bound_bytes,
                    "joiners": len(res.record.joiners), "leavers": len(res.record.leavers),
                    "wall_seconds": res.wall_seconds, "leave_seconds": res.leave_seconds,
                    "phases": _phases(res.record.worker_stats, res.record.joiners),
                })
        recovery = _recover(h, workers, steps, timeout)
    finally:
        st = h.stop()
    if st.error:
        raise SystemExit(f"{name}: job failed: {st.error} (worker logs in {logs})")
    return {"params": cfg.model.total_params(), "global_batch": global_batch, "seq_len": cfg.model.seq_len,
            "layouts": rows, "rescales": rescales, "recovery": recovery,
            "recovery_many": _recover_many(name, MANY_MICRO_BATCHES, timeout),
            "transactional": _transactional_cost(name, min(steps, 3), timeout),
            "prepare": _prepare_gain(name, min(steps, 3), timeout)}


TXN_WALK = (("tp1.pp1.dp2", ["w0", "w1"]), ("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"]), ("tp1.pp1.dp2", ["w0", "w1"]))


def _transactional_cost(name: str, steps: int, timeout: float) -> dict[str, Any]:
    """The same two rescales on two fresh jobs, transactional (the default) and in place."""
    return _side_by_side(name, steps, timeout, "transactional_rescale", "transactional", "in_place")


def _prepare_gain(name: str, steps: int, timeout: float) -> dict[str, Any]:
    """The same two rescales on two fresh jobs, the members preparing beside the step in progress
    (told on their heartbeat: the default) and at the switch."""
    return _side_by_side(name, steps, timeout, "prepare_beside_step", "beside", "at_switch")


def _side_by_side(name: str, steps: int, timeout: float, knob: str, on: str, off: str) -> dict[str, Any]:
    """``TXN_WALK`` on two fresh jobs of ``name``, ``LaunchOptions.<knob>`` True (rows under ``on``)
    and False (``off``); ``ratio_to_<off>`` on each ``on`` row: its pause over the other's."""
    global_batch, _ = SCENARIOS[name]
    cfg = TrainConfig(model=load_model(name), global_batch=global_batch, micro_batch=1)
    out: dict[str, Any] = {}
    for flag in (True, False):
        opts = LaunchOptions(pg_timeout_s=600, heartbeat_timeout_s=120, join_timeout_s=600, rescale_timeout_s=timeout,
                             **{knob: flag})
        tag = f"{knob.split('_')[0]}{int(flag)}"
        logs = tempfile.mkdtemp(prefix=f"train-bench-{name}-{tag}-")
        h = ProcessJobHandle(f"bench-{name}-{tag}", cfg, options=opts, log_dir=logs)
        rows = []
        try:
            for i, (layout, workers) in enumerate(TXN_WALK):
                res = (h.start(layout, workers, timeout=timeout) if i == 0
                       else h.rescale(layout, workers, remap=True, timeout=timeout))
                h.wait_step(res.switch_step + steps - 1, timeout=timeout)
                if i > 0:
                    rows.append({"from": str(res.from_layout), "to": layout, "pause_seconds": res.pause_seconds,
                                 "phases": _phases(res.record.worker_stats, res.record.joiners)})
        finally:
            st = h.stop()
        if st.error:
            raise SystemExit(f"{name}: job failed: {st.error} (worker logs in {logs})")
        out[on if flag else off] = rows
    for a, b in zip(out[on], out[off], strict=True):
        a[f"ratio_to_{off}"] = (a["pause_seconds"] or 0.0) / max(b["pause_seconds"] or 0.0, 1e-9)
    return out


MANY_MICRO_BATCHES = 4  # per replica at dp2, for the second kill


def _recover_many(name: str, micro: int, timeout: float) -> dict[str, Any]:
    """A fresh job of ``micro`` micro-batches per replica on ``tp1.pp1.dp2``; kill one worker half-way
    through a step. Reports what ``_recover`` does, plus the micro-batch the survivor gave up at."""
    import re

    cfg = TrainConfig(model=load_model(name), global_batch=2 * micro, micro_batch=1)
    opts = LaunchOptions(pg_timeout_s=600, heartbeat_timeout_s=120, join_timeout_s=600, rescale_timeout_s=timeout)
    logs = tempfile.mkdtemp(prefix=f"train-bench-{name}-many-")
    h = ProcessJobHandle(f"bench-{name}-many", cfg, options=opts, log_dir=logs)
    try:
        h.start("tp1.pp1.dp1", ["w0"], timeout=timeout)
        h.wait_step(0, timeout=timeout)
        out = _recover(h, ["w0"], 3, timeout, at=1.5 / micro)  # inside the second micro-batch
    finally:
        st = h.stop()
    if st.error:
        raise SystemExit(f"{name}: job failed: {st.error} (worker logs in {logs})")
    text = Path(logs, "w0.log").read_text(errors="replace")
    m = re.search(r"given up at micro-batch (\d+) of (\d+)", text)
    out["micro_batches"] = micro
    out["given_up_at"] = int(m.group(1)) if m else None  # None: it finished the step (killed late in it)
    return out


def _recover(h: ProcessJobHandle, workers: list[str], steps: int, timeout: float, *,
             at: float = 0.5) -> dict[str, Any]:
    """Two replicas, then SIGKILL one worker at fraction ``at`` of a step; time until training resumes."""
    import signal

    layout = "tp1.pp1.dp2"
    workers = _workers(layout, workers)
    res = h.rescale(layout, workers, remap=True, timeout=timeout)
    h.wait_step(res.switch_step + steps - 1, timeout=timeout)
    step_s = statistics.median(_steps_of(h, res.generation)[1:] or [1.0])
    # a step is on record when the workers ask to begin the next one: wait for one, so that the
    # kill lands at a known point of the step that follows
    last = h.wait_step(h.history()[-1].step + 1, timeout=timeout).step
    time.sleep(step_s * at)
    victim = workers[-1]
    t0 = time.perf_counter()
    os.kill(h.pid(victim), signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        st = h.status()
        if st.phase == "running" and st.generation > res.generation:
            break
        if st.phase not in ("running", "recovering") or time.monotonic() > deadline:
            raise SystemExit(f"recovery from the loss of {victim} did not happen: {st.phase} {st.error or st.reason}")
        time.sleep(0.005)
    seconds = time.perf_counter() - t0
    rec = h.coordinator.rescale_record(st.generation)
    assert rec is not None
    h.wait_step(rec.switch_step + 1, timeout=timeout)
    # seconds: from the kill until the first step on the new layout is on record (it includes that
    # step); pause_seconds: the coordinator's, from seeing the loss to that step begun
    return {"from": layout, "to": str(st.layout), "victim": victim, "seconds": seconds,
            "pause_seconds": rec.pause_seconds, "bytes_moved": rec.bytes_moved,
            # killed inside step last + 1: redone unless the survivors had passed its commit
            "steps_redone": max(0, last + 2 - rec.switch_step),
            "resumed_at_step": rec.switch_step, "last_step_before_kill": last, "step_seconds": step_s}


def _print(results: dict[str, Any]) -> None:
    for name, r in results.items():
        print(f"\n{name}: {r['params'] / 1e6:.1f}M params, global batch {r['global_batch']} x {r['seq_len']} tokens")
        print(f"  {'layout':<14}{'workers':>8}{'step s':>10}{'tokens/s':>11}")
        for row in r["layouts"]:
            print(f"  {row['layout']:<14}{row['workers']:>8}{row['step_seconds']:>10.3f}{row['tokens_per_second']:>11.0f}")
        print(f"  {'rescale':<28}{'pause s':>9}{'x step':>8}{'moved MB':>10}{'bound MB':>10}{'join/leave':>11}")
        for x in r["rescales"]:
            print(f"  {x['from'] + ' -> ' + x['to']:<28}{x['pause_seconds']:>9.3f}{x['pause_x_step']:>8.2f}"
                  f"{x['bytes_moved'] / 1e6:>10.1f}{x['lower_bound_bytes'] / 1e6:>10.1f}"
                  f"{str(x['joiners']) + '/' + str(x['leavers']):>11}")
        print(f"  {'pause breakdown, ms':<28}" + "".join(f"{p:>9}" for p in PHASES) + f"{'leave':>9}")
        for x in r["rescales"]:
            print(f"  {x['from'] + ' -> ' + x['to']:<28}" + "".join(f"{x['phases'][p] * 1e3:>9.1f}" for p in PHASES)
                  + f"{x['leave_seconds'] * 1e3:>9.1f}")
        v = r["recovery"]
        print(f"  {'worker killed mid-step':<28}{'to step s':>10}{'x step':>8}{'kill->done s':>13}"
              f"{'moved MB':>10}{'resumed at':>12}{'redone':>8}")
        for label, v in (("tp1.pp1.dp2 -> tp1.pp1.dp1", r["recovery"]),
                         (f"same, {MANY_MICRO_BATCHES} micro-batches", r.get("recovery_many"))):
            if not v:
                continue
            note = ""
            if "given_up_at" in v:
                note = ("  survivor finished its step" if v["given_up_at"] is None else
                        f"  survivor gave its step up at micro-batch {v['given_up_at']} of {v['micro_batches']}")
            pause = v["pause_seconds"] or 0.0
            print(f"  {label:<28}{pause:>10.3f}{pause / v['step_seconds']:>8.2f}{v['seconds']:>13.3f}"
                  f"{v['bytes_moved'] / 1e6:>10.1f}{'step ' + str(v['resumed_at_step']):>12}{v['steps_redone']:>8}{note}")
        _print_txn(r)


def _print_txn(r: dict[str, Any]) -> None:
    for key, on, off, title, a_col, b_col in (
            ("transactional", "transactional", "in_place", "transactional vs in place", "txn s", "in place"),
            ("prepare", "beside", "at_switch", "prepared beside the step", "beside", "at switch")):
        t = r.get(key)
        if not t:
            continue
        print(f"  {title:<28}{a_col:>9}{b_col:>10}{'ratio':>8}   phases ms ({a_col} / {b_col}): " + " ".join(PHASES))
        for a, b in zip(t[on], t[off], strict=True):
            print(f"  {a['from'] + ' -> ' + a['to']:<28}{a['pause_seconds']:>9.3f}{b['pause_seconds']:>10.3f}"
                  f"{a[f'ratio_to_{off}']:>8.2f}   " + " ".join(f"{a['phases'][p] * 1e3:.0f}" for p in PHASES)
                  + " / " + " ".join(f"{b['phases'][p] * 1e3:.0f}" for p in PHASES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,gpt-100m", help="comma-separated: " + ", ".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=0, help="steps per layout (default: 6 tiny, 3 gpt-100m)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per start/rescale/step wait")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train.json"))
    a = ap.parse_args(argv)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        if name not in SCENARIOS:
            print(f"unknown model '{name}': use {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2
        results[name] = run_model(name, a.steps or (6 if name == "tiny" else 3), a.timeout)
    _print(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "cpus": os.cpu_count(),
                               "seconds": time.perf_counter() - t0}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
