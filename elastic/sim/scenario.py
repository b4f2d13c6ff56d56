"""Scenario files for the simulator: schema, trace loading and built-in load generators.

A scenario (YAML) has the keys of issue 10 — ``pool``, ``services``, ``jobs``,
``duration_seconds``, ``tick_seconds``, ``seed`` — plus optional, defaulted sections
``scheduler`` (co-scheduler knobs), ``reshard`` (pause model) and ``daynight`` (the clock
baseline). Unknown keys are an error. Traces are CSV ``t_seconds,requests_per_second``
(header required), path relative to the scenario file; a trace repeats after its last time.

This module reads the files a caller names and nothing else; it never reads a clock.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic.model import HARDWARE_PRESETS, Behavior, SpecError, _one_line, load_model

BUILTIN_DIR = Path(__file__).parent / "scenarios"
BUILTIN = {"deepseek-day": BUILTIN_DIR / "deepseek-day.yaml"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PoolCfg(_Strict):
    nodes: int = Field(gt=0)
    gpus_per_node: int = Field(default=8, gt=0)
    hardware: str = "h800-80g"

    @model_validator(mode="after")
    def _hw(self) -> PoolCfg:
        if self.hardware not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware '{self.hardware}'; use one of {', '.join(HARDWARE_PRESETS)}")
        return self

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class GeneratorCfg(_Strict):
    """A built-in load shape. ``deepseek-day``: the published serving day (``share``,
    ``rps_per_node``, ``level``, ``ramp_seconds``, ``depth``, ``phase_seconds``);
    ``diurnal``: a cosine between ``low_rps`` and ``peak_rps``; ``constant``: ``rps``. All take
    ``noise`` (AR(1) multiplicative sigma) and the parameters of a day that differs from the
    usual one: ``today_scale`` (whole day x this) and, for ``deepseek-day``,
    ``today_morning_shift_seconds`` (the morning ramp that many seconds later; negative: earlier)."""

    name: Literal["deepseek-day", "diurnal", "constant"]
    params: dict[str, float] = Field(default_factory=dict)


class ServiceCfg(_Strict):
    name: str = Field(min_length=1)
    trace: str | None = None
    generator: GeneratorCfg | None = None
    gpus_per_replica: int = Field(default=1, gt=0)
    capacity_rps_per_replica: float = Field(gt=0)
    ttft_slo_seconds: float = Field(default=2.0, gt=0)
    startup_seconds: float = Field(default=60.0, ge=0)
    drain_seconds: float = Field(default=30.0, ge=0)
    # the policy's drain ahead (InferenceSpec.drain_ahead_seconds): a replica a held-back scale-down
    # will remove leaves the balancer this long before the window lets it go; 0 = off
    drain_ahead_seconds: float = Field(default=0.0, ge=0)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1 << 20, gt=0)
    behavior: Behavior | None = None
    priority: int = 100
    forecast: Literal["off", "trend", "holt-winters"] = "trend"
    # days of the service's own past load the policy has seen before t=0 (its forecast's history);
    # the past follows the generator without its ``today_*`` parameters, with its own noise
    history_days: int = Field(default=0, ge=0, le=14)

    @model_validator(mode="after")
    def _check(self) -> ServiceCfg:
        if (self.trace is None) == (self.generator is None):
            raise ValueError(f"service '{self.name}': give exactly one of 'trace' (CSV path) or 'generator'")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"service '{self.name}': min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        return self


class JobCfg(_Strict):
    name: str = Field(min_length=1)
    model: str
    min_gpus: int = Field(default=1, gt=0)
    max_gpus: int = Field(default=1 << 20, gt=0)
    priority: int = 0
    global_batch: int = Field(default=1024, gt=0)

    @model_validator(mode="after")
    def _check(self) -> JobCfg:
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"job '{self.name}': min_gpus={self.min_gpus} > max_gpus={self.max_gpus}")
        return self


class SchedulerCfg(_Strict):
    rescale_interval_seconds: float = Field(default=300.0, ge=0)
    gain_threshold: float = Field(default=0.02, ge=0)
    headroom_gpus: int = Field(default=0, ge=0)


class ReshardCfg(_Strict):
    """Rescale pause = ``overhead_seconds`` + bytes moved / (``bandwidth_bytes_per_second`` x GPUs sending).

    Bytes moved ~= ``state_bytes_per_param`` x params x the share of state that changes owner
    (``1 - min(old, new) / max(old, new)``): 16 B/param is bf16 weights + grads + fp32 Adam.
    """

    bandwidth_bytes_per_second: float = Field(default=25e9, gt=0)
    overhead_seconds: float = Field(default=5.0, ge=0)
    state_bytes_per_param: float = Field(default=16.0, gt=0)


class DayNightCfg(_Strict):
    """The clock baseline: an hourly schedule sized from the trace's shape plus a margin."""

    slot_seconds: float = Field(default=3600.0, gt=0)
    margin: float = Field(default=0.03, ge=0)
    start_clock_hour: float = Field(default=12.0, ge=0, lt=24, description="clock time at t=0 (for labels)")


