"""Prometheus metrics of elastic training jobs (``elastic_training_*``).

What it is for: the rendezvous coordinator records every finished training step and every
rescale here, so the controller's exporter (or the coordinator's own ``/metrics``) shows
loss, speed and the cost of each rescale per job.

Naming follows docs/DESIGN.md: ``elastic_`` prefix, base units, ``_total`` on counters,
``_seconds`` / ``_bytes`` suffixes. The only label is ``job`` (a worker or layout label
would create a new series at every rescale).

What it must not do: no HTTP serving, no clock reads, no aggregation across workers (the
coordinator hands in already-aggregated per-step figures).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PAUSE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class _Families:
    steps: Counter
    tokens: Counter
    step: Gauge
    loss: Gauge
    step_seconds: Histogram
    tokens_per_second: Gauge
    generation: Gauge
    world_size: Gauge
    failed: Gauge
    paused: Gauge
    recoveries: Counter
    rescales: Counter
    rescale_failures: Counter
    steps_given_up: Counter
    given_up_seconds: Counter
    steps_kept: Counter
    pause_seconds: Histogram
    last_pause_seconds: Gauge
    reshard_bytes: Counter
    last_reshard_bytes: Gauge
    last_planned_bytes: Gauge
    last_lower_bound_bytes: Gauge
    checkpoint_step: Gauge
    checkpoint_failures: Counter


_LOCK = threading.Lock()
_BY_REGISTRY: dict[int, tuple[CollectorRegistry, _Families]] = {}


def _families(registry: CollectorRegistry) -> _Families:
    """One set of metric families per registry (prometheus_client refuses duplicates)."""
    with _LOCK:
        hit = _BY_REGISTRY.get(id(registry))
        if hit is not None and hit[0] is registry:
            return hit[1]
        L = ["job"]
        r = registry
        fam = _Families(
            steps=Counter("elastic_training_steps", "Training steps completed", L, registry=r),
            tokens=Counter("elastic_training_tokens", "Tokens trained on", L, registry=r),
            step=Gauge("elastic_training_step", "Index of the last completed step", L, registry=r),
            loss=Gauge("elastic_training_loss", "Training loss of the last completed step", L, registry=r),
            step_seconds=Histogram("elastic_training_step_seconds", "Wall time of one training step", L,
                                   buckets=_STEP_BUCKETS, registry=r),
            tokens_per_second=Gauge("elastic_training_tokens_per_second", "Throughput of the last step", L,
                                    registry=r),
            generation=Gauge("elastic_training_generation", "Layout generation currently training", L, registry=r),
            world_size=Gauge("elastic_training_world_size", "Workers in the current layout", L, registry=r),
            failed=Gauge("elastic_training_failed", "1 when the job has failed (see status for the reason)", L,
                         registry=r),
            paused=Gauge("elastic_training_paused", "1 while the job is paused: its state held off-GPU by keepers, "
                         "no step runs", L, registry=r),
            recoveries=Counter("elastic_training_recoveries", "Lost workers recovered from surviving replicas "
                               "(training resumed without a restart)", L, registry=r),
            rescales=Counter("elastic_training_rescales", "Rescales completed in place", L, registry=r),
            rescale_failures=Counter("elastic_training_rescale_failures",
                                     "Rescales abandoned or failed (the job kept or lost its layout)", L, registry=r),
            steps_given_up=Counter("elastic_training_steps_given_up",
                                   "Steps in progress a shrink gave up (redone on the new layout)", L, registry=r),
            given_up_seconds=Counter("elastic_training_given_up_seconds",
                                     "Compute of given-up steps thrown away (wall seconds, not x GPUs)", L,
                                     registry=r),
            steps_kept=Counter("elastic_training_given_up_steps_kept",
                               "Given-up steps the new layout finished from their kept work (none thrown away)",
                               L, registry=r),
            pause_seconds=Histogram("elastic_training_rescale_pause_seconds",
                                    "Training paused by a rescale (step boundary, or the begin of a step a "
                                    "shrink gave up, to first new step)", L,
                                    buckets=_PAUSE_BUCKETS, registry=r),
            last_pause_seconds=Gauge("elastic_training_last_rescale_pause_seconds", "Pause of the last rescale", L,
                                     registry=r),
            reshard_bytes=Counter("elastic_training_reshard_bytes", "Bytes moved between workers by reshards", L,
                                  registry=r),
            last_reshard_bytes=Gauge("elastic_training_last_reshard_bytes", "Bytes moved by the last reshard", L,
                                     registry=r),
            last_planned_bytes=Gauge("elastic_training_last_reshard_planned_bytes",
                                     "Bytes the last reshard plan scheduled", L, registry=r),
            last_lower_bound_bytes=Gauge("elastic_training_last_reshard_lower_bound_bytes",
                                         "Bytes the last reshard had to move at least (needed minus local)", L,
                                         registry=r),
            checkpoint_step=Gauge("elastic_training_checkpoint_step",
                                  "Step the job's newest complete checkpoint continues at: a start after a "
                                  "failure begins there (-1: none, or checkpoints off)", L, registry=r),
            checkpoint_failures=Counter("elastic_training_checkpoint_failures",
                                        "Checkpoints given up because a worker could not write its part (the "
                                        "previous complete one stands)", L, registry=r),
        )
        _BY_REGISTRY[id(registry)] = (registry, fam)
        return fam


class TrainingMetrics:
    """The metrics of one job in one registry."""

    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry if registry is not None else CollectorRegistry()
        self._f = _families(self.registry)
        for fam in vars(self._f).values():  # every series exists (at 0) from the job's start
            fam.labels(job)
        self._f.checkpoint_step.labels(job).set(-1)

    def record_step(self, step: int, loss: float | None, tokens: int, seconds: float) -> None:
        f, j = self._f, self.job
        f.steps.labels(j).inc()
        f.step.labels(j).set(step)
        if tokens > 0:
            f.tokens.labels(j).inc(tokens)
        if loss is not None:
            f.loss.labels(j).set(loss)
        if seconds > 0:
            f.step_seconds.labels(j).observe(seconds)
            f.tokens_per_second.labels(j).set(tokens / seconds)

    def record_generation(self, generation: int, world_size: int) -> None:
        self._f.generation.labels(self.job).set(generation)
        self._f.world_size.labels(self.job).set(world_size)

    def record_rescale(self, pause_seconds: float, bytes_moved: int, planned_bytes: int,
                       lower_bound_bytes: int, gave_up_seconds: float | None = None, *, kept: bool = False) -> None:
        """A rescale done; ``gave_up_seconds``: it gave the step in progress up after that long (None: not);
        ``kept``: the new layout finished that step from its work (nothing thrown away)."""
        f, j = self._f, self.job
        f.rescales.labels(j).inc()
        if gave_up_seconds is not None:
            f.steps_given_up.labels(j).inc()
            if kept:
                f.steps_kept.labels(j).inc()
            else:
                f.given_up_seconds.labels(j).inc(gave_up_seconds)
        f.pause_seconds.labels(j).observe(pause_seconds)
        f.last_pause_seconds.labels(j).set(pause_seconds)
        f.reshard_bytes.labels(j).inc(bytes_moved)
        f.last_reshard_bytes.labels(j).set(bytes_moved)
        f.last_planned_bytes.labels(j).set(planned_bytes)
        f.last_lower_bound_bytes.labels(j).set(lower_bound_bytes)

    def record_paused(self, paused: bool, bytes_moved: int = 0) -> None:
        """The job was paused (its state moved into keepers: ``bytes_moved`` count as reshard bytes) or resumed."""
        f, j = self._f, self.job
        f.paused.labels(j).set(1 if paused else 0)
        if paused:
            f.world_size.labels(j).set(0)  # keepers hold the state; nobody trains
            f.reshard_bytes.labels(j).inc(bytes_moved)
            f.last_reshard_bytes.labels(j).set(bytes_moved)

    def record_recovery(self) -> None:
        self._f.recoveries.labels(self.job).inc()

    def record_rescale_failure(self) -> None:
        self._f.rescale_failures.labels(self.job).inc()

    def record_checkpoint_failure(self) -> None:
        self._f.checkpoint_failures.labels(self.job).inc()

    def record_checkpoint(self, step: int) -> None:
        """Every worker of the job has written its part of the checkpoint at ``step``."""
        self._f.checkpoint_step.labels(self.job).set(step)

    def record_failed(self, failed: bool) -> None:
        self._f.failed.labels(self.job).set(1 if failed else 0)
