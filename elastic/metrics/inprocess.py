"""In-process metric source: values pushed by code in the same process (simulator, demo,
controller tests). A reading older than ``max_age`` seconds is returned as stale."""

from __future__ import annotations

import threading

from elastic.metrics.sample import MetricSample, invalid_reading


class InProcessSource:
    def __init__(self, max_age: float = 60.0) -> None:
        self.max_age = max_age
        self._values: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def set(self, service: str, value: float, at: float) -> None:
        with self._lock:
            self._values[service] = (float(value), float(at))

    def clear(self, service: str) -> None:
        with self._lock:
            self._values.pop(service, None)

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
