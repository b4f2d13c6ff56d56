"""Posting a directive as a pure decision: the job as the coordinator sees it and ``now`` in, the
directive (or the refusal naming why) out. Table-driven; no coordinator, no clock, no process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic.model import Layout, SpecError
from elastic.train.checkpoint import CheckpointRef
from elastic.train.rendezvous.posting import (
    JobView,
    PostAsk,
    giving_up_pays,
    max_steps_refusal,
    plan_post,
    recoverable,
    refusal,
    switch_step,
)
from elastic.train.rendezvous.settings import CoordinatorSettings
from elastic.train.rendezvous.state import _Gen

L = Layout.parse
DP4 = _Gen(3, L("tp1.pp1.dp4"), {"w0": 0, "w1": 1, "w2": 2, "w3": 3}, start_step=10, give_up_checks=True)
GIVE_UP = CoordinatorSettings(
    lookahead_steps=0, shrink_gives_up_step=True, grow_gives_up_step=True, recover=True
)


def view(cur: _Gen | None = DP4, **kw) -> JobView:
    base = JobView(
        job="j",
        phase="running",
        why="",
        current=cur,
        in_flight=None,
        recovering=None,
        recovery_reason="",
        max_begun=14,
        max_begun_at=100.0,
        recent_step_seconds=(2.0, 2.0, 2.0),
        user_job=False,
        dp_replicas=True,
        store_host="10.0.0.1",
        store_port=29400,
        resume=None,
    )
    return replace(base, **kw)


def ask(layout: str, members, gen: int = 4, **kw) -> PostAsk:
    return PostAsk(gen, L(layout), tuple(members), **kw)


@pytest.mark.parametrize(
    ("case", "v", "gen", "says"),
    [
        ("ended", view(phase="failed", why="boom"), 4, "is failed (boom); cannot rescale it"),
        ("one in flight", view(in_flight=4), 5, "generation 4 is still in flight"),
        (
            "out of memory, reports to come",
            view(recovering="oom", recovery_reason="r0 OOM"),
            4,
            "ran out of memory",
        ),
        (
            "recovering a lost worker",
            view(recovering="lost", recovery_reason="w1 died"),
            4,
            "recovering from a lost",
        ),
        ("generation skipped", view(), 5, "directive generation=5, expected 4"),
        ("a first generation is 1", view(cur=None), 2, "expected 1"),
        ("in sequence", view(), 4, None),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_refusals_name_why(case: str, v: JobView, gen: int, says: str | None) -> None:
    why = refusal(v, gen)
    assert (why is None) == (says is None), (case, why)
    if says is not None:
        assert says in why, (case, why)
        with pytest.raises(SpecError, match="nothing|cannot|wait|once|expected"):
            plan_post(CoordinatorSettings(), v, ask("tp1.pp1.dp2", ["w0", "w1"], gen=gen), 0.0)


@pytest.mark.parametrize(
    ("case", "settings", "cur", "max_begun", "shrink", "switch"),
    [
        (
            "after the step in progress plus the lookahead",
            CoordinatorSettings(lookahead_steps=1),
            DP4,
            14,
            False,
            16,
        ),
        (
            "a shrink's own lookahead",
            CoordinatorSettings(lookahead_steps=2, shrink_lookahead_steps=0),
            DP4,
            14,
            True,
            15,
        ),
        (
            "never before the generation's first step",
            CoordinatorSettings(lookahead_steps=0),
            DP4,
            3,
            False,
            10,
        ),
        (
            "a held job switches where its keepers sit",
            CoordinatorSettings(),
            replace(DP4, hold=True),
            99,
            False,
            10,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_switch_step(case, settings, cur, max_begun, shrink, switch) -> None:
    assert switch_step(settings, cur, max_begun, shrink=shrink) == switch, case


def test_a_rescale_must_switch_before_the_last_step() -> None:
    s = CoordinatorSettings(max_steps=16)
    assert max_steps_refusal(s, "j", 4, 15) is None
    assert "ends at max_steps=16 (last step 15)" in max_steps_refusal(s, "j", 4, 16)
    assert max_steps_refusal(s, "j", 1, 99) is None  # a start is not a switch
    with pytest.raises(SpecError, match="would switch at step 16"):
        plan_post(s, view(), ask("tp1.pp1.dp2", ["w0", "w1"]), 0.0)


@pytest.mark.parametrize(
    ("case", "settings", "v", "a", "now", "give_up"),
    [
        # a shrink with no lookahead, engines that check, one stage, step 14 in progress: gives it up
        ("shrink gives the step up", GIVE_UP, view(), ask("tp1.pp1.dp2", ["w0", "w1"]), 101.0, 14),
        (
            "a shrink without the rule waits",
            replace(GIVE_UP, shrink_gives_up_step=False),
            view(),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            101.0,
            None,
        ),
        (
            "asked explicitly against the rule",
            replace(GIVE_UP, shrink_gives_up_step=False),
            view(),
            ask("tp1.pp1.dp2", ["w0", "w1"], give_up_step=True),
            101.0,
            14,
        ),
        # a user job redoes a given-up step whole: 4 members x 0.5 s in < 2.0 - 0.5 left pays; late does not
        (
            "a user job early in a step",
            GIVE_UP,
            view(user_job=True),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            100.25,
            14,
        ),
        (
            "a user job late in a step",
            GIVE_UP,
            view(user_job=True),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            101.5,
            None,
        ),
        (
            "a grow keeping the TP split",
            GIVE_UP,
            view(),
            ask("tp1.pp1.dp6", ["w0", "w1", "w2", "w3", "w4", "w5"]),
            101.0,
            14,
        ),
        (
            "a grow that changes TP does not ask",
            GIVE_UP,
            view(),
            ask("tp2.pp1.dp4", ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"]),
            101.0,
            None,
        ),
        (
            "a step of another generation is not asked for",
            GIVE_UP,
            view(max_begun=9),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            101.0,
            None,
        ),
        (
            "engines that do not check",
            GIVE_UP,
            view(cur=replace(DP4, give_up_checks=False)),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            101.0,
            None,
        ),
        (
            "a lookahead leaves the step alone",
            replace(GIVE_UP, lookahead_steps=1),
            view(),
            ask("tp1.pp1.dp2", ["w0", "w1"]),
            101.0,
            None,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_giving_the_step_in_progress_up(case, settings, v, a, now, give_up) -> None:
    post = plan_post(settings, v, a, now)
    assert post.give_up_step == give_up, case
    assert post.give_up_begun_at == (100.0 if give_up is not None else 0.0), case
    assert post.directive.switch_step == (give_up + 1 if give_up is not None else post.directive.switch_step)


def test_a_shrink_directive_and_its_record() -> None:
    post = plan_post(GIVE_UP, view(), ask("tp1.pp1.dp2", ["w2", "w0"], join_timeout_s=7.0), 101.0)
    d, r = post.directive, post.record
    assert (d.job, d.generation, d.layout, d.workers, d.old_layout) == (
        "j",
        4,
        L("tp1.pp1.dp2"),
        ("w2", "w0"),
        L("tp1.pp1.dp4"),
    )
    assert d.old_ranks == DP4.ranks and d.switch_step == 15 and d.join_timeout_s == 7.0
    assert (d.store_host, d.store_port) == ("10.0.0.1", 29400)
    assert d.rollback  # transactional, and dp4 of replicas is recoverable
    assert sorted(d.leavers) == ["w1", "w3"] and not d.joiners
    assert (r.generation, r.from_layout, r.to_layout, r.switch_step, r.leavers) == (
        4,
        L("tp1.pp1.dp4"),
        L("tp1.pp1.dp2"),
        15,
        sorted(d.leavers),
    )
    assert post.give_up_step == 14  # GIVE_UP: the shrink asks for the step in progress


def test_a_first_generation_starts_at_the_newest_checkpoint() -> None:
    ref = CheckpointRef("/ckpt/step-40", 40, "tp1.pp1.dp2")
    post = plan_post(
        CoordinatorSettings(),
        view(cur=None, resume=ref, max_begun=-1),
        ask("tp1.pp1.dp2", ["a", "b"], gen=1),
        0.0,
    )
    d = post.directive
    assert (d.switch_step, d.resume, d.resume_layout, d.old_layout, d.rollback) == (
        40,
        "/ckpt/step-40",
        "tp1.pp1.dp2",
        None,
        False,
    )
    assert post.give_up_step is None
    fresh = plan_post(CoordinatorSettings(), view(cur=None), ask("tp1.pp1.dp2", ["a", "b"], gen=1), 0.0)
    assert fresh.directive.switch_step == 0 and fresh.directive.resume is None


@pytest.mark.parametrize(
    ("case", "v", "says"),
    [
        ("a job not started has nothing to hold", view(cur=None), "has not started"),
        ("a paused job is paused already", view(cur=replace(DP4, hold=True)), "paused already"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_pause_needs_a_running_job(case, v, says) -> None:
    gen = 1 if v.current is None else 4
    with pytest.raises(SpecError, match=says):
        plan_post(CoordinatorSettings(), v, ask("tp1.pp1.dp2", ["k0", "k1"], gen=gen, hold=True), 0.0)


@pytest.mark.parametrize(
    ("case", "settings", "gen", "dp_replicas", "expected"),
    [
        ("replicas", CoordinatorSettings(recover=True), DP4, True, True),
        ("recovery off", CoordinatorSettings(recover=False), DP4, True, False),
        ("FSDP shards", CoordinatorSettings(recover=True), DP4, False, False),
        (
            "one replica",
            CoordinatorSettings(recover=True),
            replace(DP4, layout=L("tp2.pp1.dp1")),
            True,
            False,
        ),
        (
            "ZeRO shards the optimizer",
            CoordinatorSettings(recover=True),
            replace(DP4, layout=L("tp1.pp1.dp4.z1")),
            True,
            False,
        ),
        ("held by keepers", CoordinatorSettings(recover=True), replace(DP4, hold=True), True, False),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_recoverable(case, settings, gen, dp_replicas, expected) -> None:
    assert recoverable(settings, gen, dp_replicas) is expected, case


@pytest.mark.parametrize(
    ("case", "keeps", "user", "times", "now", "pays"),
    [
        ("the reference trainer keeps the work", True, False, (9.0,), 108.0, True),
        ("no step timed yet", False, True, (), 108.0, True),
        ("early: 4 x 0.25 < 2 - 0.25", False, True, (2.0, 3.0, 1.0), 100.25, True),
        ("late: 4 x 1 > 2 - 1", False, True, (2.0, 3.0, 1.0), 101.0, False),
        ("untimed steps do not count", False, True, (0.0, 0.0), 150.0, True),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_giving_up_pays(case, keeps, user, times, now, pays) -> None:
    assert (
        giving_up_pays(DP4, keeps, user_job=user, recent_step_seconds=times, now=now, begun_at=100.0) is pays
    )
