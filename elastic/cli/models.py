"""``elastic models``: the model presets and their parameter counts."""

from __future__ import annotations

import typer
from rich.table import Table


def register(app: typer.Typer) -> None:
    @app.command("models")
    def models() -> None:
        """List the model presets with their parameter counts."""
        from elastic.cli import console
        from elastic.model import MODEL_PRESETS, PUBLISHED_PARAMS

        t = Table(title="model presets")
        for col in ("name", "layers", "hidden", "ffn", "heads", "kv", "vocab", "seq", "params", "published"):
            t.add_column(col, justify="left" if col == "name" else "right")
        for m in MODEL_PRESETS.values():
            pub = PUBLISHED_PARAMS.get(m.name)
            extra = f" (MoE {m.moe.experts}x, active {m.active_params() / 1e9:.1f}B)" if m.moe else ""
            t.add_row(m.name, str(m.layers), str(m.hidden), str(m.ffn_hidden), str(m.heads), str(m.kv_heads),
                      str(m.vocab), str(m.seq_len), _human(m.total_params()) + extra, _human(pub) if pub else "")
        console.print(t)


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))
