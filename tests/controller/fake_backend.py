"""A fake backend at our own boundary (the Backend protocol), with levers for tests.

It keeps the truth a real cluster would: which GPUs each service's replicas and each
job's workers hold. It refuses to double-book a GPU (so an apply order that scales
inference before the training shrink freed the GPUs fails loudly), and logs every call.
"""

from __future__ import annotations

from dataclasses import replace

from elastic.backends.base import (
    BackendError,
    BackendUnavailable,
    CheckpointOutcome,
    JobRuntime,
    RescaleOutcome,
)
from elastic.model import GPU, InferenceSpec, Layout, SpecError, TrainingSpec
from elastic.phases import JobPhase


class FakeBackend:
    name = "fake"

    def __init__(self, nodes: dict[str, int]) -> None:
        self.nodes = dict(nodes)
        self.services: dict[str, tuple[GPU, ...]] = {}
        self.jobs: dict[str, JobRuntime] = {}
        self.calls: list[tuple[str, str, int]] = []
        self.reachable = True
        self.fail_next: str | None = None
        self.checkpoint_raises: Exception | None = None  # the next checkpoint_job raises this

    # levers
    def set_reachable(self, ok: bool) -> None:
        self.reachable = ok

    def _held(self, exclude: str) -> set[GPU]:
        held = {g for s, gs in self.services.items() if s != exclude for g in gs}
        held |= {g for j, rt in self.jobs.items() if j != exclude for g in rt.gpus}
        return held

    def _check(self, workload: str, gpus: tuple[GPU, ...]) -> None:
        clash = set(gpus) & self._held(workload)
        if clash:
            raise BackendError(f"{workload}: GPUs {sorted(map(str, clash))} are still held by another workload")
        for g in gpus:
            if g.node not in self.nodes or g.index >= self.nodes[g.node]:
                raise BackendError(f"{workload}: no GPU {g}")

    # protocol
    def ping(self) -> None:
        if not self.reachable:
            raise BackendUnavailable("fake cluster unreachable")

    def inventory(self) -> dict[str, int]:
        self.ping()
        return dict(self.nodes)

    def service_gpus(self, service: str) -> tuple[GPU, ...]:
        return self.services.get(service, ())

    def ready_replicas(self, service: str) -> int:
        return len(self.services.get(service, ()))

    def service_targets(self, service: str) -> list[str]:
        return []

    def set_service_gpus(self, spec: InferenceSpec, gpus: tuple[GPU, ...]) -> None:
        self.ping()
        if self.fail_next == spec.name:
            self.fail_next = None
            raise BackendError(f"{spec.name}: injected failure")
        self._check(spec.name, gpus)
        self.calls.append(("service", spec.name, len(gpus)))
        self.services[spec.name] = tuple(gpus)

    def job_runtime(self, job: str) -> JobRuntime | None:
        return self.jobs.get(job)

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> CheckpointOutcome:
        """As a coordinator would: refused without settings or a running job; else the next step's
        checkpoint, complete at once when waited for."""
        self.ping()
        rt = self.jobs.get(job)
        if rt is None or rt.phase != JobPhase.RUNNING:
            raise BackendError(f"training job {job} is not running here; only a running job can save a checkpoint")
        if rt.checkpoint_step is None:
            raise SpecError(f"job {job} has no checkpoint settings; give it checkpoint.dir to save one")
        if (e := self.checkpoint_raises) is not None:
            self.checkpoint_raises = None
            raise e
        self.calls.append(("checkpoint", job, 0))
        if wait_seconds <= 0:
            return CheckpointOutcome(job, rt.checkpoint_step, None)
        self.jobs[job] = replace(rt, step=rt.step + 1, checkpoint_step=rt.step + 1)
        return CheckpointOutcome(job, rt.checkpoint_step, rt.step + 1)

    def cancel_grow(self, job: str) -> bool:
        return False  # its set_job_gpus is instantaneous: nothing is ever waiting to be called off

    def pause_job(self, spec: TrainingSpec) -> RescaleOutcome:
        """The job's GPUs are freed; it keeps its layout (as ``tp.pp.dp1``), generation and step."""
        self.ping()
        before = self.jobs[spec.name]
        assert before.layout is not None
        held = before.layout.held()
        self.calls.append(("pause", spec.name, 0))
        self.jobs[spec.name] = JobRuntime(spec.name, JobPhase.PAUSED, held, (), before.generation + 1, before.step)
        return RescaleOutcome(spec.name, before.layout, held, before.generation + 1, pause_seconds=0.02,
                              bytes_moved=500, bytes_planned=500, bytes_lower_bound=500, step=before.step)

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        self.ping()
        self._check(spec.name, gpus)
        before = self.jobs.get(spec.name)
        self.calls.append(("job", spec.name, len(gpus)))
        if not gpus:
            self.jobs.pop(spec.name, None)
            return RescaleOutcome(spec.name, before.layout if before else None, None, 0)
        if before is not None and before.phase == JobPhase.PAUSED:
            self.calls.append(("resume", spec.name, len(gpus)))
        assert layout is not None and layout.world_size == len(gpus), (layout, len(gpus))
        gen = (before.generation + 1) if before else 0
        step = before.step if before else 0
        self.jobs[spec.name] = JobRuntime(spec.name, JobPhase.RUNNING, layout, tuple(gpus), gen, step,
                                          checkpoint_step=step if spec.checkpoint else None)
        return RescaleOutcome(spec.name, before.layout if before else None, layout, gen, pause_seconds=0.01,
                              bytes_moved=1000 * len(gpus), bytes_planned=1000 * len(gpus),
                              bytes_lower_bound=1000 * len(gpus), step=step)
