"""Value types of the replica policy: context in, decision and state out.

Pure data: no clock, no I/O. ``PolicyContext`` is a snapshot (spec, replicas, one metric
reading, ``now``, the previous ``PolicyState``); ``decide`` returns a ``ReplicaDecision``
with a machine-readable ``Reason`` and a human message, plus the next ``PolicyState``.
The state is an immutable value, so the controller, the simulator and the tests can keep,
copy, persist or replay it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from elastic.model import InferenceSpec


class Reason(StrEnum):
    """Why the replica count is what it is (flows into the DB log, CR conditions, dashboards)."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    STEADY = "Steady"  # outside the tolerance band but the rounded answer equals current
    WITHIN_TOLERANCE = "WithinTolerance"
    LIMITED_BY_MAX = "LimitedByMax"
    LIMITED_BY_MIN = "LimitedByMin"
    LIMITED_BY_RATE = "LimitedByRate"
    STABILIZING = "Stabilizing"
    FORECAST = "Forecast"
    METRICS_MISSING = "MetricsMissing"
    ACTIVATED = "Activated"  # left zero: metric above the activation threshold
    DEACTIVATED = "Deactivated"  # went to zero: metric at/below the activation threshold
    NO_METRIC = "NoMetric"  # spec has no metric: replicas only follow min/max
    OVERRIDE = "Override"  # an operator pinned the replica count (the controller, not the policy)


@dataclass(frozen=True)
class HoltWintersState:
    """Online additive Holt-Winters over fixed-length buckets (see ``forecast.py``).

    ``first`` buffers bucket means until one full season is seen; then ``level``/``trend``/
    ``season`` are initialised classically and updated once per closed bucket.
    """

    season_seconds: float
    buckets: int
    level: float | None = None
    trend: float = 0.0
    season: tuple[float, ...] = ()
    first: tuple[float, ...] = ()
    bucket: int | None = None  # absolute bucket number being accumulated: floor(t / bucket_seconds)
    acc_sum: float = 0.0
    acc_n: int = 0
    last_closed: int | None = None

    @property
    def bucket_seconds(self) -> float:
        return self.season_seconds / self.buckets

    @property
    def ready(self) -> bool:
        return self.level is not None


@dataclass(frozen=True)
class PolicyState:
    """What one service's policy remembers between ticks (HPA: recommendations + scale events).

    * ``recommendations``: (t, replicas) unstabilised recommendations, for the windows.
    * ``events``: (t, change) replica changes this policy decided, for the rate policies.
    * ``samples``: (t, load) recent load, for the trend forecast.
    * ``holt``: Holt-Winters state, for the seasonal forecast.
    * ``readings``: (t, metric) recent readings, for the metric's averaging window.
    * ``day``: (t, load) of the last hour, to find how early or late today runs against the season.
    * ``waiting``: (t, requests waiting) at the last reading of a backlog, to see it grow.
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    events: tuple[tuple[float, int], ...] = ()
    samples: tuple[tuple[float, float], ...] = ()
    holt: HoltWintersState | None = None
    readings: tuple[tuple[float, float], ...] = ()
    day: tuple[tuple[float, float], ...] = ()  # (t, load) of the last hour: today's phase against the season
    waiting: tuple[float, float] | None = None  # (t, backlog) of the last backlog read: how fast it grows


@dataclass(frozen=True)
class PolicyContext:
    """One snapshot for ``decide``.

    ``current_replicas`` is the count the backend has been asked for (the HPA's
    ``.spec.replicas``), including replicas still starting. ``metric`` is the aggregated
    reading (None = missing); ``stale`` marks a reading that may be incomplete or old.
    ``backlog`` is the requests waiting in the replicas' queues (vLLM's
    ``num_requests_waiting``, summed; None = not read), for a metric that is a rate of
    requests (``request-rate``): a rate says how fast requests arrive, not how many already
    wait. A gauge of requests in flight (``vllm-requests``) counts the waiting ones already;
    give no backlog with it.
    """

    spec: InferenceSpec
    current_replicas: int
    metric: float | None
    now: float
    state: PolicyState = field(default_factory=PolicyState)
    stale: bool = False
    backlog: float | None = None

    @classmethod
    def from_sample(cls, spec: InferenceSpec, current_replicas: int, sample: Any, now: float,
                    state: PolicyState | None = None, backlog: Any = None) -> PolicyContext:
        """Build from an ``elastic.metrics.MetricSample`` (duck-typed: keeps this module pure);
        ``backlog``: a sample of the requests waiting (``vllm-waiting``), beside a rate metric."""
        value = None if sample is None else float(sample.value)
        if value is not None and not (math.isfinite(value) and value >= 0):
            value = None  # not a load (a source that let it through): missing, so the service holds
        stale = bool(sample is not None and sample.stale)
        waiting = None if backlog is None else float(backlog.value)
        if waiting is not None and not (math.isfinite(waiting) and waiting >= 0):
            waiting = None  # not a count of requests: as if not read
        return cls(spec, current_replicas, value, now, state or PolicyState(), stale, waiting)


@dataclass(frozen=True)
class ReplicaDecision:
    """The answer for one service at one tick."""

    service: str
    current: int
    replicas: int
    reason: Reason
    message: str
    at: float
    metric: float | None = None
    reactive: int | None = None  # after ratio + tolerance, before forecast/windows/limits
    forecast: int | None = None  # replicas the forecast asks for (None: no forecast)
    # replicas a scale-down window is about to remove (``drain_ahead_seconds``): the backend may take
    # them out of the load balancer now so they have drained when the window lets them go
    leaving: int = 0
    # replicas the seasonal profile expects later, ((seconds from now, replicas), ...): how long GPUs
    # the service does not need stay spare (the co-scheduler's lending); empty without a season
    outlook: tuple[tuple[float, int], ...] = ()

    @property
    def change(self) -> int:
        return self.replicas - self.current
