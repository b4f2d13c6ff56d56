"""Metric source that reads the replicas' ``/metrics`` directly (embedded default: no
Prometheus needed) and aggregates them the way the preset's PromQL would.

* gauges: sum (or average) over replicas, e.g. running + waiting requests;
* counters (``request-rate``): per-replica rate from the previous scrape, summed;
* histograms (TTFT quantiles): bucket increase since the previous scrape, summed over
  replicas, then Prometheus' ``histogram_quantile`` interpolation.

Missing, never zero: no targets, no replica answering, or no rate yet -> None. If only some
replicas answer, the value from those is returned with ``stale=True`` (a partial sum can
justify growth, not shrinkage). Parsing uses ``prometheus_client``'s text parser.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from elastic.metrics.presets import Preset, get_preset
from elastic.metrics.sample import MetricSample, invalid_reading

Samples = dict[str, list[tuple[dict[str, str], float]]]

_shared: httpx.Client | None = None
_shared_lock = threading.Lock()


def shared_client() -> httpx.Client:
    """One HTTP client for this process's one-off requests to replicas (drain checks, hand-offs,
    readiness reads): building a client builds a TLS context, tens of milliseconds of CPU, which
    a poll every 100 ms would pay on every read. Thread-safe; each call passes its own timeout.
    No connection is kept alive: a request to a replica that is gone fails as unreachable, never
    on a pooled connection to a server that has since gone away."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        return _shared


def parse_metrics(text: str) -> Samples:
    """``/metrics`` text -> {sample name: [(labels, value)]} (names as exposed, e.g. ``..._total``)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def scrape_sum(url: str, names: Sequence[str], timeout: float = 1.0) -> float | None:
    """Sum of the samples named ``names`` on one replica's ``/metrics`` (all label sets);
    None when the replica does not answer. For one-off reads (drain checks, the demo's
    accounting); the controller's metric source is :class:`Scrape`."""
    try:
        text = shared_client().get(f"{url.rstrip('/')}/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return None
    samples = parse_metrics(text)
    return sum(v for n in names for _, v in samples.get(n, []))


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' interpolation over cumulative bucket counts {upper bound: count}."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):  # in the +Inf bucket: the highest finite bound is the answer
                return prev_bound
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return prev_bound


class Scrape:
    """``targets``: service -> replica base URLs (a mapping, or a callable for a live view)."""

    def __init__(self, targets: Mapping[str, Sequence[str]] | Callable[[str], Sequence[str]], preset: str, *,
                 timeout: float = 2.0, client: httpx.Client | None = None) -> None:
        self.preset: Preset = get_preset(preset)
        self._targets = targets
        self._client = client or httpx.Client(timeout=timeout)
        self._prev: dict[str, tuple[float, Samples]] = {}  # per URL: last scrape (counters, histograms)
        self.last_error: str | None = None

    def close(self) -> None:
        self._client.close()

    def targets(self, service: str) -> list[str]:
        t = self._targets(service) if callable(self._targets) else self._targets.get(service, ())
        return [u.rstrip("/") for u in t]

    def backlog(self, service: str, now: float) -> MetricSample | None:
        """The requests waiting beside a rate preset (its ``backlog`` gauge, summed over replicas),
        from the scrape ``sample`` made at ``now`` (no second request); None without such a
        preset, before that scrape, or when no replica scraped then exposes the gauge."""
        if self.preset.backlog is None:
            return None
        names = get_preset(self.preset.backlog).samples
        urls = self.targets(service)
        scraped = [prev[1] for u in urls if (prev := self._prev.get(u)) is not None and prev[0] == now]
        found = [v for got in scraped for name in names for _, v in got.get(name, [])]
        if not found:
            return None
        source = f"scrape {len(scraped)}/{len(urls)} replicas of '{service}': {self.preset.backlog}"
        return MetricSample(sum(found), now, source, stale=len(scraped) < len(urls))

    def sample(self, service: str, now: float) -> MetricSample | None:
        urls = self.targets(service)
        if not urls:
            self.last_error = f"service '{service}' has no replicas to scrape"
            return None
        values, failed = [], []
        for url in urls:
            got = self._scrape(url)
            if got is None:
                failed.append(url)
                continue
            v = self._value(url, now, got)
            self._prev[url] = (now, got)
            if isinstance(v, float) and (why := invalid_reading(v, now, now)) is not None:
                self.last_error = f"{url}/metrics: {self.preset.name}: {why}; this replica's reading is ignored"
                failed.append(url)
                continue
            if v is not None:
                values.append(v)
        value = self._aggregate(values)
        if value is None:
            if not self.last_error or not failed:
                self.last_error = f"{self.preset.name}: no value yet from {len(urls)} replicas"
            return None
        partial = len(values) < len(urls)
        source = f"scrape {len(values)}/{len(urls)} replicas of '{service}': {self.preset.name}"
        return MetricSample(value, now, source, stale=partial)

    # ---- steps -------------------------------------------------------------------------------

    def _scrape(self, url: str) -> Samples | None:
        try:
            resp = self._client.get(f"{url}/metrics")
            resp.raise_for_status()
            return parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as e:
            self.last_error = f"scrape {url}/metrics failed: {type(e).__name__}: {e}"
            return None

    def _value(self, url: str, now: float, got: Samples) -> float | tuple[float, ...] | None:
        p = self.preset
        if p.kind == "gauge":
            found = [v for name in p.samples for _, v in got.get(name, [])]
            if not found:
                return None
            return sum(found) if p.agg == "sum" else sum(found) / len(found)
        prev = self._prev.get(url)
        if prev is None or now <= prev[0]:
            return None  # a rate needs two scrapes
        if p.kind == "rate":
            cur_total = sum(v for _, v in got.get(p.samples[0], []))
            old_total = sum(v for _, v in prev[1].get(p.samples[0], []))
            inc = cur_total - old_total if cur_total >= old_total else cur_total  # counter reset
            return inc / (now - prev[0])
        return self._bucket_increase(got, prev[1])

    def _bucket_increase(self, got: Samples, old: Samples) -> tuple[float, ...] | None:
        name = self.preset.samples[0]
        cur = _buckets(got.get(name, []))
        before = _buckets(old.get(name, []))
        if not cur:
            return None
        reset = any(cur[b] < before.get(b, 0.0) for b in cur)
        inc = {b: cur[b] - (0.0 if reset else before.get(b, 0.0)) for b in cur}
        return tuple(x for b in sorted(inc) for x in (b, inc[b]))

    def _aggregate(self, values: list) -> float | None:
        if not values:
            return None
        p = self.preset
        if p.kind == "quantile":
            merged: dict[float, float] = {}
            for flat in values:
                for b, c in zip(flat[::2], flat[1::2], strict=True):
                    merged[b] = merged.get(b, 0.0) + c
            return histogram_quantile(p.quantile, merged)
        return sum(values) if p.agg == "sum" else sum(values) / len(values)


def _buckets(samples: list[tuple[dict[str, str], float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, v in samples:
        le = float(labels.get("le", "nan"))
        if not math.isnan(le):
            out[le] = out.get(le, 0.0) + v
    return out
