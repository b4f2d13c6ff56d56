"""Rate profiles (pure) and the load generator's bounds and bookkeeping."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from elastic.serve.loadgen import LoadGenerator, Report, Result, check_loopback
from elastic.serve.profiles import (
    BurstProfile,
    ConstantProfile,
    DiurnalProfile,
    TableProfile,
    arrival_times,
    diurnal_rate,
    parse_csv_profile,
    rate_at,
)


@pytest.mark.parametrize(
    "hour,want",
    [(0, 25.0), (3, 25.0), (6, 25.0), (8, 62.5), (10, 100.0), (14, 100.0), (18, 81.25), (19.4, 81.25),
     (19.6, 62.5), (21.1, 43.75), (22.6, 25.0), (23.9, 25.0), (24, 25.0)],
)
def test_diurnal_shape(hour, want) -> None:
    # plateau 10-18 h, evening steps every 90 min, night trough 25 %, morning ramp 6-10 h
    assert diurnal_rate(hour / 24, 100.0) == pytest.approx(want)


@pytest.mark.parametrize(
    "profile,t,want",
    [
        (ConstantProfile(3.0), 99.0, 3.0),
        (DiurnalProfile(peak=100.0, day_seconds=240.0), 120.0, 100.0),  # noon of a 4-minute day
        (DiurnalProfile(peak=100.0, day_seconds=240.0, start_fraction=0.5), 120.0, 25.0),  # midnight
        (BurstProfile(2.0, ((10.0, 5.0, 20.0),)), 12.0, 20.0),
        (BurstProfile(2.0, ((10.0, 5.0, 20.0),)), 15.0, 2.0),
        (TableProfile(((0.0, 1.0), (10.0, 5.0))), 9.9, 1.0),
        (TableProfile(((0.0, 1.0), (10.0, 5.0))), 50.0, 5.0),
    ],
)
def test_rate_at(profile, t, want) -> None:
    assert rate_at(profile, t) == pytest.approx(want)


def test_csv_profile() -> None:
    p = parse_csv_profile("t_seconds,requests_per_second\n0,1\n30,4.5\n")
    assert p.points == ((0.0, 1.0), (30.0, 4.5))
    for bad, msg in [("0,1\n0,2\n", "times must increase"), ("0,1,2\n", "expected"), ("", "no rows"),
                     ("0,-1\n", "values be >= 0"), ("t,r\n0,x\n", "not numbers")]:
        with pytest.raises(ValueError, match=msg):
            parse_csv_profile(bad, source="load.csv")


@pytest.mark.parametrize("rate", [5.0, 50.0])
def test_arrivals_are_poisson_at_the_profile_rate(rate) -> None:
    times = arrival_times(ConstantProfile(rate), 200.0, random.Random(7))
    assert len(times) == pytest.approx(rate * 200, rel=0.1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps: std == mean


def test_arrivals_follow_a_time_varying_profile_and_bounds() -> None:
    times = arrival_times(BurstProfile(1.0, ((50.0, 50.0, 20.0),)), 150.0, random.Random(1))
    in_burst = sum(1 for t in times if 50 <= t < 100)
    assert in_burst == pytest.approx(1000, rel=0.1) and len(times) - in_burst == pytest.approx(100, rel=0.3)
    assert len(arrival_times(ConstantProfile(100.0), 100.0, random.Random(1), max_requests=17)) == 17


def test_loopback_only_unless_allowed() -> None:
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    check_loopback("http://[::1]:8000")
    with pytest.raises(ValueError, match="not a loopback address"):
        check_loopback("http://10.1.2.3:8000")
    gen = LoadGenerator(["http://10.1.2.3:8000"], ConstantProfile(1.0), duration=1.0)
    with pytest.raises(ValueError, match="allow_remote"):
        asyncio.run(gen.run())
    with pytest.raises(ValueError, match="duration > 0"):
        LoadGenerator(["http://127.0.0.1:1"], ConstantProfile(1.0), duration=0)


def test_slo_attainment_counts_failures_as_misses() -> None:
    r = Report([Result(0.0, "a", 200, 0.2, 0.5, 4, True), Result(1.0, "a", 200, 0.9, 1.2, 4, True),
                Result(2.0, "a", 429), Result(3.0, "a", 200, 0.1, 0.3, 4, True),
                # a stream cut after a quick first token: a failed request, not a met SLO
                Result(4.0, "a", 0, 0.1, tokens=2)])
    assert r.slo_attainment(0.5) == 0.4
    assert r.slo_attainment(0.5, since=2.5) == 0.5
    s = r.summary(0.5)
    assert (s["requests"], s["ok"], s["rejected"], s["truncated"]) == (5, 3, 1, 1)


def test_a_stream_cut_short_is_a_failed_request_not_a_success(replicas) -> None:
    # 40 tokens at 10 tokens/s: the replica is stopped (1 s grace) long before the stream ends
    r = replicas.start(max_running=4, max_waiting=16, tokens_per_second=10.0)
    gen = LoadGenerator([r.url], ConstantProfile(50.0), duration=0.05, max_requests=1, max_tokens=40, seed=1)
    threading.Timer(0.5, r.stop).start()
    report = asyncio.run(gen.run())
    assert len(report.results) == 1
    res = report.results[0]
    assert res.ttft is not None and 0 < res.tokens < 40
    assert res.truncated and not res.complete
    assert report.ok == [] and report.slo_attainment(1.0) == 0.0
    assert report.summary(1.0)["truncated"] == 1


def test_loadgen_against_a_replica_records_ttft_and_e2e(replicas) -> None:
    r = replicas.start(max_running=4, max_waiting=16, tokens_per_second=40.0)
    gen = LoadGenerator([r.url], ConstantProfile(10.0), duration=1.5, max_requests=12, max_tokens=4, seed=2)
    report = asyncio.run(gen.run())
    assert 5 <= len(report.results) <= 12
    assert all(x.status == 200 and x.tokens == 4 and x.complete for x in report.results)
    assert all(0 < x.ttft <= x.e2e for x in report.results)
