"""Each stage of the replica calculation alone, table-driven (HPA v2 semantics)."""

from __future__ import annotations

import pytest

from elastic.model import Behavior
from elastic.policy import forecast as fc
from elastic.policy.stages import (
    DEFAULT_DOWN,
    DEFAULT_UP,
    Rule,
    Rules,
    bounds,
    effective_rules,
    fail_safe,
    raw_replicas,
    scale_down_limit,
    scale_up_limit,
    stabilize,
    within_tolerance,
)


@pytest.mark.parametrize(
    "metric,target,current,kind,want,ratio",
    [
        (42.0, 10.0, 1, "AverageValue", 5, 4.2),  # total 42, 10 per replica
        (30.0, 10.0, 3, "AverageValue", 3, 1.0),  # exactly at target
        (30.000000001, 10.0, 3, "AverageValue", 3, 1.0),  # float noise does not add a replica
        (0.0, 10.0, 4, "AverageValue", 0, 0.0),
        (0.9, 0.6, 4, "Value", 6, 1.5),  # 4 * 1.5
        (0.3, 0.6, 4, "Utilization", 2, 0.5),
        (5.0, 10.0, 0, "AverageValue", 1, 0.5),  # from zero: computed as if one replica ran
    ],
)
def test_raw_replicas(metric, target, current, kind, want, ratio) -> None:
    raw = raw_replicas(metric, target, current, kind)
    assert raw.replicas == want
    assert raw.ratio == pytest.approx(ratio, abs=1e-6)


def test_raw_message_shows_the_arithmetic() -> None:
    assert raw_replicas(42.0, 10.0, 1, "AverageValue").message == "load 42.0 / target 10.0 per replica -> 5 replicas"


@pytest.mark.parametrize(
    "ratio,up,down,inside",
    [
        (1.0, 0.1, 0.1, True), (1.08, 0.1, 0.1, True), (0.92, 0.1, 0.1, True),
        (1.12, 0.1, 0.1, False), (0.85, 0.1, 0.1, False),
        (1.12, 0.2, 0.0, True), (0.99, 0.2, 0.0, False),  # per-direction tolerance (HPA 1.33)
    ],
)
def test_tolerance(ratio, up, down, inside) -> None:
    assert within_tolerance(ratio, up, down) is inside


@pytest.mark.parametrize(
    "desired,current,history,up_w,down_w,want",
    [
        (5, 8, ((0.0, 8), (100.0, 6)), 0, 300, 8),  # down: highest recent (8) wins
        (5, 8, ((0.0, 8), (100.0, 6)), 0, 250, 6),  # the 8 left the 250 s window (now=260)
        (5, 8, (), 0, 300, 5),  # no history: go down at once
        (10, 4, ((200.0, 6),), 120, 300, 6),  # up window: lowest recent (6) caps the rise
        (10, 4, ((200.0, 6),), 0, 300, 10),  # default: scale up immediately
        (4, 4, ((200.0, 9),), 0, 300, 4),  # a flat desire is never raised by history
    ],
)
def test_stabilize(desired, current, history, up_w, down_w, want) -> None:
    assert stabilize(260.0, desired, current, history, up_w, down_w) == want


PODS4_PCT10_60 = Rules(0, "Max", (Rule("Pods", 4, 60), Rule("Percent", 10, 60)))


@pytest.mark.parametrize(
    "current,rules,events,want",
    [
        (3, DEFAULT_UP, (), 7),  # max(3 + 4, ceil(3 * 2))
        (10, DEFAULT_UP, (), 20),  # max(14, 20)
        (10, Rules(0, "Min", DEFAULT_UP.policies), (), 14),
        (10, Rules(0, "Disabled", DEFAULT_UP.policies), (), 10),
        (14, DEFAULT_UP, ((95.0, 4),), 20),  # period started at 10: max(10+4, 20)
        (20, DEFAULT_UP, ((95.0, 10),), 20),  # already used the period's 100 %
        (1, Rules(0, "Max", (Rule("Percent", 50, 60),)), (), 2),  # ceil(1.5): a percentage always moves
        (0, DEFAULT_UP, (), 4),  # from zero only the Pods policy can act
    ],
)
def test_scale_up_limit(current, rules, events, want) -> None:
    assert scale_up_limit(current, 100.0, events, rules) == want


