"""Metric sources: where the controller reads each inference service's load.

One protocol (``MetricSource.sample(service, now) -> MetricSample | None``) and three
sources: ``PrometheusQuery`` (Prometheus HTTP API), ``Scrape`` (replicas' ``/metrics``
directly, the embedded default) and ``InProcessSource`` (pushed values: simulator, demo,
tests). ``build_source`` picks one from a ``MetricTarget`` spec. None means missing, never 0.
Our own exporter (``elastic.metrics.exporter``) is a separate module, not imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from elastic.metrics.inprocess import InProcessSource
from elastic.metrics.presets import PRESETS, Preset, check_metric, get_preset
from elastic.metrics.prometheus import DEFAULT_SELECTOR, PrometheusQuery
from elastic.metrics.sample import BacklogSource, MetricQueryError, MetricSample, MetricSource
from elastic.metrics.scrape import Scrape, histogram_quantile, parse_metrics
from elastic.model import MetricTarget

__all__ = [
    "DEFAULT_SELECTOR", "PRESETS", "BacklogSource", "InProcessSource", "MetricQueryError", "MetricSample", "MetricSource",
    "Preset", "PrometheusQuery", "Scrape", "build_source", "check_metric", "get_preset", "histogram_quantile",
    "parse_metrics",
]


def build_source(metric: MetricTarget, *, targets: Mapping[str, Sequence[str]] | Callable[[str], Sequence[str]]
                 | None = None, bearer_token: str | None = None, selector: str = DEFAULT_SELECTOR,
                 timeout: float = 5.0) -> MetricSource:
    """The source a metric spec asks for: Prometheus when ``metric.prometheus`` is set,
    else a direct scrape of the replicas (``targets``: service -> replica URLs)."""
    check_metric(metric)
    if metric.prometheus:
        return PrometheusQuery(metric.prometheus, preset=metric.preset, query=metric.query, selector=selector,
                               timeout=timeout, bearer_token=bearer_token)
    if metric.query is not None:
        raise MetricQueryError(
            "metric.query: PromQL needs metric.prometheus (a Prometheus base URL); "
            "or use metric.preset to scrape the replicas directly")
    if targets is None:
        raise MetricQueryError("metric: scraping replicas directly needs their URLs (targets)")
    assert metric.preset is not None
    return Scrape(targets, metric.preset, timeout=timeout)
