"""The demo's figures: GPU utilisation as defined in the package docstring, SLO attainment, the bounds."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from elastic.demo.config import GOALS, GPUS
from elastic.demo.report import _r
from elastic.demo.samples import DemoRun, Sample, _world_size


def _summary(run: DemoRun, report: Any, slo: float, rt: Any, day: float, warmup: float,
             bound: float | None = None, on_arrivals: float | None = None) -> dict[str, Any]:
    s = [x for x in run.samples if x.t >= warmup]
    # a recovery's seconds are not a rescale's pause, and the samples already count the job idle
    # while it recovers: kept apart
    recoveries = [r for r in run.reshards if r.get("generation") in run.recovered]
    done = [r for r in run.reshards if r["status"] == "done" and r["pause_seconds"] is not None
            and r not in recoveries]
    if len(s) >= 2:
        dt = _intervals(s)
        total = GPUS * sum(dt)
        inf_s = sum(x.inference_busy * d for x, d in zip(s, dt, strict=True))
        # during a pause the samples show the old layout, then the new one: the larger one is subtracted
        paused = sum(r["pause_seconds"] * max(_world_size(r["from"]), _world_size(r["to"]))
                     for r in done if r["from"])
        trn_s = max(0.0, sum(x.training_busy * d for x, d in zip(s, dt, strict=True)) - paused)
        busy, inf, trn = inf_s + trn_s, inf_s / total, trn_s / total
        held_inf = sum((x.replicas + x.draining) * d for x, d in zip(s, dt, strict=True)) / total
        held_trn = sum(x.training_gpus * d for x, d in zip(s, dt, strict=True)) / total
    else:
        busy, total, inf, trn, held_inf, held_trn = 0.0, 1.0, 0.0, 0.0, 0.0, 0.0
    from elastic.serve.loadgen import quantile

    pauses = [r["pause_seconds"] for r in done]
    requests = sum(1 for r in report.results if r.sent_at >= warmup)
    e2e = [r.e2e for r in report.results if r.sent_at >= warmup and r.complete and r.e2e is not None]
    failed = _failed_by_status(report.results, warmup)
    out: dict[str, Any] = {
        "trainer": run.trainer,
        "job": run.job,
        "gpu_utilization": round(busy / total, 4),
        # the same measure for a clairvoyant controller on this day's expected load (whole
        # replicas only, nothing else lost): how much of the gap no controller could close
        "gpu_utilization_bound": round(bound, 4) if bound is not None else None,
        # the same clairvoyant controller on the requests this run really got: the arrivals' jitter
        # leaves its replicas below capacity (and, in a burst, would queue): what is left above it is
        # what reacting to the load, starting replicas and rescaling cost
        "gpu_utilization_clairvoyant_on_arrivals": round(on_arrivals, 4) if on_arrivals is not None else None,
        "inference_busy_fraction": round(inf, 4),
        "training_busy_fraction": round(trn, 4),
        # where the rest went: GPUs held by ready or draining replicas / running training workers, and
        # neither (starting replicas, joiners starting, idle)
        "inference_held_fraction": round(held_inf, 4),
        "training_held_fraction": round(held_trn, 4),
        "not_held_fraction": round(max(0.0, 1 - held_inf - held_trn), 4),
        "slo_attainment": round(report.slo_attainment(slo, since=warmup), 4) if requests else 0.0,
        "slo_ttft_seconds": slo,
        "ttft_p50_seconds": _r(report.ttft_quantile(0.5, since=warmup)),
        "ttft_p99_seconds": _r(report.ttft_quantile(0.99, since=warmup)),
        # not answered in full: refused, errors, no first token, and streams cut short
        "failed_requests": sum(failed.values()),
        # why: the HTTP status of each failed request ("0": no answer - a connection error, or no
        # response within the load generator's 20 s; "200": answered but cut short or tokenless)
        "failed_by_status": failed,
        "truncated_requests": sum(1 for r in report.results if r.sent_at >= warmup and r.truncated),
        # resumed on another replica by the balancer (handed off by a leaving replica, or refused by one)
        "handed_off_requests": sum(1 for r in report.results if r.sent_at >= warmup and r.handoffs),
        # a request is 6.4 s of tokens: what a hand-off (or a queue) adds shows here
        "e2e_p50_seconds": _r(quantile(e2e, 0.5)),
        "e2e_p99_seconds": _r(quantile(e2e, 0.99)),
        "requests": requests,
        "reshards": len(done),
        # every layout the job ran on, in order (a pause shows as no layout, not as one)
        "layouts": _layouts(run),
        "reshards_failed": sum(1 for r in run.reshards if r["status"] == "failed"),
        # grows called off before their directive because inference wanted the GPUs back (nothing moved)
        "grows_cancelled": sum(1 for r in run.reshards if r["status"] == "cancelled"),
        "mean_reshard_pause_seconds": round(sum(pauses) / len(pauses), 3) if pauses else 0.0,
        "max_reshard_pause_seconds": round(max(pauses), 3) if pauses else 0.0,
        "workers_killed": sum(1 for _, w in run.kills if w),
        "recoveries": len(recoveries),
        "recovery_seconds": [round(r["pause_seconds"] or 0.0, 3) for r in recoveries],
        "training_steps": rt.step if rt else (run.losses[-1][0] if run.losses else 0),
        "loss_first": run.losses[0][1] if run.losses else None,
        "loss_last": run.losses[-1][1] if run.losses else None,
        "day_seconds": day,
        "warmup_seconds": warmup,
    }
    out["goals"] = dict(GOALS)
    # each goal against the unrounded figure: a run just under a goal must not read as met because
    # its figure rounds up to it
    exact = {"gpu_utilization": busy / total,
             "slo_attainment": report.slo_attainment(slo, since=warmup) if requests else 0.0}
    out["goals_met_each"] = {k: exact[k] >= v for k, v in GOALS.items()}
    out["goals_met"] = all(out["goals_met_each"].values())
    return out


def _layouts(run: DemoRun) -> list[str]:
    out: list[str] = []
    for x in run.samples:
        if x.layout and (not out or out[-1] != str(x.layout)):
            out.append(str(x.layout))
    return out


def _goals_line(summary: Mapping[str, Any]) -> str:
    """One line: which trainer ran, and each goal with the run's figure and whether it was met."""
    met = summary["goals_met_each"]
    parts = [f"{k} {summary[k]:.4f} ({'met' if met[k] else 'MISSED'}: goal >= {v:.2f})" for k, v in GOALS.items()]
    return (f"training: {summary['trainer']}: " + ", ".join(parts)
            + f"; {summary['reshards']} reshards, {summary['training_steps']} steps")


