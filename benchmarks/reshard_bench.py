"""Benchmark: in-place resharding vs the checkpoint path vs the network floor.

Four processes hold the full optimizer+parameter state (fp32 param, exp_avg, exp_avg_sq:
12 bytes per parameter, >= 1 GiB in all) of a model under layout A; the job goes to layout
B with workers leaving. Three ways, each verified bit for bit against the global values:

(a) **engine** (``elastic.reshard``): at the directive every old worker plans, connects a
    transient group and prepares (allocates, pre-touches) while "the last steps run"; at
    the step boundary it executes, then leavers ``fast_exit``. ``pause_seconds`` = step
    boundary -> every survivor holds its new state and every leaver process is gone (the
    launcher sees it exit); ``total_seconds`` = directive -> the same end.
(b) **checkpoint** (what elastic trainers do today): the state as DTensors on each
    stage's (dp, tp) submesh, ``torch.distributed.checkpoint.save``, processes exit
    normally, the launcher starts NEW processes for layout B (interpreter, ``import
    torch``, process group, allocation), ``dcp.load`` reshards on load. All of it is pause.
    (Optimizer moments are saved as plain DTensors next to the weights, the cheapest form
    of ``get_state_dict(model, optim)``: this favours the baseline.)
(c) **floor**: the plan's per-pair byte volumes as raw preallocated, pre-touched uint8
    buffers, exchanged once with one batch of isend/irecv, in a group built exactly like
    the engine's (same members, backend and construction).

The engine side runs ``--repeats`` times (default 7), each time with fresh processes and
its own floor (median of three exchanges) measured in the same processes just before; the
run with the median ``pause / floor`` is reported, every run is listed under
``engine_runs``. On a small shared machine a single exchange moves by tens of percent from
one repetition to the next: one pause against the best of three floors would measure the
noise, not the engine.

Writes ``{"pause_seconds", "total_seconds", "checkpoint_seconds", "floor_seconds",
"bytes_moved", "speedup_vs_checkpoint", "total_speedup_vs_checkpoint", "ratio_to_floor",
"goals", ...}`` to ``--out`` (default benchmarks/results/reshard.json).
Run: ``make bench-reshard`` (= ``python benchmarks/reshard_bench.py --json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOALS = {"speedup_vs_checkpoint": (">=", 15.0), "total_speedup_vs_checkpoint": (">=", 5.0),
         "ratio_to_floor": ("<=", 1.3)}

# 8 layers x (attention 4h^2 + swiglu 3*h*ffn) + embedding and head: 179.6M parameters,
# 2.16 GB of fp32 param + exp_avg + exp_avg_sq. tp1.pp4 -> tp1.pp2 with survivors w0, w2:
# each survivor receives its neighbour stage from a leaver, 1.08 GB moved in two pairs.
MODEL = dict(name="reshard-bench", layers=8, hidden=1280, ffn_hidden=3456, heads=10, kv_heads=10, vocab=8192,
             seq_len=256)


# --------------------------------------------------------------------------------------------
# Shared helpers (run in every role)
# --------------------------------------------------------------------------------------------


def _model() -> Any:
    from elastic.model import ModelSpec

    return ModelSpec(**MODEL)


def _fill(name: str, kind: str, box: tuple) -> Any:
    """Deterministic global values of ``(name, kind)`` restricted to ``box`` (exact in fp32)."""
    import torch

    tid = zlib.crc32(f"{name}/{kind}".encode()) % 1000
    acc = torch.full((), tid, dtype=torch.int64)
    mult = 1
    for d, (a, b) in reversed(list(enumerate(box))):
        shape = [1] * len(box)
        shape[d] = b - a
        acc = acc + torch.arange(a, b, dtype=torch.int64).view(shape) * mult
        mult = 7919 if mult == 1 else mult * 31
    return (acc % 1000003).to(torch.float32).contiguous()


def _expected_ok(state: dict, pieces: dict) -> bool:
    import torch

    if set(state) != set(pieces):
        return False
    return all(torch.equal(state[k], _fill(k[0], k[1], b)) for k, b in pieces.items())


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)  # no fsync: the launcher reads it after the process exited


def _barrier(pg: Any = None) -> None:
    import torch
    import torch.distributed as dist

    if pg is None:
        dist.barrier()
        return
    t = torch.zeros(1)
    pg.allreduce([t]).wait()


# --------------------------------------------------------------------------------------------
# (a) engine worker and (c) floor
# --------------------------------------------------------------------------------------------


def engine_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from elastic.model import Layout
    from elastic.reshard.execute import execute, fast_exit, prepare, reshard_group
    from elastic.reshard.plan import plan_reshard
    from elastic.reshard.spec import FP32_KINDS, sharding_spec

    torch.set_num_threads(1)
    model, A, B = _model(), Layout.parse(a.src), Layout.parse(a.dst)
    olds = [f"w{i}" for i in range(A.world_size)]
    p_train, p_floor, p_engine = (int(x) for x in a.port.split(","))
    me, survivors = olds[a.rank], a.survivors.split(",")
    # setup (untimed): the training group and the old state
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{p_train}", rank=a.rank, world_size=len(olds))
    old_state = {k: _fill(k[0], k[1], b) for k, b in sharding_spec(model, A, FP32_KINDS).rank_pieces(a.rank).items()}
    old_ranks = {w: i for i, w in enumerate(olds)}
    # (c) the floor, in a group built like the engine's: the plan's per-pair volumes, raw bytes
    fplan = plan_reshard(model, A, old_ranks, B, survivors)
    members = list(fplan.members)
    fpg, franks = reshard_group(members, me, "127.0.0.1", p_floor, generation=0)
    # three single exchanges; the median is the floor (see run_engine)
    floors = [_floor(fplan, me, fpg, franks) for _ in range(3)]
    del fpg
    _barrier()
    # (a) the directive: plan, connect, prepare while the last steps would still run
    t_directive = time.time()
    plan = plan_reshard(model, A, old_ranks, B, survivors)
    t_planned = time.time()
    pg, ranks = reshard_group(members, me, "127.0.0.1", p_engine, generation=1)
    t_connected = time.time()
    prepared = prepare(plan, me, old_state)
    t_prepared = time.time()
    _barrier()  # the step boundary: training stops here
    t_boundary = time.time()
    new_state = execute(prepared, pg, ranks)
    t_end = time.time()
    st = prepared.stats
    out = {"me": me, "leaver": me in plan.leavers, "t_directive": t_directive, "t_boundary": t_boundary,
           "t_end": t_end, "plan_seconds": t_planned - t_directive, "connect_seconds": t_connected - t_planned,
           "prepare_seconds": t_prepared - t_connected, "floor_runs": floors,
           "exchange_seconds": st.exchange_seconds, "free_seconds": st.free_seconds,
           "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received, "bytes_planned": plan.bytes_planned,
           "bytes_total_state": plan.bytes_total_state, "bytes_reused": st.bytes_reused,
           "bytes_recycled": st.bytes_recycled, "wire_ops": st.wire_ops}
    if me in plan.leavers:
        _write(f"{a.dir}/engine-{me}.json", out)
        fast_exit(0)
    # The bitwise check is untimed, but on 2 cores it would steal the CPU the leavers need to
    # exit (their exit is inside the pause): verify only once every leaver has written its
    # result and had time to exit.
    _wait_for_files([f"{a.dir}/engine-{w}.json" for w in plan.leavers], timeout=60)
    time.sleep(0.3)
    pieces = sharding_spec(model, B, FP32_KINDS).rank_pieces(plan.new_ranks[me])
    out["correct"] = _expected_ok(new_state, pieces)  # untimed, after t_end
    _write(f"{a.dir}/engine-{me}.json", out)
    fast_exit(0)


def _floor(plan: Any, me: str, pg: Any, ranks: dict[str, int]) -> tuple[float, float]:
    """One batch of raw isend/irecv with the plan's per-pair volumes: (start, end) wall clock.

    The launcher takes the span from the first worker's start to the last one's end, the
    same definition as the engine's pause (first step boundary to the last end).
    """
    import torch

    vol: dict[tuple[str, str], int] = {}
    for m in plan.messages:
        vol[(m.src, m.dst)] = vol.get((m.src, m.dst), 0) + m.numel * plan.bytes_per_element
    bufs = {pair: torch.zeros(n, dtype=torch.uint8) for pair, n in vol.items() if me in pair}  # pre-touched
    _barrier(pg)
    t0 = time.time()
    works = [pg.send([b], ranks[dst], 0) if src == me else pg.recv([b], ranks[src], 0)
             for (src, dst), b in sorted(bufs.items())]
    for w in works:
        w.wait()
    _barrier(pg)  # the floor ends when every pair is done, like the engine's pause
    return t0, time.time()


# --------------------------------------------------------------------------------------------
# (b) checkpoint path
# --------------------------------------------------------------------------------------------


def _dtensor_state(layout: Any, rank: int, mesh: Any, alloc: bool) -> tuple[dict, dict]:
    """The rank's pieces as DTensors on its stage's (dp, tp) submesh (filled or empty)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from elastic.reshard.spec import FP32_KINDS, box_shape, sharding_spec

    spec = sharding_spec(_model(), layout, FP32_KINDS)
    sub = mesh["dp", "tp"]
    pieces = spec.rank_pieces(rank)
    sd, local = {}, {}
    for (name, kind), box in pieces.items():
        t = spec.tensor(name)
        lt = torch.empty(box_shape(box)) if alloc else _fill(name, kind, box)
        placements = [Replicate(), Shard(t.tp_dim) if (t.tp_dim is not None and layout.tp > 1) else Replicate()]
        sd[f"{name}|{kind}"] = DTensor.from_local(lt, sub, placements, run_check=False, shape=torch.Size(t.shape),
                                                 stride=torch.empty(t.shape, device="meta").stride())
        local[(name, kind)] = lt
    return sd, local


