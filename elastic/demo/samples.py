"""What the demo records each second: one sample of the pool, and the run it belongs to."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.demo.config import (
    JOB,
    REFERENCE,
)

if TYPE_CHECKING:
    from elastic.model import Layout

log = logging.getLogger("elastic.demo")


@dataclass
class Sample:
    t: float
    rate: float
    replicas: int
    inference_busy: float
    training_gpus: int
    training_busy: int
    layout: Layout | None
    step: int
    loss: float | None
    tokens_per_second: float
    running: float = 0.0  # requests being served by all ready replicas
    draining: int = 0  # replicas out of the balancer's targets, finishing their requests


@dataclass
class DemoRun:
    samples: list[Sample] = field(default_factory=list)
    reshards: list[dict[str, Any]] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    warmup: float = 0.0
    # reshard events with an id above this one are this run's (./elastic.db outlives runs)
    reshards_after_id: int = 0
    # --kill-worker-at: when a training worker was killed (t, worker), and the job's generations the
    # trainer recovered into on its own (their reshard rows are recoveries, not rescales)
    kills: list[tuple[float, str]] = field(default_factory=list)
    recovered: set[int] = field(default_factory=set)
    job: str = JOB  # the training job's name, and what trains it (the summary says which)
    trainer: str = REFERENCE


def _world_size(text: str | None) -> int:
    """The GPUs of a layout as a reshard record (a store row) names it; 0 for none."""
    from elastic.model import Layout

    return Layout.parse(text).world_size if text else 0
