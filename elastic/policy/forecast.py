"""Short-horizon load forecasts, so replicas start before a ramp arrives.

Two predictors, both pure and incremental:

* ``trend_forecast``: least-squares line through the load of the last window (default
  10 min), extrapolated to ``now + horizon``. Catches a ramp already under way.
* Holt-Winters (additive, one season, default a day): the load is averaged into fixed
  buckets (96 per season = 15 min for a day); after one full season the level, trend and
  seasonal components are initialised and updated once per closed bucket. The forecast for
  time T is ``level + trend * buckets_ahead + season(T)``, the seasonal term interpolated
  between bucket centres so that a 5-minute horizon sees the slope of yesterday's ramp.

``seasonal_rise`` turns the season into a safe look-ahead: how much the load rose over the
next ``horizon`` and ``season_lead`` more (a ramp may come early) on the days seen so far,
added to today's load (yesterday's ramp at today's level). ``ramp_headroom`` is the slope of
the last few minutes times the horizon, when the slope is more than noise. With
``holt-winters`` the policy forecasts ``max(trend, load now + max(seasonal rise, ramp
headroom), highest load of the last horizon)``: a day that ramps earlier than the season
says is still caught by the ramp headroom, and a day that stays flat while the season rises
only costs replicas, never the SLO. The policy takes
``max(reactive, forecast)``: a forecast only ever adds replicas early. Nothing here reads the
clock.
"""

from __future__ import annotations

import math
from dataclasses import replace

from elastic.policy.types import HoltWintersState

ALPHA, BETA, GAMMA = 0.3, 0.05, 0.3  # level, trend, season smoothing
DEFAULT_BUCKETS = 96
MIN_TREND_POINTS = 5


def trend_forecast(samples: tuple[tuple[float, float], ...], now: float, horizon: float,
                   window: float) -> float | None:
    """Load predicted at ``now + horizon`` from a line fitted over ``window`` seconds.

    None until the samples cover at least half the window (a line through 30 s of noise
    extrapolated 5 minutes is worse than no forecast). Load 10, 11, ..., 20 over 600 s with
    a 300 s horizon -> about 22.5.
    """
    pts = [(t, y) for t, y in samples if now - window <= t <= now]
    if len(pts) < MIN_TREND_POINTS or pts[-1][0] - pts[0][0] < window / 2:
        return None
    mt, my, var, slope = _fit(pts)
    if var <= 0:
        return my
    return max(0.0, my + slope * (now + horizon - mt))


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """Least squares through ``pts``: (mean t, mean y, sum of squared t deviations, slope; 0 when
    every t is the same)."""
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    slope = sum((t - mt) * (y - my) for t, y in pts) / var if var > 0 else 0.0
    return mt, my, var, slope


def holt_new(season_seconds: float, buckets: int = DEFAULT_BUCKETS) -> HoltWintersState:
    if season_seconds <= 0 or buckets < 2:
        raise ValueError(f"forecast_season_seconds must be > 0 and buckets >= 2 (got {season_seconds}, {buckets})")
    return HoltWintersState(season_seconds=season_seconds, buckets=buckets)


def holt_observe(state: HoltWintersState, t: float, load: float) -> HoltWintersState:
    """Add one observation; closes the current bucket when ``t`` has moved past it."""
    b = math.floor(t / state.bucket_seconds)
    if state.bucket is None:
        return replace(state, bucket=b, acc_sum=load, acc_n=1)
    if b <= state.bucket:  # same bucket (or a late sample): accumulate
        return replace(state, acc_sum=state.acc_sum + load, acc_n=state.acc_n + 1)
    closed = _close(state, state.bucket, state.acc_sum / state.acc_n)
    return replace(closed, bucket=b, acc_sum=load, acc_n=1)