def _layouts_line(summary: Mapping[str, Any]) -> str:
    """One line: the layouts the job ran on, in order, and how many of its moves changed TP or PP."""
    from elastic.model import Layout

    seq = [Layout.parse(x) for x in summary.get("layouts") or []]
    moves = sum((a.tp, a.pp) != (b.tp, b.pp) for a, b in zip(seq, seq[1:], strict=False))
    return (f"layouts: {' -> '.join(map(str, seq)) or 'none'}; {moves} of {max(len(seq) - 1, 0)} moves changed "
            "tensor or pipeline parallelism")


def _failed_by_status(results: list[Any], since: float) -> dict[str, int]:
    """Failed requests sent from ``since`` on (not answered in full with a first token), by HTTP status."""
    out: dict[str, int] = {}
    for r in results:
        if r.sent_at >= since and not (r.status == 200 and r.ttft is not None and r.complete):
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return dict(sorted(out.items()))


def utilization_bound(rate: Callable[[float], float], start: float, end: float, *, request_seconds: float,
                      capacity: float, min_replicas: int, max_replicas: int, gpus: int, step: float = 0.5) -> float:
    """GPU utilisation a clairvoyant controller would reach on this load (same definition).

    ``rate(t)``: the *expected* requests/s. At each instant of ``[start, end)`` the service
    holds exactly ``ceil(L / capacity)`` replicas (within its bounds), where ``L`` is the
    expected concurrency (Little's law: the mean rate over the last ``request_seconds``
    times ``request_seconds``), busy ``min(replicas, L / capacity)``; training runs on every
    other GPU without a pause; no arrival jitter, no start, drain or handoff cost. No
    controller that keeps every replica within its SLO capacity beats it with 1-GPU
    replicas: rounding up to whole replicas is all it loses.
    """
    n = max(1, int((end - start) / step))
    sizing = dict(capacity=capacity, min_replicas=min_replicas, max_replicas=max_replicas, gpus=gpus)
    loads = (_expected_load(rate, start + i * step, request_seconds, step) for i in range(n))
    return sum(_clairvoyant_busy(load, load, **sizing) for load in loads) / n


def clairvoyant_on_arrivals(samples: list[Sample], rate: Callable[[float], float], start: float, *,
                            request_seconds: float, capacity: float, min_replicas: int, max_replicas: int,
                            gpus: int) -> float | None:
    """:func:`utilization_bound`'s controller on the load a run really had: at each sample from
    ``start`` on it holds ``ceil(L / capacity)`` replicas for the expected concurrency ``L`` (it
    knows the day, not the next arrival), and they are busy with the requests the run's replicas
    were serving, ``min(replicas, running / capacity)``; training runs on every other GPU without
    a pause. Poisson arrivals scatter ``running`` by about ``sqrt(L)`` around ``L``: below it the
    replicas are under capacity, above it they are full (and would queue). None without samples."""
    s = [x for x in samples if x.t >= start]
    if len(s) < 2:
        return None
    dt = _intervals(s)
    sizing = dict(capacity=capacity, min_replicas=min_replicas, max_replicas=max_replicas, gpus=gpus)
    return sum(d * _clairvoyant_busy(_expected_load(rate, x.t, request_seconds), x.running, **sizing)
               for x, d in zip(s, dt, strict=True)) / sum(dt)


def _clairvoyant_busy(load: float, served: float, *, capacity: float, min_replicas: int, max_replicas: int,
                      gpus: int) -> float:
    """Busy share of the pool at one instant for the clairvoyant controller: ``ceil(load / capacity)``
    replicas (within the bounds) for the expected concurrency ``load``, busy with ``served``
    requests (capped at capacity each), training on every other GPU."""
    replicas = min(max_replicas, max(min_replicas, math.ceil(load / capacity - 1e-9)))
    return (min(float(replicas), served / capacity) + (gpus - replicas)) / gpus


def _intervals(s: list[Sample]) -> list[float]:
    """Seconds each sample stands for: up to the next one (the last as long as the one before)."""
    return [s[i + 1].t - s[i].t for i in range(len(s) - 1)] + [s[-1].t - s[-2].t]


def _expected_load(rate: Callable[[float], float], t: float, request_seconds: float, step: float = 0.5) -> float:
    """Expected concurrency at ``t`` (Little's law): the mean rate over the last ``request_seconds``
    times ``request_seconds``."""
    k = max(1, round(request_seconds / step))
    return sum(rate(t - j * step) for j in range(k)) / k * request_seconds
