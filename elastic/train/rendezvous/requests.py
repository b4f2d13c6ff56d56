"""The requests a job's workers send its coordinator, one frozen dataclass per route, read once at the wire.

What it is for: every ``/v1/<route>`` body is parsed here into its request type (:func:`parse`)
before the coordinator sees it, so a handler reads ``m.generation`` (an ``int``) instead of
``int(b["generation"])``, and a malformed body is refused at the edge with the route, the field
and what was expected (:class:`BadRequest`, an HTTP 400) instead of failing inside a handler.
``to_wire()`` gives back the JSON object a client sends; field names are the wire's names.

A field's type says how it is read: ``int`` (a JSON integer, not a boolean), ``float`` (any JSON
number; finite but for a loss), ``bool``, ``str``, ``Mapping[str, Any]`` (a JSON object, kept as a
dict: what the coordinator passes on or stores as is; ``Mapping[str, int]``: of integers),
``tuple[int, int]`` (a list of two integers), a nested part (:class:`StepReport`, :class:`GaveUp`,
:class:`PlanInfo`, :class:`SeenCheckpoint`). ``X | None`` also takes null. A field with a default
may be absent; a null one that takes no null gets its default too (a client sends null for what it
has none of). Fields a request does not name are ignored: a newer worker still talks to an older
coordinator.

What it must not do: any I/O, or import anything but the standard library and the error and wire
constants below it (the requests are pure values; the coordinator and the HTTP server import them).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from elastic.errors import _clip
from elastic.train.rendezvous.messages import API

_MISSING = object()


class BadRequest(ValueError):
    """A request the coordinator cannot read: ``route``, ``field`` (dotted into a nested part; None
    when the body or the route itself is wrong) and what was expected are in the message."""

    def __init__(self, route: str, field: str | None, problem: str) -> None:
        super().__init__(f'{route}: "{field}" {problem}' if field is not None else f"{route}: {problem}")
        self.route, self.field = route, field


def _expected(hint: Any, finite: bool = True) -> str:
    """What a value of type ``hint`` looks like on the wire, for an error message."""
    args = typing.get_args(hint)
    if _is_optional(hint):
        return f"{_expected(_strip_none(hint), finite)} or null"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a finite number" if finite else "a number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) is tuple:
        return f"a list of {len(args)} {_plural(args[0])}"
    if typing.get_origin(hint) is Mapping and args[1] is not Any:
        return f"a JSON object of {_plural(args[1])}"
    return "a JSON object"  # a Mapping or a nested part


def _plural(hint: Any) -> str:
    return _expected(hint).removeprefix("an ").removeprefix("a ") + "s"


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _strip_none(hint: Any) -> Any:
    rest = [a for a in typing.get_args(hint) if a is not type(None)]
    assert len(rest) == 1, f"one type besides None expected: {hint}"
    return rest[0]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Message:
    """A JSON object with typed fields; :meth:`_read` checks and converts each one."""

    # fields whose float may be NaN or infinite (a loss); every other float must be finite
    _non_finite: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def _read(cls, body: object, route: str, at: str = "") -> Self:
        """``body`` as this type; ``at``: the dotted path of a nested part ("" at the top)."""
        if not isinstance(body, Mapping):  # (a nested part's is refused by _value, naming its field)
            raise BadRequest(route, None, f"the body must be a JSON object, got {type(body).__name__}")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            hint, value = hints[f.name], body.get(f.name, _MISSING)
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if value is _MISSING or (value is None and not _is_optional(hint) and has_default):
                if not has_default:
                    raise BadRequest(route, at + f.name, f"is required: {_expected(hint)}")
                continue
            values[f.name] = cls._value(route, at + f.name, hint, value, f.name in cls._non_finite)
        return cls(**values)

    @staticmethod
    def _value(route: str, where: str, hint: Any, value: Any, non_finite: bool = False) -> Any:
        """``value`` read as ``hint``, or BadRequest naming ``where``."""
        wanted = hint  # "or null" in the message where null would do
        if _is_optional(hint):
            if value is None:
                return None
            hint = _strip_none(hint)
        part = isinstance(hint, type) and issubclass(hint, _Message)
        if part and isinstance(value, Mapping):
            return hint._read(value, route, f"{where}.")
        if isinstance(hint, type) and hasattr(hint, "from_json"):  # a wire type of its own (a Directive)
            if not isinstance(value, Mapping):
                raise BadRequest(route, where, f"must be a JSON object, got {_clip(repr(value))}")
            try:
                return hint.from_json(dict(value))
            except (KeyError, TypeError, ValueError) as e:
                raise BadRequest(
                    route, where, f"does not read as a {hint.__name__}: {_clip(str(e))}"
                ) from None
        origin = typing.get_origin(hint)
        ok = not part and (
            (hint is int and isinstance(value, int) and not isinstance(value, bool))
            or (hint is float and _number(value) and (non_finite or math.isfinite(value)))
            or (hint is bool and isinstance(value, bool))
            or (hint is str and isinstance(value, str))
            or (origin is Mapping and isinstance(value, Mapping))
            or (
                origin is tuple
                and isinstance(value, list | tuple)
                and len(value) == len(typing.get_args(hint))
            )
        )
        if not ok:
            raise BadRequest(
                route, where, f"must be {_expected(wanted, not non_finite)}, got {_clip(repr(value))}"
            )
        if hint is float:
            return float(value)
        if origin is Mapping:
            of = typing.get_args(hint)[1]
            return {
                k: v if of is Any else _Message._value(route, f"{where}.{k}", of, v) for k, v in value.items()
            }
        if origin is tuple:
            return tuple(
                _Message._value(route, f"{where}[{i}]", t, v)
                for i, (t, v) in enumerate(zip(typing.get_args(hint), value, strict=True))
            )
        return value

    def to_wire(self) -> dict[str, Any]:
        """The JSON object for this message (what a client sends)."""
        return {f.name: _wire(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _wire(value: Any) -> Any:
    if isinstance(value, _Message):
        return value.to_wire()
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, evaluated once (the annotations are strings until then)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


# ---- nested parts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part(_Message):
    """A JSON object inside a request's body."""

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], route: str = "") -> Self:
        """Read one alone (``route``: the request's, for the message; else this type's name)."""
        return cls._read(body, route or cls.__name__)


