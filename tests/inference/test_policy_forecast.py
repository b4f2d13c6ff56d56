"""The seasonal forecast's pieces: the season's rise, the ramp headroom, history, and its floors."""

from __future__ import annotations

import pytest

from elastic.model import InferenceSpec, MetricTarget
from elastic.policy import PolicyContext, PolicyState, decide
from elastic.policy import forecast as fc
from elastic.policy.replicas import remember

DAY = 86400.0


def _spec(**kw) -> InferenceSpec:
    base = dict(name="chat", gpus_per_replica=8, min_replicas=1, max_replicas=100, startup_seconds=300.0,
                metric=MetricTarget(preset="request-rate", type="AverageValue", target=10.0), forecast="holt-winters",
                behavior={"scaleUp": {"tolerance": 0.0}, "scaleDown": {"stabilizationWindowSeconds": 300}})
    base.update(kw)
    return InferenceSpec(**base)


def _day(t: float) -> float:
    """100 until 06:00, a ramp to 400 by 07:00, 400 after (t in seconds of the day)."""
    h = (t % DAY) / 3600.0
    return 100.0 if h < 6 else 400.0 if h >= 7 else 100.0 + 300.0 * (h - 6)


def test_ramp_headroom_is_the_recent_slope_times_the_horizon() -> None:
    samples = ((0.0, 100.0), (60.0, 110.0), (120.0, 120.0))
    assert fc.ramp_headroom(samples, 120.0, 300.0) == pytest.approx(50.0)
    falling = ((0.0, 120.0), (60.0, 110.0), (120.0, 100.0))
    assert fc.ramp_headroom(falling, 120.0, 300.0) == 0.0  # a fall adds nothing
    assert fc.ramp_headroom(samples[:2], 120.0, 300.0) is None  # too few readings


def test_seasonal_rise_is_yesterdays_ramp_over_the_horizon() -> None:
    s = fc.holt_new(DAY)
    for k in range(int(2 * DAY / 60)):
        s = fc.holt_observe(s, k * 60.0, _day(k * 60.0))
    assert fc.seasonal_rise(fc.holt_new(DAY), 0.0, 300.0) is None  # no season yet
    t = 2 * DAY + 6.25 * 3600  # mid-ramp: 300 load/h -> about 25 over 5 minutes
    assert fc.seasonal_rise(s, t, 300.0) == pytest.approx(25.0, abs=6.0)
    assert fc.seasonal_rise(s, 2 * DAY + 12 * 3600, 300.0) == pytest.approx(0.0, abs=1.0)  # flat afternoon


def _run(spec: InferenceSpec, state: PolicyState, t0: float, t1: float, load, dt: float = 60.0) -> list:
    cur, out = 10, []
    t = t0
    while t < t1:
        dec, state = decide(PolicyContext(spec, cur, load(t), t, state))
        cur = dec.replicas
        out.append((t, dec))
        t += dt
    return out


def test_history_lets_the_policy_scale_before_the_ramp_that_the_season_knows() -> None:
    spec = _spec()
    times = [k * 60.0 for k in range(int(2 * DAY / 60))]
    state = remember(spec, PolicyState(), times, [_day(t) for t in times])
    assert state.holt is not None and state.holt.ready
    out = _run(spec, state, 2 * DAY + 5.5 * 3600, 2 * DAY + 6.2 * 3600, _day)
    # at 06:00 the load is still 100 (10 replicas), but the next 5 minutes of the season add ~25
    at_six = next(d for t, d in out if t >= 2 * DAY + 6 * 3600)
    assert at_six.replicas >= 12 and at_six.forecast is not None
    # without history the same spec only sees the ramp once it shows in the readings
    cold = _run(spec, PolicyState(), 2 * DAY + 5.5 * 3600, 2 * DAY + 6.2 * 3600, _day)
    assert next(d for t, d in cold if t >= 2 * DAY + 6 * 3600).replicas == 10


def test_a_ramp_the_history_does_not_know_is_caught_by_the_ramp_headroom() -> None:
    spec = _spec()
    times = [k * 60.0 for k in range(int(2 * DAY / 60))]
    state = remember(spec, PolicyState(), times, [_day(t) for t in times])

    def early(t: float) -> float:  # today the ramp comes two hours early
        return _day(t + 2 * 3600)

    out = _run(spec, state, 2 * DAY + 3.5 * 3600, 2 * DAY + 4.5 * 3600, early)
    # ten minutes into the unexpected ramp (load 150 -> 15 replicas now) the policy already holds
    # replicas for the load a start-up ahead (load 175): slope 5/min x 5 min on top
    d = next(d for t, d in out if t >= 2 * DAY + 4 * 3600 + 600)
    assert d.replicas >= 17


def test_remember_touches_only_the_forecast() -> None:
    spec = _spec()
    state = remember(spec, PolicyState(), [0.0, 60.0, 120.0], [1.0, 2.0, 3.0])
    assert state.recommendations == () and state.events == () and state.readings == ()
    assert [y for _, y in state.samples] == [1.0, 2.0, 3.0]
    assert remember(_spec(metric=None), PolicyState(), [0.0], [1.0]) == PolicyState()


def test_the_season_is_looked_at_further_ahead_the_longer_a_start_up_takes() -> None:
    assert fc.season_lead(275.0) == pytest.approx(825.0)
    assert fc.season_lead(610.0) == fc.SEASON_LEAD == 1800.0  # capped: a ramp half an hour early at most
    assert fc.season_lead(0.0) == 0.0
