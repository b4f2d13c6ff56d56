"""The backend protocol: what the controller needs from a cluster, and nothing more.

A required core (inventory, inference replicas, training jobs) in the spirit of Kueue's
``GenericJob``, and optional capabilities as typed interfaces beside it (``Drains``,
``Pauses``, ``Checkpoints``, ``Fenced``, ``Adopts``), read once into :class:`Capabilities`
when the controller starts. GPUs are named ``GPU(node, index)``; the controller decides which GPUs
each workload holds and the backend makes it so. Every call either does what it says or
raises: ``BackendUnavailable`` when the cluster cannot be reached (the controller then
stops acting and reports not ready) and ``BackendError`` when one action failed (the
controller records it and stops applying the rest of that plan).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from elastic.model import GPU, InferenceSpec, Layout, TrainingSpec, load_model
from elastic.phases import RUNTIME_PHASES, JobPhase

if TYPE_CHECKING:
    # types only, like checkpoint_through's import: the controller and the admin API import this
    # module and load nothing of the trainer (its launcher, rendezvous, prometheus_client)
    from elastic.train.launch import RescaleResult
    from elastic.train.rendezvous.messages import RescaleRecord


class BackendError(RuntimeError):
    """One action failed; the message says which and why."""


class GrowCancelled(BackendError):
    """A training grow was called off before its directive (``Backend.cancel_grow``): its
    joiners were dismissed, nothing moved, the job holds the GPUs it held before."""


class CheckpointNotSaved(BackendError):
    """A checkpoint asked for could not be written (a worker's write failed); the previous one stands."""


class BackendUnavailable(BackendError):
    """The cluster cannot be reached at all."""


@dataclass(frozen=True)
class JobRuntime:
    """What a training job reports about itself. Layouts are values: the coordinator's status carries
    them as such, and a backend parses what arrives as text (pod annotations) once, with :func:`layout_of`."""

    name: str
    phase: JobPhase
    layout: Layout | None
    gpus: tuple[GPU, ...]
    generation: int = 0
    step: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    error: str | None = None
    last_pause_seconds: float | None = None
    last_bytes_moved: int | None = None
    # the job recovered on its own from a lost worker into ``generation``: what was lost, and why
    recovery: str = ""
    recovered_from: Layout | None = None  # the layout before that recovery
    # the step its newest complete checkpoint continues at (-1: none yet); None: no checkpoints
    checkpoint_step: int | None = None
    # the current generation's worst rank's measured memory (``MeasuredMemory.as_json()``), as the
    # reference trainer measures it on a layout's first steps and every 100th; None: not measured
    # yet, or a job that does not measure (a user's training loop)
    memory: dict[str, Any] | None = None

    @property
    def recorded_layout(self) -> str | None:
        """The layout as text where it is stored or published (the reshard history, a job's status, a
        ``RescaleOutcome``): a paused job's with its ``paused:`` mark (:func:`paused_tag`); None when
        the job reports none. The one place a runtime's layout becomes text."""
        if self.layout is None:
            return None
        return paused_tag(self.layout) if self.phase == JobPhase.PAUSED else str(self.layout)


def paused_tag(held: Layout) -> str:
    """How the reshard history names a pause: the layout its keepers hold, marked ``paused:``."""
    return f"paused:{held}"


@dataclass(frozen=True)
class CheckpointOutcome:
    """A checkpoint asked of a running job (``checkpoint_job``)."""

    job: str
    previous_step: int  # the newest complete checkpoint's step when it was asked (-1: none)
    step: int | None  # the new one's step once every rank wrote it; None: asked, not waited for


def checkpoint_through(handle: Any, job: str, wait_seconds: float) -> CheckpointOutcome:
    """Ask a job's coordinator (through its ``JobHandle``) for a checkpoint at the next step that
    allows one; with ``wait_seconds`` > 0 wait until it is complete. SpecError (no checkpoint
    settings, job ended) and TimeoutError pass through; a failed write raises CheckpointNotSaved."""
    from elastic.train.rendezvous import CheckpointFailed

    if handle is None:
        raise BackendError(f"training job {job} is not running here; only a running job can save a checkpoint")
    ticket = handle.coordinator.request_checkpoint()
    try:
        step = handle.coordinator.wait_checkpoint(ticket, wait_seconds) if wait_seconds > 0 else None
    except CheckpointFailed as e:
        raise CheckpointNotSaved(str(e)) from None
    return CheckpointOutcome(job, int(ticket[0]), step)


def layout_of(text: str | None) -> Layout | None:
    """A layout as a backend reads it from text (a pod's annotation); None for none."""
    return Layout.parse(text) if text else None


def still_held(workers: dict[GPU, str], current: list[str]) -> dict[GPU, str]:
    """GPU -> worker, less the workers a job no longer has: after it recovered on its own from a lost
    worker, the dead one's GPU and those of survivors it did not keep are free (their processes ended)."""
    return {g: w for g, w in workers.items() if w in current}


def coordinator_runtime(job: str, st: Any, workers: dict[GPU, str], last: RescaleOutcome | None) -> JobRuntime:
    """A ``JobRuntime`` from the training coordinator's status ``st`` (``JobStatus``), for backends that
    run one: ``workers`` = the GPUs the backend gave the job (already less ``still_held``'s leftovers),
    ``last`` = its own record of the last rescale it asked for. The coordinator's record stands in
    when the backend has none (an adopted job) and for a recovery nobody asked for."""
    rec = st.last_rescale
    recovered = rec is not None and rec.ok and bool(rec.recovery) and rec.generation == st.generation
    if rec is not None and rec.ok and (last is None or recovered):
        last = RescaleOutcome.from_record(job, rec)
    gpus = tuple(sorted(workers, key=lambda g: (g.node, g.index)))
    return JobRuntime(job, RUNTIME_PHASES[st.phase], st.layout, gpus, st.generation, max(st.step, 0),
                      st.loss, st.tokens_per_second or 0.0, st.error,
                      last.pause_seconds if last else None, last.bytes_moved if last else None,
                      recovery=rec.recovery if recovered else "",
                      recovered_from=rec.from_layout if recovered else None,
                      checkpoint_step=getattr(st, "checkpoint_step", None), memory=getattr(st, "memory", None))


@dataclass(frozen=True)
class RescaleOutcome:
    """What one start/rescale/stop did, for the reshard history (layouts as values: a backend
    parses what its pods report as text, once)."""

    job: str
    from_layout: Layout | None
    to_layout: Layout | None
    generation: int
    pause_seconds: float = 0.0
    total_seconds: float = 0.0
    bytes_moved: int = 0
    bytes_planned: int = 0
    bytes_lower_bound: int = 0
    step: int = 0

    # One constructor per way a backend learns what happened, so the field-by-field mapping from the
    # trainer's reports is written once and a report's field cannot land in the wrong column.

    @classmethod
    def from_result(cls, job: str, from_layout: Layout | None, res: RescaleResult,
                    to_layout: Layout | None = None) -> RescaleOutcome:
        """A start, rescale or pause the backend asked of the job's ``JobHandle``, from its report.
        ``from_layout``: the layout the backend saw before it asked (None for a start);
        ``to_layout``: the layout asked for, else the one ``res`` names. A pause the coordinator did
        not measure (``pause_seconds`` None) counts as none."""
        return cls(job, from_layout, to_layout if to_layout is not None else res.to_layout,
                   res.generation, pause_seconds=res.pause_seconds or 0.0, total_seconds=res.wall_seconds,
                   bytes_moved=res.bytes_moved, bytes_planned=res.planned_bytes,
                   bytes_lower_bound=res.lower_bound_bytes, step=res.switch_step)

    @classmethod
    def from_record(cls, job: str, rec: RescaleRecord) -> RescaleOutcome:
        """A rescale as the job's coordinator recorded it (``JobStatus.last_rescale``): one the backend
        did not ask for itself (a recovery, an adopted job's last). The record has no wall time of the
        whole call, so ``total_seconds`` stays 0."""
        return cls(job, rec.from_layout, rec.to_layout, rec.generation,
                   pause_seconds=rec.pause_seconds or 0.0, bytes_moved=rec.bytes_moved,
                   bytes_planned=rec.planned_bytes, bytes_lower_bound=rec.lower_bound_bytes,
                   step=rec.switch_step)

    @classmethod
    def started(cls, job: str, layout: Layout, res: RescaleResult) -> RescaleOutcome:
        """A job's first layout: no training paused, no state moved between layouts; the time is the
        whole start (the workers' start-up to the first step)."""
        return cls(job, None, layout, res.generation, total_seconds=res.wall_seconds, step=res.switch_step)

    @classmethod
    def not_running(cls, job: str) -> RescaleOutcome:
        """Asked to pause or stop a job that does not run here: nothing happened."""
        return cls(job, None, None, 0)

    @classmethod
    def still_paused(cls, job: str, held: Layout | None, generation: int, step: int) -> RescaleOutcome:
        """Asked to pause a job that is paused already: it stays held on ``held``, at ``step``."""
        return cls(job, held, held, generation, step=max(step, 0))

    @classmethod
    def stopped(cls, job: str, layout: Layout | None, generation: int, step: int = 0,
                total_seconds: float = 0.0) -> RescaleOutcome:
        """A job stopped from ``layout`` (None: it reported none) in ``generation``, at ``step``; a
        coordinator's step is -1 before the first, recorded as 0."""
        return cls(job, layout, None, generation, total_seconds=total_seconds, step=max(step, 0))


@runtime_checkable
class Backend(Protocol):
    name: str

    def ping(self) -> None:
        """Raise BackendUnavailable when the cluster cannot be reached."""

    def inventory(self) -> dict[str, int]:
        """Node name -> GPUs the pool may use."""

    def service_gpus(self, service: str) -> tuple[GPU, ...]:
        """GPUs held by the service's replicas (ready or starting)."""

    def ready_replicas(self, service: str) -> int:
        """Replicas that serve traffic now."""

    def service_targets(self, service: str) -> list[str]:
        """Base URLs of the ready replicas (for a direct /metrics scrape)."""

    def set_service_gpus(self, spec: InferenceSpec, gpus: tuple[GPU, ...]) -> None:
        """Run exactly one replica per ``spec.gpus_per_replica`` of ``gpus``: start the missing,
        drain and stop the extra. Returns once removed replicas released their GPUs."""

    def job_runtime(self, job: str) -> JobRuntime | None:
        """The job's state, or None if it is not running."""

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        """Start, rescale in place, or stop (``gpus == ()``) a training job. Returns once the
        new layout has run its first step (or the job has released its GPUs)."""

    def cancel_grow(self, job: str) -> bool:
        """Call off a ``set_job_gpus`` grow of ``job`` running in another thread if its joiners
        have not joined yet (no directive posted); that call then raises GrowCancelled. True
        if called off, False if there is nothing to call off (it then runs to its end)."""


# ---- optional capabilities ------------------------------------------------------------------------


@runtime_checkable
class Drains(Protocol):
    """Takes replicas out of the load balancer ahead of a scale-down the policy sees coming
    (``drain_ahead_seconds``). Without it a replica drains only once it is removed."""

    def drain_ahead(self, service: str, gpus: Sequence[GPU], hold_seconds: float) -> list[str]:
        """Take the replicas on ``gpus`` out of the balancer; returns their URLs. They keep their
        GPUs, still count in ``service_gpus`` and in ``metric_targets`` (the metric's scrape
        targets, when they differ from ``service_targets``), and go back into the balancer when
        not asked again within ``hold_seconds``."""


@runtime_checkable
class Pauses(Protocol):
    """Pauses a job into keepers. Without it a job that must go below its minimum can only be
    preempted (stopped), and the controller says so."""

    def pause_job(self, spec: TrainingSpec) -> RescaleOutcome:
        """Free every GPU of a running job and keep its state off-GPU (phase ``Paused``, no GPUs,
        ``layout`` = what the keepers hold); a later ``set_job_gpus`` with GPUs resumes it at the
        same step."""


@runtime_checkable
class Checkpoints(Protocol):
    """Saves a running job's state when asked (the admin API's checkpoint)."""

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> CheckpointOutcome:
        """A checkpoint at the job's next step boundary (see :func:`checkpoint_through`)."""


@runtime_checkable
class Fenced(Protocol):
    """Checks the controller's lease inside long actions. The controller sets ``fence`` to a
    callable that raises ``elastic.store.LeaseLost`` once its lease is no longer its own; the
    backend calls it right before each irreversible change inside a long action (posting a
    directive, patching a Deployment), so a leader stalled mid-action and taken over meanwhile
    changes nothing more."""

    fence: Callable[[], None] | None


@runtime_checkable
class Adopts(Protocol):
    """Re-attaches to workloads a previous controller left running. The controller calls ``adopt``
    once, in its recovery, before it reads any job's runtime; it returns what was found, as notes."""

    def adopt(self) -> list[str]: ...


@dataclass(frozen=True)
class Capabilities:
    """Which optional capabilities a backend has, read once when the controller starts."""

    drains: bool = False
    pauses: bool = False
    checkpoints: bool = False
    fenced: bool = False
    adopts: bool = False

    @classmethod
    def of(cls, backend: Any) -> Capabilities:
        return cls(drains=isinstance(backend, Drains), pauses=isinstance(backend, Pauses),
                   checkpoints=isinstance(backend, Checkpoints), fenced=isinstance(backend, Fenced),
                   adopts=isinstance(backend, Adopts))

    def names(self) -> list[str]:
        """The capabilities present, by interface name (for a log line)."""
        return [n for n, on in (("Drains", self.drains), ("Pauses", self.pauses), ("Checkpoints", self.checkpoints),
                                ("Fenced", self.fenced), ("Adopts", self.adopts)) if on]


def default_trainer_config(spec: TrainingSpec) -> Any:
    """A job spec's trainer config: the user's code (``UserJobConfig``) for a spec with an
    ``entrypoint``, else the reference trainer's: its micro-batches, precision (fp32 when it names
    none) and memory limit."""
    if spec.entrypoint is not None:
        from elastic.train.userjob import from_spec

        return from_spec(spec)
    from elastic.train.engine import TrainConfig, precision_dtype

    return TrainConfig(model=load_model(spec.model), global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                       micro_batch_cap=spec.micro_batch_cap, dtype=precision_dtype(spec.precision),
                       memory_limit_bytes=spec.memory_limit_bytes)
