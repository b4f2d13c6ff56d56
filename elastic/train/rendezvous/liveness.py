"""Lost workers, broken steps, rollback and recovery from the survivors, the deadline watch."""

from __future__ import annotations

import logging
import math
from typing import Any

from elastic.train.rendezvous.meeting import (
    RECOVERY_QUIET_BEATS,
    first_silent,
    join_overdue,
    silent_in_recovery,
)
from elastic.train.rendezvous.messages import Directive, JobStatus, RescaleRecord, StepRecord
from elastic.train.rendezvous.posting import recoverable
from elastic.train.rendezvous.recovery import Stop, consistent_step, plan_recovery, recovery_candidates
from elastic.train.rendezvous.replies import Ack, Answer
from elastic.train.rendezvous.requests import Broken, Exit, Fail, Status
from elastic.train.rendezvous.state import _Gen, _Pending, _Recovery

log = logging.getLogger(__name__)

class _Liveness:
    """The half of :class:`Coordinator` that hears of lost workers and broken steps and recovers
    the job from its survivors (the coordinator's state; every method runs with ``_cv`` held)."""

    def _h_fail(self, m: Fail) -> Ack:
        """A worker failed and exits: a lost worker (the job recovers without it if it can, else fails)."""
        w = m.worker
        self._lost_locked(w, f"worker {w}: {m.reason}")
        return Ack()

    def _h_broken(self, m: Broken) -> Answer:
        """A worker's collective broke (a peer died) or it was told to ``break``: it has shut its
        communicators down and reports what it holds: ``applied`` (last step whose update it
        applied), ``ready`` (a step whose reduced gradients it holds unapplied, or None),
        ``dirty`` (an update broke half-way), ``local_apply`` (it can apply ``ready`` alone)."""
        w, gen = m.worker, m.generation
        self._touch(w)
        error = m.error or "told to break"
        p = self._rollback_pending_locked()
        if p is not None and p.previous is not None and gen in (p.previous.generation, p.directive.generation):
            # an exchange broke (``gen``: the old generation, reported from the old state it kept; the
            # new one: a joiner, which has none): back to the old generation, recovered from there
            self._rollback_locked(f"worker {w}'s exchange broke: {error}")
        if gen in self._rolled_back and (self._current is None or gen != self._current.generation):
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
            return Answer("stop", self._rolled_back[gen])
        cur = self._current
        if self._phase in ("failed", "stopping", "stopped") or cur is None or gen != cur.generation:
            return Answer("stop", self._error or self._reason or f"generation {gen} is over")
        oom = m.out_of_memory
        if oom and self._recovery is None and self._phase in ("running", "rescaling", "starting", "recovering"):
            # the worker whose step ran out of memory reports before it breaks its peers' collectives:
            # nobody is lost, every member keeps its state, and the job waits for another layout
            self._note_memory_locked(w, gen, oom.get("memory"))
            self._start_recovery_locked(f"worker {w}'s step {m.step} ran out of memory on {cur.layout}: "
                                        f"{error}", oom=dict(oom, worker=w))
        if self._recovery is None:
            if not self._can_recover_locked():
                self._fail_locked(f"worker {w} at step {m.step}: {error}")
                return Answer("stop", self._error or "")
            self._start_recovery_locked(f"worker {w}'s collective broke at step {m.step}: {error}")
        assert self._recovery is not None
        if w not in self._recovery.lost:
            self._recovery.reports[w] = {"step": m.step, "applied": m.applied, "ready": m.ready, "dirty": m.dirty,
                                         "local_apply": m.local_apply}
        self._maybe_post_recovery_locked()
        return Answer("hold")

    # ---- recovery from surviving replicas (call with _cv held) ----------------------------
    def _can_recover_locked(self) -> bool:
        cur, p = self._current, self._pending
        if cur is None or self._phase not in ("running", "rescaling", "recovering"):
            return False
        if p is not None and p.decision == "go" and not self._committed(p):  # bytes in flight
            return False
        return recoverable(self.settings, cur, bool(self.config.get("dp_replicas", True)))

    @staticmethod
    def _committed(p: _Pending) -> bool:
        """Every member of a transactional rescale exchanged its part: the new generation's state
        is whole on its members (a loss from here on is recovered from the new generation)."""
        return p.directive.rollback and set(p.directive.members) <= p.exchanged

    def _rollback_pending_locked(self) -> _Pending | None:
        """The transactional rescale a loss now rolls back: bytes moving (``go``), not every member
        through its exchange yet, and the job was recoverable on the old generation."""
        p = self._pending
        if (p is None or p.decision != "go" or not p.directive.rollback or p.record.ok is not None
                or p.previous is None or self._committed(p)):
            return None
        return p

    def _rollback_locked(self, reason: str) -> None:
        """A member was lost (or its exchange broke) before every member exchanged its part: nobody
        has touched its old state (no recycling, nothing stepped), so the job goes back to the old
        generation and recovers from its survivors there, as from a loss during training. Members
        waiting at the exchange's end hear ``rollback``; those still exchanging break on the dead
        peer and report from their old state; joiners exit; leavers that left already are lost."""
        p = self._pending
        assert p is not None and p.previous is not None
        d, prev = p.directive, p.previous
        why = f"rolled back to generation {prev.generation} ({prev.layout}) before its first step: {reason}"
        p.record.ok, p.record.reason = False, why
        self._rolled_back[d.generation] = why
        self._gen_sizes.pop(d.generation, None)
        self.metrics.record_rescale_failure()
        log.warning("job %s: rescale to generation %d (%s) %s", self.job, d.generation, d.layout, why)
        self._current, self._pending = prev, None
        self.metrics.record_generation(prev.generation, len(prev.ranks))
        self._start_recovery_locked(f"the rescale to generation {d.generation} broke during its exchange "
                                    f"({reason})")
        rec = self._recovery
        assert rec is not None
        rec.rollback = True
        for w in d.leavers:
            if w in p.results or w in self._left:  # sent its part and left: its copy went with it
                rec.lost[w] = f"worker {w} had left after its part of the exchange"
                self.lost.add(w)
                rec.reports.pop(w, None)
        self._cv.notify_all()

    def _start_recovery_locked(self, reason: str, *, oom: dict[str, Any] | None = None) -> None:
        cur = self._current
        assert cur is not None
        p = self._pending
        if p is not None and p.decision is None:  # a rescale not yet begun: call it off first
            self._abandon_locked(f"a worker was lost before the switch ({reason})" if oom is None
                                 else f"a step ran out of memory before the switch ({reason})")
        elif p is not None and p.decision == "go" and p.record.ok is None and (self._committed(p) or oom):
            # committed (or, out of memory, every member runs the new generation: its step failed),
            # its first step not done: the rescale itself is over (the state is on the new
            # generation, from which we recover); record it as done with what is known
            rec = self._close_record_locked(p)
            if rec.pause_seconds is None and p.stopped_at is not None:
                rec.pause_seconds = self._clock() - p.stopped_at
            rec.reason = (f"done; a worker was lost before its first step finished ({reason})" if oom is None
                          else f"done; its first step ran out of memory ({reason})")
            self._pending = None
        self._phase = "recovering"
        self._recovery = _Recovery(cur.generation, self._clock(), reason, oom=oom)
        self._reason = f"recovering: {reason}"
        log.warning("job %s: %s", self.job, self._reason)
        self._cv.notify_all()
        self._alarm.notify_all()  # survivors still computing give their step up (heartbeat long polls)

    def _lost_locked(self, w: str, reason: str) -> None:
        p = self._rollback_pending_locked()
        if p is not None and w in p.directive.members:
            self._rollback_locked(reason)
            if w not in (self._current.ranks if self._current else {}):  # a joiner: nothing of it to recover
                rec = self._recovery
                assert rec is not None
                rec.lost[w] = reason
                self._left.add(w)
                self._seen.pop(w, None)
                self._building.pop(w, None)
                self._maybe_post_recovery_locked()
                return
        cur, p = self._current, self._pending
        if p is not None and p.decision == "go" and self._committed(p) and w in p.directive.leavers:
            # its part of a committed exchange had landed: the job lost nothing it needs
            log.warning("job %s: %s; a leaver whose part of generation %d had landed, the job goes on",
                        self.job, reason, p.directive.generation)
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
            p.results.setdefault(w, {})
            self._maybe_complete_locked()
            return
        if not ((cur is not None and w in cur.ranks) or (p is not None and w in p.directive.members)):
            # launched for a rescale whose directive is not posted yet: that rescale sees the exit
            # and gives up (nothing changed); the job itself lost nothing
            log.warning("job %s: %s; not in any generation yet, the job goes on", self.job, reason)
            return
        if (p is not None and p.decision is None and w in p.directive.joiners
                and not (cur is not None and w in cur.ranks)):
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
            self._abandon_locked(f"joiner lost before the rescale began ({reason}); nothing moved, the job "
                                 "continues on its old layout")
            return
        if (p is not None and p.decision == "abandoned" and w in p.directive.joiners
                and not (cur is not None and w in cur.ranks)):
            # a joiner of a rescale given up before anything moved, lost on its way out: it held nothing
            log.warning("job %s: %s; a joiner of the abandoned generation %d, the job goes on", self.job, reason,
                        p.directive.generation)
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
            return
        if self._recovery is None and (cur is None or w not in cur.ranks or not self._can_recover_locked()):
            self._fail_locked(reason)
            return
        if self._recovery is None:
            self._start_recovery_locked(reason)
        rec = self._recovery
        assert rec is not None
        if cur is None or w not in cur.ranks or rec.posted:
            if w in (self._pending.directive.members if self._pending else ()):
                self._fail_locked(f"{reason} (during the recovery itself)")
            return
        rec.lost[w] = reason
        rec.reports.pop(w, None)
        self.lost.add(w)
        self._left.add(w)
        self._seen.pop(w, None)
        self._building.pop(w, None)
        self._maybe_post_recovery_locked()

    def _recovery_answer_locked(self, w: str, gen: int, wait_s: float) -> Answer:
        """A survivor of the broken generation asks before a step: break (report first), switch to
        the recovery directive, stop (given up for lost), or hold (after a long poll)."""

        def over() -> bool:
            rec = self._recovery
            return rec is None or rec.generation != gen or w in rec.lost or w not in rec.reports

        def answer() -> Answer | None:
            rec = self._recovery
            if rec is None or rec.generation != gen:
                return Answer("stop", self._error or self._reason or "the recovery is over")
            if w in rec.lost:
                return Answer("stop", f"worker {w} was given up for lost")
            if w not in rec.reports:
                return Answer("break", rec.reason)
            return None

        return self._wait_for_switch_locked(w, answer, over, wait_s)

    def _maybe_post_recovery_locked(self, *, timed_out: bool = False) -> None:
        """Once every survivor reported (or the timeout gave the silent ones up): pick the step and the
        layout, and post the recovery directive. Fails the job when no consistent recovery exists."""
        rec, cur = self._recovery, self._current
        if rec is None or rec.posted or cur is None:
            return
        silent = [w for w in cur.ranks if w not in rec.lost and w not in rec.reports]
        if silent and not timed_out:
            return
        for w in silent:
            rec.lost[w] = (f"worker {w} did not report within recovery_timeout_s={self.settings.recovery_timeout:g}"
                           + (f" (nor within rendezvous_timeout_s={self.settings.rendezvous_timeout_s:g} while it built groups)"
                              if self._building.get(w) is not None and self.settings.rendezvous_timeout_s is not None else ""))
            self.lost.add(w)
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
        why = "lost " + ", ".join(sorted(rec.lost)) + " (" + "; ".join(rec.lost[w] for w in sorted(rec.lost)) + ")"
        if rec.rollback:
            why = f"{rec.reason}; " + (why if rec.lost else "every old member alive")
        if rec.oom is not None and not rec.lost:
            # out of memory, nobody lost: retrying the layout would fail again; every member holds its
            # state and waits for a directive onto a layout that fits (directive(), from the controller)
            # in worker order: the worker the reason names does not depend on who reported first
            _, inconsistent = consistent_step(dict(sorted(rec.reports.items())), oom=True)
            if inconsistent:
                self._fail_locked(f"{rec.reason}; {inconsistent}")
                return
            if not rec.holding:
                rec.holding = True
                self._reason = (f"out of memory: {rec.reason}; every worker holds its state, waiting for a "
                                "directive onto a layout that fits")
                log.warning("job %s: %s", self.job, self._reason)
                self._cv.notify_all()
            return
        gb = self.config.get("global_batch")
        plan = plan_recovery(cur.layout, cur.ranks, rec.reports, rec.lost, why=why, rollback=rec.rollback,
                             max_steps=self.settings.max_steps, validator=self.validator,
                             global_batch=int(gb) if gb is not None else None,
                             micro_batch=int(self.config.get("micro_batch") or 1), first_reason=rec.reason)
        if isinstance(plan, Stop):
            if not plan.finished:
                self._fail_locked(plan.reason)
                return
            self._recovery = None
            self._phase, self._reason = "finished", plan.reason
            self._cv.notify_all()
            return
        r, lay, members = plan.commit_step, plan.layout, list(plan.members)
        survivors = [w for w in cur.ranks if w not in rec.lost]
        per = cur.layout.tp * cur.layout.pp
        # 3. the step of the commit goes on record if a survivor reported it
        gen = cur.generation
        # a fresh number: a rolled-back rescale used cur + 1 already (stores and records are keyed by it)
        nxt = max([gen, *self._rescales]) + 1
        if not any(h.step == r for h in self._history[-3:]) and (parts := self._reports.pop((gen, r), None)):
            losses = [x.loss for x in parts.values() if x.loss is not None and math.isfinite(x.loss)]
            step_rec = StepRecord(r, gen, cur.layout, losses[0] if losses else None,
                                  max(x.tokens for x in parts.values()), max(x.seconds for x in parts.values()))
            self._history.append(step_rec)
            self.metrics.record_step(step_rec.step, step_rec.loss, step_rec.tokens, step_rec.seconds)
        d = Directive(
            job=self.job, generation=nxt, layout=lay, workers=tuple(members), remap=True,
            old_layout=cur.layout, old_ranks={w: cur.ranks[w] for w in survivors}, switch_step=r + 1,
            store_host=self.advertise_host, store_port=self.store_port, join_timeout_s=self.settings.join_timeout_s,
            commit_step=r, give_up_checks=self.settings.shrink_gives_up_step,
        )
        record = RescaleRecord(nxt, cur.layout, d.layout, list(members), [], list(d.leavers), r + 1,
                               recovery=why)
        self._post_seq += 1
        self._pending = _Pending(d, record, self._clock(), seq=self._post_seq)
        self._rescales[nxt] = record
        self._decisions.pop(nxt, None)
        rec.posted = True
        self._reason = (f"recovering: {why}; survivors resume at step {r + 1} on {lay} "
                        f"({len(members)} of {len(survivors)} survivors, {per} per replica)")
        log.warning("job %s: %s", self.job, self._reason)
        self._cv.notify_all()

    def _h_exit(self, m: Exit) -> Ack:
        """A worker exits on purpose (stop, finish, abandoned joiner): stop watching it."""
        w = m.worker
        self._left.add(w)
        self._seen.pop(w, None)
        self._building.pop(w, None)
        if self._phase == "stopping" and self._current and set(self._current.ranks) <= self._left:
            self._phase = "stopped"
            self._cv.notify_all()
        return Ack()

    def _h_status(self, m: Status) -> JobStatus:
        return self._status_locked()

    # ---- watcher ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing.wait(0.1):
            self.tick()

    def tick(self) -> None:
        """Check heartbeats of members and the join deadline of a pending directive (every 100 ms when started)."""
        with self._cv:
            self._check_deadline_locked()
            self._check_heartbeats_locked()
            rec, cur, now = self._recovery, self._current, self._clock()
            if rec is not None and not rec.posted and cur is not None:
                # a survivor stuck in a collective still beats (its heartbeat has its own thread): a
                # member silent for a few beats is dead, whether or not its launcher has noticed yet
                interval = self.settings.heartbeat_interval_s
                waiting = [w for w in cur.ranks if w not in rec.lost and w not in rec.reports]
                for w, silent in silent_in_recovery(waiting, self._seen, now, interval):
                    self._lost_locked(w, f"worker {w} silent for {silent:.1f} s during a recovery (> "
                                         f"{RECOVERY_QUIET_BEATS * interval:g} s: {RECOVERY_QUIET_BEATS:g} heartbeats)")
            if (rec is not None and not rec.posted and now - rec.started_at > self.settings.recovery_timeout
                    and not self._waits_for_a_blocked_survivor_locked(rec, cur, now)):
                self._maybe_post_recovery_locked(timed_out=True)

    def _waits_for_a_blocked_survivor_locked(self, rec: _Recovery, cur: _Gen | None, now: float) -> bool:
        """Whether the recovery waits past ``recovery_timeout_s`` for a silent survivor that still beats
        (its heartbeat has its own thread) and is blocked where only gloo's timeout frees it; it
        reports once that times out, within ``rendezvous_timeout_s`` (its pg_timeout_s). Waited for,
        up to that + the recovery timeout:

        * one that builds groups: blocked in gloo's rendezvous with a peer lost between the roll call
          and its own part of it;
        * one that holds shards no survivor that reported holds: its step is blocked in a collective
          that cutting its connections did not break (a send gloo had queued when its connection
          broke). Giving it up would lose the only copy of its shards and fail the job; one whose
          shards others hold is not waited for, the job recovers without it.
        """
        if self.settings.rendezvous_timeout_s is None or cur is None:
            return False
        if now - rec.started_at > self.settings.rendezvous_timeout_s + self.settings.recovery_timeout:
            return False
        quiet = RECOVERY_QUIET_BEATS * self.settings.heartbeat_interval_s
        beating = [w for w in cur.ranks if w not in rec.lost and w not in rec.reports
                   and now - self._seen.get(w, float("-inf")) <= quiet]
        if any(self._building.get(w) is not None for w in beating):
            return True
        if not beating:
            return False
        old = cur.layout
        reported = {w: cur.ranks[w] for w in rec.reports if w in cur.ranks}
        _, without = recovery_candidates(old, reported)
        _, with_them = recovery_candidates(old, {**reported, **{w: cur.ranks[w] for w in beating}})
        return len(with_them) < len(without)

    def _check_deadline_locked(self) -> None:
        p = self._pending
        if p is None or p.decision is not None:
            return
        why = join_overdue(p.directive, p.arrived, p.issued_at, self._clock())
        if why is not None:
            self._abandon_locked(why)

    def _check_heartbeats_locked(self) -> None:
        if self._phase in ("failed", "stopped", "stopping", "finished"):
            return
        now = self._clock()
        watched: set[str] = set(self._current.ranks) if self._current else set()
        if self._pending is not None and self._pending.decision == "go":
            watched |= set(self._pending.directive.members)
        lost = first_silent(watched - self._left, self._seen, now, self.settings.heartbeat_timeout_s)
        if lost is not None:
            w, silent = lost
            step = self._history[-1].step if self._history else -1
            self._lost_locked(w, f"worker {w} lost: no heartbeat for {silent:.1f} s "
                                 f"(heartbeat_timeout_s={self.settings.heartbeat_timeout_s:g}; process died or hung; "
                                 f"last completed step {step})")
