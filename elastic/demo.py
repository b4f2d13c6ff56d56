"""``elastic demo``: the whole product on one machine, on a compressed day.

A local Ray with 8 logical GPUs; one inference service of reference replicas (1 GPU
each, min 1, max 6) under the load generator's diurnal day compressed to ``--minutes``;
one training job that starts on whatever is free and is rescaled in place as traffic moves:
the reference trainer's small GPT, or with ``--job`` a user's own loop under
``elastic.torch.Manager`` (:class:`UserJob`, e.g. the example Llama, on a byte-token corpus of a
few standard-library files prepared before the controller starts); the controller ticking in
between, SQLite state in ``./elastic.db``. Everything below is measured the same way for both.

GPU utilisation is measured as docs/DESIGN.md defines it, sampled every second: each ready
replica counts ``min(1, running / capacity)``, where the capacity is the load a replica is
sized for at its SLO (the service's target: 13 concurrent requests of its 16 batch slots;
above it the queue makes time-to-first-token miss 1 s); each training GPU counts 1 while
its worker is stepping: the GPUs of the coordinator's current layout (a rescale's pause,
pause x the larger of the two world sizes, is subtracted; GPUs whose joiners are still
starting count 0, a shrink's leavers count 0 from the switch step on); idle, starting and draining GPUs (a replica out
of the balancer, finishing its requests) count 0. The sum over
time is divided by 8 x elapsed time. A request counts as served only when its stream ends
as the replica meant it to: one cut short (a replica stopped under it) is a failed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
               ("RAY_USAGE_STATS_ENABLED", "0"), ("GLOO_SOCKET_IFNAME", "lo"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(_k, _v)

log = logging.getLogger("elastic.demo")

SERVICE = "chat"
JOB = "gpt-tiny"  # the reference trainer's job
USER_JOB = "user-job"  # the job of a user's own loop (--job)
REFERENCE = "reference trainer"
GPUS = 8
# A reference replica batches 16 requests; a request holds a slot for max_tokens /
# tokens_per_second = 32 / 5 = 6.4 s. The service is sized (the policy's target, the
# replica's SLO capacity) for 13 concurrent requests: above it the queue makes
# time-to-first-token miss 1 s when few replicas run.
SLOTS, TOKENS_PER_SECOND, MAX_TOKENS, TARGET = 16, 5.0, 32, 13.0
# the training job's first start, before the day's load begins (seven processes importing torch)
JOB_START_TIMEOUT_S = 180.0
# the demo's goals: GPU utilisation as defined above, and the share of the day's requests answered in
# full with their first token within the TTFT SLO
GOALS = {"gpu_utilization": 0.90, "slo_attainment": 0.99}
# what a user job of the demo trains on (``--corpus DIR``): byte tokens of these standard-library files
CORPUS_FILES = ("dataclasses.py", "functools.py", "textwrap.py")


@dataclass(frozen=True)
class UserJob:
    """The demo's training side as a user's own loop (``elastic demo --job``): what its TrainingSpec
    names besides the demo's sizing. Its workers get ``--corpus DIR`` (the corpus the demo prepares)
    and then ``args``; ``spec`` holds further TrainingSpec fields (mesh_dims, dp_replicas, ...)."""

    entrypoint: str
    model: str  # the declared model file the planner sizes the job from
    args: tuple[str, ...] = ()
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def trainer(self) -> str:
        return f"user job {self.entrypoint}"


# The example Llama as DDP-style replicas (dp_replicate): gradients are averaged once a step, where
# its FSDP2 alternative (dp_shard) gathers and scatters the parameters at every one of a step's many
# micro-batches, several times slower on gloo over shared cores; and a replica lets --kill-worker-at
# recover in place. tp is named (the example's parallelize code needs a tp or dp_shard dim in the
# mesh) but held at 1: it too would add collectives to every micro-batch. torchtitan's example
# (examples/titan) shards over dp_shard only and is 17 times the size: its steps, which a shrink
# waits for, would hold inference back, so it has no alias (--job examples.titan.job:main runs it).
EXAMPLE_JOBS: dict[str, UserJob] = {
    "llama": UserJob("examples.llama.job:main", "examples/llama/model.json", ("--dtype", "float32"),
                     {"mesh_dims": {"dp": "dp_replicate", "tp": "tp"}, "dp_replicas": True, "allowed_tp": [1]}),
}


def resolve_job(entry: str, model: str | None = None, args: Sequence[str] = ()) -> UserJob:
    """``--job``: an example's alias (``llama``), entrypoint or script path (``examples/llama/job.py``)
    takes the example's settings; any other entrypoint needs ``model``, its declared model file.
    ``model`` and ``args`` (appended to the example's) override. ValueError names the option."""
    example = EXAMPLE_JOBS.get(entry)
    if example is None:
        example = next((j for j in EXAMPLE_JOBS.values() if entry == j.entrypoint or _same_file(entry, j)), None)
        entry_point = entry
    else:
        entry_point = example.entrypoint
    if example is None:
        if not model:
            raise ValueError(f"--job {entry}: not one of the examples ({', '.join(EXAMPLE_JOBS)}); "
                             "give its declared model file with --job-model PATH")
        return UserJob(entry_point, model, tuple(args))
    return UserJob(entry_point, model or example.model, (*example.args, *args), example.spec)


def _same_file(path: str, job: UserJob) -> bool:
    """``path`` is the script of ``job``'s ``module:function`` entrypoint (relative to this directory)."""
    if not path.endswith(".py"):
        return False
    script = Path(*job.entrypoint.partition(":")[0].split(".")).with_suffix(".py")
    return Path(path).resolve() == script.resolve()


def demo_config(minutes: float, tick_seconds: float, job: UserJob | None = None, *,
                corpus: str = "") -> dict[str, Any]:
    """The demo's controller config; with ``job`` its training job is that user loop reading ``corpus``."""
    return {**_service_config(minutes, tick_seconds), "jobs": [_job_spec(job, corpus)]}


def job_name(job: UserJob | None) -> str:
    return JOB if job is None else USER_JOB


def _demo_corpus() -> Any:
    """A ``TemporaryDirectory`` holding a byte-token corpus of :data:`CORPUS_FILES` (``--corpus DIR``
    of a user job); ``cleanup()`` removes it."""
    import tempfile

    from elastic.torch.data import prepare_corpus, stdlib_root

    tmp = tempfile.TemporaryDirectory(prefix="elastic-demo-corpus-")
    prepare_corpus(tmp.name, [stdlib_root() / f for f in CORPUS_FILES])
    return tmp


def _service_config(minutes: float, tick_seconds: float) -> dict[str, Any]:
    return {
        "pool": {"name": "local", "nodes": 1, "gpus_per_node": GPUS, "hardware": "h100-80g",
                 # a compressed day: rescale at most every few ticks, and only for a real gain
                 # (2 ticks: a GPU a replica gave back within 6 s of the last rescale idled until then,
                 # 4.5 s once in a run; a grow costs its members ~0.1 s of pause)
                 "rescale_interval_seconds": 2 * tick_seconds, "gain_threshold": 0.05},
        "services": [{
            "name": SERVICE, "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6, "priority": 100,
            # shrink on the mean of the last seconds' readings (grow on the latest): the running-requests
            # gauge jitters by +-sqrt(load), and holding its peaks holds replicas nobody needs
            # (10 s, with a 12 s window below, kept a replica ~20 s after the load fell: utilisation
            # 0.865 against 0.875-0.878 with 5 s / 8 s, SLO 0.995-0.997 either way; 2026-12-01)
            # (3 s with a 6 s window below: each evening step-down ~3 s sooner in an offline replay of this
            # policy on the seed-0 arrivals; a run: utilisation 0.893 against 0.879, SLO 0.995 either way,
            # but four scale-downs on a dip, each undone 2-8 s later; 2026-12-03)
            # noiseMargin 0.5: a scale-down to n replicas needs load + 0.5 sqrt(load) <= 13 n. The plateau's
            # 70 requests then need a 3 s mean <= 61 to drop to five (a dip of 2 sigma of one reading, not
            # 1); the evening's steps (57, 44, 31, 18 requests on 5, 4, 3, 2 replicas) pass 0.7-1.4 sigma
            # above their load. In the replay over 12 seeds: dips at the plateau 0.08 a day against 0.67.
            "metric": {"preset": "vllm-requests", "target": TARGET, "windowSeconds": max(3, 1.5 * tick_seconds),
                       "noiseMargin": 0.5},
            # a leaving replica hands its requests off (the balancer resumes them on the replicas that
            # stay) when the window lets it go, and its GPU goes to training within a second; it serves
            # until then. (Before: drained 6 s ahead, out of the balancer, its requests counting for nothing.)
            "drain_ahead_seconds": 0.0, "handoff": True,
            # the trend forecast: a line through the running-requests gauge, 3 s ahead. Over 12 s (6
            # readings) its extrapolation was as noisy as one reading (+-sqrt(load)) and started a replica
            # on a jitter about once a minute, night and evening included (each then held for the scale-down
            # window, training shrunk and grown back); over 20 s (10 readings) it is ~0.6x as noisy and
            # still sees the morning ramp. Three runs: utilisation 0.884-0.894 and 10-12 reshards, against
            # 0.872-0.874 and 18-19 with 12 s; SLO 0.9955-0.9975 against 0.993-0.9965 (2026-12-02).
            # Over 30 s (15 readings) the line is steadier still: in the replay the night's and the evening's
            # jitter started no replica it did, and the ramp's scale-ups came 2-5 s later, on the load itself.
            # After an evening step the line still runs above the load for ~6 s (it falls, but the points
            # before the step pull it up) and holds a replica a tick or two longer; ignoring a falling line
            # (tried 2026-12-03, 4 s window) let a 2-sigma dip right after the step drain the third replica:
            # 11 requests missed their TTFT on 2 replicas (SLO 0.9926 against 0.998); kept as it is.
            # startup_seconds, the forecast's horizon: from a decision to the replica serving (a shrink
            # at the next micro-batch, a spare's lease) plus a tick; 2-7 s on the slow VM's ramp
            "startup_seconds": 5.0, "forecast": "trend", "forecast_window_seconds": max(30.0, 15 * tick_seconds),
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 1}]},
                # 4 s: longer than a scale-up takes to land (a shrink that gives its step up, 0.2-0.4 s,
                # then the replica on the GPU handed over with its lease, 0.2-0.4 s; 1.5-2.3 s in all
                # before the handover), so a replica started for a ramp is not drained on the next dip
                # before the ramp arrives. The window counts from when a scale-up landed
                # (policy.replicas.landed); before that, when it counted from the decision and a
                # scale-up took 4-11 s, 6 s missed the SLO and 8 s was used. 6 s until 2026-12-03: each
                # evening step-down held a replica 2 s longer (the replay over 12 seeds: utilisation
                # -0.6 points); 3 s drained the evening's third replica on a dip: 14 requests missed
                # their TTFT on 2 replicas in a run (SLO 0.9886)
                "scaleDown": {"stabilizationWindowSeconds": int(max(4, 2 * tick_seconds)),
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 1}]},
            },
        }],
        "controller": {"tick_seconds": tick_seconds, "lease_seconds": max(15.0, 5 * tick_seconds)},
    }


