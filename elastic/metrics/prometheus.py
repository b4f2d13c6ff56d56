"""Metric source over the Prometheus HTTP API (instant queries, ``/api/v1/query``).

What it must do: time out, retry transient failures with backoff, send an optional bearer
token, and tell *missing* apart from *zero*: a query with no series, a NaN, or a server
that stays unreachable is missing (None), never 0. What it must not do: guess. A query
Prometheus rejects (syntax, execution error), a query returning several series where one is
expected, a range vector, or a 401/403 raise ``MetricQueryError`` naming the query, because
retrying cannot fix them and scaling on them would be wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from elastic.metrics.presets import get_preset, render
from elastic.metrics.sample import MetricQueryError, MetricSample, invalid_reading

DEFAULT_SELECTOR = 'service="$service"'


class PrometheusQuery:
    """``sample(service, now)`` runs one instant query for the service.

    Give ``preset`` (see ``presets.PRESETS``; ``selector`` picks the service's series) or
    ``query`` (PromQL; ``$service`` is replaced by the service name).
    ``max_age``: a result whose timestamp is older than this (vs ``now``) is stale.
    """

    def __init__(self, base_url: str, *, preset: str | None = None, query: str | None = None,
                 selector: str = DEFAULT_SELECTOR, timeout: float = 5.0, retries: int = 2,
                 backoff: float = 0.25, bearer_token: str | None = None, max_age: float = 120.0,
                 client: httpx.Client | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        if (preset is None) == (query is None):
            raise MetricQueryError("metric: give exactly one of 'preset' or 'query'")
        if not base_url.startswith(("http://", "https://")):
            raise MetricQueryError(f"metric.prometheus: '{base_url}' is not an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self.template = get_preset(preset).promql if preset else str(query)
        companion = get_preset(preset).backlog if preset else None
        self.backlog_template = get_preset(companion).promql if companion else None
        self.field = "metric.preset" if preset else "metric.query"
        self.selector = selector
        self.retries, self.backoff, self.max_age = retries, backoff, max_age
        headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._client = client or httpx.Client(timeout=timeout, headers=headers)
        self._sleep = sleep
        self.last_error: str | None = None

    def close(self) -> None:
        self._client.close()

    def promql(self, service: str) -> str:
        return render(self.template, self.selector, service)

    def sample(self, service: str, now: float) -> MetricSample | None:
        return self._instant(self.promql(service), now)

    def backlog(self, service: str, now: float) -> MetricSample | None:
        """The requests waiting beside a rate preset (its ``backlog`` gauge), one more instant
        query; None without one, or when it has no reading (missing, never 0)."""
        if self.backlog_template is None:
            return None
        return self._instant(render(self.backlog_template, self.selector, service), now)

    def _instant(self, q: str, now: float) -> MetricSample | None:
        result = self.query(q)
        if result is None:
            return None
        if not result:
            self.last_error = f"query {q!r} returned no series"
            return None
        if len(result) > 1:
            shown = ", ".join(str(labels) for labels, _, _ in result[:3])
            raise MetricQueryError(
                f"{self.field}: query {q!r} returned {len(result)} series ({shown}); one is expected: "
                "aggregate it, e.g. sum(...) or avg(...)")
        _, ts, value = result[0]
        if (why := invalid_reading(value, ts, now)) is not None:
            self.last_error = f"query {q!r}: {why}; ignored, as if missing"
            return None
        self.last_error = None
        return MetricSample(value, ts, f"prometheus {self.base_url}: {q}", stale=now - ts > self.max_age)

    def query(self, promql: str) -> list[tuple[dict[str, str], float, float]] | None:
        """Raw instant query: [(labels, timestamp, value)], or None when Prometheus is unreachable."""
        body = self._get_with_retries(promql)
        if body is None:
            return None
        data: dict[str, Any] = body.get("data") or {}
        result: Any  # [ts, value] for a scalar, a list of series for a vector
        kind, result = data.get("resultType"), data.get("result")
        if kind == "scalar":
            ts, val = result
            return [({}, float(ts), float(val))]
        if kind != "vector":
            raise MetricQueryError(
                f"{self.field}: query {promql!r} returned a {kind}; an instant vector is expected "
                "(drop the [range] selector or wrap it in rate(...))")
        return [(dict(r.get("metric", {})), float(r["value"][0]), float(r["value"][1])) for r in result]

    def _get_with_retries(self, promql: str) -> dict[str, Any] | None:
        url = f"{self.base_url}/api/v1/query"
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.get(url, params={"query": promql})
            except httpx.HTTPError as e:
                self.last_error = f"Prometheus {self.base_url} unreachable: {type(e).__name__}: {e}"
            else:
                body = self._check(resp, promql)
                if body is not None:
                    return body
            if attempt < self.retries:
                self._sleep(delay)
                delay *= 2
        return None

    def _check(self, resp: httpx.Response, promql: str) -> dict[str, Any] | None:
        if resp.status_code in (401, 403):
            raise MetricQueryError(
                f"metric.prometheus: {self.base_url} answered {resp.status_code}; check the bearer token")
        try:
            body = resp.json()
        except ValueError:
            self.last_error = f"Prometheus {self.base_url} answered {resp.status_code} without JSON"
            return None
        if body.get("status") == "success":
            return body
        etype, err = body.get("errorType", ""), body.get("error", "")
        if etype in ("bad_data", "execution") or resp.status_code in (400, 422):
            # The query's fault (syntax error, many-to-many match...): retrying cannot help.
            raise MetricQueryError(f"{self.field}: Prometheus rejected query {promql!r}: {etype}: {err}")
        self.last_error = f"Prometheus {self.base_url} error {resp.status_code} {etype}: {err}"
        return None
