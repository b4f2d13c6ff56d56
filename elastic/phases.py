"""A training job's phase as the controller, the API and the exporter name it. Pure.

What it is for: the one vocabulary of ``JobRuntime.phase`` (``JobPhase``) and of the training
coordinator's own lower-case phase (``CoordinatorPhase``). Backends translate the coordinator's
phase through ``RUNTIME_PHASES`` and the exporter publishes one ``elastic_job_phase`` series per
name in ``JOB_PHASES``. Both enums are ``StrEnum``s: a member equals its string and serializes as
it (JSON, metric labels, f-strings), so the coordinator's wire, the store, a custom resource's
status and the metrics carry the plain names. It sits below the backends, the metrics package and
the trainer so that none has to import another for it.

What it must not do: import anything but ``enum``, or hold behaviour; it is data.
"""

from __future__ import annotations

import enum

__all__ = ["JOB_PHASES", "RUNTIME_PHASES", "CoordinatorPhase", "JobPhase"]


class JobPhase(enum.StrEnum):
    """A training job's phase as ``JobRuntime.phase`` reports it."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESCALING = "Rescaling"
    PAUSED = "Paused"
    RECOVERING = "Recovering"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"
    FINISHED = "Finished"


class CoordinatorPhase(enum.StrEnum):
    """The training coordinator's phase (``JobStatus.phase``), lower-case on its wire."""

    STARTING = "starting"
    RUNNING = "running"
    RESCALING = "rescaling"
    PAUSED = "paused"
    RECOVERING = "recovering"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"


# keyed by ``str``: a status read off the wire holds a plain string, and a member hashes as its string
RUNTIME_PHASES: dict[str, JobPhase] = {
    CoordinatorPhase.RUNNING: JobPhase.RUNNING,
    CoordinatorPhase.RESCALING: JobPhase.RESCALING,
    CoordinatorPhase.FAILED: JobPhase.FAILED,
    CoordinatorPhase.STARTING: JobPhase.PENDING,
    CoordinatorPhase.STOPPING: JobPhase.STOPPING,
    CoordinatorPhase.STOPPED: JobPhase.STOPPED,
    CoordinatorPhase.FINISHED: JobPhase.FINISHED,
    CoordinatorPhase.PAUSED: JobPhase.PAUSED,
    CoordinatorPhase.RECOVERING: JobPhase.RECOVERING,
}
"""The training coordinator's phase -> a ``JobRuntime.phase``."""

JOB_PHASES: tuple[JobPhase, ...] = (JobPhase.PENDING, *sorted(set(JobPhase) - {JobPhase.PENDING}))
"""Every phase a training job reports (``elastic_job_phase``: 1 for the current one, 0 for the others)."""
