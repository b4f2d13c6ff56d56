"""The coordinator's save schedule as a pure function: state and question in, answer and next state out."""

from __future__ import annotations

import pytest

from elastic.train.checkpoint import CheckpointSettings
from elastic.train.rendezvous.saves import (
    ANSWERS_KEPT,
    SaveAsk,
    SaveState,
    decide_save,
    requested,
    write_failed,
)

W = frozenset({"w0", "w1"})


def ask(
    step: int, gen: int = 1, now: float = 0.0, members=W, complete: int = -1, written=None, undecided=False
):
    return SaveAsk(gen, step, now, frozenset(members), complete, dict(written or {}), undecided)


def every(steps: int | None = None, seconds: float | None = None) -> CheckpointSettings:
    return CheckpointSettings("/ckpt", every_steps=steps, every_seconds=seconds)


def run(
    c: CheckpointSettings, asks: list[SaveAsk], s: SaveState | None = None
) -> tuple[list[bool], SaveState]:
    s = s or SaveState()
    out = []
    for a in asks:
        r = decide_save(c, s, a)
        out.append(r.save)
        s = r.state
    return out, s


@pytest.mark.parametrize(
    ("case", "c", "asks", "saves"),
    [
        # every_steps=3: the state after step 2 is the checkpoint at step 3
        (
            "multiples of every_steps",
            every(3),
            [ask(s, complete=3 * ((s - 1) // 3)) for s in range(1, 9)],
            [False, True, False, False, True, False, False, True],
        ),
        # nobody reports the save at step 3 complete: none is begun after it
        (
            "postponed while one is written",
            every(3),
            [ask(s) for s in range(1, 9)],
            [False, True, False, False, False, False, False, False],
        ),
        (
            "postponed while a rescale is undecided",
            every(2),
            [ask(1, undecided=True), ask(2, undecided=True), ask(3)],
            [False, False, True],
        ),
        # the clock starts at the first step asked about (t=10); due 5 s later
        (
            "every_seconds",
            every(None, 5.0),
            [ask(0, now=10.0), ask(1, now=14.9), ask(2, now=15.0)],
            [False, False, True],
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_schedule(case: str, c: CheckpointSettings, asks: list[SaveAsk], saves: list[bool]) -> None:
    assert run(c, asks)[0] == saves, case


def test_every_member_of_a_generation_gets_the_first_answer_for_a_step() -> None:
    c = every(2)
    first = decide_save(c, SaveState(), ask(1))
    assert first.save and first.state.inflight == (1, 2) and first.state.writers == W
    # a second member asks about the same step later, with a rescale posted meanwhile: the same answer
    again = decide_save(c, first.state, ask(1, now=99.0, undecided=True))
    assert again.save and again.state == first.state
    # the same step number on another generation is another question
    assert decide_save(c, first.state, ask(1, gen=2, complete=2)).state.answers[(2, 1)] is False


def test_a_requested_save_goes_at_the_next_step_that_allows_one() -> None:
    c = every(100)
    _, s = run(c, [ask(0), ask(1)])
    s = requested(s)
    r = decide_save(c, s, ask(2, undecided=True))  # a rescale undecided: not yet, still asked for
    assert not r.save and r.state.requested
    r = decide_save(c, r.state, ask(3))
    assert r.save and r.state.inflight == (1, 4) and not r.state.requested


def test_a_failed_write_frees_the_schedule_for_the_next_one() -> None:
    c = every(2)
    _, s = run(c, [ask(1)])
    assert s.inflight == (1, 2)
    assert run(c, [ask(2), ask(3)], s)[0] == [False, False]  # still being written
    assert run(c, [ask(2), ask(3)], write_failed(s))[0] == [False, True]


@pytest.mark.parametrize(
    ("case", "members", "written", "completed", "gone"),
    [
        # the rescale kept both writers and both reported: complete, no redo
        ("every writer reported", {"w0", "w1", "w2"}, {"w0": (2, 1), "w1": (2, 1)}, 2, None),
        # w1 left before reporting its write: incomplete, one is due at once on the new layout
        ("a writer left first", {"w0"}, {"w0": (2, 1)}, None, ("w1",)),
        # w1 stays and has not reported yet (it reports with its next steps): wait
        ("a writer still to report", {"w0", "w1"}, {"w0": (2, 1)}, None, None),
        # a report of another generation's write is not this one's
        ("a writer reported another write", {"w0"}, {"w0": (2, 1), "w1": (2, 0)}, None, ("w1",)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_save_begun_before_a_rescale(case, members, written, completed, gone) -> None:
    c = every(100)
    s = decide_save(c, requested(SaveState()), ask(1)).state  # begun at step 1 on generation 1 by {w0, w1}
    assert s.inflight == (1, 2) and s.writers == W
    r = decide_save(c, s, ask(3, gen=2, members=members, written=written))
    assert r.completed == completed, case
    assert (r.incomplete[2] if r.incomplete else None) == gone, case
    if gone:  # the redo goes on the new layout at once, written by its members
        assert r.save and r.state.inflight == (2, 4) and r.state.writers == frozenset(members)
    elif completed is not None:
        assert r.state.inflight is None and not r.save
    else:
        assert r.state.inflight == (1, 2) and not r.save


def test_answers_are_bounded() -> None:
    _, s = run(every(1000), [ask(i) for i in range(10 * ANSWERS_KEPT)])
    assert len(s.answers) <= 2 * ANSWERS_KEPT
    assert (1, 10 * ANSWERS_KEPT - 1) in s.answers