def _job_spec(job: UserJob | None, corpus: str) -> dict[str, Any]:
    """The demo's training job: the reference trainer's small GPT, or ``job`` reading ``corpus``."""
    bounds = {"min_gpus": 1, "max_gpus": GPUS - 1, "priority": 0}
    if job is None:
        # global batch 420 = lcm(1..7): every GPU count training can get (inference keeps >= 1) has a layout
        # replicate_optimizer: no ZeRO-1, so a lost worker is recovered from its replica (--kill-worker-at)
        return {"name": JOB, "model": "tiny", **bounds, "global_batch": 420, "micro_batch": 1,
                "replicate_optimizer": True}
    # The same micro-batches as the reference trainer's (_trainer_config): a rank's share of the 420
    # samples in the fewest passes of at most 36 (2 at dp 7, 12 at dp 1). Fewer passes keep the step
    # short, and that matters: a user loop cannot give its step up half-way, so a rescale waits for
    # the step in progress.
    # No on_below_minimum: a user job cannot be paused (it is preempted below its minimum of 1 GPU,
    # which inference's maximum of 6 replicas never takes it to).
    return {"name": USER_JOB, "model": job.model, **bounds, "global_batch": 420, "micro_batch": 36,
            "entrypoint": job.entrypoint, "args": ["--corpus", corpus, *job.args], **job.spec}


