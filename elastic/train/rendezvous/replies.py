"""The coordinator's answers to its workers, one frozen dataclass per kind, written once at the wire.

What it is for: a handler of the coordinator returns one of these (the answer to a ``step``
is an :class:`Answer` with ``action="go"``, not a dict), :meth:`Coordinator.handle` writes it as
the JSON object the wire carries (``to_wire()``: fields that are None are left out), and a
worker reads it back into the same type (``from_wire()``, through
:meth:`RendezvousClient.ask`), so both sides name the fields the same way and a reply that does
not read fails at the edge, naming the field, instead of as a ``KeyError`` deep in a worker.

Which route answers with which kind is :data:`REPLIES`. A directive inside a reply is a
:class:`~elastic.train.rendezvous.messages.Directive`. Like the requests, the types carry no
behaviour and do no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from elastic.train.rendezvous.messages import Directive, JobStatus
from elastic.train.rendezvous.requests import BadRequest, _Message, _Part


class BadReply(ValueError):
    """A coordinator's answer a worker cannot read: the route it answered and the field are in the
    message (a coordinator and workers of different versions, or a bug)."""


def _one_of(kind: str, field: str, value: str, allowed: frozenset[str]) -> None:
    """BadReply naming the reply's kind, the field, what it may be and what it got, unless ``value``
    is in the closed set ``allowed``."""
    if value not in allowed:
        raise BadReply(f'{kind}: "{field}" must be one of {", ".join(sorted(allowed))}, got {value!r}')


@dataclass(frozen=True)
class Reply(_Message):
    """An answer of the coordinator; ``to_wire()`` leaves out the fields that are None."""

    kind: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_wire().items() if v is not None}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], route: str = "") -> Self:
        """Read an answer of this kind to ``route`` (for the message); BadReply names the field."""
        try:
            return cls._read(body, f"the coordinator's answer to {route or cls.kind}")
        except BadRequest as e:
            raise BadReply(str(e)) from None


@dataclass(frozen=True)
class Registered(Reply):
    """``register``: the job's config (the worker checks its own settings against it), the heartbeat
    timing, and its checkpoint settings (``CheckpointSettings.to_json()``, or None)."""

    kind: ClassVar[str] = "registered"
    job: str
    config: Mapping[str, Any]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    checkpoint: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class GiveUpAsk(_Part):
    """Give ``step`` of ``generation`` up (a rescale waits for the GPUs its members hold)."""

    generation: int
    step: int


@dataclass(frozen=True)
class Beat(Reply):
    """``heartbeat``: the job's phase, and what the worker must do now: give its running step up for
    a recovery (``interrupt``: the generation), give a step up for a rescale (``give_up``), abandon
    the groups it builds (``abort``: that generation, with ``abort_reason``), or prepare the
    directive posted since it last heard (``pending``, numbered ``pending_seq``)."""

    kind: ClassVar[str] = "beat"
    phase: str
    failed: bool
    reason: str
    interrupt: int | None = None
    give_up: GiveUpAsk | None = None
    abort: int | None = None
    abort_reason: str | None = None
    pending: Directive | None = None
    pending_seq: int | None = None


ACTIONS = frozenset({"go", "switch", "stop", "finish", "hold", "break", "join", "exit", "wait"})
"""What an :class:`Answer` tells a worker to do."""


@dataclass(frozen=True)
class Answer(Reply):
    """``step``, ``poll`` and ``broken``: what the worker does next (``action``, one of
    :data:`ACTIONS`), why (``reason``), whether to checkpoint the state after the step (``save``),
    the directive to switch to or join (``directive``), the one posted and pending meanwhile
    (``pending``), and a step its peers give up (``give_up``)."""

    kind: ClassVar[str] = "answer"
    action: str
    reason: str | None = None
    save: bool | None = None
    directive: Directive | None = None
    pending: Directive | None = None
    give_up: int | None = None

    def __post_init__(self) -> None:
        _one_of(self.kind, "action", self.action, ACTIONS)


@dataclass(frozen=True)
class GaveUpInfo(_Part):
    """A rescale that switched at a given-up step: that step, the micro-batch it was given up at,
    and whether every old member kept its work (the new layout finishes it from there)."""

    step: int
    micro: int = 0
    kept: bool = False


DECISIONS = frozenset({"go", "abandoned", "wait", "rollback", "stop"})
"""What a :class:`Decision` says of a rescale."""


@dataclass(frozen=True)
class Decision(Reply):
    """``arrive`` and ``exchanged``: the rescale's decision and why; with ``go`` of ``arrive``, the
    switch step as it stands and, after a give-up, what was given up (``gave_up``)."""

    kind: ClassVar[str] = "decision"
    decision: str
    reason: str = ""
    switch_step: int | None = None
    gave_up: GaveUpInfo | None = None

    def __post_init__(self) -> None:
        _one_of(self.kind, "decision", self.decision, DECISIONS)


@dataclass(frozen=True)
class Ack(Reply):
    """``result``, ``fail`` and ``exit``: received; nothing to do."""

    kind: ClassVar[str] = "ack"


REPLIES: dict[str, type[Reply]] = {
    "register": Registered,
    "heartbeat": Beat,
    "poll": Answer,
    "step": Answer,
    "broken": Answer,
    "arrive": Decision,
    "exchanged": Decision,
    "result": Ack,
    "fail": Ack,
    "exit": Ack,
}
"""Route name -> the kind of its answer (``status`` answers with a :class:`JobStatus`)."""


def wire(reply: Reply | JobStatus) -> dict[str, Any]:
    """The JSON object of any answer, a job's status included."""
    return reply.to_json() if isinstance(reply, JobStatus) else reply.to_wire()


def read(route: str, body: Mapping[str, Any]) -> Reply:
    """``body`` read as the answer to ``route`` (its name, ``step``); BadReply when it does not read."""
    kind = REPLIES.get(route)
    if kind is None:
        raise BadReply(f"{route}: no answer kind for this route (the routes are {', '.join(REPLIES)})")
    return kind.from_wire(body, route)