@dataclass(frozen=True)
class StepReport(_Part):
    """A worker's result of the step it finished, sent with its next ``step`` request (aggregated
    over the generation's ranks into the job's history). ``checkpoint``: its last complete
    checkpoint write (step, generation); ``checkpoint_error``: why its last write failed;
    ``memory``: the step's measured memory (``MeasuredMemory.as_json()``), read where it is kept."""

    _non_finite: ClassVar[frozenset[str]] = frozenset({"loss"})

    step: int
    loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    checkpoint: tuple[int, int] | None = None
    checkpoint_error: str = ""
    memory: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PlanInfo(_Part):
    """A member's reshard plan, as it arrives: the rank map it chose (``new_ranks``, empty: the
    directive's order), the bytes it moves and their lower bound, and how long planning took."""

    new_ranks: Mapping[str, int] = field(default_factory=dict)
    planned_bytes: int = 0
    lower_bound_bytes: int = 0
    plan_seconds: float = 0.0


@dataclass(frozen=True)
class SeenCheckpoint(_Part):
    """The newest complete checkpoint a worker sees (``CheckpointRef.to_json()``)."""

    path: str
    step: int
    layout: str


@dataclass(frozen=True)
class GaveUp(_Part):
    """Every rank gave ``step`` up for a pending rescale, at micro-batch ``micro``, after ``seconds``
    in it; ``kept``: this worker keeps the work done (the new layout may finish the step from it)."""

    step: int
    seconds: float = 0.0
    micro: int = 0
    kept: bool = False


# ---- requests, one per route -----------------------------------------------------------------


@dataclass(frozen=True)
class Request(_Message):
    """A request to the coordinator's route ``route`` (``/v1/<route>``)."""

    route: ClassVar[str]

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Self:
        """Read a body of this route; BadRequest names the route and the field."""
        return cls._read(body, cls.route)


