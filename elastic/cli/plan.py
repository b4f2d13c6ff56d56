"""``elastic plan``: the best TP x PP x DP layouts for a model on N GPUs, with a memory report.

Only parsing and printing live here; every number comes from ``elastic.parallel.planner``.
Exit codes: 0 a layout fits; 2 bad input (one line) or nothing fits (the reason says what
would make one fit; with ``--json`` the object is still printed, ``plans`` empty).
``--report PATH`` also writes ``PATH.json`` and ``PATH.png`` (``elastic.cli._plan_report``):
per-GPU memory by component and pipeline stage of the chosen layout and the next best, and,
with ``--measured FILE``, what a training run measured next to it. They are written even when
nothing fits (the closest layout then), before the exit code says so.
"""

from __future__ import annotations

import json
from itertools import groupby

import typer
from rich.table import Table
from rich.text import Text

from elastic.cli import _plan_report
from elastic.model import Layout, SpecError, load_hardware, load_model
from elastic.parallel.memory import GiB
from elastic.parallel.memory_report import memory_report
from elastic.parallel.planner import DEFAULT_GLOBAL_BATCH, PlannedLayout, PlanOptions, evaluate, plan

_SEGMENTS = (("weights", "blue"), ("gradients", "cyan"), ("optimizer", "magenta"), ("activations", "yellow"),
             ("reserve", "bright_black"))
_BAR = 32


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        model: str = typer.Option(..., "--model", help="preset name or a .yaml/.json model file"),
        gpus: int = typer.Option(..., "--gpus", help="GPUs available to the job"),
        hardware: str = typer.Option("h100-80g", "--hardware", help="hardware preset"),
        gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="default: the hardware's (8)"),
        global_batch: int = typer.Option(DEFAULT_GLOBAL_BATCH, "--global-batch", help="sequences per step"),
        seq_len: int | None = typer.Option(None, "--seq-len", help="default: the model's"),
        precision: str = typer.Option("bf16-mixed", "--precision",
                                      help="what the job trains in: bf16-mixed, fp32 or fp64"),
        micro_batch_cap: int | None = typer.Option(
            None, "--micro-batch-cap", help="size the micro-batch the reference trainer picks under this cap "
                                            "(default: the planner chooses one)"),
        recompute: str | None = typer.Option(
            None, "--recompute", help="the activation recompute the trainer runs: none, selective or full "
                                      "(default: the planner picks per layout)"),
        memory_limit_bytes: int | None = typer.Option(
            None, "--memory-limit-bytes", help="bytes of tensors each GPU may hold, below the device's memory "
                                               "less the reserve"),
        layout: str | None = typer.Option(None, "--layout", help="evaluate exactly this layout, e.g. tp8.pp2.dp4"),
        top: int | None = typer.Option(None, "--top", help="layouts to show (default 5; --json: all that fit)"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        report: str | None = typer.Option(
            None, "--report", help="also write PATH.json and PATH.png: per-GPU memory by component of the chosen "
                                   "and the next 3 layouts, worst pipeline stage of each"),
        measured: str | None = typer.Option(
            None, "--measured", help="with --report: a JSON file of measured memory (elastic.train.memory) to "
                                     "show next to the prediction"),
    ) -> None:
        """Valid layouts that fit, fastest first, with a per-GPU memory breakdown."""
        if top is not None and top < 1:
            raise SpecError(f"--top={top}: show at least 1 layout")
        if measured is not None and report is None:
            raise SpecError(f"--measured {measured}: give --report PATH too; the measurement is shown in the report")
        spec = load_model(model)
        hw = load_hardware(hardware)
        if gpus < 1:
            raise SpecError(f"--gpus={gpus}: need at least 1 GPU")
        if gpus_per_node is not None and gpus_per_node < 1:
            raise SpecError(f"--gpus-per-node={gpus_per_node}: must be >= 1")
        opts = PlanOptions(global_batch=global_batch, seq_len=seq_len, gpus_per_node=gpus_per_node,
                           precision=precision, micro_batch_cap=micro_batch_cap,  # type: ignore[arg-type]
                           memory_limit_bytes=memory_limit_bytes,
                           **({} if recompute is None else {"recompute": (recompute,)}))  # type: ignore[arg-type]
        records = _plan_report.read_measured(measured) if measured is not None else []
        if report is not None:
            _plan_report.report_paths(report)  # a bad PATH fails before any planning
        if layout is not None:
            p = evaluate(spec, Layout.parse(layout), hw, n_gpus=gpus, options=opts)
            plans, reason, ok = [p], p.reason, p.fits
            ranked = [p] + [q for q in plan(spec, gpus, hw, options=opts).plans if q.layout != p.layout] \
                if report is not None else []
        else:
            res = plan(spec, gpus, hw, options=opts)
            k = top if top is not None else (len(res.plans) if as_json else 5)
            plans, reason, ok = list(res.plans[:k]), res.reason, bool(res.plans)
            ranked = list(res.plans) or ([res.closest] if res.closest is not None else [])
        if report is not None:
            rep = memory_report(spec, gpus, hw, ranked, options=opts, reason=reason, measured=records)
            _plan_report.write_report(rep, report)
        if as_json:
            print(json.dumps({"model": spec.name, "gpus": gpus, "plans": [p.as_json() for p in plans],
                              "reason": reason}))
        else:
            _print_human(spec.name, gpus, hw.name, plans, reason, ok)
        if not ok:
            raise typer.Exit(2)


