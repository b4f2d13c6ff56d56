"""Scale-down drains: a replica taken out of the balancer finishes its requests before it stops."""

from __future__ import annotations

import time

from elastic.backends.replica_drain import wait_drained
from elastic.metrics.scrape import scrape_sum
from elastic.serve.loadgen import LoadGenerator
from elastic.serve.profiles import ConstantProfile
from tests.inference.conftest import BackgroundLoad


def _load_on(url: str, n: int, max_tokens: int) -> BackgroundLoad:
    gen = LoadGenerator([url], ConstantProfile(20.0), duration=n / 20.0 + 0.01, max_requests=n,
                        max_tokens=max_tokens, seed=3)
    return BackgroundLoad(gen)


def _wait_running(url: str, n: int) -> None:
    """Wait (bounded) until the replica at ``url`` reports ``n`` requests running."""
    deadline = time.monotonic() + 30
    while scrape_sum(url, ("vllm:num_requests_running",), timeout=10) != n:
        assert time.monotonic() < deadline, f"{url} never ran {n} requests"
        time.sleep(0.02)


def test_wait_drained_returns_once_the_requests_are_done_and_none_is_cut(replicas) -> None:
    # 30 tokens at 10 tokens/s: each request runs ~3 s, far beyond a poll
    r = replicas.start(max_running=8, max_waiting=16, tokens_per_second=10.0)
    load = _load_on(r.url, 4, 30)
    _wait_running(r.url, 4)
    # [] : drained, not given up at its timeout (that answers the busy replica); and it waited for
    # the four running requests: none runs any more
    assert wait_drained([r.url], timeout=60.0) == []
    assert scrape_sum(r.url, ("vllm:num_requests_running",), timeout=10) == 0
    r.stop()  # what the backend does next: nothing is left to cut
    report = load.finish()
    assert len(report.results) == 4
    assert all(x.complete and x.tokens == 30 for x in report.results), report.results


def test_wait_drained_gives_up_at_its_timeout_and_names_the_busy_replica(replicas) -> None:
    busy = replicas.start(max_running=4, max_waiting=16, tokens_per_second=10.0)
    idle = replicas.start(max_running=4, max_waiting=16, tokens_per_second=10.0)
    load = _load_on(busy.url, 1, 60)  # ~6 s
    _wait_running(busy.url, 1)
    assert wait_drained([busy.url, idle.url], timeout=0.5) == [busy.url]
    # it gave up at its timeout, not after the ~6 s its request runs: the request still runs
    assert scrape_sum(busy.url, ("vllm:num_requests_running",), timeout=10) == 1
    busy.stop()  # cut: the load generator must see a failed, truncated request
    report = load.finish()
    assert [x.truncated for x in report.results] == [True]


def test_an_unreachable_replica_has_nothing_to_drain() -> None:
    assert wait_drained(["http://127.0.0.1:9"], timeout=5.0) == []


def test_a_replica_read_idle_once_at_the_deadline_is_read_again_not_reported_busy(monkeypatch) -> None:
    """On a slow machine the first round of reads can outlast the timeout: a replica that read idle
    then gets its second reading instead of being named busy; one still busy is named."""
    import elastic.metrics.scrape as scrape

    reads: list[str] = []

    def slow_read(url: str, names, timeout: float = 1.0) -> float:
        reads.append(url)
        time.sleep(0.3)
        return 1.0 if url.endswith("busy") else 0.0

    monkeypatch.setattr(scrape, "scrape_sum", slow_read)
    assert wait_drained(["http://a/busy", "http://b/idle"], timeout=0.1, poll=0.01) == ["http://a/busy"]
    assert reads == ["http://a/busy", "http://b/idle", "http://b/idle"]  # one round, then idle once more
