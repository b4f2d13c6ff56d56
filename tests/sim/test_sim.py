"""Simulator: scenario validation, traces, the published day's shape, policies, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from elastic.model import SpecError
from elastic.sim import load_scenario, read_trace, simulate
from elastic.sim.scenario import deepseek_nodes
from elastic.sim.throughput import rescale_pause

SMALL = """
pool: {nodes: 6, gpus_per_node: 8, hardware: h800-80g}
services:
  - name: chat
    trace: load.csv
    gpus_per_replica: 8
    capacity_rps_per_replica: 10
    ttft_slo_seconds: 2
    startup_seconds: 60
    min_replicas: 1
    max_replicas: 6
    behavior: {scaleUp: {tolerance: 0.0}, scaleDown: {stabilizationWindowSeconds: 120, tolerance: 0.0}}
jobs:
  - {name: t, model: llama3-8b, min_gpus: 8, max_gpus: 48, global_batch: 512}
duration_seconds: 14400
tick_seconds: 60
seed: 1
scheduler: {rescale_interval_seconds: 120, gain_threshold: 0.02}
"""
# a 4-hour day: 5.5 replicas of load, down to 1.5, back up
TRACE = "t_seconds,requests_per_second\n0,55\n3600,55\n5400,15\n9000,15\n10800,55\n14400,55\n"


@pytest.fixture
def small(tmp_path: Path) -> Path:
    (tmp_path / "load.csv").write_text(TRACE)
    p = tmp_path / "small.yaml"
    p.write_text(SMALL)
    return p


def test_deepseek_day_shape_matches_the_published_figures() -> None:
    t = np.arange(0, 86400, 5.0)
    nodes = deepseek_nodes(t)
    assert nodes.max() == 278  # peak
    assert abs(nodes.mean() - 226.75) < 0.1  # published average
    assert abs(nodes.min() - 278 / 4) < 2  # night trough near a quarter of the peak
    night = deepseek_nodes(np.arange(12 * 3600, 17 * 3600, 1800.0))  # 00:00 .. 05:00
    steps = -np.diff(night)
    assert steps.max() <= 31 and (steps > 0).sum() >= 5, "the evening descends in ~30-node steps"


def test_small_scenario_cosched_beats_static_and_keeps_the_slo(small: Path) -> None:
    sc, base = load_scenario(small)
    res = {p: simulate(sc, base, p) for p in ("static", "cosched", "oracle", "daynight")}
    st, co, orc = res["static"], res["cosched"], res["oracle"]
    assert st.training_gpu_hours == 0 and st.slo_attainment == 1.0
    # static: ceil(5.5) = 6 replicas fill the pool; busy share = mean load 40 rps / (6 x 10 rps)
    assert st.gpu_utilization == pytest.approx(40 / 60, abs=0.005)
    assert co.gpu_utilization > st.gpu_utilization + 0.1
    assert co.slo_attainment >= 0.999
    assert orc.gpu_utilization >= co.gpu_utilization - 0.02
    assert co.training_tokens > 0 and co.rescales >= 2
    for r in res.values():
        j = r.as_json()
        assert set(j) == {"gpu_utilization", "slo_attainment", "inference_gpu_hours", "training_gpu_hours",
                          "training_tokens", "rescales", "rescale_pause_fraction", "idle_gpu_hours"}
        assert 0 <= j["gpu_utilization"] <= 1 and 0 <= j["slo_attainment"] <= 1
        hours = j["inference_gpu_hours"] + j["training_gpu_hours"] + j["idle_gpu_hours"]
        assert hours == pytest.approx(48 * 4, rel=1e-6)


def test_longer_pauses_and_startup_cost_something(small: Path) -> None:
    sc, base = load_scenario(small)
    base_run = simulate(sc, base, "cosched")
    slow = simulate(sc, base, "cosched", reshard_pause_scale=10.0, startup_scale=2.0)
    assert slow.rescale_pause_fraction > base_run.rescale_pause_fraction
    assert slow.gpu_utilization < base_run.gpu_utilization


def _with_service(sc, **kw):
    return sc.model_copy(update={"services": [s.model_copy(update=kw) for s in sc.services]})


def test_a_grow_onto_draining_gpus_trains_on_its_old_count_until_the_drain_ends(small: Path) -> None:
    sc, base = load_scenario(small)
    quick = simulate(_with_service(sc, drain_seconds=0.0), base, "cosched", keep_timeline=False)
    slow = simulate(_with_service(sc, drain_seconds=600.0), base, "cosched", keep_timeline=False)
    # the evening's freed GPUs reach training 10 minutes later: fewer busy GPU-hours and tokens
    assert slow.gpu_utilization < quick.gpu_utilization - 0.005
    assert slow.training_tokens < quick.training_tokens
    assert slow.training_gpu_hours == pytest.approx(quick.training_gpu_hours)  # held (reserved) all the same


def test_drain_ahead_gives_training_the_freed_gpus_sooner_and_keeps_the_slo(small: Path) -> None:
    sc, base = load_scenario(small)
    plain = simulate(_with_service(sc, drain_seconds=100.0), base, "cosched", keep_timeline=False)
    ahead = simulate(_with_service(sc, drain_seconds=100.0, drain_ahead_seconds=100.0), base, "cosched",
                     keep_timeline=False)
    assert ahead.gpu_utilization > plain.gpu_utilization
    assert ahead.training_tokens > plain.training_tokens
    assert ahead.slo_attainment >= 0.999


def test_the_policy_reads_the_arrival_rate_and_the_backlog_beside_it(small: Path, monkeypatch) -> None:
    # what a request-rate source gives: the rate of arrivals, and the requests waiting apart
    # from it (a backlog folded into the rate as queue / tick is a spike the policy would chase)
    import elastic.sim.engine as engine

    seen: list[tuple[float, float, float]] = []
    real = engine.policy_decide

    def spy(ctx):
        seen.append((ctx.now, ctx.metric, ctx.backlog))
        return real(ctx)

    monkeypatch.setattr(engine, "policy_decide", spy)
    sc, base = load_scenario(small)
    slow = _with_service(sc, startup_seconds=900.0)  # the ramp outruns the start-ups: requests wait
    simulate(slow, base, "cosched", keep_timeline=False)
    ts, rs = read_trace(small.parent / "load.csv")
    assert len(seen) == 14400 // 60
    for now, metric, _ in seen:
        assert metric == pytest.approx(float(np.interp(now + 30.0, ts, rs))), now
    waiting = [b for _, _, b in seen if b > 0]
    assert waiting, "the scenario should queue requests on its morning ramp"


def test_same_seed_same_json(small: Path, tmp_path: Path) -> None:
    ds, base = load_scenario("deepseek-day")
    a = simulate(ds, base, "cosched", days=0.1, keep_timeline=False).as_json()
    b = simulate(ds, base, "cosched", days=0.1, keep_timeline=False).as_json()
    assert a == b
    other, _ = load_scenario("deepseek-day", {"seed": 8})
    assert simulate(other, base, "cosched", days=0.1).as_json() != a


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needle"), [
    ("t_seconds,requests_per_second\n0,1\n60,-2\n", "line 3: requests_per_second=-2 is negative"),
    ("t_seconds,requests_per_second\n0,1\n60,2\n30,2\n", "line 4: t_seconds=30 is not after the previous 60"),
    ("t,rps\n0,1\n", "line 1: missing column(s) t_seconds, requests_per_second"),
    ("t_seconds,requests_per_second\n0,1\n60,abc\n", "line 3: expected two numbers"),
    ("t_seconds,requests_per_second\n0,1\n", "at least two rows"),
])
def test_trace_errors_name_the_line(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        read_trace(p)
    assert needle in str(e.value)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda s: s + "colour: blue\n", "unknown field 'colour'"),
    (lambda s: s.replace("min_replicas: 1", "min_replicas: 7\n    unexpected: 1"), "unknown field 'services.0.unexpected'"),
    (lambda s: s.replace("min_replicas: 1\n    max_replicas: 6", "min_replicas: 7\n    max_replicas: 9"),
     "min_replicas need 56 GPUs but the pool has 48"),
    (lambda s: s.replace("min_gpus: 8, max_gpus: 48", "min_gpus: 48, max_gpus: 48"),
     "job 't': min_gpus=48 cannot fit beside the inference minimum"),
    (lambda s: s.replace("model: llama3-8b", "model: nope-1b"), "unknown model 'nope-1b'"),
    (lambda s: s.replace("trace: load.csv", "trace: missing.csv"), "cannot read"),
])
def test_bad_scenarios_are_rejected_clearly(small: Path, edit, needle: str) -> None:
    small.write_text(edit(SMALL))
    with pytest.raises(SpecError) as e:
        sc, base = load_scenario(small)
        simulate(sc, base, "cosched", days=0.01)
    assert needle in str(e.value)


def test_rescale_pause_model() -> None:
    from elastic.sim.scenario import ReshardCfg

    cfg = ReshardCfg(bandwidth_bytes_per_second=25e9, overhead_seconds=5.0)
    assert rescale_pause("llama3-70b", 256, 256, cfg) == 0.0
    p = rescale_pause("llama3-70b", 256, 224, cfg)
    assert 5.0 < p < 5.1  # 141 GB over 224 senders at 25 GB/s
    assert rescale_pause("llama3-70b", 256, 224, cfg, scale=10.0) == pytest.approx(10 * p)
    assert rescale_pause("llama3-70b", 0, 64, cfg) > rescale_pause("llama3-70b", 64, 56, cfg)


# ---- CLI -------------------------------------------------------------------------------------------

def test_cli_json_all_and_plot(small: Path, tmp_path: Path) -> None:
    from elastic.cli import app

    png = tmp_path / "split.png"
    r = CliRunner().invoke(app, ["simulate", "--scenario", str(small), "--policy", "all", "--json",
                                 "--plot", str(png), "--days", "0.05"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out) == {"cosched", "static", "daynight", "oracle"}
    assert png.stat().st_size > 10_000
    r = CliRunner().invoke(app, ["simulate", "--scenario", str(small), "--policy", "cosched", "--days", "0.05"])
    assert r.exit_code == 0 and "GPU" in r.output and "6 nodes" in r.output  # the Rich table


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("pool: {nodes: 1}\nduration_seconds: 60\nextra: 1\n")
    out = subprocess.run([sys.executable, "-c", "from elastic.cli import main; main()", "simulate", "--scenario",
                          str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown field 'extra'" in out.stderr and "Traceback" not in out.stderr
