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


def _check_members(layout: Layout, members: list[str]) -> None:
    if len(members) != layout.world_size:
        raise SpecError(f"layout {layout} needs {layout.world_size} workers (tp*pp*dp = {layout.tp}*{layout.pp}*"
                        f"{layout.dp}), got {len(members)}: {members}")
    dup = sorted({m for m in members if members.count(m) > 1})
    if dup:
        raise SpecError(f"workers listed twice: {dup}; every worker holds one rank")
    if any(not m for m in members):
        raise SpecError("worker ids must be non-empty strings")
