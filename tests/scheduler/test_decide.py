"""Co-scheduler behaviour, table-driven (issue 7 "must show" list)."""

from __future__ import annotations

import pytest

from elastic.model import Layout, SpecError
from elastic.scheduler import JobState, Knobs, Reason, ServiceDemand, Snapshot, decide
from elastic.scheduler.targets import inference_targets
from tests.scheduler.builders import holding, job, per_node, pool, snap, svc, table


def actions(plan) -> list[tuple[str, str]]:
    return [(s.action, s.workload) for s in plan.steps if s.action != "noop"]


# ---- load rise ----------------------------------------------------------------------------------

def test_load_rise_takes_whole_nodes_from_the_lowest_priority_job_first() -> None:
    nodes = pool(4)
    prev = holding(chat=[("n0", 8)], hi=[("n1", 8), ("n2", 4)], lo=[("n2", 4), ("n3", 8)])
    jobs = [job("hi").prio(5).tab(table(4, 32, tp=4)).bounds(4), job("lo").prio(1).tab(table(4, 32, tp=4)).bounds(4)]
    plan = decide(snap(nodes, [svc("chat", 16)], jobs, prev))
    assert plan.gpus_of("chat") == 16
    assert plan.gpus_of("hi") == 12, "the higher-priority job keeps everything"
    assert plan.gpus_of("lo") == 4
    assert per_node(plan, "chat") == {"n0": 8, "n3": 8}, "lo gave back its whole node n3, not slivers"
    assert actions(plan) == [("shrink_training", "lo"), ("scale_inference_up", "chat")]
    shrink = plan.steps[0]
    assert shrink.reason == Reason.INFERENCE_DEMAND and "12 -> 4" in shrink.message
    assert plan.jobs["lo"].reason == Reason.INFERENCE_DEMAND


@pytest.mark.parametrize(
    ("lo_table", "hi_table", "expect_lo", "expect_hi"),
    [
        # same priority: the job losing fewer tokens/s per GPU freed gives back
        (table(8, 32, per_gpu=50), table(8, 32, per_gpu=100), 8, 16),
        (table(8, 32, per_gpu=100), table(8, 32, per_gpu=50), 16, 8),
    ],
    ids=["cheap-job-shrinks", "other-way-round"],
)
def test_equal_priority_shrinks_the_cheapest_tokens_per_gpu(lo_table, hi_table, expect_lo, expect_hi) -> None:
    prev = holding(a=[("n0", 8), ("n1", 8)], b=[("n2", 8), ("n3", 8)])
    plan = decide(snap(pool(4), [svc("chat", 8)], [job("a").tab(lo_table), job("b").tab(hi_table)], prev))
    assert (plan.gpus_of("a"), plan.gpus_of("b")) == (expect_lo, expect_hi)


# ---- load fall ----------------------------------------------------------------------------------

def test_load_fall_drains_inference_then_grows_training() -> None:
    prev = holding(chat=[("n0", 8), ("n1", 8), ("n2", 8)], t=[("n3", 8)])
    plan = decide(snap(pool(4), [svc("chat", 8)], [job("t").tab(table(8, 32))], prev))
    assert plan.gpus_of("chat") == 8 and plan.gpus_of("t") == 24
    assert actions(plan) == [("scale_inference_down", "chat"), ("grow_training", "t")]
    assert plan.steps[-1].reason == Reason.SPARE_CAPACITY
    assert plan.steps[0].reason == Reason.LOAD_FALL
    assert all(c == 8 for c in per_node(plan, "t").values()), "training grows by whole nodes"


def test_two_jobs_split_spare_gpus_by_marginal_throughput() -> None:
    # a: strong diminishing returns; b: nearly linear. With 48 spare GPUs greedy water-filling
    # gives each 8-GPU step to whichever job gains more tokens/s per GPU.
    a = job("a").tab(table(8, 48, per_gpu=100, decay=0.12))
    b = job("b").tab(table(8, 48, per_gpu=80, decay=0.02))
    plan = decide(snap(pool(6), [], [a, b]))
    ga, gb = plan.gpus_of("a"), plan.gpus_of("b")
    assert ga + gb == 48
    assert ga >= 8 and gb >= 8, "both jobs get a share"
    # the greedy split is the best split (brute force over the tables)
    ta, tb = a.tbl, b.tbl
    best = max((ta.get(x, ("", 0))[1] + tb.get(48 - x, ("", 0))[1], x) for x in range(0, 49, 8))
    assert ga == best[1]


