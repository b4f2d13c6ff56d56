"""``elastic demo``'s embedded configuration is valid and sized as its docstring says."""

from __future__ import annotations

import math
import time

import pytest

from elastic.config import load_config
from elastic.demo import (
    GPUS,
    MAX_TOKENS,
    SLOTS,
    TARGET,
    TOKENS_PER_SECOND,
    Sample,
    clairvoyant_on_arrivals,
    demo_config,
    utilization_bound,
)
from elastic.model import Layout
from elastic.serve.profiles import diurnal_rate


@pytest.mark.parametrize("minutes,tick", [(5.0, 2.0), (2.0, 1.0), (30.0, 5.0)])
def test_demo_config_loads(minutes: float, tick: float) -> None:
    cfg = load_config(data=demo_config(minutes, tick))
    svc, job = cfg.services[0], cfg.jobs[0]
    assert cfg.pool.total_gpus == GPUS
    assert (svc.min_replicas, svc.max_replicas, svc.gpus_per_replica) == (1, 6, 1)
    assert svc.metric.target == TARGET < SLOTS  # headroom between the SLO capacity and the batch
    assert svc.metric.window_seconds > 0  # shrink on the window mean, grow on the latest reading
    # every GPU count training can get next to the inference minimum has a data-parallel layout
    assert all(job.global_batch % n == 0 for n in range(1, GPUS - svc.min_replicas + 1))


def test_the_day_fits_the_service() -> None:
    # Little's law: concurrency = rate x request time; the peak must fit max_replicas x target
    request_seconds = MAX_TOKENS / TOKENS_PER_SECOND
    peak = 11.0  # the CLI default
    need = max(diurnal_rate(f / 96, peak) for f in range(96)) * request_seconds / TARGET
    assert need <= 6, f"the default day needs {need:.2f} replicas of capacity {TARGET}, more than max 6"
    assert math.ceil(need) == 6  # ... and uses the pool at its peak (a pool sized for the peak)


def _bound(rate, start=10.0, end=70.0, **kw):
    args = dict(request_seconds=4.0, capacity=10.0, min_replicas=1, max_replicas=6, gpus=8)
    return utilization_bound(rate, start, end, **{**args, **kw})


def test_clairvoyant_bound_loses_only_the_rounding_to_whole_replicas() -> None:
    # concurrency = rate x 4 s; capacity 10 per replica
    assert _bound(lambda t: 5.0) == pytest.approx(1.0)  # 20 in flight: exactly 2 busy replicas
    assert _bound(lambda t: 3.75) == pytest.approx((1.5 + 6) / 8)  # 15: 2 replicas, 1.5 busy
    assert _bound(lambda t: 0.0) == pytest.approx(7 / 8)  # the minimum replica idles
    assert _bound(lambda t: 100.0) == pytest.approx(1.0)  # beyond max: 6 replicas, all busy
    # Little's law with history: a step from 0 to 5 req/s at t=10 fills up over 4 s
    step = _bound(lambda t: 5.0 if t >= 10.0 else 0.0, start=10.0, end=14.0)
    assert 7 / 8 < step < 1.0


def test_the_clairvoyant_controller_on_real_arrivals_loses_what_their_jitter_leaves_idle() -> None:
    args = dict(request_seconds=4.0, capacity=10.0, min_replicas=1, max_replicas=6, gpus=8)

    def samples(running: list[float]) -> list[Sample]:
        return [Sample(10.0 + i, 5.0, 2, 0.0, 6, 6, None, 0, None, 0.0, running=r) for i, r in enumerate(running)]

    # 5 req/s x 4 s = 20 expected in flight: two replicas of capacity 10, whatever the arrivals
    assert clairvoyant_on_arrivals(samples([20.0] * 4), lambda t: 5.0, 10.0, **args) == pytest.approx(1.0)
    # the same mean, scattered: below 20 the two replicas are under capacity, above it full
    jitter = clairvoyant_on_arrivals(samples([15.0, 25.0] * 4), lambda t: 5.0, 10.0, **args)
    assert jitter == pytest.approx((1.5 + 6 + 2 + 6) / 16)
    assert jitter < _bound(lambda t: 5.0)  # the bound on the expected load does not see the jitter
    # samples before the start (the warm-up) do not count; too few samples: nothing to say
    warm = samples([0.0] * 5 + [20.0] * 5)
    assert clairvoyant_on_arrivals(warm, lambda t: 5.0, 15.0, **args) == pytest.approx(1.0)
    assert clairvoyant_on_arrivals(samples([20.0]), lambda t: 5.0, 10.0, **args) is None


