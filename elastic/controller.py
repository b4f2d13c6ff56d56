"""The controller loop: observe -> decide -> apply -> record, one pool, one leader.

One ``tick()`` reads as numbered steps (Kueue's scheduler, Kopf's collected effects):

0. lead      hold the pool's DB lease; a controller without it does nothing. While the tick
             works a background thread renews it (every third of the lease), and every
             backend action and every DB write of the tick is fenced: it goes ahead only while
             the lease is still this controller's at the epoch it took (the DB refuses a write
             with a stale epoch in the same transaction; locally, a lease not renewed in time
             stops the tick before its next action). A leader that lost its lease stops
             mid-tick, stands by and recovers from the DB when it leads again.
1. observe   backend inventory, what each workload holds, each service's metric, job status.
2. decide    the pure replica policy per service, then the pure co-scheduler for the pool.
3. apply     a. stop jobs the backend reports Failed (their GPUs return to the pool, the reason
                goes on record; the plan already counted them as not running and restarts them
                when GPUs allow), b. the plan's ordered steps, each confirmed before the next:
                training shrinks finish before inference gets their GPUs; inference drains
                before training grows. A grow still starting its joiners when inference wants
                the GPUs back is called off (nothing has moved yet) and the tick plans once
                more from what the job really holds.
4. record    the decision (with its reason), allocations and reshard events in the DB. A tick
             that changes nothing is a *hold*: a run of identical holds is one decision row
             (its count and last time grow), so the log keeps changes, not a row per tick.

Only step 3 touches the backend's actuators and only step 4 writes the store. Between ticks
the lease holder enforces retention (``housekeep``): old history goes in small batches,
never inside a tick. At INFO the log says what changed and why, one line each (a decision
that acts, a rescale with its layout, bytes and pause, a hold that is not plain steady
state, a lease gained or lost); a failure that repeats tick after tick is logged when it
starts, when it changes and when it ends. When the
DB or the backend is unreachable the tick stops acting and says so (``ready`` False,
reason in ``last_error``) instead of guessing. Crash recovery (``recover()``, run before
the first decision): actions the DB shows in flight are reconciled with what the backend
reports, so a controller killed mid-shrink resumes from the backend's truth. With the Ray
backend in detached mode the workers outlive the controller and finish the directive they
were given; the reshard is then recorded ``done`` with the bytes and pause the job reports.

Operators' interventions (a pause, a service's replica override, a job's layout pin) are kept
in the DB with who set them and when: a controller loads them when it starts and again when it
takes the lease, so a restart or a failover keeps them (an override that ran out is dropped).
A job whose start or grow fails backs off exponentially (``start_backoff_seconds`` doubling up
to ``start_backoff_max_seconds``): the co-scheduler does not give it more GPUs until the next
attempt, and the reason and that time are in its status, the admin API and ``/metrics``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from elastic import store as db
from elastic.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    GrowCancelled,
    JobRuntime,
    RescaleOutcome,
)
from elastic.config import ControllerConfig
from elastic.metrics.sample import MetricSample, MetricSource
from elastic.model import GPU, Allocation, HardwareSpec, Layout, ModelSpec, PlanStep, SpecError, load_hardware
from elastic.policy import decide as policy_decide
from elastic.policy import landed as policy_landed
from elastic.policy.types import PolicyContext, PolicyState, ReplicaDecision
from elastic.scheduler import decide as schedule
from elastic.scheduler.types import JobState, Knobs, SchedulePlan, ServiceDemand, Snapshot

log = logging.getLogger("elastic.controller")


@dataclass(frozen=True)
class Backoff:
    """A job whose start or grow failed ``failures`` times in a row: not given more GPUs before ``next_at``."""

    failures: int
    reason: str
    next_at: float
    last_failure_at: float


@dataclass
class TickResult:
    at: float
    acted: bool
    reason: str
    message: str
    plan: SchedulePlan | None = None
    replica_decisions: dict[str, ReplicaDecision] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def throughput_table(model: ModelSpec, hardware: HardwareSpec, max_gpus: int, *, gpus_per_node: int,
                     global_batch: int, allowed_tp: list[int] | None = None,
                     allowed_pp: list[int] | None = None, zero: int = 0,
                     replicate_optimizer: bool = False) -> dict[int, tuple[str, float]]:
    """GPU count -> (best feasible layout, tokens/s), from the planner; honours allowed tp/pp,
    ``zero=1`` (ZeRO-1 wherever dp > 1; with 0 the planner chooses per layout) and
    ``replicate_optimizer`` (no ZeRO-1: every replica a full copy, for recovery from a lost worker)."""
    from elastic.parallel.planner import best_by_gpu_count, feasible_layouts

    # vpp=1: the reference trainer runs non-interleaved 1F1B only
    opts: dict[str, Any] = {"vpps": (1,)}
    if not allowed_tp and not allowed_pp and not zero and not replicate_optimizer:
        best = best_by_gpu_count(model, hardware, max_gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                                 **opts)
        out = {n: (str(p.layout), p.tokens_per_second) for n, p in best.items()}
        return {n: v for n, v in out.items() if Layout.parse(v[0]).world_size == n}
    out = {}
    for n in range(1, max_gpus + 1):
        for p in feasible_layouts(model, n, hardware, gpus_per_node=gpus_per_node, global_batch=global_batch,
                                  **opts):
            L = p.layout
            if L.world_size != n or (allowed_tp and L.tp not in allowed_tp) or (allowed_pp and L.pp not in allowed_pp):
                continue
            if (zero and L.dp > 1 and not L.zero) or (replicate_optimizer and L.zero):
                continue
            out[n] = (str(L), p.tokens_per_second)
            break
    return out


def job_throughput_tables(cfg: ControllerConfig) -> dict[str, dict[int, tuple[str, float]]]:
    """Every job's GPU count -> (best layout, tokens/s) on the pool's hardware (pure; the planner)."""
    hw = load_hardware(cfg.pool.hardware)
    models = cfg.models()
    return {j.name: throughput_table(models[j.name], hw, min(j.max_gpus, cfg.pool.total_gpus),
                                     gpus_per_node=cfg.pool.gpus_per_node, global_batch=j.global_batch,
                                     allowed_tp=j.allowed_tp, allowed_pp=j.allowed_pp, zero=j.zero,
                                     replicate_optimizer=j.no_zero1)
            for j in cfg.jobs}


def check_feasible(cfg: ControllerConfig, tables: Mapping[str, Mapping[int, Any]]) -> None:
    """A job no layout can run within its GPU bounds would silently never start: refuse it (SpecError)."""
    for i, j in enumerate(cfg.jobs):
        if not any(j.min_gpus <= n <= j.max_gpus for n in tables.get(j.name, {})):
            raise SpecError(
                f"jobs[{i}] '{j.name}': no layout of model {j.model} with global_batch={j.global_batch} fits "
                f"{cfg.pool.hardware} GPUs between min_gpus={j.min_gpus} and max_gpus={j.max_gpus} "
                f"(pool of {cfg.pool.total_gpus}); raise max_gpus, pick a smaller model or bigger GPUs")


class Controller:
    """Runs ticks for one pool. ``clock`` is injectable; decisions never read it themselves."""

    def __init__(self, cfg: ControllerConfig, backend: Backend, store: db.Store, sources: Mapping[str, MetricSource],
                 *, owner: str, clock: Callable[[], float] = time.time,
                 throughput: Mapping[str, Mapping[int, tuple[str, float]]] | None = None,
                 async_grow: bool = False, config_source: str | None = None) -> None:
        self.cfg = cfg
        self.config_source = config_source  # the file the workloads of cfg were declared in, if any
        # A training grow waits for joiners to start (seconds); with async_grow the tick does not
        # wait for it: the job holds its target GPUs meanwhile and a later shrink of it waits.
        self.async_grow = async_grow
        self._replan = False  # set by _apply when it called a grow off: the tick plans once more
        self._growing: dict[str, tuple[threading.Thread, tuple[GPU, ...], list[str]]] = {}
        self.backend = backend
        self.store = store
        self.sources = dict(sources)
        self.owner = owner
        self.pool = cfg.pool.name
        # every write of a tick goes through ``db``: refused unless the lease is still ours
        self.db = db.FencedStore(store, self.pool, owner, guard=self._check_lead)
        self._lead_until = 0.0  # time.monotonic() past which the lease may have run out
        self._lost: str | None = None  # set by the renewal thread when the DB refused a renewal
        self._hanging: dict[str, threading.Thread] = {}  # service -> a metric read that never answered
        self.backoff: dict[str, Backoff] = {}
        #: (kind, target) -> the intervention on record (who, when) behind paused/overrides/pinned
        self.intervened: dict[tuple[str, str], db.InterventionRecord] = {}
        self._expired_overrides = False  # an override ran out: its row goes in the record step
        if hasattr(backend, "fence"):  # optional capability: the backend fences inside long actions
            backend.fence = self._check_lead
        self.clock = clock
        self.hardware = load_hardware(cfg.pool.hardware)
        self.policy_state: dict[str, PolicyState] = {s.name: PolicyState() for s in cfg.services}
        self.last_rescale: dict[str, float] = {}
        self._recoveries_seen: dict[str, int] = {}  # job -> generation whose recovery is on record
        self.recoveries: list[tuple[str, int]] = []  # (job, generation) of each recovery put on record
        self.paused = False
        self.ready = False
        self.last_error: str | None = None
        self.last_tick: TickResult | None = None
        self.is_leader = False
        self.recovered = False
        self.overrides: dict[str, tuple[int, float]] = {}
        self._ahead: dict[str, set[GPU]] = {}  # service -> GPUs last drained ahead (to log changes only)
        self._hold: str | None = None  # digest of the hold run being recorded (None after a change)
        self._vanished_seen: set[tuple[str, str]] = set()
        self._source_errors: dict[str, str] = {}  # service -> its metric source's failure, logged once
        self._lease_state: bool | None = None  # leader at the last tick (None: no tick yet), to log changes
        self._housekept_at: float | None = None
        self.pinned: dict[str, dict[int, tuple[str, float]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._throughput = dict(throughput or {})
        for j in cfg.jobs:
            if j.name not in self._throughput:
                self._throughput[j.name] = throughput_table(
                    cfg.models()[j.name], self.hardware, min(j.max_gpus, cfg.pool.total_gpus),
                    gpus_per_node=cfg.pool.gpus_per_node, global_batch=j.global_batch,
                    allowed_tp=j.allowed_tp, allowed_pp=j.allowed_pp, zero=j.zero,
                    replicate_optimizer=j.no_zero1)
        check_feasible(cfg, self._throughput)
        self._register()
        self._load_interventions()

    # ---- lifecycle ------------------------------------------------------------------------------
    def _register(self) -> None:
        now = _dt(self.clock())
        db.upsert_pool(self.store, self.pool, self.cfg.pool.model_dump(), now=now)
        for s in self.cfg.services:
            db.upsert_service(self.store, s.name, self.pool, s.model_dump(by_alias=True), now=now)
        for j in self.cfg.jobs:
            db.upsert_job(self.store, j.name, self.pool, j.model_dump(), now=now)

    def recover(self) -> list[str]:
        """Reconcile what the DB shows in flight with what the backend reports. Returns notes.

        1. what the backend re-attached to (detached Ray: actors that outlived the last controller);
        2. actions begun and never finished: closed as interrupted, with the backend's truth;
        3. reshards in flight: ``done`` when the job now runs the target layout at that generation
           (its workers finished the directive without a controller; bytes and pause from the job),
           else ``failed`` with the layout it is on;
        4. allocations re-recorded from the backend, and a ``Recovered`` decision with the notes.
        """
        now = self.clock()
        notes: list[str] = list(getattr(self.backend, "adopted", None) or [])
        for act in db.open_actions(self.db, self.pool):
            rt = self.backend.job_runtime(act.workload) if act.kind.endswith("training") else None
            truth = f"backend reports {_recorded_layout(rt)} on {len(rt.gpus)} GPUs" if rt else "backend reports nothing running"
            db.finish_action(self.db, act.id, error=f"interrupted (controller restarted); {truth}")
            notes.append(f"{act.kind} {act.workload} interrupted: {truth}")
        for ev in db.in_flight_reshards(self.db, self.pool):
            rt = self.backend.job_runtime(ev.job)
            done = rt is not None and _recorded_layout(rt) == ev.to_layout and rt.generation >= ev.generation
            if done:
                db.finish_reshard(self.db, ev.id, bytes_moved=rt.last_bytes_moved, pause_seconds=rt.last_pause_seconds,
                                  now=_dt(now))
                self.last_rescale[ev.job] = now
            else:
                db.finish_reshard(self.db, ev.id, bytes_moved=None, pause_seconds=None, now=_dt(now),
                                  error=f"interrupted (controller restarted); job is on "
                                        f"{_recorded_layout(rt) if rt else 'nothing'} generation {rt.generation if rt else 0}")
            notes.append(f"reshard {ev.job} g{ev.generation} {ev.from_layout} -> {ev.to_layout}: "
                         f"{'completed by the workers' if done else 'abandoned'}")
        self._record_allocations(self._observed_allocation(), generation=0)
        if notes:
            log.warning("recovered: %s", "; ".join(notes))
            db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason="Recovered",
                               message="; ".join(notes), plan={"steps": [], "notes": notes}, inputs={})
        self.recovered = True
        return notes

    def stop(self) -> None:
        self._stop.set()

    def release_lease(self) -> None:
        """Hand the pool's lease back now if we hold it, so a successor need not wait for it
        to expire; a failure is only logged (the lease expires on its own). Only at our epoch: if
        we were stalled and a process of the same name took it over, its lease stays."""
        if not self.is_leader or self.db.epoch is None:
            return
        try:
            db.release_lease(self.store, self.pool, self.owner, epoch=self.db.epoch)
        except Exception as e:  # noqa: BLE001 - it expires on its own
            log.warning("could not release the lease of pool %s: %s", self.pool, e)
        # the released row keeps our name and epoch until someone takes it: our own fence must
        # refuse from now on, not the DB's
        self._stand_down(None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for grows still running in the background; True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._growing):
            t = self._growing[job][0]
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(g[0].is_alive() for g in self._growing.values())

    # ---- operator interventions (admin API) -------------------------------------------------------
    # Each is written to the DB (``store``: the caller's transaction, e.g. with its audit entry)
    # before it changes the live state, so what the controller acts on is always on record.
    def pause(self, *, actor: str = "controller", store: Any = None) -> None:
        """Stop acting (ticks still observe nothing and record nothing) until ``resume``; kept across restarts."""
        rec = db.set_intervention(store or self.store, pool=self.pool, kind="pause", target=self.pool, actor=actor,
                                  now=_dt(self.clock()))
        self.paused = True
        self.intervened[("pause", self.pool)] = rec

    def resume(self, *, store: Any = None) -> None:
        db.clear_intervention(store or self.store, pool=self.pool, kind="pause", target=self.pool)
        self.paused = False
        self.intervened.pop(("pause", self.pool), None)

    def set_override(self, service: str, replicas: int, until: float, *, actor: str = "controller",
                     store: Any = None) -> None:
        """Pin a service's replica count until ``until`` (epoch seconds); the policy still runs."""
        spec = self._service_spec(service)
        if not spec.min_replicas <= replicas <= spec.max_replicas:
            raise ValueError(f"replicas={replicas} outside [{spec.min_replicas}, {spec.max_replicas}] of '{service}'")
        rec = db.set_intervention(store or self.store, pool=self.pool, kind="override", target=service, actor=actor,
                                  value={"replicas": replicas}, until=_dt(until), now=_dt(self.clock()))
        self.overrides[service] = (replicas, until)
        self.intervened[("override", service)] = rec

    def clear_override(self, service: str, *, store: Any = None) -> None:
        db.clear_intervention(store or self.store, pool=self.pool, kind="override", target=service)
        self.overrides.pop(service, None)
        self.intervened.pop(("override", service), None)

    def pin_layout(self, job: str, layout: Layout | None, *, actor: str = "controller", store: Any = None) -> None:
        """Force ``job`` onto ``layout`` (validated by the caller with the planner); None unpins."""
        if job not in self._throughput:
            raise KeyError(job)
        if layout is None:
            db.clear_intervention(store or self.store, pool=self.pool, kind="pin", target=job)
            self.pinned.pop(job, None)
            self.intervened.pop(("pin", job), None)
        else:
            rec = db.set_intervention(store or self.store, pool=self.pool, kind="pin", target=job, actor=actor,
                                      value={"layout": str(layout)}, now=_dt(self.clock()))
            self._pin(job, layout)
            self.intervened[("pin", job)] = rec

    def _pin(self, job: str, layout: Layout) -> None:
        tps = self._throughput[job].get(layout.world_size, (str(layout), 1.0))[1]
        self.pinned[job] = {layout.world_size: (str(layout), max(tps, 1.0))}

    def _load_interventions(self) -> None:
        """The interventions on record become the live ones (at start and whenever this controller
        takes the lease: a predecessor's pause or pins hold). An override that ran out, or one for a
        workload this controller does not manage (or with a count its spec no longer allows), is left
        out; overrides set in memory only (the operator's ``spec.replicas``) stay as they are."""
        now = self.clock()
        for kind, target in list(self.intervened):
            if kind == "override":
                self.overrides.pop(target, None)
            elif kind == "pin":
                self.pinned.pop(target, None)
        self.intervened, self.paused = {}, False
        services = {s.name: s for s in self.cfg.services}
        for r in db.list_interventions(self.store, self.pool):
            if r.kind == "pause":
                self.paused = True
            elif r.kind == "override":
                spec, replicas = services.get(r.target), r.value.get("replicas")
                if r.until is None or r.until.timestamp() <= now:
                    self._expired_overrides = True
                    continue
                if spec is None or not isinstance(replicas, int) or \
                        not spec.min_replicas <= replicas <= spec.max_replicas:
                    log.warning("override of %s on record (%s by %s) ignored: not a service of this controller or "
                                "outside its replica bounds", r.target, r.value, r.actor)
                    continue
                self.overrides[r.target] = (replicas, r.until.timestamp())
            elif r.kind == "pin":
                try:
                    layout = Layout.parse(str(r.value.get("layout")))
                except SpecError:
                    layout = None
                if r.target not in self._throughput or layout is None:
                    log.warning("layout pin of %s on record (%s by %s) ignored: not a job of this controller or "
                                "not a layout", r.target, r.value, r.actor)
                    continue
                self._pin(r.target, layout)
            self.intervened[(r.kind, r.target)] = r
        if self.intervened:
            log.info("interventions on record: %s", "; ".join(
                f"{k} {t}{'' if k == 'pause' else ' ' + json.dumps(r.value)} by {r.actor}"
                for (k, t), r in sorted(self.intervened.items())))

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> Any:
        """Save ``job``'s state at its next step boundary and, with ``wait_seconds``, wait until
        every rank wrote it (``CheckpointOutcome``). Not under the tick's lock: a tick goes on
        meanwhile. KeyError: not a job of this controller; BackendError: not running or the
        backend cannot; SpecError (no checkpoint settings), CheckpointFailed, TimeoutError."""
        if job not in self._throughput:
            raise KeyError(job)
        spec = next((j for j in self.cfg.jobs if j.name == job), None)
        if spec is not None and spec.checkpoint is None:  # the spec says it all, running or not
            raise SpecError(f"job {job} has no checkpoint settings; give it checkpoint.dir to save one")
        act = getattr(self.backend, "checkpoint_job", None)
        if act is None:
            raise BackendError(f"the {getattr(self.backend, 'name', type(self.backend).__name__)} backend cannot save "
                               "a checkpoint on demand")
        out = act(job, wait_seconds)
        log.info("checkpoint of %s asked for%s", job, f": step {out.step}" if out.step is not None else "")
        return out

    def _service_spec(self, service: str) -> Any:
        for s in self.cfg.services:
            if s.name == service:
                return s
        raise KeyError(service)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            started = self.clock()
            self.tick()
            self.housekeep()
            self._stop.wait(max(0.0, self.cfg.controller.tick_seconds - (self.clock() - started)))
        self.release_lease()

    # ---- between ticks: retention ------------------------------------------------------------------
    def housekeep(self, *, force: bool = False) -> dict[str, int]:
        """Enforce the retention settings: delete history older than each table's limit.

        Runs between ticks, never inside one, and only on the lease holder (a standby leaves the
        store alone). At most every ``retention.interval_seconds`` (``force``: now), in batches of
        ``retention.batch_rows`` rows, each its own short transaction, for at most
        ``retention.max_seconds``; what is left waits for the next pass. Returns rows deleted
        per table; a store failure is logged, never raised (the next pass retries).
        """
        r = self.cfg.controller.retention
        now = self.clock()
        if not self.is_leader or (not force and self._housekept_at is not None
                                  and now - self._housekept_at < r.interval_seconds):
            return {}
        self._housekept_at = now
        deadline = time.monotonic() + r.max_seconds
        deleted: dict[str, int] = {}
        try:
            with self._lock:  # never at the same time as a tick (SQLite has one writer)
                for table, days in r.days().items():
                    if days is None:
                        continue
                    cutoff = _dt(now - days * 86400.0)
                    while time.monotonic() < deadline:
                        n = db.purge_history(self.db, table, cutoff, r.batch_rows)
                        deleted[table] = deleted.get(table, 0) + n
                        if n < r.batch_rows:
                            break
        except db.StoreError as e:
            log.warning("retention pass stopped: %s (the next pass retries)", e)
        gone = {t: n for t, n in deleted.items() if n}
        if gone:
            left = " (more left for the next pass)" if time.monotonic() >= deadline else ""
            log.info("retention: deleted %s%s", ", ".join(f"{n} {t} older than {r.days()[t]:g} d"
                                                          for t, n in gone.items()), left)
        return deleted

    # ---- one reconcile cycle --------------------------------------------------------------------
    def tick(self) -> TickResult:
        with self._lock:
            t0 = time.perf_counter()
            now = self.clock()
            try:
                res = self._tick(now)
                if self.last_error is not None:
                    log.info("acting again: the database and the backend answer")
                self.ready, self.last_error = True, None
            except db.LeaseLost as e:
                # another controller leads now: stop here, before the next action, and stand by
                self._stand_down(str(e))
                res = TickResult(now, False, "LeaseLost", str(e))
                self.ready, self.last_error = True, None
            except (db.StoreUnavailable, BackendUnavailable) as e:
                error = f"{type(e).__name__}: {e}"
                # once when it starts or changes, not every tick while it lasts
                (log.error if error != self.last_error else log.debug)("not acting: %s", error)
                self.ready, self.last_error = False, error
                res = TickResult(now, False, "Unavailable", self.last_error, error=self.last_error)
            res.seconds = time.perf_counter() - t0
            self.last_tick = res
            return res

    def _tick(self, now: float) -> TickResult:
        # 0. lead
        self._bounded("backend ping", self.backend.ping)
        self.store.ping()
        if not self._lead(now):
            holder = db.lease_holder(self.store, self.pool, now=_dt(now))
            self._lease_changed(False, holder.owner if holder else "?")
            return TickResult(now, False, "NotLeader", f"lease held by {holder.owner if holder else '?'}")
        self._lease_changed(True, self.owner)
        with self._heartbeat():
            return self._lead_tick(now)

    def _lead_tick(self, now: float) -> TickResult:
        if not self.recovered:
            self.recover()
        if self.paused:
            return TickResult(now, False, "Paused", "controller paused by an operator")
        # 1. observe
        nodes = self._bounded("backend inventory", self.backend.inventory)
        # a failed job's workers are gone or stuck: its GPUs are reclaimed in step 3a, so the
        # plan already treats it as not running (it starts afresh when GPUs allow)
        failed = {j.name: rt for j in self.cfg.jobs
                  if (rt := self.backend.job_runtime(j.name)) is not None and rt.phase == "Failed"}
        previous, runtimes = self._observe_jobs(set(failed))
        samples = {s.name: self._sample(s.name, now) for s in self.cfg.services}
        # 2. decide
        replica_decisions = self._decide_replicas(now, previous, samples)
        plan = schedule(self._snapshot(now, nodes, previous, replica_decisions, runtimes))
        # 3. apply: 3a. reclaim failed jobs, 3b. the plan's ordered steps
        applied, error = self._reap_failed(now, failed)
        if error is None:
            steps, error = self._apply(now, plan)
            applied += steps
        if error is None and self._replan:
            # a grow was called off: plan again from what the job really holds, same replica
            # decisions (the policy is stateful and has spoken for this tick)
            self._replan = False
            previous, runtimes = self._observe_jobs(set(failed))
            plan = schedule(self._snapshot(now, nodes, previous, replica_decisions, runtimes))
            steps, error = self._apply(now, plan)
            applied += steps
        if error is None:
            # 3c. drain ahead of the scale-downs the policy's windows are about to let through
            applied += self._drain_ahead(now, nodes, failed, plan, replica_decisions)
        # 4. record
        self._record(now, plan, replica_decisions, samples, applied, error)
        return TickResult(now, True, plan.reason, plan.message, plan, replica_decisions, applied, error)

    # ---- 0. lead: the lease, its renewal while the tick works, the fence ---------------------------
    def _lead(self, now: float) -> bool:
        """Take or renew the pool's lease. A new epoch (a takeover, or ours again after it ran out)
        loads the interventions on record: a predecessor may have paused or pinned meanwhile."""
        ttl = self.cfg.controller.lease_seconds
        asked = time.monotonic()  # the lease runs from no later than this, whatever the DB's delay
        epoch = db.take_lease(self.store, self.pool, self.owner, ttl, now=_dt(now), epoch=self.db.epoch)
        if epoch is None:
            self._stand_down(None)  # said by _lease_changed, with the holder's name
            return False
        self._lost, self._lead_until = None, asked + ttl * _LEASE_MARGIN
        if epoch != self.db.epoch:
            self.db.epoch = epoch
            self._load_interventions()
        self.is_leader = True
        return True

    def _stand_down(self, why: str | None) -> None:
        """No longer the leader: nothing more is acted or written until the lease is ours again,
        and then the DB's state is recovered first (another leader acted meanwhile)."""
        if self.db.epoch is not None and why is not None:
            log.warning("lost the lease of pool %s: %s; stopped before the next action, standing by", self.pool, why)
            self._lease_state = False
        self.db.epoch, self.is_leader, self.recovered, self._hold = None, False, False, None

    def _check_lead(self) -> None:
        """The local half of the fence, before every backend action and DB write of a tick:
        ``LeaseLost`` once a renewal was refused, or once the lease may have run out on this
        host's clock (a process stalled past it, e.g. stopped, must not act on waking)."""
        if self._lost is not None:
            raise db.LeaseLost(self._lost)
        if self.db.epoch is None:
            raise db.LeaseLost(f"{self.owner} does not hold the lease of pool {self.pool}")
        late = time.monotonic() - self._lead_until
        if late > 0:
            raise db.LeaseLost(f"the lease of pool {self.pool} was not renewed in time ({late:.1f} s past its "
                               "deadline on this host)")

    @contextlib.contextmanager
    def _heartbeat(self) -> Iterator[None]:
        """Renew the lease every third of its length while the tick works (a long rescale keeps it);
        a refused renewal marks it lost (``_check_lead`` then stops the tick at its next step)."""
        ttl = self.cfg.controller.lease_seconds
        done = threading.Event()
        epoch = self.db.epoch

        def beat() -> None:
            while not done.wait(ttl / 3):
                asked = time.monotonic()
                try:
                    ok = db.renew_lease(self.store, self.pool, self.owner, ttl, now=_dt(self.clock()), epoch=epoch)
                except db.StoreError as e:  # the deadline decides if the DB stays away
                    log.warning("could not renew the lease of pool %s: %s", self.pool, e)
                    continue
                if not ok:
                    self._lost = f"the lease of pool {self.pool} could not be renewed: another controller holds it"
                    return
                self._lead_until = asked + ttl * _LEASE_MARGIN

        t = threading.Thread(target=beat, name=f"lease-{self.pool}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

    def _act(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A backend action, fenced: only while the lease is still ours."""
        self._check_lead()
        return fn(*args)

    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """A backend read that must not hold the tick: ``BackendUnavailable`` after
        ``backend_timeout_seconds`` (the call is left to finish on its own)."""
        return _call_within(fn, self.cfg.controller.backend_timeout(), what, BackendUnavailable)

    def _lease_changed(self, leader: bool, holder: str) -> None:
        """One line when this controller gains or loses the pool's lease (or starts as a standby)."""
        was, self._lease_state = self._lease_state, leader
        if was == leader:
            return
        if leader:
            log.info("leading pool %s: lease taken by %s at epoch %s (%g s, renewed while a tick works)", self.pool,
                     self.owner, self.db.epoch, self.cfg.controller.lease_seconds)
        elif was:
            log.warning("lost the lease of pool %s to %s: standing by, not acting", self.pool, holder)
        else:
            log.info("standing by: the lease of pool %s is held by %s", self.pool, holder)

    # ---- 1. observe -----------------------------------------------------------------------------
    def _observe_jobs(self, failed: set[str]) -> tuple[Allocation, dict[str, JobRuntime | None]]:
        """What every workload holds, and each job's runtime (None: not running, or failed)."""
        runtimes = {j.name: None if j.name in failed else self.backend.job_runtime(j.name) for j in self.cfg.jobs}
        for name, rt in runtimes.items():
            if rt is not None and rt.recovery and self._recoveries_seen.get(name) != rt.generation:
                self._record_recovery(rt)
        self._forgive(runtimes, self.clock())
        return self._observed_allocation(exclude=failed), runtimes

    def _record_recovery(self, rt: JobRuntime) -> None:
        """A job recovered from a lost worker on its own (no action of ours): put it on record as a
        finished reshard and a ``WorkerLost`` decision, once."""
        self._recoveries_seen[rt.name] = rt.generation
        self.recoveries.append((rt.name, rt.generation))
        now = self.clock()
        if not any(ev.generation == rt.generation
                   for ev in db.list_reshards(self.db, job=rt.name, limit=5, newest_first=True)):
            rid = db.start_reshard(self.db, job=rt.name, pool=self.pool, generation=rt.generation,
                                   from_layout=rt.recovered_from or "", to_layout=rt.layout or "",
                                   bytes_planned=rt.last_bytes_moved or 0, bytes_lower_bound=0, now=_dt(now))
            db.finish_reshard(self.db, rid, bytes_moved=rt.last_bytes_moved, pause_seconds=rt.last_pause_seconds,
                              now=_dt(now))
        msg = (f"{rt.name} recovered in place from {rt.recovery}: {rt.recovered_from} -> {rt.layout} on "
               f"{len(rt.gpus)} GPUs, training resumed (pause {rt.last_pause_seconds or 0.0:.2f} s)")
        log.warning("%s", msg)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason="WorkerLost", message=msg,
                           plan={"steps": [], "notes": [msg], "job": rt.name, "generation": rt.generation,
                                 "lost": rt.recovery}, inputs={})

    def _failed_start(self, job: str, reason: str, now: float) -> None:
        """A start or grow of ``job`` failed (or the job failed on its own): wait before the next
        attempt, twice as long after each failure in a row (``start_backoff_*``)."""
        b = self.backoff.get(job)
        n = (b.failures if b else 0) + 1
        wait = self.cfg.controller.backoff_after(n)
        self.backoff[job] = Backoff(n, reason[:500], now + wait, now)
        log.warning("job %s: failure %d in a row (%s); it gets no more GPUs for %g s", job, n, reason[:200], wait)

    def _backing_off(self, job: str, now: float) -> Backoff | None:
        b = self.backoff.get(job)
        return b if b is not None and now < b.next_at else None

    def _forgive(self, runtimes: Mapping[str, JobRuntime | None], now: float) -> None:
        """A job running ``start_backoff_max_seconds`` after its last failure starts afresh."""
        cap = self.cfg.controller.start_backoff_max_seconds
        for job, b in list(self.backoff.items()):
            rt = runtimes.get(job)
            if rt is not None and rt.phase == "Running" and now - b.last_failure_at >= cap:
                del self.backoff[job]
                log.info("job %s has run %g s since its last failure: its backoff is over", job, cap)

    def _observed_allocation(self, exclude: set[str] | None = None) -> Allocation:
        hold: dict[str, tuple[GPU, ...]] = {}
        for s in self.cfg.services:
            g = self.backend.service_gpus(s.name)
            if g:
                hold[s.name] = g
        for j in self.cfg.jobs:
            if exclude and j.name in exclude:
                continue
            if self._grow_in_flight(j.name):
                hold[j.name] = self._growing[j.name][1]  # reserved for the joiners starting now
                continue
            rt = self.backend.job_runtime(j.name)
            if rt and rt.gpus:
                hold[j.name] = rt.gpus
        return Allocation(hold)

    def _grow_in_flight(self, job: str) -> bool:
        g = self._growing.get(job)
        if g is None:
            return False
        if g[0].is_alive():
            return True
        del self._growing[job]
        return False

    def _wait_grow(self, job: str) -> None:
        g = self._growing.pop(job, None)
        if g is not None:
            g[0].join()

    def _grow_async(self, step: PlanStep, spec: Any, gpus: tuple[GPU, ...], now: float, action_id: int) -> None:
        errors: list[str] = []

        def run() -> None:
            try:
                self._apply_step(step, spec, gpus, now)
                db.finish_action(self.db, action_id, now=_dt(self.clock()))
            except db.LeaseLost as e:  # the new leader recovers this grow from the DB and the backend
                log.warning("grow of %s stopped: %s", spec.name, e)
                return
            except GrowCancelled as e:
                log.info("grow of %s called off: %s", spec.name, e)
                db.finish_action(self.db, action_id, error=str(e), cancelled=True, now=_dt(self.clock()))
            except Exception as e:  # noqa: BLE001 - recorded; the next tick observes the job as it is
                errors.append(str(e))
                log.error("grow of %s failed: %s", spec.name, e)
                self._failed_start(spec.name, str(e), self.clock())
                db.finish_action(self.db, action_id, error=str(e), now=_dt(self.clock()))

        t = threading.Thread(target=run, name=f"grow-{spec.name}", daemon=True)
        self._growing[spec.name] = (t, gpus, errors)
        t.start()

    def _sample(self, service: str, now: float) -> MetricSample | None:
        src = self.sources.get(service)
        if src is None:
            return None
        try:
            hung = self._hanging.get(service)
            if hung is not None and hung.is_alive():
                raise TimeoutError("its previous read has not answered yet")
            # a source that never answers (a Prometheus accepting connections and nothing more) must
            # not hold the tick; its thread goes on and the next read waits for it to end
            s = _call_within(lambda: src.sample(service, now), self.cfg.controller.metrics_timeout(),
                             f"metric read for {service}", TimeoutError, hanging=self._hanging, key=service)
        except Exception as e:  # noqa: BLE001 - a failing source is missing data, never zero
            if self._source_errors.get(service) != str(e):  # once per failure, not every tick
                log.warning("metric source for %s failed: %s", service, e)
            self._source_errors[service] = str(e)
            return None
        if self._source_errors.pop(service, None) is not None:
            log.info("metric source for %s answers again", service)
        if s is not None and now - s.observed_at > self.cfg.controller.metrics_max_age_seconds:
            return MetricSample(s.value, s.observed_at, s.source, stale=True)
        return s

    # ---- 2. decide ------------------------------------------------------------------------------
    def _decide_replicas(self, now: float, previous: Allocation, samples: dict[str, MetricSample | None]
                         ) -> dict[str, ReplicaDecision]:
        out: dict[str, ReplicaDecision] = {}
        for s in self.cfg.services:
            current = len(previous.gpus_of(s.name)) // s.gpus_per_replica
            ctx = PolicyContext.from_sample(s, current, samples[s.name], now, self.policy_state[s.name])
            decision, self.policy_state[s.name] = policy_decide(ctx)
            pin = self.overrides.get(s.name)
            if pin is not None and now < pin[1]:
                # a pinned service has no forecast to lend by
                decision = replace(decision, replicas=pin[0], reason="Override", leaving=0, outlook=(),
                                   message=f"pinned to {pin[0]} replicas by an operator (policy said {decision.replicas})")
            elif pin is not None:
                del self.overrides[s.name]
                if self.intervened.pop(("override", s.name), None) is not None:
                    self._expired_overrides = True  # its row goes in the record step
            out[s.name] = decision
        return out

    def _snapshot(self, now: float, nodes: dict[str, int], previous: Allocation,
                  replicas: dict[str, ReplicaDecision], runtimes: dict[str, JobRuntime | None]) -> Snapshot:
        services = tuple(
            ServiceDemand(s.name, replicas[s.name].replicas, s.gpus_per_replica, s.priority, s.min_replicas,
                          outlook=replicas[s.name].outlook)
            for s in self.cfg.services)
        jobs = tuple(
            JobState(j.name, self._table(j.name, now, previous), j.min_gpus, j.max_gpus, j.priority,
                     layout=(runtimes[j.name].layout if _trains(runtimes[j.name]) else None),
                     last_rescale_at=self.last_rescale.get(j.name),
                     # the job's own last pause: a grow must repay it (and the shrink back) before the
                     # services' outlook needs the GPUs again
                     pause_seconds=float((runtimes[j.name].last_pause_seconds if runtimes[j.name] else None) or 0.0),
                     status=_job_status(runtimes[j.name]),
                     # a backend that cannot keep a job's state off-GPU can only preempt it, and no
                     # backend can keep a user job's (its state is the user's code's): say so
                     on_below_minimum=(j.on_below_minimum if self._can_pause and j.entrypoint is None
                                       else "preempt"))
            for j in self.cfg.jobs)
        return Snapshot(now, nodes, services, jobs, previous, Knobs.from_pool(self.cfg.pool))

    def _table(self, job: str, now: float, previous: Allocation) -> Mapping[int, tuple[str, float]]:
        """The job's GPU count -> layout table as the co-scheduler sees it: its pin if any; while it
        backs off from a failed start, no count above what it holds (it is not started or grown)."""
        table = self.pinned.get(job, self._throughput[job])
        if self._backing_off(job, now) is None:
            return table
        held = len(previous.gpus_of(job))
        return {n: v for n, v in table.items() if n <= held}

    # ---- 3. apply -------------------------------------------------------------------------------
    def _reap_failed(self, now: float, failed: dict[str, JobRuntime]) -> tuple[list[str], str | None]:
        """Stop each failed job so its GPUs return to the pool; the failure reason goes on record."""
        done: list[str] = []
        specs = {j.name: j for j in self.cfg.jobs}
        for name, rt in failed.items():
            why = rt.error or "no reason reported"
            action_id = db.begin_action(self.db, pool=self.pool, kind="stop_failed_training", workload=name,
                                        payload={"gpus": [str(g) for g in rt.gpus], "reason": why}, now=_dt(now))
            log.error("job %s failed on %s at step %d (%s); reclaiming its %d GPUs", name, rt.layout, rt.step, why,
                      len(rt.gpus))
            try:
                self._act(self.backend.set_job_gpus, specs[name], (), None)
            except BackendError as e:
                db.finish_action(self.db, action_id, error=str(e), now=_dt(self.clock()))
                return done, f"stop_failed_training {name}: {e}"
            db.finish_action(self.db, action_id, now=_dt(self.clock()))
            self.last_rescale.pop(name, None)
            self._failed_start(name, why, now)
            done.append(f"stop_failed_training {name}: {why}")
        return done, None

    def _apply(self, now: float, plan: SchedulePlan) -> tuple[list[str], str | None]:
        applied: list[str] = []
        specs = {s.name: s for s in self.cfg.services} | {j.name: j for j in self.cfg.jobs}
        for step in plan.steps:
            if step.action == "noop":
                continue
            gpus = plan.allocation.gpus_of(step.workload)
            if self._grow_in_flight(step.workload):
                if step.action == "grow_training":
                    applied.append(f"{step.action} {step.workload} (in flight)")
                    continue
                # Inference wants GPUs back from a job whose grow is still starting joiners: call
                # the grow off (nothing has moved yet) rather than wait seconds for joiners that
                # would leave again; the tick then plans once more from what the job really holds.
                if self._act(self.backend.cancel_grow, step.workload):
                    self._wait_grow(step.workload)
                    applied.append(f"cancel_grow {step.workload} (joiners dismissed before their directive; "
                                   f"{step.action} re-planned)")
                    log.info("called off the grow of %s: %s needs its GPUs", step.workload, step.action)
                    self._replan = True
                    return applied, None
                self._wait_grow(step.workload)  # past its directive: a shrink waits for the grow to land
            action_id = db.begin_action(self.db, pool=self.pool, kind=step.action, workload=step.workload,
                                        payload={"gpus": [str(g) for g in gpus], "reason": step.reason},
                                        now=_dt(now))
            if step.action == "grow_training" and self.async_grow:
                self._grow_async(step, specs[step.workload], gpus, now, action_id)
                applied.append(f"{step.action} {step.workload} (started)")
                continue
            try:
                self._apply_step(step, specs[step.workload], gpus, now)
            except BackendError as e:
                if step.action == "grow_training" and not isinstance(e, GrowCancelled):
                    self._failed_start(step.workload, str(e), now)
                db.finish_action(self.db, action_id, error=str(e), now=_dt(self.clock()))
                log.error("step %s %s failed: %s; the rest of this plan is skipped", step.action, step.workload, e)
                return applied, f"{step.action} {step.workload}: {e}"
            db.finish_action(self.db, action_id, now=_dt(self.clock()))
            applied.append(f"{step.action} {step.workload}")
        return applied, None

    def _drain_ahead(self, now: float, nodes: dict[str, int], failed: dict[str, JobRuntime], plan: SchedulePlan,
                     replicas: dict[str, ReplicaDecision]) -> list[str]:
        """Take out of the load balancer the replicas a scale-down the policy sees coming will remove
        (``ReplicaDecision.leaving``; 0 while an operator pins the count), so it finds them drained and
        their GPUs go to training at once.

        Which replicas: those the co-scheduler would remove if the service had ``leaving`` fewer
        now (the same pure decision the scale-down will make; should it pick others then, those
        drain as usual). A service scaled this tick or one whose ``leaving`` is 0 gets every
        replica back. The backend holds them out for a few ticks unless asked again, so
        a controller that stops ticking cannot strand them."""
        act = getattr(self.backend, "drain_ahead", None)
        if act is None:
            return []
        scaled = {st.workload for st in plan.steps if st.action in ("scale_inference_up", "scale_inference_down")}
        hold = max(10.0, 3 * self.cfg.controller.tick_seconds)
        wanted: dict[str, tuple[GPU, ...]] = {}
        alloc: Allocation | None = None
        runtimes: dict[str, JobRuntime | None] = {}
        for s in self.cfg.services:
            d = replicas[s.name]
            gpus: tuple[GPU, ...] = ()
            if d.leaving > 0 and s.name not in scaled:
                if alloc is None:  # what every workload holds after this tick's steps
                    alloc, runtimes = self._observe_jobs(set(failed))
                fewer = {**replicas, s.name: replace(d, replicas=d.replicas - d.leaving)}
                try:
                    keep = set(schedule(self._snapshot(now, nodes, alloc, fewer, runtimes)).allocation.gpus_of(s.name))
                except Exception as e:  # noqa: BLE001 - a nicety: never a reason to stop the tick
                    log.warning("drain ahead of %s: no plan for %d replicas (%s); nobody drained ahead", s.name,
                                d.replicas - d.leaving, e)
                    keep = set(alloc.gpus_of(s.name))
                gpus = tuple(g for g in alloc.gpus_of(s.name) if g not in keep)
            wanted[s.name] = gpus
        out: list[str] = []
        for name, gpus in wanted.items():
            try:
                urls = self._act(act, name, gpus, hold)
            except BackendError as e:  # a nicety, never a reason to stop the tick
                log.warning("drain ahead of %s failed: %s", name, e)
                continue
            if set(gpus) != self._ahead.get(name, set()):
                self._ahead[name] = set(gpus)
                out.append(f"drain_ahead {name}: " + (f"{len(urls)} replica(s) out of the load balancer on "
                                                      f"{', '.join(str(g) for g in gpus)}" if gpus
                                                      else "every replica back in the load balancer"))
        return out

    @property
    def _can_pause(self) -> bool:
        return callable(getattr(self.backend, "pause_job", None))

    def _apply_step(self, step: PlanStep, spec: Any, gpus: tuple[GPU, ...], now: float) -> None:
        if step.action in ("scale_inference_up", "scale_inference_down"):
            self._act(self.backend.set_service_gpus, spec, gpus)
            if step.action == "scale_inference_up":
                self._landed(spec.name, len(gpus) // spec.gpus_per_replica)
            return
        if step.action == "pause_training" and self._can_pause:
            self._pause(spec, now)
            return
        layout = None
        target = step.target
        if gpus:
            text = getattr(target, "layout_after", None) or self._throughput[spec.name][len(gpus)][0]
            layout = Layout.parse(text)
        before = self.backend.job_runtime(spec.name)
        to = str(layout) if before is not None and layout is not None else None
        self._reshard_on_record(spec, before, to, now, lambda: self._act(self.backend.set_job_gpus, spec, gpus, layout))

    def _landed(self, service: str, replicas: int) -> None:
        """A scale-up landed *now*, seconds after the tick that decided it began (see ``policy.landed``)."""
        st = self.policy_state.get(service)
        if st is not None:
            self.policy_state[service] = policy_landed(st, self.clock(), replicas)

    def _pause(self, spec: Any, now: float) -> None:
        """Free every GPU of a job and keep its state off-GPU (keepers); recorded as a reshard to
        ``paused:<layout the keepers hold>``, with its bytes and seconds."""
        before = self.backend.job_runtime(spec.name)
        to = (paused_tag(Layout.parse(before.layout).held())
              if before is not None and before.layout and before.phase != "Paused" else None)
        self._reshard_on_record(spec, before, to, now, lambda: self._act(self.backend.pause_job, spec))  # type: ignore[attr-defined]

    def _reshard_on_record(self, spec: Any, before: JobRuntime | None, to_layout: str | None, now: float,
                           act: Callable[[], RescaleOutcome]) -> None:
        """Run ``act`` (a start, rescale, stop or pause); when it moves state (``to_layout``), record it in
        the reshard history: in flight first, then done with its bytes and pause, or failed/cancelled."""
        rid = None
        if before is not None and to_layout is not None:
            rid = db.start_reshard(self.db, job=spec.name, pool=self.pool, generation=before.generation + 1,
                                   from_layout=_recorded_layout(before) or "", to_layout=to_layout, bytes_planned=0,
                                   bytes_lower_bound=0, now=_dt(now))
        try:
            out = act()
        except BackendError as e:
            if rid is not None:  # a called-off grow (nothing moved) ends as cancelled, with the reason
                db.finish_reshard(self.db, rid, bytes_moved=None, pause_seconds=None, error=str(e),
                                  cancelled=isinstance(e, GrowCancelled))
            raise
        if rid is not None:
            # planned and lower-bound bytes are known only once the workers planned at the boundary
            db.finish_reshard(self.db, rid, bytes_moved=out.bytes_moved, pause_seconds=out.pause_seconds,
                              now=_dt(self.clock()), bytes_planned=out.bytes_planned,
                              bytes_lower_bound=out.bytes_lower_bound)
            log.info("rescaled %s %s -> %s (generation %d): %s moved (planned %s, lower bound %s), "
                     "training paused %s", spec.name, _recorded_layout(before) if before else "-", to_layout,
                     before.generation + 1 if before else 1, _bytes(out.bytes_moved), _bytes(out.bytes_planned),
                     _bytes(out.bytes_lower_bound),
                     "-" if out.pause_seconds is None else f"{out.pause_seconds:.2f} s")
        self.last_rescale[spec.name] = now

    # ---- 4. record ------------------------------------------------------------------------------
    def _record(self, now: float, plan: SchedulePlan, replicas: dict[str, ReplicaDecision],
                samples: dict[str, MetricSample | None], applied: list[str], error: str | None) -> None:
        inputs = {
            "metrics": {k: (None if v is None else {"value": v.value, "stale": v.stale}) for k, v in samples.items()},
            "replicas": {k: {"current": d.current, "desired": d.replicas, "leaving": d.leaving, "reason": str(d.reason),
                             "message": d.message}
                         for k, d in replicas.items()},
        }
        plan_doc = {
            "steps": [{"action": s.action, "workload": s.workload, "reason": s.reason, "message": s.message}
                      for s in plan.steps],
            "allocation": {w: [str(g) for g in gs] for w, gs in plan.allocation.holdings.items()},
            "applied": applied,
            "error": error,
            "jobs": {k: asdict(v) for k, v in plan.jobs.items()},
        }
        reason = "ApplyFailed" if error else plan.reason
        message = f"{plan.message}; failed: {error}" if error else plan.message
        hold = None if (applied or error or any(st.action != "noop" for st in plan.steps)) else \
            hold_digest(reason, message, plan, replicas)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason=reason, message=message,
                           plan=plan_doc, inputs=inputs, hold=hold)
        if self._expired_overrides:
            db.drop_expired_overrides(self.db, self.pool, now=_dt(now))
            self._expired_overrides = False
        self._log_decision(reason, message, plan, replicas, applied, error, hold)
        self._record_allocations(self._observed_allocation(), generation=int(now))
        for name, d in replicas.items():
            with self._vanished("service", name):
                db.set_service_status(self.db, name, {
                    "currentReplicas": d.current, "desiredReplicas": d.replicas, "observedValue": d.metric,
                    "leavingReplicas": d.leaving, "reason": str(d.reason), "message": d.message}, now=_dt(now))
        for j in self.cfg.jobs:
            rt = self.backend.job_runtime(j.name)
            jd = plan.jobs.get(j.name)
            with self._vanished("job", j.name):
                self._set_job_status(j.name, rt, jd, now)

    @contextlib.contextmanager
    def _vanished(self, kind: str, name: str) -> Iterator[None]:
        """A workload this controller manages whose row was deleted from the store (by hand, or by a
        client that bypassed the API's refusal) costs its status line, never the tick: said once."""
        try:
            yield
        except db.NotFound:
            if (kind, name) not in self._vanished_seen:
                self._vanished_seen.add((kind, name))
                log.warning("%s %s is gone from the store but declared in the controller's config (%s): its "
                            "status is not recorded; restart with the config that says what it is",
                            kind, name, self.config_source or "given at start")

    def _set_job_status(self, name: str, rt: Any, jd: Any, now: float) -> None:
        b = self.backoff.get(name)
        backoff = None if b is None else {"failures": b.failures, "reason": b.reason,
                                          "nextAttemptAt": _dt(b.next_at).isoformat()}
        if self._backing_off(name, now) is not None and b is not None:
            jd = replace(jd, reason="BackingOff",
                         message=f"failed {b.failures} time(s) in a row ({b.reason[:200]}); next attempt at "
                                 f"{_dt(b.next_at).isoformat()}") if jd is not None else jd
        db.set_job_status(self.db, name, {
            "backoff": backoff,
            "phase": rt.phase if rt else "Pending", "layout": _recorded_layout(rt) if rt else None,
            "generation": rt.generation if rt else 0, "step": rt.step if rt else 0,
            "loss": rt.loss if rt else None, "tokensPerSecond": rt.tokens_per_second if rt else 0.0,
            "worldSize": len(rt.gpus) if rt else 0,
            "checkpointStep": rt.checkpoint_step if rt else None,
            "reason": jd.reason if jd else None, "message": jd.message if jd else None}, now=_dt(now))

    def _log_decision(self, reason: str, message: str, plan: SchedulePlan, replicas: dict[str, ReplicaDecision],
                      applied: list[str], error: str | None, hold: str | None) -> None:
        """One line per change; one per new run of holds that is not plain steady state."""
        was, self._hold = self._hold, hold
        if hold is None:
            steps = [f"{st.action} {st.workload} ({st.reason}: {st.message})" for st in plan.steps
                     if st.action != "noop"] + [a for a in applied if a.startswith(("drain_ahead", "stop_failed"))]
            (log.warning if error else log.info)("decision %s: %s; %s", reason, message,
                                                  "; ".join(steps) or "no plan step")
            return
        if hold == was:
            return
        why = [f"{st.workload} {st.reason}: {st.message}" for st in plan.steps if st.action == "noop"]
        why += [f"{name} {d.reason}: {d.message}" for name, d in sorted(replicas.items())
                if str(d.reason) in _HOLD_REASONS]
        if reason == "Steady" and not why:
            log.debug("holding: %s", message)
            return
        fail_safe = any(str(d.reason) == "MetricsMissing" for d in replicas.values())
        log.info("holding (%s%s): %s; %s", reason, ", fail-safe" if fail_safe else "", message, "; ".join(why))

    def _record_allocations(self, alloc: Allocation, generation: int) -> None:
        current = db.current_allocations(self.db, self.pool)
        for w, gpus in alloc.holdings.items():
            rec = current.get(w)
            if rec is None or sorted(map(str, rec.gpus)) != sorted(map(str, gpus)):
                kind = "inference" if w in {s.name for s in self.cfg.services} else "training"
                db.set_allocation(self.db, self.pool, w, gpus, generation, kind=kind)
        for w in current:
            if w not in alloc.holdings:
                db.release_allocation(self.db, self.pool, w)


#: the share of the lease this controller counts on from the moment it asked for it (the rest is
#: slack for clock rates and the DB's delay)
_LEASE_MARGIN = 0.9


def _call_within(fn: Callable[[], Any], timeout: float, what: str, error: type[Exception], *,
                 hanging: dict[str, threading.Thread] | None = None, key: str = "") -> Any:
    """``fn()`` in a helper thread, waited for at most ``timeout`` seconds; ``error`` after that
    (the call goes on in its daemon thread, noted in ``hanging[key]``: Python cannot interrupt it)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=run, name=f"call {what}", daemon=True)
    t.start()
    if not done.wait(timeout):
        if hanging is not None:
            hanging[key] = t
        raise error(f"{what} did not answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


#: replica-policy reasons that make a hold a different one (a fail-safe, an operator's pin); the
#: others (within tolerance, stabilising, ...) drift with the load and would split runs for nothing
_HOLD_REASONS = frozenset({"MetricsMissing", "Override"})


def hold_digest(reason: str, message: str, plan: SchedulePlan, replicas: Mapping[str, ReplicaDecision]) -> str:
    """What a tick that changed nothing held on, as a short digest: identical holds extend one
    decision row. The reason, the plan's summary, its notes (a job held back, demand the pool
    cannot place) and every service held by a fail-safe or an operator's pin."""
    key = [reason, message,
           sorted((st.workload, st.reason) for st in plan.steps if st.action == "noop"),
           sorted((name, str(d.reason)) for name, d in replicas.items() if str(d.reason) in _HOLD_REASONS)]
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def paused_tag(held: Layout | str) -> str:
    """How the reshard history names a pause: the layout its keepers hold, marked ``paused:``."""
    return f"paused:{held}"


def _recorded_layout(rt: JobRuntime) -> str | None:
    """The layout as the reshard history writes it (a paused job's with its ``paused:`` mark)."""
    return paused_tag(rt.layout) if rt.phase == "Paused" and rt.layout else rt.layout


def _trains(rt: JobRuntime | None) -> bool:
    return rt is not None and rt.phase != "Paused"


def _job_status(rt: JobRuntime | None) -> str:
    if rt is None:
        return "pending"
    return "paused" if rt.phase == "Paused" else "running"
