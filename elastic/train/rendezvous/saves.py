"""When a checkpoint is taken: the coordinator's save schedule as a pure function of its state.

:func:`decide_save` answers one member's question before a step ("save the state after this
step?") from a :class:`SaveState` and what the coordinator knows now (:class:`SaveAsk`), and
returns the answer with the next state. The first member of a generation to ask about a step
fixes the answer; every other member of that generation gets the same one, so all ranks write
their parts of one checkpoint at the same step. No lock, no clock, no I/O here: the coordinator
calls it under its lock with its own clock's ``now`` and applies what comes back (section 6 of
:mod:`elastic.train.rendezvous`).

The rules:

* a save is due at every multiple of ``every_steps`` and once ``every_seconds`` have passed since
  the last one (the clocks start at the first step asked about), or at once when asked for
  (:func:`requested`) or when one begun on an older layout cannot complete;
* one is never begun while the previous one is still being written or a rescale is undecided;
  a postponed one goes at the first step that allows it;
* a save begun on an older generation (then a rescale or a recovery) completes once each rank
  that was to write it reported its write; one of them gone without reporting it (a leaver exits
  at once, a lost one) leaves it incomplete, and one is taken on the new layout at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # settings only (the module that writes checkpoints is not needed to decide)
    from elastic.train.checkpoint import CheckpointSettings

ANSWERS_KEPT = 32
"""Answers kept per (generation, step): members are at most a step or two apart."""


@dataclass(frozen=True)
class SaveState:
    """The schedule between two questions."""

    # (generation, step) -> the answer every member of that generation gets for that step
    answers: Mapping[tuple[int, int], bool] = field(default_factory=dict)
    inflight: tuple[int, int] | None = None  # the save decided last: (generation, the step it saves)
    writers: frozenset[str] = frozenset()  # the ranks that write it (its generation's members)
    last_step: int | None = None  # the step the last save saved (or the first step asked about)
    last_at: float | None = None  # and when it was decided
    requested: bool = False  # one asked for (request_checkpoint)
    redo: bool = False  # one cut short by a rescale or a recovery: due at once on the new layout


@dataclass(frozen=True)
class SaveAsk:
    """A member asks before ``step`` of ``generation``, at ``now`` on the coordinator's clock."""

    generation: int
    step: int
    now: float
    members: frozenset[str]  # the current generation's workers
    complete_step: int  # the newest complete checkpoint's step (-1: none)
    # each worker's last complete write as it reported it: (step, generation)
    written_by: Mapping[str, tuple[int, int]]
    rescale_undecided: bool  # a rescale is posted and not decided yet


@dataclass(frozen=True)
class SaveAnswer:
    save: bool
    state: SaveState
    # a save begun on an older generation that every writer has now reported: its step
    completed: int | None = None
    # one begun on an older generation that cannot complete: (its step, its generation, the writers
    # gone without reporting their parts)
    incomplete: tuple[int, int, tuple[str, ...]] | None = None


def decide_save(c: CheckpointSettings, s: SaveState, ask: SaveAsk) -> SaveAnswer:
    """The answer to ``ask`` under settings ``c`` and the schedule ``s`` (see the module doc)."""
    key = (ask.generation, ask.step)
    if key in s.answers:
        return SaveAnswer(s.answers[key], s)
    now = ask.now
    if s.last_step is None:  # the first step asked about: the clocks start here
        s = replace(s, last_step=ask.step, last_at=now)
    completed: int | None = None
    incomplete: tuple[int, int, tuple[str, ...]] | None = None
    if s.inflight is not None:
        g, at = s.inflight
        if ask.complete_step >= at:
            s = replace(s, inflight=None)
        elif g != ask.generation:
            gone = tuple(sorted(w for w in s.writers - ask.members if ask.written_by.get(w) != (at, g)))
            if all(ask.written_by.get(w) == (at, g) for w in s.writers):
                completed = at
                s = replace(s, inflight=None)
            elif gone:
                incomplete = (at, g, gone)
                s = replace(s, inflight=None, redo=True)
    assert s.last_step is not None
    due = (
        s.redo
        or s.requested
        or (c.every_steps is not None and (ask.step + 1) // c.every_steps > s.last_step // c.every_steps)
        or (c.every_seconds is not None and s.last_at is not None and now - s.last_at >= c.every_seconds)
    )
    save = due and s.inflight is None and not ask.rescale_undecided
    if save:
        s = replace(
            s,
            inflight=(ask.generation, ask.step + 1),
            last_step=ask.step + 1,
            last_at=now,
            writers=ask.members,
            requested=False,
            redo=False,
        )
    answers = dict(s.answers)
    answers[key] = save
    if len(answers) > 2 * ANSWERS_KEPT:
        answers = {k: answers[k] for k in sorted(answers)[-ANSWERS_KEPT:]}
    return SaveAnswer(save, replace(s, answers=answers), completed, incomplete)


def requested(s: SaveState) -> SaveState:
    """A checkpoint asked for: due at the next step that allows one."""
    return replace(s, requested=True)


def write_failed(s: SaveState) -> SaveState:
    """A rank's write of the save in flight failed: it is given up, the next is due by the usual rules."""
    return replace(s, inflight=None)