def test_the_demo_day_bound_is_what_the_readme_quotes() -> None:
    from elastic.serve.profiles import DiurnalProfile, rate_at

    day, warmup = 300.0, 15.0
    prof = DiurnalProfile(peak=11.0, day_seconds=day, start_fraction=0.125 - warmup / day)
    b = utilization_bound(lambda t: rate_at(prof, t), warmup, warmup + day,
                          request_seconds=MAX_TOKENS / TOKENS_PER_SECOND, capacity=TARGET,
                          min_replicas=1, max_replicas=6, gpus=GPUS)
    assert 0.92 < b < 0.935


def test_the_summary_counts_only_this_runs_reshards(tmp_path) -> None:
    # ./elastic.db outlives a demo run: the next run's summary must not count (or subtract the
    # pauses of) the reshards an earlier run recorded, however many there were
    from types import SimpleNamespace

    from elastic import store as db
    from elastic.demo import JOB, DemoRun, _collect_reshards, last_reshard_id

    url = f"sqlite:///{tmp_path / 'elastic.db'}"
    db.upgrade(url)
    store = db.Store.from_url(url)

    def reshard(gen: int, pause: float, *, finish: bool = True) -> int:
        rid = db.start_reshard(store, job=JOB, pool="demo", generation=gen, from_layout="tp1.pp1.dp2",
                               to_layout="tp1.pp1.dp3", bytes_planned=10, bytes_lower_bound=10)
        if finish:
            db.finish_reshard(store, rid, bytes_moved=10, pause_seconds=pause)
        return rid

    for g in range(250):  # an earlier run: more than one page of events
        reshard(g, 9.0)
    assert last_reshard_id(store) == 250
    run, ctl = DemoRun(reshards_after_id=last_reshard_id(store)), SimpleNamespace(store=store)
    reshard(1000, 0.1)
    in_flight = reshard(1001, 0.0, finish=False)
    _collect_reshards(ctl, run)
    assert [r["pause_seconds"] for r in run.reshards] == [0.1]  # the one in flight waits
    db.finish_reshard(store, in_flight, bytes_moved=10, pause_seconds=0.2)
    _collect_reshards(ctl, run)
    _collect_reshards(ctl, run)  # idempotent
    assert [(r["id"], r["pause_seconds"]) for r in run.reshards] == [(251, 0.1), (252, 0.2)]
    empty = DemoRun(reshards_after_id=0)
    _collect_reshards(ctl, empty)  # from the start of the file: every page is read
    assert len(empty.reshards) == 252


