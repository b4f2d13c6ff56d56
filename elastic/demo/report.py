"""The demo's outputs for people: the live table, the timeline CSV and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.demo.config import GPUS
from elastic.demo.samples import DemoRun, Sample

if TYPE_CHECKING:
    from elastic.model import Layout


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
        t.add_row(f"{int(hour):02d}:{int(hour % 1 * 60):02d}", f"{x.rate:.1f}", str(x.replicas), str(x.layout or "-"),
                  str(x.training_gpus), str(x.step), f"{x.loss:.3f}" if x.loss is not None else "-",
                  f"{x.tokens_per_second:.0f}",
                  f"{last['from']}→{last['to']} {last['pause_seconds'] or 0:.2f}s" if last else "-")
    return t


def layout_segments(run: DemoRun) -> list[tuple[float, float, Layout]]:
    """The training layout over the run: (start, end, layout) in seconds of the day (the warm-up
    before 0), one per stretch on one layout; stretches without a layout (a job not running) are left out."""
    s = run.samples
    out: list[tuple[float, float, Layout]] = []
    for x, nxt in zip(s, [*s[1:], None], strict=True):
        end = (nxt.t if nxt is not None else x.t) - run.warmup
        if not x.layout:
            continue
        if out and out[-1][2] == x.layout and abs(out[-1][1] - (x.t - run.warmup)) < 1e-9:
            out[-1] = (out[-1][0], end, x.layout)
        else:
            out.append((x.t - run.warmup, end, x.layout))
    return out


LAYOUT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                 "#ccb974", "#64b5cd")


def _figure(run: DemoRun) -> Any:
    """The timeline: GPUs by side and the request rate over the day, and below them a strip with the
    training layout over time. Each layout has a colour (the strip's legend names them in the order
    the job first ran them); a stretch carries its layout's name only where the name fits inside it,
    so no two names overlap however often the job rescales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = run.samples
    t = [x.t - run.warmup for x in s]
    fig, (ax, strip) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [5, 1]})
    ax.stackplot(t, [x.replicas for x in s], [x.draining for x in s], [x.training_gpus for x in s],
                 labels=["inference GPUs (serving)", "draining (out of the balancer)", "training GPUs"],
                 colors=["#4c72b0", "#8fa8d0", "#55a868"], alpha=0.6, step="post")
    ax.set_ylim(0, GPUS + 0.5)
    ax.axvspan(t[0], 0, color="grey", alpha=0.1, label="warm-up (not counted)")
    ax.set_ylabel("GPUs")
    ax2 = ax.twinx()
    ax2.plot(t, [x.rate for x in s], color="#c44e52", label="request rate (req/s)")
    ax2.set_ylabel("requests / s")
    segments = layout_segments(run)
    order = list(dict.fromkeys(lay for _, _, lay in segments))
    color = {lay: LAYOUT_COLORS[i % len(LAYOUT_COLORS)] for i, lay in enumerate(order)}
    for a, b, lay in segments:
        strip.broken_barh([(a, max(b - a, 1e-6))], (0, 1), facecolors=color[lay], edgecolors="white", linewidth=0.5)
        ax.axvline(a, color="grey", lw=0.5, ls=":")
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.set_ylabel("layout", rotation=0, ha="right", va="center")
    strip.set_xlabel("seconds into the compressed day (03:00 at 0; the shaded warm-up is not counted)")
    if order:
        strip.legend(handles=[Patch(color=color[lay], label=str(lay)) for lay in order], loc="upper center",
                     bbox_to_anchor=(0.5, -0.9), ncol=min(len(order), 5), fontsize=8, frameon=False)
    for kt, victim in run.kills:
        if victim:
            ax.axvline(kt - run.warmup, color="#c44e52", lw=1.2, ls="--", label=f"worker {victim} killed")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax.set_title(f"elastic demo: inference follows the day, training ({run.trainer}) takes the rest and "
                 "reshards in place", fontsize=10)
    fig.tight_layout()
    _name_stretches(fig, strip, segments)
    return fig


def _name_stretches(fig: Any, strip: Any, segments: list[tuple[float, float, Layout]]) -> None:
    """Each stretch's layout name, centred in it, where it fits with a margin (measured once drawn)."""
    renderer = fig.canvas.get_renderer()
    for a, b, lay in segments:
        text = strip.text((a + b) / 2, 0.5, str(lay), ha="center", va="center", fontsize=7, color="white", clip_on=True)
        box = text.get_window_extent(renderer)
        left, right = (strip.transData.transform((x, 0.5))[0] for x in (a, b))
        if box.width + 4 > right - left:
            text.remove()


def _plot(run: DemoRun, path: str, profile: Any, rate_at: Any) -> None:
    import matplotlib.pyplot as plt

    if not run.samples:
        return
    fig = _figure(run)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
