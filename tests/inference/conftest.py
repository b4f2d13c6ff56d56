"""Builders for the inference tests: reference replicas in this process and a load generator
running in a background thread (so the test body can poll and decide meanwhile)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from elastic.serve.loadgen import LoadGenerator, Report
from elastic.serve.server import ReplicaConfig, ThreadedReplica


class Replicas:
    def __init__(self) -> None:
        self.running: list[ThreadedReplica] = []

    def start(self, **cfg) -> ThreadedReplica:
        r = ThreadedReplica(ReplicaConfig(**cfg))
        self.running.append(r)
        return r

    def urls(self) -> list[str]:
        return [r.url for r in self.running]

    def stop_all(self) -> None:
        for r in self.running:
            r.stop()
        self.running.clear()


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    pool = Replicas()
    try:
        yield pool
    finally:
        pool.stop_all()


class BackgroundLoad:
    """Runs ``LoadGenerator.run()`` on its own event loop in a thread."""

    def __init__(self, gen: LoadGenerator) -> None:
        self.gen = gen
        self.report: Report | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.report = asyncio.run(self.gen.run())
        except BaseException as e:  # surfaced by finish()
            self.error = e

    def finish(self, timeout: float = 30.0) -> Report:
        self.gen.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "load generator did not stop"
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


@pytest.fixture
def background_load() -> Iterator:
    """``start = background_load; run = start(generator)``; stopped at teardown if still running."""
    runs: list[BackgroundLoad] = []

    def start(gen: LoadGenerator) -> BackgroundLoad:
        runs.append(BackgroundLoad(gen))
        return runs[-1]

    yield start
    for r in runs:
        r.gen.stop()
        r.thread.join(30)
