"""A real Prometheus scraping two reference replicas under load.

The load is shaped so the counts are steady while we compare them: each replica runs 2
requests and queues 3 (10 long requests, least-outstanding balancing), decoding at 2 tokens/s
so nothing finishes during the test. ``PrometheusQuery`` with the vLLM presets must read the
same running/waiting counts the replicas expose on ``/metrics``.
"""

from __future__ import annotations

import time

import httpx
import pytest

from elastic.metrics import MetricQueryError, PrometheusQuery, Scrape, parse_metrics
from elastic.serve.loadgen import LoadGenerator
from elastic.serve.profiles import ConstantProfile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def exposed(url: str, name: str) -> float:
    return sum(v for _, v in parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).get(name, []))


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_prometheus_query_reads_what_replicas_expose(prometheus, replicas, background_load) -> None:
    # 1. Two replicas, scraped by Prometheus under the label service="chat".
    a = replicas.start(max_running=2, max_waiting=8, tokens_per_second=2.0)
    b = replicas.start(max_running=2, max_waiting=8, tokens_per_second=2.0)
    prometheus.scrape("chat-replicas", [a.url, b.url], {"service": "chat"})
    prometheus.wait_for_targets("chat-replicas", 2)

    # 2. Load: 10 long requests within ~1 s -> 2 running + 3 waiting on each replica.
    gen = LoadGenerator([a.url, b.url], ConstantProfile(20.0), duration=3.0, max_requests=10, max_tokens=100,
                        timeout=60.0)
    load = background_load(gen)
    wait_until(lambda: all(exposed(u, "vllm:num_requests_running") == 2 and exposed(u, "vllm:num_requests_waiting") == 3
                           for u in (a.url, b.url)), 20, "replicas to hold 2 running + 3 waiting each")

    # 3. What the replicas expose, read directly and through Prometheus, must agree.
    direct = {p: Scrape({"chat": [a.url, b.url]}, p).sample("chat", time.time()) for p in
              ("vllm-running", "vllm-waiting", "vllm-requests")}
    assert {p: s.value for p, s in direct.items()} == {"vllm-running": 4, "vllm-waiting": 6, "vllm-requests": 10}
    queries = {p: PrometheusQuery(prometheus.url, preset=p) for p in direct}
    wait_until(lambda: all((s := q.sample("chat", time.time())) is not None and s.value == direct[p].value
                           for p, q in queries.items()), 20, "Prometheus to report the same counts")
    s = queries["vllm-waiting"].sample("chat", time.time())
    assert s is not None and s.value == 6 and not s.stale and "vllm:num_requests_waiting" in s.source
    # a rate's backlog: the requests waiting beside it, read from the same scrape or one more query
    rate = Scrape({"chat": [a.url, b.url]}, "request-rate")
    t = time.time()
    assert rate.backlog("chat", t) is None  # nothing scraped at t yet
    rate.sample("chat", t)  # a rate needs two scrapes; the gauge beside it needs this one
    waiting = rate.backlog("chat", t)
    assert waiting is not None and waiting.value == 6 and "vllm-waiting" in waiting.source, waiting
    assert Scrape({"chat": [a.url]}, "vllm-requests").backlog("chat", t) is None  # counts the waiting already
    via = PrometheusQuery(prometheus.url, preset="request-rate")
    wait_until(lambda: (w := via.backlog("chat", time.time())) is not None and w.value == 6, 20,
               "Prometheus to report the backlog beside the rate")
    assert PrometheusQuery(prometheus.url, preset="vllm-running").backlog("chat", time.time()) is None
    kv = PrometheusQuery(prometheus.url, preset="vllm-kv-cache").sample("chat", time.time())
    assert kv is not None and 0 < kv.value < 1

    # 4. Wrong queries are spec errors naming the query; a missing series is missing, not zero.
    with pytest.raises(MetricQueryError, match=r"returned 2 series.*sum\(\.\.\.\)"):
        PrometheusQuery(prometheus.url, query='vllm:num_requests_running{service="$service"}').sample("chat", time.time())
    with pytest.raises(MetricQueryError, match=r"metric.query: Prometheus rejected query 'sum\(vllm:num_requests_running\{'"):
        PrometheusQuery(prometheus.url, query="sum(vllm:num_requests_running{").sample("chat", time.time())
    with pytest.raises(MetricQueryError, match="instant vector is expected"):
        PrometheusQuery(prometheus.url, query="vllm:num_requests_running[1m]").sample("chat", time.time())
    absent = PrometheusQuery(prometheus.url, preset="vllm-waiting")
    assert absent.sample("no-such-service", time.time()) is None
    assert "no series" in (absent.last_error or "")
    report = load.finish()
    assert len(report.results) <= 10
