"""The meeting of a rescale and the coordinator's deadlines, as pure functions.

* :func:`meet`: a member arrives at the meeting point of a posted directive with its reshard
  plan's digest (or the error that kept it from planning): the rescale goes once every member
  arrived with the same plan, and is abandoned (nothing moved) on an error, a plan for other
  workers, or two different plans.
* :func:`join_overdue`: a directive whose members did not all arrive within its
  ``join_timeout_s`` is abandoned.
* :func:`first_silent` and :func:`silent_in_recovery`: which watched worker has been silent too
  long (lost), by the coordinator's clock.

No lock, no clock, no I/O here: the coordinator calls them under its lock with its own ``now``
and applies what they say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic.train.rendezvous.messages import Directive

RECOVERY_QUIET_BEATS = 2.5
"""During a recovery a member silent this many heartbeat intervals is dead (its heartbeat has a
thread of its own: a survivor stuck in a collective still beats)."""


@dataclass(frozen=True)
class Meeting:
    """What an arrival decides: ``go``, ``abandon`` (with ``reason``) or ``wait``; ``arrived`` is the
    meeting after it (worker -> plan digest), and ``counted`` whether this arrival is in it."""

    decision: str
    reason: str
    arrived: Mapping[str, str]
    counted: bool


def meet(
    d: Directive,
    arrived: Mapping[str, str],
    worker: str,
    digest: str,
    new_ranks: Mapping[str, int],
    error: str | None,
) -> Meeting:
    """``worker`` arrives at ``d``'s meeting (where ``arrived`` are already) with its plan's
    ``digest`` and the rank map it chose (``new_ranks``; empty: the directive's order), or the
    ``error`` that kept it from planning."""
    if error:
        return Meeting(
            "abandon",
            f"worker {worker} could not plan or prepare the reshard: {error}; nothing moved, "
            "the job continues on its old layout",
            arrived,
            False,
        )
    counted = worker not in arrived
    if counted:
        if new_ranks and (
            set(new_ranks) != set(d.workers) or sorted(new_ranks.values()) != list(range(len(d.workers)))
        ):
            # a plan for another directive (of the same number): never make it the job's layout
            return Meeting(
                "abandon",
                f"worker {worker} arrived with a plan for other workers ({dict(new_ranks)}) "
                f"than generation {d.generation}'s {list(d.workers)}; nothing moved, the job "
                "continues on its old layout",
                arrived,
                False,
            )
        arrived = {**arrived, worker: digest}
    digests = sorted(set(arrived.values()))
    if len(digests) > 1:
        by = {dg: sorted(x for x, y in arrived.items() if y == dg) for dg in digests}
        return Meeting(
            "abandon",
            f"members computed different reshard plans {by}; the planner must be "
            "deterministic for equal inputs",
            arrived,
            counted,
        )
    if set(d.members) <= set(arrived):
        return Meeting("go", "", arrived, counted)
    return Meeting("wait", "", arrived, counted)


def join_overdue(d: Directive, arrived: Iterable[str], issued_at: float, now: float) -> str | None:
    """Why ``d`` (posted at ``issued_at``) is abandoned at ``now``: some member did not arrive within
    its ``join_timeout_s``. None while there is time."""
    if now - issued_at <= d.join_timeout_s:
        return None
    missing = sorted(set(d.members) - set(arrived))
    joiners = [m for m in missing if m in d.joiners]
    what = "joiner(s)" if joiners and len(joiners) == len(missing) else "member(s)"
    return (
        f"{what} {', '.join(missing)} did not arrive within join_timeout_s={d.join_timeout_s:g}; nothing moved, "
        "the job continues on its old layout"
    )


def first_silent(
    watched: Iterable[str], seen: Mapping[str, float], now: float, timeout: float
) -> tuple[str, float] | None:
    """The first of ``watched`` (by name) whose last request (``seen``) is more than ``timeout``
    before ``now``, with how long it has been silent. A worker never seen is not judged here (its
    launcher reports one that never started)."""
    for w in sorted(watched):
        last = seen.get(w)
        if last is not None and now - last > timeout:
            return w, now - last
    return None


def silent_in_recovery(
    members: Iterable[str], seen: Mapping[str, float], now: float, interval: float
) -> list[tuple[str, float]]:
    """The members still to report in a recovery that have been silent more than
    :data:`RECOVERY_QUIET_BEATS` heartbeat intervals, with how long (a member never seen counts as
    seen ``now``)."""
    quiet = RECOVERY_QUIET_BEATS * interval
    return [(w, now - seen.get(w, now)) for w in members if now - seen.get(w, now) > quiet]
