"""Our own Prometheus exporter: where every GPU is, what the controller decided and why.

What it is for: one ``Exporter`` per process holds a ``CollectorRegistry`` with the
``elastic_*`` metrics the dashboards in ``dashboards/`` read. Two entry points:

* ``observe_tick(tick, controller)``: called by the serve loop after every tick; records
  the tick (duration, outcome, decision reason, errors, metric-source errors) and then
  refreshes the state gauges with ``update_from``.
* ``update_from(controller, store)``: refreshes the gauges from the state store (what the
  controller recorded: allocations, service and job status, reshard events, the lease) and
  the controller's flags. Works without a controller (an API-only process) too.

Names follow docs/DESIGN.md and Prometheus conventions: ``elastic_`` prefix, base units
(seconds, bytes, ratios 0..1), ``_total`` on counters; labels are bounded (pool, service,
job, state, reason codes, the controller's own owner id), never a GPU, worker, rank or
request. Training-job gauges seen by the controller are ``elastic_job_*``: the trainer's
own per-job metrics (``elastic/train/telemetry.py``) own ``elastic_training_*`` and both may
be scraped side by side; ``elastic_training_layout_info`` is the one name the two share in
spirit and only this module exports it.

GPU utilisation (docs/DESIGN.md): (inference GPUs weighted by each service's load per replica /
target, capped at 1, + training GPUs of running jobs) / total GPUs, over the last tick.
E.g. 8 GPUs, 2 replicas at 50 % of target, 4 training GPUs running: (2*0.5 + 4) / 8 = 0.625.

What it must not do: decide, act, or call a backend; it reads what was recorded.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from elastic import store as db
from elastic.model import InferenceSpec, Layout, PoolSpec, SpecError
from elastic.phases import JOB_PHASES, JobPhase
from elastic.reasons import DecisionReason, TickReason
from elastic.store.repo import MAX_PAGE

GPU_STATES = ("inference", "training", "idle", "draining")
TICK_OUTCOMES = ("acted", "standby", "paused", "unavailable")
_TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RESHARD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_OUTCOME = {TickReason.NOT_LEADER: "standby", TickReason.PAUSED: "paused", TickReason.UNAVAILABLE: "unavailable"}
_RUNNING_PHASES = (JobPhase.RUNNING,)
MEMORY_COMPONENTS = ("weights", "gradients", "optimizer", "activations")


class _Labelled:
    """Tracks the label sets a gauge exported so vanished workloads' series are removed."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.seen: set[tuple[str, ...]] = set()

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.gauge.labels(*labels).set(value)
        self.seen.add(labels)

    def keep_only(self, keep: Iterable[tuple[str, ...]], scope: tuple[str, ...] = ()) -> None:
        """Remove series not in ``keep`` whose leading labels equal ``scope``."""
        keep = set(keep)
        for labels in list(self.seen):
            if labels[: len(scope)] == scope and labels not in keep:
                self.gauge.remove(*labels)
                self.seen.discard(labels)