def test_a_recovery_is_counted_apart_from_the_rescales_and_not_subtracted_twice() -> None:
    # the sampler already counts the job idle while it recovers; its reshard row must not add to the
    # rescale pauses (nor be subtracted from training time a second time)
    from types import SimpleNamespace

    from elastic.demo import DemoRun, Sample, _summary, day_offset

    run = DemoRun(warmup=0.0)
    run.samples = [Sample(float(t), 1.0, 1, 1.0, 2, 2, Layout(1, 1, 2 if t else 1), t, 1.0, 1.0) for t in range(11)]
    run.reshards = [
        {"id": 1, "generation": 2, "from": "tp1.pp1.dp1", "to": "tp1.pp1.dp2", "status": "done", "pause_seconds": 0.5},
        {"id": 2, "generation": 3, "from": "tp1.pp1.dp2", "to": "tp1.pp1.dp1", "status": "done", "pause_seconds": 3.0},
    ]
    run.recovered, run.kills = {3}, [(5.0, "gpt-tiny-w1")]
    report = SimpleNamespace(results=[], slo_attainment=lambda *a, **k: 1.0, ttft_quantile=lambda *a, **k: None)
    s = _summary(run, report, 1.0, None, 10.0, 0.0)
    assert (s["reshards"], s["mean_reshard_pause_seconds"], s["recoveries"], s["recovery_seconds"],
            s["workers_killed"]) == (1, 0.5, 1, [3.0], 1)
    assert s["layouts"] == ["tp1.pp1.dp1", "tp1.pp1.dp2"]  # every layout the job ran on, in order
    # 11 samples of 1 s: 2 training GPUs busy each, minus the one rescale's 0.5 s x 2 GPUs (the
    # larger of its layouts: the samples show either during the pause)
    assert s["training_busy_fraction"] == pytest.approx((22 - 1.0) / (8 * 11), abs=1e-4)
    assert day_offset("03:00") == 0.0 and day_offset("15:00") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="HH:MM"):
        day_offset("noon")


@pytest.mark.parametrize("phase, layout, busy", [("Rescaling", "tp1.pp1.dp3", 3), ("Rescaling", "tp1.pp1.dp1", 1),
                                                 ("Running", "tp1.pp1.dp2", 2), ("Paused", "tp1.pp1.dp1", 0)])
def test_training_counts_the_gpus_of_the_layout_that_steps_not_the_backends_books(phase, layout, busy) -> None:
    """The backend books a rescale's GPUs when its call returns; the coordinator's layout says who steps:
    a grow's joiner from the switch step on (dp3 on 2 booked GPUs), not a shrink's leaver (dp1 on 2)."""
    import threading
    from types import SimpleNamespace

    from elastic.demo import DemoRun, _sample_loop

    rt = SimpleNamespace(gpus=("g0", "g1"), layout=Layout.parse(layout), phase=phase, step=5, loss=1.0,
                         tokens_per_second=9.0)
    backend = SimpleNamespace(service_targets=lambda s: [], draining_targets=lambda s: [], job_runtime=lambda j: rt)
    run, stop = DemoRun(), threading.Event()
    t = threading.Thread(target=_sample_loop, args=(backend, None, None, 0.0, run, stop, lambda p, t: 1.0, 13.0),
                         kwargs={"every": 0.01})
    t.start()
    deadline = time.monotonic() + 30
    while not run.samples and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(5)
    assert run.samples, "the sampler took no sample (it raised, or never ran)"
    x = run.samples[0]
    assert (x.training_gpus, x.training_busy, x.layout) == (2, busy, Layout.parse(layout))


def test_the_demo_job_keeps_a_full_optimizer_copy_per_replica_when_a_worker_is_to_be_killed() -> None:
    job = load_config(data=demo_config(5.0, 2.0, replicated=True)).jobs[0]
    assert job.replicate_optimizer and not job.zero  # a killed worker is recovered from its replica
    assert job.memory_limit_bytes is None  # data-parallel layouts only, without ZeRO-1
    default = load_config(data=demo_config(5.0, 2.0)).jobs[0]
    assert not default.replicate_optimizer and default.memory_limit_bytes is not None


class _Job:
    """The backend's view of the demo job at one tick (our boundary: the real backend is Ray)."""

    def __init__(self, phase: str, step: int) -> None:
        self.phase, self.step, self.gpus = phase, step, ("g",) * 7
        self.loss = 5.5 if step else None