class Scenario(_Strict):
    pool: PoolCfg
    services: list[ServiceCfg] = Field(default_factory=list)
    jobs: list[JobCfg] = Field(default_factory=list)
    duration_seconds: float = Field(gt=0)
    tick_seconds: float = Field(default=60.0, gt=0)
    seed: int = 0
    scheduler: SchedulerCfg = Field(default_factory=SchedulerCfg)
    reshard: ReshardCfg = Field(default_factory=ReshardCfg)
    daynight: DayNightCfg = Field(default_factory=DayNightCfg)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [s.name for s in self.services] + [j.name for j in self.jobs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"names must be unique across services and jobs; repeated: {dup}")
        gpn = self.pool.gpus_per_node
        for s in self.services:
            if s.gpus_per_replica > gpn and s.gpus_per_replica % gpn:
                raise ValueError(f"service '{s.name}': gpus_per_replica={s.gpus_per_replica} must fit one node "
                                 f"(<= {gpn}) or be whole nodes (a multiple of {gpn})")
        inf_min = sum(s.min_replicas * s.gpus_per_replica for s in self.services)
        total = self.pool.total_gpus
        if inf_min > total:
            raise ValueError(f"services' min_replicas need {inf_min} GPUs but the pool has {total} "
                             f"({self.pool.nodes} nodes x {gpn}); lower min_replicas or add nodes")
        for j in self.jobs:
            if j.min_gpus > total - inf_min:
                raise ValueError(f"job '{j.name}': min_gpus={j.min_gpus} cannot fit beside the inference minimum "
                                 f"({inf_min} of {total} GPUs); lower jobs[].min_gpus")
        return self


