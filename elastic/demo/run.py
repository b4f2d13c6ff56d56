"""Running the demo: the controller on a local Ray, the day's load, one sample of the pool per second."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from elastic.demo.config import (
    GPUS,
    JOB,
    JOB_START_TIMEOUT_S,
    MAX_TOKENS,
    REFERENCE,
    SERVICE,
    SLOTS,
    TOKENS_PER_SECOND,
    UserJob,
    _demo_corpus,
    demo_config,
    job_name,
)
from elastic.demo.measure import (
    _goals_line,
    _layouts_line,
    _summary,
    clairvoyant_on_arrivals,
    utilization_bound,
)
from elastic.demo.report import _plot, _table, _write_timeline
from elastic.demo.samples import DemoRun, Sample
from elastic.phases import CoordinatorPhase, JobPhase

log = logging.getLogger("elastic.demo")





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
    # windows filled. Started before the cold start had ended, a shorter warm-up let the start run
    # into the day (called off by the first scale-ups)
    warmup = max(40.0, 5 * tick_seconds)
    kill_t = None if kill_worker_at is None else warmup + day_offset(kill_worker_at) * day
    name, trainer = job_name(job), REFERENCE if job is None else job.trainer
    # 0. a user job's corpus (removed at the end), ready before any worker starts
    corpus = _demo_corpus() if job is not None else None
    # with a worker to kill, the reference trainer replicates its optimizer (no ZeRO-1); a user job's ranks
    # hold copies if it says so
    cfg = load_config(data=demo_config(minutes, tick_seconds, job, corpus=corpus.name if corpus else "",
                                       replicated=kill_t is not None))
    replicas = cfg.jobs[0].replicate_optimizer if job is None else cfg.jobs[0].dp_replicas
    replica_cfg = ReplicaConfig(model="tiny", max_running=SLOTS, max_waiting=128, tokens_per_second=TOKENS_PER_SECOND)
    # 1. state and cluster
    console.print(f"[bold]elastic demo[/]: {GPUS} logical GPUs, a day in {minutes:g} min, training: {trainer}, "
                  f"state in {mask_url(db_url)}")
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    backend = RayBackend(cfg.pool, replica_config=replica_cfg,
                         # nice: the 8 "GPUs" share this machine's cores; training must not slow the
                         # replicas it would never touch on separate GPUs
                         train_options=LaunchOptions(heartbeat_timeout_s=60.0, join_timeout_s=90.0, nice=10),
                         # a joiner (a new replica) taken from a started spare skips its process start,
                         # imports and model load: a GPU lease and it trains (serves). The morning ramp
                         # scales up four times in ~40 s and the evening grows training every ~10 s,
                         # while a used spare takes 15-25 s to replace on a slow machine (Ray starts two
                         # processes at a time, each importing torch on cores shared with the rest):
                         # with one replica spare, the ramp's last replicas start cold, many seconds each,
                         # and requests queue meanwhile
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
    # scale-ups (7 -> 6 -> 5 workers, each restart as slow), and on a slow machine it would run into
    # the measured day
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
    console.print(_layouts_line(summary), highlight=False)
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

    j = backend.jobs.get(run.job)
    st = j.handle.status() if j else None
    if st is None or not st.workers or st.phase != CoordinatorPhase.RUNNING:
        console.print(f"[yellow]--kill-worker-at: the job is {st.phase if st else 'not running'}; nothing killed[/]")
        run.kills.append((t, ""))
        return
    victim = st.workers[-1]
    ray.kill(j.handle.actors[victim], no_restart=True)
    run.kills.append((t, victim))
    console.print(f"killed training worker {victim} of {st.layout} at step {st.step}"
                  + ("" if st.layout is not None and st.layout.dp >= 2 and replicas else
                     " (no replica of its state: the job cannot recover)"))


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
        tbusy = (rt.layout.world_size if rt and rt.layout and rt.phase in (JobPhase.RUNNING, JobPhase.RESCALING)
                 else 0)
        _note_loss(run.losses, rt)
        run.samples.append(Sample(t, rate_at(profile, t), len(urls), busy, tg, tbusy, rt.layout if rt else None,
                                  rt.step if rt else 0, rt.loss if rt else None,
                                  rt.tokens_per_second if rt else 0.0, sum(running), len(draining)))




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
        if rt is not None and rt.phase == JobPhase.RUNNING and rt.step > 0:
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