def _mesh(layout: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    # Layout ranks are tp fastest, then dp, then pp: the row-major (pp, dp, tp) mesh.
    return init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def ckpt_save_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastic.model import Layout

    torch.set_num_threads(1)
    A = Layout.parse(a.src)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=A.world_size)
    sd, _ = _dtensor_state(A, a.rank, _mesh(A), alloc=False)
    dist.barrier()
    t0 = time.time()  # the step boundary
    dcp.save(sd, checkpoint_id=f"{a.dir}/ckpt")
    dist.barrier()
    _write(f"{a.dir}/save-{a.rank}.json", {"t0": t0, "t_saved": time.time()})
    dist.destroy_process_group()
    sys.exit(0)  # a normal exit, as torchrun's restart of the whole job does


def ckpt_load_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastic.model import Layout
    from elastic.reshard.spec import FP32_KINDS, sharding_spec

    t_imported = time.time()
    torch.set_num_threads(1)
    B = Layout.parse(a.dst)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=B.world_size)
    sd, local = _dtensor_state(B, a.rank, _mesh(B), alloc=True)
    t_allocated = time.time()
    dcp.load(sd, checkpoint_id=f"{a.dir}/ckpt")
    dist.barrier()
    t_done = time.time()
    ok = _expected_ok(local, sharding_spec(_model(), B, FP32_KINDS).rank_pieces(a.rank))
    _write(f"{a.dir}/load-{a.rank}.json", {"t_imported": t_imported, "t_allocated": t_allocated, "t_done": t_done,
                                           "correct": ok})
    dist.destroy_process_group()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, rank: int, port: int | str, a: argparse.Namespace, d: str) -> subprocess.Popen:
    # Every role (engine, floor and checkpoint alike) gets the trainer workers' memory settings
    # (huge pages for tensors and malloc's heap, elastic.train.procenv): first touch, unmap and
    # process exit cost less, on both sides of the comparison.
    from elastic.train.procenv import worker_memory_env

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), **worker_memory_env(os.environ))
    cmd = [sys.executable, __file__, "--role", role, "--rank", str(rank), "--port", str(port), "--dir", d,
           "--from", a.src, "--to", a.dst, "--survivors", a.survivors]
    return subprocess.Popen(cmd, env=env)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> dict[int, float]:
    """Reap the processes as they exit; returns pid -> exit time (wall clock)."""
    pending = {p.pid: p for p in procs}
    gone: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            for p in pending.values():
                p.kill()
            raise SystemExit(f"benchmark processes timed out after {timeout:.0f} s")
        pid, status = os.waitpid(-1, 0)
        if pid in pending:
            gone[pid] = time.time()
            p = pending.pop(pid)
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                for q in pending.values():
                    q.kill()
                raise SystemExit(f"a benchmark process exited with {p.returncode}; see its output above")
    return gone


