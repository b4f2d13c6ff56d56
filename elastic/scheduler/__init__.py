"""Co-scheduler: split one GPU pool between inference services and training jobs.

Pure: ``decide(snapshot) -> SchedulePlan`` with ``now`` inside the snapshot; no clock, DB,
metrics or backend access. The controller, the simulator, tests and benchmarks all call
the same function.
"""

from __future__ import annotations

from elastic.scheduler.core import decide
from elastic.scheduler.types import (
    JobDecision,
    JobState,
    Knobs,
    Reason,
    SchedulePlan,
    ServiceDecision,
    ServiceDemand,
    Snapshot,
    StepTarget,
    ThroughputTable,
)

__all__ = [
    "JobDecision", "JobState", "Knobs", "Reason", "SchedulePlan", "ServiceDecision", "ServiceDemand",
    "Snapshot", "StepTarget", "ThroughputTable", "decide",
]
