"""The demo's outputs for people: the live table, the timeline CSV and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic.demo.config import GPUS
from elastic.demo.samples import DemoRun, Sample


def _write_timeline(run: DemoRun, path: str, results: list[Any] | None = None, slo: float = 1.0) -> None:
    """One row per second: the samples the summary is computed from (t = 0 at the day's start),
    and, from the load generator's ``results``, the requests sent since the row before (``sent``)
    and how many of them missed the TTFT SLO ``slo`` or failed (``missed``)."""
    import bisect
    import csv
    from dataclasses import astuple, fields

    sent_at = sorted((r.sent_at, not r.met(slo)) for r in results or [])
    times = [t for t, _ in sent_at]
    missed = [0]
    for _, m in sent_at:
        missed.append(missed[-1] + m)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([x.name for x in fields(Sample)] + ["sent", "missed"])
        prev = 0
        for x in run.samples:
            row = list(astuple(x))
            row[0] = round(x.t - run.warmup, 3)
            upto = bisect.bisect_right(times, x.t)
            w.writerow(row + [upto - prev, missed[upto] - missed[prev]])
            prev = upto


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _table(run: DemoRun, ctl: Any, minutes: float) -> Any:
    from rich.table import Table

    t = Table(title=f"elastic demo — one compressed day — training: {run.trainer}", expand=False)
    for c in ("time of day", "req/s", "replicas", "training", "GPUs", "step", "loss", "tokens/s", "last reshard"):
        t.add_column(c, justify="right")
    if run.samples:
        x = run.samples[-1]
        hour = (3 + 24 * (x.t - run.warmup) / (minutes * 60)) % 24
        last = run.reshards[-1] if run.reshards else None
        t.add_row(f"{int(hour):02d}:{int(hour % 1 * 60):02d}", f"{x.rate:.1f}", str(x.replicas), x.layout or "-",
                  str(x.training_gpus), str(x.step), f"{x.loss:.3f}" if x.loss is not None else "-",
                  f"{x.tokens_per_second:.0f}",
                  f"{last['from']}→{last['to']} {last['pause_seconds'] or 0:.2f}s" if last else "-")
    return t


def _plot(run: DemoRun, path: str, profile: Any, rate_at: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.samples
    if not s:
        return
    t = [x.t - run.warmup for x in s]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(t, [x.replicas for x in s], [x.draining for x in s], [x.training_gpus for x in s],
                 labels=["inference GPUs (serving)", "draining (out of the balancer)", "training GPUs"],
                 colors=["#4c72b0", "#8fa8d0", "#55a868"], alpha=0.6, step="post")
    ax.set_ylim(0, GPUS + 0.5)
    ax.axvspan(t[0], 0, color="grey", alpha=0.1, label="warm-up (not counted)")
    ax.set_xlabel("seconds into the compressed day (03:00 at 0; the shaded warm-up is not counted)")
    ax.set_ylabel("GPUs")
    ax2 = ax.twinx()
    ax2.plot(t, [x.rate for x in s], color="#c44e52", label="request rate (req/s)")
    ax2.set_ylabel("requests / s")
    prev = None
    for x in s:
        if x.layout and x.layout != prev:
            ax.annotate(x.layout, (x.t - run.warmup, x.replicas + x.draining + x.training_gpus), fontsize=7,
                        rotation=60)
            ax.axvline(x.t - run.warmup, color="grey", lw=0.5, ls=":")
            prev = x.layout
    for kt, victim in run.kills:
        if victim:
            ax.axvline(kt - run.warmup, color="#c44e52", lw=1.2, ls="--", label=f"worker {victim} killed")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax.set_title(f"elastic demo: inference follows the day, training ({run.trainer}) takes the rest and "
                 "reshards in place", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
