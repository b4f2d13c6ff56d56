"""What crosses the wire between the coordinator, its workers and the launcher: directives,
step and rescale records, the job's status, and the errors a caller sees."""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from elastic.layout import Layout

API = "/v1"
SECRET_ENV = "ELASTIC_JOB_SECRET"
"""The environment variable that hands a job's secret to its workers."""
LONG_POLL_MAX_S = 5.0
"""Longest a long-polling request (``wait_s``) is held; well under the client's HTTP timeout."""


class RendezvousError(RuntimeError):
    """The coordinator could not be reached or answered with an error."""


class RescaleFailed(RuntimeError):
    """A rescale was abandoned (job continues on its old layout) or failed (job failed)."""

    def __init__(self, message: str, record: RescaleRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class RescaleCancelled(RescaleFailed):
    """A rescale was called off before its directive (``JobHandle.cancel_pending``): its
    joiners were dismissed, nothing moved, the job continues on its old layout."""


class JobFailed(RuntimeError):
    """The training job failed; ``str(e)`` carries the reason."""


# --------------------------------------------------------------------------------------------
# Wire types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Directive:
    """Generation ``generation`` trains ``layout`` on ``workers`` from ``switch_step`` on.

    ``remap=False``: new ranks follow the order of ``workers``; ``remap=True``: the reshard
    planner chooses the rank map (it keeps the most bytes local). ``old_ranks`` is the rank
    map of the generation being replaced (empty for the first one).
    """

    job: str
    generation: int
    layout: Layout
    workers: tuple[str, ...]
    remap: bool
    old_layout: Layout | None
    old_ranks: dict[str, int]
    switch_step: int
    store_host: str
    store_port: int
    join_timeout_s: float
    hold: bool = False  # a paused generation: its workers keep the state and run no step
    commit_step: int | None = None  # recovery: survivors first apply this step if they hold it ready
    # a transactional rescale: members keep their old state untouched (no recycling of dropped
    # shards) until every member has exchanged its part, and report ``exchanged`` before they
    # build the new layout; a member lost before that rolls the job back to the old generation,
    # which then recovers from its survivors (set when the old layout is recoverable)
    rollback: bool = False
    # a start (no old generation) from a checkpoint: its path; ``switch_step`` is its step and every
    # worker reads its boxes out of it (elastic.train.checkpoint) instead of initialising them
    resume: str | None = None
    resume_layout: str | None = None
    # every engine of this generation checks before each micro-batch whether a shrink asks for the
    # step in progress (TrainEngine.give_up_checks): a property of the generation, so its ranks all
    # run the check's collective or none does (the coordinator's shrink_gives_up_step when posted)
    give_up_checks: bool = False

    @property
    def members(self) -> tuple[str, ...]:
        """Everyone who takes part in the transition: old union new, sorted."""
        return tuple(sorted(set(self.old_ranks) | set(self.workers)))

    @property
    def leavers(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.old_ranks) - set(self.workers)))

    @property
    def joiners(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.workers) - set(self.old_ranks)))

    def __post_init__(self) -> None:
        _check_layouts(self, "layout", optional=("old_layout",))

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(layout=str(self.layout), old_layout=str(self.old_layout) if self.old_layout else None,
                 workers=list(self.workers), old_ranks=dict(self.old_ranks))
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Directive:
        d = dict(d)
        d["layout"] = Layout.parse(d["layout"])
        d["old_layout"] = Layout.parse(d["old_layout"]) if d.get("old_layout") else None
        d["workers"] = tuple(d["workers"])
        d["old_ranks"] = {str(k): int(v) for k, v in d["old_ranks"].items()}
        return cls(**d)


@dataclass
class StepRecord:
    """One finished step of the whole job (aggregated over the generation's workers)."""

    step: int
    generation: int
    layout: Layout
    loss: float | None
    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        _check_layouts(self, "layout")

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "layout": str(self.layout)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepRecord:
        kw = _known(cls, d)
        kw["layout"] = _layout_in(cls, "layout", kw["layout"])
        return cls(**kw)


class CheckpointFailed(RuntimeError):
    """A checkpoint asked for could not be written (a rank's write failed); nothing else changed."""