@dataclass
class Sample:
    t: float
    rate: float
    replicas: int
    inference_busy: float
    training_gpus: int
    training_busy: int
    layout: str | None
    step: int
    loss: float | None
    tokens_per_second: float
    running: float = 0.0  # requests being served by all ready replicas
    draining: int = 0  # replicas out of the balancer's targets, finishing their requests


@dataclass
class DemoRun:
    samples: list[Sample] = field(default_factory=list)
    reshards: list[dict[str, Any]] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    warmup: float = 0.0
    # reshard events with an id above this one are this run's (./elastic.db outlives runs)
    reshards_after_id: int = 0
    # --kill-worker-at: when a training worker was killed (t, worker), and the job's generations the
    # trainer recovered into on its own (their reshard rows are recoveries, not rescales)
    kills: list[tuple[float, str]] = field(default_factory=list)
    recovered: set[int] = field(default_factory=set)
    job: str = JOB  # the training job's name, and what trains it (the summary says which)
    trainer: str = REFERENCE


def _replica_running(url: str) -> float:
    from elastic.metrics.scrape import scrape_sum

    return scrape_sum(url, ("vllm:num_requests_running",), timeout=0.5) or 0.0  # unreachable: not busy


def run_demo(minutes: float = 5.0, *, tick_seconds: float = 2.0, db_url: str = "sqlite:///./elastic.db",
             summary_json: str | None = None, plot: str | None = None, live: bool = True,
             api_port: int | None = 0, slo_ttft_seconds: float = 1.0, peak_rps: float = 11.0,
             seed: int = 0, timeline_csv: str | None = None, kill_worker_at: str | None = None,
             job: UserJob | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.live import Live

    from elastic import store as db
    from elastic.backends.ray import RayBackend
    from elastic.config import load_config
    from elastic.controller import Controller
    from elastic.metrics import build_source
    from elastic.serve.loadgen import LoadGenerator
    from elastic.serve.profiles import DiurnalProfile, rate_at
    from elastic.serve.server import ReplicaConfig
    from elastic.store.engine import mask_url
    from elastic.train.launch import LaunchOptions

    console = Console()
    day = minutes * 60.0
    # the warm-up (at the night's load, not counted) comes after the job's cold start (below): the
    # first scale-up (1 -> 2 replicas, training shrunk 7 -> 6 in place), the metric and forecast
    # windows filled. Before the cold start waited for its own end, 15-25 s let it run into the day
    # (called off by the first scale-ups); 40 s kept it out on a fast machine only (2026-12-02)
    warmup = max(40.0, 5 * tick_seconds)
    kill_t = None if kill_worker_at is None else warmup + day_offset(kill_worker_at) * day
    name, trainer = job_name(job), REFERENCE if job is None else job.trainer
    # 0. a user job's corpus (removed at the end), ready before any worker starts
    corpus = _demo_corpus() if job is not None else None
    cfg = load_config(data=demo_config(minutes, tick_seconds, job, corpus=corpus.name if corpus else ""))
    # the reference trainer replicates its optimizer (no ZeRO-1); a user job's ranks hold copies if it says so
    replicas = job is None or cfg.jobs[0].dp_replicas
    replica_cfg = ReplicaConfig(model="tiny", max_running=SLOTS, max_waiting=128, tokens_per_second=TOKENS_PER_SECOND)
    # 1. state and cluster
    console.print(f"[bold]elastic demo[/]: {GPUS} logical GPUs, a day in {minutes:g} min, training: {trainer}, "
                  f"state in {mask_url(db_url)}")
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    backend = RayBackend(cfg.pool, replica_config=replica_cfg, trainer_config=_trainer_config,
                         # nice: the 8 "GPUs" share this machine's cores; training must not slow the
                         # replicas it would never touch on separate GPUs
                         train_options=LaunchOptions(heartbeat_timeout_s=60.0, join_timeout_s=90.0, nice=10),
                         # a joiner (a new replica) taken from a started spare skips its process start,
                         # imports and model load: a GPU lease and it trains (serves). The morning ramp
                         # scales up four times in ~40 s and the evening grows training every ~10 s,
                         # while a used spare takes 15-25 s to replace on a slow machine (Ray starts two
                         # processes at a time, each importing torch on cores shared with the rest):
                         # with one replica spare, the ramp's last replicas started cold, 13-16 s each,
                         # and queued requests meanwhile (2026-12-02)
                         spare_workers=2, spare_replicas=3)
    source = build_source(cfg.services[0].metric, targets=lambda s: backend.metric_targets(s))
    ctl = Controller(cfg, backend, store, {SERVICE: source}, owner=f"demo-{os.getpid()}", async_grow=True)
    api = None
    if api_port is not None:
        api = _start_api(store, ctl, api_port)
        if api:
            console.print(f"controller API and /metrics on http://127.0.0.1:{api[2]}")
    # 2. the first tick places the minimum replica and the job before traffic starts. A demo
    # killed earlier (kill -9: Ctrl-C releases it) may still hold the database's lease; it
    # expires within lease_seconds, and the day must not start with nobody acting.
    start_id = last_reshard_id(store, name)
    first = _first_tick(ctl, console, cfg.controller.lease_seconds + 2 * tick_seconds, tick_seconds)
    if not ctl.is_leader:
        backend.shutdown()
        if api:
            api[0].should_exit = True
        if corpus:
            corpus.cleanup()
        raise SystemExit(f"elastic demo: {first.message}; another controller is acting on {mask_url(db_url)} "
                         "(use --db with another database, or stop it)")
    # 3. the cold start (the training job's first workers: torch in each process, on this
    # machine's cores) runs before any load: started under load it is called off by the first
    # scale-ups (7 -> 6 -> 5 workers, each restart as slow), and on a slow machine it ran into the
    # measured day (2026-12-02: 44 s after the first tick, 4 s into the day, with a 40 s warm-up)
    run = DemoRun(warmup=warmup, reshards_after_id=start_id, job=name, trainer=trainer)
    _wait_job_started(ctl, backend, console, JOB_START_TIMEOUT_S, tick_seconds, run.losses, job=name)
    # The day starts at 03:00: night trough, morning ramp, plateau, evening descent in steps.
    # A warm-up at the night load comes first (as the simulator starts every policy warm):
    # the controller sizes the service from real metrics before the measured day begins.
    profile = DiurnalProfile(peak=peak_rps, day_seconds=day, start_fraction=0.125 - warmup / day)
    lg = LoadGenerator(lambda: backend.service_targets(SERVICE), profile, duration=warmup + day,
                       max_requests=int(peak_rps * day * 1.2) + 100, max_tokens=MAX_TOKENS, seed=seed, timeout=20.0)
    lg_thread = threading.Thread(target=lambda: asyncio.run(lg.run()), name="loadgen", daemon=True)
    stop = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=_sample_loop, args=(backend, ctl, profile, t0, run, stop, rate_at,
                                                           cfg.services[0].metric.target), daemon=True)
    lg_thread.start()
    sampler.start()
    # 4. the loop: tick, show
    try:
        with Live(_table(run, ctl, minutes), console=console, refresh_per_second=2,
                  transient=False) if live else _Null() as view:
            while time.monotonic() - t0 < warmup + day:
                started = time.monotonic()
                res = ctl.tick()
                if res.error:
                    log.warning("tick: %s", res.error)
                if kill_t is not None and not run.kills and time.monotonic() - t0 >= kill_t:
                    _kill_a_worker(backend, run, time.monotonic() - t0, console, replicas=replicas)
                run.recovered.update(g for j, g in ctl.recoveries if j == name)
                _collect_reshards(ctl, run)
                if live:
                    view.update(_table(run, ctl, minutes))
                time.sleep(max(0.0, tick_seconds - (time.monotonic() - started)))
    finally:
        stop.set()
        lg.stop()
        lg_thread.join(timeout=30)
        sampler.join(timeout=5)
        ctl.wait_idle(60)
        run.recovered.update(g for j, g in ctl.recoveries if j == name)
        _collect_reshards(ctl, run)
        rt = backend.job_runtime(name)
        backend.shutdown()
        if api:
            api[0].should_exit = True
        ctl.release_lease()  # the next run need not wait for it to expire
        if corpus:
            corpus.cleanup()
    # 5. summary
    svc = cfg.services[0]
    sizing = dict(request_seconds=MAX_TOKENS / TOKENS_PER_SECOND, capacity=svc.metric.target,
                  min_replicas=svc.min_replicas, max_replicas=svc.max_replicas, gpus=GPUS)
    bound = utilization_bound(lambda t: rate_at(profile, t), warmup, warmup + day, **sizing)
    on_arrivals = clairvoyant_on_arrivals(run.samples, lambda t: rate_at(profile, t), warmup, **sizing)
    summary = _summary(run, lg.report, slo_ttft_seconds, rt, day, warmup, bound, on_arrivals)
    console.print_json(json.dumps(summary))
    console.print(_goals_line(summary), highlight=False)
    if summary_json:
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(summary, indent=2))
    if timeline_csv:
        _write_timeline(run, timeline_csv, lg.report.results, slo_ttft_seconds)
        console.print(f"timeline written to {timeline_csv}")
    if plot:
        _plot(run, plot, profile, rate_at)
        console.print(f"plot written to {plot}")
    store.dispose()
    return summary


