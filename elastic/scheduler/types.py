"""Input and output types of the co-scheduler (all frozen, all validated on construction).

What goes in (:class:`Snapshot`): the pool, what inference wants (replica counts that the
replica policy already decided), the training jobs with their throughput tables, the previous
allocation, the knobs and ``now``. What comes out (:class:`SchedulePlan`): the new
:class:`elastic.model.Allocation`, the ordered :class:`elastic.model.PlanStep` list, and one
decision record per service and per job. ``SchedulePlan.to_plan()`` gives the plain
:class:`elastic.model.Plan` other layers store.

This module must not compute anything: no placement, no policy. It never reads a clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from elastic.layout import Layout
from elastic.model import GPU, Allocation, Plan, PlanStep, PoolSpec, SpecError


class Reason(StrEnum):
    """Machine-readable reason codes carried by every step and decision."""

    INFERENCE_DEMAND = "InferenceDemand"  # inference needs GPUs: scale up, shrink training
    LOAD_FALL = "LoadFall"  # inference needs fewer replicas: drain and scale down
    SPARE_CAPACITY = "SpareCapacity"  # free GPUs go to training (grow, start, resume)
    BELOW_MINIMUM = "BelowMinimum"  # a job would drop under min_gpus: paused or preempted
    HYSTERESIS = "Hysteresis"  # a rescale was held back (interval, gain threshold, or no payback before reclaim)
    NO_FEASIBLE_LAYOUT = "NoFeasibleLayout"  # GPUs no valid layout can use stay idle/headroom
    POOL_EXHAUSTED = "PoolExhausted"  # inference demand exceeds what the pool can place
    STEADY = "Steady"  # nothing to change


JobStatus = Literal["running", "paused", "preempted", "pending"]


@dataclass(frozen=True)
class ServiceDemand:
    """One inference service as the co-scheduler sees it: the replica policy's answer plus shape.

    ``replicas`` is the desired count (the policy already applied tolerance, bounds and
    stabilisation); ``min_replicas`` is never violated while the pool can place it.
    A replica of ``gpus_per_replica <= gpus_per_node`` lives on one node; a larger replica
    needs a multiple of ``gpus_per_node`` and takes whole nodes. ``outlook`` is what the
    service's forecast expects later: ``(seconds from now, replicas)``, ascending; it only
    decides whether lending GPUs to training pays (empty: no forecast, lending always may).
    """

    name: str
    replicas: int
    gpus_per_replica: int = 1
    priority: int = 100
    min_replicas: int = 0
    outlook: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("service: name is empty")
        if self.replicas < 0 or self.min_replicas < 0:
            raise SpecError(f"service '{self.name}': replicas={self.replicas}, min_replicas={self.min_replicas} must be >= 0")
        if self.gpus_per_replica < 1:
            raise SpecError(f"service '{self.name}': gpus_per_replica={self.gpus_per_replica} must be >= 1")
        offsets = [t for t, _ in self.outlook]
        if any(t <= 0 for t in offsets) or offsets != sorted(set(offsets)) or any(n < 0 for _, n in self.outlook):
            raise SpecError(f"service '{self.name}': outlook {self.outlook!r} must be (seconds > 0, replicas >= 0) "
                            "pairs in ascending time")

    @property
    def wanted(self) -> int:
        return max(self.replicas, self.min_replicas)


#: GPU count -> (the best feasible layout at that count, its tokens/s)
ThroughputTable = Mapping[int, tuple[Layout, float]]


@dataclass(frozen=True)
class JobState:
    """One training job: bounds, priority, its throughput table and its rescale history.

    ``throughput`` maps a GPU count to ``(layout, tokens_per_second)`` of the best feasible
    layout at that count (built by the caller, e.g. with the planner's ``best_by_gpu_count``);
    every layout here, and ``layout`` (what the job runs now), is a :class:`Layout`: text is
    parsed where it enters (the store, the wire, the CLI), never here. Counts missing from the
    table have no valid layout. The job's current GPUs are read from the snapshot's previous
    allocation. ``on_below_minimum`` says what happens when inference
    needs GPUs the job cannot spare: ``pause`` (state kept off-GPU, resumes later) or
    ``preempt`` (stopped; state dropped, starts again from step 0). ``pause_seconds`` is how
    long one rescale stops the job (measured on its last rescales, or modelled): a grow must
    earn it back, and the pause of giving the GPUs back, before inference needs them again
    (0: not known, every grow pays).
    """

    name: str
    throughput: ThroughputTable
    min_gpus: int = 1
    max_gpus: int = 1 << 30
    priority: int = 0
    layout: Layout | None = None
    last_rescale_at: float | None = None
    status: JobStatus = "running"
    on_below_minimum: Literal["pause", "preempt"] = "pause"
    pause_seconds: float = 0.0
    _counts: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("job: name is empty")
        if self.min_gpus < 1 or self.max_gpus < self.min_gpus:
            raise SpecError(
                f"job '{self.name}': need 1 <= min_gpus <= max_gpus, got min_gpus={self.min_gpus}, max_gpus={self.max_gpus}"
            )
        if not self.pause_seconds >= 0:
            raise SpecError(f"job '{self.name}': pause_seconds={self.pause_seconds} must be >= 0")
        for n, entry in self.throughput.items():
            if not isinstance(n, int) or n < 1:
                raise SpecError(f"job '{self.name}': throughput table key {n!r} must be a GPU count >= 1")
            if len(entry) != 2 or entry[1] < 0:
                raise SpecError(f"job '{self.name}': throughput[{n}]={entry!r} must be (layout, tokens_per_second >= 0)")
            if not isinstance(entry[0], Layout):
                raise SpecError(f"job '{self.name}': throughput[{n}] layout {entry[0]!r} is a "
                                f"{type(entry[0]).__name__}, not a Layout; parse layout text once, where it "
                                "enters (the store, the wire, the CLI), and pass the Layout")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise SpecError(f"job '{self.name}': layout {self.layout!r} is a {type(self.layout).__name__}, "
                            "not a Layout; parse layout text once, where it enters (the store, the wire, the "
                            "CLI), and pass the Layout")
        counts = sorted(n for n, (_, tps) in self.throughput.items() if self.min_gpus <= n <= self.max_gpus and tps > 0)
        object.__setattr__(self, "_counts", tuple(counts))

    def feasible_counts(self) -> tuple[int, ...]:
        """GPU counts in [min_gpus, max_gpus] with a layout that makes progress, ascending."""
        return self._counts

    def tps(self, gpus: int) -> float:
        return self.throughput[gpus][1] if gpus in self.throughput else 0.0

    def layout_at(self, gpus: int) -> Layout | None:
        return self.throughput[gpus][0] if gpus in self.throughput else None


def below_minimum_note(status: str) -> str:
    """What pausing or preempting does to a job's state, for the step's message."""
    if status == "paused":
        return " (its state is kept off-GPU; it resumes at the same step when GPUs are free)"
    return " (stopped, its state dropped: it starts again from step 0)"


@dataclass(frozen=True)
class Knobs:
    """Co-scheduler settings (see :class:`elastic.model.PoolSpec` for the user-facing names)."""

    rescale_interval_seconds: float = 60.0
    gain_threshold: float = 0.1
    headroom_gpus: int = 0

    def __post_init__(self) -> None:
        if self.rescale_interval_seconds < 0 or self.gain_threshold < 0 or self.headroom_gpus < 0:
            raise SpecError(f"scheduler knobs must be >= 0, got {self}")

    @classmethod
    def from_pool(cls, pool: PoolSpec) -> Knobs:
        return cls(pool.rescale_interval_seconds, pool.gain_threshold, pool.headroom_gpus)


@dataclass(frozen=True)
class Snapshot:
    """Everything one decision sees. ``nodes`` maps node name -> GPU count."""

    now: float
    nodes: Mapping[str, int]
    services: tuple[ServiceDemand, ...] = ()
    jobs: tuple[JobState, ...] = ()
    previous: Allocation = field(default_factory=lambda: Allocation({}))
    knobs: Knobs = field(default_factory=Knobs)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError("snapshot: the pool has no nodes")
        for node, count in self.nodes.items():
            if count < 1:
                raise SpecError(f"snapshot: node '{node}' has {count} GPUs; every node needs >= 1")
        names = Counter([s.name for s in self.services] + [j.name for j in self.jobs])
        dup = sorted(n for n, k in names.items() if k > 1)
        if dup:
            raise SpecError(f"snapshot: workload names must be unique across services and jobs, repeated: {dup}")

    @property
    def total_gpus(self) -> int:
        return sum(self.nodes.values())


@dataclass(frozen=True)
class StepTarget:
    """What one step changes: counts, layouts (training) and the exact GPUs added/removed."""

    gpus_before: int
    gpus_after: int
    added: tuple[GPU, ...] = ()
    removed: tuple[GPU, ...] = ()
    layout_before: Layout | None = None
    layout_after: Layout | None = None
    replicas_before: int | None = None
    replicas_after: int | None = None
    after_drain: bool = False  # an inference scale-up that waits for a drain earlier in the plan


@dataclass(frozen=True)
class ServiceDecision:
    name: str
    demand_replicas: int
    replicas: int
    gpus: int
    reason: str
    message: str


@dataclass(frozen=True)
class JobDecision:
    name: str
    gpus_before: int
    gpus: int
    layout: Layout | None
    tokens_per_second: float
    status: JobStatus
    reason: str
    message: str

    @property
    def rescaled(self) -> bool:
        return self.gpus != self.gpus_before


@dataclass(frozen=True)
class SchedulePlan:
    """The co-scheduler's answer: a new allocation, ordered steps and one record per workload.

    Step order is the execution order: shrink/pause training, scale inference up, drain
    inference down (then any scale-up that waits for a drain), grow training.
    """

    now: float
    allocation: Allocation
    steps: tuple[PlanStep, ...]
    services: Mapping[str, ServiceDecision]
    jobs: Mapping[str, JobDecision]
    idle_gpus: int
    reason: str
    message: str

    def to_plan(self) -> Plan:
        return Plan(allocation=self.allocation, steps=self.steps, reason=self.reason, message=self.message)

    def gpus_of(self, workload: str) -> int:
        return len(self.allocation.gpus_of(workload))
