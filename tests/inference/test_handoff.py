"""Hand-off: a leaving replica gives its requests back and the balancer resumes them elsewhere,
the same text, nothing cut, the replica idle at once (InferenceSpec.handoff)."""

from __future__ import annotations

import json
import time

import httpx

from elastic.backends.ray import hand_off, wait_drained
from elastic.serve.loadgen import LoadGenerator
from elastic.serve.profiles import ConstantProfile
from tests.inference.conftest import BackgroundLoad


def _stream(url: str, body: dict, stop_after: int | None = None,
            on_stop=None) -> tuple[str, int, dict | None, str | None]:
    """Post a streaming completion: (text, tokens, resume point or None, finish reason). After
    ``stop_after`` tokens, call ``on_stop()`` once (and keep reading)."""
    text, resume, finish, n = [], None, None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (chunk := json.loads(line[6:]))["choices"][0]
            if choice["finish_reason"] is not None:
                finish, resume = choice["finish_reason"], chunk.get("resume")
                continue
            text.append(choice["text"])
            n += 1
            if stop_after is not None and n == stop_after:
                on_stop()
    return "".join(text), n, resume, finish


def test_a_handed_off_request_resumes_on_another_replica_with_the_same_text(replicas) -> None:
    a = replicas.start(max_running=4, tokens_per_second=40.0)
    b = replicas.start(max_running=4, tokens_per_second=40.0)
    body = {"prompt": "The quick brown fox", "max_tokens": 24}
    whole, n_whole, _, finish = _stream(b.url, body)
    assert finish == "length" and n_whole == 24

    answered: list[dict] = []
    first, n_first, resume, finish = _stream(
        a.url, body, stop_after=5, on_stop=lambda: answered.append(httpx.post(f"{a.url}/admin/handoff").json()))
    assert finish == "handoff" and answered == [{"handed_off": 1}]
    # the resume point: the prompt's token ids plus every token the client received, and what is still owed
    assert 5 <= n_first < 24 and resume is not None
    assert resume["max_tokens"] == 24 - n_first and len(resume["prompt"]) == len(body["prompt"]) + n_first
    rest, n_rest, _, finish = _stream(b.url, resume)
    assert finish == "length" and n_first + n_rest == 24
    assert first + rest == whole  # greedy decoding: the same context continues with the same tokens


def test_after_a_handoff_the_replica_refuses_new_requests_as_draining_and_reports_unhealthy(replicas) -> None:
    a = replicas.start(max_running=4, tokens_per_second=40.0)
    assert httpx.get(f"{a.url}/health").status_code == 200
    assert httpx.post(f"{a.url}/admin/handoff").json() == {"handed_off": 0}
    r = httpx.post(f"{a.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "draining"
    assert httpx.get(f"{a.url}/health").status_code == 503
    metrics = httpx.get(f"{a.url}/metrics").text
    assert 'elastic_replica_requests_total{model_name="tiny",outcome="refused_draining"} 1.0' in metrics


def test_token_id_prompts_are_checked_against_the_vocabulary(replicas) -> None:
    a = replicas.start(max_running=4, tokens_per_second=40.0)
    ok = httpx.post(f"{a.url}/v1/completions", json={"prompt": [72, 105], "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    for bad in ([], [-1], [10**9]):
        r = httpx.post(f"{a.url}/v1/completions", json={"prompt": bad, "max_tokens": 2}, timeout=10)
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], (bad, r.text)


def test_the_balancer_resumes_every_handed_off_stream_and_the_leaving_replica_is_idle_at_once(replicas) -> None:
    # 60 tokens at 10 tokens/s: each request runs ~6 s; the hand-off comes 1 s in, so a replica that
    # drained its requests instead would stay busy ~5 s more
    leaving = replicas.start(max_running=8, max_waiting=16, tokens_per_second=10.0)
    staying = replicas.start(max_running=8, max_waiting=16, tokens_per_second=10.0)
    targets = [leaving.url]
    gen = LoadGenerator(lambda: list(targets), ConstantProfile(40.0), duration=0.6, max_requests=6, max_tokens=60,
                        seed=5)
    load = BackgroundLoad(gen)
    time.sleep(1.0)
    targets[:] = [staying.url]  # 1. out of the balancer's targets, 2. hand off
    t0 = time.monotonic()
    moved = hand_off([leaving.url])
    assert wait_drained([leaving.url], timeout=10.0) == []
    idle_after = time.monotonic() - t0
    # idle well before its requests could have ended there (a bound with room for a slow machine)
    assert moved[leaving.url] == 6 and idle_after < 3.0, (moved, idle_after)
    leaving.stop()  # what the backend does next: nothing of it is left to cut
    load.thread.join(30.0)  # the run ends by itself once every resumed stream has ended
    report = load.finish()
    assert len(report.results) == 6
    for x in report.results:
        assert x.complete and x.status == 200 and x.tokens == 60 and x.handoffs == 1, x
        assert x.target == staying.url and x.ttft is not None and x.ttft < 1.0
    assert report.summary(1.0)["handed_off"] == 6


def test_hand_off_reports_none_for_a_replica_without_the_endpoint() -> None:
    assert hand_off(["http://127.0.0.1:9"], timeout=1.0) == {"http://127.0.0.1:9": None}