def day_offset(hhmm: str) -> float:
    """Seconds into the demo's day (which starts at 03:00) of a time of day, as a fraction of the day."""
    try:
        h, m = (int(x) for x in hhmm.split(":"))
        if not (0 <= h < 24 and 0 <= m < 60):
            raise ValueError
    except ValueError:
        raise ValueError(f"--kill-worker-at={hhmm!r}: expected a time of day HH:MM, e.g. 13:00") from None
    return ((h * 60 + m) / 1440 - 0.125) % 1.0


def _kill_a_worker(backend: Any, run: DemoRun, t: float, console: Any, *, replicas: bool = True) -> None:
    """Chaos: kill one training worker's actor (as a lost node would); the trainer recovers in place
    from a data-parallel replica (``replicas``: the job's ranks hold full copies, not FSDP shards)."""
    import ray

    from elastic.model import Layout

    j = backend.jobs.get(run.job)
    st = j.handle.status() if j else None
    if st is None or not st.workers or st.phase != "running":
        console.print(f"[yellow]--kill-worker-at: the job is {st.phase if st else 'not running'}; nothing killed[/]")
        run.kills.append((t, ""))
        return
    victim = st.workers[-1]
    ray.kill(j.handle.actors[victim], no_restart=True)
    run.kills.append((t, victim))
    console.print(f"killed training worker {victim} of {st.layout} at step {st.step}"
                  + ("" if Layout.parse(st.layout).dp >= 2 and replicas else
                     " (no replica of its state: the job cannot recover)"))


