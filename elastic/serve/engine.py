"""Continuous-batching engine of the reference replica: a bounded running batch, a bounded
waiting queue, one decoding step for the whole batch at a time, vLLM-named metrics.

``tokens_per_second`` paces the steps (each running request gets about that many tokens
per second) so a tiny CPU model can stand in for a big GPU model's speed; the compute is
real but the pace is the knob. A full waiting queue is refused at submit time (the server
answers 429); cancelled requests (client gone) free their slot at the next step.

Hand-off (``Engine.handoff``): a replica leaving the service gives every request it holds back
to the load balancer instead of finishing it; each one ends with what it generated so far and
the prompt to resume from (prompt + tokens so far, the tokens still owed), which another
replica continues exactly (decoding is greedy: the same context gives the same next token).
After it, new requests are refused (``Draining``; the server answers 503) so the replica is
idle at once and its GPU can go elsewhere within a poll instead of after its longest request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from elastic.serve.gpt import TinyGPT, decode

# vLLM's TTFT buckets (vllm/engine/metrics.py), so dashboards and quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``."""


class Draining(Exception):
    """The replica handed its requests off (it is leaving): send this one elsewhere."""


class ReplicaMetrics:
    """vLLM's metric names (``vllm:...``, label ``model_name``) on a private registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", lab, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%", lab, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.requests = Counter("elastic_replica_requests", "Requests by outcome (accepted, rejected, cancelled)",
                                lab + ["outcome"], registry=r)
        self.model_name = model_name
        for g in (self.running, self.waiting, self.kv):
            g.labels(model_name).set(0)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    cancelled: bool = False
    handed_off: bool = False  # given back to the balancer by Engine.handoff (see the module docstring)
    out: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class Engine:
    def __init__(self, model: TinyGPT, metrics: ReplicaMetrics, *, max_running: int = 8, max_waiting: int = 64,
                 tokens_per_second: float = 50.0) -> None:
        if max_running < 1 or max_waiting < 0 or tokens_per_second <= 0:
            raise ValueError("max_running >= 1, max_waiting >= 0 and tokens_per_second > 0 are required "
                             f"(got {max_running}, {max_waiting}, {tokens_per_second})")
        self.model, self.metrics = model, metrics
        self.max_running, self.max_waiting = max_running, max_waiting
        self.step_seconds = 1.0 / tokens_per_second
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.handing_off = False
        self._wake = asyncio.Event()

    def submit(self, req: Request) -> None:
        if self.handing_off:
            self.metrics.requests.labels(self.metrics.model_name, "refused_draining").inc()
            raise Draining("this replica is leaving the service and handed its requests off; send it to another")
        if len(self.waiting) + len(self.running) >= self.max_waiting + self.max_running:
            self.metrics.requests.labels(self.metrics.model_name, "rejected").inc()
            raise QueueFull(f"waiting queue full ({self.max_waiting}); retry later")
        self.waiting.append(req)
        self.metrics.requests.labels(self.metrics.model_name, "accepted").inc()
        self._update_gauges()
        self._wake.set()

    def handoff(self) -> int:
        """Give every running and waiting request back (each stream ends with a resume point) and
        refuse new ones from now on; returns how many were handed off. Call it on the engine's loop."""
        self.handing_off = True
        reqs = [r for r in self.running + list(self.waiting) if not r.cancelled]
        self.running.clear()
        self.waiting.clear()
        for r in reqs:
            r.handed_off = True
            r.out.put_nowait(None)
        if reqs:
            self.metrics.requests.labels(self.metrics.model_name, "handed_off").inc(len(reqs))
        self._update_gauges()
        return len(reqs)

    async def run(self) -> None:
        """The step loop: 1. drop cancelled, 2. admit, 3. one batched step, 4. emit, 5. pace."""
        while True:
            self._drop_cancelled()
            self._admit()
            self._update_gauges()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            batch = list(self.running)
            seqs = [self._context(r) for r in batch]
            new = await asyncio.to_thread(self.model.next_tokens, seqs)
            self._emit(batch, new)
            await asyncio.sleep(max(0.0, self.step_seconds - (time.monotonic() - started)))

    # ---- steps ---------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.running if r.cancelled] + [r for r in self.waiting if r.cancelled]:
            (self.running.remove if r in self.running else self.waiting.remove)(r)
            self.metrics.requests.labels(self.metrics.model_name, "cancelled").inc()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            self.running.append(r)
            self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(len(r.prompt))

    def _context(self, r: Request) -> list[int]:
        seq = r.prompt + r.tokens
        return seq[-self.model.max_positions:]

    def _emit(self, batch: list[Request], new: list[int]) -> None:
        now = time.monotonic()
        m, name = self.metrics, self.metrics.model_name
        for r, tok in zip(batch, new, strict=True):
            if r.cancelled or r.handed_off:  # handed off while this step ran: the next replica makes it
                continue
            r.tokens.append(tok)
            if r.first_token_at is None:
                r.first_token_at = now
                m.ttft.labels(name).observe(now - r.arrival)
            m.generation_tokens.labels(name).inc()
            r.out.put_nowait(decode([tok]))
            if len(r.tokens) >= r.max_tokens:
                r.out.put_nowait(None)
                self.running.remove(r)
                m.success.labels(name, "length").inc()
                m.e2e.labels(name).observe(now - r.arrival)

    def _update_gauges(self) -> None:
        m, name = self.metrics, self.metrics.model_name
        m.running.labels(name).set(len(self.running))
        m.waiting.labels(name).set(len(self.waiting))
        used = sum(len(self._context(r)) for r in self.running)
        m.kv.labels(name).set(used / (self.max_running * self.model.max_positions))