def load_scenario(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[Scenario, Path]:
    """A built-in name (``deepseek-day``) or a YAML path. Returns the scenario and its directory."""
    import yaml

    p = BUILTIN.get(str(name_or_path), Path(name_or_path))
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        known = ", ".join(BUILTIN)
        raise SpecError(f"scenario {p}: cannot read ({e.strerror}); give a YAML file or a built-in ({known})") from None
    except yaml.YAMLError as e:
        raise SpecError(f"scenario {p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"scenario {p}: expected a mapping with pool/services/jobs, got {type(data).__name__}")
    data.update(overrides or {})
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"scenario {p}: {_one_line(e)}") from None
    for j in sc.jobs:
        load_model(j.model)  # unknown model -> SpecError naming it
    return sc, p.parent


# ---- traces and generators ---------------------------------------------------------------------


def read_trace(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``t_seconds,requests_per_second`` CSV -> (times, rates). Errors name the line."""
    try:
        f = path.open(newline="")
    except OSError as e:
        raise SpecError(f"trace {path}: cannot read ({e.strerror})") from None
    with f:
        rows = list(csv.reader(f))
    if not rows:
        raise SpecError(f"trace {path}: empty; expected a header 't_seconds,requests_per_second' and rows")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in ("t_seconds", "requests_per_second") if c not in header]
    if missing:
        raise SpecError(f"trace {path} line 1: missing column(s) {', '.join(missing)}; header must be "
                        f"'t_seconds,requests_per_second' (got {','.join(header)!r})")
    it, ir = header.index("t_seconds"), header.index("requests_per_second")
    ts: list[float] = []
    rs: list[float] = []
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        try:
            t, r = float(row[it]), float(row[ir])
        except (IndexError, ValueError):
            raise SpecError(f"trace {path} line {line}: expected two numbers t_seconds,requests_per_second, "
                            f"got {','.join(row)!r}") from None
        if not (math.isfinite(t) and math.isfinite(r)):
            raise SpecError(f"trace {path} line {line}: values must be finite, got {','.join(row)!r}")
        if r < 0:
            raise SpecError(f"trace {path} line {line}: requests_per_second={r:g} is negative")
        if ts and t <= ts[-1]:
            raise SpecError(f"trace {path} line {line}: t_seconds={t:g} is not after the previous {ts[-1]:g}; "
                            "sort the trace by time")
        ts.append(t)
        rs.append(r)
    if len(ts) < 2:
        raise SpecError(f"trace {path}: needs at least two rows (got {len(ts)})")
    return np.asarray(ts), np.asarray(rs)


# The published DeepSeek-V3/R1 day (27 Feb 12:00 -> 28 Feb 12:00, UTC+8) as nodes busy by hour:
# full pool through the afternoon/evening, ~30-node steps down after midnight, a trough near a
# quarter of the peak, a morning ramp. (clock hour, nodes) knots; between knots the level ramps
# over ``ramp`` seconds. Mean over 24 h: 226.72 nodes, published 226.75 (tests check it).
DEEPSEEK_KNOTS: tuple[tuple[float, float], ...] = (
    (12.0, 278), (0.5, 248), (1.5, 218), (2.5, 188), (3.25, 158), (4.0, 128), (4.5, 98), (5.25, 70),
    (7.375, 100), (8.0, 130), (8.5, 160), (9.0, 190), (9.5, 220), (10.0, 250), (10.5, 278),
)


MORNING = (5.25, 10.5)  # clock hours of the trough's start and the morning ramp's end


def deepseek_nodes(t: np.ndarray, ramp: float = 1800.0, start_clock_hour: float = 12.0, depth: float = 1.0,
                   morning_shift: float = 0.0) -> np.ndarray:
    """Nodes-equivalent load of the published day at scenario times ``t`` (t=0 is 12:00).

    ``depth`` scales how far each knot sits below the 278-node peak (0.5: the trough at ~174
    nodes instead of ~70); ``morning_shift`` moves the morning ramp's knots (after the trough
    begins) by that many seconds (-7200: the ramp comes two hours early)."""
    day = 86400.0
    peak = DEEPSEEK_KNOTS[0][1]

    def clock(h: float) -> float:
        moved = h + morning_shift / 3600.0 if MORNING[0] < h <= MORNING[1] else h
        return (moved - start_clock_hour) % 24 * 3600.0

    knots = sorted((clock(h), peak - (peak - n) * depth) for h, n in DEEPSEEK_KNOTS)
    tt = np.mod(t, day)
    out = np.full_like(tt, knots[-1][1], dtype=float)
    prev = knots[-1][1]
    for k_t, k_n in knots:
        frac = np.clip((tt - k_t) / ramp, 0.0, 1.0) if ramp > 0 else (tt >= k_t).astype(float)
        out = np.where(tt >= k_t, prev + (k_n - prev) * frac, out)
        prev = k_n
    return out


def _noise(seed: int, name: str, duration: float, sigma: float, corr_seconds: float = 600.0) -> Callable:
    """Smooth multiplicative noise: AR(1) on a 60 s grid, deterministic per (seed, service)."""
    n = int(duration // 60) + 3
    if sigma <= 0:
        return lambda t: np.ones_like(t, dtype=float)
    rng = np.random.default_rng([seed, *name.encode()])
    a = math.exp(-60.0 / corr_seconds)
    e = rng.normal(0.0, sigma * math.sqrt(1 - a * a), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sigma)
    for i in range(1, n):
        x[i] = a * x[i - 1] + e[i]
    grid = np.arange(n) * 60.0
    return lambda t: 1.0 + np.interp(t, grid, x)


Rate = Callable[[np.ndarray], np.ndarray]


def rate_function(svc: ServiceCfg, base_dir: Path, seed: int, duration: float,
                  start_clock_hour: float = 12.0) -> tuple[Rate, Rate]:
    """(rate(t), mean_shape(t)): the request rate, and its noise-free usual shape (for clock schedules).

    The usual shape leaves out the generator's ``today_*`` parameters: a clock schedule and the
    forecast's history know the usual day, not today's surprise."""
    rate, shape, _ = rate_and_history(svc, base_dir, seed, duration, start_clock_hour)
    return rate, shape


def rate_and_history(svc: ServiceCfg, base_dir: Path, seed: int, duration: float,
                     start_clock_hour: float = 12.0) -> tuple[Rate, Rate, Rate]:
    """(rate, usual shape, past rate): the past rate is defined for ``t < 0`` (the days before the
    scenario starts): the usual shape times noise of its own."""
    if svc.trace is not None:
        ts, rs = read_trace((base_dir / svc.trace).resolve())
        period = ts[-1]

        def trace_rate(t: np.ndarray) -> np.ndarray:
            return np.interp(np.mod(t, period) if period > 0 else t, ts, rs)

        return trace_rate, trace_rate, trace_rate
    g = svc.generator
    assert g is not None
    p = dict(g.params)
    sigma = p.pop("noise", 0.0)
    noise = _noise(seed, svc.name, duration, sigma)
    past_span = svc.history_days * 86400.0
    past_noise = _noise(seed, svc.name + "/history", past_span, sigma)
    today_scale = p.pop("today_scale", 1.0)
    if g.name == "deepseek-day":
        share, rps_per_node = p.pop("share", 1.0), p.pop("rps_per_node", 10.0)
        level, ramp = p.pop("level", 0.99), p.pop("ramp_seconds", 1800.0)
        depth, phase = p.pop("depth", 1.0), p.pop("phase_seconds", 0.0)
        shift = p.pop("today_morning_shift_seconds", 0.0)
        _no_extra(svc, p)

        def usual(t: np.ndarray, morning: float = 0.0) -> np.ndarray:
            tt = np.asarray(t, float) - phase
            return deepseek_nodes(tt, ramp, start_clock_hour, depth, morning) * share * rps_per_node * level

        def past(t: np.ndarray) -> np.ndarray:
            return usual(t) * past_noise(np.asarray(t, float) + past_span)

        return (lambda t: usual(t, shift) * today_scale * noise(np.asarray(t, float))), usual, past
    elif g.name == "diurnal":
        low, peak, period = p.pop("low_rps", 1.0), p.pop("peak_rps", 10.0), p.pop("period_seconds", 86400.0)
        _no_extra(svc, p)

        def shape(t: np.ndarray) -> np.ndarray:
            return low + (peak - low) * 0.5 * (1 - np.cos(2 * np.pi * np.asarray(t, float) / period))
    else:
        rps = p.pop("rps", 1.0)
        _no_extra(svc, p)

        def shape(t: np.ndarray) -> np.ndarray:
            return np.full_like(np.asarray(t, float), rps)

    return ((lambda t: shape(t) * today_scale * noise(np.asarray(t, float))), shape,
            (lambda t: shape(t) * past_noise(np.asarray(t, float) + past_span)))


def _no_extra(svc: ServiceCfg, p: dict[str, float]) -> None:
    if p:
        raise SpecError(f"service '{svc.name}': unknown generator parameter(s) {sorted(p)} for "
                        f"'{svc.generator.name if svc.generator else ''}'")
