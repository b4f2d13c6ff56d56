"""Property tests: over random pools, demands, jobs and previous allocations, no GPU is
double-booked, everything is inside the pool, inference gets min(demand, pool) and a running
job always holds a count its table has a layout for, with TP groups inside nodes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.model import Layout
from elastic.scheduler import JobState, Knobs, ServiceDemand, Snapshot, decide
from tests.scheduler.builders import table


@st.composite
def scenarios(draw):
    nodes = {f"n{i}": 8 for i in range(draw(st.integers(1, 6)))}
    total = 8 * len(nodes)
    services = tuple(ServiceDemand(f"s{i}", draw(st.integers(0, total)), 1, draw(st.integers(0, 3)))
                     for i in range(draw(st.integers(0, 3))))
    jobs = []
    for i in range(draw(st.integers(0, 3))):
        tp = draw(st.sampled_from([1, 2, 4, 8]))
        step = tp * draw(st.integers(1, 2))
        jobs.append(JobState(f"j{i}", table(step, 64, decay=draw(st.floats(0, 0.2)), tp=tp), min_gpus=step,
                             priority=draw(st.integers(0, 3))))
    steps = draw(st.lists(st.tuples(*[st.integers(0, total)] * max(len(services), 1)), min_size=1, max_size=4))
    return nodes, services, tuple(jobs), steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_allocations_are_disjoint_inside_the_pool_and_serve_inference_first(case) -> None:
    nodes, services, jobs, steps = case
    total = sum(nodes.values())
    plan = None
    for k, demands in enumerate(steps):
        svcs = tuple(ServiceDemand(s.name, demands[i], 1, s.priority) for i, s in enumerate(services))
        prev = plan.allocation if plan else Snapshot(0, nodes).previous
        plan = decide(Snapshot(k * 100.0, nodes, svcs, jobs, prev, Knobs(50.0, 0.05, 0)))
        plan.allocation.check_disjoint()
        for gpus in plan.allocation.holdings.values():
            assert all(g.node in nodes and 0 <= g.index < nodes[g.node] for g in gpus)
        inf = sum(plan.gpus_of(s.name) for s in svcs)
        assert inf == min(sum(s.replicas for s in svcs), total)
        used = sum(len(g) for g in plan.allocation.holdings.values())
        assert used + plan.idle_gpus == total
        for j in jobs:
            n = plan.gpus_of(j.name)
            assert n == 0 or n in j.feasible_counts()
            if n:
                layout = j.layout_at(n)
                assert isinstance(layout, Layout)
                tp = layout.tp
                per_node: dict[str, int] = {}
                for g in plan.allocation.gpus_of(j.name):
                    per_node[g.node] = per_node.get(g.node, 0) + 1
                assert all(c % tp == 0 for c in per_node.values()), (j.name, tp, per_node)