def _trainer_config(spec: Any) -> Any:
    """fp32 on CPU; per-layout micro-batches (same samples per step) keep a step short at any dp,
    and at most 36 samples each: a shrink gives the step in progress up at the next micro-batch
    (2-4 per step at dp 3-7; with 64, dp 7 ran its step as one)."""
    from elastic.model import load_model
    from elastic.train.engine import TrainConfig

    return TrainConfig(model=load_model(spec.model), global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                       micro_batch_cap=36)


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *a: Any) -> None:
        return None

    def update(self, *_: Any) -> None:
        return None


def _start_api(store: Any, ctl: Any, port: int) -> tuple[Any, Any, int] | None:
    try:
        from elastic.api.app import TokenSet, create_app
        from elastic.api.server import serve_api
    except ImportError:
        return None
    app = create_app(store, ctl, tokens=TokenSet.from_env())
    server, thread = serve_api(app, "127.0.0.1", port)
    return server, thread, getattr(server, "port", port)


def _sample_loop(backend: Any, ctl: Any, profile: Any, t0: float, run: DemoRun, stop: threading.Event,
                 rate_at: Any, capacity: float, every: float = 1.0) -> None:
    while not stop.wait(every):
        t = time.monotonic() - t0
        urls = backend.service_targets(SERVICE)
        # docs/DESIGN.md: a draining replica is not busy (it holds its GPU until its requests are done)
        draining = backend.draining_targets(SERVICE)
        running = [_replica_running(u) for u in urls]
        busy = sum(min(1.0, r / capacity) for r in running)
        rt = backend.job_runtime(run.job)
        tg = len(rt.gpus) if rt else 0
        # GPUs stepping: the coordinator's current layout (the old one until the switch step, the new
        # one from there: a grow's joiners train, a shrink's leavers do not, before the backend's books
        # say so); the pause itself is subtracted from the reshard records in the summary
        tbusy = _world_size(rt.layout) if rt and rt.phase in ("Running", "Rescaling") else 0
        _note_loss(run.losses, rt)
        run.samples.append(Sample(t, rate_at(profile, t), len(urls), busy, tg, tbusy, rt.layout if rt else None,
                                  rt.step if rt else 0, rt.loss if rt else None,
                                  rt.tokens_per_second if rt else 0.0, sum(running), len(draining)))


def _world_size(layout: str | None) -> int:
    from elastic.model import Layout

    return Layout.parse(layout).world_size if layout else 0


def _note_loss(losses: list[tuple[int, float]], rt: Any) -> None:
    """Append the job's ``(step, loss)`` when it has one for a step not noted yet."""
    if rt is not None and rt.loss is not None and (not losses or losses[-1][0] != rt.step):
        losses.append((rt.step, rt.loss))


