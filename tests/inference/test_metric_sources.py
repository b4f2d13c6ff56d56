"""Metric sources without Prometheus: presets, parsing, scraping real replicas, in-process."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from elastic.metrics import (
    PRESETS,
    InProcessSource,
    MetricQueryError,
    PrometheusQuery,
    Scrape,
    build_source,
    check_metric,
    histogram_quantile,
    parse_metrics,
)
from elastic.model import MetricTarget, SpecError

INF = math.inf


# ---- presets and spec errors -------------------------------------------------------------------


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(MetricQueryError, match="metric.preset: unknown preset 'vllm-gpu-cache'; known presets: vllm-running"):
        check_metric(MetricTarget(preset="vllm-gpu-cache", target=1))
    assert isinstance(MetricQueryError("x"), SpecError)


@pytest.mark.parametrize(
    "preset,kind,ok",
    [("vllm-requests", "AverageValue", True), ("vllm-requests", "Utilization", False),
     ("vllm-kv-cache", "Utilization", True), ("vllm-kv-cache", "AverageValue", False),
     ("vllm-ttft-p90", "Value", True), ("sglang-token-usage", "AverageValue", False),
     ("request-rate", "AverageValue", True)],
)
def test_preset_and_metric_type_must_agree(preset, kind, ok) -> None:
    m = MetricTarget(preset=preset, type=kind, target=1)
    if ok:
        assert check_metric(m).name == preset
    else:
        with pytest.raises(MetricQueryError, match=f"metric.type: preset '{preset}'"):
            check_metric(m)


def test_presets_cover_vllm_and_sglang_names() -> None:
    promql = " ".join(p.promql for p in PRESETS.values())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                 "sglang:token_usage", "vllm:request_success_total"):
        assert name in promql
    assert "gpu_cache_usage_perc" not in promql  # removed from vLLM


def test_build_source_picks_and_refuses() -> None:
    assert isinstance(build_source(MetricTarget(preset="vllm-running", target=2), targets={"x": []}), Scrape)
    q = build_source(MetricTarget(preset="vllm-running", target=2, prometheus="http://127.0.0.1:9"))
    assert isinstance(q, PrometheusQuery) and q.promql("chat") == 'sum(vllm:num_requests_running{service="chat"})'
    with pytest.raises(MetricQueryError, match="metric.query: PromQL needs metric.prometheus"):
        build_source(MetricTarget(query="up", target=1))
    with pytest.raises(MetricQueryError, match="metric.prometheus"):
        PrometheusQuery("127.0.0.1:9090", preset="vllm-running")


def test_unreachable_prometheus_is_missing_after_retries_with_backoff() -> None:
    delays: list[float] = []
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    q = PrometheusQuery(f"http://127.0.0.1:{port}", preset="vllm-running", retries=3, backoff=0.1,
                        timeout=1.0, sleep=delays.append)
    assert q.sample("chat", time.time()) is None
    assert delays == [0.1, 0.2, 0.4] and "unreachable" in (q.last_error or "")


# ---- parsing and quantiles ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "q,buckets,want",
    [
        (0.5, {0.1: 0, 0.5: 10, 1.0: 10, INF: 10}, 0.3),  # all 10 in (0.1, 0.5]: median at 0.3
        (0.9, {0.1: 5, 0.5: 5, 1.0: 10, INF: 10}, 0.9),
        (0.99, {0.1: 0, 1.0: 5, INF: 10}, 1.0),  # in +Inf: the highest finite bound
        (0.5, {0.1: 0, INF: 0}, None),  # no observations: NaN in Prometheus -> missing
    ],
)
def test_histogram_quantile(q, buckets, want) -> None:
    got = histogram_quantile(q, buckets)
    assert got == (None if want is None else pytest.approx(want))


def test_parse_metrics_keeps_colon_names_and_labels() -> None:
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3\n'
            '# TYPE vllm:request_success counter\nvllm:request_success_total{finished_reason="stop"} 7\n')
    got = parse_metrics(text)
    assert got["vllm:num_requests_running"] == [({"model_name": "m"}, 3.0)]
    assert got["vllm:request_success_total"] == [({"finished_reason": "stop"}, 7.0)]


def test_in_process_source_marks_old_values_stale() -> None:
    src = InProcessSource(max_age=30)
    assert src.sample("chat", 0.0) is None
    src.set("chat", 42.0, at=100.0)
    assert src.sample("chat", 110.0).value == 42.0 and not src.sample("chat", 110.0).stale
    assert src.sample("chat", 200.0).stale
    src.clear("chat")
    assert src.sample("chat", 200.0) is None


# ---- scraping real replicas ----------------------------------------------------------------------


def test_scrape_aggregates_replicas_and_flags_partial(replicas) -> None:
    a = replicas.start(max_running=1, max_waiting=4, tokens_per_second=1.0)
    b = replicas.start(max_running=1, max_waiting=4, tokens_per_second=1.0)
    # Two long requests on a (1 running, 1 waiting), one on b, sent without waiting for them.
    with httpx.Client(timeout=1.0) as c:
        for url in (a.url, a.url, b.url):
            try:
                c.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 100}, timeout=0.3)
            except httpx.TimeoutException:
                pass  # the request stays queued on the replica; we only needed it submitted
    now = time.time()
    # Client timeouts cancel requests at the next step, so read at once and allow either state.
    src = Scrape({"chat": [a.url, b.url]}, "vllm-running")
    s = src.sample("chat", now)
    assert s is not None and not s.stale and s.value in (0, 1, 2)
    with socket_closed_port() as dead:
        part = Scrape({"chat": [a.url, dead]}, "vllm-requests").sample("chat", now)
        assert part is not None and part.stale and "1/2 replicas" in part.source
        assert Scrape({"chat": [dead]}, "vllm-requests").sample("chat", now) is None
    assert Scrape({"chat": []}, "vllm-requests").sample("chat", now) is None


def test_scrape_rates_and_ttft_need_two_scrapes(replicas) -> None:
    r = replicas.start(max_running=4, max_waiting=4, tokens_per_second=50.0)
    rate, ttft = Scrape({"s": [r.url]}, "request-rate"), Scrape({"s": [r.url]}, "vllm-ttft-p50")
    t0 = time.time()
    assert rate.sample("s", t0) is None and ttft.sample("s", t0) is None  # first scrape: no rate yet
    with httpx.Client(timeout=10) as c:
        for _ in range(4):
            assert c.post(f"{r.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    t1 = t0 + 2.0  # the controller's clock: four requests in "2 s" -> 2 req/s
    assert rate.sample("s", t1).value == pytest.approx(2.0)
    p50 = ttft.sample("s", t1)
    assert p50 is not None and 0 < p50.value < 1.0


class socket_closed_port:
    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        return None


def test_scrape_sum_adds_every_label_set_and_reports_an_unreachable_replica_as_none() -> None:
    import http.server
    import threading

    from elastic.metrics.scrape import scrape_sum

    body = (b'vllm:num_requests_running{model_name="a"} 3\nvllm:num_requests_running{model_name="b"} 2\n'
            b'vllm:num_requests_waiting{model_name="a"} 4\n')

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert scrape_sum(url, ("vllm:num_requests_running",)) == 5
        assert scrape_sum(url, ("vllm:num_requests_running", "vllm:num_requests_waiting")) == 9
        assert scrape_sum(url, ("vllm:absent",)) == 0
    finally:
        srv.shutdown()
    assert scrape_sum(f"http://127.0.0.1:{srv.server_address[1]}", ("x",), timeout=0.5) is None
