"""Posting a directive: the coordinator's decision as a pure function of what it knows and ``now``.

:func:`plan_post` takes the job as the coordinator sees it (:class:`JobView`, read under its
lock), what the controller asks for (:class:`PostAsk`) and ``now``, and returns the
:class:`Posting` to apply (the directive, its record, whether the members give the step in
progress up) or raises :class:`SpecError` naming why nothing is posted. The smaller rules it is
made of (:func:`refusal`, :func:`switch_step`, :func:`gives_up`, :func:`giving_up_pays`,
:func:`recoverable`) are the same ones :meth:`Coordinator.check_directive` and the recovery use.
No lock, no clock, no I/O here (the newest checkpoint a first generation starts at is looked
up by the coordinator and passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.model import Layout, SpecError
from elastic.train.rendezvous.messages import Directive, RescaleRecord
from elastic.train.rendezvous.settings import CoordinatorSettings
from elastic.train.rendezvous.state import _Gen

if TYPE_CHECKING:  # a value only (the module that finds checkpoints on disk is not needed to decide)
    from elastic.train.checkpoint import CheckpointRef

ENDED = ("failed", "stopped", "stopping", "finished")


@dataclass(frozen=True)
class PostAsk:
    """``Coordinator.directive``'s arguments, checked (``members`` match ``layout``)."""

    generation: int
    layout: Layout
    members: tuple[str, ...]
    remap: bool = True
    join_timeout_s: float | None = None
    hold: bool = False
    give_up_step: bool | None = None  # None: the settings' rule for a shrink or a grow


@dataclass(frozen=True)
class JobView:
    """What the coordinator knows of its job when a directive is asked for."""

    job: str
    phase: str
    why: str  # the error, else the reason of the phase
    current: _Gen | None
    in_flight: int | None  # the generation of a posted rescale not abandoned (decided or not)
    # a recovery in progress: "lost" (a worker lost), "oom" (a step ran out of memory, reports
    # still coming), or None; a recovery that holds for a directive is not posted through here
    recovering: str | None
    recovery_reason: str
    max_begun: int  # the highest step any member has begun
    max_begun_at: float  # when the first member asked to begin it
    recent_step_seconds: tuple[float, ...]  # the current generation's last few timed steps
    user_job: bool  # a user's own loop (cannot hand a given-up step's work over)
    dp_replicas: bool  # its data-parallel ranks hold copies of the state (False: shards, FSDP)
    store_host: str
    store_port: int
    resume: CheckpointRef | None  # where a first generation starts (the coordinator looked it up)


@dataclass(frozen=True)
class Posting:
    directive: Directive
    record: RescaleRecord
    give_up_step: int | None  # the step in progress the members are asked to give up
    give_up_begun_at: float  # when it was begun


def refusal(view: JobView, generation: int) -> str | None:
    """Why generation ``generation`` cannot be posted now for sequencing reasons, or None."""
    if view.phase in ENDED:
        return f"job {view.job} is {view.phase} ({view.why}); cannot rescale it"
    if view.in_flight is not None:
        return (
            f"job {view.job}: generation {view.in_flight} is still in flight; wait for it (wait_generation) "
            "before posting another"
        )
    if view.recovering == "oom":
        return (
            f"job {view.job}: a step ran out of memory and not every worker has reported back yet "
            f"({view.recovery_reason}); post the directive once they have"
        )
    if view.recovering is not None:
        return (
            f"job {view.job} is recovering from a lost worker ({view.recovery_reason}); post the rescale "
            "once it runs again"
        )
    expected = (view.current.generation if view.current else 0) + 1
    if generation != expected:
        return (
            f"job {view.job}: directive generation={generation}, expected {expected} (generations count up "
            "by one from the current one)"
        )
    return None


def switch_step(settings: CoordinatorSettings, cur: _Gen, max_begun: int, *, shrink: bool = False) -> int:
    """The earliest step boundary every member of ``cur`` can still stop at.

    Training: after the highest step any member has begun, plus the lookahead (a shrink's own).
    Held: the step the keepers sit at (they begin no step)."""
    if cur.hold:
        return cur.start_step
    ahead = settings.shrink_lookahead if shrink else settings.lookahead_steps
    return max(max_begun + 1 + ahead, cur.start_step)


def max_steps_refusal(settings: CoordinatorSettings, job: str, generation: int, switch: int) -> str | None:
    """A rescale must switch before the job's last step, or the old layout finishes first and the
    joiners wait for a boundary that never comes."""
    if settings.max_steps is None or generation == 1 or switch < settings.max_steps:
        return None
    return (
        f"job {job}: generation {generation} would switch at step {switch} (after the step in progress and "
        f"the lookahead), but the job ends at max_steps={settings.max_steps} (last step {settings.max_steps - 1}); "
        "nothing changed: the job finishes on its current layout"
    )


def recoverable(settings: CoordinatorSettings, gen: _Gen, dp_replicas: bool) -> bool:
    """A loss in ``gen`` can be recovered: every box has a surviving copy (replicas, dp >= 2,
    without ZeRO sharding their optimizer state) and recovery is on. ``dp_replicas``: a user job
    says whether its data-parallel ranks hold copies (DDP) or shards (FSDP) of the state."""
    if not settings.recover or gen.hold:
        return False
    lay = gen.layout
    return lay.dp >= 2 and not lay.zero and dp_replicas


