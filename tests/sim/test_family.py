"""The scenario family and the sweep: seeded, deterministic, and a day that ramps earlier than its history."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from elastic.sim import simulate
from elastic.sim.family import family, summary, sweep, unseen_day
from elastic.sim.scenario import Scenario, rate_and_history


def _small(seed: int, n: int) -> list[tuple[str, Scenario]]:
    return family(seed, n, nodes=(16,), duration_seconds=6 * 3600.0)


def test_the_family_varies_what_the_issue_asks_for() -> None:
    days = [sc for _, sc in family(0, 24)]
    services = [s for sc in days for s in sc.services]
    assert {len(sc.services) for sc in days} == {1, 2, 3}
    assert {len(sc.jobs) for sc in days} >= {1, 2, 3}
    assert {j.min_gpus for sc in days for j in sc.jobs} == {8, 16, 64}
    assert min(s.startup_seconds for s in services) >= 60 and max(s.startup_seconds for s in services) <= 600
    sizes = {s.gpus_per_replica for s in services}
    assert 1 in sizes and 8 in sizes and 16 in sizes  # one GPU, a whole node, more than one node
    assert all(s.history_days >= 1 and s.forecast == "holt-winters" for s in services)
    shifts = [s.generator.params["today_morning_shift_seconds"] for s in services if s.generator]
    assert min(shifts) < -600 and max(shifts) > 600  # days that ramp earlier and later than their history


def test_same_family_seed_same_table() -> None:
    a = sweep(_small(5, 2))
    b = sweep(_small(5, 2))
    assert [r.as_json() for r in a] == [r.as_json() for r in b]
    assert summary(a) == summary(b)
    c = sweep(_small(6, 2))
    assert [r.as_json() for r in c] != [r.as_json() for r in a]


def test_summary_reports_the_distribution_and_the_gap() -> None:
    rows = sweep(_small(5, 3))
    s = summary(rows)
    for p in ("cosched", "static", "daynight", "oracle"):
        u = s[p]["utilization"]
        assert u["min"] <= u["p10"] <= u["median"] <= u["p90"] <= u["max"]
    gaps = sorted(r.gap for r in rows)
    assert s["gap_points"]["median"] == pytest.approx(gaps[1])
    assert s["gap_points"]["max"] == pytest.approx(gaps[-1])


def _chat_day(shift: float) -> Scenario:
    # the issue's unseen day on a 40-node pool: whole-node replicas, 4-minute start-ups, 30 s ticks
    sc = unseen_day(seed=3, morning_shift_seconds=shift)
    svc = sc.services[0].model_copy(update={"min_replicas": 6, "max_replicas": 40, "generator": sc.services[0].generator.model_copy(
        update={"params": {**sc.services[0].generator.params, "share": 40 / 278}})})
    jobs = [j.model_copy(update={"max_gpus": 320}) for j in sc.jobs]
    return sc.model_copy(update={"pool": sc.pool.model_copy(update={"nodes": 40}), "services": [svc], "jobs": jobs})


def test_a_morning_ramp_two_hours_earlier_than_the_history_still_meets_the_slo() -> None:
    early = _chat_day(-7200.0)
    usual = _chat_day(0.0)
    # the day really differs: two hours before the usual ramp, the early day needs far more
    at = np.asarray([(7.0 - 12.0) % 24 * 3600])  # 07:00, before the usual ramp
    rate_early, _, past = rate_and_history(early.services[0], Path("."), early.seed, 86400.0)
    rate_usual, _, _ = rate_and_history(usual.services[0], Path("."), usual.seed, 86400.0)
    assert rate_early(at)[0] > 1.3 * rate_usual(at)[0]
    assert rate_early(at)[0] > 1.3 * past(at - 86400.0)[0]  # and than yesterday, which the forecast learnt
    co = simulate(early, Path("."), "cosched", keep_timeline=False)
    static = simulate(early, Path("."), "static", keep_timeline=False)
    assert static.slo_attainment >= 0.999
    assert co.slo_attainment >= 0.999, co.slo_attainment
    assert co.gpu_utilization > static.gpu_utilization + 0.05


def test_cli_sweep_prints_the_rows_and_the_distribution_the_same_each_time() -> None:
    import json

    from typer.testing import CliRunner

    from elastic.cli import app
    from elastic.model import SpecError

    args = ["simulate", "--sweep", "--family-seed", "2", "--scenarios", "1", "--days", "0.05"]
    a = CliRunner().invoke(app, args + ["--json"])
    assert a.exit_code == 0, a.output
    out = json.loads(a.output)
    assert out["family_seed"] == 2 and len(out["rows"]) == 1
    assert set(out["rows"][0]) == {"scenario", "gap_points", "cosched", "static", "daynight", "oracle"}
    assert out["summary"]["scenarios"] == 1 and "gap_points" in out["summary"]
    assert CliRunner().invoke(app, args + ["--json"]).output == a.output
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "gap to oracle" in table.output and "f2-00" in table.output
    bad = CliRunner().invoke(app, ["simulate", "--sweep", "--scenario", "deepseek-day"])
    assert isinstance(bad.exception, SpecError)
