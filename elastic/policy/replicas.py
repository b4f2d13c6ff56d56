"""``decide(ctx) -> (ReplicaDecision, PolicyState)``: how many replicas a service needs.

Pure: the clock is ``ctx.now``, the metric is already read, the previous state comes in
and the next one goes out. The stages (``stages.py``, ``forecast.py``) run in the order
the HPA controller applies them, which is what users of ``behavior`` expect:

1. bounds first when the current count is outside [min, max] (HPA: no metrics needed);
2. fail-safe: a missing metric holds the current count (recorded as a recommendation, so
   a scale-down after the gap still waits out its stabilisation window);
3. the metric's averaging window (``windowSeconds``), plus the rate that serves a rate
   metric's backlog (``_backlog``), raw ratio, then tolerance;
   scale-to-zero activation (KEDA ``activationThreshold``);
4. forecast: ``max(reactive, forecast)`` - scale up ``startup_seconds`` ahead, never less;
5. stabilisation windows over the recommendations;
6. rate policies and bounds together (HPA ``convertDesiredReplicasWithBehaviorRate``);
7. stale metrics may grow the service but never shrink it;
8. drain ahead (``drain_ahead_seconds``): the replicas the window is about to remove, so the
   backend can take them out of the load balancer early (never on stale or missing metrics);
9. reason code + message with the arithmetic; record the scale event.
"""

from __future__ import annotations

import math
from dataclasses import replace

