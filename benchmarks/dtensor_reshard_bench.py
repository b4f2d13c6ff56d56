"""Benchmark: ``elastic.torch.reshard`` in place vs today's checkpoint restart, FSDP2 x TP Llama.

Four processes train the example Llama (``LlamaConfig.bench_1g()``: fp32 parameters plus
AdamW's two moments, just over 1 GiB) under FSDP2 x TP2 on a (2, 2) ``("dp_shard", "tp")``
mesh for one real step (the moments are non-zero), then two of them leave: the job goes on as
TP2 on the other two, a (1, 2) mesh whose order :func:`elastic.torch.mesh_order` chooses.
From the same step boundary, three ways:

(a) **in place** (``elastic.torch.reshard``): before the boundary every worker builds the new
    mesh and the survivors the new model and optimizer (``training_state(...,
    init_optimizer=True)``; it can overlap the last steps: ``prepare_seconds``). At the boundary
    (a barrier) one collective ``reshard(src, dst)`` over the world (leavers pass ``dst=None``)
    moves the state straight into the new shards. ``pause_seconds`` = the boundary -> every
    survivor holds its new state.
(b) **checkpoint to disk** (what elastic trainers do today): ``get_state_dict`` +
    ``torch.distributed.checkpoint.save`` into a folder on a real disk (DCP's default
    ``fsync``), the four processes destroy their group and exit, the launcher starts two NEW
    processes (interpreter, ``import torch``, process group, model on the new mesh, optimizer),
    ``dcp.load`` + ``set_state_dict``. ``checkpoint_seconds`` = the boundary -> both hold it.
(c) **checkpoint through ``/dev/shm``**: the same, the folder in memory
    (``checkpoint_shm_seconds``).

Every result is checked: a hash of the bytes of every key's full tensor (parameters, both
moments, ``step``) after (a), (b) and (c) must equal the old state's, or the benchmark fails.

The survivors default to ranks 0 and 1 (one node of two leaves). The world group stays, so
the new mesh is ``DeviceMesh`` over ``mesh_order``'s answer, which torch honours only when it
increases (each mesh dim's group is sorted, and the data follows it; ``mesh_order``'s order is
a renumbering for a new world). For survivors 1 and 2 it answers ``[2, 1]`` (rank 2 holds the
first TP half), the mesh runs as ``[1, 2]`` and every byte moves;
``inplace_plan.order_ascending`` says which case a run was.

Each repeat starts four fresh processes per checkpoint path; each of those sets also runs
(a) once before its save (the new model is dropped first), so the in-place and the checkpoint
runs alternate side by side on the same busy machine. Medians are reported, every run listed.

Writes ``{"pause_seconds", "checkpoint_seconds", "checkpoint_shm_seconds", "bytes_moved",
"bytes_lower_bound", "speedup_vs_checkpoint", "goals", ...}`` to ``--out`` (default
``benchmarks/results/dtensor_reshard.json``); exits non-zero when a goal is missed.
Run: ``python benchmarks/dtensor_reshard_bench.py --json`` (``--small`` for a quick smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL_SPEEDUP = 15.0
DIMS = ("dp_shard", "tp")
OLD_SHAPE = (2, 2)  # FSDP2 x TP2 on 4 processes
NEW_SHAPE = (1, 2)  # TP2 on the 2 survivors
SEED = 5
LR = 1e-3
BATCH = 2  # rows of the one training step's global batch, one per FSDP rank
SEQ = 64


# --------------------------------------------------------------------------------------------
# Shared helpers (run in the workers)
# --------------------------------------------------------------------------------------------


def _config(small: bool) -> Any:
    from examples.llama.model import LlamaConfig

    return LlamaConfig.tiny() if small else LlamaConfig.bench_1g()


def _init(rank: int, world: int, port: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))


def _mesh(order: list[int], shape: tuple[int, int]) -> Any:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    # collective over the whole world, members or not
    return DeviceMesh("cpu", torch.tensor(order).reshape(shape), mesh_dim_names=DIMS)


def _optimizer(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _old_model(cfg: Any, mesh: Any) -> tuple[Any, Any]:
    """The training job's model: deterministic weights, parallelized, one real AdamW step taken."""
    import torch

    from examples.llama import parallel as par
    from examples.llama.model import Llama

    with torch.device("meta"):  # no default init of 100M parameters that init_weights overwrites
        model = Llama(cfg)
    model.to_empty(device="cpu").init_weights(SEED)
    par.parallelize(model, mesh, tp_dim="tp", dp_dim="dp_shard")
    opt = _optimizer(model)
    dp = mesh["dp_shard"]
    seq = min(SEQ, cfg.max_seq_len)
    rows = torch.randint(0, cfg.vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(SEED))
    lo = dp.get_local_rank() * (BATCH // dp.size())
    x, y = rows[lo:lo + BATCH // dp.size(), :-1], rows[lo:lo + BATCH // dp.size(), 1:]
    logits = model(x)
    with par.loss_context(logits):
        loss = par.loss_fn(logits, y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # the step boundary holds no gradients
    return model, opt


def _new_model(cfg: Any, mesh: Any) -> tuple[Any, Any]:
    """The model and optimizer on the new mesh, uninitialized: they are about to receive the state."""
    import torch

    from examples.llama import parallel as par
    from examples.llama.model import Llama, precompute_freqs_cis

    with torch.device("meta"):
        model = Llama(cfg)
    par.parallelize(model, mesh, tp_dim="tp", dp_dim="dp_shard")
    model.to_empty(device="cpu")
    with torch.no_grad():  # not persistent: derived from the config, no checkpoint carries it
        model.freqs_cis.copy_(precompute_freqs_cis(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))
    return model, _optimizer(model)


def _digests(state: dict | None, hash_here: bool) -> dict[str, str] | None:
    """A hash of the bytes of every key's full tensor; collective over each DTensor's mesh.

    Every holder gathers each full tensor, only ``hash_here`` hashes them: one rank per mesh
    is enough, and every holder hashing every byte would multiply the bench's untimed CPU work.
    """
    import hashlib

    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, str] = {}
    for key, t in sorted((state or {}).items()):
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().reshape(-1)
        if hash_here:
            h = hashlib.blake2b(f"{tuple(t.shape)}|{t.dtype}|".encode(), digest_size=16)
            h.update(full.view(torch.uint8).numpy())
            out[key] = h.hexdigest()
    return out if hash_here else None


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if t.dim() > 0)


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)  # no fsync: the launcher reads it after the process exited


