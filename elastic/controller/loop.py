"""``Controller``: one pool's reconcile loop, lead -> observe -> decide -> apply -> record.

``tick()`` reads as the numbered steps of the package's docstring; each step's code is in its own
module (``lease``, ``observe``, ``decide``, ``apply``, ``record``), mixed into this class over one
shared state (``base.ControllerState``). Here: construction, crash recovery from the DB, the tick
itself, the loop that runs it, and retention between ticks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import cast

from elastic import store as db
from elastic.backends.base import Adopts, Backend, BackendUnavailable, Capabilities, Fenced
from elastic.config import ControllerConfig
from elastic.controller.apply import Applying
from elastic.controller.base import Backoff, TickResult, _dt, _recorded_layout, log
from elastic.controller.record import Recording
from elastic.controller.tables import check_feasible, throughput_table
from elastic.metrics.sample import MetricSource
from elastic.model import GPU, Layout, load_hardware
from elastic.phases import JobPhase
from elastic.policy.types import PolicyState
from elastic.reasons import DecisionReason, TickReason
from elastic.scheduler import decide as schedule


class Controller(Applying, Recording):
    """Runs ticks for one pool. ``clock`` is injectable; decisions never read it themselves."""

    def __init__(self, cfg: ControllerConfig, backend: Backend, store: db.Store, sources: Mapping[str, MetricSource],
                 *, owner: str, clock: Callable[[], float] = time.time,
                 throughput: Mapping[str, Mapping[int, tuple[Layout, float]]] | None = None,
                 async_grow: bool = False, config_source: str | None = None) -> None:
        self.cfg = cfg
        self.config_source = config_source  # the file the workloads of cfg were declared in, if any
        # A training grow waits for joiners to start (seconds); with async_grow the tick does not
        # wait for it: the job holds its target GPUs meanwhile and a later shrink of it waits.
        self.async_grow = async_grow
        self._replan = False  # set by _apply when it called a grow off: the tick plans once more
        self._growing: dict[str, tuple[threading.Thread, tuple[GPU, ...], list[str]]] = {}
        self._mem_dropped = {}
        self._mem_tables = {}
        self._predicted_memory = {}
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
        self.caps = Capabilities.of(backend)  # its optional capabilities, read once
        log.info("backend %s: optional capabilities %s", getattr(backend, "name", type(backend).__name__),
                 ", ".join(self.caps.names()) or "none")
        if self.caps.fenced:  # the backend checks the lease inside long actions
            cast(Fenced, backend).fence = self._check_lead
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
        self.pinned: dict[str, dict[int, tuple[Layout, float]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._throughput = dict(throughput or {})
        for j in cfg.jobs:
            if j.name not in self._throughput:
                self._throughput[j.name] = throughput_table(
                    cfg.models()[j.name], self.hardware, min(j.max_gpus, cfg.pool.total_gpus),
                    gpus_per_node=cfg.pool.gpus_per_node, **j.planner_options())
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
        notes: list[str] = cast(Adopts, self.backend).adopt() if self.caps.adopts else []
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
            db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason=DecisionReason.RECOVERED,
                               message="; ".join(notes), plan={"steps": [], "notes": notes}, inputs={})
        self.recovered = True
        return notes

    def stop(self) -> None:
        self._stop.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for grows still running in the background; True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._growing):
            t = self._growing[job][0]
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(g[0].is_alive() for g in self._growing.values())

    def grows_in_flight(self) -> dict[str, tuple[threading.Thread, list[str]]]:
        """Each start or grow running in the background (``async_grow``): job -> (its thread, the
        failures it appends before it ends). A caller reads the outcome once the thread ended."""
        return {job: (g[0], g[2]) for job, g in list(self._growing.items())}

    def take_over(self, old: Controller) -> None:
        """Carry on from ``old``, a controller of the same pool in this process being replaced (its
        config changed): what the loop has learnt (stabilisation windows, rescale times, recovery
        done and recoveries on record, retention's last pass), the grows still running in the
        background (their GPUs stay reserved; a shrink waits for one, inference calls one off) and
        the pool's lease.

        The lease: this controller shares ``old``'s fenced store (its epoch) and deadline; else it
        would stand by until that lease ran out (a lease is taken only once free or expired) and the
        pool would not act meanwhile. The grows of replaced controllers write their outcome through
        that one store, whose fence is now this controller's (it renews the lease; ``old`` no longer
        ticks), and record their times in the one ``last_rescale``."""
        self.policy_state.update({k: v for k, v in old.policy_state.items() if k in self.policy_state})
        old.last_rescale.update(self.last_rescale)
        self.last_rescale = old.last_rescale
        self.recovered = old.recovered
        self._recoveries_seen.update(old._recoveries_seen)
        self._housekept_at = old._housekept_at
        self._growing = old._growing  # this controller sees those grows end, as old would have
        self._mem_dropped = old._mem_dropped
        self.db = old.db
        self.db.guard = self._check_lead
        self._lead_until, self._lost, self.is_leader, self._lease_state = (old._lead_until, old._lost, old.is_leader,
                                                                         old._lease_state)

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
                res = TickResult(now, False, TickReason.LEASE_LOST, str(e))
                self.ready, self.last_error = True, None
            except (db.StoreUnavailable, BackendUnavailable) as e:
                error = f"{type(e).__name__}: {e}"
                # once when it starts or changes, not every tick while it lasts
                (log.error if error != self.last_error else log.debug)("not acting: %s", error)
                self.ready, self.last_error = False, error
                res = TickResult(now, False, TickReason.UNAVAILABLE, self.last_error, error=self.last_error)
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
            return TickResult(now, False, TickReason.NOT_LEADER, f"lease held by {holder.owner if holder else '?'}")
        self._lease_changed(True, self.owner)
        with self._heartbeat():
            return self._lead_tick(now)

    def _lead_tick(self, now: float) -> TickResult:
        if not self.recovered:
            self.recover()
        if self.paused:
            return TickResult(now, False, TickReason.PAUSED, "controller paused by an operator")
        # 1. observe: every job once; the rest of the tick works from this view (``Observed``)
        nodes = self._bounded("backend inventory", self.backend.inventory)
        obs = self._observe()
        # a failed job's workers are gone or stuck: its GPUs are reclaimed in step 3a, so the
        # plan already treats it as not running (it starts afresh when GPUs allow)
        # (a job whose start or grow is in flight is stopped by that thread if it failed: not reaped twice)
        failed = {j.name: rt for j in self.cfg.jobs if not self._grow_in_flight(j.name)
                  and (rt := obs.runtime(j.name)) is not None and rt.phase == JobPhase.FAILED}
        previous, runtimes = self._observe_jobs(obs, set(failed))
        samples = {s.name: self._sample(s.name, now) for s in self.cfg.services}
        backlogs = {s.name: self._backlog(s.name, now) for s in self.cfg.services if samples[s.name] is not None}
        # 2. decide
        replica_decisions = self._decide_replicas(now, previous, samples, backlogs)
        plan = schedule(self._snapshot(now, nodes, previous, replica_decisions, runtimes))
        # 3. apply: 3a. reclaim failed jobs, 3b. the plan's ordered steps, 3c. relayouts off dropped layouts
        applied, error = self._reap_failed(now, failed, obs)
        if error is None:
            steps, error = self._apply(now, plan, obs)
            applied += steps
        if error is None and self._replan:
            # a grow was called off: plan again from what the job really holds, same replica
            # decisions (the policy is stateful and has spoken for this tick)
            self._replan = False
            previous, runtimes = self._observe_jobs(obs, set(failed))
            plan = schedule(self._snapshot(now, nodes, previous, replica_decisions, runtimes))
            steps, error = self._apply(now, plan, obs)
            applied += steps
        if error is None:
            # 3c. a job left on a layout dropped for its memory moves in place to the next of its count
            steps, error = self._relayout(now, plan, obs)
            applied += steps
        if error is None:
            # 3d. drain ahead of the scale-downs the policy's windows are about to let through
            applied += self._drain_ahead(now, nodes, failed, plan, replica_decisions, obs)
        # 4. record
        self._record(now, plan, replica_decisions, samples, applied, error, obs)
        return TickResult(now, True, plan.reason, plan.message, plan, replica_decisions, applied, error)
