"""The coordinator's answers to its workers: registration, heartbeats, steps, the meeting and results."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elastic.model import SpecError
from elastic.train.checkpoint import CheckpointRef
from elastic.train.rendezvous.meeting import meet
from elastic.train.rendezvous.messages import API, LONG_POLL_MAX_S, CheckpointFailed, JobStatus
from elastic.train.rendezvous.replies import (
    Ack,
    Answer,
    Beat,
    Decision,
    GaveUpInfo,
    GiveUpAsk,
    Registered,
    Reply,
    wire,
)
from elastic.train.rendezvous.requests import (
    REQUESTS,
    Arrive,
    Exchanged,
    Heartbeat,
    PlanInfo,
    Poll,
    Register,
    Request,
    Result,
    Step,
    parse,
)
from elastic.train.rendezvous.saves import SaveAsk, decide_save, requested
from elastic.train.rendezvous.state import _Pending

log = logging.getLogger(__name__)

class _Routes:
    """The worker-facing half of :class:`Coordinator` (its state, lock and helpers are the
    coordinator's; every method runs with ``_cv`` held)."""

    def handle(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """The answer to a request as it came off the wire: ``route`` its path (``/v1/step``; an
        unknown one raises KeyError), ``body`` its JSON object, read into its request type first
        (:class:`BadRequest` names the field when it does not read)."""
        if _ROUTES.get(route) is None:
            raise KeyError(route)
        return wire(self.receive(parse(route, body)))

    def receive(self, m: Request) -> Reply | JobStatus:
        """The answer to a typed request (:mod:`elastic.train.rendezvous.requests`), typed
        (:mod:`elastic.train.rendezvous.replies`; ``status``: the :class:`JobStatus`)."""
        name = _HANDLERS.get(type(m))
        if name is None:
            raise TypeError(f"not a coordinator request: {type(m).__name__} (one of {', '.join(REQUESTS)})")
        answer: Callable[[Request], Reply | JobStatus] = getattr(self, name)
        with self._cv:
            return answer(m)

    def _h_register(self, m: Register) -> Registered:
        w = m.worker
        self._touch(w)
        self._left.discard(w)
        self._registered.add(w)
        if self.settings.checkpoint is not None:
            seen = m.checkpoint_latest
            self._reported_checkpoints[w] = CheckpointRef(seen.path, seen.step, seen.layout) if seen else None
        return Registered(self.job, self.config, self.settings.heartbeat_interval_s, self.settings.heartbeat_timeout_s,
                          self.settings.checkpoint.to_json() if self.settings.checkpoint else None)

    def _h_heartbeat(self, m: Heartbeat) -> Beat:
        """A worker's liveness beat. With ``generation`` and ``wait_s`` it long-polls: answered at
        once with ``interrupt: <generation>`` when that generation is being recovered and this
        worker has not reported yet (it is still computing a step that cannot complete). With
        ``building`` (the generation whose groups it is building in a rescale) also with
        ``abort: <building>`` and ``abort_reason`` when those groups will never form (the job
        failed, the rescale was rolled back, or past its commit a member was lost): the worker
        gives their rendezvous up instead of waiting for a dead peer's key until its timeout.
        With ``seen`` (the last posted directive it was told of, ``pending_seq``) also with
        ``pending: <directive>`` and ``pending_seq`` when a rescale of its training generation was
        posted since, answered as soon as it is: the member plans and allocates its receive
        buffers in the background during the step in progress instead of in the pause (with no
        lookahead the switch is at the next step boundary, which the step loop reaches too late)."""
        w, gen, seen = m.worker, m.generation, m.seen
        building = m.building  # the generation whose groups it is building, if any
        wait_s = min(m.wait_s, LONG_POLL_MAX_S)
        if w not in self._left:
            self._touch(w)
            self._building[w] = building

        def unreported(g: int | None) -> bool:
            rec = self._recovery
            return (rec is not None and g is not None and g == rec.generation and not rec.posted
                    and w not in rec.reports and w not in rec.lost)

        def interrupt() -> bool:
            return unreported(gen)

        def abort() -> str | None:
            """Why the groups of ``building`` will never form: the job failed, that rescale was rolled
            back, or (past its commit) the generation is being recovered from a lost member."""
            if building is None:
                return None
            if self._phase == "failed":
                return f"the job failed: {self._error}"
            if building in self._rolled_back:
                return self._rolled_back[building]
            decided = self._decisions.get(building)
            if decided is not None and decided[0] == "abandoned":  # e.g. a joiner never came: nothing will form
                return f"the rescale to generation {building} was abandoned: {decided[1]}"
            rec = self._recovery
            return rec.reason if unreported(building) and rec is not None else None

        def give_up() -> int | None:
            return None if gen is None else self._give_up_asked_locked(w, gen)

        def pending() -> _Pending | None:
            p, cur = self._pending, self._current
            if (not self.settings.prepare_beside_step or seen is None or gen is None or p is None or p.decision is not None or p.seq == seen
                    or p.record.recovery or cur is None or cur.hold or gen != cur.generation
                    or w not in p.directive.old_ranks):  # (a recovery's survivors are broken: nothing runs)
                return None
            return p

        def answer_now() -> bool:
            return (interrupt() or abort() is not None or give_up() is not None or self._phase == "failed"
                    or self._closing.is_set() or pending() is not None)

        if wait_s > 0 and not answer_now():
            self._alarm.wait_for(answer_now, wait_s)
            if w not in self._left:
                self._touch(w)
        s, why, p = give_up(), abort(), pending()
        return Beat(self._phase, self._phase == "failed", self._error or "",
                    interrupt=gen if interrupt() else None,
                    give_up=GiveUpAsk(gen, s) if s is not None and gen is not None else None,
                    abort=building if why is not None else None, abort_reason=why,
                    pending=p.directive if p is not None else None, pending_seq=p.seq if p is not None else None)

    def _h_poll(self, m: Poll) -> Answer:
        """A worker without a generation asks whether a directive includes it (``wait_s``: long poll)."""
        w = m.worker
        self._touch(w)
        wait_s = min(m.wait_s, LONG_POLL_MAX_S)
        answer = [self._poll_answer_locked(w)]

        def decided() -> bool:
            answer[0] = self._poll_answer_locked(w)
            return answer[0].action != "wait" or self._closing.is_set()

        if not decided() and wait_s > 0:
            self._cv.wait_for(decided, wait_s)
        return answer[0]

    def _poll_answer_locked(self, w: str) -> Answer:
        if self._phase in ("failed", "stopping", "stopped", "finished"):
            return Answer("exit", self._error or self._reason or self._phase)
        p = self._pending
        if p is not None and p.decision is None and w in p.directive.workers:
            return Answer("join", directive=p.directive)
        if p is not None and p.decision == "abandoned" and w in p.directive.joiners:
            # launched for a rescale that will not happen: leave now rather than wait to be killed
            return Answer("exit", p.record.reason)
        return Answer("wait")

    def _h_step(self, m: Step) -> Answer:
        """Before step ``step``: go, switch to the pending generation, or stop. Carries the last result."""
        w, gen, step = m.worker, m.generation, m.step
        self._touch(w)
        if m.result is not None:
            self._record_report_locked(w, gen, m.result)
        self._note_resumed_locked(w, gen, step)
        if self._phase in ("failed", "stopping", "stopped"):
            # a requested stop at a step boundary: every worker of the generation is at the same step
            # with a whole state, which is worth a last checkpoint (a failed job's is not)
            return Answer("stop", self._error or self._reason or self._phase,
                          save=self._phase != "failed" and self._recovery is None)
        if self._recovery is not None and gen == self._recovery.generation:
            return self._recovery_answer_locked(w, gen, m.wait_s)
        cur = self._current
        if cur is None or gen != cur.generation:
            return Answer("stop", f"worker {w} is on generation {gen}, the job on "
                                  f"{cur.generation if cur else 'none'}; stale worker")
        if cur.hold:
            return self._hold_answer_locked(w, gen, m.wait_s)
        if self.settings.max_steps is not None and step >= self.settings.max_steps:
            self._finished.add(w)
            if set(cur.ranks) <= self._finished:
                if self._pending is not None and self._pending.decision is None:  # defensive: refused at post
                    self._abandon_locked(f"the job reached max_steps={self.settings.max_steps} before the switch step "
                                         f"{self._pending.directive.switch_step}")
                self._phase, self._reason = "finished", f"reached max_steps={self.settings.max_steps}"
                self._cv.notify_all()
            return Answer("finish", f"reached max_steps={self.settings.max_steps}", save=True)
        p = self._pending
        if p is not None and p.decision is None and w in p.directive.old_ranks:
            if m.gave_up is not None and m.gave_up.step == step:
                self._gave_up_locked(p, w, step, m.gave_up.seconds, m.gave_up.micro, m.gave_up.kept)
            if step >= p.directive.switch_step:
                self._note_boundary_locked(p, w)
                return Answer("switch", directive=p.directive)
            self._begin_step_locked(step)
            # no save while a rescale is in flight; a step its peers may be computing is given up too
            return Answer("go", pending=p.directive,
                          give_up=step if self._give_up_asked_locked(w, gen) == step else None)
        self._begin_step_locked(step)
        return Answer("go", save=True) if self._save_answer_locked(gen, step) else Answer("go")

    def _save_answer_locked(self, gen: int, step: int) -> bool:
        """Whether the state after ``step`` of generation ``gen`` is to be checkpointed: decided when
        the first member asks, the same answer for the others (section 6 of the module doc)."""
        c = self.settings.checkpoint
        if c is None:
            return False
        cur = self._current
        members = frozenset(cur.ranks) if cur is not None else frozenset()
        undecided = self._pending is not None and self._pending.decision is None
        a = decide_save(c, self._saves, SaveAsk(gen, step, self._clock(), members, self._checkpoint_step,
                                                self._written_by, undecided))
        self._saves = a.state
        if a.completed is not None:
            self._note_checkpoint_locked(a.completed)
        if a.incomplete is not None:
            at, g, gone = a.incomplete
            log.warning("job %s: the checkpoint at step %d is incomplete (%s left generation %d before reporting "
                        "its write); taking one on %s now", self.job, at, ", ".join(gone), g,
                        cur.layout if cur is not None else "the new layout")
        return a.save

    def request_checkpoint(self) -> tuple[int, int]:
        """Ask for a checkpoint at the next step that allows one. Returns a ticket for
        :meth:`wait_checkpoint`: (the newest complete checkpoint's step now, -1 for none; the
        number of failed writes so far). Raises SpecError when the job has no checkpoint
        settings or has ended (nothing asked)."""
        with self._cv:
            if self.settings.checkpoint is None:
                raise SpecError(f"job {self.job} has no checkpoint settings; give it checkpoint.dir to save one")
            if self._phase in ("failed", "stopping", "stopped", "finished"):
                raise SpecError(f"job {self.job} is {self._phase}; a checkpoint needs a running job")
            if self._current is not None and self._current.hold:
                raise SpecError(f"job {self.job} is paused: its keepers hold the state and run no step; resume it "
                                "to save a checkpoint")
            self._saves = requested(self._saves)
            return self._checkpoint_step, len(self._save_failures)

    def wait_checkpoint(self, ticket: tuple[int, int], timeout: float) -> int:
        """Wait until a checkpoint newer than the ticket's (:meth:`request_checkpoint`) is complete;
        returns its step. Raises CheckpointFailed when a rank's write failed meanwhile,
        SpecError when the job ended first, TimeoutError (saying what held it back) after
        ``timeout`` seconds."""
        after, failures = ticket
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._checkpoint_step <= after:
                if len(self._save_failures) > failures:
                    stands = f"the one at step {after} still stands" if after >= 0 else "there is no complete one"
                    raise CheckpointFailed(f"job {self.job}: the checkpoint could not be written "
                                           f"({self._save_failures[-1]}); {stands}")
                if self._phase in ("failed", "stopped", "finished"):
                    raise SpecError(f"job {self.job} is {self._phase} and saved no checkpoint after step {after}"
                                    + (f": {self._error}" if self._error else ""))
                left = deadline - time.monotonic()
                if left <= 0:
                    why = ("a rescale is in flight" if self._pending is not None and self._pending.decision is None else
                           "the previous checkpoint is still being written" if self._saves.inflight is not None else
                           "the workers have not reached a step boundary")
                    raise TimeoutError(f"job {self.job}: no checkpoint after step {after} within {timeout:g} s "
                                       f"({why})")
                self._cv.wait(min(left, 1.0))
            return self._checkpoint_step

    def _hold_answer_locked(self, w: str, gen: int, wait_s: float) -> Answer:
        """A keeper of a held generation asks before the step it sits at: switch when the next
        directive is posted, stop when the job stops, else ``hold`` (after a long poll)."""

        def over() -> bool:
            cur = self._current
            return cur is None or cur.generation != gen

        def answer() -> Answer | None:
            if over():
                cur = self._current
                return Answer("stop", f"worker {w} is on generation {gen}, the job on "
                                      f"{cur.generation if cur else 'none'}; stale worker")
            return None

        return self._wait_for_switch_locked(w, answer, over, wait_s)

    def _wait_for_switch_locked(self, w: str, answer: Callable[[], Answer | None],
                                over: Callable[[], bool], wait_s: float) -> Answer:
        """For a worker that waits between steps (a keeper, a survivor): ``stop`` when the job stops,
        ``answer()`` when it has one, ``switch`` once a directive lists it as an old member, else
        ``hold`` after a long poll of up to ``wait_s`` (``over()``: ``answer`` would now say something)."""

        def switch() -> bool:
            p = self._pending
            return p is not None and p.decision is None and w in p.directive.old_ranks

        def now() -> Answer | None:
            if self._phase in ("failed", "stopping", "stopped"):
                return Answer("stop", self._error or self._reason or self._phase)
            out = answer()
            if out is None and switch():
                p = self._pending
                assert p is not None
                self._note_boundary_locked(p, w)
                out = Answer("switch", directive=p.directive)
            return out

        out = now()
        if out is None and wait_s > 0:  # the predicate has no side effects: wait_for re-checks it
            self._cv.wait_for(lambda: (self._closing.is_set() or self._phase in ("failed", "stopping", "stopped")
                                       or over() or switch()), min(wait_s, LONG_POLL_MAX_S))
            out = now()
        return out or Answer("hold", self._reason)

    def _give_up_asked_locked(self, w: str, gen: int) -> int | None:
        """The step a pending shrink asks ``w``, a member of the current generation ``gen``, to give
        up (None: none), until a member reported it given up (heartbeat and ``go`` alike)."""
        p, cur = self._pending, self._current
        if (p is None or p.decision is not None or p.give_up_step is None or p.record.gave_up_step is not None
                or cur is None or gen != cur.generation or w not in p.directive.old_ranks):
            return None
        return p.give_up_step

    def _gave_up_locked(self, p: _Pending, w: str, step: int, seconds: float, micro: int = 0,
                        kept: bool = False) -> None:
        """Member ``w`` gave ``step`` up for the pending rescale (every rank did, at micro-batch
        ``micro``; ``kept``: with that work): it switches there. No member has been told to switch
        before it (all were computing the step), and a grow's joiners learn the amended step with
        the ``go`` (nobody hears ``go`` before every old member arrived, after giving the step up):
        amending the switch step is safe."""
        if p.give_up_step != step or p.directive.switch_step not in (step, step + 1):
            log.warning("job %s: worker %s gave up step %d, which generation %d did not ask for",
                        self.job, w, step, p.directive.generation)
            return
        if p.directive.switch_step == step + 1:
            p.directive = replace(p.directive, switch_step=step)
            p.record.switch_step, p.record.gave_up_step = step, step
            log.info("job %s: generation %d switches at step %d, which its members gave up (not waiting "
                     "for it)", self.job, p.directive.generation, step)
        p.record.gave_up_seconds = max(p.record.gave_up_seconds, seconds)
        p.gave_up_micro = micro
        if kept:
            p.kept_by.add(w)

    def _note_boundary_locked(self, p: _Pending, w: str) -> None:
        p.boundary.add(w)
        if p.stopped_at is None and set(p.directive.old_ranks) <= p.boundary:
            # a given-up step stopped training when it began: its work is lost, not paused over
            # (unless the new layout keeps it: see _note_resumed_locked)
            p.boundary_at = self._clock()
            p.stopped_at = p.give_up_begun_at if p.record.gave_up_step is not None else p.boundary_at

    def _note_resumed_locked(self, w: str, gen: int, step: int) -> None:
        """Pause ends when the last new member asks to begin the first step of the new generation."""
        p = self._pending
        if p is None or p.decision != "go" or gen != p.directive.generation or step != p.directive.switch_step:
            return
        p.resumed.add(w)
        if set(p.directive.workers) <= p.resumed and p.record.pause_seconds is None:
            if self._recovery is not None and p.record.recovery:  # from the loss to training again
                p.record.pause_seconds = self._clock() - self._recovery.started_at
            elif p.stopped_at is not None:
                kept = [int(p.results.get(m, {}).get("kept_micro_batches") or 0) for m in p.directive.workers]
                if p.record.gave_up_step is not None and p.boundary_at is not None and min(kept) > 0:
                    # the given-up step's work was kept: training stopped at the boundary, not before
                    p.record.kept_micro_batches = min(kept)
                    p.record.pause_seconds = self._clock() - p.boundary_at
                else:
                    p.record.pause_seconds = self._clock() - p.stopped_at
            self._cv.notify_all()  # wait_resumed

    def _h_arrive(self, m: Arrive) -> Decision:
        """A member is at the meeting point of ``generation`` with its plan digest; returns the decision.

        ``error`` (optional): this member could not plan or prepare the reshard; the rescale is
        abandoned for everyone before any byte moves. ``wait_s`` (optional): hold the answer up
        to that long while the decision is still open (long poll: every member hears ``go`` the
        moment the last one arrives, instead of on its next poll).
        """
        w, gen = m.worker, m.generation
        self._touch(w)
        p = self._pending
        if gen not in self._decisions and (p is None or p.directive.generation != gen
                                           or w not in p.directive.members):
            return Decision("abandoned", f"worker {w} is not a member of generation {gen}")
        if gen not in self._decisions:
            self._arrive_locked(w, m)
        wait_s = min(m.wait_s, LONG_POLL_MAX_S)
        if gen not in self._decisions and wait_s > 0:
            self._cv.wait_for(lambda: gen in self._decisions or self._closing.is_set(), wait_s)
        if gen in self._decisions:
            decision, reason = self._decisions[gen]
            p = self._pending
            if decision == "go" and p is not None and p.directive.generation == gen:
                # the switch step as it stands (a joiner's copy predates a give-up's amendment) and
                # whether every old member kept the given-up step's work (the new layout finishes it)
                gave_up = (GaveUpInfo(p.record.gave_up_step, p.gave_up_micro, set(p.directive.old_ranks) <= p.kept_by)
                           if p.record.gave_up_step is not None else None)
                return Decision(decision, reason, p.directive.switch_step, gave_up)
            return Decision(decision, reason)
        return Decision("wait")

    def _arrive_locked(self, w: str, m: Arrive) -> None:
        p = self._pending
        assert p is not None
        met = meet(p.directive, p.arrived, w, m.digest, m.plan.new_ranks, m.error)
        if met.counted:
            p.arrived = dict(met.arrived)
            if m.plan != PlanInfo():  # one that sent no plan keeps the plan another member sent
                p.plan_info = m.plan.to_wire()
        if met.decision == "abandon":
            self._abandon_locked(met.reason)
        elif met.decision == "go":
            self._go_locked()

    def _h_result(self, m: Result) -> Ack:
        """A member finished (or failed) its part of a rescale."""
        w, gen = m.worker, m.generation
        self._touch(w)
        if not m.ok:
            self._fail_locked(f"worker {w} failed during the rescale to generation {gen}: {m.error}")
            return Ack()
        p = self._pending
        self._note_written_locked(w, m.checkpoint)
        if p is not None and p.directive.generation == gen:
            p.results[w] = dict(m.stats)
            if w not in p.directive.workers:  # a leaver: it exits now, its silence is expected
                self._left.add(w)
                self._seen.pop(w, None)
                self._building.pop(w, None)
            self._maybe_complete_locked()
            self._cv.notify_all()  # wait_resumed
        return Ack()

    def _h_exchanged(self, m: Exchanged) -> Decision:
        """A member of a transactional rescale (``Directive.rollback``) moved its part of the bytes and
        still holds its old state: ``go`` once every member has (the commit: from here the old state
        may go and the new layout is built), ``rollback`` when the rescale was rolled back meanwhile,
        ``wait`` after a long poll of up to ``wait_s``."""
        w, gen = m.worker, m.generation
        self._touch(w)
        wait_s = min(m.wait_s, LONG_POLL_MAX_S)

        def answer() -> Decision | None:
            if gen in self._rolled_back:
                return Decision("rollback", self._rolled_back[gen])
            if self._phase in ("failed", "stopping", "stopped"):
                return Decision("stop", self._error or self._reason or self._phase)
            p = self._pending
            if p is None or p.directive.generation != gen:
                # committed and finished already (a late ask), or never ours
                rec = self._rescales.get(gen)
                return (Decision("go") if rec is not None and rec.ok
                        else Decision("stop", f"generation {gen} is not in flight"))
            if self._committed(p):
                return Decision("go")
            return None

        p = self._pending
        if p is not None and p.directive.generation == gen and p.decision == "go" and w in p.directive.members:
            p.exchanged.add(w)
            if self._committed(p):
                self._cv.notify_all()
        out = answer()
        if out is None and wait_s > 0:
            self._cv.wait_for(lambda: answer() is not None or self._closing.is_set(), wait_s)
            out = answer()
        return out or Decision("wait")


# path -> the method answering it (on :class:`Coordinator`, which has both halves: ``_h_fail``,
# ``_h_broken``, ``_h_exit`` and ``_h_status`` are in liveness.py), and the same by request type
_ROUTES: dict[str, str] = {f"{API}/{r}": f"_h_{r}" for r in REQUESTS}
_HANDLERS: dict[type[Request], str] = {kind: f"_h_{r}" for r, kind in REQUESTS.items()}