def _wait_job_started(ctl: Any, backend: Any, console: Any, wait_s: float, tick_seconds: float,
                      losses: list[tuple[int, float]] | None = None, *, job: str = JOB) -> bool:
    """Tick until the demo's job runs (its first workers stepping), at most ``wait_s`` seconds.
    False (and a line on the console) when it did not: the day starts anyway, and the summary
    shows what the late start cost. The losses it sees go to ``losses`` as ``(step, loss)`` (the
    summary's ``loss_first`` is the job's, not the first one after the wait)."""
    t0 = time.monotonic()
    said = False
    while True:
        rt = backend.job_runtime(job)
        if losses is not None:
            _note_loss(losses, rt)
        if rt is not None and rt.phase == "Running" and rt.step > 0:
            log.info("training job running on %d GPUs after %.1f s", len(rt.gpus), time.monotonic() - t0)
            return True
        if time.monotonic() - t0 > wait_s:
            console.print(f"[yellow]the training job is not running after {wait_s:.0f} s "
                          f"({rt.phase if rt else 'not started'}); the day starts anyway[/]")
            return False
        if not said:
            console.print(f"starting training job {job} on the GPUs inference leaves free, before the day's load")
            said = True
        time.sleep(tick_seconds)
        res = ctl.tick()
        if res.error:
            log.warning("tick: %s", res.error)


def _first_tick(ctl: Any, console: Any, wait_s: float, tick_seconds: float) -> Any:
    """Tick until this controller holds the lease (at most ``wait_s``); returns the last result."""
    res = ctl.tick()
    deadline = time.monotonic() + wait_s
    if not ctl.is_leader:
        console.print(f"waiting up to {wait_s:.0f} s for the lease: {res.message} (an earlier demo that was killed?)")
    while not ctl.is_leader and time.monotonic() < deadline:
        time.sleep(tick_seconds)
        res = ctl.tick()
    return res


def last_reshard_id(store: Any, job: str = JOB) -> int:
    """The newest reshard event's id of the demo's ``job`` in ``store`` (0 when there is none)."""
    from elastic import store as db

    newest = db.list_reshards(store, job=job, limit=1, newest_first=True)
    return newest[0].id if newest else 0


def _collect_reshards(ctl: Any, run: DemoRun) -> None:
    """Add this run's finished reshards (ids above ``run.reshards_after_id``) not collected yet.

    Every event since the run's start is read, page by page: one still in flight is picked
    up by a later call once it has finished."""
    from elastic import store as db

    seen = {r["id"] for r in run.reshards}
    after = run.reshards_after_id
    while True:
        page = db.list_reshards(ctl.store, job=run.job, limit=200, after_id=after)
        for r in page:
            if r.id not in seen and r.status in db.FINISHED:
                run.reshards.append({"id": r.id, "generation": r.generation, "from": r.from_layout, "to": r.to_layout,
                                     "status": r.status,
                                     "pause_seconds": r.pause_seconds, "bytes_moved": r.bytes_moved,
                                     "at": r.finished_at.isoformat() if r.finished_at else None})
        if len(page) < 200:
            break
        after = page[-1].id
    run.reshards.sort(key=lambda r: r["id"])


