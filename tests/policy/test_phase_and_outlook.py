"""Today's phase against the season (how early the morning runs), the lead it allows, and the
outlook the co-scheduler lends by. Table-driven, no clock."""

from __future__ import annotations

import math

import pytest

from elastic.model import InferenceSpec, MetricTarget
from elastic.policy import PolicyContext, PolicyState, decide
from elastic.policy import forecast as fc
from elastic.policy.replicas import remember

DAY = 86400.0


def staircase(t: float) -> float:
    """100 until 06:00, then +30 every half hour (each step over 10 minutes) up to 250 at 08:30."""
    h = (t % DAY) / 3600.0
    steps = 0.0
    for k in range(5):
        start = 6.0 + 0.5 * k
        steps += min(max((h - start) / (10 / 60), 0.0), 1.0)
    return 100.0 + 30.0 * steps


def season() -> fc.HoltWintersState:
    s = fc.holt_new(DAY)
    for i in range(int(2 * DAY // 60)):
        s = fc.holt_observe(s, i * 60.0, staircase(i * 60.0))
    return s


SEASON = season()


def today(now: float, early: float, level: float = 0.0) -> tuple[tuple[float, float], ...]:
    return tuple((t, staircase(t + early) + level) for t in (now - 3600.0 + 60.0 * k for k in range(61)))


@pytest.mark.parametrize(
    ("clock", "early", "level", "expect"),
    [
        (7.5, 0.0, 0.0, 0.0),  # on time, two steps in the window
        (7.5, 1200.0, 0.0, 1200.0),  # twenty minutes early
        (7.5, -900.0, 0.0, -900.0),  # a quarter of an hour late
        (7.5, 1200.0, 6.0, 1200.0),  # a few percent busier than the season: the shape still fits
        (3.0, 1200.0, 0.0, None),  # a flat night says nothing about when the morning comes
        (5.9, 1500.0, 0.0, 1500.0),  # 25 minutes early: locked as soon as the first step is under way
    ],
    ids=["on-time", "early", "late", "busier", "flat-night", "first-step-early"],
)
def test_phase_offset(clock, early, level, expect) -> None:
    now = 2 * DAY + clock * 3600.0
    got = fc.phase_offset(SEASON, today(now, early, level), now, 1800.0)
    if expect is None:
        assert got is None
    else:
        assert got is not None and abs(got - expect) <= 360.0, got


def test_a_day_unlike_the_season_is_not_locked() -> None:
    # the morning two hours early: the window's rise matches no shift within half an hour
    now = 2 * DAY + 6.5 * 3600.0
    assert fc.phase_offset(SEASON, today(now, 7200.0), now, 1800.0) is None


@pytest.mark.parametrize(
    ("phase", "expect"),
    [(None, 1800.0), (0.0, 300.0), (1200.0, 1500.0), (-600.0, 300.0), (3600.0, 1800.0)],
    ids=["unknown", "on-time", "early", "late", "capped"],
)
def test_locked_lead(phase, expect) -> None:
    assert fc.locked_lead(610.0, phase, 300.0) == expect


def _spec() -> InferenceSpec:
    return InferenceSpec(name="chat", gpus_per_replica=8, min_replicas=2, max_replicas=100, startup_seconds=600.0,
                         metric=MetricTarget(preset="request-rate", type="AverageValue", target=10.0),
                         forecast="holt-winters")


def _state(spec: InferenceSpec, until: float) -> PolicyState:
    times = [float(t) for t in range(0, int(until), 60)]
    return remember(spec, PolicyState(), times, [staircase(t) for t in times])


def test_the_lead_shrinks_once_the_phase_is_locked() -> None:
    # mid-staircase on an on-time day: the forecast asks for the next step, not three of them
    spec = _spec()
    now = 2 * DAY + 7.6 * 3600.0
    state = _state(spec, now)
    dec, _ = decide(PolicyContext(spec, 20, staircase(now), now, state))
    full = fc.seasonal_rise(state.holt, now, spec.startup_seconds + fc.season_lead(spec.startup_seconds))
    assert full is not None
    assert dec.forecast is not None and dec.forecast < math.ceil((staircase(now) + full) / 10.0)
    assert dec.forecast >= math.ceil(staircase(now + spec.startup_seconds) / 10.0)  # still a start-up ahead


def test_outlook_is_the_season_at_todays_level_and_only_with_a_season() -> None:
    spec = _spec()
    now = 2 * DAY + 5.5 * 3600.0  # half an hour before the morning
    dec, _ = decide(PolicyContext(spec, 10, 100.0, now, _state(spec, now)))
    out = dict(dec.outlook)
    assert set(out) == set(fc.OUTLOOK_SECONDS)
    assert out[300.0] == 10 and out[7200.0] in (19, 20)  # 100 now; 190 at 07:30 (15-minute buckets blur it)
    assert list(out.values()) == sorted(out.values())
    fresh, _ = decide(PolicyContext(spec, 10, 100.0, now, PolicyState()))
    assert fresh.outlook == ()  # no season yet: the co-scheduler lends as without a forecast
    stale, _ = decide(PolicyContext(spec, 10, 100.0, now, _state(spec, now), stale=True))
    assert stale.outlook == ()