from elastic.model import InferenceSpec
from elastic.policy import forecast as fc
from elastic.policy.stages import (
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
from elastic.policy.types import PolicyContext, PolicyState, Reason, ReplicaDecision


def decide(ctx: PolicyContext) -> tuple[ReplicaDecision, PolicyState]:
    spec, cur, now = ctx.spec, ctx.current_replicas, ctx.now
    if cur < 0:
        raise ValueError(f"current_replicas must be >= 0 (got {cur})")
    up, down = effective_rules(spec.behavior)
    state = _prune(ctx.state, now, up, down, spec)

    # 1. Out of bounds (spec changed): go straight to the bound, as the HPA does.
    if cur > spec.max_replicas or (cur < spec.min_replicas):
        target, which = bounds(cur, spec.min_replicas, spec.max_replicas)
        reason = Reason.LIMITED_BY_MAX if which == "max" else Reason.LIMITED_BY_MIN
        msg = f"{cur} replicas outside [{spec.min_replicas}, {spec.max_replicas}] -> {target}"
        return _finish(ctx, state, target, reason, msg, None, None)

    if spec.metric is None:
        return _finish(ctx, state, cur, Reason.NO_METRIC, "no metric configured; replicas follow min/max", None, None)

    # 2. Fail-safe: no reading -> hold. Record the hold so the windows restart from it.
    if ctx.metric is None:
        state = replace(state, recommendations=state.recommendations + ((now, cur),))
        msg = f"metric missing; holding {cur} replicas (missing metrics never shrink a service)"
        return _finish(ctx, state, cur, Reason.METRICS_MISSING, msg, None, None)

    # 3. Reactive answer on the (window-averaged) reading: raw ratio, tolerance, activation.
    metric, state, note = _average(spec, state, now, ctx.metric)
    load = _load(spec, cur, metric)
    state = _observe(state, spec, now, load)  # the arrival rate only: the season learns load, not queues
    drain, drain_note, state = _backlog(spec, state, now, ctx.backlog)
    reactive, reason, msg = _reactive(spec, cur, metric + drain, up, down)
    msg = note + drain_note + msg

    # 4. Forecast: only ever adds replicas, only when the service is active.
    predicted = _forecast_replicas(spec, state, cur, now, up, down, load, drain) if reactive > 0 else None
    desired = reactive
    if predicted is not None and predicted > reactive:
        desired = predicted
        reason = Reason.FORECAST
        msg += f"; forecast load in {spec.startup_seconds:g}s -> {predicted} replicas"

    # 5. Stabilisation windows.
    stable = stabilize(now, desired, cur, state.recommendations, up.window, down.window)
    state = replace(state, recommendations=state.recommendations + ((now, desired),))
    if stable != desired:
        reason = Reason.STABILIZING
        direction = "down" if desired < cur else "up"
        window = down.window if direction == "down" else up.window
        best = "highest" if direction == "down" else "lowest"
        msg += f"; scale-{direction} window {window:g}s keeps the {best} recent recommendation -> {stable}"

    # 6. Rate policies and bounds.
    final, limit_reason, limit_msg = _limits(spec, cur, stable, now, state.events, up, down)
    if limit_reason is not None:
        reason, msg = limit_reason, msg + "; " + limit_msg

    # 7. Stale readings may be partial: grow on them, never shrink.
    if ctx.stale and final < cur:
        final = fail_safe(final, cur, missing=False, stale=True)
        reason = Reason.METRICS_MISSING
        msg += f"; metric is stale, holding {cur} (stale metrics never shrink a service)"

    # 8. Drain ahead: what a window shorter by drain_ahead_seconds would remove already is about to go.
    leaving = 0 if ctx.stale else _leaving(spec, cur, final, now, state, up, down)
    if leaving:
        msg += (f"; drain ahead: {leaving} replica(s) leave the load balancer now, released within "
                f"{spec.drain_ahead_seconds:g}s if the load stays")

    if cur == 0 and final > 0:
        reason = Reason.ACTIVATED
    outlook = _outlook(spec, state, now, load) if spec.forecast == "holt-winters" and not ctx.stale else ()
    return _finish(ctx, state, final, reason, msg, reactive, predicted, leaving, outlook)


def remember(spec: InferenceSpec, state: PolicyState, times: list[float], loads: list[float]) -> PolicyState:
    """Feed the forecast the service's past load (``times`` ascending, before the first ``decide``):
    a seasonal forecast needs a day of history before it can see a ramp coming. Only the
    forecast's memory changes; the windows and rate policies start empty."""
    if spec.metric is None:
        return state
    for t, load in zip(times, loads, strict=True):
        state = _observe(state, spec, t, max(0.0, load))
    if times:
        state = replace(state, samples=tuple(x for x in state.samples if x[0] >= times[-1] - spec.forecast_window_seconds))
    return state


def landed(state: PolicyState, at: float, replicas: int) -> PolicyState:
    """A scale-up to ``replicas`` landed at ``at`` (its replicas can serve from then on): it counts
    as a recommendation at that time too, so the scale-down stabilisation window runs from when
    the replicas could serve, not only from the decision. For a caller whose scaling blocks
    (the controller waits for the training shrink and the replicas' start): otherwise a window
    that mostly passed while they started lets the next dip drain a replica the ramp needs."""
    return replace(state, recommendations=state.recommendations + ((at, replicas),))


# ---- steps -----------------------------------------------------------------------------------


def _leaving(spec: InferenceSpec, cur: int, final: int, now: float, state: PolicyState, up: Rules,
             down: Rules) -> int:
    """Replicas the scale-down window will remove within ``drain_ahead_seconds`` if the load stays.

    The window keeps the highest recommendation of its last ``W`` seconds; the one of the last
    ``W - ahead`` seconds is what it will keep ``ahead`` seconds from now unless a higher one
    comes, through the same rate policies and bounds. Only while the window holds a scale-down
    back (``final == cur``): once it lets go, the backend drains as usual. Window 8 s, ahead
    6 s, recommendations 5, 5 in the last 2 s and 6 before, current 6 -> 1 leaving.
    """
    ahead = spec.drain_ahead_seconds
    if ahead <= 0 or final != cur or cur <= spec.min_replicas or not state.recommendations:
        return 0
    latest = state.recommendations[-1][1]  # this tick's, recorded in step 5
    early = stabilize(now, latest, cur, state.recommendations, up.window, max(0.0, down.window - ahead))
    if early >= cur:
        return 0
    early, _, _ = _limits(spec, cur, early, now, state.events, up, down)
    return max(0, cur - early)


def _average(spec: InferenceSpec, state: PolicyState, now: float, metric: float) -> tuple[float, PolicyState, str]:
    """``max(latest, mean of the window's readings)``: the window slows shrinking, never growing.

    A dip in a jittery gauge must not drain a replica the load still needs, but a rise is
    answered on the latest reading (the SLO is at stake, and the scale-up side has no
    window by default either).
    """
    assert spec.metric is not None
    window = spec.metric.window_seconds
    if window <= 0:
        return metric, state, ""
    readings = tuple(r for r in state.readings if r[0] > now - window) + ((now, metric),)
    mean = sum(v for _, v in readings) / len(readings)
    state = replace(state, readings=readings)
    if mean <= metric or len(readings) == 1:
        return metric, state, ""
    return mean, state, f"mean of {len(readings)} readings over {window:g}s {mean:.4g} > latest {metric:g}; "


BACKLOG_MIN_DRAIN_SECONDS = 15.0  # the HPA's sync period: a service whose replicas start at once


def _backlog(spec: InferenceSpec, state: PolicyState, now: float, backlog: float | None
             ) -> tuple[float, str, PolicyState]:
    """The rate that serves the waiting requests on top of the arrival rate (a rate metric in
    total requests/s only: ``AverageValue``): the backlog the replicas ordered now will find
    when they serve, one start-up horizon from now, served over one more horizon.

    That backlog is today's plus its growth over the horizon: a growing backlog means the
    ready replicas fall short by its growth rate until the ordered ones arrive. Asking for a
    backlog to be gone sooner than a horizon orders replicas that arrive after it has drained
    and then idle (a tick's worth of queue read as extra load for one tick is a spike); a
    shrinking backlog is being served by the replicas already there. 600 requests waiting,
    300 s horizon, 2 more each second -> +2 + 2 = +4 requests/s."""
    m = spec.metric
    if backlog is None or m is None or m.type != "AverageValue" or not math.isfinite(backlog) or backlog < 0:
        return 0.0, "", state
    prev, state = state.waiting, replace(state, waiting=(now, backlog))
    growth = 0.0
    if prev is not None and now > prev[0]:
        growth = max(0.0, (backlog - prev[1]) / (now - prev[0]))
    if backlog <= 0:
        return 0.0, "", state
    over = max(spec.startup_seconds, BACKLOG_MIN_DRAIN_SECONDS)
    rate = backlog / over + growth
    note = f"backlog {backlog:.4g} waiting"
    if growth:
        note += f", growing {growth:.4g}/s"
    return rate, f"{note}, served over {over:g}s: +{rate:.4g}; ", state


def _reactive(spec: InferenceSpec, cur: int, metric: float, up: Rules, down: Rules) -> tuple[int, Reason, str]:
    m = spec.metric
    assert m is not None
    threshold = m.activation_threshold
    if spec.min_replicas == 0 and metric <= threshold:
        # KEDA: at/below the activation threshold an idle service may go to zero.
        return 0, Reason.DEACTIVATED, f"metric {metric:g} <= activation threshold {threshold:g} -> 0 replicas"
    if cur == 0:
        raw = raw_replicas(metric, m.target, cur, m.type)
        n = max(1, raw.replicas)
        return n, Reason.ACTIVATED, f"metric {metric:g} > activation threshold {threshold:g}; {raw.message}"
    raw = raw_replicas(metric, m.target, cur, m.type)
    if within_tolerance(raw.ratio, up.tolerance, down.tolerance):
        return cur, Reason.WITHIN_TOLERANCE, (
            f"{raw.message}; usage ratio {raw.ratio:.2f} within tolerance "
            f"[{1 - down.tolerance:.2f}, {1 + up.tolerance:.2f}] -> keep {cur}")
    if raw.replicas < cur and m.noise_margin > 0:
        return _noise_margin(m.noise_margin, m.target, cur, metric, raw.message)
    if raw.replicas == cur:
        return cur, Reason.STEADY, raw.message
    return raw.replicas, (Reason.SCALED_UP if raw.replicas > cur else Reason.SCALED_DOWN), raw.message


def _noise_margin(z: float, target: float, cur: int, load: float, msg: str) -> tuple[int, Reason, str]:
    """A scale-down to ``n`` replicas only if ``load + z * sqrt(load) <= n * target``: a count of
    requests in flight scatters by about ``sqrt(load)``, so a reading that far below the current
    count's capacity may be noise. Load 62 at target 13 with 6 replicas, z 0.5: 62 + 3.9 = 65.9 >
    5 * 13 -> keep 6; load 55: 58.7 <= 65 -> 5."""
    padded = load + z * math.sqrt(max(load, 0.0))
    n = min(cur, raw_replicas(padded, target, cur, "AverageValue").replicas)  # padded >= load: never below the raw count
    note = f"{msg}; with noise margin {z:g} x sqrt(load) = {padded:.1f} -> {n} replicas"
    if n >= cur:
        return cur, Reason.WITHIN_TOLERANCE, note + " (a dip this size may be noise: keep)"
    return n, Reason.SCALED_DOWN, note


def _load(spec: InferenceSpec, cur: int, metric: float) -> float:
    # Forecast the total demand in target units: for Value/Utilization the metric is per
    # replica (or one ratio), so 4 replicas at 0.9 carry a load of 3.6.
    assert spec.metric is not None
    return metric if spec.metric.type == "AverageValue" else metric * max(cur, 1)


def _observe(state: PolicyState, spec: InferenceSpec, now: float, load: float) -> PolicyState:
    if spec.forecast == "off":
        return state
    state = replace(state, samples=state.samples + ((now, load),))  # the trend (also the seasonal floor)
    if spec.forecast == "holt-winters":
        holt = state.holt or fc.holt_new(spec.forecast_season_seconds)
        day = state.day + ((now, load),)
        state = replace(state, holt=fc.holt_observe(holt, now, load),
                        day=day[next(i for i, x in enumerate(day) if x[0] >= now - fc.PHASE_WINDOW):])
    return state


def _forecast_replicas(spec: InferenceSpec, state: PolicyState, cur: int, now: float, up: Rules, down: Rules,
                       load_now: float, drain: float = 0.0) -> int | None:
    """Replicas for the arrival rate a horizon ahead, plus ``drain``: the backlog's share, which
    the replicas ordered now must serve too (the forecast itself learns arrivals only)."""
    horizon = spec.startup_seconds
    if spec.forecast == "off":
        return None
    if spec.forecast == "trend":
        load = fc.trend_forecast(state.samples, now, horizon, spec.forecast_window_seconds)
    else:
        # the season's rise over the start-up on top of today's load, or the ramp under way when
        # it is steeper (a ramp the season does not know yet: an early morning). No trend line on
        # top: extrapolated from the middle of its 10-minute window, it adds the window's noise
        # again to what the ramp headroom reads from the same, more recent readings.
        rise = _seasonal_rise(spec, state, now, horizon)
        ramp = fc.ramp_headroom(state.samples, now, horizon)
        load = load_now + max(rise or 0.0, ramp or 0.0) if rise is not None or ramp is not None else None
        # a replica given back now cannot return sooner than a start-up: keep what the last
        # start-up's worth of load needed (a dip in a noisy plateau is not a fall)
        # ... less what the scale-down window holds already: the two would add up
        recent = [y for t, y in state.samples if t > now - (horizon - down.window)]
        if recent:
            load = max(load or 0.0, max(recent))
    if load is None:
        return None
    load += drain
    m = spec.metric
    assert m is not None
    # The forecast is a load; convert with the AverageValue rule and the same tolerance band.
    raw = raw_replicas(load, m.target, cur, "AverageValue")
    if cur > 0 and within_tolerance(raw.ratio, up.tolerance, up.tolerance):
        return cur
    return raw.replicas


def _seasonal_rise(spec: InferenceSpec, state: PolicyState, now: float, horizon: float) -> float | None:
    """The season's rise over the horizon and a lead beyond it (a morning may come early); once
    today's phase is locked from its own load, the lead shrinks to how early today runs."""
    full = fc.seasonal_rise(state.holt, now, horizon + fc.season_lead(horizon))
    if not full:
        return full
    assert state.holt is not None  # a rise needs a season
    margin = fc.phase_margin(state.holt)
    near = fc.seasonal_rise(state.holt, now, horizon + margin)
    if near is not None and near >= full:
        return full  # the lead adds nothing: no phase fit needed
    phase = fc.phase_offset(state.holt, state.day, now, fc.season_lead(horizon))
    return fc.seasonal_rise(state.holt, now, horizon + fc.locked_lead(horizon, phase, margin))


def _limits(spec: InferenceSpec, cur: int, desired: int, now: float, events: tuple[tuple[float, int], ...],
            up: Rules, down: Rules) -> tuple[int, Reason | None, str]:
    if desired > cur:
        rate_cap = scale_up_limit(cur, now, events, up)
        if spec.max_replicas <= rate_cap and desired > spec.max_replicas:
            return spec.max_replicas, Reason.LIMITED_BY_MAX, f"maxReplicas {spec.max_replicas} -> {spec.max_replicas}"
        if desired > rate_cap:
            return rate_cap, Reason.LIMITED_BY_RATE, f"scale-up rate ({_describe(up)}) -> {rate_cap}"
    elif desired < cur:
        rate_floor = scale_down_limit(cur, now, events, down)
        if spec.min_replicas >= rate_floor and desired < spec.min_replicas:
            return spec.min_replicas, Reason.LIMITED_BY_MIN, f"minReplicas {spec.min_replicas} -> {spec.min_replicas}"
        if desired < rate_floor:
            return rate_floor, Reason.LIMITED_BY_RATE, f"scale-down rate ({_describe(down)}) -> {rate_floor}"
    return desired, None, ""


def _describe(rules: Rules) -> str:
    if rules.select == "Disabled":
        return "selectPolicy Disabled"
    pol = ", ".join(f"{p.kind} {p.value} per {p.period:g}s" for p in rules.policies)
    return f"{pol}; selectPolicy {rules.select}"


def _prune(state: PolicyState, now: float, up: Rules, down: Rules, spec: InferenceSpec) -> PolicyState:
    keep_recs = max(up.window, down.window)
    keep_events = max([p.period for p in up.policies + down.policies] or [0.0])
    return replace(
        state,
        recommendations=tuple(r for r in state.recommendations if r[0] > now - keep_recs),
        events=tuple(e for e in state.events if e[0] > now - keep_events),
        samples=tuple(s for s in state.samples if s[0] >= now - spec.forecast_window_seconds),
        readings=tuple(r for r in state.readings
                       if spec.metric is not None and r[0] > now - spec.metric.window_seconds),
    )


def _outlook(spec: InferenceSpec, state: PolicyState, now: float, load: float) -> tuple[tuple[float, int], ...]:
    """The seasonal outlook in replicas (AverageValue rule, within the bounds)."""
    m = spec.metric
    assert m is not None
    return tuple((dt, min(max(math.ceil(y / m.target - 1e-9), spec.min_replicas), spec.max_replicas))
                 for dt, y in fc.seasonal_outlook(state.holt, now, load))


def _finish(ctx: PolicyContext, state: PolicyState, replicas: int, reason: Reason, msg: str,
            reactive: int | None, predicted: int | None, leaving: int = 0,
            outlook: tuple[tuple[float, int], ...] = ()) -> tuple[ReplicaDecision, PolicyState]:
    cur = ctx.current_replicas
    if replicas != cur:
        state = replace(state, events=state.events + ((ctx.now, replicas - cur),))
    decision = ReplicaDecision(
        service=ctx.spec.name, current=cur, replicas=replicas, reason=reason, message=msg, at=ctx.now,
        metric=ctx.metric, reactive=reactive, forecast=predicted, leaving=leaving, outlook=outlook)
    return decision, state