def test_higher_priority_job_fills_first() -> None:
    plan = decide(snap(pool(4), [], [job("lo").prio(0).tab(table(8, 32)), job("hi").prio(9).tab(table(8, 24))]))
    assert plan.gpus_of("hi") == 24 and plan.gpus_of("lo") == 8


# ---- below minimum --------------------------------------------------------------------------------

@pytest.mark.parametrize(("builder", "status", "action"), [
    (lambda: job("t").tab(table(16, 32)).bounds(16), "paused", "pause_training"),
    (lambda: job("t").tab(table(16, 32)).bounds(16).preempt(), "preempted", "preempt_training"),
])
def test_job_at_minimum_is_paused_or_preempted_not_inference_starved(builder, status, action) -> None:
    prev = holding(chat=[("n0", 8), ("n1", 8)], t=[("n2", 8), ("n3", 8)])
    plan = decide(snap(pool(4), [svc("chat", 24)], [builder()], prev))
    assert plan.gpus_of("chat") == 24, "inference demand is served first"
    assert plan.gpus_of("t") == 0
    d = plan.jobs["t"]
    assert d.status == status and d.reason == Reason.BELOW_MINIMUM
    assert "min_gpus=16" in d.message
    assert actions(plan)[0] == (action, "t")


def test_paused_job_resumes_when_load_falls() -> None:
    prev = holding(chat=[("n0", 8), ("n1", 8), ("n2", 8), ("n3", 8)])
    paused = JobState("t", table(16, 32), 16, 32, status="paused", last_rescale_at=0.0)
    plan = decide(snap(pool(4), [svc("chat", 8)], [paused], prev, now=500.0))
    assert plan.gpus_of("t") == 16 and plan.jobs["t"].status == "running"
    assert "resumes" in plan.jobs["t"].message


# ---- hysteresis --------------------------------------------------------------------------------

@pytest.mark.parametrize(("now", "last", "threshold", "expect", "reason"), [
    (1000.0, 990.0, 0.05, 8, Reason.HYSTERESIS),  # rescaled 10 s ago < 60 s interval
    (1000.0, 900.0, 0.05, 16, Reason.SPARE_CAPACITY),  # interval passed, +100% gain
    (1000.0, 900.0, 1.5, 8, Reason.HYSTERESIS),  # +100% < 150% threshold
])
def test_hysteresis(now, last, threshold, expect, reason) -> None:
    prev = holding(t=[("n0", 8)])
    plan = decide(snap(pool(2), [], [job("t").tab(table(8, 16)).rescaled_at(last)], prev, now=now,
                       knobs=Knobs(60.0, threshold, 0)))
    assert plan.gpus_of("t") == expect
    assert plan.jobs["t"].reason == reason
    if reason == Reason.HYSTERESIS:
        assert any(s.action == "noop" and s.reason == Reason.HYSTERESIS for s in plan.steps)


def test_forced_shrink_ignores_the_rescale_interval() -> None:
    prev = holding(t=[("n0", 8), ("n1", 8)])
    plan = decide(snap(pool(2), [svc("chat", 8)], [job("t").tab(table(8, 16)).rescaled_at(999.0)], prev))
    assert plan.gpus_of("t") == 8 and plan.gpus_of("chat") == 8


