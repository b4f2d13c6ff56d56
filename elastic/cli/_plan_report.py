"""The files of ``elastic plan --report PATH``: ``PATH.json`` and ``PATH.png``; and reading ``--measured``.

Every number comes from :mod:`elastic.parallel.memory_report`; this module only writes it
down. The plot (matplotlib, Agg backend, as the demo's and the simulator's) has one stacked
bar per reported layout (its worst GPU: weights, gradients, optimizer, activations, reserve)
under the per-GPU budget line, and, for each measured layout, a panel of the predicted and
the measured bytes per component side by side (the reserve is an allowance no tensor holds,
so it is not measured and not drawn there).

Labels must stay readable: tick labels are a few short lines, totals sit above their bars,
the budget and the colours are in a legend below the axes; :func:`overlapping_labels` is
what the tests check a rendered figure with.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from elastic.model import SpecError
from elastic.parallel.memory import GiB
from elastic.parallel.memory_report import LayoutMemory, MeasuredMemory, MemoryReport

COLOURS = {"weights": "#4c72b0", "gradients": "#64b5cd", "optimizer": "#8172b2", "activations": "#dd8452",
           "reserve": "#b0b0b0"}
MEASURED = ("weights", "gradients", "optimizer", "activations")
SUFFIXES = (".json", ".png")


def report_paths(path: str) -> tuple[Path, Path]:
    """``PATH`` is a prefix: ``PATH.json`` and ``PATH.png`` (a ``.json`` or ``.png`` the user typed
    is taken off first, so ``--report mem.png`` writes ``mem.json`` and ``mem.png``)."""
    p = Path(path)
    if p.suffix in SUFFIXES:
        p = p.with_suffix("")
    if not p.name or p.name in (".", "..") or path.endswith(("/", "\\")):
        raise SpecError(f"--report {path!r}: give a file prefix such as 'reports/llama3-70b' "
                        "(it writes reports/llama3-70b.json and reports/llama3-70b.png)")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".png")


def read_measured(path: str) -> list[MeasuredMemory]:
    """The records of a ``--measured`` file: a JSON list of ``MeasuredMemory.as_json`` objects
    (as ``elastic.train.memory.write_measured`` writes), or one such object."""
    try:
        obj = json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecError(f"--measured {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"--measured {path}: not JSON ({e.msg} at line {e.lineno})") from None
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise SpecError(f"--measured {path}: the list is empty; give at least one measured record")
    return [MeasuredMemory.from_json(x, f"--measured {path} (record {i})") for i, x in enumerate(items)]


def write_report(report: MemoryReport, path: str) -> tuple[Path, Path]:
    """Write ``PATH.json`` and ``PATH.png``; return their paths."""
    js, png = report_paths(path)
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(report.as_json(), indent=1) + "\n")
    fig = render(report)
    try:
        fig.savefig(png, dpi=110)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return js, png


# --------------------------------------------------------------------------------------------
# The plot
# --------------------------------------------------------------------------------------------


def _unit(n: float) -> tuple[float, str]:
    for scale, name in ((GiB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "bytes"


def _tick(e: LayoutMemory) -> str:
    place = {0: "measured run", 1: "#1 chosen"}.get(e.place, f"#{e.place}")
    if e.place == 0 and e.measured is None:
        place = "given layout"
    p, pp = e.worst.pp_rank, e.plan.layout.pp
    stage = ("one stage" if pp == 1 else f"worst: first of {pp} stages" if p == 0
             else f"worst: last of {pp} stages" if p == pp - 1 else f"worst: stage {p} of 0..{pp - 1}")
    choice = f"mb {e.plan.micro_batch}, {e.plan.recompute}" + (", offload" if e.plan.offload else "")
    return "\n".join([str(e.plan.layout), place if e.plan.fits else f"{place}, does not fit", stage, choice])


def render(report: MemoryReport) -> Any:
    """The figure (not saved): left the layouts' worst GPUs, then one panel per measured layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    measured = [e for e in report.layouts if e.measured is not None]
    n = max(1, len(report.layouts))
    widths = [max(4.0, 1.9 * n)] + [3.6] * len(measured)
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths) + 1.2, 6.0), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    ax = axes[0][0]
    # 1. one stacked bar per layout: its worst GPU, in GiB
    xs = list(range(len(report.layouts)))
    for x, e in zip(xs, report.layouts, strict=True):
        w, bottom = e.worst, 0.0
        for name, colour in COLOURS.items():
            v = getattr(w, name) / GiB
            ax.bar(x, v, 0.6, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5)
            bottom += v
        # on a white ground above the budget line, which may pass right behind it
        ax.annotate(f"{w.total / GiB:.1f} GiB", (x, bottom), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, zorder=4,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
    ax.axhline(report.budget / GiB, color="#c44e52", ls="--", lw=1.2, zorder=3)
    top = max([report.budget] + [e.worst.total for e in report.layouts]) / GiB
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(xs, [_tick(e) for e in report.layouts], fontsize=8)
    ax.set_xlim(-0.6, len(xs) - 0.4)
    ax.set_ylabel("GiB per GPU (the stage that needs the most)")
    ax.set_title(textwrap.fill(f"{report.model} on {report.gpus} x {report.hardware}: predicted memory per GPU",
                               width=int(12 * widths[0])), fontsize=10)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles.append(Line2D([], [], color="#c44e52", ls="--", label=f"per-GPU budget {report.budget / GiB:.0f} GiB"))
    # 2. predicted vs measured, per component, for each measured layout
    for ax2, e in zip(axes[0][1:], measured, strict=True):
        m = e.measured
        assert m is not None
        w = e.stages[m.pp_rank]  # the prediction for the stage of the rank that held the most
        pred = [getattr(w, k) for k in MEASURED]
        got = [getattr(m, k) for k in MEASURED]
        scale, unit = _unit(max(pred + got + [1]))
        idx = range(len(MEASURED))
        ax2.bar([i - 0.2 for i in idx], [v / scale for v in pred], 0.38, color=[COLOURS[k] for k in MEASURED])
        ax2.bar([i + 0.2 for i in idx], [v / scale for v in got], 0.38, color="white", hatch="///",
                edgecolor=[COLOURS[k] for k in MEASURED])
        ax2.set_xticks(list(idx), ["weights", "grads", "optim.", "activ."], fontsize=8)
        ax2.set_ylabel(unit)
        ax2.set_title(textwrap.fill(f"{m.layout} stage {m.pp_rank}: predicted (solid) vs measured (hatched, "
                                    f"rank {m.rank}, {m.dtype}, step {m.step})", width=34), fontsize=9)
    if measured:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="measured"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def overlapping_labels(fig: Any) -> list[tuple[str, str]]:
    """Pairs of visible texts of a drawn figure whose boxes overlap (ticks, titles, totals, legend)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []
    for t in fig.findobj(Text):  # tick labels, titles, annotations, legend entries (not their wrappers)
        if not t.get_visible() or not t.get_text().strip():
            continue
        boxes.append((t.get_text(), t.get_window_extent(renderer)))
    out = []
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            inter = ba.intersection(ba, bb)  # None when apart; touching edges do not count
            if inter is not None and inter.width > 0.5 and inter.height > 0.5:
                out.append((a, b))
    return out