def keeps_work(old: Layout, new: Layout) -> bool:
    """Whether ``new`` can finish a step ``old`` gave up from its kept work (the agent decides for
    good with the plan's ranks): one pipeline stage on both sides and the same TP split."""
    return old.pp == new.pp == 1 and old.tp == new.tp and old.ep == new.ep == 1


def gives_up(settings: CoordinatorSettings, cur: _Gen, switch: int, max_begun: int) -> bool:
    """Whether a shrink or grow switching at ``switch`` can ask for the step in progress: no
    lookahead (the step before the switch is the one in progress), engines that check (the
    generation was posted with them), one pipeline stage (members meet at every micro-batch),
    and a step of this generation in progress."""
    return (
        min(settings.shrink_lookahead, settings.lookahead_steps) == 0
        and cur.give_up_checks
        and cur.layout.pp == 1
        and switch - 1 == max_begun >= cur.start_step
    )


def giving_up_pays(
    cur: _Gen | None,
    keeps: bool,
    *,
    user_job: bool,
    recent_step_seconds: Sequence[float],
    now: float,
    begun_at: float,
) -> bool:
    """Giving the step in progress up costs nothing when the new layout finishes it from the work
    done (the reference trainer, the same TP split and one pipeline stage on both sides:
    ``keeps``). Otherwise the new layout redoes the step whole (a user job's loop cannot hand the
    work over; a change of TP or PP splits it differently), so the step is given up only while
    that costs less than waiting for its end: every member's seconds in it so far, against the
    seconds left of a typical step of this generation, which the rescale would otherwise wait.
    Late in a step the rescale waits for the boundary; with no step timed yet, it gives the step up."""
    if cur is None or (keeps and not user_job):
        return True
    times = sorted(t for t in recent_step_seconds if t > 0)
    if not times:
        return True
    typical = times[len(times) // 2]
    elapsed = max(0.0, now - begun_at)
    return len(cur.ranks) * elapsed < typical - elapsed


def plan_post(settings: CoordinatorSettings, view: JobView, ask: PostAsk, now: float) -> Posting:
    """The directive ``ask`` posts on the job ``view`` at ``now`` (see the module doc and
    :meth:`Coordinator.directive`), or SpecError with why nothing is posted."""
    why = refusal(view, ask.generation)
    if why is not None:
        raise SpecError(why)
    cur, lay, members = view.current, ask.layout, ask.members
    if ask.hold and (cur is None or cur.hold):
        raise SpecError(
            f"job {view.job}: "
            + (
                "a job that has not started has no state to hold; start it"
                if cur is None
                else "is paused already; resume it first"
            )
        )
    resume = view.resume if cur is None else None
    shrink = cur is not None and not ask.hold and not cur.hold and set(members) < set(cur.ranks)
    switch = (
        switch_step(settings, cur, view.max_begun, shrink=shrink)
        if cur is not None
        else resume.step
        if resume
        else 0
    )
    if (why := max_steps_refusal(settings, view.job, ask.generation, switch)) is not None:
        raise SpecError(why)
    d = Directive(
        job=view.job,
        generation=ask.generation,
        layout=lay,
        workers=members,
        remap=ask.remap,
        old_layout=cur.layout if cur else None,
        old_ranks=dict(cur.ranks) if cur else {},
        switch_step=switch,
        store_host=view.store_host,
        store_port=view.store_port,
        join_timeout_s=ask.join_timeout_s if ask.join_timeout_s is not None else settings.join_timeout_s,
        hold=ask.hold,
        rollback=settings.transactional
        and cur is not None
        and not ask.hold
        and recoverable(settings, cur, view.dp_replicas),
        resume=resume.path if resume else None,
        resume_layout=resume.layout if resume else None,
        give_up_checks=settings.shrink_gives_up_step,
    )
    record = RescaleRecord(
        ask.generation,
        d.old_layout,
        d.layout,
        list(members),
        list(d.joiners),
        list(d.leavers),
        switch,
        hold=ask.hold,
    )
    give_up_step: int | None = None
    if cur is not None:
        keeps = keeps_work(cur.layout, lay)
        grow = not ask.hold and not cur.hold and set(cur.ranks) < set(members) and keeps
        rule = settings.shrink_gives_up_step if shrink else settings.grow_gives_up_step if grow else False
        asks = (
            ask.give_up_step
            if ask.give_up_step is not None
            else rule
            and giving_up_pays(
                cur,
                keeps,
                user_job=view.user_job,
                recent_step_seconds=view.recent_step_seconds,
                now=now,
                begun_at=view.max_begun_at,
            )
        )
        if (shrink or grow) and asks and gives_up(settings, cur, switch, view.max_begun):
            give_up_step = switch - 1
    return Posting(
        d,
        record,
        give_up_step,
        view.max_begun_at if give_up_step is not None else 0.0,
    )
