"""The reference replica: OpenAI-compatible subset, bounded queue, vLLM-named metrics; as a
plain process (``python -m elastic.serve``) and as a Ray actor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from elastic.metrics import parse_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_completion_stream_metrics_and_health(replicas) -> None:
    r = replicas.start(max_running=2, max_waiting=1, tokens_per_second=100.0)
    with httpx.Client(timeout=10) as c:
        assert c.get(f"{r.url}/health").status_code == 200
        out = c.post(f"{r.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 5}).json()
        assert out["object"] == "text_completion" and out["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        assert out["choices"][0]["finish_reason"] == "length"
        with c.stream("POST", f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5  # 3 tokens, a final chunk, DONE
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        bad = c.post(f"{r.url}/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        assert c.post(f"{r.url}/v1/completions", json={"max_tokens": 3}).status_code == 422
        m = parse_metrics(c.get(f"{r.url}/metrics").text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in m, name
    assert sum(v for _, v in m["vllm:request_success_total"]) == 2
    assert sum(v for _, v in m["vllm:time_to_first_token_seconds_count"]) == 2
    assert sum(v for _, v in m["vllm:generation_tokens_total"]) == 8


def test_full_queue_answers_429(replicas) -> None:
    r = replicas.start(max_running=1, max_waiting=1, tokens_per_second=2.0)
    with httpx.Client(timeout=10) as c:
        streams = []
        for _ in range(2):  # one running, one waiting
            req = c.build_request("POST", f"{r.url}/v1/completions", json={"prompt": "a", "max_tokens": 50, "stream": True})
            streams.append(c.send(req, stream=True))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = parse_metrics(c.get(f"{r.url}/metrics").text)
            if m["vllm:num_requests_running"][0][1] == 1 and m["vllm:num_requests_waiting"][0][1] == 1:
                break
            time.sleep(0.05)
        full = c.post(f"{r.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
        for s in streams:
            s.close()  # client gone: the replica frees both slots
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = parse_metrics(c.get(f"{r.url}/metrics").text)
            if m["vllm:num_requests_running"][0][1] == 0 and m["vllm:num_requests_waiting"][0][1] == 0:
                break
            time.sleep(0.1)
        assert c.post(f"{r.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    outcomes = {lab["outcome"]: v for lab, v in m["elastic_replica_requests_total"]}
    assert outcomes["rejected"] == 1 and outcomes["cancelled"] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plain_process() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "elastic.serve", "--port", "0", "--max-running", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # printed once the socket is bound
        assert line.startswith("elastic-serve listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "replica process did not become healthy"
            time.sleep(0.3)
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(20)


def test_bad_arguments_exit_2() -> None:
    out = subprocess.run([sys.executable, "-m", "elastic.serve", "--max-running", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-running" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.ray
def test_ray_actor_replica() -> None:
    ray = pytest.importorskip("ray")
    from elastic.serve.ray_replica import start_replica
    from elastic.serve.server import ReplicaConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, object_store_memory=200 * 2**20,
             _node_ip_address="127.0.0.1", configure_logging=False)
    try:
        handle, url = start_replica(ReplicaConfig(max_running=2))
        assert url.startswith("http://127.0.0.1:")
        assert ray.available_resources().get("GPU", 0) == 7  # the actor holds one logical GPU
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert out.status_code == 200
        assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics", timeout=10).text
        ray.get(handle.stop.remote(), timeout=30)
    finally:
        ray.shutdown()
