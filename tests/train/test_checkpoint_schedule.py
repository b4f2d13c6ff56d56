"""When a checkpoint is taken: the coordinator decides, the same for every rank of a generation.

Driven request by request with an injected clock (no processes), like test_agent_rendezvous;
one test at the end runs real worker processes through an on-demand checkpoint.
"""

from __future__ import annotations

import time

import pytest

from elastic.model import Layout, SpecError
from elastic.train import checkpoint as ck
from elastic.train.checkpoint import CheckpointSettings
from elastic.train.rendezvous import CheckpointFailed
from tests.train.test_agent_rendezvous import call, started

W = ["w0", "w1"]


def steps(c, gen: int, step: int, workers=W, written=None, error: dict | None = None, first=False) -> list[bool]:
    """Every worker asks to begin ``step`` (reporting ``step - 1``, unless it is its generation's
    ``first``); returns whether each was told to save."""
    out = []
    for w in workers:
        res = {"step": step - 1, "loss": 2.0, "tokens": 256, "seconds": 0.5, "checkpoint": written}
        if error and w in error:
            res["checkpoint_error"] = error[w]
        r = call(c, "step", w, generation=gen, step=step, **({} if first else {"result": res}))
        assert r["action"] == "go", r
        out.append(bool(r.get("save")))
    return out


def job(tmp_path, **kw):
    return started(checkpoint=CheckpointSettings(str(tmp_path), **kw))


def test_saves_fall_on_multiples_of_every_steps_and_every_rank_gets_the_same_answer(tmp_path) -> None:
    c, _, _ = job(tmp_path, every_steps=3)  # steps 0 and 1 run
    saved = {s: steps(c, 1, s, written=[3, 1] if s > 3 else None) for s in range(2, 9)}
    # the state after step 2 is the checkpoint at step 3; after 5, at step 6 (3's reported complete by then)
    assert {s for s, a in saved.items() if any(a)} == {2, 5}
    assert all(a in ([True, True], [False, False]) for a in saved.values()), saved
    assert c.status().checkpoint_step == 3


def test_the_next_checkpoint_waits_until_the_last_one_is_complete(tmp_path) -> None:
    c, _, _ = job(tmp_path, every_steps=2)
    # step 1 (run by ``started``) was told to save: the checkpoint at step 2. Nobody reports that
    # write complete: no second one is begun however many steps pass
    assert [s for s in range(2, 12) if any(steps(c, 1, s))] == []
    # the reports land with step 12's requests (the first member's answer is fixed before the last
    # member's report completes the record): the postponed one goes at the next step
    assert steps(c, 1, 12, written=[2, 1]) == [False, False]
    assert c.status().checkpoint_step == 2
    assert steps(c, 1, 13, written=[2, 1]) == [True, True]


def test_every_seconds_saves_by_the_clock(tmp_path) -> None:
    c, clock, _ = job(tmp_path, every_steps=None, every_seconds=60.0)
    assert not any(steps(c, 1, 2))
    clock.t += 59.0
    assert not any(steps(c, 1, 3))
    clock.t += 1.5
    assert steps(c, 1, 4) == [True, True]
    clock.t += 30.0
    assert not any(steps(c, 1, 5, written=[5, 1]))
    clock.t += 30.0
    assert steps(c, 1, 6, written=[5, 1]) == [True, True]


def test_no_checkpoint_begins_while_a_rescale_is_in_flight_and_a_postponed_one_follows(tmp_path) -> None:
    c, clock, _ = job(tmp_path, every_steps=3)
    d = c.directive(2, "tp1.pp1.dp4", ["w0", "w1", "w2", "ghost"], join_timeout_s=10)
    call(c, "register", "w2")
    answers = [call(c, "step", w, generation=1, step=2) for w in W]  # step 2 is due (state at 3)
    assert all(a["action"] == "go" and "pending" in a and not a.get("save") for a in answers), answers
    for w in W:
        assert call(c, "step", w, generation=1, step=d.switch_step)["action"] == "switch"
    for w in ("w0", "w1", "w2"):
        call(c, "arrive", w, generation=2, digest="x")
    for _ in range(3):
        clock.t += 3.5
        for w in ("w0", "w1", "w2"):
            call(c, "heartbeat", w)
    c.tick()  # the ghost never arrives: the rescale is abandoned, the job goes on on generation 1
    assert call(c, "arrive", "w0", generation=2, digest="x")["decision"] == "abandoned"
    assert steps(c, 1, d.switch_step) == [True, True]  # the postponed checkpoint, at the first step allowed


