"""Each job's GPU count -> (best layout, tokens/s) table, from the layout planner, and the check
that every job has a layout within its GPU bounds. The layouts are :class:`Layout` objects, as the
co-scheduler's ``JobState`` takes them; text only where a table is written out.

Pure: the planner's arithmetic over the config; no clock, DB or backend. The controller builds its
tables at start unless it is given them; ``elastic serve``, the CLI and the operator use these too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic.config import ControllerConfig
from elastic.model import HardwareSpec, Layout, ModelSpec, SpecError, load_hardware


def throughput_table(model: ModelSpec, hardware: HardwareSpec, max_gpus: int, *, gpus_per_node: int,
                     global_batch: int, allowed_tp: list[int] | None = None,
                     allowed_pp: list[int] | None = None, zero: int = 0,
                     replicate_optimizer: bool = False, precision: str = "bf16-mixed",
                     micro_batch_cap: int | None = None, memory_limit_bytes: int | None = None,
                     recompute: str | None = None, offload: bool | None = None,
                     ) -> dict[int, tuple[Layout, float]]:
    """GPU count -> (best feasible layout, tokens/s), from the planner; honours allowed tp/pp,
    ``zero=1`` (ZeRO-1 wherever dp > 1; with 0 the planner chooses per layout),
    ``replicate_optimizer`` (no ZeRO-1: every replica a full copy, for recovery from a lost worker),
    and the memory the job's tensors take and may take: its ``precision``, the micro-batch its trainer
    picks under ``micro_batch_cap``, the ``recompute`` and ``offload`` it runs (None: the planner's
    choice per layout) and its per-GPU ``memory_limit_bytes`` (``TrainingSpec.planner_options()``
    gives all of them for a job)."""
    from elastic.parallel.planner import best_by_gpu_count, feasible_layouts

    # vpp=1: the reference trainer runs non-interleaved 1F1B only
    opts: dict[str, Any] = {"vpps": (1,), "precision": precision, "micro_batch_cap": micro_batch_cap,
                            "memory_limit_bytes": memory_limit_bytes, **trainer_choices(recompute, offload)}
    if not allowed_tp and not allowed_pp and not zero and not replicate_optimizer:
        best = best_by_gpu_count(model, hardware, max_gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                                 **opts)
        return {n: (p.layout, p.tokens_per_second) for n, p in best.items() if p.layout.world_size == n}
    out: dict[int, tuple[Layout, float]] = {}
    for n in range(1, max_gpus + 1):
        for p in feasible_layouts(model, n, hardware, gpus_per_node=gpus_per_node, global_batch=global_batch,
                                  **opts):
            L = p.layout
            if L.world_size != n or (allowed_tp and L.tp not in allowed_tp) or (allowed_pp and L.pp not in allowed_pp):
                continue
            if (zero and L.dp > 1 and not L.zero) or (replicate_optimizer and L.zero):
                continue
            out[n] = (L, p.tokens_per_second)
            break
    return out


def trainer_choices(recompute: str | None, offload: bool | None) -> dict[str, Any]:
    """The planner's recompute and offload choices narrowed to what a job's trainer runs (none given:
    left to the planner)."""
    out: dict[str, Any] = {}
    if recompute is not None:
        out["recompute"] = (recompute,)
    if offload is not None:
        out["offload"] = (offload,)
    return out


def job_throughput_tables(cfg: ControllerConfig) -> dict[str, dict[int, tuple[Layout, float]]]:
    """Every job's GPU count -> (best layout, tokens/s) on the pool's hardware (pure; the planner)."""
    hw = load_hardware(cfg.pool.hardware)
    models = cfg.models()
    return {j.name: throughput_table(models[j.name], hw, min(j.max_gpus, cfg.pool.total_gpus),
                                     gpus_per_node=cfg.pool.gpus_per_node, **j.planner_options())
            for j in cfg.jobs}


def check_feasible(cfg: ControllerConfig, tables: Mapping[str, Mapping[int, Any]]) -> None:
    """A job no layout can run within its GPU bounds would silently never start: refuse it (SpecError)."""
    for i, j in enumerate(cfg.jobs):
        if not any(j.min_gpus <= n <= j.max_gpus for n in tables.get(j.name, {})):
            raise SpecError(
                f"jobs[{i}] '{j.name}': no layout of model {j.model} with global_batch={j.global_batch} fits "
                f"{cfg.pool.hardware} GPUs between min_gpus={j.min_gpus} and max_gpus={j.max_gpus} "
                f"(pool of {cfg.pool.total_gpus}); raise max_gpus, pick a smaller model or bigger GPUs")
