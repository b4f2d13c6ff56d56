"""The stages of the replica calculation, each a small pure function with its own tests.

Semantics follow the Kubernetes HPA v2 controller (``pkg/controller/podautoscaler``):

* ``raw_replicas``: ``desired = ceil(current * metric / target)`` (Value, Utilization) or
  ``ceil(total / target)`` (AverageValue), with the usage ratio for the tolerance test.
* ``within_tolerance``: ``|1 - ratio| <= tolerance`` (default 0.1) keeps the current count.
* ``stabilize``: scale-down takes the *highest* recommendation over its window (default
  300 s), scale-up the *lowest* over its window (default 0 s).
* ``rate_limits``: ``Pods``/``Percent`` policies per ``periodSeconds``, combined with
  ``selectPolicy`` Max (largest change), Min (smallest) or Disabled (no change).
* ``bounds``: ``minReplicas``/``maxReplicas``.
* ``fail_safe``: missing metrics hold, stale metrics may only grow (never shrink).

Nothing here reads the clock: every function that needs time takes ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from elastic.model import Behavior, ScalingRules

DEFAULT_TOLERANCE = 0.1
_EPS = 1e-9  # so that ceil(30.000000000004 / 10) stays 3


@dataclass(frozen=True)
class Rule:
    """One rate policy: ``kind`` Pods or Percent, ``value``, ``period`` seconds."""

    kind: Literal["Pods", "Percent"]
    value: int
    period: float


@dataclass(frozen=True)
class Rules:
    """Effective ``behavior.scaleUp`` / ``scaleDown`` with the HPA defaults filled in."""

    window: float
    select: Literal["Max", "Min", "Disabled"]
    policies: tuple[Rule, ...]
    tolerance: float = DEFAULT_TOLERANCE


# HPA defaults (k8s.io/kubernetes pkg/apis/autoscaling/v2/defaults.go):
# scale up: no stabilisation, 4 Pods or 100 % per 15 s, whichever is larger;
# scale down: 300 s stabilisation, 100 % per 15 s.
DEFAULT_UP = Rules(0.0, "Max", (Rule("Pods", 4, 15.0), Rule("Percent", 100, 15.0)))
DEFAULT_DOWN = Rules(300.0, "Max", (Rule("Percent", 100, 15.0),))


def effective_rules(behavior: Behavior | None) -> tuple[Rules, Rules]:
    """Fill each unset field with the HPA default, field by field as the HPA does."""
    b = behavior or Behavior()
    return _fill(b.scale_up, DEFAULT_UP), _fill(b.scale_down, DEFAULT_DOWN)


def _fill(given: ScalingRules | None, default: Rules) -> Rules:
    if given is None:
        return default
    window = default.window if given.stabilization_window_seconds is None else float(given.stabilization_window_seconds)
    policies = default.policies if given.policies is None else tuple(
        Rule(p.type, p.value, float(p.period_seconds)) for p in given.policies)
    tolerance = DEFAULT_TOLERANCE if given.tolerance is None else given.tolerance
    return Rules(window, given.select_policy, policies, tolerance)


# ---- 1. raw ratio ------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    replicas: int
    ratio: float  # usage ratio: 1.0 = exactly at target
    message: str


def raw_replicas(metric: float, target: float, current: int,
                 kind: Literal["AverageValue", "Value", "Utilization"]) -> Raw:
    """The HPA's replica calculation, before tolerance.

    AverageValue: ``metric`` is the total over replicas, ``target`` the value per replica;
    load 42 / target 10 -> ceil(4.2) = 5. Value/Utilization: ``metric`` is one value (or the
    average per replica); 4 replicas at 0.9 for target 0.6 -> ceil(4 * 1.5) = 6.
    With zero replicas we compute as if one were running (activation from zero).
    """
    if target <= 0:
        raise ValueError(f"metric.target must be > 0 (got {target})")
    base = max(current, 1)
    if kind == "AverageValue":
        replicas = _ceil(metric / target)
        ratio = metric / (target * base)
        msg = f"load {metric:.1f} / target {_num(target)} per replica -> {replicas} replicas"
    else:
        ratio = metric / target
        replicas = _ceil(base * ratio)
        msg = f"{kind.lower()} {metric:.3g} / target {_num(target)} x {base} replicas -> {replicas} replicas"
    return Raw(replicas, ratio, msg)


def _num(x: float) -> str:
    return f"{x:.1f}" if x >= 1 and float(x).is_integer() else f"{x:g}"


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


# ---- 2. tolerance --------------------------------------------------------------------------


def within_tolerance(ratio: float, up: float = DEFAULT_TOLERANCE, down: float = DEFAULT_TOLERANCE) -> bool:
    """True when the usage ratio is inside the band where the HPA does not act.

    Ratio 1.08 with tolerance 0.1 -> no change; 1.12 -> scale. Per-direction tolerances as
    in HPA v2 (Kubernetes 1.33): scale up only above ``1 + up``, down only below ``1 - down``.
    """
    return (1.0 - down) <= ratio <= (1.0 + up)


# ---- 3. stabilisation window ---------------------------------------------------------------


def stabilize(now: float, desired: int, current: int, history: tuple[tuple[float, int], ...],
              up_window: float, down_window: float) -> int:
    """The HPA's ``stabilizeRecommendationWithBehaviors``.

    ``history`` holds earlier (t, recommendation); the new ``desired`` counts as one too.
    Scale-down goes no lower than the highest recommendation within ``down_window``;
    scale-up goes no higher than the lowest within ``up_window``. Example: recommendations
    [8, 5, 6] in the last 300 s and current 8 -> stays 8 until the 8 leaves the window.
    """
    up_rec = down_rec = desired
    for t, rec in history:
        if t > now - up_window:
            up_rec = min(up_rec, rec)
        if t > now - down_window:
            down_rec = max(down_rec, rec)
    out = max(current, up_rec)  # go up, but only as far as every recent recommendation agrees
    return min(out, down_rec)  # go down, but only as far as every recent recommendation agrees


# ---- 4. rate policies ----------------------------------------------------------------------


def _changed_within(period: float, now: float, events: tuple[tuple[float, int], ...], sign: int) -> int:
    return sum(abs(c) for t, c in events if t > now - period and c * sign > 0)


def _period_start(current: int, rule: Rule, now: float, events: tuple[tuple[float, int], ...]) -> int:
    # Replicas at the start of the period: undo what was added/removed inside it.
    added = _changed_within(rule.period, now, events, +1)
    removed = _changed_within(rule.period, now, events, -1)
    return max(0, current - added + removed)


def scale_up_limit(current: int, now: float, events: tuple[tuple[float, int], ...], rules: Rules) -> int:
    """Highest count the scale-up policies allow now (``calculateScaleUpLimitWithScalingRules``).

    Pods 4 / Percent 100 per 15 s from 3 replicas: max(3 + 4, ceil(3 * 2)) = 7 with Max,
    min(7, 6) = 6 with Min. Never below ``current``.
    """
    if rules.select == "Disabled" or not rules.policies:
        return current
    proposals = []
    for rule in rules.policies:
        start = _period_start(current, rule, now, events)
        if rule.kind == "Pods":
            proposals.append(start + rule.value)
        else:  # rounded up, or a small service could never grow by a percentage
            proposals.append(math.ceil(start * (1 + rule.value / 100)))
    limit = max(proposals) if rules.select == "Max" else min(proposals)
    return max(limit, current)


def scale_down_limit(current: int, now: float, events: tuple[tuple[float, int], ...], rules: Rules) -> int:
    """Lowest count the scale-down policies allow now (``calculateScaleDownLimitWithBehaviors``).

    Pods 4 / Percent 10 per 60 s from 80 replicas: Max change -> min(76, int(72.0)) = 72;
    Min change -> 76. Never above ``current``.
    """
    if rules.select == "Disabled" or not rules.policies:
        return current
    proposals = []
    for rule in rules.policies:
        start = _period_start(current, rule, now, events)
        if rule.kind == "Pods":
            proposals.append(start - rule.value)
        else:  # truncated, as the HPA does (int32 conversion)
            proposals.append(int(start * (1 - rule.value / 100)))
    limit = min(proposals) if rules.select == "Max" else max(proposals)
    return min(max(limit, 0), current)


# ---- 5. bounds -----------------------------------------------------------------------------


def bounds(desired: int, min_replicas: int, max_replicas: int) -> tuple[int, Literal["max", "min"] | None]:
    """Clamp to [min, max]; say which bound bit."""
    if desired > max_replicas:
        return max_replicas, "max"
    if desired < min_replicas:
        return min_replicas, "min"
    return desired, None


# ---- 6. fail-safe --------------------------------------------------------------------------


def fail_safe(desired: int, current: int, missing: bool, stale: bool) -> int:
    """Missing metrics hold the current count; stale (possibly partial) ones may only grow it.

    A sum over 3 of 4 replicas undercounts the load: it can justify more replicas, never fewer.
    """
    if missing:
        return current
    if stale:
        return max(desired, current)
    return desired
