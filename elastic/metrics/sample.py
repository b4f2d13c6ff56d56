"""The one small protocol every metric source implements, and its value type.

``MetricSource.sample(service, now)`` returns a ``MetricSample`` or None. None means
*missing* (no series, Prometheus down, no replica answered): the policy holds the service,
it never reads a gap as zero. ``stale=True`` marks a reading that may be partial or old
(some replicas did not answer): the policy may grow on it but never shrinks.

Errors in the *spec* (a PromQL syntax error, a query returning several series, an unknown
preset) raise ``MetricQueryError``, a ``SpecError`` naming the field: nothing should be
scaled on such a spec until a person fixes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from elastic.model import SpecError


class MetricQueryError(SpecError):
    """The metric spec is wrong (bad PromQL, several series, unknown preset...)."""


@dataclass(frozen=True)
class MetricSample:
    value: float
    observed_at: float
    source: str
    stale: bool = False


FUTURE_TOLERANCE_S = 30.0
"""How far ahead of the controller's clock a reading's timestamp may be (clock skew) before it
is refused: a reading from the future would never grow old, and so never count as stale."""


def invalid_reading(value: float, observed_at: float, now: float) -> str | None:
    """Why a reading cannot be load (None when it can): not a finite number, negative (a load
    never is: a -50 would shrink a service to its minimum), or timestamped in the future."""
    if not math.isfinite(value):
        return f"the value is {value}"
    if value < 0:
        return f"the value {value:g} is negative (a load never is)"
    if observed_at - now > FUTURE_TOLERANCE_S:
        return (f"the reading is timestamped {observed_at - now:.0f} s in the future (clock skew between "
                f"the source and the controller is allowed {FUTURE_TOLERANCE_S:g} s)")
    return None


@runtime_checkable
class MetricSource(Protocol):
    def sample(self, service: str, now: float) -> MetricSample | None: ...


@runtime_checkable
class BacklogSource(Protocol):
    """A source of a rate metric that also reads the requests waiting beside it (the preset's
    ``backlog``): the replica policy serves that backlog on top of the rate. None when it has
    no reading, or when its metric is not a rate with one (a gauge of requests in flight counts
    the waiting ones already)."""

    def backlog(self, service: str, now: float) -> MetricSample | None: ...
