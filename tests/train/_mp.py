"""Multi-process harness for the trainer tests: spawn N gloo workers on loopback, bounded in time.

``run_workers(fn, n, *args)`` starts ``n`` processes (forkserver, torch preloaded), each with a default gloo
process group of ``n`` ranks on 127.0.0.1 (a free port found by binding port 0), calls
``fn(rank, n, *args)`` and returns the per-rank results. Any exception in a worker fails
the caller with that worker's traceback; a worker that does not finish in ``timeout``
seconds is killed and the caller fails (never hangs).

Also: the scenario bodies the test files run in the workers (they must be importable
module-level functions for spawn), and ``gather_full_state`` that rebuilds every global
tensor from all ranks' pieces while checking replicas are bitwise equal.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.model import MODEL_PRESETS, Layout, ModelSpec, MoESpec
from elastic.reshard.spec import ShardingSpec, box_numel, sharding_spec
from elastic.train.engine import State, TrainConfig, TrainEngine

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple[Any, ...]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        q.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    # forked from a server that has imported torch once (``import torch`` costs seconds of CPU per
    # process here); the reshard harness's list, so that either may start this process's forkserver
    from tests.reshard._mp import FORKSERVER_PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world - len(results)} of {world} workers did not finish in {timeout:.0f}s; "
                                   f"errors so far: {errors}")
            try:
                rank, status, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"workers {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                                       f"; errors: {errors}") from None
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break  # the others are probably blocked on the failed one: stop them
        if errors:
            raise RuntimeError("worker failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world)]


# --------------------------------------------------------------------------------------------
# models and configs shared by the tests
# --------------------------------------------------------------------------------------------

MODELS: dict[str, ModelSpec] = {
    "tiny": MODEL_PRESETS["tiny"],
    # GPT-2 flavour: gelu MLP, biases, LayerNorm, tied embeddings, MHA; vocab 251 and ffn 175
    # split unevenly over tp2 (125/126 and 87/88), 5 layers over pp2 (a virtual padding slot)
    "tiny-gpt2": ModelSpec(name="tiny-gpt2", layers=5, hidden=64, ffn_hidden=175, heads=4, kv_heads=4, vocab=251,
                           seq_len=16, mlp="gelu", tie_embeddings=True),
    # DeepSeek-shaped: one dense layer, then MoE layers of 8 routed experts (top 2) and one shared
    # expert; 8 experts split over ep 1, 2 and 4; expert width 24 over tp2 (12/12), ffn 80 (40/40)
    "tiny-moe": ModelSpec(name="tiny-moe", layers=4, hidden=32, ffn_hidden=80, heads=4, kv_heads=2, vocab=128,
                          seq_len=16, moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=24, shared_experts=1,
                                                  dense_layers=1)),
    # GPT-2 flavoured MoE: gelu experts with biases (the down-projection's added after the TP
    # reduction), tied embeddings, top 1 of 4 experts (its weight is 1: the router learns from the
    # balance loss alone), no shared expert, every layer MoE
    "tiny-moe-gelu": ModelSpec(name="tiny-moe-gelu", layers=2, hidden=32, ffn_hidden=64, heads=4, kv_heads=4,
                               vocab=96, seq_len=16, mlp="gelu", tie_embeddings=True,
                               moe=MoESpec(experts=4, top_k=1, expert_ffn_hidden=20)),
}


def make_cfg(model: str = "tiny", dtype: str = "float64", global_batch: int = 4, micro_batch: int = 1,
             lr: float = 3e-3, weight_decay: float = 0.0) -> TrainConfig:
    return TrainConfig(MODELS[model], global_batch=global_batch, micro_batch=micro_batch, seed=7, lr=lr,
                       weight_decay=weight_decay, dtype=DTYPES[dtype])


def reference_losses(cfg: TrainConfig, steps: int, *, one_micro_batch: bool = False) -> list[float]:
    """The single-process run (tp1.pp1.dp1) every parallel run must follow.

    One intra-op thread: on a busy 2-core machine two threads spinning against each other
    make these tiny matmuls 30x slower. ``one_micro_batch``: each step's samples in one
    micro-batch, the same maths up to float rounding, several times faster than hundreds of
    tiny micro-batches; only for a model without per-micro-batch terms (a mixture of experts'
    auxiliary loss is one)."""
    if one_micro_batch:
        cfg = dataclasses.replace(cfg, micro_batch=cfg.global_batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = TrainEngine(cfg, Layout(1, 1, 1), 0)
        return [eng.train_step(s).loss for s in range(steps)]
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# full-state gathering
# --------------------------------------------------------------------------------------------


def gather_full_state(state: State, spec: ShardingSpec | None, layout_rank: int | None,
                      group: dist.ProcessGroup | None = None) -> dict[tuple[str, str], torch.Tensor]:
    """Every ``(tensor, kind)`` as a full global tensor, assembled from all processes' pieces.

    Processes outside the layout pass ``{}``. Fails if a region held by several ranks differs
    by a single bit, or if some element of a tensor is held by nobody.
    """
    mine = []
    if spec is not None and layout_rank is not None:
        pieces = spec.rank_pieces(layout_rank)
        mine = [(key, pieces[key], state[key].detach().cpu().clone()) for key in pieces]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    full: dict[tuple[str, str], torch.Tensor] = {}
    seen: dict[tuple[str, str], torch.Tensor] = {}
    shapes = {t.name: t.shape for t in (spec.tensors if spec is not None else ())}
    for contribution in everyone:
        for key, box, t in contribution:
            if key not in full:
                shape = shapes.get(key[0]) or _shape_from(everyone, key)
                full[key] = torch.zeros(shape, dtype=t.dtype)
                seen[key] = torch.zeros(shape, dtype=torch.bool)
            region = tuple(slice(a, b) for a, b in box)
            overlap = seen[key][region]
            if overlap.any():
                assert torch.equal(full[key][region][overlap], t[overlap]), f"replicas of {key} differ in {box}"
            full[key][region] = t
            seen[key][region] = True
    for key, s in seen.items():
        assert bool(s.all()), f"{key}: {int((~s).sum())} elements held by no rank"
    return full


def _shape_from(everyone: list[Any], key: tuple[str, str]) -> tuple[int, ...]:
    dims: list[int] = []
    for contribution in everyone:
        for k, box, _ in contribution:
            if k == key:
                stops = [b for _, b in box]
                dims = stops if not dims else [max(x, y) for x, y in zip(dims, stops, strict=True)]
    return tuple(dims)


# --------------------------------------------------------------------------------------------
# scenario bodies (run inside the workers)
# --------------------------------------------------------------------------------------------


def run_layouts(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]], steps: int) -> dict[str, Any]:
    """For each ``(layout, cfg kwargs)``: train ``steps`` steps on all ``world`` ranks; return the
    losses seen by this rank, and (rank 0) the reference losses of each config."""
    out: dict[str, Any] = {"losses": {}, "reference": {}, "state_bytes": {}, "spec_bytes": {}}
    for layout_text, kw in runs:
        cfg = make_cfg(**kw)
        layout = Layout.parse(layout_text)
        eng = TrainEngine(cfg, layout, rank)
        key = f"{layout_text}/{sorted(kw.items())}"
        out["losses"][key] = [eng.train_step(s).loss for s in range(steps)]
        gather_full_state(eng.state(), eng.spec, rank)  # asserts replicas stayed bitwise equal
        out["state_bytes"][key] = eng.state_bytes()
        out["spec_bytes"][key] = eng.spec.bytes_per_rank(rank, torch.finfo(cfg.dtype).bits // 8)
        assert eng.memory is not None  # the first steps are measured
        out.setdefault("weight_elements", {})[key] = (eng.memory.weight_elements, sum(
            box_numel(b) for (_, kind), b in eng.spec.rank_pieces(rank).items() if kind == "param"))
        eng.close()
        ref_key = str(sorted(kw.items()))
        if rank == 0 and ref_key not in out["reference"]:
            out["reference"][ref_key] = reference_losses(cfg, steps)
    return out


def spec_of(cfg: TrainConfig, layout: Layout) -> ShardingSpec:
    return sharding_spec(cfg.model, layout, cfg.kinds)


def run_rescale(rank: int, world: int, generations: list[tuple[str, list[str]]], steps_per_gen: int,
                cfg_kw: dict[str, Any]) -> dict[str, Any]:
    """Fidelity (b): ``world`` processes (workers ``w0..``) live throughout; the job starts on
    ``generations[0]`` and rescales in place to each next ``(layout, members)`` every
    ``steps_per_gen`` steps. Processes outside the current layout idle. Returns this worker's
    losses (None while idle) and, per reshard, whether the gathered state before equals the
    gathered state after bit for bit."""
    from elastic.reshard.execute import execute, prepare
    from elastic.reshard.plan import plan_reshard

    me = f"w{rank}"
    everyone = {f"w{i}": i for i in range(world)}  # worker -> rank in the default group
    cfg = make_cfg(**cfg_kw)
    layout = Layout.parse(generations[0][0])
    ranks = {w: i for i, w in enumerate(generations[0][1])}  # worker -> layout rank
    eng = _member_engine(cfg, layout, ranks, me, everyone, state=None)
    out: dict[str, Any] = {"losses": [], "reshards": []}
    step = 0
    for g, (next_text, next_members) in enumerate([*generations[1:], (None, None)]):
        # 1. train this generation's steps (idle workers only count them)
        for _ in range(steps_per_gen):
            out["losses"].append(eng.train_step(step).loss if eng else None)
            step += 1
        if next_text is None:
            break
        new_layout = Layout.parse(next_text)
        # 2. everything before, gathered from all ranks
        old_state = eng.state() if eng else {}
        before = gather_full_state(old_state, spec_of(cfg, layout), ranks.get(me))
        # 3. plan (pure, the same on every worker) and execute among old union new
        plan = plan_reshard(cfg.model, layout, ranks, new_layout, next_members, kinds=cfg.kinds,
                            bytes_per_element=torch.finfo(cfg.dtype).bits // 8)
        new_state: State = {}
        if me in plan.members:
            prepared = prepare(plan, me, old_state, dtype=cfg.dtype)
            new_state = execute(prepared, None, everyone)
        if eng:
            eng.close()
        # 4. the new generation adopts the received tensors
        layout, ranks = new_layout, dict(plan.new_ranks)
        eng = _member_engine(cfg, layout, ranks, me, everyone, state=new_state)
        if eng:
            live = eng.state()
            assert all(live[k].data_ptr() == new_state[k].data_ptr() for k in new_state), "engine copied its state"
        after = gather_full_state(eng.state() if eng else {}, spec_of(cfg, layout), ranks.get(me))
        same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out["reshards"].append({"gen": g + 1, "layout": next_text, "bitwise_equal": same,
                                "bytes_planned": plan.bytes_planned, "bytes_lower_bound": plan.bytes_lower_bound,
                                "new_ranks": dict(plan.new_ranks)})
    if eng:
        eng.close()
    return out


def _member_engine(cfg: TrainConfig, layout: Layout, ranks: dict[str, int], me: str, everyone: dict[str, int],
                   state: State | None) -> TrainEngine | None:
    """Build the layout's process group (every process takes part in new_group, members in
    layout-rank order) and, on members, the engine."""
    order = sorted(ranks, key=ranks.__getitem__)
    pg = dist.new_group([everyone[w] for w in order], sort_ranks=False)
    if me not in ranks:
        return None
    return TrainEngine(cfg, layout, ranks[me], state=state, pg=pg)


def run_rescale_each(rank: int, world: int, scenarios: list[tuple[list[tuple[str, list[str]]], dict[str, Any]]],
                     steps_per_gen: int) -> list[dict[str, Any]]:
    """:func:`run_rescale` for each ``(generations, cfg kwargs)``, in the same processes (one
    spawn per test file)."""
    return [run_rescale(rank, world, gens, steps_per_gen, kw) for gens, kw in scenarios]


# ---- shared assertions of the fidelity files ------------------------------------------------------

FIDELITY_TOL = {"float64": 1e-9, "float32": 1e-4}


def assert_matches_reference(results: list[dict], layout: str, kw: dict, steps: int, drop: dict[str, float]) -> None:
    """Every rank's losses equal the single-process reference within the dtype's tolerance,
    are the same on every rank, and fall by at least ``drop[model]`` nats over the run."""
    import math

    key = f"{layout}/{sorted(kw.items())}"
    ref = results[0]["reference"][str(sorted(kw.items()))]
    tol = FIDELITY_TOL[kw["dtype"]]
    for rank, res in enumerate(results):
        got = res["losses"][key]
        assert len(got) == steps
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert math.isclose(a, b, rel_tol=tol, abs_tol=0), f"rank {rank} step {step}: {a!r} vs reference {b!r}"
    assert len({tuple(r["losses"][key]) for r in results}) == 1
    assert ref[-1] < ref[0] - drop[kw.get("model", "tiny")], f"loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"


def assert_state_bytes_equal_spec(results: list[dict], layout: str, kw: dict) -> None:
    key = f"{layout}/{sorted(kw.items())}"
    for res in results:
        assert res["state_bytes"][key] == res["spec_bytes"][key] > 0


def check_rescale_curve(runs: list[list[dict]], scenarios: dict[str, Any], scenario: str, steps_per_gen: int,
                        *, lower_bound: bool) -> None:
    """What every ``run_rescale_each`` scenario must show: each reshard kept the state bit for bit
    (seen from every worker); every member's loss at every step is the never-rescaled run's, idle
    workers have none; every change moved bytes (``lower_bound``: exactly the planner's lower bound)."""
    import math

    generations, cfg_kw = scenarios[scenario]
    results = [per_worker[list(scenarios).index(scenario)] for per_worker in runs]
    ref = reference_losses(make_cfg(**cfg_kw), steps_per_gen * len(generations))
    tol = FIDELITY_TOL[cfg_kw["dtype"]]
    for res in results:
        assert [r["bitwise_equal"] for r in res["reshards"]] == [True] * (len(generations) - 1)
    for step, want in enumerate(ref):
        members = {int(w[1:]) for w in generations[step // steps_per_gen][1]}
        for rank, res in enumerate(results):
            got = res["losses"][step]
            if rank in members:
                assert math.isclose(got, want, rel_tol=tol, abs_tol=0), f"w{rank} step {step}: {got} vs {want}"
            else:
                assert got is None
    for r in results[0]["reshards"]:
        assert r["bytes_planned"] > 0, r
        if lower_bound:
            assert r["bytes_planned"] == r["bytes_lower_bound"], r


def wait_out_of_memory_hold(handle: Any, timeout: float) -> Any:
    """The job's status (``handle.status()``) once its coordinator holds it after a step that ran out of
    memory (every member reported back); fails when the job ends instead or the wait runs out."""
    deadline = time.monotonic() + timeout
    while True:
        st = handle.status()
        if st.out_of_memory is not None:
            return st
        assert st.phase not in ("failed", "stopped", "finished"), f"job ended instead: {st.phase} ({st.error})"
        assert time.monotonic() < deadline, f"no out-of-memory hold within {timeout} s: {st.phase}, {st.reason}"
        time.sleep(0.05)
