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
added to today's load (yesterday's ramp at today's level). ``phase_offset`` fits the season's
shape to the last hour of today's load to find how early today runs; once that is known,
``locked_lead`` shrinks the lead to it plus a margin. ``seasonal_outlook`` is the season's load
up to two hours ahead at today's level, for the co-scheduler's lending (never for sizing). ``ramp_headroom`` is the slope of
the last few minutes times the horizon, when the slope is more than noise. With
``holt-winters`` the policy forecasts ``max(load now + max(seasonal rise, ramp headroom),
highest load of the last horizon)`` (the trend line is for ``trend`` alone): a day that ramps earlier than the season
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

OUTLOOK_SECONDS = (300.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0)


def seasonal_outlook(state: HoltWintersState | None, now: float, load_now: float,
                     offsets: tuple[float, ...] = OUTLOOK_SECONDS) -> tuple[tuple[float, float], ...]:
    """Load expected ``offset`` seconds from now: today's load plus the season's change until then
    (the profile of the days seen, at today's level). Empty before one full season. It tells the
    co-scheduler how long spare GPUs stay spare; it never sizes a service (that is the forecast's
    job, with its floors). Load 100, season 10 now and 30 in an hour -> 120 at 3600 s."""
    base = holt_forecast(state, now)
    if base is None:
        return ()
    out = []
    for dt in offsets:
        ahead = holt_forecast(state, now + dt)
        if ahead is not None:
            out.append((dt, max(0.0, load_now + ahead - base)))
    return tuple(out)


SEASON_LEAD = 1800.0  # the season's rise is looked for up to this far beyond the horizon: a ramp may come early
SEASON_LEAD_HORIZONS = 3.0  # ... and no further than this many horizons


def season_lead(horizon: float) -> float:
    """How far beyond the horizon the season's rise is looked for. A ramp that comes early is
    caught by the ramp headroom a few readings in, plus a start-up: the longer the start-up, the
    more of an early ramp only the season can cover. Horizon 275 s -> 825 s; 610 s -> 1800 s."""
    return min(SEASON_LEAD, SEASON_LEAD_HORIZONS * horizon)


# Today's phase against the season, in shares of the season (a day: an hour of load matched, in
# 2-minute steps, with 5 minutes kept beyond a locked phase since 15-minute buckets blur a step).
PHASE_WINDOW_SHARE = 1 / 24  # load matched against the season
PHASE_STEP_SHARE = 1 / 720  # resolution of the search
PHASE_MARGIN_SHARE = 1 / 288  # look-ahead kept beyond a locked phase
PHASE_WINDOW = 3600.0  # the day's window: the load history a policy keeps for the phase (at most this)
PHASE_POINTS = 30  # readings of the window used (evenly spaced): the fit's cost stays flat in the tick
PHASE_FIT = 0.25  # a fit counts when its residual is under this share of the change it explains
PHASE_LEVEL = 0.1  # today's level may sit this share of its load off the season's


def _season_at(state: HoltWintersState, t: float) -> float:
    L, m = state.bucket_seconds, state.buckets
    pos = t / L - 0.5
    lo = math.floor(pos)
    frac = pos - lo
    return (1 - frac) * state.season[lo % m] + frac * state.season[(lo + 1) % m]


def phase_offset(state: HoltWintersState | None, day: tuple[tuple[float, float], ...], now: float,
                 span: float) -> float | None:
    """Seconds today runs ahead of the season (negative: behind), within ``+-span``: the shift of
    the seasonal shape that best fits the last ``PHASE_WINDOW`` of load (least squares, free level).
    None when the window shows no change the season explains well: a flat night says nothing about
    when the morning comes, and a day unlike the season (a ramp two hours early) is not locked.
    A day whose steps come 20 minutes early -> about 1200 once one step is in the window."""
    if state is None or not state.ready or span <= 0:
        return None
    window = min(PHASE_WINDOW, state.season_seconds * PHASE_WINDOW_SHARE)
    step = state.season_seconds * PHASE_STEP_SHARE
    pts = [(t, y) for t, y in day if now - window <= t <= now]
    if len(pts) < 10 or pts[-1][0] - pts[0][0] < window / 2:
        return None
    stride = max(1, len(pts) // PHASE_POINTS)
    pts = pts[::-1][::stride][::-1]
    n = int(span // step)
    assert state.level is not None
    mean_y = sum(y for _, y in pts) / len(pts)
    state_level, bound = state.level, PHASE_LEVEL * mean_y
    best: tuple[float, float, float] | None = None  # (sse, shift, range of the shape)
    for k in range(-n, n + 1):
        shape = [_season_at(state, t + k * step) for t, _ in pts]
        # today's level may differ from the season's by several percent, not by a step: a free level
        # would fit a staircase shifted by one whole step as well as the true phase
        c = sum(y - v for (_, y), v in zip(pts, shape, strict=True)) / len(pts)
        c = min(max(c, state_level - bound), state_level + bound)
        sse = sum((y - v - c) ** 2 for (_, y), v in zip(pts, shape, strict=True))
        # ties (a plateau fits several shifts) go to the shift nearest zero: no evidence of a lead
        if best is None or sse < best[0] - 1e-9 or (abs(sse - best[0]) <= 1e-9 and abs(k) < abs(best[1]) / step):
            best = (sse, k * step, max(shape) - min(shape))
    assert best is not None
    sse, shift, change = best
    if change <= 0 or math.sqrt(sse / len(pts)) > PHASE_FIT * change:
        return None
    return shift


def phase_margin(state: HoltWintersState) -> float:
    """Look-ahead kept beyond a locked phase (300 s for a day)."""
    return state.season_seconds * PHASE_MARGIN_SHARE


def locked_lead(horizon: float, phase: float | None, margin: float) -> float:
    """The season's lead once today's phase is known: as far as today runs ahead, plus a margin;
    the full ``season_lead`` while it is not. Horizon 610 s, margin 300 s: phase None -> 1800 s;
    phase 0 (on time) -> 300 s; phase 1200 (20 minutes early) -> 1500 s; phase -600 (late) -> 300 s."""
    full = season_lead(horizon)
    if phase is None:
        return full
    return min(full, max(0.0, phase) + margin)
RAMP_Z = 2.0  # standard errors a slope must clear to count as a ramp
# seconds of load the ramp rate is measured over: a few ticks, so a ramp that just began shows;
# long enough that a few minutes of noise drifting one way is not read as a ramp (chosen on the
# scenario family: a longer window let a noise rise on long start-ups through)
RAMP_WINDOW = 300.0


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
