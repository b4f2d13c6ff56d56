"""Reason codes the controller and the operator write, beside the replica policy's and the
scheduler's own (``elastic.policy.types.Reason``, ``elastic.scheduler.types.Reason``). Pure.

What it is for: one vocabulary for why a tick did not act (``TickResult.reason``), for the
decision-log rows the controller writes itself (a lost worker, a recovery, a step over its
memory, a job backing off), and for the lifecycle conditions and Events of the custom
resources. Each is a ``StrEnum``: a member equals its string and serializes as it, so the DB,
a resource's status, Events and dashboards carry the plain names, and code that compares with
a name read back from any of them keeps working. Validation refusals of a custom resource are
not here: they are named after the field (``Invalid<Field>``, ``elastic.crds.CRError``).

What it must not do: import anything but ``enum``, or hold behaviour; it is data.
"""

from __future__ import annotations

import enum

__all__ = ["DecisionReason", "ResourceReason", "TickReason"]


class TickReason(enum.StrEnum):
    """Why a tick acted on nothing (``TickResult.reason`` with ``acted=False``)."""

    NOT_LEADER = "NotLeader"  # another controller holds the pool's lease
    LEASE_LOST = "LeaseLost"  # the lease ran out or was taken during the tick: it stopped
    UNAVAILABLE = "Unavailable"  # the backend or the DB could not be reached
    PAUSED = "Paused"  # an operator paused the controller


class DecisionReason(enum.StrEnum):
    """Decision-log rows the controller writes itself (the plan's rows carry the scheduler's)."""

    APPLY_FAILED = "ApplyFailed"  # the tick failed to apply its plan (the row carries the error)
    WORKER_LOST = "WorkerLost"  # a training worker died; the job recovers in place or restarts
    RECOVERED = "Recovered"  # a new leader recovered the pool's state from the DB and the backend
    MEMORY_EXCEEDED = "MemoryExceeded"  # a step's measured peak went over the per-GPU budget
    OUT_OF_MEMORY = "OutOfMemory"  # a step raised an out-of-memory error
    BACKING_OFF = "BackingOff"  # a job whose start failed waits before the next try


class ResourceReason(enum.StrEnum):
    """The lifecycle reasons of a custom resource's ``Ready`` condition and its Events."""

    ACCEPTED = "Accepted"  # the spec is valid; the operator reconciles it
    RECONCILED = "Reconciled"  # the resource is as its spec asks
    WORKER_FAILED = "WorkerFailed"  # a training worker failed
    START_FAILED = "StartFailed"  # a training job's workers could not be started
    UNSCHEDULABLE = "Unschedulable"  # the pool cannot give the job its minimum
    NO_NODES = "NoNodes"  # no schedulable node matches the pool's nodeSelector with GPUs
    WAITING_FOR_MEMBERS = "WaitingForMembers"  # the pool waits until its services and jobs are registered
    POOL_NOT_FOUND = "PoolNotFound"  # the resource names a GPUPool that does not exist
    SCALE_TARGET_UNREADABLE = "ScaleTargetUnreadable"  # the service's scaleTargetRef cannot be read