def test_a_checkpoint_asked_for_is_taken_at_the_next_step_and_waited_for(tmp_path) -> None:
    c, _, _ = job(tmp_path, every_steps=1000)
    ticket = c.request_checkpoint()
    assert ticket == (-1, 0)
    assert steps(c, 1, 2) == [True, True]
    assert not any(steps(c, 1, 3))  # once
    with pytest.raises(TimeoutError, match="previous checkpoint is still being written"):
        c.wait_checkpoint(ticket, timeout=0.05)
    steps(c, 1, 4, written=[3, 1])
    assert c.wait_checkpoint(ticket, timeout=1) == 3


def test_a_write_that_fails_is_reported_to_whoever_waits_and_the_job_goes_on(tmp_path) -> None:
    c, _, reg = job(tmp_path, every_steps=1000)
    ticket = c.request_checkpoint()
    assert any(steps(c, 1, 2))
    assert reg.get_sample_value("elastic_training_checkpoint_failures_total", {"job": "job"}) == 0
    steps(c, 1, 4, error={"w1": "OSError: [Errno 28] No space left on device"})
    assert reg.get_sample_value("elastic_training_checkpoint_failures_total", {"job": "job"}) == 1
    with pytest.raises(CheckpointFailed, match=r"w1: OSError: \[Errno 28\] No space left.*no complete one"):
        c.wait_checkpoint(ticket, timeout=1)
    assert c.status().phase == "running"
    ticket = c.request_checkpoint()  # given up: a new one may be asked for at once
    assert any(steps(c, 1, 5))


def _rescale_to(c, layout: str, workers: list[str], results: dict[str, dict]) -> int:
    """Generation 1 (``W``) rescales to generation 2 on ``workers``; each member's rescale result
    carries ``results[w]`` (e.g. its last checkpoint write). Returns the switch step."""
    for w in workers:
        if w not in W:
            call(c, "register", w)
    d = c.directive(2, layout, workers)
    for w in d.joiners:
        assert call(c, "poll", w)["action"] == "join"
    for s in range(3, d.switch_step):
        steps(c, 1, s)
    for w in W:
        assert call(c, "step", w, generation=1, step=d.switch_step)["action"] == "switch"
    plan = {"new_ranks": {w: i for i, w in enumerate(workers)}}
    members = sorted(set(W) | set(workers))
    assert [call(c, "arrive", w, generation=2, digest="x", plan=plan)["decision"] for w in members][-1] == "go"
    for w in members:
        call(c, "result", w, generation=2, ok=True, stats={}, **results.get(w, {}))
    return d.switch_step


@pytest.mark.parametrize("leaver_reports", [False, True])
def test_a_checkpoint_a_leaver_did_not_finish_is_taken_again_on_the_new_layout(tmp_path, leaver_reports) -> None:
    """A save begun just before a shrink: the leaver exits at once (its GPU is not held back for its
    write). Unless its result says the write was done, the checkpoint is incomplete: one is taken at
    the new layout's first step, and whoever waits for the one asked for gets that one."""
    c, _, _ = job(tmp_path, every_steps=1000)
    ticket = c.request_checkpoint()
    assert steps(c, 1, 2) == [True, True]  # the checkpoint at step 3, on tp1.pp1.dp2
    results = {"w1": {"checkpoint": [3, 1]}} if leaver_reports else {}
    switch = _rescale_to(c, "tp1.pp1.dp1", ["w0"], results)
    first = steps(c, 2, switch, workers=["w0"], first=True)
    if leaver_reports:  # complete once the survivor reports its write too; nothing taken again
        assert first == [False]
        assert steps(c, 2, switch + 1, workers=["w0"], written=[3, 1]) == [False]
        assert c.status().checkpoint_step == 3
        assert c.wait_checkpoint(ticket, timeout=1) == 3
        return
    assert first == [True]  # the state after the switch step, on tp1.pp1.dp1
    assert c.status().checkpoint_step == -1
    steps(c, 2, switch + 1, workers=["w0"], written=[switch + 1, 2])
    assert c.wait_checkpoint(ticket, timeout=1) == switch + 1
    assert not any(steps(c, 2, switch + 2, workers=["w0"], written=[switch + 1, 2]))  # once


def test_a_checkpoint_in_flight_across_a_grow_completes_when_its_ranks_report_it(tmp_path) -> None:
    """Every rank that writes it survives a grow: their writes end after the switch and are reported
    with the new generation's steps; the checkpoint is complete then, and none is taken again."""
    c, _, _ = job(tmp_path, every_steps=1000)
    ticket = c.request_checkpoint()
    assert steps(c, 1, 2) == [True, True]
    switch = _rescale_to(c, "tp1.pp1.dp3", ["w0", "w1", "w2"], {})
    new = ["w0", "w1", "w2"]
    assert steps(c, 2, switch, workers=new, first=True) == [False] * 3  # not reported yet, not given up
    assert steps(c, 2, switch + 1, workers=new, written=[3, 1]) == [False] * 3
    assert not any(steps(c, 2, switch + 2, workers=new, written=[3, 1]))
    assert c.status().checkpoint_step == 3
    assert c.wait_checkpoint(ticket, timeout=1) == 3


