"""Request-rate profiles: pure functions of time, shared by the load generator, the demo
and the simulator.

No I/O imports here (the simulator must be able to import this module): CSV *text* is
parsed, files are read by the caller.

* ``diurnal_rate(f, peak)``: a day as a fraction ``f`` in [0, 1): night trough at 25 % of
  the peak (00:00-06:00), morning ramp (06:00-10:00), plateau (10:00-18:00), evening
  descent in four steps (18:00-24:00, one every 90 min).
* Profiles (``DiurnalProfile``, ``BurstProfile``, ``TableProfile``, ``ConstantProfile``)
  and ``rate_at(profile, t)`` in requests per second at ``t`` seconds from the start.
* ``arrival_times(profile, duration, rng)``: open-loop Poisson arrivals that follow the
  profile (Lewis-Shedler thinning).
"""

from __future__ import annotations

import csv
import io
import math
import random
from dataclasses import dataclass

MORNING_START, MORNING_END = 6 / 24, 10 / 24
EVENING_START = 18 / 24
EVENING_STEPS = 4
DEFAULT_TROUGH = 0.25


def diurnal_rate(t_fraction_of_day: float, peak: float, trough: float = DEFAULT_TROUGH) -> float:
    """Requests per second at a time of day (``0.5`` = noon) for a service peaking at ``peak``.

    At 08:00 (f = 1/3) the ramp is half-way: peak 100, trough 25 % -> 62.5 req/s.
    """
    if peak < 0 or not 0 <= trough <= 1:
        raise ValueError(f"diurnal profile needs peak >= 0 and 0 <= trough <= 1 (got peak={peak}, trough={trough})")
    f = t_fraction_of_day % 1.0
    low = trough * peak
    if f < MORNING_START:
        return low
    if f < MORNING_END:
        return low + (peak - low) * (f - MORNING_START) / (MORNING_END - MORNING_START)
    if f < EVENING_START:
        return peak
    step = min(EVENING_STEPS, 1 + int((f - EVENING_START) / ((1 - EVENING_START) / EVENING_STEPS)))
    return peak - (peak - low) * step / EVENING_STEPS


@dataclass(frozen=True)
class ConstantProfile:
    rate: float


@dataclass(frozen=True)
class DiurnalProfile:
    """A day compressed into ``day_seconds``; ``start_fraction`` = time of day at t = 0."""

    peak: float
    day_seconds: float = 600.0
    start_fraction: float = 0.0
    trough: float = DEFAULT_TROUGH


@dataclass(frozen=True)
class BurstProfile:
    """``base`` req/s with bursts ``(start_s, duration_s, rate)``."""

    base: float
    bursts: tuple[tuple[float, float, float], ...] = ()


@dataclass(frozen=True)
class TableProfile:
    """Step function from a table: ``rate`` holds from its ``t`` until the next row."""

    points: tuple[tuple[float, float], ...]


Profile = ConstantProfile | DiurnalProfile | BurstProfile | TableProfile


def rate_at(profile: Profile, t: float) -> float:
    """Requests per second at ``t`` seconds after the start."""
    if isinstance(profile, ConstantProfile):
        return profile.rate
    if isinstance(profile, DiurnalProfile):
        return diurnal_rate(profile.start_fraction + t / profile.day_seconds, profile.peak, profile.trough)
    if isinstance(profile, BurstProfile):
        for start, dur, rate in profile.bursts:
            if start <= t < start + dur:
                return rate
        return profile.base
    if isinstance(profile, TableProfile):
        rate = 0.0
        for pt, pr in profile.points:
            if pt > t:
                break
            rate = pr
        return rate
    raise TypeError(f"unknown profile {profile!r}")


def max_rate(profile: Profile) -> float:
    if isinstance(profile, ConstantProfile):
        return profile.rate
    if isinstance(profile, DiurnalProfile):
        return profile.peak
    if isinstance(profile, BurstProfile):
        return max([profile.base] + [r for _, _, r in profile.bursts])
    return max([r for _, r in profile.points] or [0.0])


def parse_csv_profile(text: str, source: str = "csv") -> TableProfile:
    """Rows ``t_seconds,requests_per_second`` (a header line is allowed), times increasing."""
    rows: list[tuple[float, float]] = []
    for n, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row or not "".join(row).strip() or row[0].strip().startswith("#"):
            continue
        if len(row) != 2:
            raise ValueError(f"{source} line {n}: expected 't_seconds,requests_per_second', got {row!r}")
        try:
            t, r = float(row[0]), float(row[1])
        except ValueError:
            if n == 1:  # header
                continue
            raise ValueError(f"{source} line {n}: not numbers: {row!r}") from None
        if r < 0 or t < 0 or (rows and t <= rows[-1][0]) or not (math.isfinite(t) and math.isfinite(r)):
            raise ValueError(f"{source} line {n}: times must increase and values be >= 0 (got {row!r})")
        rows.append((t, r))
    if not rows:
        raise ValueError(f"{source}: no rows; expected 't_seconds,requests_per_second'")
    return TableProfile(tuple(rows))


def arrival_times(profile: Profile, duration: float, rng: random.Random, max_requests: int | None = None) -> list[float]:
    """Poisson arrival times in [0, duration) whose rate follows ``profile`` (thinning).

    Candidates come at the peak rate; each is kept with probability rate(t) / peak, which
    yields a non-homogeneous Poisson process with intensity rate(t).
    """
    peak = max_rate(profile)
    out: list[float] = []
    if peak <= 0 or duration <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration or (max_requests is not None and len(out) >= max_requests):
            return out
        if rng.random() * peak <= rate_at(profile, t):
            out.append(t)
