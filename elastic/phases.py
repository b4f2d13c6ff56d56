"""A training job's phase as the controller, the API and the exporter name it. Pure.

What it is for: the one vocabulary of ``JobRuntime.phase``. The training coordinator reports
its own lower-case phase; backends translate it through ``RUNTIME_PHASES`` and the exporter
publishes one ``elastic_job_phase`` series per name in ``JOB_PHASES``. It sits below both the
backends and the metrics package so that neither has to import the other for it.

What it must not do: import anything, or hold behaviour; it is data.
"""

from __future__ import annotations

__all__ = ["JOB_PHASES", "RUNTIME_PHASES"]

RUNTIME_PHASES = {
    "running": "Running",
    "rescaling": "Rescaling",
    "failed": "Failed",
    "starting": "Pending",
    "stopping": "Stopping",
    "stopped": "Stopped",
    "finished": "Finished",
    "paused": "Paused",
    "recovering": "Recovering",
}
"""The training coordinator's phase -> a ``JobRuntime.phase``."""

JOB_PHASES = ("Pending", *sorted(set(RUNTIME_PHASES.values()) - {"Pending"}))
"""Every phase a training job reports (``elastic_job_phase``: 1 for the current one, 0 for the others)."""
