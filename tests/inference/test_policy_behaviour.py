"""The whole policy against the HPA's and KEDA's documented behaviour, forecasting and fail-safe.

The HPA examples come from the Kubernetes docs, "Horizontal Pod Autoscaling" (algorithm
details, stabilisation window, scaling policies); the activation rule from KEDA's
``activationThreshold`` docs.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from pydantic import ValidationError

from elastic.model import InferenceSpec
from elastic.policy import PolicyContext, PolicyState, Reason, ReplicaDecision, decide
from elastic.serve.profiles import diurnal_rate


def make_spec(**kw: Any) -> InferenceSpec:
    """Builder: a chat service targeting 10 requests per replica unless told otherwise."""
    metric = {"preset": "vllm-requests", "target": 10.0, **kw.pop("metric", {})}
    base = {"name": "chat", "min_replicas": 1, "max_replicas": 100, "metric": metric}
    return InferenceSpec.model_validate({**base, **kw})


def run(spec: InferenceSpec, loads: Iterable[float | None], start: int, dt: float = 15.0,
        t0: float = 0.0, stale: Sequence[bool] | None = None) -> list[ReplicaDecision]:
    """Feed one reading per tick and apply every decision (a perfect actuator)."""
    state, cur, out = PolicyState(), start, []
    for i, load in enumerate(loads):
        ctx = PolicyContext(spec, cur, load, t0 + i * dt, state, stale=bool(stale and stale[i]))
        d, state = decide(ctx)
        out.append(d)
        cur = d.replicas
    return out


def direction_changes(replicas: Sequence[int]) -> int:
    steps = [b - a for a, b in zip(replicas, replicas[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))


# ---- HPA documented behaviour ------------------------------------------------------------------


@pytest.mark.parametrize(
    "load,want,reason",
    [
        (42.0, 4, Reason.WITHIN_TOLERANCE),  # ratio 1.05: inside the 0.1 band
        (37.0, 4, Reason.WITHIN_TOLERANCE),  # ratio 0.925
        (46.0, 5, Reason.SCALED_UP),  # ratio 1.15 -> ceil(4.6)
        (80.0, 8, Reason.SCALED_UP),
        (200.0, 8, Reason.LIMITED_BY_RATE),  # wants 20; 4 pods or 100 % per 15 s -> 8
        (40.5, 4, Reason.WITHIN_TOLERANCE),
    ],
)
def test_tolerance_band_and_scale_up(load, want, reason) -> None:
    d = run(make_spec(), [load], start=4)[0]
    assert (d.replicas, d.reason) == (want, reason), d.message


def test_message_carries_the_arithmetic() -> None:
    d = run(make_spec(), [42.0], start=1)[0]
    assert d.message.startswith("load 42.0 / target 10.0 per replica -> 5 replicas")


def test_scale_down_stabilisation_picks_the_max_recommendation() -> None:
    # Recommendations 8, 5, 6, 3 ... the count follows the highest one of the last 300 s.
    loads = [80.0] + [50.0] * 4 + [60.0] + [30.0] * 30  # ticks every 15 s
    ds = run(make_spec(), loads, start=8)
    reps = [d.replicas for d in ds]
    assert reps[:20] == [8] * 20  # the 80 at t=0 is in the window until t=300
    assert ds[1].reason == Reason.STABILIZING
    assert reps[20] == 6  # t=300: the 8 left; the 6 (t=75) is the highest left
    assert reps[25] == 3  # t=375: the 6 left too
    assert all(r in (8, 6, 3) for r in reps)


def test_scale_up_stabilisation_picks_the_min_recommendation() -> None:
    spec = make_spec(behavior={"scaleUp": {"stabilizationWindowSeconds": 60}})
    ds = run(spec, [60.0, 90.0, 90.0, 90.0, 90.0, 90.0], start=4)
    assert [d.replicas for d in ds] == [6, 6, 6, 6, 9, 9]  # the 6 caps the rise until it leaves 60 s


@pytest.mark.parametrize(
    "select,want",
    [
        # Docs: 80 replicas -> 10, Pods 4 / Percent 10 per 60 s. Max: 8 per minute while above 40.
        ("Max", [72, 72, 72, 72, 64, 64, 64, 64, 57]),
        ("Min", [76, 76, 76, 76, 72, 72, 72, 72, 68]),  # the smaller change: 4 pods
        ("Disabled", [80] * 9),
    ],
)
def test_percent_vs_pods_with_select_policy(select, want) -> None:
    spec = make_spec(behavior={"scaleDown": {
        "stabilizationWindowSeconds": 0, "selectPolicy": select,
        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 60},
                     {"type": "Percent", "value": 10, "periodSeconds": 60}]}})
    ds = run(spec, [100.0] * 9, start=80)
    assert [d.replicas for d in ds] == want
    assert ds[1].reason == Reason.LIMITED_BY_RATE


def test_limited_by_max_and_min() -> None:
    spec = make_spec(min_replicas=2, max_replicas=6)
    d = run(spec, [500.0], start=5)[0]
    assert (d.replicas, d.reason) == (6, Reason.LIMITED_BY_MAX)
    spec = make_spec(min_replicas=2, max_replicas=6, behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    d = run(spec, [0.0], start=5)[0]
    assert (d.replicas, d.reason) == (2, Reason.LIMITED_BY_MIN)
    d = run(make_spec(min_replicas=2, max_replicas=6), [50.0], start=9)[0]  # spec lowered max
    assert (d.replicas, d.reason) == (6, Reason.LIMITED_BY_MAX)


# ---- KEDA-style activation ---------------------------------------------------------------------


def test_activation_from_zero_and_back() -> None:
    spec = make_spec(min_replicas=0, metric={"activationThreshold": 5.0})
    ds = run(spec, [0.0, 3.0, 5.0], start=0)
    assert [d.replicas for d in ds] == [0, 0, 0]  # at or below the threshold: stay at zero
    d = run(spec, [6.0], start=0)[0]
    assert (d.replicas, d.reason) == (1, Reason.ACTIVATED)  # 6 > 5 -> ceil(6 / 10) = 1
    d = run(spec, [35.0], start=0)[0]
    assert (d.replicas, d.reason) == (4, Reason.ACTIVATED)
    # Idle again: back to zero only after the scale-down window (KEDA's cooldown role).
    ds = run(spec, [20.0] + [2.0] * 25, start=2)
    reps = [d.replicas for d in ds]
    assert reps[19] == 2 and reps[20] == 0 and ds[20].reason == Reason.DEACTIVATED


def test_no_activation_without_min_zero() -> None:
    d = run(make_spec(min_replicas=1, metric={"activationThreshold": 5.0}), [0.0], start=1)[0]
    assert d.replicas == 1


# ---- no flapping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("forecast", ["off", "trend"])
def test_no_flapping_on_noisy_flat_load(seed, forecast) -> None:
    rng = random.Random(seed)
    loads = [40.0 * (1 + rng.uniform(-0.15, 0.15)) for _ in range(40)]  # 10 min at 15 s ticks
    ds = run(make_spec(forecast=forecast), loads, start=4)
    reps = [d.replicas for d in ds]
    assert direction_changes(reps) < 2, reps
    assert max(reps) <= 6 and min(reps) >= 4


# ---- forecast ------------------------------------------------------------------------------------


def short_of_capacity(ds: Sequence[ReplicaDecision], loads: Sequence[float], dt: float, startup: float,
                      window: tuple[float, float]) -> float:
    """Share of ticks in ``window`` where the replicas *ready* (decided ``startup`` ago)
    cannot carry the load even at the tolerance edge: the time users wait on a ramp."""
    lag = int(startup / dt)
    ticks = [i for i, d in enumerate(ds) if window[0] <= d.at < window[1]]
    short = [i for i in ticks if ds[i - lag].replicas * 10.0 * 1.1 < loads[i]]
    return len(short) / len(ticks)


@pytest.mark.parametrize("method", ["holt-winters", "trend"])
def test_forecast_scales_up_before_the_morning_ramp(method) -> None:
    # A day compressed to 4 h (as in the demo), 15 s ticks, replicas need 5 min to start:
    # the ramp (06:00-10:00 -> 40 min here) adds ~19 load units, ~2 replicas, per start-up time.
    day, dt, startup = 14400.0, 15.0, 300.0
    rng = random.Random(1)
    loads = [diurnal_rate(i * dt / day, 200.0) * (1 + rng.uniform(-0.03, 0.03)) for i in range(int(3 * day / dt))]
    spec = make_spec(startup_seconds=startup, forecast_season_seconds=day)
    reactive = run(spec, loads, start=5, dt=dt)
    ahead = run(spec.model_copy(update={"forecast": method}), loads, start=5, dt=dt)
    ramp = (2 * day + 6 / 24 * day, 2 * day + 10 / 24 * day)  # day 3: Holt-Winters has seen two days
    # 1. Replicas ready now (asked for startup ago) fall short on the ramp when only reacting.
    late_reactive = short_of_capacity(reactive, loads, dt, startup, ramp)
    late_forecast = short_of_capacity(ahead, loads, dt, startup, ramp)
    assert late_reactive > 0.5, late_reactive
    assert late_forecast < 0.5 * late_reactive, (late_forecast, late_reactive)
    # 2. The forecast run already has now what the reactive run will ask for startup later.
    lag = int(startup / dt)
    ticks = [i for i, d in enumerate(reactive) if ramp[0] <= d.at < ramp[1]]
    ready_early = sum(ahead[i].replicas >= reactive[i + lag].replicas for i in ticks) / len(ticks)
    ready_reactive = sum(reactive[i].replicas >= reactive[i + lag].replicas for i in ticks) / len(ticks)
    assert ready_early > 2 * ready_reactive and ready_early > 0.3, (ready_early, ready_reactive)
    # 3. The reason says when the forecast drove the answer. On the plateau it keeps at most the
    #    one replica it overshot the ramp's end by (the tolerance band then holds it), never fewer.
    assert any(d.reason == Reason.FORECAST for d in ahead if ramp[0] <= d.at < ramp[1])
    plateau = [(a, b) for a, b in zip(ahead, reactive, strict=True) if 2 * day + day / 2 <= a.at < 2 * day + 0.7 * day]
    assert all(b.replicas <= a.replicas <= b.replicas + 1 for a, b in plateau)


# ---- fail-safe -----------------------------------------------------------------------------------


def test_metrics_disappear_at_high_load_then_return() -> None:
    loads: list[float | None] = [100.0] * 4 + [None] * 80 + [100.0] * 4 + [20.0] * 30
    ds = run(make_spec(), loads, start=10)
    gap = ds[4:84]
    assert all(d.replicas == 10 and d.reason == Reason.METRICS_MISSING for d in gap)  # 20 min: hold
    assert "missing" in gap[0].message
    assert [d.replicas for d in ds[84:88]] == [10] * 4  # back: normal decisions, still 10
    assert ds[85].reason == Reason.WITHIN_TOLERANCE
    low = ds[88:]
    # Scale-down waits out the window counted from the *return* of the metric, then acts.
    assert all(d.replicas == 10 for d in low[:16]) and low[-1].replicas == 2


def test_stale_metrics_never_shrink_but_may_grow() -> None:
    ds = run(make_spec(behavior={"scaleDown": {"stabilizationWindowSeconds": 0}}),
             [10.0, 150.0], start=8, stale=[True, True])
    assert (ds[0].replicas, ds[0].reason) == (8, Reason.METRICS_MISSING)
    assert ds[1].replicas == 15


def test_missing_metric_at_zero_stays_at_zero() -> None:
    d = run(make_spec(min_replicas=0), [None], start=0)[0]
    assert (d.replicas, d.reason) == (0, Reason.METRICS_MISSING)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"metric": {"target": 0.0}}, "metric.target"),
        ({"metric": {"target": -3.0}}, "metric.target"),
        ({"min_replicas": 5, "max_replicas": 2}, "min_replicas"),
        ({"behavior": {"scaleUp": {"selectPolicy": "Sometimes"}}}, "behavior.scaleUp.selectPolicy"),
        ({"behavior": {"scaleDown": {"policies": [{"type": "Pods", "value": 0, "periodSeconds": 15}]}}},
         "behavior.scaleDown.policies.0.value"),
    ],
)
def test_bad_spec_names_the_field(kw, field) -> None:
    with pytest.raises(ValidationError) as e:
        make_spec(**kw)
    text = str(e.value)
    assert field.split(".")[-1] in text and (field in text or "min_replicas" in text), text


def test_policy_is_deterministic_and_clock_free() -> None:
    loads = [40.0, 90.0, 10.0, None, 70.0]
    a = run(make_spec(forecast="trend"), loads, start=3, t0=1e9)
    b = run(make_spec(forecast="trend"), loads, start=3, t0=1e9)
    assert a == b


# ---- the metric's averaging window (windowSeconds) ---------------------------------------------


def _jittery(mean: float, n: int, seed: int) -> list[float]:
    """A running-requests gauge: Poisson-like jitter of +-sqrt(mean) around ``mean``."""
    rng = random.Random(seed)
    return [max(0.0, rng.gauss(mean, mean ** 0.5)) for _ in range(n)]


def test_window_off_is_the_hpa_rule() -> None:
    assert make_spec().metric.window_seconds == 0
    # one low reading shrinks at once when nothing smooths it (stabilisation window 0)
    spec = make_spec(behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    d = run(spec, [40.0, 40.0, 12.0], start=4, dt=2.0)
    assert [x.replicas for x in d] == [4, 4, 2]


def test_window_holds_replicas_through_a_dip_and_says_why() -> None:
    spec = make_spec(metric={"windowSeconds": 10}, behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    d = run(spec, [40.0, 40.0, 40.0, 40.0, 12.0], start=4, dt=2.0)
    # mean of 5 readings over 10 s = 34.4 -> ceil(3.44) = 4: the dip does not drain anyone
    assert d[-1].replicas == 4
    assert "mean of 5 readings over 10s 34.4 > latest 12" in d[-1].message
    assert d[-1].metric == 12.0  # the decision records the raw reading


def test_window_shrinks_once_the_load_really_fell() -> None:
    spec = make_spec(metric={"windowSeconds": 10}, behavior={"scaleDown": {"stabilizationWindowSeconds": 0}})
    d = run(spec, [40.0] * 5 + [12.0] * 6, start=4, dt=2.0)
    got = [x.replicas for x in d]
    assert got[-1] == 2  # 10 s after the fall only low readings are left in the window
    assert got.index(2) >= 8  # ... and not before most of the window saw the fall
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))  # monotone on the way down


def test_window_never_delays_a_scale_up() -> None:
    loads = [10.0] * 10 + [80.0]
    smoothed = run(make_spec(metric={"windowSeconds": 60}), loads, start=1, dt=2.0)[-1]
    plain = run(make_spec(), loads, start=1, dt=2.0)[-1]
    assert smoothed.replicas == plain.replicas > 1  # acts on the latest reading, as without a window
    assert smoothed.reason == plain.reason and "mean of" not in smoothed.message


def test_window_damps_flapping_under_a_short_scale_down_window() -> None:
    # A running-requests gauge read every 2 s with a 6 s scale-down window (the demo's): the
    # window does not buy fewer replicas on a steady load, it stops draining on every dip.
    for mean in (20.0, 40.0):
        flaps, seconds = {}, {}
        for window in (0, 10):
            spec = make_spec(metric={"target": 6.5, "windowSeconds": window},
                             behavior={"scaleDown": {"stabilizationWindowSeconds": 6}})
            got = [[x.replicas for x in run(spec, _jittery(mean, 300, seed), start=2, dt=2.0)] for seed in range(5)]
            flaps[window] = sum(direction_changes(r) for r in got)
            seconds[window] = sum(sum(r) for r in got)
        assert flaps[10] < 0.85 * flaps[0], (mean, flaps)
        assert seconds[10] < 1.03 * seconds[0], (mean, seconds)  # at a cost of at most 3 % replica-time


def test_window_must_not_be_negative() -> None:
    with pytest.raises(ValidationError, match="window_seconds|windowSeconds"):
        make_spec(metric={"windowSeconds": -1})


# ---- the noise margin (noiseMargin) -----------------------------------------------------------


def _margin_spec(z: float, **kw: Any) -> InferenceSpec:
    behavior = kw.pop("behavior", {"scaleDown": {"stabilizationWindowSeconds": 0}})
    return make_spec(metric={"target": 13.0, "noiseMargin": z, **kw.pop("metric", {})}, behavior=behavior,
                     max_replicas=6, **kw)


def test_noise_margin_keeps_a_replica_through_a_dip_of_one_sigma_and_says_why() -> None:
    # the demo's plateau: 70 requests on 6 replicas of 13; a reading of 62 is one sqrt(70) below
    plain = run(_margin_spec(0.0), [62.0], start=6, dt=2.0)[-1]
    assert (plain.replicas, plain.reason) == (5, Reason.SCALED_DOWN)
    kept = run(_margin_spec(0.5), [62.0], start=6, dt=2.0)[-1]
    assert (kept.replicas, kept.reason) == (6, Reason.WITHIN_TOLERANCE)
    assert "noise margin 0.5 x sqrt(load) = 65.9 -> 6 replicas" in kept.message
    assert "may be noise" in kept.message


@pytest.mark.parametrize("load,z,want", [
    (55.0, 0.5, 5),  # 55 + 3.7 = 58.7 <= 65
    (61.0, 0.5, 5),  # 61 + 3.9 = 64.9 <= 65: just fits
    (61.5, 0.5, 6),  # 65.4 > 65
    (20.0, 0.5, 2),  # a fall by four replicas: 20 + 2.2 -> ceil(22.2 / 13) = 2
    (20.0, 2.0, 3),  # 20 + 8.9 = 28.9 -> 3: the margin can stop a fall part-way
    (0.0, 1.0, 1),   # nothing running: the minimum
])
def test_noise_margin_arithmetic(load: float, z: float, want: int) -> None:
    assert run(_margin_spec(z), [load], start=6, dt=2.0)[-1].replicas == want


def test_noise_margin_never_touches_a_scale_up() -> None:
    for load in (70.0, 90.0):
        with_margin = run(_margin_spec(2.0), [load], start=2, dt=2.0)[-1]
        assert with_margin.replicas == run(_margin_spec(0.0), [load], start=2, dt=2.0)[-1].replicas > 2


def test_noise_margin_stops_flapping_on_a_steady_load_and_still_follows_a_fall() -> None:
    # Poisson-like readings every 2 s around 70 (6 replicas of 13 needed: 70 / 13 = 5.4), the
    # demo's 6 s scale-down window and 3 s mean: without a margin the dips drain a replica the
    # load needs again seconds later; with 0.5 they do so at most a third as often
    flaps = {}
    for z in (0.0, 0.5):
        spec = _margin_spec(z, metric={"windowSeconds": 3}, behavior={"scaleDown": {"stabilizationWindowSeconds": 6}})
        flaps[z] = sum(sum(1 for a, b in zip(r, r[1:], strict=False) if b < a)
                       for r in ([x.replicas for x in run(spec, _jittery(70.0, 150, seed), start=6, dt=2.0)]
                                 for seed in range(8)))
    assert flaps[0.0] >= 3 and flaps[0.5] * 3 <= flaps[0.0], flaps
    # ... and a real fall (to 31 requests: three replicas) is followed all the way down
    spec = _margin_spec(0.5, metric={"windowSeconds": 3}, behavior={"scaleDown": {"stabilizationWindowSeconds": 6}})
    assert run(spec, [70.0] * 3 + [31.0] * 12, start=6, dt=2.0)[-1].replicas == 3


def test_noise_margin_is_for_counts_only_and_bounded() -> None:
    with pytest.raises(ValidationError, match="noiseMargin.*AverageValue"):
        make_spec(metric={"type": "Utilization", "target": 0.6, "noiseMargin": 0.5})
    with pytest.raises(ValidationError, match="noise_margin|noiseMargin"):
        make_spec(metric={"noiseMargin": -1})
    assert make_spec().metric.noise_margin == 0.0  # off unless asked for


# ---- drain ahead ------------------------------------------------------------------------------


def _drain_ahead_spec(**kw: Any) -> InferenceSpec:
    return make_spec(drain_ahead_seconds=kw.pop("ahead", 6), behavior={"scaleDown": {
        "stabilizationWindowSeconds": 8, "policies": kw.pop("policies", [{"type": "Pods", "value": 10,
                                                                           "periodSeconds": 1}])}}, **kw)


def test_drain_ahead_names_the_replicas_the_window_will_remove_and_they_leave_on_time() -> None:
    # window 8 s, ahead 6 s, one tick per 2 s: the lower recommendation has held for 2 s at the
    # first low tick (the window shortened to 2 s holds only it), the scale-down comes 6 s later
    ds = run(_drain_ahead_spec(), [50, 50, 30, 30, 30, 30, 30], start=5, dt=2.0)
    assert [(d.replicas, d.leaving) for d in ds] == [(5, 0), (5, 0), (5, 2), (5, 2), (5, 2), (3, 0), (3, 0)]
    assert "drain ahead: 2 replica(s)" in ds[2].message and ds[2].reason == Reason.STABILIZING


def test_drain_ahead_goes_back_to_zero_when_the_load_returns_and_is_off_by_default() -> None:
    ds = run(_drain_ahead_spec(), [50, 30, 50, 50], start=5, dt=2.0)
    assert [d.leaving for d in ds] == [0, 2, 0, 0]
    assert [d.leaving for d in run(make_spec(behavior={"scaleDown": {"stabilizationWindowSeconds": 8}}),
                                   [50, 30, 30, 30], start=5, dt=2.0)] == [0, 0, 0, 0]


def test_drain_ahead_keeps_to_the_rate_policy_and_the_minimum() -> None:
    one_per_10s = [{"type": "Pods", "value": 1, "periodSeconds": 10}]
    ds = run(_drain_ahead_spec(policies=one_per_10s), [50, 10, 10], start=5, dt=2.0)
    assert [d.leaving for d in ds] == [0, 1, 1]  # the load wants 1 replica; the rate lets 1 go
    ds = run(_drain_ahead_spec(min_replicas=4), [50, 10, 10], start=5, dt=2.0)
    assert [d.leaving for d in ds] == [0, 1, 1]
    assert run(_drain_ahead_spec(min_replicas=5), [50, 10], start=5, dt=2.0)[-1].leaving == 0


def test_drain_ahead_never_acts_on_missing_or_stale_metrics() -> None:
    assert [d.leaving for d in run(_drain_ahead_spec(), [50, None, None], start=5, dt=2.0)] == [0, 0, 0]
    ds = run(_drain_ahead_spec(), [50, 30, 30], start=5, dt=2.0, stale=[False, True, True])
    assert [d.leaving for d in ds] == [0, 0, 0]


def test_drain_ahead_must_not_be_negative() -> None:
    with pytest.raises(ValidationError, match="drain_ahead_seconds"):
        _drain_ahead_spec(ahead=-1)
