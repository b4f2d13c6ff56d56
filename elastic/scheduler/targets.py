"""How many GPUs each workload should hold, before any placement.

Stages, each a small function with its own tests:

1. ``inference_targets``: inference demand first; if the pool cannot hold it all, minimums
   first, then the rest by service priority.
2. ``forced_shrinks``: when training holds more than the budget left beside inference, take
   GPUs back from the lowest-priority jobs first, cheapest tokens/s lost per GPU freed
   first; only when every job sits at its minimum, pause/preempt (lowest priority first).
3. ``water_fill``: spare GPUs go to jobs by marginal tokens/s per GPU (greedy over the
   throughput tables, higher priority first), with hysteresis: a job rescaled less than
   ``rescale_interval_seconds`` ago keeps its size, and a grow must gain more than
   ``gain_threshold`` relative tokens/s.
4. ``payback``: a grow must earn back its own pause and the pause of giving the GPUs back
   before inference needs them again (``spare_curve``: the services' outlook, ``reclaim_after``).

Counts only: which GPUs is ``core``'s business. Never reads a clock (``now`` is passed in).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from elastic.scheduler.types import JobState, Knobs, Reason, ServiceDemand, below_minimum_note


@dataclass
class JobTarget:
    gpus: int
    reason: str
    message: str
    forced: bool = False  # set by inference demand: exempt from the rescale interval
    status: str = "running"


def inference_targets(services: tuple[ServiceDemand, ...], pool_gpus: int,
                      current: dict[str, int] | None = None) -> dict[str, int]:
    """Replicas per service: everything wanted if it fits. Otherwise: minimums first; then,
    priority level by level, each service keeps the replicas it already runs (up to what it
    wants: moving a serving replica to another service of the same priority only trades one
    start-up for another), and what is left is shared in proportion to the extra each wants
    (largest remainder) — two equal services short of 4 GPUs each lose about half, not one all."""
    want = {s.name: s.wanted for s in services}
    if sum(s.wanted * s.gpus_per_replica for s in services) <= pool_gpus:
        return want
    current = current or {}
    got = {s.name: 0 for s in services}
    left = pool_gpus
    for s in sorted(services, key=lambda s: (-s.priority, s.name)):  # 1. minimums
        n = min(s.min_replicas, left // s.gpus_per_replica)
        got[s.name], left = n, left - n * s.gpus_per_replica
    for prio in sorted({s.priority for s in services}, reverse=True):  # 2. level by level
        level = [s for s in services if s.priority == prio]
        for goal in ({s.name: min(s.wanted, max(current.get(s.name, 0), got[s.name])) for s in level}, want):
            left = _share(level, goal, got, left)
    return got


def _share(level: list[ServiceDemand], goal: dict[str, int], got: dict[str, int], left: int) -> int:
    """Raise ``got`` towards ``goal`` within ``left`` GPUs, proportionally, then by largest remainder."""
    short = [s for s in level if goal[s.name] > got[s.name]]
    extra = sum((goal[s.name] - got[s.name]) * s.gpus_per_replica for s in short)
    if not short:
        return left
    share = min(1.0, left / extra)
    for s in short:
        n = int((goal[s.name] - got[s.name]) * share)
        got[s.name], left = got[s.name] + n, left - n * s.gpus_per_replica
    progress = True
    while progress:
        progress = False
        for s in sorted(short, key=lambda s: (-(goal[s.name] - got[s.name]) / goal[s.name], s.name)):
            if goal[s.name] > got[s.name] and left >= s.gpus_per_replica:
                got[s.name], left = got[s.name] + 1, left - s.gpus_per_replica
                progress = True
    return left


def _loss_per_gpu(job: JobState, have: int, to: int) -> float:
    return (job.tps(have) - job.tps(to)) / (have - to)


def forced_shrinks(jobs: list[JobState], current: dict[str, int], budget: int) -> dict[str, JobTarget]:
    """Targets after giving back ``sum(current) - budget`` GPUs (no-op when training fits)."""
    targets = {j.name: current[j.name] for j in jobs}
    out: dict[str, JobTarget] = {}
    need = sum(targets.values()) - max(budget, 0)
    if need <= 0:
        return out
    given = {j.name: 0 for j in jobs}
    # 1. shrink above minimum: lowest priority first, then cheapest tokens/s per GPU freed.
    while need > 0:
        best: tuple[tuple[int, float, str], JobState, int] | None = None
        for j in jobs:
            have = targets[j.name]
            lower = [k for k in j.feasible_counts() if k < have]
            if have == 0 or not lower:
                continue
            # smallest shrink that covers the need, else the largest available (down to min)
            covering = [k for k in lower if have - k >= need]
            to = max(covering) if covering else min(lower)
            key = (j.priority, _loss_per_gpu(j, have, to), j.name)
            if best is None or key < best[0]:
                best = (key, j, to)
        if best is None:
            break
        _, j, to = best
        need -= targets[j.name] - to
        given[j.name] += targets[j.name] - to
        targets[j.name] = to
    for j in jobs:
        if given[j.name]:
            out[j.name] = JobTarget(
                targets[j.name], Reason.INFERENCE_DEMAND,
                f"gives back {given[j.name]} GPUs to inference ({current[j.name]} -> {targets[j.name]}), "
                f"losing {j.tps(current[j.name]) - j.tps(targets[j.name]):.0f} tokens/s",
                forced=True,
            )
    # 2. every job at its minimum and inference still short: pause/preempt, lowest priority first.
    for j in sorted(jobs, key=lambda j: (j.priority, j.tps(targets[j.name]) / max(targets[j.name], 1), j.name)):
        if need <= 0:
            break
        have = targets[j.name]
        if have == 0:
            continue
        need -= have
        status = "paused" if j.on_below_minimum == "pause" else "preempted"
        out[j.name] = JobTarget(
            0, Reason.BELOW_MINIMUM,
            f"inference needs {have} more GPUs than {j.name} can spare above min_gpus={j.min_gpus}; "
            f"{status} with {current[j.name]} GPUs released"
            + below_minimum_note(status),
            forced=True, status=status,
        )
    return out


def _next_step(job: JobState, at: int, spare: int, lookahead: int = 16, cap: int | None = None,
               ) -> tuple[float, int] | None:
    """Best (marginal tokens/s per GPU, count) reachable from ``at`` with ``spare`` GPUs (at most ``cap``)."""
    best: tuple[float, int] | None = None
    seen = 0
    for k in job.feasible_counts():
        if k <= at:
            continue
        if k - at > spare or seen >= lookahead or (cap is not None and k > cap):
            break
        seen += 1
        gain = (job.tps(k) - job.tps(at)) / (k - at)
        if gain > 0 and (best is None or gain > best[0]):
            best = (gain, k)
    return best


def water_fill(jobs: list[JobState], start: dict[str, int], spare: int,
               caps: dict[str, int] | None = None) -> dict[str, int]:
    """Greedy water-filling: repeatedly give the step with the best marginal tokens/s per GPU
    (a job in ``caps`` grows to that count at most)."""
    alloc = dict(start)
    heap: list[tuple[int, float, str, int]] = []
    by_name = {j.name: j for j in jobs}
    caps = caps or {}

    def push(j: JobState) -> None:
        step = _next_step(j, alloc[j.name], spare, cap=caps.get(j.name))
        if step:
            heapq.heappush(heap, (-j.priority, -step[0], j.name, step[1]))

    for j in jobs:
        push(j)
    while heap and spare > 0:
        _, _, name, to = heapq.heappop(heap)
        j = by_name[name]
        if to - alloc[name] > spare:  # stale: spare shrank since this was pushed
            push(j)
            continue
        spare -= to - alloc[name]
        alloc[name] = to
        push(j)
    return alloc


def grow_targets(
    jobs: list[JobState], current: dict[str, int], fixed: dict[str, JobTarget], spare: int, now: float, knobs: Knobs,
    curve: tuple[tuple[float, int], ...] = (),
) -> dict[str, JobTarget]:
    """Targets for jobs not already fixed by a forced shrink: water-filling + hysteresis + payback
    (``curve``: ``spare_curve``; empty: no outlook, every grow pays)."""
    out: dict[str, JobTarget] = {}
    movable: list[JobState] = []
    for j in jobs:
        if j.name in fixed:
            continue
        if not j.feasible_counts():
            out[j.name] = JobTarget(current[j.name], Reason.NO_FEASIBLE_LAYOUT,
                                    f"no layout in the throughput table fits min_gpus={j.min_gpus}..max_gpus={j.max_gpus}",
                                    status="pending" if current[j.name] == 0 else "running")
            continue
        since = None if j.last_rescale_at is None else now - j.last_rescale_at
        if since is not None and since < knobs.rescale_interval_seconds:
            out[j.name] = JobTarget(current[j.name], Reason.HYSTERESIS,
                                    f"rescaled {since:.0f}s ago < rescale_interval {knobs.rescale_interval_seconds:.0f}s",
                                    status=_status(j, current[j.name]))
            continue
        movable.append(j)
    # Re-run the fill without jobs whose gain is below the threshold, and with the first grow that
    # does not repay its pauses made smaller (or dropped), until stable.
    caps: dict[str, int] = {}
    notes: dict[str, str] = {}
    while True:
        alloc = water_fill(movable, {j.name: current[j.name] for j in movable}, spare, caps)
        blocked = [j for j in movable if _too_small(j, current[j.name], alloc[j.name], knobs)]
        for j in blocked:
            have, to = current[j.name], alloc[j.name]
            gain = (j.tps(to) - j.tps(have)) / j.tps(have)
            out[j.name] = JobTarget(have, Reason.HYSTERESIS,
                                    f"growing {have} -> {to} GPUs gains {gain:.1%} tokens/s < gain_threshold "
                                    f"{knobs.gain_threshold:.1%}", status=_status(j, have))
        unpaid = None if blocked else _unpaid(movable, current, alloc, curve)
        if unpaid is not None:
            j, t, need, smaller = unpaid
            have, to = current[j.name], alloc[j.name]
            note = (f"growing {have} -> {to} GPUs: inference needs them back in about {t:.0f}s, before the "
                    f"grow repays its pauses ({need:.0f}s at {j.tps(to) - j.tps(have):.0f} tokens/s gained, "
                    f"{j.pause_seconds:g}s per rescale)")
            if smaller is not None:
                caps[j.name], notes[j.name] = smaller, note
                continue
            out[j.name] = JobTarget(have, Reason.HYSTERESIS, note, status=_status(j, have))
            blocked = [j]
        if not blocked:
            break
        movable = [j for j in movable if j not in blocked]
    for j in movable:
        have, to = current[j.name], alloc[j.name]
        if to > have:
            verb = "grows" if have else "resumes" if j.status in ("paused", "preempted") else "starts"
            out[j.name] = JobTarget(to, Reason.SPARE_CAPACITY,
                                    f"{verb} on spare GPUs {have} -> {to} ({j.layout_at(to)}): "
                                    f"{j.tps(have):.0f} -> {j.tps(to):.0f} tokens/s"
                                    + (f" (not further: {notes[j.name]})" if j.name in notes else ""), status="running")
        else:
            out[j.name] = JobTarget(have, Reason.STEADY, f"holds {have} GPUs", status=_status(j, have))
    return out


def spare_curve(services: tuple[ServiceDemand, ...], budget_now: int, headroom: int, pool_gpus: int,
                held: int) -> tuple[tuple[float, int], ...]:
    """GPUs training could hold beyond ``held`` at each time the services' outlook names:
    ``((0, spare now), (t, spare at t), ...)``. A service without an outlook keeps its count; one
    whose outlook ends keeps its last value. Pool 64, headroom 0, training holds 40, chat (1 GPU)
    wants 16 now and 24 in 600 s -> ((0, 8), (600, 0))."""
    times = sorted({t for s in services for t, _ in s.outlook})
    curve = [(0.0, budget_now - held)]
    for t in times:
        inf = 0
        for s in services:
            later = [n for u, n in s.outlook if u >= t]
            n = later[0] if later else (s.outlook[-1][1] if s.outlook else s.wanted)
            inf += max(n, s.min_replicas) * s.gpus_per_replica
        curve.append((t, pool_gpus - headroom - inf - held))
    return tuple(curve)


def reclaim_after(curve: tuple[tuple[float, int], ...], lent: int) -> float:
    """Seconds until inference needs back the top ``lent`` of the spare GPUs: the first time the
    curve drops below ``lent`` (inf: not within the outlook). Curve ((0, 8), (600, 0)), 8 lent ->
    600 s; 0 lent -> inf."""
    for t, spare in curve:
        if t > 0 and spare < lent:
            return t
    return math.inf


def payback_seconds(j: JobState, have: int, to: int) -> float:
    """How long GPUs lent to ``j`` (``have`` -> ``to``) must stay lent for the grow to pay: its own
    pause (the whole job stops), then the pause of the shrink when they go back, repaid by the
    marginal tokens/s. ``gain x (T - p) > tps(have) x p + tps(to) x p``. 512 -> 520 GPUs of a
    linear job, 5 s pauses -> 5 + 5 x (512 + 520) / 8 = 650 s; a start (0 -> n) -> 2 x 5 = 10 s."""
    p = j.pause_seconds
    gain = j.tps(to) - j.tps(have)
    if p <= 0:
        return 0.0
    if gain <= 0:
        return math.inf
    return p + p * (j.tps(have) + j.tps(to)) / gain


def _unpaid(jobs: list[JobState], current: dict[str, int], alloc: dict[str, int],
            curve: tuple[tuple[float, int], ...]) -> tuple[JobState, float, float, int | None] | None:
    """The first grow inference takes back before it pays: ``(job, reclaim in s, payback s, the
    largest smaller count that does pay or None)``. Training gives GPUs back lowest priority first,
    so that job's grow sits on top of the spare and goes first; the highest-priority grow sits
    lowest and stays longest. A smaller grow leaves the top of the spare alone: it may pay."""
    grows = [j for j in jobs if alloc[j.name] > current[j.name]]
    lent = sum(alloc[j.name] - current[j.name] for j in grows)
    for j in sorted(grows, key=lambda j: (j.priority, j.name)):
        have, to = current[j.name], alloc[j.name]
        t = reclaim_after(curve, lent)
        need = payback_seconds(j, have, to)
        if t < need:
            smaller = [k for k in j.feasible_counts() if have < k < to
                       and reclaim_after(curve, lent - (to - k)) >= payback_seconds(j, have, k)]
            return j, t, need, (smaller[-1] if smaller else None)
        lent -= to - have
    return None


def _status(j: JobState, gpus: int) -> str:
    if gpus > 0:
        return "running"
    return j.status if j.status in ("paused", "preempted") else "pending"


def _too_small(j: JobState, have: int, to: int, knobs: Knobs) -> bool:
    if to <= have or have == 0:
        return False  # starting or resuming a job is always worth it
    base = j.tps(have)
    return base > 0 and (j.tps(to) - base) / base <= knobs.gain_threshold