@pytest.mark.parametrize("runs_after, expected, ticks", [(3, True, 3), (None, False, None)])
def test_the_day_waits_for_the_training_jobs_cold_start(runs_after, expected, ticks) -> None:
    """``_wait_job_started`` ticks the controller until the job steps (a job Running at step 0 has not
    stepped yet), or gives up after its timeout with a line on the console: the day starts anyway."""
    from rich.console import Console

    from elastic.demo import _wait_job_started

    class Ctl:
        n = 0

        def tick(self):
            self.n += 1
            return type("R", (), {"error": None})()

    class Backend:
        def job_runtime(self, job):
            if runs_after is not None and ctl.n >= runs_after:
                return _Job("Running", 1)
            return _Job("Pending", 0) if ctl.n < 2 else _Job("Running", 0)

    ctl, console, losses = Ctl(), Console(record=True, width=200), []
    assert _wait_job_started(ctl, Backend(), console, wait_s=0.3, tick_seconds=0.01, losses=losses) is expected
    assert losses == ([(1, 5.5)] if expected else [])  # the job's first loss, once: the summary's loss_first
    out = console.export_text()
    assert "starting training job" in out
    if ticks is not None:
        assert ctl.n == ticks and "not running" not in out
    else:
        assert ctl.n > 3 and "not running after 0 s (Running); the day starts anyway" in out


def test_the_summary_says_why_requests_failed() -> None:
    """``failed_by_status``: the failed requests of the measured day by HTTP status (0 = no answer),
    summing to ``failed_requests``; an answered-but-cut request counts under 200, warm-up ones not at all."""
    from elastic.demo import DemoRun, _summary
    from elastic.serve.loadgen import Report, Result

    ok = dict(status=200, ttft=0.1, e2e=6.4, tokens=32, complete=True)
    report = Report(results=[
        Result(sent_at=1.0, target="a", **ok),
        Result(sent_at=2.0, target="a", status=0),  # timed out
        Result(sent_at=3.0, target="a", status=503),
        Result(sent_at=4.0, target="a", status=200, ttft=0.2, tokens=5, complete=False),  # cut short
        Result(sent_at=5.0, target="a", status=0),
        Result(sent_at=-1.0, target="a", status=0),  # warm-up: not counted
    ])
    s = _summary(DemoRun(), report, 1.0, None, 10.0, 0.0)
    assert s["failed_by_status"] == {"0": 2, "200": 1, "503": 1}
    assert s["failed_requests"] == 4 and s["truncated_requests"] == 1


def test_the_timeline_counts_each_seconds_requests_and_slo_misses(tmp_path) -> None:
    import csv

    from elastic.demo import DemoRun, Sample, _write_timeline
    from elastic.serve.loadgen import Result

    run = DemoRun(warmup=10.0)
    run.samples = [Sample(t, 1.0, 1, 0.5, 7, 7, "tp1.pp1.dp7", 1, 5.0, 1.0) for t in (10.0, 11.0, 12.0)]
    ok = dict(status=200, e2e=6.0, complete=True)
    results = [Result(9.5, "a", ttft=0.2, **ok),  # before the first row: counted in it
               Result(10.5, "a", ttft=0.3, **ok), Result(10.9, "a", ttft=1.5, **ok),  # one late
               Result(11.2, "a", 503),  # failed: a miss
               Result(11.5, "a", 200, ttft=0.4, complete=False),  # cut short: a miss
               Result(12.5, "a", ttft=0.1, **ok)]  # after the last row: in none
    path = tmp_path / "t.csv"
    _write_timeline(run, str(path), results, slo=1.0)
    rows = list(csv.DictReader(path.open()))
    assert [(float(r["t"]), int(r["sent"]), int(r["missed"])) for r in rows] == [(0.0, 1, 0), (1.0, 2, 1), (2.0, 2, 2)]


# ---- elastic demo --job: the training side as a user's own loop --------------------------------------


def _user_cfg(tmp_path, entry: str = "llama", **kw):
    from elastic.demo import resolve_job

    return load_config(data=demo_config(5.0, 2.0, resolve_job(entry, **kw), corpus=str(tmp_path / "corpus")))