# --------------------------------------------------------------------------------------------
# Old workers: train, (a) in place, then save for (b)/(c) and exit
# --------------------------------------------------------------------------------------------


def old_worker(a: argparse.Namespace) -> None:
    import gc
    import logging

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastic.torch import mesh_order, reshard, training_state

    torch.set_num_threads(1)
    # full_tensor of a (_StridedShard, Shard) tensor (the digests) warns of two all-gathers per key
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    world = OLD_SHAPE[0] * OLD_SHAPE[1]
    t_imported = time.time()
    _init(a.rank, world, a.port)
    cfg = _config(a.small)
    # setup, untimed: the job as it trains
    model, opt = _old_model(cfg, _mesh(list(range(world)), OLD_SHAPE))
    src = training_state(model, opt)
    t_trained = time.time()
    before = _digests(src, hash_here=a.rank == 0)
    t_digested = time.time()
    if a.rank == 0:
        _write(f"{a.dir}/before.json", {"digests": before, "state_bytes": _state_bytes(src), "keys": len(src)})
    survivors = [int(r) for r in a.survivors.split(",")]

    # (a) in place. Before the boundary: the new mesh, model and optimizer
    dist.barrier()
    t_directive = time.time()
    order = mesh_order(src, NEW_SHAPE, new_members=survivors, mesh_dim_names=DIMS)
    new_mesh = _mesh(order, NEW_SHAPE)
    new_model = new_opt = dst = None
    if a.rank in order:
        new_model, new_opt = _new_model(cfg, new_mesh)
        dst = training_state(new_model, new_opt, init_optimizer=True)
    t_prepared = time.time()
    dist.barrier()  # the step boundary
    t_boundary = time.time()
    st = reshard(src, dst)
    t_end = time.time()
    after = _digests(dst, hash_here=a.rank == order[0]) if dst is not None else None  # untimed; collective
    t_verified = time.time()
    _write(f"{a.dir}/inplace-{a.rank}.json", {
        "rank": a.rank, "survivor": dst is not None, "order": order, "t_imported": t_imported,
        "t_trained": t_trained, "t_digested": t_digested, "t_verified": t_verified, "t_directive": t_directive,
        "t_prepared": t_prepared, "t_boundary": t_boundary, "t_end": t_end, "digests": after,
        "bytes_moved": st.bytes_moved, "bytes_lower_bound": st.bytes_lower_bound, "bytes_needed": st.bytes_needed,
        "bytes_local": st.bytes_local, "messages": st.messages, "keys": st.keys, "scalars": st.scalars,
        "rounds": st.rounds, "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
        "seconds": st.seconds, "exchange_seconds": st.exchange_seconds, "plan_seconds": st.plan_seconds,
        "execute_seconds": st.execute_seconds, "executor_prepare_seconds": st.executor.prepare_seconds,
        "executor_exchange_seconds": st.executor.exchange_seconds,
        "executor_local_copy_seconds": st.executor.local_copy_seconds,
        "executor_free_seconds": st.executor.free_seconds, "wire_ops": st.executor.wire_ops,
    })
    del new_model, new_opt, dst
    gc.collect()

    # (b) / (c): the checkpoint path from a fresh step boundary
    dist.barrier()
    t0 = time.time()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=a.ckpt)
    dist.barrier()
    _write(f"{a.dir}/save-{a.rank}.json", {"t0": t0, "t_saved": time.time()})
    dist.destroy_process_group()
    sys.exit(0)  # a normal exit, as a restart of the whole job does


