"""Step 2 of a tick, decide: the inputs of the pure decisions, built from what step 1 observed.

The replica policy per service (with an operator's override on top) and the co-scheduler's
snapshot of the pool. The decisions themselves live in ``elastic.policy`` and
``elastic.scheduler`` and read no clock: ``now`` travels in their inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from elastic.backends.base import JobRuntime
from elastic.controller.observe import Observing
from elastic.metrics.sample import MetricSample
from elastic.model import Allocation, Layout
from elastic.phases import JobPhase
from elastic.policy import decide as policy_decide
from elastic.policy.types import PolicyContext, Reason, ReplicaDecision
from elastic.scheduler.types import JobState, Knobs, ServiceDemand, Snapshot


class Deciding(Observing):
    """Turns an observation into the policy's context and the co-scheduler's snapshot."""

    def _decide_replicas(self, now: float, previous: Allocation, samples: dict[str, MetricSample | None],
                         backlogs: Mapping[str, MetricSample | None] | None = None) -> dict[str, ReplicaDecision]:
        out: dict[str, ReplicaDecision] = {}
        for s in self.cfg.services:
            current = len(previous.gpus_of(s.name)) // s.gpus_per_replica
            ctx = PolicyContext.from_sample(s, current, samples[s.name], now, self.policy_state[s.name],
                                            backlog=(backlogs or {}).get(s.name))
            decision, self.policy_state[s.name] = policy_decide(ctx)
            pin = self.overrides.get(s.name)
            if pin is not None and now < pin[1]:
                # a pinned service has no forecast to lend by
                decision = replace(decision, replicas=pin[0], reason=Reason.OVERRIDE, leaving=0,
                                   outlook=(),
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
                     layout=_training_layout(runtimes[j.name]),
                     last_rescale_at=self.last_rescale.get(j.name),
                     # the job's own last pause: a grow must repay it (and the shrink back) before the
                     # services' outlook needs the GPUs again
                     pause_seconds=float((runtimes[j.name].last_pause_seconds if runtimes[j.name] else None) or 0.0),
                     status=_job_status(runtimes[j.name]),
                     # a backend that cannot keep a job's state off-GPU can only preempt it: say so
                     on_below_minimum=j.on_below_minimum if self._can_pause else "preempt")
            for j in self.cfg.jobs)
        return Snapshot(now, nodes, services, jobs, previous, Knobs.from_pool(self.cfg.pool))

    def _table(self, job: str, now: float, previous: Allocation) -> Mapping[int, tuple[Layout, float]]:
        """The job's GPU count -> layout table as the co-scheduler sees it: its pin if any, never a
        layout dropped for its memory (``observe``; re-planned by ``elastic.controller.memory``); while
        it backs off from a failed start, no count above what it holds (it is not started or grown)."""
        table = self._layout_table(job)
        if self._backing_off(job, now) is None:
            return table
        held = len(previous.gpus_of(job))
        return {n: v for n, v in table.items() if n <= held}


def _trains(rt: JobRuntime | None) -> bool:
    return rt is not None and rt.phase != JobPhase.PAUSED


def _training_layout(rt: JobRuntime | None) -> Layout | None:
    """The layout a job trains on, as the co-scheduler's ``JobState.layout`` takes it: the runtime's
    layout of a job that trains; None for a paused one, whose keepers hold its state on no GPU (the
    layout they hold is not one the co-scheduler can run)."""
    return rt.layout if rt is not None and _trains(rt) else None


def _job_status(rt: JobRuntime | None) -> str:
    if rt is None:
        return "pending"
    return "paused" if rt.phase == JobPhase.PAUSED else "running"