@dataclass
class RescaleRecord:
    """One directive's fate. ``ok`` is None while it is in progress."""

    generation: int
    from_layout: Layout | None
    to_layout: Layout
    workers: list[str]
    joiners: list[str]
    leavers: list[str]
    switch_step: int
    ok: bool | None = None
    reason: str = ""
    pause_seconds: float | None = None
    bytes_moved: int = 0
    planned_bytes: int = 0
    lower_bound_bytes: int = 0
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0
    new_ranks: dict[str, int] = field(default_factory=dict)
    worker_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    hold: bool = False  # the job was paused by this directive (pause_seconds: until the state was held)
    recovery: str = ""  # a recovery directive: which workers were lost and why
    # a shrink that gave the step in progress up (shrink_gives_up_step): that step, and how long
    # the members had computed on it (the longest; counted in pause_seconds: work thrown away)
    gave_up_step: int | None = None
    gave_up_seconds: float = 0.0
    # of the given-up step, the micro-batches per replica whose work the new layout kept and
    # finished from (0: none, the step was redone whole and gave_up_seconds were thrown away)
    kept_micro_batches: int = 0

    def __post_init__(self) -> None:
        _check_layouts(self, "to_layout", optional=("from_layout",))

    def copy(self) -> RescaleRecord:
        """A copy that shares nothing mutable with this record (a coordinator keeps filling its own)."""
        return deepcopy(self)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "from_layout": _layout_out(self.from_layout), "to_layout": str(self.to_layout)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RescaleRecord:
        kw = _known(cls, d)
        kw["from_layout"] = _layout_in(cls, "from_layout", kw["from_layout"], optional=True)
        kw["to_layout"] = _layout_in(cls, "to_layout", kw["to_layout"])
        return cls(**kw)


@dataclass
class JobStatus:
    job: str
    phase: str  # starting | running | rescaling | paused | recovering | failed | stopping | stopped | finished
    generation: int
    layout: Layout | None
    workers: list[str]  # current generation's workers in rank order
    step: int  # last completed step, -1 before the first
    loss: float | None
    tokens_per_second: float | None
    step_seconds: float | None
    error: str | None
    last_rescale: RescaleRecord | None
    reason: str = ""  # the last notable event (e.g. why a rescale was abandoned)
    failures: list[str] = field(default_factory=list)  # every failure report, first one = error
    checkpoint_step: int | None = None  # the newest complete checkpoint's step (-1: none yet; None: off)
    # the current generation's worst rank's measured memory (``MeasuredMemory.as_json()``: bytes by
    # component, ``device_peak`` on a GPU); None until a step of it was measured, or for a user job
    memory: dict[str, Any] | None = None
    # a step ran out of memory and the job waits (phase recovering) for a directive onto a layout that
    # fits: the failing worker's report (layout, rank, step, error, the memory it held); None otherwise
    out_of_memory: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_layouts(self, optional=("layout",))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "layout": _layout_out(self.layout),
                "last_rescale": self.last_rescale.to_json() if self.last_rescale is not None else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobStatus:
        kw = _known(cls, d)
        kw["layout"] = _layout_in(cls, "layout", kw["layout"], optional=True)
        if kw.get("last_rescale") is not None:
            kw["last_rescale"] = RescaleRecord.from_json(kw["last_rescale"])
        return cls(**kw)


# one type per concept: a layout is a Layout in Python, text only on the wire (to_json / from_json)


def _check_layouts(obj: Any, *required: str, optional: tuple[str, ...] = ()) -> None:
    """TypeError naming the field and the fix when a layout field of ``obj`` is not a ``Layout``
    (``optional`` ones may be None): text handed in where a value belongs would slip back to text."""
    for name in (*required, *optional):
        value = getattr(obj, name)
        if not (isinstance(value, Layout) or (value is None and name in optional)):
            raise TypeError(f"{type(obj).__name__}.{name}: a Layout (Layout.parse the text), got "
                            f"{type(value).__name__} {value!r}")


def _layout_out(layout: Layout | None) -> str | None:
    return str(layout) if layout is not None else None


def _layout_in(cls: type, name: str, text: Any, optional: bool = False) -> Layout | None:
    """A layout field as it arrives on the wire (text; None or empty for none where ``optional``)."""
    if optional and not text:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{cls.__name__}.{name}: expected a layout's text (e.g. 'tp2.pp1.dp2'), got {text!r}")
    return Layout.parse(text)


def _known(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    """``d``'s fields of ``cls``; a key it does not know is left out (a coordinator of a newer
    release may say more), a field it needs and is missing raises ValueError naming it."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    names = {f.name: f for f in fields(cls)}
    need = sorted(n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING)
    if missing := [n for n in need if n not in d]:
        raise ValueError(f"{cls.__name__}: missing field(s) {', '.join(missing)}")
    return {k: v for k, v in d.items() if k in names}