def _wait_for_files(paths: list[str], timeout: float) -> None:
    deadline = time.time() + timeout
    while not all(Path(p).exists() for p in paths):
        if time.time() > deadline:
            raise SystemExit(f"leavers did not report within {timeout:.0f} s: {paths}")
        time.sleep(0.01)


def _read(d: str, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(d).glob(f"{prefix}-*.json"))]


def run_engine(a: argparse.Namespace, d: str) -> dict:
    from elastic.model import Layout

    n = Layout.parse(a.src).world_size
    port = ",".join(str(_free_port()) for _ in range(3))  # training group, floor group, engine group
    procs = [_spawn("engine", r, port, a, d) for r in range(n)]
    gone = _wait_all(procs, a.timeout)
    res = _read(d, "engine")
    by_me = {r["me"]: r for r in res}
    leaver_exit = [gone[procs[int(w[1:])].pid] for w, r in by_me.items() if r["leaver"]]
    end = max([r["t_end"] for r in res if not r["leaver"]] + leaver_exit)
    floors = [max(r["floor_runs"][i][1] for r in res) - min(r["floor_runs"][i][0] for r in res)
              for i in range(len(res[0]["floor_runs"]))]
    if not all(r.get("correct", True) for r in res):
        raise SystemExit("engine produced wrong state (bitwise check failed)")
    return {
        "pause_seconds": end - min(r["t_boundary"] for r in res),
        "total_seconds": end - min(r["t_directive"] for r in res),
        # each exchange spans the first worker's start to the last one's end (as the pause);
        # of the three the median (a single exchange moves by +-30 % here, and the pause it
        # is compared with is a single exchange too)
        "floor_seconds": sorted(floors)[len(floors) // 2],
        "floor_runs": floors,
        "bytes_moved": res[0]["bytes_planned"],
        "bytes_total_state": res[0]["bytes_total_state"],
        "engine_breakdown": {
            "plan_seconds": max(r["plan_seconds"] for r in res),
            "connect_seconds": max(r["connect_seconds"] for r in res),
            "prepare_seconds": max(r["prepare_seconds"] for r in res),
            "exchange_seconds": max(r["exchange_seconds"] for r in res),
            "leaver_exit_after_boundary": max(leaver_exit, default=0.0) - min(r["t_boundary"] for r in res),
            "bytes_reused": sum(r["bytes_reused"] for r in res),
            "bytes_recycled": sum(r["bytes_recycled"] for r in res),
            "wire_ops": sum(r["wire_ops"] for r in res),
            "per_worker_end_after_boundary": {
                r["me"]: round((gone[procs[int(r["me"][1:])].pid] if r["leaver"] else r["t_end"])
                               - min(x["t_boundary"] for x in res), 4) for r in res},
            "per_worker_execute_seconds": {r["me"]: round(r["t_end"] - r["t_boundary"], 4) for r in res},
            "leaver_exit_after_execute": {r["me"]: round(gone[procs[int(r["me"][1:])].pid] - r["t_end"], 4)
                                          for r in res if r["leaver"]},
            # where a slow run's time went: the workers leaving the boundary barrier apart,
            # the longest execute, the slowest leaver exit
            "boundary_skew_seconds": max(r["t_boundary"] for r in res) - min(r["t_boundary"] for r in res),
            "execute_max_seconds": max(r["t_end"] - r["t_boundary"] for r in res),
            "leaver_exit_max_seconds": max((gone[procs[int(r["me"][1:])].pid] - r["t_end"] for r in res
                                            if r["leaver"]), default=0.0),
        },
    }


def run_checkpoint(a: argparse.Namespace, d: str) -> dict:
    from elastic.model import Layout

    A, B = Layout.parse(a.src), Layout.parse(a.dst)
    port = _free_port()
    _wait_all([_spawn("ckpt-save", r, port, a, d) for r in range(A.world_size)], a.timeout)
    t_old_gone = time.time()
    port = _free_port()
    t_launch = time.time()
    _wait_all([_spawn("ckpt-load", r, port, a, d) for r in range(B.world_size)], a.timeout)
    saves, loads = _read(d, "save"), _read(d, "load")
    if not all(r["correct"] for r in loads):
        raise SystemExit("checkpoint path produced wrong state (bitwise check failed)")
    t0 = min(s["t0"] for s in saves)
    return {
        "checkpoint_seconds": max(r["t_done"] for r in loads) - t0,
        "checkpoint_breakdown": {
            "save_seconds": max(s["t_saved"] for s in saves) - t0,
            "old_exit_seconds": t_old_gone - max(s["t_saved"] for s in saves),
            "new_start_seconds": max(r["t_imported"] for r in loads) - t_launch,
            "new_group_alloc_seconds": max(r["t_allocated"] - r["t_imported"] for r in loads),
            "load_seconds": max(r["t_done"] for r in loads) - max(r["t_allocated"] for r in loads),
        },
    }


def median_run(runs: list[dict]) -> dict:
    """The engine run with the median pause/floor ratio (each run measures both side by side)."""
    ranked = sorted(runs, key=lambda r: r["pause_seconds"] / r["floor_seconds"])
    return ranked[(len(ranked) - 1) // 2]


def summarize(runs: list[dict], ck: dict) -> dict:
    eng = median_run(runs)
    out = {
        "pause_seconds": eng["pause_seconds"],
        "total_seconds": eng["total_seconds"],
        "checkpoint_seconds": ck["checkpoint_seconds"],
        "floor_seconds": eng["floor_seconds"],
        "bytes_moved": eng["bytes_moved"],
        "speedup_vs_checkpoint": ck["checkpoint_seconds"] / eng["pause_seconds"],
        "total_speedup_vs_checkpoint": ck["checkpoint_seconds"] / eng["total_seconds"],
        "ratio_to_floor": eng["pause_seconds"] / eng["floor_seconds"],
    }
    out["goals"] = {k: {"goal": f"{op} {v}", "met": (out[k] >= v if op == ">=" else out[k] <= v)}
                    for k, (op, v) in GOALS.items()}
    out["bytes_total_state"] = eng["bytes_total_state"]
    out["engine_breakdown"] = eng["engine_breakdown"]
    out["floor_runs"] = eng["floor_runs"]
    out["engine_runs"] = [{"pause_seconds": round(r["pause_seconds"], 4), "total_seconds": round(r["total_seconds"], 4),
                           "floor_seconds": round(r["floor_seconds"], 4),
                           "ratio_to_floor": round(r["pause_seconds"] / r["floor_seconds"], 3),
                           "floor_runs": [round(f, 4) for f in r["floor_runs"]],
                           **{k: round(r["engine_breakdown"][k], 4) for k in
                              ("boundary_skew_seconds", "execute_max_seconds", "leaver_exit_max_seconds")}}
                          for r in runs]
    out["checkpoint_breakdown"] = ck["checkpoint_breakdown"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reshard.json"))
    ap.add_argument("--from", dest="src", default="tp1.pp4.dp1")
    ap.add_argument("--to", dest="dst", default="tp1.pp2.dp1")
    ap.add_argument("--survivors", default="w0,w2", help="old workers that stay (comma-separated)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=7,
                    help="engine runs, each with fresh processes and its own floor; the median-ratio run is reported")
    ap.add_argument("--engine-only", action="store_true", help="skip the checkpoint path (quick look)")
    ap.add_argument("--role", choices=["engine", "ckpt-save", "ckpt-load"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {"engine": engine_worker, "ckpt-save": ckpt_save_worker, "ckpt-load": ckpt_load_worker}[a.role](a)
        return
    d = tempfile.mkdtemp(prefix="reshard-bench-")
    try:
        runs = []
        for i in range(max(1, a.repeats)):
            run_dir = Path(d) / f"engine-{i}"
            run_dir.mkdir()
            runs.append(run_engine(a, str(run_dir)))
        if a.engine_only:
            print(json.dumps({"median": median_run(runs), "runs": runs}, indent=2))
            return
        ck = run_checkpoint(a, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = summarize(runs, ck)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            if not isinstance(v, dict):
                print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
        for k, g in out["goals"].items():
            print(f"goal {k} {g['goal']}: {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