@pytest.mark.parametrize(
    "current,rules,events,want",
    [
        (80, PODS4_PCT10_60, (), 72),  # Max change: 10 % of 80 = 8 beats 4 pods
        (72, PODS4_PCT10_60, (), 64),  # int(64.8) = 64: the docs' "rounded up to 8"
        (30, PODS4_PCT10_60, (), 26),  # below 40 the Pods policy is the larger change
        (80, Rules(0, "Min", PODS4_PCT10_60.policies), (), 76),  # Min change: 4 pods
        (80, Rules(0, "Disabled", PODS4_PCT10_60.policies), (), 80),
        (72, PODS4_PCT10_60, ((70.0, -8),), 72),  # same 60 s period: 80 -> 72 already used
        (10, DEFAULT_DOWN, (), 0),  # 100 % per 15 s
    ],
)
def test_scale_down_limit(current, rules, events, want) -> None:
    assert scale_down_limit(current, 100.0, events, rules) == want


@pytest.mark.parametrize("desired,lo,hi,want,which", [(5, 1, 10, 5, None), (12, 1, 10, 10, "max"), (0, 1, 10, 1, "min")])
def test_bounds(desired, lo, hi, want, which) -> None:
    assert bounds(desired, lo, hi) == (want, which)


@pytest.mark.parametrize(
    "desired,current,missing,stale,want",
    [(2, 6, True, False, 6), (9, 6, True, False, 6), (2, 6, False, True, 6), (9, 6, False, True, 9), (2, 6, False, False, 2)],
)
def test_fail_safe(desired, current, missing, stale, want) -> None:
    assert fail_safe(desired, current, missing, stale) == want


def test_effective_rules_fill_hpa_defaults_field_by_field() -> None:
    up, down = effective_rules(None)
    assert (up.window, up.select, down.window) == (0, "Max", 300)
    b = Behavior.model_validate({"scaleDown": {"stabilizationWindowSeconds": 60}})
    up, down = effective_rules(b)
    assert down.window == 60 and down.policies == DEFAULT_DOWN.policies and up == DEFAULT_UP
    b = Behavior.model_validate({"scaleUp": {"selectPolicy": "Min", "tolerance": 0.05,
                                             "policies": [{"type": "Pods", "value": 1, "periodSeconds": 30}]}})
    up, _ = effective_rules(b)
    assert up == Rules(0, "Min", (Rule("Pods", 1, 30),), 0.05)


@pytest.mark.parametrize(
    "slope,window,horizon,want",
    [(0.0, 600, 300, 50.0), (0.1, 600, 300, 50.0 + 0.1 * 300), (-0.05, 600, 120, 50.0 - 0.05 * 120)],
)
def test_trend_forecast_extrapolates_a_line(slope, window, horizon, want) -> None:
    now = 1000.0
    samples = tuple((t, 50.0 + slope * (t - now)) for t in range(int(now - window), int(now) + 1, 15))
    assert fc.trend_forecast(samples, now, horizon, window) == pytest.approx(want, rel=1e-6)


def test_trend_forecast_needs_half_a_window() -> None:
    samples = tuple((float(t), 1.0) for t in range(0, 200, 15))
    assert fc.trend_forecast(samples, 200.0, 60, 600) is None


def test_holt_winters_learns_a_season_and_forecasts_it() -> None:
    season, buckets = 1000.0, 20
    shape = [10.0 if (i % buckets) < 10 else 30.0 for i in range(buckets)]
    s = fc.holt_new(season, buckets)
    for t in range(0, 2000, 10):  # two seasons, 10 s ticks
        s = fc.holt_observe(s, float(t), shape[int(t / 50) % buckets])
    assert fc.holt_forecast(fc.holt_new(season, buckets), 0) is None
    assert s.ready
    # Mid-bucket forecasts in the third season reproduce the shape.
    assert fc.holt_forecast(s, 2000 + 5 * 50 + 25) == pytest.approx(10.0, abs=1.0)
    assert fc.holt_forecast(s, 2000 + 15 * 50 + 25) == pytest.approx(30.0, abs=1.0)