def load_worker(a: argparse.Namespace) -> None:
    """A new process of the restarted job: everything from here to the loaded state is pause."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t_imported = time.time()
    torch.set_num_threads(1)
    world = NEW_SHAPE[0] * NEW_SHAPE[1]
    _init(a.rank, world, a.port)
    cfg = _config(a.small)
    model, opt = _new_model(cfg, _mesh(list(range(world)), NEW_SHAPE))
    t_built = time.time()
    model_sd, optim_sd = get_state_dict(model, opt)  # creates the optimizer's state
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=a.ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    dist.barrier()
    t_done = time.time()
    from elastic.torch import training_state

    _write(f"{a.dir}/load-{a.rank}.json", {"t_imported": t_imported, "t_built": t_built, "t_done": t_done,
                                           "digests": _digests(training_state(model, opt), hash_here=a.rank == 0)})
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


def _spawn(role: str, rank: int, port: int, run_dir: str, ckpt: str, a: argparse.Namespace) -> subprocess.Popen:
    # the trainer workers' memory settings (elastic.train.procenv), for both paths alike
    from elastic.train.procenv import worker_memory_env

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), **worker_memory_env(os.environ))
    cmd = [sys.executable, __file__, "--role", role, "--rank", str(rank), "--port", str(port), "--dir", run_dir,
           "--ckpt", ckpt, "--survivors", a.survivors] + (["--small"] if a.small else [])
    return subprocess.Popen(cmd, env=env, stdout=sys.stderr)  # stdout stays the result's


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> float:
    """Wait for every process; the wall clock when the last one was gone."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            rc = p.poll()
            if rc is None:
                continue
            pending.remove(p)
            if rc != 0:
                for q in pending:
                    q.kill()
                raise SystemExit(f"a benchmark process exited with {rc}; see its output above")
        if pending and time.monotonic() > deadline:
            for q in pending:
                q.kill()
            raise SystemExit(f"benchmark processes timed out after {timeout:.0f} s")
        time.sleep(0.002)
    return time.time()


def _read(d: str, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(d).glob(f"{prefix}-*.json"))]


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    real, best, fstype = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype


def run_set(a: argparse.Namespace, storage: str, base: str) -> tuple[dict, dict, dict]:
    """Four old processes (train, in place, save) then two new ones (load): one run of (a) and of (b) or (c)."""
    run_dir = tempfile.mkdtemp(prefix=f"{storage}-", dir=base)
    ckpt = tempfile.mkdtemp(prefix="dtensor-reshard-ckpt-", dir=a.disk_dir if storage == "disk" else a.shm_dir)
    try:
        port = _free_port()
        t_set = time.time()
        t_old_gone = _wait_all([_spawn("old", r, port, run_dir, ckpt, a) for r in range(4)], a.timeout)
        port = _free_port()
        t_launch = time.time()
        _wait_all([_spawn("load", r, port, run_dir, ckpt, a) for r in range(2)], a.timeout)
        ckpt_bytes = sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    before = json.loads(Path(run_dir, "before.json").read_text())
    ip = _inplace(run_dir, before)
    ip["setup"] = _setup(run_dir, t_set)
    ip["setup"]["set_wall_seconds"] = time.time() - t_set
    return before, ip, _checkpoint(run_dir, before, t_old_gone, t_launch, ckpt_bytes)


def _setup(run_dir: str, t_set: float) -> dict:
    """Where one set's untimed time goes (the bench's own runtime, not a figure of merit)."""
    res = _read(run_dir, "inplace")
    return {"start_seconds": max(r["t_imported"] for r in res) - t_set,
            "build_and_train_seconds": max(r["t_trained"] - r["t_imported"] for r in res),
            "digest_seconds": max(r["t_digested"] - r["t_trained"] for r in res),
            "verify_seconds": max(r["t_verified"] - r["t_end"] for r in res)}