def test_asking_a_job_without_settings_a_paused_or_an_ended_one_is_refused(tmp_path) -> None:
    from tests.train.test_agent_rendezvous import _pause

    c, _, _ = started()
    with pytest.raises(SpecError, match="no checkpoint settings; give it checkpoint.dir"):
        c.request_checkpoint()
    c, clock, _ = job(tmp_path)
    _pause(c, clock)
    c.wait_generation(2, timeout=1)
    with pytest.raises(SpecError, match="paused: its keepers hold the state and run no step; resume it"):
        c.request_checkpoint()
    c.request_stop()
    with pytest.raises(SpecError, match="is stopping; a checkpoint needs a running job"):
        c.request_checkpoint()


@pytest.mark.parametrize("kw, match", [
    ({"every_steps": None}, "neither every_steps nor every_seconds"),
    ({"every_seconds": 0}, "every_seconds=0: must be > 0"),
    ({"every_steps": 0}, "every_steps=0: must be >= 1"),
])
def test_intervals_are_validated(kw, match) -> None:
    with pytest.raises(SpecError, match=match):
        CheckpointSettings("/ck", **kw)


def test_settings_travel_to_the_workers_whole() -> None:
    s = CheckpointSettings("/ck", every_steps=None, every_seconds=1800.0, keep=3)
    assert CheckpointSettings.from_json(s.to_json()) == CheckpointSettings("/ck", None, 3, every_seconds=1800.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_running_job_saves_on_demand_and_the_files_are_complete(tmp_path) -> None:
    from elastic.train.launch import LaunchOptions, ProcessJobHandle
    from tests.train.test_checkpoint import _cfg

    settings = CheckpointSettings(str(tmp_path / "ck"), every_steps=10_000)
    h = ProcessJobHandle("od", _cfg(), options=LaunchOptions(checkpoint=settings), log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(2, timeout=60)
        t0 = time.monotonic()
        step = h.checkpoint(timeout=120)
        assert step >= 3 and time.monotonic() - t0 < 120
        ref = ck.latest(settings.dir)
        assert ref is not None and (ref.step, ref.layout) == (step, "tp1.pp1.dp2")
        assert h.status().checkpoint_step == step and h.status().phase == "running"
        h.wait_step(step + 2, timeout=60)  # training went on
        # one asked for just before a shrink: whichever layout it lands on, it completes and is waited for
        ticket = h.coordinator.request_checkpoint()
        h.rescale("tp1.pp1.dp1", ["w0"], timeout=120)
        again = h.coordinator.wait_checkpoint(ticket, timeout=120)
        ref = ck.latest(settings.dir)
        assert again > step and ref is not None and ref.step == again, (again, ref)
        assert h.status().phase == "running" and h.status().layout == Layout.parse("tp1.pp1.dp1")
    finally:
        final = h.stop()
    assert final.error is None, final.error


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_leaver_gone_before_its_write_is_done_costs_that_checkpoint_and_one_is_taken_on_the_new_layout(
        tmp_path, monkeypatch) -> None:
    """The race itself, with real processes: w1's writes take 4 s (a slow disk), a checkpoint is
    asked for, and the job shrinks onto w0 while w1 still writes. w1 exits at once with its part
    unwritten: that checkpoint stays incomplete on disk, and the one taken on the new layout is what
    the caller waiting gets."""
    from elastic.train.launch import LaunchOptions, ProcessJobHandle
    from tests.train.test_checkpoint import _cfg

    monkeypatch.setenv("ELASTIC_FAULT_SLOW_CHECKPOINT", "w1:4")
    settings = CheckpointSettings(str(tmp_path / "ck"), every_steps=10_000)
    h = ProcessJobHandle("race", _cfg(), options=LaunchOptions(checkpoint=settings), log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        begun = h.wait_step(2, timeout=60).step
        ticket = h.coordinator.request_checkpoint()
        h.wait_step(begun + 2, timeout=60)  # the save was answered at a boundary since: both ranks write now
        h.rescale("tp1.pp1.dp1", ["w0"], timeout=120)
        got = h.coordinator.wait_checkpoint(ticket, timeout=120)
        ref = ck.latest(settings.dir)
        assert ref is not None and (ref.step, ref.layout) == (got, "tp1.pp1.dp1"), (got, ref)
        # w1 left before its part was written: no checkpoint of the old layout is complete (the
        # incomplete one is pruned once a newer one is complete)
        old = [p for p in (tmp_path / "ck").iterdir() if p.name.endswith("tp1.pp1.dp2")]
        assert not any((p / "rank-00001.pt").exists() for p in old), old
        assert h.status().phase == "running"
    finally:
        final = h.stop()
    assert final.error is None, final.error