@pytest.mark.parametrize(("threshold", "max_grows"), [(0.3, 0), (0.2, 1200 // 60 + 1)])
def test_no_flapping_under_noisy_load(threshold: float, max_grows: int) -> None:
    """Inference demand flips between 3 and 4 nodes every 10 s (raw, before any replica-policy
    smoothing). Grows are spaced by the interval and need the gain threshold; 32 -> 40 GPUs is
    +25%, so with a 30% threshold the job never grows back and stops flapping at once."""
    import random

    rng = random.Random(3)
    prev = holding(t=[(f"n{i}", 8) for i in range(4, 8)])
    last: float | None = None
    grows: list[float] = []
    shrinks = 0
    knobs = Knobs(rescale_interval_seconds=60.0, gain_threshold=threshold, headroom_gpus=0)
    for step in range(120):
        now = step * 10.0
        demand = 3 + rng.choice([0, 1])
        t = JobState("t", table(8, 64, decay=0.01), 8, 64, last_rescale_at=last)
        plan = decide(Snapshot(now, pool(8), (ServiceDemand("chat", demand, 8),), (t,), prev, knobs))
        d = plan.jobs["t"]
        if d.rescaled:
            last = now
            if d.gpus > d.gpus_before:
                grows.append(now)
            else:
                shrinks += 1
        plan.allocation.check_disjoint()
        assert plan.gpus_of("chat") == demand * 8, "inference is never held back by hysteresis"
        prev = plan.allocation
    assert len(grows) <= max_grows
    assert all(b - a >= 60.0 for a, b in zip(grows, grows[1:], strict=False))
    assert shrinks <= len(grows) + 1


# ---- layouts, idle GPUs, fragmentation --------------------------------------------------------------

def test_decisions_and_steps_carry_the_tables_layouts() -> None:
    # a shrink from 16 to 8 GPUs: the step names both layouts, the decision the new one, as the
    # table's Layout objects (text only where a plan is written out)
    prev = holding(t=[("n0", 8), ("n1", 8)])
    plan = decide(snap(pool(2), [svc("chat", 8)], [job("t").tab(table(8, 16))], prev))
    step = next(s for s in plan.steps if s.workload == "t")
    assert (step.action, step.target.layout_before, step.target.layout_after) == (
        "shrink_training", Layout(8, 1, 2), Layout(8, 1, 1))
    assert plan.jobs["t"].layout == Layout(8, 1, 1)


def test_partial_nodes_hold_multiples_of_tp() -> None:
    prev = holding(chat=[("n0", 3), ("n1", 2)])
    plan = decide(snap(pool(3), [svc("chat", 5)], [job("t").tab(table(4, 24, tp=4)).bounds(4)], prev))
    counts = per_node(plan, "t")
    assert plan.gpus_of("t") == 16
    assert all(c % 4 == 0 for c in counts.values()), counts


def test_gpus_no_layout_can_use_stay_idle_with_a_reason() -> None:
    plan = decide(snap(pool(2), [svc("chat", 3)], [job("t").tab(table(8, 16)).bounds(8)]))
    assert plan.gpus_of("t") == 8 and plan.idle_gpus == 5
    assert plan.jobs["t"].gpus == 8


def test_job_without_any_feasible_count_is_reported() -> None:
    plan = decide(snap(pool(1), [], [job("t").tab({3: (Layout(1, 1, 3), 10.0)}).bounds(4, 8)]))
    assert plan.gpus_of("t") == 0
    assert plan.jobs["t"].reason == Reason.NO_FEASIBLE_LAYOUT


def test_multi_node_replicas_take_whole_nodes() -> None:
    prev = holding(t=[("n0", 8), ("n1", 8), ("n2", 8), ("n3", 8)])
    plan = decide(snap(pool(4), [svc("big", 1, gpus=16)], [job("t").tab(table(8, 32))], prev))
    assert sorted(per_node(plan, "big").values()) == [8, 8]
    assert plan.gpus_of("t") == 16


def test_step_order_shrink_up_down_then_up_after_drain() -> None:
    prev = holding(a=[("n0", 8)], b=[("n1", 8)], lo=[("n2", 8), ("n3", 8)])
    jobs = [job("lo").tab(table(8, 32))]
    # a needs 16 more: the paused job's 16 GPUs suffice, so a scales up before b drains
    plan = decide(snap(pool(4), [svc("a", 24), svc("b", 4)], jobs, prev))
    assert actions(plan) == [("pause_training", "lo"), ("scale_inference_up", "a"), ("scale_inference_down", "b")]
    # nothing for training to free (lo keeps its node): a's scale-up waits for b's drain
    prev2 = holding(a=[("n0", 8)], b=[("n1", 8), ("n2", 8)], lo=[("n3", 8)])
    plan2 = decide(snap(pool(4), [svc("a", 24), svc("b", 0)], jobs, prev2))
    assert actions(plan2) == [("scale_inference_down", "b"), ("scale_inference_up", "a")]
    assert plan2.steps[1].target.after_drain and plan2.gpus_of("lo") == 8
    plan2.allocation.check_disjoint()


def test_every_step_carries_a_reason_and_numbers() -> None:
    prev = holding(chat=[("n0", 8)], t=[("n1", 8), ("n2", 8)])
    plan = decide(snap(pool(3), [svc("chat", 16)], [job("t").tab(table(8, 24))], prev))
    for s in plan.steps:
        assert s.reason in set(Reason)
        assert any(ch.isdigit() for ch in s.message)
    assert plan.to_plan().steps == plan.steps


# ---- inference targets -------------------------------------------------------------------------------

@pytest.mark.parametrize(("services", "pool_gpus", "expect"), [
    ([svc("a", 4), svc("b", 4)], 8, {"a": 4, "b": 4}),
    ([svc("a", 6), svc("b", 6)], 8, {"a": 4, "b": 4}),  # equal priority: fair share
    ([svc("a", 6, priority=200), svc("b", 6)], 8, {"a": 6, "b": 2}),
    ([svc("a", 6, min_replicas=1), svc("b", 9, priority=5, min_replicas=3)], 8, {"a": 5, "b": 3}),  # mins first
    ([svc("a", 2, gpus=4), svc("b", 4)], 8, {"a": 1, "b": 4}),
])
def test_inference_targets(services, pool_gpus, expect) -> None:
    assert inference_targets(tuple(services), pool_gpus) == expect


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "needle"), [
    (lambda: Snapshot(0, {"n0": 8}, (svc("x", 1),), (job("x").obj(),)), "unique"),
    (lambda: Snapshot(0, {}), "no nodes"),
    (lambda: JobState("j", {0: (Layout(1, 1, 1), 1.0)}), "GPU count"),
    (lambda: JobState("j", {8: (Layout(1, 1, 8), 1.0)}, min_gpus=16, max_gpus=8), "min_gpus"),
    # a layout still in its text form is refused where it enters the scheduler, naming the job and the count
    (lambda: JobState("j", {8: ("tp1.pp1.dp8", 1.0)}),
     r"job 'j': throughput\[8\] layout 'tp1.pp1.dp8' is a str, not a Layout"),
    (lambda: JobState("j", {8: (Layout(1, 1, 8), 1.0)}, layout="tp1.pp1.dp8"),  # type: ignore[arg-type]
     r"job 'j': layout 'tp1.pp1.dp8' is a str, not a Layout"),
    (lambda: ServiceDemand("s", -1), "replicas"),
])
def test_bad_input_is_rejected_with_the_field(make, needle) -> None:
    with pytest.raises(SpecError, match=needle):
        make()


def test_previous_allocation_problems_are_reported_not_fatal() -> None:
    from elastic.model import GPU, Allocation

    prev = Allocation({"t": (GPU("gone", 0), GPU("n0", 0)), "ghost": (GPU("n0", 1),)})
    plan = decide(snap(pool(1), [], [job("t").tab(table(1, 8, tp=1)).bounds(1)], prev))
    assert "gone" in plan.message and "ghost" in plan.message
    assert plan.gpus_of("t") == 8


def test_at_the_pool_limit_serving_replicas_are_not_moved_between_equal_services() -> None:
    prev = holding(a=[("n0", 8), ("n1", 8)], b=[("n2", 8), ("n3", 8)])
    # both want 3 nodes of a 4-node pool: each keeps its 2 rather than trading replicas
    plan = decide(snap(pool(4), [svc("a", 3, gpus=8), svc("b", 3, gpus=8)], [], prev))
    assert (plan.gpus_of("a"), plan.gpus_of("b")) == (16, 16)
    assert not [s for s in plan.steps if s.action != "noop"]
    assert plan.services["a"].reason == Reason.POOL_EXHAUSTED
    # a higher-priority service still takes what it needs
    plan = decide(snap(pool(4), [svc("a", 3, gpus=8, priority=200), svc("b", 3, gpus=8)], [], prev))
    assert (plan.gpus_of("a"), plan.gpus_of("b")) == (24, 8)


# ---- clearing nodes for a replica (eviction moves training, never shrinks it for nothing) ------------

@pytest.mark.parametrize(("jobs", "prev", "big_on", "keep"), [
    # training holds a slice of every node: the two nodes with the fewest training GPUs come free,
    # and the job moves those GPUs onto the other two nodes (16 before, 16 after)
    ([job("t").tab(table(2, 32, tp=2)).bounds(2)],
     holding(t=[("n0", 2), ("n1", 2), ("n2", 6), ("n3", 6)]), {"n0": 8, "n1": 8}, {"t": 16}),
    # the node whose training carries fewest tokens/s comes free, not the one with most free GPUs:
    # "dear" makes 1000 tokens/s per GPU on n1, "cheap" 10 per GPU on n0
    ([job("cheap").tab(table(2, 16, per_gpu=10, tp=2)).bounds(2),
      job("dear").tab(table(2, 16, per_gpu=1000, tp=2)).bounds(2)],
     holding(cheap=[("n0", 4), ("n3", 4)], dear=[("n1", 2), ("n2", 2)]), {"n0": 8, "n3": 8}, {"cheap": 8}),
], ids=["fewest-training-gpus", "fewest-tokens"])
def test_a_whole_node_replica_clears_the_cheapest_nodes_and_training_moves(jobs, prev, big_on, keep) -> None:
    nodes = pool(4)
    plan = decide(snap(nodes, [svc("big", 1, gpus=16)], jobs, prev))
    assert per_node(plan, "big") == big_on
    assert {j: plan.gpus_of(j) for j in keep} == keep, "training moved off the nodes instead of shrinking"
    plan.allocation.check_disjoint()
    moved = [s for s in plan.steps if s.workload in keep and s.action != "noop"]
    assert all("moves off node" in s.message or "gives back" in s.message for s in moved), moved
    assert ("scale_inference_up", "big") in actions(plan)


def test_no_training_is_evicted_for_a_whole_node_replica_that_cannot_place_anyway() -> None:
    # small replicas sit on three nodes; only n3 holds training alone: clearing it gives one
    # empty node of the two the replica needs, so training keeps its GPUs
    prev = holding(s=[("n0", 4), ("n1", 4), ("n2", 4)], t=[("n3", 4)])
    plan = decide(snap(pool(4), [svc("s", 12), svc("big", 1, gpus=16)], [job("t").tab(table(4, 16, tp=4)).bounds(4)],
                       prev))
    assert plan.gpus_of("t") == 4 and plan.gpus_of("big") == 0
    assert plan.services["big"].reason == Reason.POOL_EXHAUSTED
    assert not [s for s in plan.steps if s.workload == "t" and s.action != "noop"]


def test_a_job_evicted_from_a_node_for_a_replica_moves_onto_the_free_slices() -> None:
    # 2 + 2 GPUs free: no room for a 4-GPU replica until training leaves one node; it takes the
    # 2 + 4 GPUs still free afterwards instead of shrinking by its whole slice
    prev = holding(t=[("n0", 6), ("n1", 6)])
    plan = decide(snap(pool(2), [svc("s", 1, gpus=4)], [job("t").tab(table(2, 16, tp=2)).bounds(2)], prev))
    assert plan.gpus_of("s") == 4 and plan.gpus_of("t") == 12 and plan.idle_gpus == 0
    assert actions(plan) == [("shrink_training", "t"), ("scale_inference_up", "s")]
    assert "moves off node" in plan.jobs["t"].message
    plan.allocation.check_disjoint()
