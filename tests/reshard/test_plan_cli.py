"""``elastic reshard-plan``: JSON keys and values, human output, one-line errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from elastic.cli import app

KEYS = {"bytes_total_state", "bytes_needed", "bytes_lower_bound", "bytes_planned", "bytes_lower_bound_without_remap",
        "max_send_bytes", "max_recv_bytes", "messages", "rounds", "rank_map", "plan_seconds"}


def test_json_summary_has_exactly_the_documented_keys() -> None:
    r = CliRunner().invoke(app, ["reshard-plan", "--model", "tiny", "--from", "tp2.pp2.dp2", "--to", "tp1.pp2.dp3",
                                 "--survivors", "5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out) == KEYS
    assert out["bytes_planned"] == out["bytes_lower_bound"] <= out["bytes_lower_bound_without_remap"]
    assert out["bytes_needed"] > out["bytes_lower_bound"] > 0
    assert out["rank_map"].keys() == {"w0", "w1", "w2", "w3", "w4", "w8"}  # 5 survivors + joiner w8
    assert sorted(out["rank_map"].values()) == list(range(6))
    assert out["messages"] > 0 and out["rounds"] == 1


def test_nodes_and_staging_cap_options() -> None:
    r = CliRunner().invoke(app, ["reshard-plan", "--model", "tiny", "--from", "tp1.pp1.dp4", "--to", "tp2.pp1.dp4",
                                 "--nodes-of", "4", "--staging-cap", "200000", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    ranks = out["rank_map"]
    node = {w: int(w[1:]) // 4 if int(w[1:]) < 4 else 1 + (int(w[1:]) - 4) // 4 for w in ranks}
    for g in range(4):  # every new TP group on one node
        assert len({node[w] for w, r_ in ranks.items() if r_ // 2 == g}) == 1
    assert out["rounds"] > 1


def test_human_output_shows_bytes_and_bars() -> None:
    r = CliRunner().invoke(app, ["reshard-plan", "--model", "tiny", "--from", "tp2.pp2.dp1", "--to", "tp1.pp2.dp2"])
    assert r.exit_code == 0, r.output
    assert "lower bound (with remap)" in r.output and "per-worker traffic" in r.output and "█" in r.output


def test_bad_layout_is_a_user_error() -> None:
    from elastic.cli import main  # noqa: F401 - main() maps SpecError to exit 2; CliRunner sees the exception
    from elastic.model import SpecError

    r = CliRunner().invoke(app, ["reshard-plan", "--model", "tiny", "--from", "tp2.pp2.dp1", "--to", "tp3.pp1.dp1"])
    assert isinstance(r.exception, SpecError)
    assert "tp=3 does not divide heads=4" in str(r.exception)
