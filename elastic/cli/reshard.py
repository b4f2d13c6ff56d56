"""``elastic reshard-plan``: plan a checkpoint-free reshard between two layouts and show it.

Old workers ``w0..w{n-1}`` hold old ranks ``0..n-1``; the first ``--survivors`` stay, joiners
``w{n}...`` fill the rest of the new layout. Planning only: nothing moves.
"""

from __future__ import annotations

import json
import time

import typer
from rich.table import Table

from elastic.cli._fit import fit

_ROWS_SHOWN = 24


def register(app: typer.Typer) -> None:
    @app.command("reshard-plan")
    def reshard_plan(
        model: str = typer.Option(..., "--model", help="preset name or model file (.yaml/.json)"),
        from_: str = typer.Option(..., "--from", help="old layout, e.g. tp8.pp16.dp16"),
        to: str = typer.Option(..., "--to", help="new layout, e.g. tp8.pp8.dp24"),
        survivors: int | None = typer.Option(None, "--survivors", help="old workers that stay (default: min(old, new))"),
        nodes_of: int | None = typer.Option(None, "--nodes-of", help="K consecutive workers per node (joiners on new nodes)"),
        staging_cap: int | None = typer.Option(None, "--staging-cap", help="max bytes a worker sends+receives per round"),
        bytes_per_element: int = typer.Option(4, "--bytes-per-element", help="4 for fp32 state, 2 for bf16"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    ) -> None:
        """Plan moving a model's training state from one layout to another, peer to peer."""
        from elastic.cli import console
        from elastic.model import Layout, SpecError, load_model
        from elastic.reshard.plan import plan_reshard

        m = load_model(model)
        old, new = Layout.parse(from_), Layout.parse(to)
        n_old, n_new = old.world_size, new.world_size
        s = min(n_old, n_new) if survivors is None else survivors
        if not 0 <= s <= min(n_old, n_new):
            raise SpecError(f"--survivors={s}: must be between 0 and min(old world {n_old}, new world {n_new})")
        if nodes_of is not None and nodes_of < 1:
            raise SpecError(f"--nodes-of={nodes_of}: must be >= 1 workers per node")
        old_ws = [f"w{i}" for i in range(n_old)]
        new_workers = old_ws[:s] + [f"w{n_old + i}" for i in range(n_new - s)]
        nodes = None
        if nodes_of:
            nodes = {w: f"node{i // nodes_of}" for i, w in enumerate(old_ws)}
            first_new = -(-n_old // nodes_of)  # joiners start on fresh nodes
            nodes |= {w: f"node{first_new + i // nodes_of}" for i, w in enumerate(new_workers[s:])}
        t0 = time.perf_counter()
        plan = plan_reshard(m, old, {w: i for i, w in enumerate(old_ws)}, new, new_workers, nodes=nodes,
                            staging_cap_bytes=staging_cap, bytes_per_element=bytes_per_element)
        seconds = time.perf_counter() - t0
        summary = {
            "bytes_total_state": plan.bytes_total_state,
            "bytes_needed": plan.bytes_needed,
            "bytes_lower_bound": plan.bytes_lower_bound,
            "bytes_planned": plan.bytes_planned,
            "bytes_lower_bound_without_remap": plan.bytes_lower_bound_without_remap,
            "max_send_bytes": plan.max_send_bytes,
            "max_recv_bytes": plan.max_recv_bytes,
            "messages": len(plan.messages),
            "rounds": plan.rounds,
            "rank_map": dict(plan.new_ranks),
            "plan_seconds": round(seconds, 4),
        }
        if as_json:
            print(json.dumps(summary))
            return
        _print_human(console, plan, summary, s, len(new_workers) - s)


def _print_human(console, plan, summary: dict, n_surv: int, n_join: int) -> None:  # noqa: ANN001
    console.print(
        f"[bold]{plan.model}[/]: {plan.old_layout} -> {plan.new_layout}  "
        f"({n_surv} stay, {len(plan.leavers)} leave, {n_join} join; planned in {summary['plan_seconds']:.2f} s)"
    )
    t = Table(show_header=False, box=None)
    moved = [w for w, r in plan.new_ranks.items() if plan.old_ranks.get(w, r) != r and w in plan.old_ranks]
    for label, value in [
        ("state (one copy)", _b(plan.bytes_total_state)),
        ("needed by the new layout", _b(plan.bytes_needed)),
        ("lower bound (with remap)", _b(plan.bytes_lower_bound)),
        ("lower bound (no remap)", _b(plan.bytes_lower_bound_without_remap)),
        ("planned", f"{_b(plan.bytes_planned)} in {summary['messages']:,} messages, {plan.rounds} round(s)"),
        ("max send / recv per worker", f"{_b(plan.max_send_bytes)} / {_b(plan.max_recv_bytes)}"),
        ("survivors given a new rank", f"{len(moved)}"),
    ]:
        t.add_row(label, value)
    fit(t, console)
    console.print(t)
    busiest = sorted(plan.members, key=lambda w: -max(plan.send_bytes.get(w, 0), plan.recv_bytes.get(w, 0)))
    top = max(plan.max_send_bytes, plan.max_recv_bytes, 1)
    bars = Table(title=f"per-worker traffic (busiest {min(_ROWS_SHOWN, len(busiest))} of {len(busiest)})")
    for col in ("worker", "old", "new", "send", "", "recv", ""):
        bars.add_column(col, justify="right" if col in ("old", "new", "send", "recv") else "left")
    for w in busiest[:_ROWS_SHOWN]:
        snd, rcv = plan.send_bytes.get(w, 0), plan.recv_bytes.get(w, 0)
        bars.add_row(w, str(plan.old_ranks.get(w, "-")), str(plan.new_ranks.get(w, "leaves")),
                     _b(snd), _bar(snd, top, "cyan"), _b(rcv), _bar(rcv, top, "magenta"))
    fit(bars, console, ("old", "new"))
    console.print(bars)


def _b(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{int(n)} B"


def _bar(v: int, top: int, colour: str, width: int = 12) -> str:
    n = round(width * v / top) if top else 0
    return f"[{colour}]{'█' * n}[/]{'·' * (width - n)}"