class Exporter:
    """The ``elastic_*`` metric families in one registry (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._reshard_cursor = 0  # every reshard with id <= cursor has been counted
        self._reshard_seen: set[int] = set()  # finished ones above the cursor (an older one still in flight)
        r = self.registry
        G = lambda name, doc, labels: _Labelled(Gauge(name, doc, labels, registry=r))  # noqa: E731
        # pool
        self.gpus = G("elastic_gpus", "GPUs of the pool by state (inference, training, idle, draining)",
                      ["pool", "state"])
        self.utilization = G("elastic_gpu_utilization", "Busy share of the pool's GPUs at the last tick: "
                             "load-weighted inference + running training, over total (0..1)", ["pool"])
        # services
        self.current = G("elastic_service_current_replicas", "Replicas the service runs now", ["service"])
        self.desired = G("elastic_service_desired_replicas", "Replicas the replica policy wants", ["service"])
        self.leaving = G("elastic_service_leaving_replicas", "Replicas drained ahead of a scale-down the policy "
                         "sees coming: out of the load balancer, finishing their requests (drain_ahead_seconds)",
                         ["service"])
        self.load = G("elastic_service_load", "Load metric the policy last saw (the unit of the service's metric)",
                      ["service"])
        self.target = G("elastic_service_load_target", "Target of the service's load metric (per replica for "
                        "AverageValue)", ["service"])
        self.scaling = Counter("elastic_service_scaling_decisions", "Replica decisions by reason code",
                               ["service", "reason"], registry=r)
        self.metric_errors = Counter("elastic_metric_source_errors", "Ticks whose load reading was missing or "
                                     "stale, by service", ["service", "kind"], registry=r)
        # training jobs (controller side)
        self.world_size = G("elastic_job_world_size", "GPUs (workers) of the job's current layout", ["job"])
        self.layout_info = G("elastic_training_layout_info", "The job's current layout (value 1)",
                             ["job", "tp", "pp", "dp"])
        self.step = G("elastic_job_step", "Last training step the job reported", ["job"])
        self.checkpoint_step = G("elastic_job_checkpoint_step",
                                 "Step the job's newest complete checkpoint continues at (-1: none yet; absent: "
                                 "no checkpoints): a failure no replica covers redoes the steps since", ["job"])
        self.tokens_per_second = G("elastic_job_tokens_per_second", "Training throughput the job reported",
                                   ["job"])
        self.generation = G("elastic_job_generation", "Layout generation (one more per rescale)", ["job"])
        self.phase = G("elastic_job_phase", "1 for the job's current phase (Running, Rescaling, Recovering, "
                       "Paused: state held off-GPU, Failed, ...), 0 for the others", ["job", "phase"])
        # never out of memory: the worst rank of the current layout, measured, beside the planner's
        # prediction for what ran and the per-GPU budget the layout was fitted in
        self.memory = G("elastic_job_memory_bytes", "Per-GPU bytes of the job's worst rank in a measured step of "
                        "its current layout, by component (weights, gradients, optimizer, activations; peak: the "
                        "GPU allocator's peak, else their sum)", ["job", "component"])
        self.memory_predicted = G("elastic_job_memory_predicted_bytes", "The planner's per-GPU bytes for what the "
                                  "worst rank ran (its layout, stage and micro-batch), by component (total: their "
                                  "sum, without the reserve)", ["job", "component"])
        self.memory_budget = G("elastic_job_memory_budget_bytes", "Per-GPU bytes a layout may use: device memory "
                               "less the planner's reserve; a step measured above it drops the layout", ["job"])
        self.dropped_layouts = G("elastic_job_dropped_layouts", "Layouts the job may not run again: a step "
                                 "overran the per-GPU budget or a worker ran out of memory", ["job"])
        self.recoveries = Counter("elastic_job_recoveries", "Lost workers the job recovered from in place, from "
                                  "its surviving replicas (no restart, no checkpoint)", ["job"], registry=r)
        self._recovery_cursor = 0  # every WorkerLost decision with id <= cursor has been counted
        self.reshards = Counter("elastic_job_reshards", "Finished reshards by status (done, failed, cancelled: called off before anything moved)",
                                ["job", "status"], registry=r)
        self.reshard_seconds = Histogram("elastic_job_reshard_duration_seconds", "Wall time of a reshard, start "
                                         "to first step on the new layout", ["job"], buckets=_RESHARD_BUCKETS,
                                         registry=r)
        self.reshard_pause = Histogram("elastic_job_reshard_pause_seconds", "Training paused by a reshard",
                                       ["job"], buckets=_RESHARD_BUCKETS, registry=r)
        self.reshard_bytes = Counter("elastic_job_reshard_bytes", "Bytes moved between workers by reshards",
                                     ["job"], registry=r)
        self.planned_bytes = Counter("elastic_job_reshard_planned_bytes", "Bytes reshard plans scheduled",
                                     ["job"], registry=r)
        self.lower_bound_bytes = Counter("elastic_job_reshard_lower_bound_bytes", "Bytes reshards had to move "
                                         "at least (needed minus already local)", ["job"], registry=r)
        # controller
        self.decisions = Counter("elastic_controller_decisions", "Recorded decisions by reason code",
                                 ["pool", "reason"], registry=r)
        self.ticks = Counter("elastic_controller_ticks", "Ticks by outcome (acted, standby, paused, unavailable)",
                             ["pool", "outcome"], registry=r)
        self.errors = Counter("elastic_controller_errors", "Ticks that failed: unavailable (DB or backend "
                              "unreachable) or apply (a plan step failed)", ["pool", "kind"], registry=r)
        self.tick_seconds = Histogram("elastic_controller_tick_duration_seconds", "Wall time of one tick",
                                      ["pool"], buckets=_TICK_BUCKETS, registry=r)
        self.last_tick = G("elastic_controller_last_tick_timestamp_seconds", "Time of the last tick (Unix)",
                           ["pool"])
        self.leader = G("elastic_controller_leader", "1 when this controller (owner) holds the pool's lease",
                        ["pool", "owner"])
        self.ready = G("elastic_controller_ready", "1 when the last tick reached the DB and the backend", ["pool"])
        self.paused = G("elastic_controller_paused", "1 while an operator paused the controller", ["pool"])

    # ---- per tick ---------------------------------------------------------------------------------
    def observe_tick(self, tick: Any, controller: Any) -> None:
        """Record one ``TickResult`` of ``controller`` and refresh the state gauges."""
        pool = controller.pool
        with self._lock:
            self._init_pool(pool, controller)
            outcome = "acted" if tick.acted else _OUTCOME.get(tick.reason, "standby")
            self.ticks.labels(pool, outcome).inc()
            self.tick_seconds.labels(pool).observe(max(0.0, float(tick.seconds)))
            self.last_tick.set((pool,), float(tick.at))
            if outcome == "unavailable":
                self.errors.labels(pool, "unavailable").inc()
            if tick.acted:
                self.decisions.labels(pool, DecisionReason.APPLY_FAILED if tick.error else tick.reason).inc()
                if tick.error:
                    self.errors.labels(pool, "apply").inc()
                for name, d in tick.replica_decisions.items():
                    self.scaling.labels(name, str(d.reason)).inc()
                self._metric_errors(controller)
        self.update_from(controller, controller.store)

    def _init_pool(self, pool: str, controller: Any) -> None:
        """Create every bounded label set at 0, so rates and 'no errors' show as 0, not 'no data'."""
        for outcome in TICK_OUTCOMES:
            self.ticks.labels(pool, outcome)
        for kind in ("unavailable", "apply"):
            self.errors.labels(pool, kind)
        for s in controller.cfg.services:
            for kind in ("missing", "stale"):
                self.metric_errors.labels(s.name, kind)
        for j in controller.cfg.jobs:
            self._init_job(j.name)

    def _init_job(self, job: str) -> None:
        for status in db.FINISHED:
            self.reshards.labels(job, status)
        self.recoveries.labels(job)
        self.reshard_bytes.labels(job)
        self.planned_bytes.labels(job)
        self.lower_bound_bytes.labels(job)
        self.reshard_seconds.labels(job)
        self.reshard_pause.labels(job)

    def _metric_errors(self, controller: Any) -> None:
        """Missing/stale readings as the controller recorded them in this tick's decision inputs."""
        last = db.list_decisions(controller.store, 1, pool=controller.pool, newest_first=True)
        if not last:
            return
        for service, m in (last[0].inputs.get("metrics") or {}).items():
            if m is None:
                self.metric_errors.labels(service, "missing").inc()
            elif m.get("stale"):
                self.metric_errors.labels(service, "stale").inc()

    # ---- state from the store -------------------------------------------------------------------------
    def update_from(self, controller: Any | None, store: db.Store) -> None:
        """Refresh every state gauge from ``store`` (and ``controller``'s flags when given)."""
        with self._lock:
            pools = [controller.pool] if controller is not None else [p.name for p in db.list_pools(store)]
            for pool in pools:
                self._update_pool(store, pool, controller)
            self._update_reshards(store)
            self._update_recoveries(store)

    def _update_pool(self, store: db.Store, pool: str, controller: Any | None) -> None:
        rec = db.get_pool(store, pool)
        total = PoolSpec.model_validate(rec.spec).total_gpus if rec is not None else 0
        alloc = db.current_allocations(store, pool)
        services = db.list_services(store, pool)
        jobs = db.list_jobs(store, pool)
        busy, split = self._services(services, alloc)
        busy += self._jobs(jobs, alloc)
        split["training"] = sum(len(a.gpus) for a in alloc.values() if a.kind == "training")
        split["idle"] = max(0, total - sum(len(a.gpus) for a in alloc.values()))
        for state in GPU_STATES:
            self.gpus.set((pool, state), split[state])
        if total:
            self.utilization.set((pool,), min(1.0, busy / total))
        self._lease(store, pool, controller)

    def _services(self, services: list[db.ServiceRecord], alloc: dict[str, db.AllocationRecord]
                  ) -> tuple[float, dict[str, int]]:
        """Per-service gauges; returns (load-weighted busy GPUs, {inference, draining} GPU counts)."""
        busy, split = 0.0, {"inference": 0, "draining": 0}
        names = []
        for s in services:
            st, held = s.status, len(alloc[s.name].gpus) if s.name in alloc else 0
            spec = _inference_spec(s.spec)
            per = spec.gpus_per_replica if spec else 1
            desired, current = st.get("desiredReplicas"), st.get("currentReplicas")
            leaving = int(st.get("leavingReplicas") or 0)
            # GPUs a service still holds beyond what it is meant to run are draining (being given back),
            # and so are the replicas drained ahead of a scale-down (out of the balancer already)
            draining = max(0, held - (int(desired) - leaving) * per) if desired is not None else 0
            split["inference"] += held - draining
            split["draining"] += draining
            names.append((s.name,))
            # what it holds after the last apply is the truth; the recorded status is pre-apply
            _set_opt(self.current, (s.name,), held // per if s.name in alloc or current is not None else None)
            _set_opt(self.desired, (s.name,), desired)
            _set_opt(self.leaving, (s.name,), leaving if desired is not None else None)
            _set_opt(self.load, (s.name,), st.get("observedValue"))
            target = spec.metric.target if spec and spec.metric else None
            _set_opt(self.target, (s.name,), target)
            value = st.get("observedValue")
            if target and value is not None and math.isfinite(float(value)):
                busy += (held - draining) * min(1.0, max(0.0, float(value) / target))
        for g in (self.current, self.desired, self.leaving, self.load, self.target):
            g.keep_only(names)
        return busy, split

    def _jobs(self, jobs: list[db.JobRecord], alloc: dict[str, db.AllocationRecord]) -> float:
        """Per-job gauges; returns the GPUs of jobs that are training (not pausing or rescaling)."""
        busy = 0.0
        names, layouts = [], []
        for j in jobs:
            st = j.status
            names.append((j.name,))
            self._init_job(j.name)
            held = len(alloc[j.name].gpus) if j.name in alloc else 0
            if st.get("phase") in _RUNNING_PHASES:
                busy += held
            _set_opt(self.world_size, (j.name,), st.get("worldSize", held))
            _set_opt(self.step, (j.name,), st.get("step"))
            _set_opt(self.checkpoint_step, (j.name,), st.get("checkpointStep"))
            _set_opt(self.tokens_per_second, (j.name,), st.get("tokensPerSecond"))
            _set_opt(self.generation, (j.name,), st.get("generation"))
            for ph in JOB_PHASES:
                self.phase.set((j.name, ph), 1 if st.get("phase", JobPhase.PENDING) == ph else 0)
            self._memory(j.name, st)
            layout = _layout(st.get("layout"))
            if layout is not None:
                labels = (j.name, str(layout.tp), str(layout.pp), str(layout.dp))
                self.layout_info.set(labels, 1)
                layouts.append(labels)
        for g in (self.world_size, self.step, self.checkpoint_step, self.tokens_per_second, self.generation,
                  self.memory_budget, self.dropped_layouts):
            g.keep_only(names)
        self.memory.keep_only([(n, c) for (n,) in names for c in (*MEMORY_COMPONENTS, "peak")])
        self.memory_predicted.keep_only([(n, c) for (n,) in names for c in (*MEMORY_COMPONENTS, "total")])
        self.phase.keep_only([(n, ph) for (n,) in names for ph in JOB_PHASES])
        self.layout_info.keep_only(layouts)
        return busy

    def _memory(self, job: str, st: dict[str, Any]) -> None:
        """The memory gauges from the job's status: ``memory`` (the worst rank's measured step, with the
        planner's ``predicted`` bytes and the ``budgetBytes`` beside it) and ``droppedLayouts``. A job with
        no measurement of its current layout has no series (missing is not 0)."""
        raw = st.get("memory")
        m: dict[str, Any] = raw if isinstance(raw, dict) else {}
        raw = m.get("predicted")
        pred: dict[str, Any] = raw if isinstance(raw, dict) else {}
        for c in MEMORY_COMPONENTS:
            _set_opt(self.memory, (job, c), m.get(c))
            _set_opt(self.memory_predicted, (job, c), pred.get(c))
        peak = m.get("device_peak") if m.get("device_peak") is not None else m.get("total")
        _set_opt(self.memory, (job, "peak"), peak)
        _set_opt(self.memory_predicted, (job, "total"), pred.get("total"))
        _set_opt(self.memory_budget, (job,), m.get("budgetBytes"))
        dropped = st.get("droppedLayouts")
        _set_opt(self.dropped_layouts, (job,), len(dropped) if isinstance(dropped, list) else None)

    def _lease(self, store: db.Store, pool: str, controller: Any | None) -> None:
        # the controller's clock decides lease expiry (it is injectable; tests and the simulator fake it)
        now = datetime.fromtimestamp(float(controller.clock()), tz=UTC) if controller is not None else None
        holder = db.lease_holder(store, pool, now=now)
        if controller is not None:
            self.ready.set((pool,), 1 if controller.ready else 0)
            self.paused.set((pool,), 1 if controller.paused else 0)
            me = holder is not None and holder.owner == controller.owner and bool(controller.is_leader)
            self.leader.set((pool, controller.owner), 1 if me else 0)
        else:  # an API-only process reports who holds the lease
            keep = [(pool, holder.owner)] if holder else []
            for labels in keep:
                self.leader.set(labels, 1)
            self.leader.keep_only(keep, scope=(pool,))

    def _update_reshards(self, store: db.Store) -> None:
        """Count reshards that finished since the last call, each exactly once."""
        while True:
            rows = db.list_reshards(store, None, MAX_PAGE, self._reshard_cursor)
            for r in rows:
                if r.status in db.FINISHED and r.id not in self._reshard_seen:
                    self._count_reshard(r)
                    self._reshard_seen.add(r.id)
            # advance the cursor over the finished prefix; in-flight ones are looked at again
            for r in rows:
                if r.id not in self._reshard_seen:
                    break
                self._reshard_cursor = r.id
                self._reshard_seen.discard(r.id)
            if len(rows) < MAX_PAGE or self._reshard_cursor != rows[-1].id:
                return

    def _update_recoveries(self, store: db.Store) -> None:
        """Count the ``WorkerLost`` decisions (a job recovered in place) recorded since the last call."""
        newest = db.list_decisions(store, 1, newest_first=True)
        top = newest[0].id if newest else 0
        while self._recovery_cursor < top:
            rows = db.list_decisions(store, MAX_PAGE, self._recovery_cursor, reason=DecisionReason.WORKER_LOST,
                                     up_to_id=top)
            for d in rows:
                # the job is in the decision's plan; older records only name it first in the message
                job = str(d.plan.get("job") or d.message.split(" ", 1)[0])
                self._init_job(job)
                self.recoveries.labels(job).inc()
            self._recovery_cursor = rows[-1].id if len(rows) == MAX_PAGE else top

    def _count_reshard(self, r: db.ReshardRecord) -> None:
        self._init_job(r.job)
        self.reshards.labels(r.job, r.status).inc()
        if r.status == "cancelled":
            return  # called off before its directive: no duration, no pause, nothing moved
        if r.finished_at is not None:
            self.reshard_seconds.labels(r.job).observe(max(0.0, (r.finished_at - r.started_at).total_seconds()))
        if r.pause_seconds is not None:
            self.reshard_pause.labels(r.job).observe(max(0.0, r.pause_seconds))
        self.reshard_bytes.labels(r.job).inc(max(0, r.bytes_moved or 0))
        self.planned_bytes.labels(r.job).inc(max(0, r.bytes_planned))
        self.lower_bound_bytes.labels(r.job).inc(max(0, r.bytes_lower_bound))


def _set_opt(g: _Labelled, labels: tuple[str, ...], value: Any) -> None:
    """Set when the value is a finite number; remove the series otherwise (missing is not 0)."""
    try:
        v = float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        v = math.nan
    if math.isfinite(v):
        g.set(labels, v)
    elif labels in g.seen:
        g.gauge.remove(*labels)
        g.seen.discard(labels)


def _inference_spec(doc: dict[str, Any]) -> InferenceSpec | None:
    try:
        return InferenceSpec.model_validate(doc)
    except ValueError:
        return None


def _layout(text: Any) -> Layout | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return Layout.parse(text)
    except SpecError:
        return None
