"""Step 4 of a pool's cycle: status fields, conditions and Events carrying the controller's reasons.

A mixin of :class:`operators.runtime.OperatorRuntime` (it reads the runtime's status writer,
settings and clock).
"""


import logging
from typing import Any

from elastic.backends.base import BackendError
from elastic.controller import Controller, TickResult
from elastic.phases import JobPhase
from elastic.reasons import DecisionReason, ResourceReason, TickReason
from operators.members import JOBS, POOLS, SERVICES, Grow, Member, Pool

log = logging.getLogger("operators.runtime")


class Publishing:
    """Publishing a pool's cycle (mixed into :class:`operators.runtime.OperatorRuntime`)."""

    def _pool_not_ready(self, pool: Pool, reason: str, message: str) -> None:
        assert self.status is not None
        if self.status.set_condition(POOLS, None, pool.name, "Ready", False, reason, message, pool.generation):
            self.status.event(POOLS, None, pool.name, pool.uid, type_="Warning", reason=reason, note=message,
                              action="Reconcile")

    def _publish(self, pool: Pool, ctl: Controller, res: TickResult, nodes: dict[str, int],
                 members: list[Member], landed: dict[str, tuple[Grow, str | None]] | None = None) -> None:
        assert self.status is not None
        by_workload = {m.workload: m for m in members}
        for job, (g, why) in (landed or {}).items():  # a start or grow that ran in the background landed
            m = by_workload.get(job)
            if m is not None and why is None and g.step is not None:
                self.status.event(m.plural, m.namespace, m.name, m.uid, type_="Normal", reason=g.step.reason,
                                  note=g.step.message, action=g.step.action)
        if not res.acted:
            if res.reason == TickReason.NOT_LEADER:
                return  # the leader publishes; a standby stays silent
            self._pool_not_ready(pool, res.reason, res.message)
            return
        inference = sum(len(pool.backend.service_gpus(s.name)) for s in ctl.cfg.services)
        training = 0
        runtimes = {}
        for j in ctl.cfg.jobs:
            rt = pool.backend.job_runtime(j.name)
            runtimes[j.name] = rt
            training += len(rt.gpus) if rt else 0
        ok = res.error is None
        self.status.set_condition(POOLS, None, pool.name, "Ready", ok,
                                  DecisionReason.APPLY_FAILED if not ok else res.reason,
                                  res.message if ok else f"{res.message}; failed: {res.error}", pool.generation,
                                  extra={"nodes": len(nodes), "gpus": sum(nodes.values()), "inferenceGPUs": inference,
                                         "trainingGPUs": training, "leader": self.settings.instance,
                                         "lastDecision": res.reason, "lastTickTime": _rfc(res.at)})
        if not ok:
            self.status.event(POOLS, None, pool.name, pool.uid, type_="Warning", reason=DecisionReason.APPLY_FAILED,
                              note=str(res.error), action="Apply")
        applied = set(res.applied)
        for a in res.applied:  # a failed job the controller stopped this cycle (its GPUs back in the pool)
            kind, _, rest = a.partition(" ")
            workload, _, why = rest.partition(": ")
            if kind == "stop_failed_training" and (m := by_workload.get(workload)) is not None:
                self.status.event(m.plural, m.namespace, m.name, m.uid, type_="Warning",
                                  reason=ResourceReason.WORKER_FAILED,
                                  note=f"stopped, its GPUs back in pool {pool.name}: {why}", action="Stop")
        for step in (res.plan.steps if res.plan else ()):
            m = by_workload.get(step.workload)
            if m is not None and f"{step.action} {step.workload}" in applied:
                self.status.event(m.plural, m.namespace, m.name, m.uid, type_="Normal", reason=step.reason,
                                  note=step.message, action=step.action)
        for m in members:
            starting = (g := pool.growing.get(m.workload)) is not None and g.running
            if m.workload in pool.backoff and not starting:  # its next try, starting now, says how it goes
                _, wait, why = pool.backoff[m.workload]
                note = f"{why}; next try after a back-off of {wait:g} s"
                if self.status.set_condition(m.plural, m.namespace, m.name, "Ready", False,
                                             ResourceReason.START_FAILED, note, m.generation):
                    self.status.event(m.plural, m.namespace, m.name, m.uid, type_="Warning",
                                      reason=ResourceReason.START_FAILED, note=note, action="Start")
                self.status.patch(m.plural, m.namespace, m.name, {"phase": "BackOff", "worldSize": 0, "workers": []})
            elif m.workload in pool.unschedulable:
                self.status.set_condition(m.plural, m.namespace, m.name, "Ready", False, ResourceReason.UNSCHEDULABLE,
                                          pool.unschedulable[m.workload], m.generation)
            elif m.plural == SERVICES:
                self._publish_service(pool, m, res)
            else:
                self._publish_job(pool, m, res, runtimes.get(m.workload))

    def _publish_service(self, pool: Pool, m: Member, res: TickResult) -> None:
        assert self.status is not None
        d = res.replica_decisions.get(m.workload)
        gpus = pool.backend.service_gpus(m.workload)
        try:
            ready = pool.backend.ready_replicas(m.workload)
        except BackendError:
            ready = 0
        sd = res.plan.services.get(m.workload) if res.plan else None
        extra: dict[str, Any] = {"replicas": len(gpus) // m.spec.gpus_per_replica, "readyReplicas": ready,
                                 "gpus": [str(g) for g in gpus], "selector": self._selector(pool, m)}
        if d is not None:
            extra.update(desiredReplicas=d.replicas, observedValue=d.metric)
        conds = self.status.conditions(SERVICES, m.namespace, m.name)
        from operators.status import set_condition

        if d is not None:
            conds = set_condition(conds, "ScalingActive", d.metric is not None, str(d.reason), d.message, m.generation)
        if sd is not None:
            limited = sd.replicas < sd.demand_replicas
            conds = set_condition(conds, "ScalingLimited", limited, sd.reason, sd.message, m.generation)
        ok, reason, note = self._replicas_ready(pool, m, extra["replicas"], ready)
        was = next((c for c in conds if c.get("type") == "Ready"), {})
        conds = set_condition(conds, "Ready", ok, reason, note, m.generation)
        self.status.patch(SERVICES, m.namespace, m.name, {**extra, "conditions": conds,
                                                         "observedGeneration": m.generation})
        if not ok and was.get("reason") != reason:
            self.status.event(SERVICES, m.namespace, m.name, m.uid, type_="Warning", reason=reason, note=note,
                              action="Observe")

    def _replicas_ready(self, pool: Pool, m: Member, replicas: int, ready: int) -> tuple[bool, str, str]:
        """Ready=False ``ReplicasNotReady`` once the Deployment has had fewer ready replicas than the pool
        gives it for longer than ``spec.startupSeconds``, naming each pod's trouble; the GPUs stay booked
        to the service (its pods hold them), nothing else changes."""
        now = self.clock()
        if ready >= replicas:
            pool.not_ready_since.pop(m.workload, None)
            return True, ResourceReason.RECONCILED, f"scaled by pool {pool.name}"
        since = pool.not_ready_since.setdefault(m.workload, now)
        if now - since <= m.spec.startup_seconds:
            return True, ResourceReason.RECONCILED, f"scaled by pool {pool.name}; {ready} of {replicas} replicas ready"
        try:
            why = "; ".join(pool.backend.unready_replicas(m.workload)) or "no pod yet"
        except BackendError as e:
            why = str(e)
        dep = m.cr.scale_target_ref.name
        return False, "ReplicasNotReady", (f"Deployment {m.namespace}/{dep}: {ready} of {replicas} replicas ready "
                                           f"longer than startupSeconds ({m.spec.startup_seconds:g} s): {why}")

    def _selector(self, pool: Pool, m: Member) -> str:
        cached = self.status.known(SERVICES, m.namespace, m.name).get("selector") if self.status else None
        if cached:
            return str(cached)
        try:
            dep = pool.backend._deployment(m.workload)
        except BackendError:
            return ""
        labels = (dep.spec.selector.match_labels or {}) if dep.spec and dep.spec.selector else {}
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

    def _publish_job(self, pool: Pool, m: Member, res: TickResult, rt: Any) -> None:
        assert self.status is not None
        jd = res.plan.jobs.get(m.workload) if res.plan else None
        extra: dict[str, Any] = {
            "phase": rt.phase if rt else JobPhase.PENDING, "layout": str(rt.layout or "") if rt else "",
            "generation": rt.generation if rt else 0, "worldSize": len(rt.gpus) if rt else 0,
            "step": rt.step if rt else 0, "tokensPerSecond": rt.tokens_per_second if rt else 0.0,
            "loss": rt.loss if rt else None,
            "workers": sorted(p.metadata.name for p in pool.backend.worker_pods(m.workload)) if rt else [],
        }
        ctl = pool.controller
        mem = (ctl.memory_status(m.workload, rt) if ctl is not None else None) if rt is not None else None
        if mem:
            extra["memory"] = {"layout": str(mem.get("layout", "")), "rank": int(mem.get("rank", 0)),
                               "step": int(mem.get("step", 0)),
                               **{k: int(mem.get(k) or 0) for k in ("weights", "gradients", "optimizer", "activations",
                                                                    "total")},
                               **({"devicePeak": int(mem["device_peak"])} if mem.get("device_peak") is not None
                                  else {}),
                               **({"predicted": mem["predicted"]} if mem.get("predicted") else {}),
                               "budgetBytes": int(mem["budgetBytes"])}
        dropped = ctl.dropped_layouts(m.workload) if ctl is not None else []
        if dropped:
            extra["droppedLayouts"] = dropped
        if rt is not None and rt.last_pause_seconds is not None:
            extra["lastReshard"] = {"seconds": rt.last_pause_seconds, "bytes": rt.last_bytes_moved or 0,
                                    "toLayout": str(rt.layout or "")}
        conds = self.status.conditions(JOBS, m.namespace, m.name)
        from operators.status import set_condition

        if jd is not None:
            conds = set_condition(conds, "Scheduled", jd.gpus > 0, jd.reason, jd.message, m.generation)
        ready = rt is None or rt.phase != JobPhase.FAILED
        was = next((c for c in conds if c.get("type") == "Ready"), {})
        conds = set_condition(conds, "Ready", ready,
                              ResourceReason.RECONCILED if ready else ResourceReason.WORKER_FAILED,
                              f"scheduled by pool {pool.name}" if ready else (rt.error or "a worker failed"),
                              m.generation)
        if not ready and was.get("reason") != ResourceReason.WORKER_FAILED:
            self.status.event(JOBS, m.namespace, m.name, m.uid, type_="Warning", reason=ResourceReason.WORKER_FAILED,
                              note=rt.error or "a worker failed", action="Observe")
        self.status.patch(JOBS, m.namespace, m.name, {**extra, "conditions": conds, "observedGeneration": m.generation})


def _rfc(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
