"""Metric presets for the servers users run: vLLM, SGLang, and request rate.

Each preset has two equivalent forms: a PromQL query (``$sel`` stands for the label
matchers that pick the service's series, e.g. ``service="chat"``) and a recipe for reading
the replicas' ``/metrics`` directly (``Scrape``). The reference replica exports vLLM's
names, so the same preset works against it, against real vLLM, and through Prometheus.

Presets are either a *total* over replicas (pair with ``AverageValue``: load / target per
replica) or an *average* per replica (pair with ``Utilization`` or ``Value``);
``check_metric`` refuses a mismatched pair with a message naming the field.
vLLM's removed ``vllm:gpu_cache_usage_perc`` is deliberately absent (use ``vllm-kv-cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.metrics.sample import MetricQueryError
from elastic.model import MetricTarget

TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class Preset:
    name: str
    promql: str
    kind: Literal["gauge", "rate", "quantile"]
    samples: tuple[str, ...]  # sample names read from /metrics (summed together for gauges)
    agg: Literal["sum", "avg"]
    description: str
    quantile: float = 0.0
    # a rate of requests says how fast they come, not how many wait: the gauge preset of the
    # requests queued beside it, read as the policy's backlog (``PolicyContext.backlog``)
    backlog: str | None = None

    @property
    def is_total(self) -> bool:
        return self.agg == "sum"


def _gauge(name: str, agg: Literal["sum", "avg"], samples: tuple[str, ...], desc: str) -> Preset:
    promql = " + ".join(f"{agg}({s}{{$sel}})" for s in samples)
    return Preset(name, promql, "gauge", samples, agg, desc)


def _ttft(q: float) -> Preset:
    promql = f"histogram_quantile({q}, sum by (le) (rate({TTFT}_bucket{{$sel}}[1m])))"
    return Preset(f"vllm-ttft-p{int(q * 100)}", promql, "quantile", (f"{TTFT}_bucket",), "avg",
                  f"p{int(q * 100)} time to first token, seconds (vLLM histogram)", quantile=q)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    _gauge("vllm-running", "sum", ("vllm:num_requests_running",), "requests in the running batch (vLLM)"),
    _gauge("vllm-waiting", "sum", ("vllm:num_requests_waiting",), "requests queued (vLLM)"),
    _gauge("vllm-requests", "sum", ("vllm:num_requests_running", "vllm:num_requests_waiting"),
           "running + waiting requests (vLLM): the usual load signal"),
    _gauge("vllm-kv-cache", "avg", ("vllm:kv_cache_usage_perc",), "KV-cache usage, fraction 0..1, average per replica"),
    _ttft(0.5), _ttft(0.9), _ttft(0.99),
    _gauge("sglang-running", "sum", ("sglang:num_running_reqs",), "requests running (SGLang)"),
    _gauge("sglang-queue", "sum", ("sglang:num_queue_reqs",), "requests queued (SGLang)"),
    _gauge("sglang-requests", "sum", ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
           "running + queued requests (SGLang)"),
    _gauge("sglang-token-usage", "avg", ("sglang:token_usage",), "KV token usage, fraction 0..1, average per replica"),
    Preset("request-rate", "sum(rate(vllm:request_success_total{$sel}[1m]))", "rate",
           ("vllm:request_success_total",), "sum", "finished requests per second (vLLM counter); the "
           "requests waiting beside it (vllm-waiting) are the policy's backlog", backlog="vllm-waiting"),
]}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise MetricQueryError(f"metric.preset: unknown preset '{name}'; known presets: {', '.join(PRESETS)}") from None


def check_metric(metric: MetricTarget) -> Preset | None:
    """Validate a metric spec beyond its own fields; returns the preset (None for a query)."""
    if metric.preset is None:
        return None
    preset = get_preset(metric.preset)
    if preset.is_total and metric.type == "Utilization":
        raise MetricQueryError(
            f"metric.type: preset '{preset.name}' is a total over replicas; use type 'AverageValue' "
            "(target = value per replica)")
    if not preset.is_total and metric.type == "AverageValue":
        raise MetricQueryError(
            f"metric.type: preset '{preset.name}' is an average per replica; use type 'Utilization' or 'Value'")
    return preset


def render(promql: str, selector: str, service: str) -> str:
    """Fill ``$sel`` (label matchers) and ``$service`` (the service name) into a query."""
    return promql.replace("$sel", selector.replace("$service", service)).replace("$service", service)