def _inplace(run_dir: str, before: dict) -> dict:
    res = _read(run_dir, "inplace")
    surv = [r for r in res if r["survivor"]]
    hashed = [r for r in surv if r["digests"] is not None]
    if len(hashed) != 1 or hashed[0]["digests"] != before["digests"]:
        bad = sorted({k for r in hashed for k, v in r["digests"].items() if before["digests"].get(k) != v})
        raise SystemExit(f"in-place reshard produced wrong state: {len(bad)} keys differ, e.g. {bad[:3]}")
    t_b = min(r["t_boundary"] for r in res)
    r0 = res[0]
    return {
        "pause_seconds": max(r["t_end"] for r in surv) - t_b,
        "prepare_seconds": max(r["t_prepared"] - r["t_directive"] for r in res),
        "boundary_skew_seconds": max(r["t_boundary"] for r in res) - t_b,
        "order": r0["order"],
        **{k: r0[k] for k in ("bytes_moved", "bytes_lower_bound", "bytes_needed", "bytes_local", "messages", "keys",
                              "scalars", "rounds")},
        # where the pause goes, the slowest worker of each phase
        "reshard_seconds": max(r["seconds"] for r in res),
        "exchange_seconds": max(r["exchange_seconds"] for r in res),
        "plan_seconds": max(r["plan_seconds"] for r in res),
        "execute_seconds": max(r["execute_seconds"] for r in res),
        "executor_prepare_seconds": max(r["executor_prepare_seconds"] for r in res),
        "executor_exchange_seconds": max(r["executor_exchange_seconds"] for r in res),
        "executor_local_copy_seconds": max(r["executor_local_copy_seconds"] for r in res),
        "executor_free_seconds": max(r["executor_free_seconds"] for r in res),
        "wire_ops": sum(r["wire_ops"] for r in res),
        "bytes_sent": {r["rank"]: r["bytes_sent"] for r in res},
        "bytes_received": {r["rank"]: r["bytes_received"] for r in res},
    }


def _checkpoint(run_dir: str, before: dict, t_old_gone: float, t_launch: float, ckpt_bytes: int) -> dict:
    saves, loads = _read(run_dir, "save"), _read(run_dir, "load")
    hashed = [r for r in loads if r["digests"] is not None]
    if len(hashed) != 1:
        raise SystemExit(f"{len(hashed)} of the new processes hashed their state, not one")
    for r in hashed:
        if r["digests"] != before["digests"]:
            bad = sorted(k for k, v in r["digests"].items() if before["digests"].get(k) != v)
            raise SystemExit(f"checkpoint path produced wrong state: {len(bad)} keys differ, e.g. {bad[:3]}")
    t0 = min(s["t0"] for s in saves)
    t_saved = max(s["t_saved"] for s in saves)
    return {
        "seconds": max(r["t_done"] for r in loads) - t0,
        "save_seconds": t_saved - t0,
        "old_exit_seconds": t_old_gone - t_saved,
        "relaunch_gap_seconds": t_launch - t_old_gone,
        "new_start_seconds": max(r["t_imported"] for r in loads) - t_launch,  # interpreter + import torch
        "new_build_seconds": max(r["t_built"] - r["t_imported"] for r in loads),  # group, mesh, model, optimizer
        "load_seconds": max(r["t_done"] for r in loads) - max(r["t_built"] for r in loads),
        "checkpoint_bytes": ckpt_bytes,
    }