def _summary(run: DemoRun, report: Any, slo: float, rt: Any, day: float, warmup: float,
             bound: float | None = None, on_arrivals: float | None = None) -> dict[str, Any]:
    s = [x for x in run.samples if x.t >= warmup]
    # a recovery's seconds are not a rescale's pause, and the samples already count the job idle
    # while it recovers: kept apart
    recoveries = [r for r in run.reshards if r.get("generation") in run.recovered]
    done = [r for r in run.reshards if r["status"] == "done" and r["pause_seconds"] is not None
            and r not in recoveries]
    if len(s) >= 2:
        dt = _intervals(s)
        total = GPUS * sum(dt)
        inf_s = sum(x.inference_busy * d for x, d in zip(s, dt, strict=True))
        # during a pause the samples show the old layout, then the new one: the larger one is subtracted
        paused = sum(r["pause_seconds"] * max(_world_size(r["from"]), _world_size(r["to"]))
                     for r in done if r["from"])
        trn_s = max(0.0, sum(x.training_busy * d for x, d in zip(s, dt, strict=True)) - paused)
        busy, inf, trn = inf_s + trn_s, inf_s / total, trn_s / total
        held_inf = sum((x.replicas + x.draining) * d for x, d in zip(s, dt, strict=True)) / total
        held_trn = sum(x.training_gpus * d for x, d in zip(s, dt, strict=True)) / total
    else:
        busy, total, inf, trn, held_inf, held_trn = 0.0, 1.0, 0.0, 0.0, 0.0, 0.0
    from elastic.serve.loadgen import quantile

    pauses = [r["pause_seconds"] for r in done]
    requests = sum(1 for r in report.results if r.sent_at >= warmup)
    e2e = [r.e2e for r in report.results if r.sent_at >= warmup and r.complete and r.e2e is not None]
    failed = _failed_by_status(report.results, warmup)
    out: dict[str, Any] = {
        "trainer": run.trainer,
        "job": run.job,
        "gpu_utilization": round(busy / total, 4),
        # the same measure for a clairvoyant controller on this day's expected load (whole
        # replicas only, nothing else lost): how much of the gap no controller could close
        "gpu_utilization_bound": round(bound, 4) if bound is not None else None,
        # the same clairvoyant controller on the requests this run really got: the arrivals' jitter
        # leaves its replicas below capacity (and, in a burst, would queue): what is left above it is
        # what reacting to the load, starting replicas and rescaling cost
        "gpu_utilization_clairvoyant_on_arrivals": round(on_arrivals, 4) if on_arrivals is not None else None,
        "inference_busy_fraction": round(inf, 4),
        "training_busy_fraction": round(trn, 4),
        # where the rest went: GPUs held by ready or draining replicas / running training workers, and
        # neither (starting replicas, joiners starting, idle)
        "inference_held_fraction": round(held_inf, 4),
        "training_held_fraction": round(held_trn, 4),
        "not_held_fraction": round(max(0.0, 1 - held_inf - held_trn), 4),
        "slo_attainment": round(report.slo_attainment(slo, since=warmup), 4) if requests else 0.0,
        "slo_ttft_seconds": slo,
        "ttft_p50_seconds": _r(report.ttft_quantile(0.5, since=warmup)),
        "ttft_p99_seconds": _r(report.ttft_quantile(0.99, since=warmup)),
        # not answered in full: refused, errors, no first token, and streams cut short
        "failed_requests": sum(failed.values()),
        # why: the HTTP status of each failed request ("0": no answer - a connection error, or no
        # response within the load generator's 20 s; "200": answered but cut short or tokenless)
        "failed_by_status": failed,
        "truncated_requests": sum(1 for r in report.results if r.sent_at >= warmup and r.truncated),
        # resumed on another replica by the balancer (handed off by a leaving replica, or refused by one)
        "handed_off_requests": sum(1 for r in report.results if r.sent_at >= warmup and r.handoffs),
        # a request is 6.4 s of tokens: what a hand-off (or a queue) adds shows here
        "e2e_p50_seconds": _r(quantile(e2e, 0.5)),
        "e2e_p99_seconds": _r(quantile(e2e, 0.99)),
        "requests": requests,
        "reshards": len(done),
        "reshards_failed": sum(1 for r in run.reshards if r["status"] == "failed"),
        # grows called off before their directive because inference wanted the GPUs back (nothing moved)
        "grows_cancelled": sum(1 for r in run.reshards if r["status"] == "cancelled"),
        "mean_reshard_pause_seconds": round(sum(pauses) / len(pauses), 3) if pauses else 0.0,
        "max_reshard_pause_seconds": round(max(pauses), 3) if pauses else 0.0,
        "workers_killed": sum(1 for _, w in run.kills if w),
        "recoveries": len(recoveries),
        "recovery_seconds": [round(r["pause_seconds"] or 0.0, 3) for r in recoveries],
        "training_steps": rt.step if rt else (run.losses[-1][0] if run.losses else 0),
        "loss_first": run.losses[0][1] if run.losses else None,
        "loss_last": run.losses[-1][1] if run.losses else None,
        "day_seconds": day,
        "warmup_seconds": warmup,
    }
    out["goals"] = dict(GOALS)
    out["goals_met"] = all(out[k] >= v for k, v in GOALS.items())
    return out


def _goals_line(summary: Mapping[str, Any]) -> str:
    """One line: which trainer ran, and each goal with the run's figure and whether it was met."""
    parts = [f"{k} {summary[k]:.4f} ({'met' if summary[k] >= v else 'MISSED'}: goal >= {v:.2f})"
             for k, v in GOALS.items()]
    return (f"training: {summary['trainer']}: " + ", ".join(parts)
            + f"; {summary['reshards']} reshards, {summary['training_steps']} steps")


def _failed_by_status(results: list[Any], since: float) -> dict[str, int]:
    """Failed requests sent from ``since`` on (not answered in full with a first token), by HTTP status."""
    out: dict[str, int] = {}
    for r in results:
        if r.sent_at >= since and not (r.status == 200 and r.ttft is not None and r.complete):
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return dict(sorted(out.items()))


def utilization_bound(rate: Callable[[float], float], start: float, end: float, *, request_seconds: float,
                      capacity: float, min_replicas: int, max_replicas: int, gpus: int, step: float = 0.5) -> float:
    """GPU utilisation a clairvoyant controller would reach on this load (same definition).

    ``rate(t)``: the *expected* requests/s. At each instant of ``[start, end)`` the service
    holds exactly ``ceil(L / capacity)`` replicas (within its bounds), where ``L`` is the
    expected concurrency (Little's law: the mean rate over the last ``request_seconds``
    times ``request_seconds``), busy ``min(replicas, L / capacity)``; training runs on every
    other GPU without a pause; no arrival jitter, no start, drain or handoff cost. No
    controller that keeps every replica within its SLO capacity beats it with 1-GPU
    replicas: rounding up to whole replicas is all it loses.
    """
    n = max(1, int((end - start) / step))
    sizing = dict(capacity=capacity, min_replicas=min_replicas, max_replicas=max_replicas, gpus=gpus)
    loads = (_expected_load(rate, start + i * step, request_seconds, step) for i in range(n))
    return sum(_clairvoyant_busy(load, load, **sizing) for load in loads) / n


