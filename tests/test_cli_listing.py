"""Listings read well where people use them: piped, in 80 columns, nothing cut short.

Each command runs as a user runs it (a subprocess with its stdout a pipe and ``COLUMNS=80``);
no line may be wider than 80 columns, no cell may end in Rich's ellipsis, and the values a user
looks for (a preset's name, its parameter count, a layout) appear whole. Every listing also
takes ``--json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from rich.table import Table

from elastic.cli._fit import fit
from elastic.cli.models import _human
from elastic.model import MODEL_PRESETS

ELLIPSIS = "\u2026"


def _run(*args: str, columns: int = 80) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-c", "from elastic.cli import main; main()", *args], env=env,
                         capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _check_width(text: str, columns: int = 80) -> None:
    wide = [line for line in text.splitlines() if len(line) > columns]
    assert not wide, f"{len(wide)} line(s) wider than {columns}: {wide[0]!r}"
    assert ELLIPSIS not in text, "a cell was cut short"


def test_models_in_80_columns_shows_every_name_and_count_whole() -> None:
    out = _run("models")
    _check_width(out)
    for m in MODEL_PRESETS.values():
        assert any(m.name in line.split() for line in out.splitlines()), m.name
        assert _human(m.total_params()) in out, (m.name, _human(m.total_params()))
    assert "left out to fit the width" in out  # and it says which columns it dropped


def test_models_wide_keeps_every_column() -> None:
    out = _run("models", columns=160)
    _check_width(out, 160)
    for col in ("layers", "hidden", "ffn", "heads", "kv", "vocab", "seq", "params", "published"):
        assert col in out, col
    assert "left out" not in out


def test_models_json_has_every_preset() -> None:
    rows = json.loads(_run("models", "--json"))
    assert [r["name"] for r in rows] == list(MODEL_PRESETS)
    by_name = {r["name"]: r for r in rows}
    assert by_name["llama3-405b"]["params"] == MODEL_PRESETS["llama3-405b"].total_params()
    assert by_name["deepseek-v3"]["moe_experts"] == MODEL_PRESETS["deepseek-v3"].moe.experts


def test_plan_in_80_columns_shows_layouts_whole() -> None:
    out = _run("plan", "--model", "gpt3-175b", "--gpus", "64", "--top", "3")
    _check_width(out)
    rows = json.loads(_run("plan", "--model", "gpt3-175b", "--gpus", "64", "--top", "3", "--json"))
    layouts = [p["layout"] for p in rows["plans"]] if isinstance(rows, dict) and "plans" in rows else \
        [p["layout"] for p in rows]
    assert layouts
    for lay in layouts:
        assert lay in out, lay


def test_reshard_plan_in_80_columns() -> None:
    out = _run("reshard-plan", "--model", "gpt-100m", "--from", "tp1.pp1.dp4", "--to", "tp1.pp1.dp2")
    _check_width(out)
    assert "leaves" in out
    assert json.loads(_run("reshard-plan", "--model", "gpt-100m", "--from", "tp1.pp1.dp4", "--to",
                           "tp1.pp1.dp2", "--json"))


@pytest.mark.parametrize("width", [40, 80, 120])
def test_fit_drops_listed_columns_then_folds_never_cuts(width: int) -> None:
    console = Console(width=width, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    t = Table(title="t")
    for col in ("name", "a", "b", "c", "value"):
        t.add_column(col)
    t.add_row("megatron-145.6b", "1" * 20, "2" * 20, "3" * 20, "405.85B")
    dropped = fit(t, console, ("a", "b", "c"))
    with console.capture() as cap:
        console.print(t)
    text = cap.get()
    assert ELLIPSIS not in text
    assert all(len(line) <= width for line in text.splitlines())
    assert "megatron-145.6b" in text and "405.85B" in text  # whole, on one line
    # at 120 everything fits; narrower, columns give way in the order given, and only as many as needed
    assert dropped == {120: [], 80: ["a"], 40: ["a", "b", "c"]}[width]


def test_admin_listings_in_80_columns_keep_names_and_numbers_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """`elastic get jobs|services` and `elastic decisions` piped: the less important columns give way
    so that a job's name, its layout and its tokens/s, and a decision's action, stay on one line whole."""
    import elastic.cli as cli
    from elastic.cli import admin

    out = Console(width=80, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    monkeypatch.setattr(cli, "console", out)
    job = {"name": "gpt-pretrain", "pool": "h100-east", "spec": {"min_gpus": 8, "max_gpus": 512},
           "status": {"phase": "Running", "layout": "tp8.pp16.dp15", "worldSize": 1920, "step": 123456,
                      "checkpointStep": 123000, "tokensPerSecond": 2803412, "loss": 2.3456789,
                      "reason": "SpareCapacity"}}
    svc = {"name": "chat-frontend", "pool": "h100-east", "spec": {"min_replicas": 1, "max_replicas": 64,
                                                                  "gpus_per_replica": 8, "metric": {"target": 13}},
           "status": {"currentReplicas": 40, "desiredReplicas": 42, "observedValue": 517.25,
                      "reason": "InferenceDemand"}}
    admin._table(admin.JOB_COLUMNS, [admin.job_row(job)], drop=admin._DROP["jobs"])
    admin._table(admin.SERVICE_COLUMNS, [admin.service_row(svc)], drop=admin._DROP["services"])
    admin._table(admin.DECISION_COLUMNS, [["17", "2030-01-01 12:00:00Z", "h100-east", "scale_inference_up",
                                           "chat-frontend", "InferenceDemand", "scale up 40 -> 42 replicas"]],
                 drop=("POOL", "ID"))
    text = out.export_text()
    _check_width(text)
    words = {w for line in text.splitlines() for w in line.split()}
    for whole in ("gpt-pretrain", "tp8.pp16.dp15", "1920", "123456", "SpareCapacity", "chat-frontend", "40", "42",
                  "scale_inference_up", "InferenceDemand"):
        assert whole in words, (whole, text)
    assert "left out to fit the width" in text
