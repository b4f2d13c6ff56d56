"""Replicas under the load generator push the policy to scale up; the added replicas bring
TTFT back under target. A small closed loop: observe (scrape) -> decide (policy) -> act
(start in-process replicas; the generator balances over the live list). Loopback, bounded.

Capacity: 2 running x 10 tokens/s / 4 tokens = ~5 req/s per replica; load 9 req/s, so one
replica queues ~4 req/s and TTFT grows by ~0.8 s every second until the policy adds replicas.
Three replicas (15 req/s) carry 9 req/s at 60 % with room left for a busy CI machine.
"""

from __future__ import annotations

import time

import pytest

from elastic.metrics import Scrape
from elastic.model import InferenceSpec
from elastic.policy import PolicyContext, PolicyState, Reason, decide
from elastic.serve.loadgen import LoadGenerator
from elastic.serve.profiles import ConstantProfile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TTFT_TARGET = 1.0
REPLICA = {"max_running": 2, "max_waiting": 500, "tokens_per_second": 10.0}


def test_scale_up_brings_ttft_back_under_target(replicas, background_load) -> None:
    spec = InferenceSpec.model_validate({"name": "chat", "min_replicas": 1, "max_replicas": 3,
                                         "metric": {"preset": "vllm-requests", "target": 2.0}})
    replicas.start(**REPLICA)
    source = Scrape(lambda _svc: replicas.urls(), "vllm-requests")
    gen = LoadGenerator(replicas.urls, ConstantProfile(9.0), duration=20.0, max_requests=300, max_tokens=4,
                        timeout=30.0, seed=3)
    load = background_load(gen)

    # 1. Overload one replica for 5 s, then let the policy act once a second.
    time.sleep(5.0)
    state, decisions, scaled_at = PolicyState(), [], None
    while gen.elapsed() < 12.0:
        sample = source.sample("chat", time.time())
        d, state = decide(PolicyContext.from_sample(spec, len(replicas.running), sample, time.time(), state))
        decisions.append(d)
        while len(replicas.running) < d.replicas:  # act: start what the policy asked for
            replicas.start(**REPLICA)
            scaled_at = scaled_at if scaled_at is not None else gen.elapsed()
        time.sleep(1.0)
    time.sleep(max(0.0, 18.0 - gen.elapsed()))
    report = load.finish()

    # 2. The policy saw the queue and scaled up to the bound, saying why.
    first = decisions[0]
    assert first.replicas > 1 and first.reason in (Reason.SCALED_UP, Reason.LIMITED_BY_MAX), first
    assert "load" in first.message and len(replicas.running) == 3
    # 3. Before the scale-up TTFT missed the target; after it (once the backlog drained) it meets it.
    before = [r.ttft for r in report.ok if 3.0 <= r.sent_at < 5.0]
    after_since = scaled_at + 6.0  # the first replica's backlog (~20 requests) drains meanwhile
    print(f"scaled at {scaled_at:.1f}s; decisions {[(d.replicas, d.reason.value) for d in decisions]}")
    print(f"TTFT p50 before {sorted(before)[len(before) // 2]:.2f}s, "
          f"p90 after {report.ttft_quantile(0.9, since=after_since):.2f}s, "
          f"SLO attainment after {report.slo_attainment(TTFT_TARGET, since=after_since):.2f}")
    assert sorted(before)[len(before) // 2] > TTFT_TARGET
    assert report.ttft_quantile(0.9, since=after_since) < TTFT_TARGET
    assert report.slo_attainment(TTFT_TARGET, since=after_since) >= 0.9