@dataclass(frozen=True)
class Register(Request):
    """A worker process starts. ``checkpoint_latest``: the newest complete checkpoint it sees
    (``CheckpointRef.to_json()``), for a coordinator that cannot see the directory itself."""

    route: ClassVar[str] = "register"
    worker: str
    checkpoint_latest: SeenCheckpoint | None = None
    pid: int | None = None
    host: str | None = None


@dataclass(frozen=True)
class Heartbeat(Request):
    """A liveness beat; with ``generation`` and ``wait_s`` a long poll for an interrupt, a give-up,
    an abort of the groups of ``building``, or the directive posted since ``seen``."""

    route: ClassVar[str] = "heartbeat"
    worker: str
    generation: int | None = None
    building: int | None = None
    wait_s: float = 0.0
    seen: int | None = None


@dataclass(frozen=True)
class Poll(Request):
    """A worker without a generation asks whether a directive includes it (``wait_s``: long poll)."""

    route: ClassVar[str] = "poll"
    worker: str
    wait_s: float = 0.0


@dataclass(frozen=True)
class Step(Request):
    """Before step ``step`` of ``generation``, with the last step's ``result`` and, after giving a
    step up for a rescale, ``gave_up``; ``wait_s``: long poll while it holds or waits to recover."""

    route: ClassVar[str] = "step"
    worker: str
    generation: int
    step: int
    result: StepReport | None = None
    wait_s: float = 0.0
    gave_up: GaveUp | None = None


@dataclass(frozen=True)
class Arrive(Request):
    """A member is at the meeting point of ``generation`` with its plan's ``digest`` and ``plan``, or
    the ``error`` that kept it from preparing."""

    route: ClassVar[str] = "arrive"
    worker: str
    generation: int
    digest: str = ""
    plan: PlanInfo = field(default_factory=PlanInfo)
    error: str | None = None
    wait_s: float = 0.0


@dataclass(frozen=True)
class Result(Request):
    """A member finished (``ok``) or failed (``error``) its part of the rescale to ``generation``;
    ``stats``: what it measured; ``checkpoint``: its last complete write (step, generation)."""

    route: ClassVar[str] = "result"
    worker: str
    generation: int
    ok: bool = False
    error: str | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)
    checkpoint: tuple[int, int] | None = None


@dataclass(frozen=True)
class Exchanged(Request):
    """A member of a transactional rescale moved its part of the bytes (``wait_s``: long poll)."""

    route: ClassVar[str] = "exchanged"
    worker: str
    generation: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class Fail(Request):
    """A worker failed and exits."""

    route: ClassVar[str] = "fail"
    worker: str
    reason: str = "no reason given"


@dataclass(frozen=True)
class Broken(Request):
    """A worker's collective broke at ``step``, or it was told to break: what it holds (``applied``,
    ``ready``, ``dirty``, ``local_apply``), why (``error``), and with ``out_of_memory`` the report of
    a step that ran out of memory (layout, rank, step, error, memory)."""

    route: ClassVar[str] = "broken"
    worker: str
    generation: int
    step: int
    applied: int
    ready: int | None = None
    dirty: bool = False
    local_apply: bool = False
    error: str | None = None
    out_of_memory: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Exit(Request):
    """A worker exits on purpose."""

    route: ClassVar[str] = "exit"
    worker: str


@dataclass(frozen=True)
class Status(Request):
    """The job's status (``GET /v1/status`` sends no worker)."""

    route: ClassVar[str] = "status"
    worker: str | None = None


REQUESTS: dict[str, type[Request]] = {
    r.route: r
    for r in (Register, Heartbeat, Poll, Step, Arrive, Result, Exchanged, Fail, Broken, Exit, Status)
}
"""Route name -> its request type."""


def parse(route: str, body: Mapping[str, Any]) -> Request:
    """``body`` read as a request to ``route``: its name (``step``) or its path (``/v1/step``).
    BadRequest for an unknown route or a malformed body."""
    kind = REQUESTS.get(route.removeprefix(f"{API}/"))
    if kind is None:
        raise BadRequest(_clip(route), None, f"no such route (the routes are {', '.join(REQUESTS)})")
    return kind.from_wire(body)
