"""In-process metric source: values pushed by code in the same process (simulator, demo,
controller tests). A reading older than ``max_age`` seconds is returned as stale."""

from __future__ import annotations

import threading

from elastic.metrics.sample import MetricSample, invalid_reading


class InProcessSource:
    def __init__(self, max_age: float = 60.0) -> None:
        self.max_age = max_age
        self._values: dict[str, tuple[float, float]] = {}
        self._backlogs: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def set(self, service: str, value: float, at: float) -> None:
        with self._lock:
            self._values[service] = (float(value), float(at))

    def set_backlog(self, service: str, waiting: float, at: float) -> None:
        """The requests waiting beside a rate metric (``backlog``); unset: none is read."""
        with self._lock:
            self._backlogs[service] = (float(waiting), float(at))

    def clear(self, service: str) -> None:
        with self._lock:
            self._values.pop(service, None)
            self._backlogs.pop(service, None)

    def backlog(self, service: str, now: float) -> MetricSample | None:
        with self._lock:
            got = self._backlogs.get(service)
        if got is None or invalid_reading(got[0], got[1], now) is not None:
            return None
        return MetricSample(got[0], got[1], "in-process", stale=now - got[1] > self.max_age)

    def sample(self, service: str, now: float) -> MetricSample | None:
        with self._lock:
            got = self._values.get(service)
        if got is None:
            return None
        value, at = got
        if (why := invalid_reading(value, at, now)) is not None:
            self.last_error = f"{service}: {why}; ignored, as if missing"
            return None
        self.last_error = None
        return MetricSample(value, at, "in-process", stale=now - at > self.max_age)
