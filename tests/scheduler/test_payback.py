"""Lending pays or it does not happen: a grow must repay its own pause and the pause of giving the
GPUs back before the services' outlook needs them again (issue 37, point 2). Table-driven."""

from __future__ import annotations

import math

import pytest

from elastic.model import Layout
from elastic.scheduler import JobState, Reason, ServiceDemand, decide
from elastic.scheduler.targets import payback_seconds, reclaim_after, spare_curve
from tests.scheduler.builders import holding, pool, snap, table


def linear(name: str, pause: float, step: int = 8, hi: int = 1024, priority: int = 0) -> JobState:
    return JobState(name, table(step, hi), min_gpus=step, priority=priority, pause_seconds=pause)


@pytest.mark.parametrize(
    ("have", "to", "pause", "expect"),
    [
        (512, 520, 5.0, 5 + 5 * (512 + 520) / 8),  # 8 GPUs onto a big job: 650 s
        (64, 128, 5.0, 5 + 5 * (64 + 128) / 64),  # doubling: 20 s
        (0, 64, 5.0, 10.0),  # a start or resume: its own pause and the one when it gives them back
        (512, 520, 0.0, 0.0),  # pause not known: every grow pays
    ],
    ids=["small-grow-big-job", "doubling", "start", "no-pause-known"],
)
def test_payback_seconds(have, to, pause, expect) -> None:
    assert payback_seconds(linear("j", pause), have, to) == pytest.approx(expect)


def test_a_grow_that_gains_nothing_never_pays() -> None:
    flat = JobState("j", {8: (Layout(8, 1, 1), 100.0), 16: (Layout(8, 1, 2), 100.0)}, min_gpus=8,
                    pause_seconds=5.0)
    assert payback_seconds(flat, 8, 16) == math.inf


@pytest.mark.parametrize(
    ("curve", "lent", "expect"),
    [
        (((0, 8), (600, 0)), 8, 600.0),
        (((0, 8), (600, 4), (1200, 0)), 4, 1200.0),  # the lower 4 stay until the next rise
        (((0, 8), (600, 8)), 8, math.inf),  # not needed back within the outlook
        (((0, 8), (600, 0)), 0, math.inf),
    ],
)
def test_reclaim_after(curve, lent, expect) -> None:
    assert reclaim_after(curve, lent) == expect


def test_spare_curve_follows_the_outlook_and_keeps_services_without_one() -> None:
    chat = ServiceDemand("chat", 16, outlook=((600.0, 24), (1200.0, 20)))
    batch = ServiceDemand("batch", 8, gpus_per_replica=2, min_replicas=2)  # no outlook: keeps 8 x 2
    curve = spare_curve((chat, batch), budget_now=64 - 16 - 16, headroom=0, pool_gpus=64, held=24)
    assert curve == ((0.0, 8), (600.0, 0), (1200.0, 4))


def _lend(outlook: tuple[tuple[float, int], ...], jobs: list[JobState], prev=None):
    # 8 nodes; chat holds 5 and its load fell to 3 nodes' worth; the jobs hold 3 nodes
    prev = prev or holding(chat=[(f"n{i}", 8) for i in range(5)], big=[(f"n{i}", 8) for i in range(5, 8)])
    return decide(snap(pool(8), [ServiceDemand("chat", 24, outlook=outlook)], jobs, prev, now=10_000.0))


@pytest.mark.parametrize(
    ("outlook", "grows"),
    [
        ((), True),  # no forecast: lend as before
        (((300.0, 40), (3600.0, 40)), False),  # back to 5 nodes in 5 minutes: 16 GPUs onto 24 never pay
        (((3600.0, 24), (7200.0, 40)), True),  # spare for an hour: the grow pays in 600 s
        (((300.0, 32), (3600.0, 32)), True),  # one node back soon, the other stays: grows by that one
    ],
    ids=["no-outlook", "reclaimed-in-5-min", "spare-for-an-hour", "partly-reclaimed"],
)
def test_a_node_reclaimed_before_the_grow_pays_is_not_lent(outlook, grows) -> None:
    plan = _lend(outlook, [linear("big", pause=120.0)])  # 24 -> 40 repays in 120 + 120 x 64 / 16 = 600 s
    assert plan.gpus_of("chat") == 24
    if grows:
        assert plan.gpus_of("big") > 24
        assert plan.jobs["big"].reason == Reason.SPARE_CAPACITY
    else:
        assert plan.gpus_of("big") == 24
        assert plan.jobs["big"].reason == Reason.HYSTERESIS
        assert "before the grow repays its pauses" in plan.jobs["big"].message
    if outlook == ((300.0, 32), (3600.0, 32)):
        assert plan.gpus_of("big") == 32, "only the node that stays spare is lent"


def test_the_job_that_gives_back_first_is_the_one_not_lent_to() -> None:
    # two jobs, 16 spare GPUs, 8 of them needed back in 5 minutes: inference takes from the
    # lowest-priority job first, so its grow would be the one undone
    prev = holding(chat=[(f"n{i}", 8) for i in range(4)], hi=[("n4", 8), ("n5", 8)], lo=[("n6", 8), ("n7", 8)])
    jobs = [linear("hi", 120.0, priority=5), linear("lo", 120.0, priority=1)]
    plan = decide(snap(pool(10), [ServiceDemand("chat", 32, outlook=((300.0, 40), (3600.0, 40)))], jobs, prev,
                       now=10_000.0))
    assert plan.gpus_of("hi") == 24, "the high-priority grow sits below the reclaim: it pays"
    assert plan.gpus_of("lo") == 16
    assert plan.jobs["lo"].reason == Reason.HYSTERESIS
