"""The coordinator's own bookkeeping of generations, pending rescales and recoveries."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.model import Layout, SpecError
from elastic.parallel.memory_report import measured_peak  # noqa: F401 - the coordinator and tests read it here
from elastic.train.rendezvous.messages import Directive, RescaleRecord

log = logging.getLogger(__name__)

@dataclass
class _Gen:
    generation: int
    layout: Layout  # parsed once, from the directive that made it
    ranks: dict[str, int]
    start_step: int
    hold: bool = False
    give_up_checks: bool = False  # its engines check for a give-up before each micro-batch


@dataclass
class _Pending:
    directive: Directive
    record: RescaleRecord
    issued_at: float
    arrived: dict[str, str] = field(default_factory=dict)  # worker -> plan digest
    decision: str | None = None  # None | "go" | "abandoned"
    stopped_at: float | None = None  # every old member reached the boundary
    boundary_at: float | None = None  # when they had (stopped_at is earlier for a given-up step)
    boundary: set[str] = field(default_factory=set)
    resumed: set[str] = field(default_factory=set)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    plan_info: dict[str, Any] = field(default_factory=dict)
    previous: _Gen | None = None  # the generation it replaces (a rollback's way back)
    exchanged: set[str] = field(default_factory=set)  # members whose part of the exchange is done
    # shrink_gives_up_step: the step in progress the members are asked to give up (None: not asked),
    # and when it was begun (the pause of a shrink that gives it up counts from there)
    give_up_step: int | None = None
    give_up_begun_at: float = 0.0
    gave_up_micro: int = 0  # the micro-batch its members gave the step up at
    kept_by: set[str] = field(default_factory=set)  # members that kept the given-up step's work
    # which post this is (a rescale abandoned before its switch leaves its generation number to the
    # next try): a member's heartbeat says the last one it was told of, so each is told once
    seq: int = 0


@dataclass
class _Recovery:
    generation: int
    started_at: float
    reason: str
    lost: dict[str, str] = field(default_factory=dict)  # worker -> why it was given up
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # survivor -> {applied, ready, dirty, ...}
    posted: bool = False
    # after a rolled-back rescale: every old member may be alive (the lost one was a joiner), and
    # recovering onto them all is going back, not retrying what broke
    rollback: bool = False
    # a member's step ran out of memory (its report: layout, rank, step, error, memory): nobody was
    # lost, every member holds its state; the job waits for a directive onto a layout that fits
    oom: dict[str, Any] | None = None
    holding: bool = False  # every member reported: the job waits for that directive (logged once)


Validator = Callable[[Layout, Sequence[str]], None]

MEMORY_GENERATIONS_KEPT = 4
"""Generations whose worst measured memory the coordinator keeps (the status shows the current one's)."""


def _keeps_work(old: Layout, new: Layout) -> bool:
    """Whether ``new`` can finish a step ``old`` gave up from its kept work (the agent decides for
    good with the plan's ranks): one pipeline stage on both sides and the same TP split."""
    return old.pp == new.pp == 1 and old.tp == new.tp and old.ep == new.ep == 1


def recovery_candidates(old: Layout, ranks: dict[str, int]) -> tuple[dict[tuple[int, int], list[str]], list[str]]:
    """The survivors of ``old`` (worker -> old rank) by the model-parallel coordinate ``(tp rank,
    pp rank)`` whose shards they hold, each list with the workers of intact replicas first (a
    replica whose every coordinate survived), then by replica and rank; and the coordinates no
    survivor holds, as text (a recovery from these survivors is impossible while any is missing).

    Example: ``tp2.pp1.dp2`` with ranks ``{w0: 0, w1: 1, w2: 2, w3: 3}`` that lost ``w1`` and
    ``w2`` has ``(0, 0): [w0]`` and ``(1, 0): [w3]``: one complete set, from two broken replicas.
    """
    per = old.tp * old.pp
    replica_of = {w: old.coords(r)[1] for w, r in ranks.items()}
    size = {d: sum(1 for x in replica_of.values() if x == d) for d in set(replica_of.values())}
    out: dict[tuple[int, int], list[str]] = {(t, p): [] for p in range(old.pp) for t in range(old.tp)}
    for w in sorted(ranks, key=lambda w: (size[replica_of[w]] < per, replica_of[w], ranks[w])):
        t, _, p = old.coords(ranks[w])
        out[(t, p)].append(w)
    missing = [f"tp rank {t}, pp rank {p}" for (t, p), ws in out.items() if not ws]
    return out, missing


def recovery_members(old: Layout, new: Layout, candidates: dict[tuple[int, int], list[str]]) -> list[str]:
    """The workers of ``new`` (``old``'s model-parallel split, fewer replicas) in its rank order:
    the rank of ``(t, k, p)`` is the ``k``-th candidate of coordinate ``(t, p)``, so that every
    survivor keeps the shard it holds. ``new.dp`` must not exceed the shortest candidate list."""
    out = []
    for i in range(new.world_size):
        t, k, p = new.coords(i)
        out.append(candidates[(t, p)][k])
    return out


def _check_members(layout: Layout, members: list[str]) -> None:
    if len(members) != layout.world_size:
        raise SpecError(f"layout {layout} needs {layout.world_size} workers (tp*pp*dp = {layout.tp}*{layout.pp}*"
                        f"{layout.dp}), got {len(members)}: {members}")
    dup = sorted({m for m in members if members.count(m) > 1})
    if dup:
        raise SpecError(f"workers listed twice: {dup}; every worker holds one rank")
    if any(not m for m in members):
        raise SpecError("worker ids must be non-empty strings")
