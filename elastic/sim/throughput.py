"""Training throughput tables and rescale pauses for the simulator.

Tables come from the layout planner (``elastic.parallel.planner.best_by_gpu_count``) when
it is importable; only counts the best layout uses completely are kept (a job is never
handed GPUs its layout would leave idle). If the planner is missing or fails, a documented
analytic stand-in is used (``analytic_table``) and the caller is told which source it got.

Pause model: ``overhead + moved_bytes / (bandwidth x sending GPUs)`` with moved bytes
approximated as ``state_bytes_per_param x params x (1 - min(old, new) / max(old, new))``
— the share of sharded state whose owner changes when a job goes from ``old`` to ``new``
GPUs (0 -> n or n -> 0: everything moves to/from host memory). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from functools import lru_cache

from elastic.model import HardwareSpec, Layout, ModelSpec, load_hardware, load_model
from elastic.sim.scenario import JobCfg, ReshardCfg

Table = dict[int, tuple[Layout, float]]


@lru_cache(maxsize=64)
def job_table(model_name: str, hardware: str, max_gpus: int, gpus_per_node: int, global_batch: int) -> tuple[Table, str]:
    """(table, source) where source is ``planner`` or ``analytic``."""
    model, hw = load_model(model_name), load_hardware(hardware)
    try:
        from elastic.parallel.planner import best_by_gpu_count
    except ImportError:
        return analytic_table(model, hw, max_gpus, gpus_per_node, global_batch), "analytic"
    plans = best_by_gpu_count(model, hw, max_gpus, gpus_per_node=gpus_per_node, global_batch=global_batch)
    table: Table = {}
    for n, p in plans.items():
        if getattr(p, "leftover_gpus", 0) == 0 and p.tokens_per_second > 0:
            table[n] = (p.layout, float(p.tokens_per_second))
    return table, "planner"


def analytic_table(model: ModelSpec, hw: HardwareSpec, max_gpus: int, gpus_per_node: int, global_batch: int) -> Table:
    """Stand-in when no planner is available: 6·N_active FLOPs/token at 40% MFU, TP = node size,
    PP just deep enough for 16 B/param in 70% of memory, DP dividing the global batch, and 1% less
    efficiency per doubling of DP (gradient all-reduce)."""
    params = model.total_params()
    tp = min(gpus_per_node, 8)
    while model.heads % tp:
        tp //= 2
    pp = 1
    while 16 * params / (tp * pp) > 0.7 * hw.memory_bytes and pp < model.layers:
        pp += 1
    per_gpu = 0.4 * hw.peak_flops / (6 * model.active_params())
    table: Table = {}
    for dp in range(1, max_gpus // (tp * pp) + 1):
        if global_batch % dp:
            continue
        n = tp * pp * dp
        table[n] = (Layout(tp, pp, dp), n * per_gpu * (0.99 ** math.log2(dp)))
    return table


def tables_for(jobs: list[JobCfg], hardware: str, gpus_per_node: int, pool_gpus: int) -> tuple[dict[str, Table], set[str]]:
    out: dict[str, Table] = {}
    sources: set[str] = set()
    for j in jobs:
        t, src = job_table(j.model, hardware, min(j.max_gpus, pool_gpus), gpus_per_node, j.global_batch)
        out[j.name] = t
        sources.add(src)
    return out, sources


@lru_cache(maxsize=64)
def _params(model_name: str) -> int:
    return load_model(model_name).total_params()


def rescale_pause(model_name: str, old: int, new: int, cfg: ReshardCfg, scale: float = 1.0) -> float:
    """Seconds a job stops when it goes from ``old`` to ``new`` GPUs (0 = paused, state on host).

    Worked number: llama3-70b (70.6e9 params), 256 -> 224 GPUs, 25 GB/s per GPU, 5 s overhead:
    16 x 70.6e9 x (1 - 224/256) = 141 GB over 224 senders -> 0.03 s + 5 s = 5.03 s.
    """
    if old == new:
        return 0.0
    frac = 1.0 if min(old, new) == 0 else 1.0 - min(old, new) / max(old, new)
    moved = cfg.state_bytes_per_param * _params(model_name) * frac
    senders = max(1, min(old, new) or max(old, new))
    return scale * (cfg.overhead_seconds + moved / (cfg.bandwidth_bytes_per_second * senders))
