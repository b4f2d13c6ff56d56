"""Step 3 of a tick, apply: the only step that acts on the backend.

a. stop jobs the backend reports Failed (their GPUs return to the pool, the reason goes on record;
   the plan already counted them as not running and restarts them when GPUs allow);
b. the plan's ordered steps, each confirmed before the next: training shrinks finish before
   inference gets their GPUs; inference drains before training grows. A grow still starting its
   joiners when inference wants the GPUs back is called off (nothing has moved yet) and the tick
   plans once more from what the job really holds;
c. a job still on a layout dropped for its memory (``observe``) that the plan left on its GPUs moves
   in place to the next layout of that GPU count (``_relayout``);
d. drain ahead: replicas a scale-down the policy sees coming will remove leave the load balancer.

Every action is fenced by the lease (``_act``), and every one that moves a job's state is in the
reshard history: in flight first, then done with its bytes and pause, or failed or cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, cast

from elastic import store as db
from elastic.backends.base import (
    BackendError,
    Drains,
    GrowCancelled,
    JobRuntime,
    Pauses,
    RescaleOutcome,
    paused_tag,
)
from elastic.controller.base import _dt, _recorded_layout, log
from elastic.controller.decide import Deciding
from elastic.controller.lease import Leading
from elastic.controller.observe import Observed
from elastic.model import GPU, Allocation, Layout, PlanStep
from elastic.phases import JobPhase
from elastic.policy import landed as policy_landed
from elastic.policy.types import ReplicaDecision
from elastic.reasons import DecisionReason
from elastic.scheduler import decide as schedule
from elastic.scheduler.types import SchedulePlan


class Applying(Leading, Deciding):
    """Carries out a plan's steps on the backend, in order, and records the reshards they cause."""

    def _reap_failed(self, now: float, failed: dict[str, JobRuntime], obs: Observed) -> tuple[list[str], str | None]:
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
            finally:
                obs.acted(name)
            db.finish_action(self.db, action_id, now=_dt(self.clock()))
            self.last_rescale.pop(name, None)
            self._failed_start(name, why, now)
            done.append(f"stop_failed_training {name}: {why}")
        return done, None

    def _apply(self, now: float, plan: SchedulePlan, obs: Observed) -> tuple[list[str], str | None]:
        applied: list[str] = []
        specs = {s.name: s for s in self.cfg.services} | {j.name: j for j in self.cfg.jobs}
        job_names = {j.name for j in self.cfg.jobs}
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
                    obs.acted(step.workload)
                    applied.append(f"cancel_grow {step.workload} (joiners dismissed before their directive; "
                                   f"{step.action} re-planned)")
                    log.info("called off the grow of %s: %s needs its GPUs", step.workload, step.action)
                    self._replan = True
                    return applied, None
                self._wait_grow(step.workload)  # past its directive: a shrink waits for the grow to land
                obs.acted(step.workload)
            action_id = db.begin_action(self.db, pool=self.pool, kind=step.action, workload=step.workload,
                                        payload={"gpus": [str(g) for g in gpus], "reason": step.reason},
                                        now=_dt(now))
            before = obs.runtime(step.workload) if step.workload in job_names else None
            obs.acted(step.workload)  # whatever comes of it, the job is read again at its next use
            if step.action == "grow_training" and self.async_grow:
                self._grow_async(step, specs[step.workload], gpus, now, action_id, before)
                applied.append(f"{step.action} {step.workload} (started)")
                continue
            try:
                self._apply_step(step, specs[step.workload], gpus, now, before)
            except BackendError as e:
                if step.action == "grow_training" and not isinstance(e, GrowCancelled):
                    self._failed_start(step.workload, str(e), now)
                db.finish_action(self.db, action_id, error=str(e), now=_dt(self.clock()))
                log.error("step %s %s failed: %s; the rest of this plan is skipped", step.action, step.workload, e)
                return applied, f"{step.action} {step.workload}: {e}"
            db.finish_action(self.db, action_id, now=_dt(self.clock()))
            applied.append(f"{step.action} {step.workload}")
        return applied, None

    def _relayout(self, now: float, plan: SchedulePlan, obs: Observed) -> tuple[list[str], str | None]:
        """Move each job whose running layout was dropped for its memory, and which this tick's plan
        left on the GPUs it holds, in place to the re-planned layout of the same GPU count (a plan that
        resized it already took a layout of the re-planned table). Recorded as an action and a reshard."""
        applied: list[str] = []
        resized = {st.workload for st in plan.steps if st.action != "noop"}
        for spec in self.cfg.jobs:
            if spec.name in resized or self._grow_in_flight(spec.name):
                continue
            rt = obs.runtime(spec.name)
            to = self._relayout_target(spec.name, rt)
            if rt is None or to is None:
                continue
            obs.acted(spec.name)
            gpus = rt.gpus
            action_id = db.begin_action(self.db, pool=self.pool, kind="relayout_training", workload=spec.name,
                                        payload={"gpus": [str(g) for g in gpus],
                                                 "reason": DecisionReason.MEMORY_EXCEEDED,
                                                 "from": str(rt.layout), "to": str(to)}, now=_dt(now))
            try:
                self._reshard_on_record(spec, rt, str(to), now,
                                        partial(self._act, self.backend.set_job_gpus, spec, gpus, to))
            except BackendError as e:
                db.finish_action(self.db, action_id, error=str(e), now=_dt(self.clock()))
                log.error("relayout of %s off %s failed: %s", spec.name, rt.layout, e)
                return applied, f"relayout_training {spec.name}: {e}"
            db.finish_action(self.db, action_id, now=_dt(self.clock()))
            applied.append(f"relayout_training {spec.name}: {rt.layout} -> {to} on the same {len(gpus)} GPUs "
                           "(its layout exceeded its memory budget)")
        return applied, None

    def _drain_ahead(self, now: float, nodes: dict[str, int], failed: dict[str, JobRuntime], plan: SchedulePlan,
                     replicas: dict[str, ReplicaDecision], obs: Observed) -> list[str]:
        """Take out of the load balancer the replicas a scale-down the policy sees coming will remove
        (``ReplicaDecision.leaving``; 0 while an operator pins the count), so it finds them drained and
        their GPUs go to training at once.

        Which replicas: those the co-scheduler would remove if the service had ``leaving`` fewer
        now (the same pure decision the scale-down will make; should it pick others then, those
        drain as usual). A service scaled this tick or one whose ``leaving`` is 0 gets every
        replica back. The backend holds them out for a few ticks unless asked again, so
        a controller that stops ticking cannot strand them."""
        if not self.caps.drains:
            return []
        act = cast(Drains, self.backend).drain_ahead
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
                    alloc, runtimes = self._observe_jobs(obs, set(failed))
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

    def _apply_step(self, step: PlanStep, spec: Any, gpus: tuple[GPU, ...], now: float,
                    before: JobRuntime | None) -> None:
        """Carry out one plan step. ``before``: the job as the tick last saw it (None for a service,
        or a job that runs nothing), which the reshard history starts from."""
        if step.action in ("scale_inference_up", "scale_inference_down"):
            self._act(self.backend.set_service_gpus, spec, gpus)
            if step.action == "scale_inference_up":
                self._landed(spec.name, len(gpus) // spec.gpus_per_replica)
            return
        if step.action == "pause_training" and self._can_pause:
            self._pause(spec, now, before)
            return
        layout: Layout | None = None
        if gpus:
            layout = getattr(step.target, "layout_after", None) or self._throughput[spec.name][len(gpus)][0]
        to = str(layout) if before is not None and layout is not None else None
        self._reshard_on_record(spec, before, to, now, lambda: self._act(self.backend.set_job_gpus, spec, gpus, layout))

    def _landed(self, service: str, replicas: int) -> None:
        """A scale-up landed *now*, seconds after the tick that decided it began (see ``policy.landed``)."""
        st = self.policy_state.get(service)
        if st is not None:
            self.policy_state[service] = policy_landed(st, self.clock(), replicas)

    def _pause(self, spec: Any, now: float, before: JobRuntime | None) -> None:
        """Free every GPU of a job and keep its state off-GPU (keepers); recorded as a reshard to
        ``paused:<layout the keepers hold>``, with its bytes and seconds."""
        to = (paused_tag(before.layout.held())
              if before is not None and before.layout is not None and before.phase != JobPhase.PAUSED else None)
        self._reshard_on_record(spec, before, to, now, lambda: self._act(cast(Pauses, self.backend).pause_job, spec))

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

    def _wait_grow(self, job: str) -> None:
        g = self._growing.pop(job, None)
        if g is not None:
            g[0].join()

    def _grow_async(self, step: PlanStep, spec: Any, gpus: tuple[GPU, ...], now: float, action_id: int,
                    before: JobRuntime | None) -> None:
        """``_apply_step`` of a grow in its own thread. ``before`` is the tick's view of the job when the
        grow begins (nothing else acts on a job while its grow is in flight)."""
        errors: list[str] = []

        def run() -> None:
            try:
                self._apply_step(step, spec, gpus, now, before)
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


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