def _r(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else x


def summarize(before: dict, inplace: list[dict], disk: list[dict], shm: list[dict], meta: dict) -> dict:
    med = statistics.median
    first = inplace[0]
    pause, ck, ck_shm = (med(r[k] for r in rs) for rs, k in
                         ((inplace, "pause_seconds"), (disk, "seconds"), (shm, "seconds")))
    out: dict[str, Any] = {
        "pause_seconds": pause,
        "checkpoint_seconds": ck,
        "checkpoint_shm_seconds": ck_shm,
        "bytes_moved": first["bytes_moved"],
        "bytes_lower_bound": first["bytes_lower_bound"],
        "speedup_vs_checkpoint": ck / pause,
        "speedup_vs_checkpoint_shm": ck_shm / pause,
        "prepare_seconds": med(r["prepare_seconds"] for r in inplace),
        "messages": first["messages"],
        "state_bytes": before["state_bytes"],
        "keys": before["keys"],
    }
    out["goals"] = {"bytes_moved_is_lower_bound": out["bytes_moved"] == out["bytes_lower_bound"],
                    "speedup_ge_15": out["speedup_vs_checkpoint"] >= GOAL_SPEEDUP}
    out["setup"] = meta
    out["inplace_profile_median"] = {k: med(r[k] for r in inplace) for k in
                                     ("reshard_seconds", "exchange_seconds", "plan_seconds", "execute_seconds",
                                      "executor_prepare_seconds", "executor_exchange_seconds",
                                      "executor_local_copy_seconds", "executor_free_seconds",
                                      "boundary_skew_seconds")}
    # an order that does not increase runs as if sorted: not the layout mesh_order meant (docstring)
    out["inplace_plan"] = {"order_ascending": first["order"] == sorted(first["order"])}
    out["inplace_plan"] |= {k: first[k] for k in ("order", "bytes_needed", "bytes_local", "keys", "scalars", "rounds",
                                                 "wire_ops", "bytes_sent", "bytes_received")}
    out["checkpoint_breakdown_median"] = {
        name: {k: med(r[k] for r in rs) for k in rs[0]} for name, rs in (("disk", disk), ("shm", shm))}
    out["inplace_runs"] = [{**{k: _r(v) for k, v in r.items() if k.endswith("_seconds")},
                            "bench_setup": {k: _r(v) for k, v in r["setup"].items()}} for r in inplace]
    out["checkpoint_runs"] = [{k: _r(v) for k, v in r.items()} for r in disk]
    out["checkpoint_shm_runs"] = [{k: _r(v) for k, v in r.items()} for r in shm]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--out", help="result file (default benchmarks/results/dtensor_reshard.json, "
                                  "dtensor_reshard_small.json with --small)")
    ap.add_argument("--small", action="store_true", help="the tiny Llama: a smoke run of every path (< 60 s)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each checkpoint path, and twice as many in place (default 3, 1 with --small)")
    ap.add_argument("--survivors", default="0,1",
                    help="old ranks that stay, (dp, tp) = (r // 2, r %% 2); default: the first node of two")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="parent folder of the on-disk checkpoint")
    ap.add_argument("--shm-dir", default="/dev/shm", help="parent folder of the in-memory checkpoint")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for one set of processes")
    ap.add_argument("--role", choices=["old", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {"old": old_worker, "load": load_worker}[a.role](a)
        return 0
    if a.repeats is None:
        a.repeats = 1 if a.small else 3
    if a.out is None:
        a.out = str(ROOT / "benchmarks" / "results" / ("dtensor_reshard_small.json" if a.small else "dtensor_reshard.json"))
    survivors = [int(r) for r in a.survivors.split(",")]
    if len(survivors) != 2 or len(set(survivors)) != 2 or not set(survivors) <= set(range(4)):
        raise SystemExit(f"--survivors {a.survivors}: two distinct ranks of 0..3")
    fs = {"disk": _fs_type(a.disk_dir), "shm": _fs_type(a.shm_dir)}
    if fs["disk"] in ("tmpfs", "ramfs"):
        raise SystemExit(f"--disk-dir {a.disk_dir} is on {fs['disk']}, not a disk; give a folder on a real disk")
    base = tempfile.mkdtemp(prefix="dtensor-reshard-bench-")
    t_start = time.time()
    before: dict | None = None
    inplace: list[dict] = []
    runs: dict[str, list[dict]] = {"disk": [], "shm": []}
    try:
        for i in range(max(1, a.repeats)):
            # alternate which checkpoint path goes first, so neither always runs on a cooler machine
            for storage in (("disk", "shm") if i % 2 == 0 else ("shm", "disk")):
                got, ip, ck = run_set(a, storage, base)
                if before is not None and got["digests"] != before["digests"]:
                    raise SystemExit("two runs of the same training step gave different states: not deterministic")
                before = got
                inplace.append(ip)
                runs[storage].append(ck)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta = {"model": "LlamaConfig.tiny()" if a.small else "LlamaConfig.bench_1g()", "old_mesh": list(OLD_SHAPE),
            "new_mesh": list(NEW_SHAPE), "mesh_dim_names": list(DIMS), "survivors": survivors,
            "repeats": a.repeats, "disk_dir": a.disk_dir, "disk_fs": fs["disk"], "shm_dir": a.shm_dir,
            "shm_fs": fs["shm"], "bench_wall_seconds": round(time.time() - t_start, 1)}
    out = summarize(before, inplace, runs["disk"], runs["shm"], meta)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            if not isinstance(v, dict | list):
                print(f"{k:28s} {v:.4f}" if isinstance(v, float) else f"{k:28s} {v}")
        for k, met in out["goals"].items():
            print(f"goal {k}: {'met' if met else 'NOT met'}")
    return 0 if all(out["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