@pytest.mark.parametrize("entry", ["llama", "examples.llama.job:main", "examples/llama/job.py"])
def test_the_user_job_demo_config_loads_with_the_examples_entrypoint_and_no_pause(tmp_path, entry) -> None:
    from elastic.demo import USER_JOB

    cfg = _user_cfg(tmp_path, entry)
    job = cfg.jobs[0]
    assert (job.name, job.entrypoint, job.model) == (USER_JOB, "examples.llama.job:main" if entry == "llama"
                                                     else entry, "examples/llama/model.json")
    assert job.args == ["--corpus", str(tmp_path / "corpus"), "--dtype", "float32"]
    # inference's six replicas at most never push it below its minimum of one GPU
    assert "on_below_minimum" not in job.model_fields_set and job.on_below_minimum == "pause"
    # DDP-style replicas, tp held at 1: a killed worker is recovered in place from a full copy
    assert job.dp_replicas and job.mesh_dims == {"dp": "dp_replicate", "tp": "tp"} and job.allowed_tp == [1]
    assert not job.zero and job.checkpoint is None
    # the service side is the reference demo's, unchanged
    assert cfg.services == load_config(data=demo_config(5.0, 2.0)).services
    assert cfg.pool == load_config(data=demo_config(5.0, 2.0)).pool


def test_every_gpu_count_the_planner_gives_the_user_job_splits_its_global_batch(tmp_path) -> None:
    """Training has a layout at each count it can get (1..7), every dp divides the global batch, and the
    user job runs the reference trainer's micro-batches there (the same passes of the same sizes)."""
    from elastic.backends.base import default_trainer_config
    from elastic.controller import job_throughput_tables
    from elastic.demo import demo_config
    from elastic.model import load_model
    from elastic.torch.data import rank_micro_batches
    from elastic.train.userjob import from_spec

    cfg = _user_cfg(tmp_path)
    job = cfg.jobs[0]
    table = job_throughput_tables(cfg)[job.name]
    assert sorted(table) == list(range(1, GPUS))
    user = from_spec(job, load_model(job.model))
    reference = default_trainer_config(load_config(data=demo_config(5.0, 2.0)).jobs[0])
    for n, (L, _) in table.items():
        assert L.world_size == n and L.tp == 1  # replicas only
        assert job.global_batch % L.dp == 0
        pieces = [len(p) for p in rank_micro_batches(list(range(job.global_batch)), 0, L.dp, job.micro_batch)]
        assert (user.grad_accum(L), user.micro_batch_for(L)) == (len(pieces), max(pieces))  # what the launcher checks
        assert (user.grad_accum(L), user.micro_batch_for(L)) == (reference.grad_accum(L), reference.micro_batch_for(L))


def test_the_reference_demo_config_is_unchanged_without_a_job() -> None:
    from elastic.demo import JOB

    job = load_config(data=demo_config(5.0, 2.0)).jobs[0]
    assert (job.name, job.model, job.entrypoint, job.global_batch, job.micro_batch) == (JOB, "tiny", None, 420, 1)
    assert (job.micro_batch_cap, job.precision, job.recompute, job.offload) == (36, "fp32", "selective", False)
    assert job.args == [] and not job.replicate_optimizer


def test_any_other_entrypoint_needs_its_model_file(tmp_path) -> None:
    from elastic.demo import resolve_job

    with pytest.raises(ValueError, match="--job-model"):
        resolve_job("examples.titan.job:main")
    job = resolve_job("examples.titan.job:main", "examples/titan/model.json", ["--dtype", "float32"])
    assert (job.model, job.args, dict(job.spec)) == ("examples/titan/model.json", ("--dtype", "float32"), {})
    spec = load_config(data=demo_config(5.0, 2.0, job, corpus="/c")).jobs[0]
    assert spec.args == ["--corpus", "/c", "--dtype", "float32"]
    assert spec.mesh_dims is None and not spec.dp_replicas  # the spec's defaults: dp_shard x tp
    # an example's own model file can be overridden; an entrypoint that does not import is refused at load
    assert resolve_job("llama", "examples/titan/model.json").model == "examples/titan/model.json"
    from elastic.model import SpecError

    with pytest.raises(SpecError, match="entrypoint"):
        load_config(data=demo_config(5.0, 2.0, resolve_job("nowhere.at_all:main", "examples/llama/model.json")))


