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

Counts only: which GPUs is ``core``'s business. Never reads a clock (``now`` is passed in).
"""

from __future__ import annotations

import heapq
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


def _next_step(job: JobState, at: int, spare: int, lookahead: int = 16) -> tuple[float, int] | None:
    """Best (marginal tokens/s per GPU, count) reachable from ``at`` with ``spare`` GPUs."""
    best: tuple[float, int] | None = None
    seen = 0
    for k in job.feasible_counts():
        if k <= at:
            continue
        if k - at > spare or seen >= lookahead:
            break
        seen += 1
        gain = (job.tps(k) - job.tps(at)) / (k - at)
        if gain > 0 and (best is None or gain > best[0]):
            best = (gain, k)
    return best


def water_fill(jobs: list[JobState], start: dict[str, int], spare: int) -> dict[str, int]:
    """Greedy water-filling: repeatedly give the step with the best marginal tokens/s per GPU."""
    alloc = dict(start)
    heap: list[tuple[int, float, str, int]] = []
    by_name = {j.name: j for j in jobs}

    def push(j: JobState) -> None:
        step = _next_step(j, alloc[j.name], spare)
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
) -> dict[str, JobTarget]:
    """Targets for jobs not already fixed by a forced shrink: water-filling + hysteresis."""
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
    # Re-run the fill without jobs whose gain is below the threshold, until stable.
    while True:
        alloc = water_fill(movable, {j.name: current[j.name] for j in movable}, spare)
        blocked = [j for j in movable if _too_small(j, current[j.name], alloc[j.name], knobs)]
        if not blocked:
            break
        for j in blocked:
            have, to = current[j.name], alloc[j.name]
            gain = (j.tps(to) - j.tps(have)) / j.tps(have)
            out[j.name] = JobTarget(have, Reason.HYSTERESIS,
                                    f"growing {have} -> {to} GPUs gains {gain:.1%} tokens/s < gain_threshold "
                                    f"{knobs.gain_threshold:.1%}", status=_status(j, have))
        movable = [j for j in movable if j not in blocked]
    for j in movable:
        have, to = current[j.name], alloc[j.name]
        if to > have:
            verb = "grows" if have else "resumes" if j.status in ("paused", "preempted") else "starts"
            out[j.name] = JobTarget(to, Reason.SPARE_CAPACITY,
                                    f"{verb} on spare GPUs {have} -> {to} ({j.layout_at(to)}): "
                                    f"{j.tps(have):.0f} -> {j.tps(to):.0f} tokens/s", status="running")
        else:
            out[j.name] = JobTarget(have, Reason.STEADY, f"holds {have} GPUs", status=_status(j, have))
    return out


def _status(j: JobState, gpus: int) -> str:
    if gpus > 0:
        return "running"
    return j.status if j.status in ("paused", "preempted") else "pending"


def _too_small(j: JobState, have: int, to: int, knobs: Knobs) -> bool:
    if to <= have or have == 0:
        return False  # starting or resuming a job is always worth it
    base = j.tps(have)
    return base > 0 and (j.tps(to) - base) / base <= knobs.gain_threshold
