"""Step 4 of a tick, record: the decision (with its reason), the allocations and every workload's
status in the DB, and one log line per change.

A tick that changes nothing is a *hold*: a run of identical holds is one decision row (its count
and last time grow), so the log keeps changes, not a row per tick. At INFO the log says what
changed and why, one line each (a decision that acts, a hold that is not plain steady state).
Every write goes through the fenced store (``db``): refused unless the lease is still ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import fields, replace
from typing import Any

from elastic import store as db
from elastic.controller import memory as mem
from elastic.controller.base import _dt, _recorded_layout, log
from elastic.controller.observe import Observed, Observing
from elastic.metrics.sample import MetricSample
from elastic.model import Allocation, SpecError
from elastic.parallel.memory_report import MeasuredMemory
from elastic.phases import JobPhase
from elastic.policy.types import Reason, ReplicaDecision
from elastic.reasons import DecisionReason
from elastic.scheduler.types import JobDecision, SchedulePlan
from elastic.scheduler.types import Reason as ScheduleReason

#: replica-policy reasons that make a hold a different one (a fail-safe, an operator's pin); the
#: others (within tolerance, stabilising, ...) drift with the load and would split runs for nothing
_HOLD_REASONS = frozenset({Reason.METRICS_MISSING, Reason.OVERRIDE})


def _decision_doc(d: JobDecision) -> dict[str, Any]:
    """A job's decision as the decision log stores it: every field, the layout as its text."""
    doc = {f.name: getattr(d, f.name) for f in fields(d)}
    return {**doc, "layout": None if d.layout is None else str(d.layout)}


def hold_digest(reason: str, message: str, plan: SchedulePlan, replicas: Mapping[str, ReplicaDecision]) -> str:
    """What a tick that changed nothing held on, as a short digest: identical holds extend one
    decision row. The reason, the plan's summary, its notes (a job held back, demand the pool
    cannot place) and every service held by a fail-safe or an operator's pin."""
    key = [reason, message,
           sorted((st.workload, st.reason) for st in plan.steps if st.action == "noop"),
           sorted((name, str(d.reason)) for name, d in replicas.items() if str(d.reason) in _HOLD_REASONS)]
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()


class Recording(Observing):
    """Writes what a tick decided and did to the store, and logs it."""

    def _record(self, now: float, plan: SchedulePlan, replicas: dict[str, ReplicaDecision],
                samples: dict[str, MetricSample | None], applied: list[str], error: str | None,
                obs: Observed) -> None:
        """Write the tick to the store. What each job holds and its status come from ``obs``: step 1's
        read for a job the tick left alone, a read after the action for one it acted on."""
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
            "jobs": {k: _decision_doc(v) for k, v in plan.jobs.items()},
        }
        reason = DecisionReason.APPLY_FAILED if error else plan.reason
        message = f"{plan.message}; failed: {error}" if error else plan.message
        hold = None if (applied or error or any(st.action != "noop" for st in plan.steps)) else \
            hold_digest(reason, message, plan, replicas)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason=reason, message=message,
                           plan=plan_doc, inputs=inputs, hold=hold)
        if self._expired_overrides:
            db.drop_expired_overrides(self.db, self.pool, now=_dt(now))
            self._expired_overrides = False
        self._log_decision(reason, message, plan, replicas, applied, error, hold)
        self._record_allocations(self._observed_allocation(obs), generation=int(now))
        for name, d in replicas.items():
            with self._vanished("service", name):
                db.set_service_status(self.db, name, {
                    "currentReplicas": d.current, "desiredReplicas": d.replicas, "observedValue": d.metric,
                    "leavingReplicas": d.leaving, "reason": str(d.reason), "message": d.message}, now=_dt(now))
        for j in self.cfg.jobs:
            rt = obs.runtime(j.name)
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
            jd = replace(jd, reason=DecisionReason.BACKING_OFF,
                         message=f"failed {b.failures} time(s) in a row ({b.reason[:200]}); next attempt at "
                                 f"{_dt(b.next_at).isoformat()}") if jd is not None else jd
        db.set_job_status(self.db, name, {
            "backoff": backoff,
            "phase": rt.phase if rt else JobPhase.PENDING, "layout": _recorded_layout(rt),
            "generation": rt.generation if rt else 0, "step": rt.step if rt else 0,
            "loss": rt.loss if rt else None, "tokensPerSecond": rt.tokens_per_second if rt else 0.0,
            "worldSize": len(rt.gpus) if rt else 0,
            "checkpointStep": rt.checkpoint_step if rt else None,
            # the worst rank's measured memory of the current layout, and the layouts dropped for
            # theirs (kept here for the job's life: a restarted controller reads them back)
            "memory": self.memory_status(name, rt),
            "droppedLayouts": self.dropped_layouts(name),
            "reason": jd.reason if jd else None, "message": jd.message if jd else None}, now=_dt(now))

    def memory_status(self, job: str, rt: Any) -> dict[str, Any] | None:
        """A job status's ``memory``: its worst rank's measured step of the current layout
        (``rt.memory``), the planner's bytes for exactly what that rank ran (``predicted``: per
        component and ``total``, without the reserve) and the per-GPU budget the layout was fitted in
        (``budgetBytes``). None without a measurement; no ``predicted`` when the planner cannot
        evaluate what ran. The prediction is kept per measured choice: the status is written every tick."""
        if rt is None or not rt.memory:
            return None
        out = {**rt.memory, "budgetBytes": self._budget(job)}
        try:
            m = MeasuredMemory.from_json(rt.memory, where=f"job {job}: measured memory")
        except SpecError:
            return out
        key = (job, m.model, m.layout, m.pp_rank, m.micro_batch, m.grad_accum)
        if key not in self._predicted_memory:
            model = self.cfg.models().get(job)
            p = None if model is None else mem.predicted_stage(model, m, self.hardware,
                                                               gpus_per_node=self.cfg.pool.gpus_per_node)
            self._predicted_memory = {k: v for k, v in self._predicted_memory.items() if k[0] != job}
            self._predicted_memory[key] = None if p is None else {
                **{c: getattr(p, c) for c in mem.COMPONENTS}, "total": p.total - p.reserve}
        predicted = self._predicted_memory[key]
        if predicted is not None:
            out["predicted"] = predicted
        return out

    def _log_decision(self, reason: str, message: str, plan: SchedulePlan, replicas: dict[str, ReplicaDecision],
                      applied: list[str], error: str | None, hold: str | None) -> None:
        """One line per change; one per new run of holds that is not plain steady state."""
        was, self._hold = self._hold, hold
        if hold is None:
            steps = [f"{st.action} {st.workload} ({st.reason}: {st.message})" for st in plan.steps
                     if st.action != "noop"]
            steps += [a for a in applied if a.startswith(("drain_ahead", "stop_failed", "relayout_training"))]
            (log.warning if error else log.info)("decision %s: %s; %s", reason, message,
                                                  "; ".join(steps) or "no plan step")
            return
        if hold == was:
            return
        why = [f"{st.workload} {st.reason}: {st.message}" for st in plan.steps if st.action == "noop"]
        why += [f"{name} {d.reason}: {d.message}" for name, d in sorted(replicas.items())
                if str(d.reason) in _HOLD_REASONS]
        if reason == ScheduleReason.STEADY and not why:
            log.debug("holding: %s", message)
            return
        fail_safe = any(d.reason == Reason.METRICS_MISSING for d in replicas.values())
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
