"""Open-loop load generator: Poisson arrivals following a rate profile, streaming requests,
TTFT and end-to-end latency per request, SLO attainment.

Open loop: a request is sent at its arrival time whether or not earlier ones finished (as
users do), so an overloaded service shows up as growing TTFT, not as a slower generator.
Bounded on purpose: ``duration`` seconds and ``max_requests`` requests at most, and, unless
``allow_remote=True``, loopback targets only. Requests go to the target with the fewest
requests in flight (a least-outstanding balancer); targets may change while running.

It is also the demo's load balancer, so it resumes what a leaving replica hands off: a
stream that ends with ``finish_reason: "handoff"`` is continued on another target from the
``resume`` point the replica gave (same text, the time to first token is the first one's),
and a 503 ``draining`` answer is sent to another target; at most ``MAX_HOPS`` times per
request. ``Result.handoffs`` counts them.

``python -m elastic.serve.loadgen --target http://127.0.0.1:8000 --profile diurnal ...``
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from elastic.serve.profiles import (
    BurstProfile,
    ConstantProfile,
    DiurnalProfile,
    Profile,
    arrival_times,
    parse_csv_profile,
)


@dataclass(frozen=True)
class Result:
    sent_at: float  # seconds since the run started
    target: str
    status: int  # HTTP status; 0 = connection error / timeout
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    # the stream ended as the server meant it to (a finish reason or ``[DONE]``): a response
    # cut short (a replica stopped under it) has a first token but is a failed request
    complete: bool = False
    handoffs: int = 0  # times it moved to another replica (handed off mid-stream, or refused as draining)

    def met(self, ttft_target: float) -> bool:
        """Answered in full with its first token within ``ttft_target`` seconds (the SLO)."""
        return self.complete and self.ttft is not None and self.ttft <= ttft_target

    @property
    def truncated(self) -> bool:
        return self.ttft is not None and not self.complete


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    duration: float = 0.0

    @property
    def ok(self) -> list[Result]:
        """Requests answered in full (a first token and the stream's proper end)."""
        return [r for r in self.results if r.status == 200 and r.ttft is not None and r.complete]

    def slo_attainment(self, ttft_target: float, since: float = 0.0) -> float:
        """Share of requests sent after ``since`` answered in full with a TTFT within the target
        (failures, truncated streams among them, count as misses)."""
        sent = [r for r in self.results if r.sent_at >= since]
        if not sent:
            return float("nan")
        return sum(1 for r in sent if r.met(ttft_target)) / len(sent)

    def ttft_quantile(self, q: float, since: float = 0.0) -> float | None:
        vals = sorted(r.ttft for r in self.ok if r.sent_at >= since and r.ttft is not None)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None

    def summary(self, ttft_target: float) -> dict:
        ok = self.ok
        return {
            "requests": len(self.results), "ok": len(ok),
            "rejected": sum(1 for r in self.results if r.status in (429, 503)),
            "errors": sum(1 for r in self.results if r.status not in (200, 429, 503)),
            "truncated": sum(1 for r in self.results if r.truncated),
            "handed_off": sum(1 for r in self.results if r.handoffs),
            "ttft_p50": self.ttft_quantile(0.5), "ttft_p90": self.ttft_quantile(0.9),
            "e2e_p50": quantile([r.e2e for r in ok if r.e2e is not None], 0.5),
            "slo_ttft_seconds": ttft_target, "slo_attainment": self.slo_attainment(ttft_target),
            "duration_seconds": self.duration,
        }


def quantile(vals: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``vals`` (nearest rank, no interpolation); None when empty."""
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        raise ValueError(f"target {url!r} is not a loopback address; pass allow_remote=True (--allow-remote) "
                         "to load a remote service on purpose")


MAX_HOPS = 4  # a request moves to another replica at most this many times (hand-offs, draining refusals)


class LoadGenerator:
    """``targets``: replica base URLs, or a callable returning the current list."""

    def __init__(self, targets: Sequence[str] | Callable[[], Sequence[str]], profile: Profile, *,
                 duration: float, max_requests: int = 10_000, max_tokens: int = 16, prompt: str = "Hello",
                 timeout: float = 30.0, seed: int = 0, allow_remote: bool = False) -> None:
        if duration <= 0 or max_requests < 1 or max_tokens < 1:
            raise ValueError(f"duration > 0, max_requests >= 1, max_tokens >= 1 required "
                             f"(got {duration}, {max_requests}, {max_tokens})")
        self._targets = targets
        self.profile, self.duration, self.max_requests = profile, duration, max_requests
        self.max_tokens, self.prompt, self.timeout = max_tokens, prompt, timeout
        self.allow_remote = allow_remote
        self.rng = random.Random(seed)
        self.in_flight: dict[str, int] = {}
        self.report = Report()
        self.started: float | None = None
        self._stop = False

    def stop(self) -> None:
        """Ask a running ``run()`` to stop sending and to drop what is in flight (thread-safe)."""
        self._stop = True

    def targets(self) -> list[str]:
        urls = [u.rstrip("/") for u in (self._targets() if callable(self._targets) else self._targets)]
        if not self.allow_remote:
            for u in urls:
                check_loopback(u)
        return urls

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    async def run(self) -> Report:
        """1. draw arrival times, 2. fire each at its time (open loop), 3. wait (bounded), 4. report."""
        self.targets()  # fail fast on a remote target
        arrivals = arrival_times(self.profile, self.duration, self.rng, self.max_requests)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            self.started = time.monotonic()
            tasks = []
            for t in arrivals:
                while not self._stop and self.elapsed() < t:
                    await asyncio.sleep(min(0.05, t - self.elapsed()))
                if self._stop:
                    break
                tasks.append(asyncio.create_task(self._one(client, self.elapsed())))
            deadline = self.elapsed() + self.timeout + 1.0
            pending = {t for t in tasks if not t.done()}
            while pending and not self._stop and self.elapsed() < deadline:
                _, pending = await asyncio.wait(pending, timeout=0.1)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.report.duration = self.elapsed()
        self.report.results.sort(key=lambda r: r.sent_at)
        return self.report

    async def _one(self, client: httpx.AsyncClient, sent_at: float) -> None:
        self.report.results.append(await self._serve(client, sent_at))

    def _pick(self, avoid: set[str]) -> str | None:
        # Least outstanding requests; ties broken at random so equal replicas share evenly.
        urls = [u for u in self.targets() if u not in avoid]
        return min(urls, key=lambda u: (self.in_flight.get(u, 0), self.rng.random())) if urls else None

    async def _serve(self, client: httpx.AsyncClient, sent_at: float) -> Result:
        """One request, from its first target to its end, through hand-offs (see the module docstring)."""
        body: dict = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}
        t0 = time.monotonic()
        ttft, tokens, hops, avoid, target = None, 0, 0, set(), ""
        while True:
            picked = self._pick(avoid)
            if picked is None:
                return Result(sent_at, target, 0 if not target else 503, ttft, tokens=tokens, handoffs=hops)
            target = picked
            self.in_flight[target] = self.in_flight.get(target, 0) + 1
            try:
                leg = await self._request(client, target, body, t0)
            finally:
                self.in_flight[target] -= 1
            ttft = ttft if ttft is not None else leg.ttft
            tokens += leg.tokens
            if leg.moved is None or hops >= MAX_HOPS:
                status = leg.status if leg.moved is None else 503
                e2e = time.monotonic() - t0 if leg.complete else None
                return Result(sent_at, target, status, ttft, e2e, tokens, leg.complete and leg.moved is None,
                              handoffs=hops)
            hops += 1
            avoid.add(target)  # it is leaving
            body = {**body, **leg.moved}

    async def _request(self, client: httpx.AsyncClient, target: str, body: dict, t0: float) -> _Leg:
        ttft, tokens, complete, moved = None, 0, False, None
        try:
            async with client.stream("POST", f"{target}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    if resp.status_code == 503 and _error_type(raw) == "draining":
                        return _Leg(503, None, 0, False, {})  # leaving: the same request goes elsewhere
                    return _Leg(resp.status_code, None, 0, False, None)
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        complete = True
                        continue
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    choice = chunk["choices"][0]
                    if choice["finish_reason"] == "handoff":
                        moved = {k: chunk["resume"][k] for k in ("prompt", "max_tokens")}
                        continue
                    if choice["finish_reason"] is not None:
                        complete = True
                    if choice["text"] or choice["finish_reason"] is None:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        tokens += 1
            return _Leg(200, ttft, tokens, complete, moved)
        except (TimeoutError, httpx.HTTPError):
            return _Leg(0, ttft, tokens, False, None)


@dataclass(frozen=True)
class _Leg:
    """One replica's part of a request: ``moved`` is what to post next (a hand-off's resume point,
    ``{}`` for the same body after a draining refusal), None when the request ended here."""

    status: int
    ttft: float | None
    tokens: int
    complete: bool
    moved: dict | None


def _error_type(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


# ---- command line ----------------------------------------------------------------------------------


def build_profile(a: argparse.Namespace) -> Profile:
    if a.profile == "constant":
        return ConstantProfile(a.rate)
    if a.profile == "diurnal":
        return DiurnalProfile(peak=a.rate, day_seconds=a.day_seconds, start_fraction=a.start_hour / 24)
    if a.profile == "bursts":
        bursts = tuple(tuple(float(x) for x in b.split(":")) for b in a.burst)
        if any(len(b) != 3 for b in bursts):
            raise ValueError("--burst expects START:DURATION:RATE")
        return BurstProfile(a.rate, bursts)  # type: ignore[arg-type]
    path = Path(a.profile)
    return parse_csv_profile(path.read_text(), source=str(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic.serve.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", required=True, help="replica base URL (repeat for several)")
    p.add_argument("--profile", default="constant", help="constant | diurnal | bursts | path to a CSV "
                   "'t_seconds,requests_per_second'")
    p.add_argument("--rate", type=float, default=5.0, help="req/s (constant), peak (diurnal) or base (bursts)")
    p.add_argument("--day-seconds", type=float, default=600.0, help="diurnal: length of the compressed day")
    p.add_argument("--start-hour", type=float, default=0.0, help="diurnal: time of day at start")
    p.add_argument("--burst", action="append", default=[], help="bursts: START:DURATION:RATE (repeatable)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-slo", type=float, default=0.5, help="TTFT target, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback targets")
    a = p.parse_args(argv)
    try:
        gen = LoadGenerator(a.target, build_profile(a), duration=a.duration, max_requests=a.max_requests,
                            max_tokens=a.max_tokens, seed=a.seed, allow_remote=a.allow_remote)
        report = asyncio.run(gen.run())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.summary(a.ttft_slo), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
