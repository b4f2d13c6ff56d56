"""A reading that cannot be load -- negative, not finite, or from the future -- is never read as
load: every source reports it as missing (or the replica's part as failed), and the policy holds."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.metrics import InProcessSource, PrometheusQuery
from elastic.metrics.sample import FUTURE_TOLERANCE_S, MetricSample
from elastic.model import InferenceSpec
from elastic.policy import PolicyContext, PolicyState, decide


class _PromAPI:
    """Prometheus's HTTP query API answering one canned vector (a source with a skewed clock)."""

    def __init__(self) -> None:
        self.answer: tuple[float, str] = (0.0, "0")
        api = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                ts, value = api.answer
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [ts, value]}]}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def prom_api() -> Iterator[_PromAPI]:
    api = _PromAPI()
    yield api
    api.server.shutdown()
    api.server.server_close()


def test_prometheus_negative_and_future_readings_are_missing_not_load(prom_api: _PromAPI) -> None:
    q = PrometheusQuery(prom_api.url, query="sum(x)", retries=0)
    now = time.time()
    prom_api.answer = (now, "-50")
    assert q.sample("chat", now) is None and "-50 is negative" in q.last_error
    prom_api.answer = (now + 3600, "12")
    assert q.sample("chat", now) is None and "3600 s in the future" in q.last_error
    prom_api.answer = (now, "NaN")
    assert q.sample("chat", now) is None and "nan" in q.last_error
    # a little clock skew is a reading like any other
    prom_api.answer = (now + FUTURE_TOLERANCE_S / 2, "12")
    s = q.sample("chat", now)
    assert s is not None and s.value == 12.0 and not s.stale and q.last_error is None


def test_a_real_prometheus_answering_a_negative_value_is_missing(prometheus: Any) -> None:
    q = PrometheusQuery(prometheus.url, query="vector(-50)", retries=1)
    assert q.sample("chat", time.time()) is None and "negative" in q.last_error
    assert q.sample("chat", time.time()) is None
    assert PrometheusQuery(prometheus.url, query="vector(7)").sample("chat", time.time()).value == 7.0


def test_in_process_readings_that_are_not_load_are_missing() -> None:
    src = InProcessSource(max_age=30)
    for value, at in ((-50.0, 100.0), (float("inf"), 100.0), (5.0, 100.0 + FUTURE_TOLERANCE_S + 1)):
        src.set("chat", value, at=at)
        assert src.sample("chat", 100.0) is None and src.last_error
    src.set("chat", 5.0, at=100.0)
    assert src.sample("chat", 100.0).value == 5.0 and src.last_error is None


def test_scrape_ignores_the_replica_whose_reading_is_negative(replicas: Any) -> None:
    import httpx

    from elastic.metrics import Scrape

    a, b = replicas.start(), replicas.start()
    bad = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _gauge_handler(b"vllm:num_requests_running -50\n"))
    threading.Thread(target=bad.serve_forever, daemon=True).start()
    try:
        bad_url = f"http://127.0.0.1:{bad.server_address[1]}"
        src = Scrape({"chat": [a.url, b.url, bad_url]}, "vllm-requests")
        for u in (a.url, b.url):
            assert httpx.get(f"{u}/health").status_code == 200
        s = src.sample("chat", time.time())
        assert s is not None and s.value >= 0 and s.stale  # the others' reading, partial: never shrinks
        assert "negative" in src.last_error and bad_url in src.last_error
    finally:
        bad.shutdown()
        bad.server_close()


def _gauge_handler(body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    return H


@pytest.mark.parametrize("value", [-50.0, float("nan"), float("-inf")])
def test_the_policy_holds_five_replicas_on_a_reading_that_is_not_load(value: float) -> None:
    spec = InferenceSpec.model_validate({"name": "chat", "min_replicas": 1, "max_replicas": 10,
                                         "metric": {"preset": "vllm-requests", "target": 10.0}})
    ctx = PolicyContext.from_sample(spec, 5, MetricSample(value, 100.0, "forged"), 100.0, PolicyState())
    assert ctx.metric is None
    d, _ = decide(ctx)
    assert d.replicas == 5
