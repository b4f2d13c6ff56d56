"""A seeded family of DeepSeek-shaped days, and a sweep of every policy over it.

One day is one draw; a policy tuned on it can lose SLO on the next. ``family(seed, n)`` draws
``n`` scenarios around the published DeepSeek day: peak share of the pool, trough depth, ramp
speed, phase and noise per service; replica start-ups of 60-600 s; replica sizes of 1-8 GPUs and
whole multiples of a node; one to three services; one to three training jobs with different
minimums (8, 16, 64 GPUs); and a day that differs from the service's history (a morning ramp up
to half an hour early or late, the whole day a few percent up or down). ``unseen_day()`` is the
single day of the issue that motivated the family (whole-node replicas of 100 requests/s,
4-minute start-ups, 30 s ticks). ``sweep`` runs the four policies on each and ``summary`` gives
the distribution. Pure: draws from ``random.Random(seed)``, builds validated ``Scenario``
values, never reads a file or a clock. The same seed gives the same family and the same table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from elastic.sim.engine import POLICIES, simulate
from elastic.sim.scenario import Scenario

BEHAVIOR = {"scaleUp": {"stabilizationWindowSeconds": 0, "tolerance": 0.0},
            "scaleDown": {"stabilizationWindowSeconds": 300, "tolerance": 0.01}}
JOBS = (("pretrain-70b", "llama3-70b", 64, 1024), ("sft-13b", "llama2-13b", 16, 1024),
        ("ablation-8b", "llama3-8b", 8, 512))
HISTORY_DAYS = 2
# A grow must repay its pauses before the services' outlook takes the GPUs back (the payback rule,
# ``elastic.scheduler.targets``): that replaces a long rescale interval and a gain threshold, which
# held GPUs idle after every shrink. The interval stays as a guard against flapping.
SCHEDULER = {"rescale_interval_seconds": 60.0, "gain_threshold": 0.0}


def unseen_day(seed: int = 11, *, morning_shift_seconds: float = 0.0) -> Scenario:
    """The issue's unseen day: 278 nodes, one chat service of whole-node replicas (100 requests/s
    each), 4-minute start-ups, 30 s ticks, ``min_replicas`` 40, a 70B job (64-2,224 GPUs) and an
    8B job (8-512), peak demand 97% of the pool."""
    return Scenario.model_validate({
        "pool": {"nodes": 278, "gpus_per_node": 8, "hardware": "h800-80g"},
        "services": [{
            "name": "chat", "gpus_per_replica": 8, "capacity_rps_per_replica": 100.0,
            "generator": {"name": "deepseek-day", "params": {
                "share": 1.0, "rps_per_node": 100.0, "level": 0.97, "noise": 0.01,
                "today_morning_shift_seconds": morning_shift_seconds}},
            "ttft_slo_seconds": 2.0, "startup_seconds": 240.0, "drain_seconds": 60.0, "min_replicas": 40,
            "max_replicas": 278, "behavior": BEHAVIOR, "forecast": "holt-winters", "history_days": HISTORY_DAYS}],
        "jobs": [{"name": "pretrain-70b", "model": "llama3-70b", "min_gpus": 64, "max_gpus": 2224, "priority": 10,
                  "global_batch": 1024},
                 {"name": "ablation-8b", "model": "llama3-8b", "min_gpus": 8, "max_gpus": 512, "priority": 0,
                  "global_batch": 512}],
        "duration_seconds": 86400.0, "tick_seconds": 30.0, "seed": seed,
        "scheduler": SCHEDULER,
    })


def family(seed: int = 0, n: int = 24, *, nodes: tuple[int, ...] = (32, 48, 64),
           duration_seconds: float = 86400.0) -> list[tuple[str, Scenario]]:
    """``n`` named scenarios drawn from ``seed`` (the same seed gives the same list)."""
    rng = random.Random(seed)
    return [(f"f{seed}-{i:02d}", _draw(rng, seed * 1000 + i, nodes, duration_seconds)) for i in range(n)]


def _draw(rng: random.Random, seed: int, nodes_choice: tuple[int, ...], duration: float) -> Scenario:
    nodes, gpn = rng.choice(nodes_choice), 8
    pool = nodes * gpn
    k = rng.randint(1, 3)
    weights = [rng.uniform(0.5, 1.5) for _ in range(k)]
    inf_peak = pool * rng.uniform(0.78, 0.92)  # GPUs the services need at their joint peak
    services, inf_min = [], 0
    for i in range(k):
        g = rng.choice((1, 2, 4, 8, 8, 16))
        cap = round(rng.uniform(8.0, 14.0) * g, 1)
        peak_gpus = inf_peak * weights[i] / sum(weights)
        peak_replicas = max(1.0, peak_gpus / g)
        mn = max(1, int(peak_replicas * rng.uniform(0.05, 0.15)))
        inf_min += mn * g
        services.append({
            "name": f"svc{i}", "gpus_per_replica": g, "capacity_rps_per_replica": cap,
            "generator": {"name": "deepseek-day", "params": {
                "share": round(peak_replicas / 278, 6), "rps_per_node": cap, "level": 1.0,
                "ramp_seconds": round(rng.uniform(600, 1800)), "depth": round(rng.uniform(0.6, 1.15), 3),
                "phase_seconds": round(rng.uniform(-3, 3) * 3600), "noise": round(rng.uniform(0.003, 0.02), 4),
                "today_morning_shift_seconds": round(rng.uniform(-1800, 1800)),
                "today_scale": round(rng.uniform(0.97, 1.03), 3)}},
            "ttft_slo_seconds": 2.0, "startup_seconds": float(round(rng.uniform(60, 600), -1)),
            "drain_seconds": 60.0, "min_replicas": mn, "max_replicas": nodes * gpn // g,
            "behavior": BEHAVIOR, "forecast": "holt-winters", "history_days": HISTORY_DAYS,
        })
    jobs = []
    room = pool - inf_min
    for name, model, mn, batch in rng.sample(JOBS, rng.randint(1, 3)):
        if mn <= room:
            jobs.append({"name": name, "model": model, "min_gpus": mn, "max_gpus": pool,
                         "priority": {"llama3-70b": 10, "llama2-13b": 5}.get(model, 0), "global_batch": batch})
            room -= mn
    return Scenario.model_validate({
        "pool": {"nodes": nodes, "gpus_per_node": gpn, "hardware": "h800-80g"},
        "services": services, "jobs": jobs, "duration_seconds": duration,
        "tick_seconds": rng.choice((30.0, 60.0)), "seed": seed,
        "scheduler": SCHEDULER,
    })


@dataclass(frozen=True)
class Row:
    """One scenario under every policy: (utilisation, SLO attainment) per policy."""

    scenario: str
    figures: dict[str, tuple[float, float]]

    @property
    def gap(self) -> float:
        """Utilisation points ``cosched`` leaves to the oracle (negative: above it)."""
        return 100.0 * (self.figures["oracle"][0] - self.figures["cosched"][0])

    def as_json(self) -> dict:
        return {"scenario": self.scenario, "gap_points": round(self.gap, 3),
                **{p: {"gpu_utilization": round(u, 6), "slo_attainment": round(s, 6)} for p, (u, s) in
                   self.figures.items()}}


def sweep(scenarios: list[tuple[str, Scenario]], policies: tuple[str, ...] = POLICIES) -> list[Row]:
    rows = []
    for name, sc in scenarios:
        figs = {}
        for p in policies:
            r = simulate(sc, Path("."), p, keep_timeline=False)  # type: ignore[arg-type]
            figs[p] = (r.gpu_utilization, r.slo_attainment)
        rows.append(Row(name, figs))
    return rows


SLO_GOAL = 0.999


def summary(rows: list[Row]) -> dict:
    """The distribution over the family: per policy, utilisation and SLO quantiles; the gap to the
    oracle's utilisation (median, 10th-percentile-worst, worst); and the scenarios where
    ``cosched`` misses the SLO goal that ``static`` reaches."""
    out: dict = {"scenarios": len(rows)}
    policies = list(rows[0].figures) if rows else []
    for p in policies:
        util = sorted(r.figures[p][0] for r in rows)
        slo = sorted(r.figures[p][1] for r in rows)
        out[p] = {"utilization": _quantiles(util), "slo": _quantiles(slo),
                  "slo_below_goal": sum(1 for s in slo if s < SLO_GOAL)}
    if "cosched" in policies and "oracle" in policies:
        gaps = sorted(r.gap for r in rows)
        out["gap_points"] = {"median": _q(gaps, 0.5), "p90": _q(gaps, 0.9), "max": gaps[-1]}
    if "cosched" in policies and "static" in policies:
        out["slo_misses"] = [r.scenario for r in rows
                             if r.figures["static"][1] >= SLO_GOAL and r.figures["cosched"][1] < SLO_GOAL]
    return out


def _q(xs: list[float], q: float) -> float:
    """Quantile by linear interpolation over sorted ``xs``."""
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _quantiles(xs: list[float]) -> dict[str, float]:
    return {"min": xs[0], "p10": _q(xs, 0.1), "median": _q(xs, 0.5), "p90": _q(xs, 0.9), "max": xs[-1]}