def clairvoyant_on_arrivals(samples: list[Sample], rate: Callable[[float], float], start: float, *,
                            request_seconds: float, capacity: float, min_replicas: int, max_replicas: int,
                            gpus: int) -> float | None:
    """:func:`utilization_bound`'s controller on the load a run really had: at each sample from
    ``start`` on it holds ``ceil(L / capacity)`` replicas for the expected concurrency ``L`` (it
    knows the day, not the next arrival), and they are busy with the requests the run's replicas
    were serving, ``min(replicas, running / capacity)``; training runs on every other GPU without
    a pause. Poisson arrivals scatter ``running`` by about ``sqrt(L)`` around ``L``: below it the
    replicas are under capacity, above it they are full (and would queue). None without samples."""
    s = [x for x in samples if x.t >= start]
    if len(s) < 2:
        return None
    dt = _intervals(s)
    sizing = dict(capacity=capacity, min_replicas=min_replicas, max_replicas=max_replicas, gpus=gpus)
    return sum(d * _clairvoyant_busy(_expected_load(rate, x.t, request_seconds), x.running, **sizing)
               for x, d in zip(s, dt, strict=True)) / sum(dt)


def _clairvoyant_busy(load: float, served: float, *, capacity: float, min_replicas: int, max_replicas: int,
                      gpus: int) -> float:
    """Busy share of the pool at one instant for the clairvoyant controller: ``ceil(load / capacity)``
    replicas (within the bounds) for the expected concurrency ``load``, busy with ``served``
    requests (capped at capacity each), training on every other GPU."""
    replicas = min(max_replicas, max(min_replicas, math.ceil(load / capacity - 1e-9)))
    return (min(float(replicas), served / capacity) + (gpus - replicas)) / gpus


def _intervals(s: list[Sample]) -> list[float]:
    """Seconds each sample stands for: up to the next one (the last as long as the one before)."""
    return [s[i + 1].t - s[i].t for i in range(len(s) - 1)] + [s[-1].t - s[-2].t]


def _expected_load(rate: Callable[[float], float], t: float, request_seconds: float, step: float = 0.5) -> float:
    """Expected concurrency at ``t`` (Little's law): the mean rate over the last ``request_seconds``
    times ``request_seconds``."""
    k = max(1, round(request_seconds / step))
    return sum(rate(t - j * step) for j in range(k)) / k * request_seconds


def _write_timeline(run: DemoRun, path: str, results: list[Any] | None = None, slo: float = 1.0) -> None:
    """One row per second: the samples the summary is computed from (t = 0 at the day's start),
    and, from the load generator's ``results``, the requests sent since the row before (``sent``)
    and how many of them missed the TTFT SLO ``slo`` or failed (``missed``)."""
    import bisect
    import csv
    from dataclasses import astuple, fields

    sent_at = sorted((r.sent_at, not r.met(slo)) for r in results or [])
    times = [t for t, _ in sent_at]
    missed = [0]
    for _, m in sent_at:
        missed.append(missed[-1] + m)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([x.name for x in fields(Sample)] + ["sent", "missed"])
        prev = 0
        for x in run.samples:
            row = list(astuple(x))
            row[0] = round(x.t - run.warmup, 3)
            upto = bisect.bisect_right(times, x.t)
            w.writerow(row + [upto - prev, missed[upto] - missed[prev]])
            prev = upto


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _table(run: DemoRun, ctl: Any, minutes: float) -> Any:
    from rich.table import Table

    t = Table(title=f"elastic demo — one compressed day — training: {run.trainer}", expand=False)
    for c in ("time of day", "req/s", "replicas", "training", "GPUs", "step", "loss", "tokens/s", "last reshard"):
        t.add_column(c, justify="right")
    if run.samples:
        x = run.samples[-1]
        hour = (3 + 24 * (x.t - run.warmup) / (minutes * 60)) % 24
        last = run.reshards[-1] if run.reshards else None
        t.add_row(f"{int(hour):02d}:{int(hour % 1 * 60):02d}", f"{x.rate:.1f}", str(x.replicas), x.layout or "-",
                  str(x.training_gpus), str(x.step), f"{x.loss:.3f}" if x.loss is not None else "-",
                  f"{x.tokens_per_second:.0f}",
                  f"{last['from']}→{last['to']} {last['pause_seconds'] or 0:.2f}s" if last else "-")
    return t


def _plot(run: DemoRun, path: str, profile: Any, rate_at: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.samples
    if not s:
        return
    t = [x.t - run.warmup for x in s]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(t, [x.replicas for x in s], [x.draining for x in s], [x.training_gpus for x in s],
                 labels=["inference GPUs (serving)", "draining (out of the balancer)", "training GPUs"],
                 colors=["#4c72b0", "#8fa8d0", "#55a868"], alpha=0.6, step="post")
    ax.set_ylim(0, GPUS + 0.5)
    ax.axvspan(t[0], 0, color="grey", alpha=0.1, label="warm-up (not counted)")
    ax.set_xlabel("seconds into the compressed day (03:00 at 0; the shaded warm-up is not counted)")
    ax.set_ylabel("GPUs")
    ax2 = ax.twinx()
    ax2.plot(t, [x.rate for x in s], color="#c44e52", label="request rate (req/s)")
    ax2.set_ylabel("requests / s")
    prev = None
    for x in s:
        if x.layout and x.layout != prev:
            ax.annotate(x.layout, (x.t - run.warmup, x.replicas + x.draining + x.training_gpus), fontsize=7,
                        rotation=60)
            ax.axvline(x.t - run.warmup, color="grey", lw=0.5, ls=":")
            prev = x.layout
    for kt, victim in run.kills:
        if victim:
            ax.axvline(kt - run.warmup, color="#c44e52", lw=1.2, ls="--", label=f"worker {victim} killed")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax.set_title(f"elastic demo: inference follows the day, training ({run.trainer}) takes the rest and "
                 "reshards in place", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
