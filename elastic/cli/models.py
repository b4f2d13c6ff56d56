"""``elastic models``: the model presets and their parameter counts."""

from __future__ import annotations

import json

import typer
from rich.table import Table

# The columns in the order they give way when the terminal is narrow (the name and the
# parameter count, what a user looks a preset up for, always stay).
_DROP = ("seq", "vocab", "kv", "ffn", "heads", "hidden", "layers", "published")


def register(app: typer.Typer) -> None:
    @app.command("models")
    def models(as_json: bool = typer.Option(False, "--json", help="print JSON: one object per preset")) -> None:
        """List the model presets with their parameter counts."""
        from elastic.cli import console
        from elastic.cli._fit import fit
        from elastic.model import MODEL_PRESETS, PUBLISHED_PARAMS

        if as_json:
            rows = [{"name": m.name, "layers": m.layers, "hidden": m.hidden, "ffn_hidden": m.ffn_hidden,
                     "heads": m.heads, "kv_heads": m.kv_heads, "vocab": m.vocab, "seq_len": m.seq_len,
                     "params": m.total_params(), "active_params": m.active_params() if m.moe else None,
                     "moe_experts": m.moe.experts if m.moe else None,
                     "published_params": PUBLISHED_PARAMS.get(m.name)} for m in MODEL_PRESETS.values()]
            typer.echo(json.dumps(rows, indent=2))
            return
        t = Table(title="model presets")
        for col in ("name", "layers", "hidden", "ffn", "heads", "kv", "vocab", "seq", "params", "published"):
            t.add_column(col, justify="left" if col == "name" else "right")
        for m in MODEL_PRESETS.values():
            pub = PUBLISHED_PARAMS.get(m.name)
            extra = f" (MoE {m.moe.experts}x, active {m.active_params() / 1e9:.1f}B)" if m.moe else ""
            t.add_row(m.name, str(m.layers), str(m.hidden), str(m.ffn_hidden), str(m.heads), str(m.kv_heads),
                      str(m.vocab), str(m.seq_len), _human(m.total_params()) + extra, _human(pub) if pub else "")
        fit(t, console, _DROP)
        console.print(t)


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))
