"""``elastic simulate``: run a scenario under one or all policies and compare them.

Thin I/O shell over the pure ``elastic.sim``: parses options, prints a Rich table or JSON,
writes the plot (matplotlib, Agg backend). ``--sweep`` runs every policy over a seeded family of
days (``elastic.sim.family``) and prints one row per day and the distribution. Bad input raises
``SpecError`` (one line, exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from elastic.cli._fit import fit
from elastic.model import SpecError

POLICY_CHOICES = ("cosched", "static", "daynight", "oracle", "all")


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        scenario: str | None = typer.Option(None, "--scenario",
                                            help="scenario YAML file or a built-in name (deepseek-day)"),
        policy: str = typer.Option("all", "--policy", help="cosched | static | daynight | oracle | all"),
        as_json: bool = typer.Option(False, "--json", help="print JSON: one object per policy"),
        plot: Path | None = typer.Option(None, "--plot", help="write a PNG of the GPU split over time"),
        days: float | None = typer.Option(None, "--days", help="simulate N days instead of duration_seconds"),
        reshard_pause_scale: float = typer.Option(1.0, "--reshard-pause-scale", help="multiply every rescale pause"),
        startup_scale: float = typer.Option(1.0, "--startup-scale", help="multiply every replica start-up time"),
        sweep: bool = typer.Option(False, "--sweep", help="run every policy over a seeded family of days"),
        family_seed: int = typer.Option(0, "--family-seed", help="--sweep: the family's seed (same seed, same table)"),
        scenarios: int = typer.Option(24, "--scenarios", help="--sweep: how many days the family has"),
    ) -> None:
        """Trace-driven cluster simulation: GPU utilisation and SLO attainment per policy."""
        from elastic.sim import POLICIES, load_scenario
        from elastic.sim import simulate as run

        if sweep:
            if scenario is not None or plot is not None:
                raise SpecError("--sweep draws its own scenarios: leave out --scenario and --plot")
            if scenarios < 1:
                raise SpecError(f"--scenarios={scenarios}: must be >= 1")
            _sweep(family_seed, scenarios, as_json, days)
            return
        if scenario is None:
            raise SpecError("give --scenario (a YAML file or deepseek-day) or --sweep")

        if policy not in POLICY_CHOICES:
            raise SpecError(f"--policy {policy!r}: use one of {', '.join(POLICY_CHOICES)}")
        for name, v in (("--days", days), ("--reshard-pause-scale", reshard_pause_scale),
                        ("--startup-scale", startup_scale)):
            if v is not None and v <= 0:
                raise SpecError(f"{name}={v}: must be > 0")
        sc, base = load_scenario(scenario)
        names = list(POLICIES) if policy == "all" else [policy]
        results = {p: run(sc, base, p, days=days, reshard_pause_scale=reshard_pause_scale,  # type: ignore[arg-type]
                          startup_scale=startup_scale, keep_timeline=plot is not None) for p in names}
        if as_json:
            out = {p: r.as_json() for p, r in results.items()}
            typer.echo(json.dumps(out if policy == "all" else out[policy], indent=2, sort_keys=True))
        else:
            _table(results, scenario, sc)
        if plot is not None:
            _plot(results, plot, sc.pool.total_gpus)


def _sweep(seed: int, n: int, as_json: bool, days: float | None) -> None:
    from rich.table import Table

    from elastic.cli import console
    from elastic.sim.family import family, summary
    from elastic.sim.family import sweep as run_sweep

    rows = run_sweep(family(seed, n, duration_seconds=(days or 1.0) * 86400.0))
    dist = summary(rows)
    if as_json:
        typer.echo(json.dumps({"family_seed": seed, "rows": [r.as_json() for r in rows], "summary": dist},
                              indent=2, sort_keys=True))
        return
    policies = list(rows[0].figures)
    t = Table(title=f"scenario family seed {seed}: {n} days, utilisation / SLO per policy")
    t.add_column("scenario")
    for p in policies:
        t.add_column(p, justify="right")
    t.add_column("gap to oracle", justify="right")
    for r in rows:
        t.add_row(r.scenario, *(f"{u:.2%} / {s:.3%}" for u, s in r.figures.values()), f"{r.gap:+.2f} pt")
    fit(t, console)
    console.print(t)
    d = Table(title="distribution over the family (utilisation / SLO)")
    d.add_column("policy")
    for q in ("min", "p10", "median", "p90", "max"):
        d.add_column(q, justify="right")
    d.add_column("days SLO < 99.9%", justify="right")
    for p in policies:
        u, s = dist[p]["utilization"], dist[p]["slo"]
        d.add_row(p, *(f"{u[q]:.2%} / {s[q]:.3%}" for q in ("min", "p10", "median", "p90", "max")),
                  str(dist[p]["slo_below_goal"]))
    fit(d, console)
    console.print(d)
    g = dist["gap_points"]
    console.print(f"gap to oracle (utilisation points): median {g['median']:.2f}, worst 10% from {g['p90']:.2f}, "
                  f"max {g['max']:.2f}; days where cosched misses 99.9% and static keeps it: "
                  f"{', '.join(dist['slo_misses']) or 'none'}")


def _table(results: dict, scenario: str, sc) -> None:
    from rich.table import Table

    from elastic.cli import console

    sources = {r.throughput_source for r in results.values()}
    t = Table(title=f"{scenario}: {sc.pool.nodes} nodes x {sc.pool.gpus_per_node} GPUs "
                    f"({sc.pool.hardware}), throughput from {', '.join(sorted(sources))}")
    for col in ("policy", "GPU util", "SLO", "inference GPU-h", "training GPU-h", "tokens",
                "rescales", "pause share", "idle GPU-h"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for p, r in results.items():
        t.add_row(p, f"{r.gpu_utilization:.2%}", f"{r.slo_attainment:.3%}", f"{r.inference_gpu_hours:,.0f}",
                  f"{r.training_gpu_hours:,.0f}", f"{r.training_tokens:.3g}", str(r.rescales),
                  f"{r.rescale_pause_fraction:.2%}", f"{r.idle_gpu_hours:,.0f}")
    # at 80 columns (piped) the policy, its utilisation and SLO stay; the rest gives way in this order
    fit(t, console, ("idle GPU-h", "pause share", "rescales", "tokens", "training GPU-h",
                     "inference GPU-h"))
    console.print(t)


def _plot(results: dict, path: Path, total: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, (p, r) in zip(axes[:, 0], results.items(), strict=True):
        tl = r.timeline
        hours = [t / 3600.0 for t in tl["t"]]
        ax.stackplot(hours, tl["inference"], tl["training"], tl["idle"],
                     labels=["inference", "training", "idle/draining"], colors=["#4c72b0", "#55a868", "#dddddd"])
        ax.plot(hours, tl["load_gpus"], color="black", lw=0.8, label="load (GPU-equivalent)")
        ax.set_ylim(0, total * 1.02)
        ax.set_ylabel("GPUs")
        ax.set_title(f"{p}: utilisation {r.gpu_utilization:.1%}, SLO {r.slo_attainment:.3%}", fontsize=10)
    axes[0, 0].legend(loc="lower left", fontsize=8, ncol=4)
    axes[-1, 0].set_xlabel("hours since scenario start")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