# The columns in the order they give way when the terminal is narrow; the layout, its tokens/s
# and whether it fits in memory (GiB) always stay.
_DROP = ("stage layers", "imbal.", "recompute", "memory / GPU", "MFU", "mb x ga", "#", "gpus", "step s")


def _print_human(model: str, gpus: int, hw: str, plans: list[PlannedLayout], reason: str, ok: bool) -> None:
    from elastic.cli import console, err_console
    from elastic.cli._fit import fit

    if not plans:
        err_console.print(f"[bold red]no layout fits:[/] {reason}", highlight=False, soft_wrap=True)
        return
    t = Table(title=f"{model} on {gpus} x {hw}", caption=_legend())
    for col, just in (("#", "right"), ("layout", "left"), ("gpus", "right"), ("mb x ga", "right"),
                      ("recompute", "left"), ("memory / GPU", "left"), ("GiB", "right"), ("stage layers", "left"),
                      ("imbal.", "right"), ("tokens/s", "right"), ("MFU", "right"), ("step s", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, p in enumerate(plans, 1):
        gpus_txt = str(p.gpus_used) + (f" (+{p.leftover_gpus} idle)" if p.leftover_gpus else "")
        rc = p.recompute + (" +offload" if p.offload else "")
        t.add_row(str(i), str(p.layout), gpus_txt, f"{p.micro_batch} x {p.grad_accum}", rc, memory_bar(p),
                  f"{p.memory.total / GiB:.1f}/{p.gpu_memory_bytes / GiB:.0f}", _runs(p.stage_layers, p.virtual_layers),
                  f"{p.imbalance:.2f}", f"{p.tokens_per_second:,.0f}", f"{p.mfu:.1%}", f"{p.step_seconds:.2f}",
                  style=None if p.fits else "red")
    fit(t, console, _DROP)
    console.print(t)
    console.print(reason, highlight=False, soft_wrap=True)


def memory_bar(p: PlannedLayout, width: int = _BAR) -> Text:
    """A stacked bar of the per-GPU memory components over the device capacity ('.' is free)."""
    parts = p.memory.as_dict()
    scale = width / max(p.gpu_memory_bytes, p.memory.total)
    bar = Text()
    used = 0
    for name, colour in _SEGMENTS:
        n = round(parts[name] * scale)
        n = min(n, width - used)
        bar.append("█" * n, style=colour)
        used += n
    bar.append("·" * (width - used), style="dim")
    return bar


def _legend() -> Text:
    t = Text("memory: ")
    for name, colour in _SEGMENTS:
        t.append("█", style=colour)
        t.append(f" {name}  ")
    t.append("· free")
    return t


def _runs(layers: tuple[int, ...], virtual: int) -> str:
    """Run-length layers per stage: (3, 4, 4, 4, 3) -> '3,4x3,3'."""
    out = []
    for n, grp in groupby(layers):
        k = len(list(grp))
        out.append(f"{n}x{k}" if k > 1 else str(n))
    return ",".join(out) + (f" (+{virtual} virtual)" if virtual else "")
