"""A request-rate metric's backlog: the waiting requests are served over one start-up horizon.

A rate says how fast requests arrive, not how many already wait; the caller gives the waiting
ones beside it (``PolicyContext.backlog``). The replicas ordered now find the backlog as it
will be one horizon on (today's plus its growth) and serve it over one more: a backlog that
persists or grows adds replicas, and one tick's queue does not turn into a load spike.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from elastic.model import InferenceSpec, MetricTarget
from elastic.policy import PolicyContext, PolicyState, Reason, decide


def _spec(metric_type: str = "AverageValue", preset: str = "request-rate", **kw: Any) -> InferenceSpec:
    target = 10.0 if metric_type == "AverageValue" else 0.8
    base: dict[str, Any] = dict(name="chat", min_replicas=1, max_replicas=100, startup_seconds=300.0,
                                metric=MetricTarget(preset=preset, type=metric_type, target=target),
                                behavior={"scaleUp": {"tolerance": 0.0}, "scaleDown": {"tolerance": 0.0}})
    base.update(kw)
    return InferenceSpec(**base)


@pytest.mark.parametrize(("rate", "backlog", "startup", "expect"), [
    (95.0, None, 300.0, 10),  # no backlog read: the rate alone
    (95.0, 0.0, 300.0, 10),
    (99.0, 300.0, 300.0, 10),  # 30 s of a 10/s overload: +1/s over the horizon, no spike
    (100.0, 600.0, 300.0, 11),  # +2/s: 102/s needs an eleventh replica
    (100.0, 3000.0, 300.0, 11),  # +10/s
    (100.0, 3001.0, 300.0, 12),
    (100.0, 150.0, 0.0, 11),  # replicas that start at once: drained within the 15 s floor, +10/s
    (95.0, math.nan, 300.0, 10),  # not a count: as if not read
    (95.0, -50.0, 300.0, 10),
], ids=["none", "zero", "one-tick", "persisting", "exactly-one-more", "just-over", "instant-start", "nan",
        "negative"])
def test_a_backlog_adds_what_serves_it_within_the_horizon(rate, backlog, startup, expect) -> None:
    spec = _spec(startup_seconds=startup)
    dec, _ = decide(PolicyContext(spec, 10, rate, 1000.0, PolicyState(), backlog=backlog))
    assert dec.replicas == expect, dec.message
    if expect > 10:
        assert dec.reason == Reason.SCALED_UP and "backlog" in dec.message


def test_a_metric_per_replica_ignores_a_backlog() -> None:
    # vllm-kv-cache is an average per replica: a queue length is no load in its units
    spec = _spec("Utilization", "vllm-kv-cache")
    dec, _ = decide(PolicyContext(spec, 10, 0.8, 1000.0, PolicyState(), backlog=5000.0))
    assert dec.replicas == 10, dec.message


def test_the_forecast_learns_the_arrival_rate_not_the_backlog() -> None:
    spec = _spec(forecast="holt-winters")
    state = PolicyState()
    for i in range(5):
        _, state = decide(PolicyContext(spec, 10, 90.0, 1000.0 + 60 * i, state, backlog=6000.0))
    assert [y for _, y in state.samples] == [90.0] * 5
    assert all(y == 90.0 for _, y in state.day)


@pytest.mark.parametrize(("waiting", "expect"), [(600.0, 600.0), (None, None), (math.inf, None), (-1.0, None)])
def test_from_sample_takes_the_waiting_requests_beside_the_rate(waiting, expect) -> None:
    from elastic.metrics.sample import MetricSample

    rate = MetricSample(100.0, 1000.0, "test")
    backlog = None if waiting is None else MetricSample(waiting, 1000.0, "test")
    ctx = PolicyContext.from_sample(_spec(), 10, rate, 1000.0, backlog=backlog)
    assert (ctx.metric, ctx.backlog) == (100.0, expect)


@pytest.mark.parametrize(("first", "second", "expect"), [
    (0.0, 420.0, 11),  # growing 7/s: the ordered replicas find 420 + 7 x 300 waiting: 97 + 1.4 + 7 -> 11
    (300.0, 420.0, 11),  # growing 2/s: 97 + 1.4 + 2 = 100.4 -> 11
    (600.0, 420.0, 10),  # shrinking: the replicas there serve it; 97 + 1.4 -> 10
    (420.0, 420.0, 10),  # steady: 98.4 -> 10
], ids=["from-empty", "growing", "shrinking", "steady"])
def test_a_growing_backlog_counts_what_it_will_be_when_the_replicas_serve(first, second, expect) -> None:
    spec = _spec()
    _, state = decide(PolicyContext(spec, 10, 97.0, 1000.0, PolicyState(), backlog=first))
    dec, state = decide(PolicyContext(spec, 10, 97.0, 1060.0, state, backlog=second))
    assert dec.replicas == expect, dec.message
    assert state.waiting == (1060.0, second)
    assert ("growing" in dec.message) == (second > first)
