"""Tick-driven cluster simulator: the real replica policy and co-scheduler on a simulated clock.

One tick (``tick_seconds``) reads as numbered steps:

1. observe: each service's request rate at the tick (trace or generator);
2. decide replicas: the policy under test (``cosched``: ``elastic.policy.replicas.decide``
   with the service's forecast, fed ``history_days`` of past load before t=0, then at each
   tick what a request-rate source reads: the arrival rate, and the requests waiting in the
   queue as its backlog; ``static``: peak; ``daynight``: a clock schedule; ``oracle``:
   the true future rate over the start-up horizon);
3. decide the split: ``elastic.scheduler.decide`` (the same pure function the controller runs),
   with each service's seasonal outlook and each job's modelled rescale pause, so a grow is
   judged on whether it pays before the GPUs go back;
4. apply: every GPU has an "available from" time — a GPU a shrinking job gives back is
   free when its reshard pause ends, a drained replica's GPU when its drain ends; a new
   replica serves from ``max(available) + startup_seconds``; a rescaled job pauses from
   ``max(now, available of its new GPUs)`` for the pause model's seconds, and until then a
   grow trains on its old GPU count (the new GPUs, still draining, are busy with nothing);
5. account over the tick: a fluid FIFO queue per service (arrivals beyond capacity queue;
   queued requests that will wait longer than ``ttft_slo_seconds`` miss the SLO), inference
   GPU-seconds weighted by served load (capped at one per replica), training GPU-seconds and
   tokens outside pauses.

GPU utilisation = (load-weighted inference GPU-s + training GPU-s outside pauses) / total
GPU-s; starting, draining, pausing and idle GPUs are not busy. Pure: no wall clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from elastic.model import GPU, Allocation, InferenceSpec, Layout, MetricTarget
from elastic.policy.replicas import decide as policy_decide
from elastic.policy.replicas import remember
from elastic.policy.types import PolicyContext, PolicyState
from elastic.scheduler import JobState, Knobs, SchedulePlan, Snapshot, StepTarget, decide
from elastic.scheduler import ServiceDemand as Demand
from elastic.sim.scenario import Scenario, ServiceCfg, rate_and_history
from elastic.sim.throughput import Table, rescale_pause, tables_for

PolicyName = Literal["cosched", "static", "daynight", "oracle"]
POLICIES: tuple[PolicyName, ...] = ("cosched", "static", "daynight", "oracle")


@dataclass
class _Svc:
    cfg: ServiceCfg
    spec: InferenceSpec
    rate: object
    shape: object
    startup: float
    ready_at: list[float] = field(default_factory=list)  # one entry per replica held
    # drain ahead: since when each replica the policy names as leaving is out of the balancer
    # (held, serving nothing new; its drain clock runs)
    ahead: list[float] = field(default_factory=list)
    queue: float = 0.0
    late: float = 0.0  # part of the queue already counted as missing the SLO
    arrived: float = 0.0
    missed: float = 0.0
    policy_state: PolicyState = field(default_factory=PolicyState)
    outlook: tuple[tuple[float, int], ...] = ()  # the policy's seasonal outlook, for the co-scheduler's lending


@dataclass
class _Job:
    name: str
    model: str
    table: Table
    min_gpus: int
    max_gpus: int
    priority: int
    gpus: int = 0
    layout: Layout | None = None
    pause_from: float = 0.0
    pause_until: float = 0.0
    # a grow waits for its new GPUs (a replica's drain, a shrinking job's pause): meanwhile the job
    # still trains on its old count and the waiting GPUs are busy with nothing
    waiting_gpus: int = 0
    waiting_from: float = 0.0
    waiting_until: float = 0.0
    last_rescale: float | None = None
    status: str = "pending"
    tokens: float = 0.0
    rescales: int = 0
    pause_gpu_seconds: float = 0.0


@dataclass
class SimResult:
    policy: str
    gpu_utilization: float
    slo_attainment: float
    inference_gpu_hours: float
    training_gpu_hours: float
    training_tokens: float
    rescales: int
    rescale_pause_fraction: float
    idle_gpu_hours: float
    throughput_source: str = "planner"
    timeline: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def as_json(self) -> dict[str, float | int]:
        return {
            "gpu_utilization": round(self.gpu_utilization, 6),
            "slo_attainment": round(self.slo_attainment, 6),
            "inference_gpu_hours": round(self.inference_gpu_hours, 3),
            "training_gpu_hours": round(self.training_gpu_hours, 3),
            "training_tokens": round(self.training_tokens),
            "rescales": self.rescales,
            "rescale_pause_fraction": round(self.rescale_pause_fraction, 6),
            "idle_gpu_hours": round(self.idle_gpu_hours, 3),
        }


def simulate(sc: Scenario, base_dir: Path, policy: PolicyName = "cosched", *, days: float | None = None,
             reshard_pause_scale: float = 1.0, startup_scale: float = 1.0, keep_timeline: bool = True) -> SimResult:
    """Run one policy over the scenario (``days`` overrides ``duration_seconds``)."""
    return _Sim(sc, base_dir, policy, days, reshard_pause_scale, startup_scale, keep_timeline).run()


class _Sim:
    def __init__(self, sc: Scenario, base_dir: Path, policy: PolicyName, days: float | None,
                 pause_scale: float, startup_scale: float, keep_timeline: bool) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy '{policy}'; use one of {', '.join(POLICIES)}")
        self.sc, self.policy, self.pause_scale = sc, policy, pause_scale
        self.duration = days * 86400.0 if days else sc.duration_seconds
        self.dt = sc.tick_seconds
        gpn = sc.pool.gpus_per_node
        self.nodes = {f"node{i:04d}": gpn for i in range(sc.pool.nodes)}
        self.total = sc.pool.total_gpus
        self.svcs = [self._svc(s, base_dir, startup_scale) for s in sc.services]
        tables, sources = tables_for(sc.jobs, sc.pool.hardware, gpn, self.total)
        self.source = "+".join(sorted(sources)) or "none"
        self.jobs = [_Job(j.name, j.model, tables[j.name], j.min_gpus, j.max_gpus, j.priority) for j in sc.jobs]
        k = sc.scheduler
        self.knobs = (Knobs(0.0, 0.0, k.headroom_gpus) if policy == "oracle"
                      else Knobs(k.rescale_interval_seconds, k.gain_threshold, k.headroom_gpus))
        self.alloc = Allocation({})
        self.avail: dict[GPU, float] = {}
        self.keep_timeline = keep_timeline
        self._job_states: dict[str, tuple[tuple, JobState]] = {}
        self.tl: dict[str, list[float]] = {"t": [], "inference": [], "training": [], "idle": [], "load_gpus": []}
        self.acc = {"inf_busy": 0.0, "trn_busy": 0.0, "inf_held": 0.0, "trn_held": 0.0, "idle": 0.0, "pause": 0.0}
        self._static = {s.cfg.name: self._peak_replicas(s) for s in self.svcs} if policy == "static" else {}
        self._schedule = {s.cfg.name: self._clock_schedule(s) for s in self.svcs} if policy == "daynight" else {}

    def _svc(self, cfg: ServiceCfg, base_dir: Path, startup_scale: float) -> _Svc:
        rate, shape, past = rate_and_history(cfg, base_dir, self.sc.seed, self.duration + 86400.0,
                                             self.sc.daynight.start_clock_hour)
        startup = cfg.startup_seconds * startup_scale
        # The policy looks ahead as far as a new replica really takes: its start-up, plus up to
        # one tick until the next decision, plus the reshard pause of the training shrink that
        # frees its GPUs (the controller knows all three).
        horizon = startup + self.dt + self.sc.reshard.overhead_seconds * self.pause_scale
        spec = InferenceSpec(
            name=cfg.name, gpus_per_replica=cfg.gpus_per_replica, min_replicas=cfg.min_replicas,
            max_replicas=cfg.max_replicas, priority=cfg.priority, behavior=cfg.behavior,
            metric=MetricTarget(preset="request-rate", type="AverageValue", target=cfg.capacity_rps_per_replica),
            startup_seconds=horizon, forecast=cfg.forecast, drain_ahead_seconds=cfg.drain_ahead_seconds,
        )
        svc = _Svc(cfg, spec, rate, shape, startup)
        if cfg.history_days:
            # the forecast's memory of the days before t=0, one reading per tick
            t = np.arange(-cfg.history_days * 86400.0, 0.0, self.dt)
            svc.policy_state = remember(spec, svc.policy_state, t.tolist(), past(t).tolist())
        return svc

    # ---- baselines ----------------------------------------------------------------------------
    def _replicas_for(self, s: _Svc, rps: float) -> int:
        n = math.ceil(rps / s.cfg.capacity_rps_per_replica - 1e-9)
        return min(max(n, s.cfg.min_replicas), s.cfg.max_replicas)

    def _peak_replicas(self, s: _Svc) -> int:
        t = np.arange(0.0, self.duration + self.dt, min(self.dt, 60.0))
        return self._replicas_for(s, float(np.max(s.rate(t))))

    def _clock_schedule(self, s: _Svc) -> list[int]:
        slot = self.sc.daynight.slot_seconds
        n = max(1, round(86400.0 / slot))
        out = []
        for i in range(n):
            t = np.arange(i * slot, (i + 1) * slot + 1, 60.0)
            out.append(self._replicas_for(s, float(np.max(s.shape(t))) * (1 + self.sc.daynight.margin)))
        return out

    # ---- 1-2 ----------------------------------------------------------------------------------
    def _desired(self, s: _Svc, now: float, rps: float) -> int:
        if self.policy == "static":
            return self._static[s.cfg.name]
        if self.policy == "daynight":
            sched = self._schedule[s.cfg.name]
            return sched[int(now // self.sc.daynight.slot_seconds) % len(sched)]
        if self.policy == "oracle":
            horizon = s.spec.startup_seconds + self.dt
            a, b = int(now // self.fine_step), int((now + horizon) // self.fine_step) + 1
            return self._replicas_for(s, float(np.max(self.fine[s.cfg.name][a:b + 1])))
        # cosched: the production replica policy, fed what a request-rate source reads: the arrival
        # rate, and the requests waiting in the replicas' queues beside it (not folded into the
        # rate: a backlog over one tick read as extra requests/s is a spike the policy would chase)
        ctx = PolicyContext(s.spec, len(s.ready_at), rps, now, s.policy_state, backlog=s.queue)
        dec, s.policy_state = policy_decide(ctx)
        s.outlook = dec.outlook
        # drain ahead: the replicas named as leaving stop taking new requests now; the latest
        # go back first when the load returns
        # (a scale-down now keeps them: it removes them first, their drain already under way)
        if dec.replicas >= len(s.ready_at):
            want = dec.leaving if dec.replicas == len(s.ready_at) else 0
            s.ahead = s.ahead[:want] + [now] * max(0, want - len(s.ahead))
        return dec.replicas

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        steps = int(round(self.duration / self.dt))
        # Rates at every tick's midpoint, and on a 30 s grid for the oracle's look-ahead,
        # computed once (vectorised) rather than per tick.
        mids = np.arange(steps) * self.dt + self.dt / 2
        self.rates = {s.cfg.name: s.rate(mids).tolist() for s in self.svcs}
        if self.policy == "oracle":
            self.fine_step = min(30.0, self.dt)
            fine = np.arange(0.0, self.duration + 86400.0, self.fine_step)
            self.fine = {s.cfg.name: s.rate(fine) for s in self.svcs}
        self._warm_start()
        for i in range(steps):
            self._tick(i, i * self.dt)
        return self._result()

    def _warm_start(self) -> None:
        """Begin in steady state: the first decision's replicas are serving and jobs running at t=0.

        (A cold start would queue the first start-up's worth of traffic at peak and charge every
        policy for it; that is a property of the scenario's start, not of the policy.)"""
        mid = np.asarray([self.dt / 2])
        demands = tuple(Demand(s.cfg.name, self._replicas_for(s, float(s.rate(mid)[0])), s.cfg.gpus_per_replica,
                               s.cfg.priority, s.cfg.min_replicas) for s in self.svcs)
        if self.policy in ("static", "daynight"):
            demands = tuple(Demand(d.name, self._desired(s, 0.0, 0.0), d.gpus_per_replica, d.priority, d.min_replicas)
                            for d, s in zip(demands, self.svcs, strict=True))
        jobs = tuple(JobState(j.name, j.table, j.min_gpus, j.max_gpus, j.priority) for j in self.jobs)
        plan = decide(Snapshot(-self.dt, self.nodes, demands, jobs, Allocation({}), self.knobs))
        for s in self.svcs:
            s.ready_at = [-math.inf] * (plan.gpus_of(s.cfg.name) // s.cfg.gpus_per_replica)
        for j in self.jobs:
            dec = plan.jobs[j.name]
            j.gpus, j.layout, j.status = dec.gpus, dec.layout, dec.status
        self.alloc = plan.allocation

    def _tick(self, i: int, now: float) -> None:
        rates = {s.cfg.name: self.rates[s.cfg.name][i] for s in self.svcs}  # 1. observe
        demands = tuple(Demand(s.cfg.name, self._desired(s, now, rates[s.cfg.name]), s.cfg.gpus_per_replica,  # 2.
                               s.cfg.priority, s.cfg.min_replicas, s.outlook) for s in self.svcs)
        jobs = tuple(self._job_state(j) for j in self.jobs)
        plan = decide(Snapshot(now, self.nodes, demands, jobs, self.alloc, self.knobs))  # 3. decide
        self._apply(now, plan)  # 4. apply
        self._account(now, rates)  # 5. account

    def _job_state(self, j: _Job) -> JobState:
        key = (j.layout, j.last_rescale, j.status, j.gpus)
        hit = self._job_states.get(j.name)
        if hit is None or hit[0] != key:  # JobState validates its table: build it only on change
            # the pause of its next rescale as the controller would estimate it: one node more or
            # less from where it is (from nothing: its state comes back from host memory)
            pause = rescale_pause(j.model, j.gpus, j.gpus + self.sc.pool.gpus_per_node if j.gpus else j.min_gpus,
                                  self.sc.reshard, self.pause_scale)
            hit = (key, JobState(j.name, j.table, j.min_gpus, j.max_gpus, j.priority, j.layout, j.last_rescale,
                                 j.status, pause_seconds=pause))  # type: ignore[arg-type]
            self._job_states[j.name] = hit
        return hit[1]

    def _apply(self, now: float, plan: SchedulePlan) -> None:
        changes = {st.workload: st.target for st in plan.steps if isinstance(st.target, StepTarget)}
        for s in self.svcs:
            t = changes.get(s.cfg.name)
            if t is not None:
                self._apply_service(now, s, t.added, t.removed)
        for j in self.jobs:
            dec = plan.jobs[j.name]
            j.status = dec.status
            t = changes.get(j.name)
            if t is not None:
                self._apply_job(now, j, t, dec.layout)
        self.alloc = plan.allocation

    def _apply_service(self, now: float, s: _Svc, added: tuple[GPU, ...], removed: tuple[GPU, ...]) -> None:
        g = s.cfg.gpus_per_replica
        s.ready_at.sort()
        for k in range(len(removed) // g):  # cancel replicas still starting first, then drain ready ones
            ready = s.ready_at.pop()
            # a replica drained ahead has been draining since it left the balancer
            since = s.ahead.pop(0) if ready <= now and s.ahead else now
            until = max(now, since + s.cfg.drain_seconds) if ready <= now else now
            for x in removed[k * g:(k + 1) * g]:
                self.avail[x] = until
        for k in range(len(added) // g):
            chunk = added[k * g:(k + 1) * g]
            start = max([now] + [self.avail.get(x, now) for x in chunk])
            s.ready_at.append(start + s.startup)

    def _apply_job(self, now: float, j: _Job, t: StepTarget, layout: Layout | None) -> None:
        n0, n1 = t.gpus_before, t.gpus_after
        start = max([now] + [self.avail.get(x, now) for x in t.added])
        pause = rescale_pause(j.model, n0, n1, self.sc.reshard, self.pause_scale)
        j.pause_from, j.pause_until = start, start + pause
        j.waiting_gpus, j.waiting_from, j.waiting_until = max(0, n1 - n0), now, start
        for x in t.removed:
            self.avail[x] = j.pause_until  # a shrinking job lets go once its reshard is done
        j.gpus, j.layout = n1, layout
        j.last_rescale = now
        j.rescales += 1

    # ---- 5 ------------------------------------------------------------------------------------
    def _account(self, now: float, rates: dict[str, float]) -> None:
        dt, end = self.dt, now + self.dt
        inf_held = trn_held = 0
        for s in self.svcs:
            g, cap = s.cfg.gpus_per_replica, s.cfg.capacity_rps_per_replica
            # replica-seconds serving (replicas drained ahead take no new request: they serve none here)
            ready_time = sum(min(dt, max(0.0, end - r)) for r in sorted(s.ready_at)[:len(s.ready_at) - len(s.ahead)])
            arrivals = rates[s.cfg.name] * dt
            work = s.queue + arrivals
            served = min(work, cap * ready_time)
            s.queue = work - served
            s.late = max(0.0, s.late - served)
            ready_now = max(0, sum(1 for r in s.ready_at if r <= end) - len(s.ahead))
            late_now = max(0.0, s.queue - cap * ready_now * s.cfg.ttft_slo_seconds)
            if late_now > s.late:
                s.missed += late_now - s.late
                s.late = late_now
            s.arrived += arrivals
            self.acc["inf_busy"] += g * min(served / cap, ready_time)
            inf_held += g * len(s.ready_at)
        for j in self.jobs:
            overlap = max(0.0, min(end, j.pause_until) - max(now, j.pause_from))
            run = dt - overlap
            # a grow still waiting for its new GPUs trains on the old count (tokens and busy GPUs)
            wait = max(0.0, min(end, j.waiting_until) - max(now, j.waiting_from)) if j.waiting_gpus else 0.0
            before = j.gpus - j.waiting_gpus
            j.tokens += (j.table[j.gpus][1] * (run - wait) if j.gpus else 0.0) + (
                j.table[before][1] * wait if wait and before in j.table else 0.0)
            self.acc["trn_busy"] += j.gpus * run - j.waiting_gpus * wait
            self.acc["pause"] += j.gpus * overlap
            j.pause_gpu_seconds += j.gpus * overlap
            trn_held += j.gpus
        idle = self.total - inf_held - trn_held
        self.acc["inf_held"] += inf_held * dt
        self.acc["trn_held"] += trn_held * dt
        self.acc["idle"] += idle * dt
        if self.keep_timeline:
            self.tl["t"].append(now)
            self.tl["inference"].append(inf_held)
            self.tl["training"].append(trn_held)
            self.tl["idle"].append(idle)
            self.tl["load_gpus"].append(sum(rates[s.cfg.name] / s.cfg.capacity_rps_per_replica * s.cfg.gpus_per_replica
                                            for s in self.svcs))

    def _result(self) -> SimResult:
        total = self.total * self.duration
        a = self.acc
        arrived = sum(s.arrived for s in self.svcs)
        missed = sum(s.missed for s in self.svcs)
        return SimResult(
            policy=self.policy,
            gpu_utilization=(a["inf_busy"] + a["trn_busy"]) / total,
            slo_attainment=1.0 - missed / arrived if arrived else 1.0,
            inference_gpu_hours=a["inf_held"] / 3600.0,
            training_gpu_hours=a["trn_held"] / 3600.0,
            training_tokens=sum(j.tokens for j in self.jobs),
            rescales=sum(j.rescales for j in self.jobs),
            rescale_pause_fraction=a["pause"] / a["trn_held"] if a["trn_held"] else 0.0,
            idle_gpu_hours=a["idle"] / 3600.0,
            throughput_source=self.source,
            timeline=self.tl if self.keep_timeline else {},
        )