def test_the_summary_and_its_goals_line_say_which_trainer_ran() -> None:
    from elastic.demo import GOALS, REFERENCE, DemoRun, _goals_line, _summary
    from elastic.serve.loadgen import Report, Result

    report = Report(results=[Result(sent_at=1.0, target="a", status=200, ttft=0.1, e2e=6.4, tokens=32, complete=True)])
    run = DemoRun(job="user-job", trainer="user job examples.llama.job:main")
    run.samples = [Sample(float(t), 1.0, 1, 1.0, 7, 7, "tp1.pp1.dp7", t, 1.0, 1.0) for t in range(5)]
    s = _summary(run, report, 1.0, None, 10.0, 0.0)
    assert (s["trainer"], s["job"], s["goals"], s["goals_met"]) == (run.trainer, "user-job", GOALS, True)
    line = _goals_line(s)
    assert line.startswith("training: user job examples.llama.job:main: gpu_utilization 1.0000 (met")
    assert "slo_attainment 1.0000 (met: goal >= 0.99)" in line
    # the reference run: no samples, utilisation 0 -> missed
    ref = _summary(DemoRun(), report, 1.0, None, 10.0, 0.0)
    assert ref["trainer"] == REFERENCE and not ref["goals_met"]
    assert "gpu_utilization 0.0000 (MISSED: goal >= 0.90)" in _goals_line(ref)
    # just under the goal: the figure rounds up to 0.9000, the goal is still missed
    under = DemoRun(job="user-job", trainer="t")
    # (1.19968 busy replica-GPUs + 6 training GPUs) / 8 = 0.89996
    under.samples = [Sample(float(t), 1.0, 2, 1.19968, 6, 6, "tp1.pp1.dp6", t, 1.0, 1.0) for t in range(5)]
    s = _summary(under, report, 1.0, None, 10.0, 0.0)
    assert s["gpu_utilization"] == 0.9 and s["goals_met_each"] == {"gpu_utilization": False, "slo_attainment": True}
    assert not s["goals_met"] and "gpu_utilization 0.9000 (MISSED: goal >= 0.90)" in _goals_line(s)


def test_the_cli_refuses_job_options_without_a_job_and_an_unknown_entrypoint_without_a_model() -> None:
    from typer.testing import CliRunner

    from elastic.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--job-model", "examples/llama/model.json"])
    assert res.exit_code == 2 and "go with --job" in res.output
    res = runner.invoke(app, ["demo", "--job", "my.train:main"])
    assert res.exit_code == 2 and "--job-model" in res.output


def test_the_demo_never_prints_its_database_password(capsys) -> None:
    from elastic.demo import run_demo
    from elastic.store import StoreError

    with pytest.raises(StoreError, match=r"u:\*\*\*@127\.0\.0\.1:1/x is unavailable"):
        run_demo(0.1, db_url="postgresql+psycopg://u:secretpw@127.0.0.1:1/x", live=False)
    out = capsys.readouterr().out
    assert "state in postgresql+psycopg://u:***@127.0.0.1:1/x" in out and "secretpw" not in out


def test_the_layouts_line_counts_the_moves_that_changed_tp_or_pp() -> None:
    from elastic.demo import _layouts_line

    line = _layouts_line({"layouts": ["tp1.pp1.dp7.z1", "tp1.pp1.dp3.z1", "tp1.pp2.dp1", "tp1.pp1.dp3.z1",
                                      "tp2.pp1.dp3"]})
    assert line == ("layouts: tp1.pp1.dp7.z1 -> tp1.pp1.dp3.z1 -> tp1.pp2.dp1 -> tp1.pp1.dp3.z1 -> tp2.pp1.dp3; "
                    "3 of 4 moves changed tensor or pipeline parallelism")
    assert _layouts_line({"layouts": []}).startswith("layouts: none; 0 of 0 moves")