def _close(s: HoltWintersState, bucket: int, y: float) -> HoltWintersState:
    m = s.buckets
    if s.level is None:
        # Before the first full season: buffer the means (gaps repeat the last mean).
        gap = 0 if s.last_closed is None else bucket - s.last_closed - 1
        first = s.first + (s.first[-1:] * gap if s.first else ()) + (y,)
        if len(first) < m:
            return replace(s, first=first, last_closed=bucket)
        first = first[-m:]
        level = sum(first) / m
        # season[i] belongs to the phase index (bucket mod m) of the buffered bucket.
        season = [0.0] * m
        for k, v in enumerate(first):
            season[(bucket - (m - 1) + k) % m] = v - level
        return replace(s, level=level, trend=0.0, season=tuple(season), first=(), last_closed=bucket)
    gap = max(1, bucket - (s.last_closed or bucket - 1))
    i = bucket % m
    prev_level = s.level + s.trend * (gap - 1)  # skipped buckets: carry the line forward
    level = ALPHA * (y - s.season[i]) + (1 - ALPHA) * (prev_level + s.trend)
    trend = BETA * (level - s.level) / gap + (1 - BETA) * s.trend
    season = list(s.season)
    season[i] = GAMMA * (y - level) + (1 - GAMMA) * s.season[i]
    return replace(s, level=level, trend=trend, season=tuple(season), last_closed=bucket)


def holt_forecast(state: HoltWintersState | None, at: float) -> float | None:
    """Load predicted at time ``at``; None before one full season has been seen."""
    if state is None or state.level is None or state.last_closed is None:
        return None
    L = state.bucket_seconds
    last_center = (state.last_closed + 0.5) * L
    ahead = (at - last_center) / L
    pos = at / L - 0.5  # position in bucket-centre units, for interpolation
    lo = math.floor(pos)
    frac = pos - lo
    m = state.buckets
    season = (1 - frac) * state.season[lo % m] + frac * state.season[(lo + 1) % m]
    return max(0.0, state.level + state.trend * ahead + season)


def seasonal_rise(state: HoltWintersState | None, now: float, horizon: float, points: int = 6) -> float | None:
    """Largest rise of the seasonal forecast between ``now`` and any time up to ``now + horizon``
    (never negative); None before one full season. The season's increment, not its level: a day
    that runs 10% above the last ones still gets the last ones' ramp on top of its own load.
    Season 10 at 06:00 and 40 at 06:15, horizon 5 min -> a rise of about 10 (interpolated)."""
    base = holt_forecast(state, now)
    if base is None:
        return None
    ahead = [holt_forecast(state, now + horizon * k / points) for k in range(1, points + 1)]
    return max(0.0, max(a for a in ahead if a is not None) - base)

SEASON_LEAD = 1800.0  # the season's rise is looked for up to this far beyond the horizon: a ramp may come early
SEASON_LEAD_HORIZONS = 3.0  # ... and no further than this many horizons


def season_lead(horizon: float) -> float:
    """How far beyond the horizon the season's rise is looked for. A ramp that comes early is
    caught by the ramp headroom a few readings in, plus a start-up: the longer the start-up, the
    more of an early ramp only the season can cover. Horizon 275 s -> 825 s; 610 s -> 1800 s."""
    return min(SEASON_LEAD, SEASON_LEAD_HORIZONS * horizon)
RAMP_Z = 2.0  # standard errors a slope must clear to count as a ramp
RAMP_WINDOW = 240.0  # seconds of load the ramp rate is measured over: a few ticks, so a ramp that just began shows


def ramp_headroom(samples: tuple[tuple[float, float], ...], now: float, horizon: float,
                  window: float = RAMP_WINDOW) -> float | None:
    """Load the current ramp adds over ``horizon``: the least-squares slope of the last ``window``
    seconds (at least 3 readings) times the horizon, never negative. Shorter than the trend's
    window on purpose: a 10-minute line still averages the flat trough into a ramp that began
    3 minutes ago. Load 100, 110, 120 at 60 s steps, horizon 300 s -> 50."""
    pts = [(t, y) for t, y in samples if now - window <= t <= now]
    if len(pts) < 3:
        return None
    mt, my, var, slope = _fit(pts)
    if var <= 0:
        return 0.0
    n = len(pts)
    # a ramp, not noise: the slope must stand RAMP_Z standard errors clear of zero
    resid = sum((y - my - slope * (t - mt)) ** 2 for t, y in pts) / max(n - 2, 1)
    if slope <= RAMP_Z * math.sqrt(resid / var):
        return 0.0
    return slope * horizon
