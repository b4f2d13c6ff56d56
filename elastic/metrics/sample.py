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


@runtime_checkable
class MetricSource(Protocol):
    def sample(self, service: str, now: float) -> MetricSample | None: ...
