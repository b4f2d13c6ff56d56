"""The job's coordinator: directives posted by the launcher, the rescale's go/abandon, its status."""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry

from elastic.model import Layout, SpecError
from elastic.parallel.memory_report import MeasuredMemory
from elastic.train.checkpoint import CheckpointRef
from elastic.train.checkpoint import latest as latest_checkpoint
from elastic.train.rendezvous.liveness import _Liveness
from elastic.train.rendezvous.messages import (
    Directive,
    JobFailed,
    JobStatus,
    RescaleFailed,
    RescaleRecord,
    StepRecord,
)
from elastic.train.rendezvous.posting import (
    JobView,
    PostAsk,
    max_steps_refusal,
    plan_post,
    refusal,
    switch_step,
)
from elastic.train.rendezvous.recovery import consistent_step
from elastic.train.rendezvous.requests import StepReport
from elastic.train.rendezvous.routes import _Routes
from elastic.train.rendezvous.saves import SaveState, write_failed
from elastic.train.rendezvous.settings import CoordinatorSettings
from elastic.train.rendezvous.state import (
    MEMORY_GENERATIONS_KEPT,
    Validator,
    _check_members,
    _Gen,
    _Pending,
    _Recovery,
    measured_peak,
)
from elastic.train.rendezvous.wire import _bound_store, _make_handler, _Server
from elastic.train.telemetry import TrainingMetrics
from elastic.train.userjob import is_user_config

log = logging.getLogger(__name__)

class Coordinator(_Routes, _Liveness):
    """One job's rendezvous. ``start()`` it, post ``directive()``s, read ``status()``."""

    def __init__(
        self,
        job: str,
        config: dict[str, Any] | None = None,
        settings: CoordinatorSettings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        registry: CollectorRegistry | None = None,
        validator: Validator | None = None,
        secret: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.config = dict(config or {})
        # timing and rescale rules, validated once (a test may swap it between directives: a posted
        # directive keeps what it was posted with)
        self.settings = settings if settings is not None else CoordinatorSettings()
        if secret is not None and len(secret) < 16:
            raise SpecError("secret: at least 16 characters (or None: the coordinator generates one)")
        # every request but /healthz must carry it (see the module doc); never logged
        self.secret = secret or secrets.token_urlsafe(32)
        self._auth = f"Bearer {self.secret}".encode()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.validator = validator
        self._building: dict[str, Any] = {}  # worker -> the generation its last heartbeat said it builds
        self.resumed_from: CheckpointRef | None = None
        self._checkpoint_step = -1  # every worker of a generation wrote its part (from their step reports)
        self._reported_checkpoints: dict[str, CheckpointRef | None] = {}  # worker -> what it sees, at register
        # when to save (section 6 above): the schedule's state (saves.decide_save), and each worker's
        # last complete write as it reported it (step, generation)
        self._saves = SaveState()
        self._written_by: dict[str, tuple[int, int]] = {}
        self._save_failures: list[str] = []  # why decided saves did not complete (ranks' write errors)
        self.metrics = TrainingMetrics(job, registry)
        self._clock = clock
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        # heartbeats long-poll on a condition of their own (same lock), woken only when a recovery
        # starts or the job ends: every worker holds one all the time, and waking them all on each
        # step result of each worker (``_cv``) would cost workers^2 wake-ups per step
        self._alarm = threading.Condition(lock)
        self._post_seq = 0  # directives posted so far (_Pending.seq)
        self._server: ThreadingHTTPServer | None = None
        self._store: Any = None
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        # job state (guarded by _cv)
        self._phase = "starting"
        self._error: str | None = None
        self._reason = ""
        self._current: _Gen | None = None
        self._pending: _Pending | None = None
        self._max_begun = -1
        self._max_begun_at = 0.0  # when the first member asked to begin step _max_begun
        self._seen: dict[str, float] = {}  # worker -> last request time
        self._left: set[str] = set()
        self._registered: set[str] = set()
        self._reports: dict[tuple[int, int], dict[str, StepReport]] = {}  # (generation, step) -> worker -> report
        self._gen_sizes: dict[int, tuple[Layout, int]] = {}  # generation -> (layout, world size)
        self._history: list[StepRecord] = []
        self._rescales: dict[int, RescaleRecord] = {}
        # generation -> the measured memory of its worst rank over its measured steps (the reference
        # trainer's engines send one with a step they measured): what the controller checks
        self._memory: dict[int, MeasuredMemory] = {}
        self._decisions: dict[int, tuple[str, str]] = {}
        self._finished: set[str] = set()
        self._failures: list[str] = []
        self._recovery: _Recovery | None = None
        self._rolled_back: dict[int, str] = {}  # generation -> why its exchange was rolled back
        self.lost: set[str] = set()  # workers given up for lost (a launcher makes sure they are gone)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Coordinator:
        """1. host the TCPStore master, 2. serve HTTP, 3. watch heartbeats and deadlines."""

        if self.settings.checkpoint is not None and self.settings.checkpoint.coordinator_sees:
            self.settings.checkpoint.check_writable()
        self._store = _bound_store(self.host)
        self._server = _Server((self.host, self.port), _make_handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        for target, name in ((self._server.serve_forever, "http"), (self._watch, "watch")):
            t = threading.Thread(target=target, name=f"rendezvous-{self.job}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def store_port(self) -> int:
        return int(self._store.port) if self._store is not None else 0

    def stop(self) -> None:
        """Stop serving. Workers that are still alive lose their coordinator and exit."""
        self._closing.set()
        with self._cv:
            if self._phase not in ("failed", "finished"):
                self._phase = "stopped"
            self._cv.notify_all()
            self._alarm.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._store = None

    # ---- controller API -------------------------------------------------------------------
    def directive(self, generation: int, layout: Layout | str, members: Sequence[str], *, remap: bool = True,
                  join_timeout_s: float | None = None, hold: bool = False,
                  give_up_step: bool | None = None) -> Directive:
        """Post generation ``generation``: train ``layout`` on ``members`` (new-rank order if not ``remap``).

        ``hold=True`` pauses the job instead: ``members`` (keepers, no GPU) receive the state laid
        out as ``layout`` and run no step until the next directive, which switches at the step
        the job paused at. The validator (GPU memory) does not apply to keepers.

        ``give_up_step`` (a shrink, None: ``shrink_gives_up_step``; a grow, None:
        ``grow_gives_up_step``): ask the members to give the step in progress up at their next
        micro-batch instead of finishing it, keeping its work; the rescale then switches at that
        step, which the new layout finishes. Only where the current generation's engines check
        (posted with ``shrink_gives_up_step`` on), with one pipeline stage and no lookahead, and
        for a grow (only old members and joiners) with one stage and the same TP split after it;
        elsewhere, or when the step gets past its last micro-batch first, it switches after the step.

        Refused (SpecError) before anything changes when the generation is out of sequence,
        another rescale is in flight, the member list does not match the layout, the job is
        new (a first generation cannot hold: there is nothing to keep) or already held, or the
        validator (model/planner checks) rejects it.
        """
        lay = layout if isinstance(layout, Layout) else Layout.parse(layout)
        members = [str(m) for m in members]
        _check_members(lay, members)
        if self.validator is not None and not hold:
            self.validator(lay, members)
        with self._cv:
            view = self._view_locked(members)
            if self._recovery is not None and self._recovery.holding:  # held after a step ran out of memory
                if (why := refusal(view, generation)) is not None:
                    raise SpecError(why)
                return self._oom_directive_locked(generation, lay, members, remap=remap, hold=hold,
                                                  join_timeout_s=join_timeout_s)
            ask = PostAsk(generation, lay, tuple(members), remap, join_timeout_s, hold, give_up_step)
            post = plan_post(self.settings, view, ask, self._clock())
            d = post.directive
            if d.resume is not None and view.resume is not None:
                self.resumed_from = view.resume
                self._note_checkpoint_locked(view.resume.step)
                log.info("job %s starts from checkpoint %s (step %d, saved on %s)", self.job, view.resume.path,
                         view.resume.step, view.resume.layout)
            self._post_seq += 1
            self._pending = _Pending(d, post.record, self._clock(), seq=self._post_seq,
                                     give_up_step=post.give_up_step, give_up_begun_at=post.give_up_begun_at)
            # heartbeats tell the members in the step, who prepare meanwhile (and carry the request to
            # give the step in progress up, if any: they answer once the lock is free)
            self._alarm.notify_all()
            self._rescales[generation] = post.record
            # an abandoned (or rolled back) earlier try of this number decided nothing about this one
            self._decisions.pop(generation, None)
            self._rolled_back.pop(generation, None)
            self._phase = "rescaling" if d.old_layout is not None else "starting"
            self._cv.notify_all()
            return d

    def _view_locked(self, members: Sequence[str] = ()) -> JobView:
        """The job as :mod:`~elastic.train.rendezvous.posting` decides on it (``members``: of the
        directive asked for; a first generation's checkpoint to start at is looked up for them)."""
        cur, rec, p = self._current, self._recovery, self._pending
        resume = self._resume_from_locked(members) if self.settings.checkpoint and cur is None and members else None
        recent = tuple(h.seconds for h in self._history[-5:] if cur is not None and h.generation == cur.generation)
        recovering = None if rec is None or rec.holding else "oom" if rec.oom is not None else "lost"
        return JobView(
            job=self.job, phase=self._phase, why=self._error or self._reason, current=cur,
            in_flight=p.directive.generation if p is not None and p.decision != "abandoned" else None,
            recovering=recovering, recovery_reason=rec.reason if rec is not None else "",
            max_begun=self._max_begun, max_begun_at=self._max_begun_at, recent_step_seconds=recent,
            user_job=is_user_config(self.config), dp_replicas=bool(self.config.get("dp_replicas", True)),
            store_host=self.advertise_host, store_port=self.store_port,
            resume=resume)

    def _oom_directive_locked(self, generation: int, lay: Layout, members: list[str], *, remap: bool, hold: bool,
                              join_timeout_s: float | None) -> Directive:
        """The directive that moves a job held after a step ran out of memory onto ``lay``: like a
        recovery's, from every member's kept state (each stands broken, its communicators shut), at
        the step that failed (the one after the last every member applied), which the new layout
        redoes on the same samples. Refused when the members' states are not at one step."""
        rec, cur = self._recovery, self._current
        assert rec is not None and rec.oom is not None and cur is not None
        if hold:
            raise SpecError(f"job {self.job}: a step ran out of memory; move it to a layout that fits (or stop it) "
                            "rather than pausing it")
        r, inconsistent = consistent_step(dict(sorted(rec.reports.items())), oom=True)
        if inconsistent:  # defensive: such a job has failed when the last member reported
            raise SpecError(f"job {self.job}: {inconsistent}")
        if (why := max_steps_refusal(self.settings, self.job, generation, r + 1)) is not None:
            raise SpecError(why)
        d = Directive(
            job=self.job, generation=generation, layout=lay, workers=tuple(members), remap=remap,
            old_layout=cur.layout, old_ranks=dict(cur.ranks), switch_step=r + 1,
            store_host=self.advertise_host, store_port=self.store_port,
            join_timeout_s=join_timeout_s if join_timeout_s is not None else self.settings.join_timeout_s,
            commit_step=r, give_up_checks=self.settings.shrink_gives_up_step,
        )
        record = RescaleRecord(generation, cur.layout, d.layout, list(members), list(d.joiners), list(d.leavers),
                               r + 1, reason=f"out of memory on {cur.layout}: {rec.reason}")
        self._post_seq += 1
        self._pending = _Pending(d, record, self._clock(), seq=self._post_seq)
        self._rescales[generation] = record
        self._decisions.pop(generation, None)
        self._rolled_back.pop(generation, None)
        rec.posted = True
        self._reason = f"out of memory on {cur.layout}: moving to {lay} at step {r + 1} (the step that failed)"
        log.warning("job %s: %s", self.job, self._reason)
        self._cv.notify_all()
        return d

    def _begin_step_locked(self, step: int) -> None:
        if step > self._max_begun:
            self._max_begun, self._max_begun_at = step, self._clock()

    def check_directive(self, generation: int) -> None:
        """Refuse (SpecError) now what :meth:`directive` would refuse for sequencing reasons, so a launcher
        need not start joiners for it: job not running, another rescale in flight, wrong generation, or
        the job's ``max_steps`` coming before the earliest switch step."""
        with self._cv:
            view = self._view_locked()
            if (why := refusal(view, generation)) is not None:
                raise SpecError(why)
            cur = self._current
            if self._recovery is not None:  # held after a step ran out of memory: it switches at that step
                switch: int | None = consistent_step(self._recovery.reports, oom=True)[0] + 1
            else:
                switch = switch_step(self.settings, cur, self._max_begun) if cur is not None else None
            if switch is not None and (why := max_steps_refusal(self.settings, self.job, generation, switch)):
                raise SpecError(why)

    def status(self) -> JobStatus:
        with self._cv:
            return self._status_locked()

    def _status_locked(self) -> JobStatus:
        cur, last = self._current, (self._history[-1] if self._history else None)
        workers = sorted(cur.ranks, key=cur.ranks.__getitem__) if cur else []
        rec = self._rescales[max(self._rescales)] if self._rescales else None
        rec_oom = self._oom_held_locked()
        return JobStatus(
            job=self.job, phase=self._phase, generation=cur.generation if cur else 0,
            layout=cur.layout if cur else None, workers=workers, step=last.step if last else -1,
            loss=last.loss if last else None, tokens_per_second=last.tokens_per_second if last else None,
            step_seconds=last.seconds if last else None,
            # held after a step ran out of memory: the job has not failed, and its error says why it waits
            error=self._error or (f"OutOfMemory: {rec_oom['error']}" if rec_oom else None),
            last_rescale=rec.copy() if rec else None, reason=self._reason,
            failures=list(self._failures),
            checkpoint_step=self._checkpoint_step if self.settings.checkpoint else None,
            memory=(m.as_json() if cur is not None and (m := self._memory.get(cur.generation)) is not None
                    else None),
            out_of_memory=dict(rec_oom) if rec_oom else None,
        )

    def _oom_held_locked(self) -> dict[str, Any] | None:
        """The out-of-memory report the job is held on, once every member reported back and until its
        directive is posted (a directive is accepted exactly then), or None."""
        rec = self._recovery
        return rec.oom if rec is not None and rec.oom is not None and rec.holding and not rec.posted else None

    def history(self) -> list[StepRecord]:
        with self._cv:
            return list(self._history)

    def rescale_record(self, generation: int) -> RescaleRecord | None:
        with self._cv:
            rec = self._rescales.get(generation)
            return rec.copy() if rec else None

    def wait_generation(self, generation: int, timeout: float) -> RescaleRecord:
        """Block until ``generation`` ran its first step. Raises RescaleFailed / JobFailed / TimeoutError."""

        with self._cv:
            if not self._cv.wait_for(lambda: self._generation_over_locked(generation), timeout):
                raise TimeoutError(f"job {self.job}: generation {generation} did not run a step within {timeout:.0f} s "
                                   f"(phase {self._phase}, {self._reason or 'no reason recorded'})")
            rec = self._rescales.get(generation)
            if rec is not None and rec.ok:
                return rec.copy()
            if rec is not None and rec.ok is False:
                raise RescaleFailed(rec.reason, rec.copy())
            raise JobFailed(self._error or f"job {self.job} is {self._phase}")

    def wait_resumed(self, generation: int, timeout: float) -> RescaleRecord:
        """Block until ``generation`` trains again: every new member has begun its first step (the
        pause is over) and every member has reported its part of the reshard, so its leavers are
        leaving. The record is returned as known then (``ok`` stays None until the first step has
        finished: see :meth:`wait_generation`). For a caller that waits for the GPUs a shrink frees:
        the new layout's first step adds nothing to them and takes a whole step. A generation that
        completed, failed or was abandoned meanwhile answers as :meth:`wait_generation` does.
        Raises RescaleFailed / JobFailed / TimeoutError."""

        def resumed() -> bool:
            p = self._pending
            return (p is not None and p.directive.generation == generation and p.decision == "go"
                    and p.record.pause_seconds is not None and set(p.directive.members) <= set(p.results))

        with self._cv:
            if not self._cv.wait_for(lambda: resumed() or self._generation_over_locked(generation), timeout):
                raise TimeoutError(f"job {self.job}: generation {generation} did not begin a step within "
                                   f"{timeout:.0f} s (phase {self._phase}, {self._reason or 'no reason recorded'})")
            if resumed():
                p = self._pending
                assert p is not None
                return self._fill_record(p.record.copy(), p.results)
        return self.wait_generation(generation, 0.0)

    def _generation_over_locked(self, generation: int) -> bool:
        rec = self._rescales.get(generation)
        return self._phase in ("failed", "stopped", "finished") or (rec is not None and rec.ok is not None)

    def wait_step(self, step: int, timeout: float) -> StepRecord:
        """Block until step ``step`` has finished on every worker. Raises JobFailed / TimeoutError."""
        with self._cv:
            ok = self._cv.wait_for(
                lambda: (self._history and self._history[-1].step >= step) or self._phase in ("failed", "stopped"),
                timeout)
            if self._history and self._history[-1].step >= step:
                return next(r for r in self._history if r.step >= step)
            if not ok:
                raise TimeoutError(f"job {self.job}: step {step} not reached within {timeout:.0f} s "
                                   f"(at step {self._history[-1].step if self._history else -1}, phase {self._phase})")
            raise JobFailed(self._error or f"job {self.job} is {self._phase}")

    def wait_phase(self, phases: Sequence[str], timeout: float) -> str:
        with self._cv:
            self._cv.wait_for(lambda: self._phase in phases, timeout)
            return self._phase

    def request_stop(self, reason: str = "stopped by the controller") -> None:
        """Workers stop at their next step boundary (or now, if waiting) and exit."""
        with self._cv:
            if self._phase not in ("failed", "finished", "stopped"):
                self._phase, self._reason = "stopping", reason
                if self._pending is not None and self._pending.decision is None:
                    self._abandon_locked(f"job stopping: {reason}")
            self._cv.notify_all()

    def fail(self, reason: str) -> None:
        """Mark the job failed (a launcher saw a process die, ...). Idempotent: the first reason wins."""
        with self._cv:
            self._fail_locked(reason)

    def worker_lost(self, worker: str, reason: str) -> None:
        """A launcher saw ``worker`` die (or a check gave it up): recover without it if the job can,
        else fail the job with ``reason``. Idempotent."""
        with self._cv:
            self._lost_locked(worker, reason)

    def lost_workers(self) -> list[str]:
        """Workers given up for lost; a launcher makes sure each is gone (a frozen process still
        holds its sockets, and its peers would wait for it)."""
        with self._cv:
            return sorted(self.lost)

    def worker_left(self, worker: str) -> None:
        """A launcher confirms ``worker`` is gone on purpose; its silence is not a failure."""
        with self._cv:
            self._left.add(worker)
            self._seen.pop(worker, None)
            self._building.pop(worker, None)

    def registered(self, worker: str) -> bool:
        """``worker``'s process has registered and has not left since. A name given again to a
        new process (a worker that left and is launched anew) counts only once that process has
        registered: the launcher must not post a directive that would wait, inside the pause, for
        a process still starting."""
        with self._cv:
            return worker in self._registered and worker not in self._left

    def has_left(self, worker: str) -> bool:
        """``worker`` exited on purpose (leaver, stopped, abandoned joiner): its exit is no failure."""
        with self._cv:
            return worker in self._left

    # ---- state transitions (call with _cv held) ------------------------------------------
    def _fail_locked(self, reason: str) -> None:
        if self._phase in ("stopping", "stopped", "finished"):
            return  # workers exiting on a stop request are not failures
        if len(self._failures) < 20:
            self._failures.append(reason)
        if self._phase == "failed":
            return
        log.error("training job %s failed: %s", self.job, reason)
        self._phase, self._error, self._reason = "failed", reason, reason
        p = self._pending
        if p is not None and p.record.ok is None:
            p.record.ok, p.record.reason = False, f"job failed during the rescale: {reason}"
            if p.decision is None:
                p.decision = "abandoned"
                self._decisions[p.directive.generation] = ("abandoned", p.record.reason)
        self.metrics.record_failed(True)
        self._cv.notify_all()
        self._alarm.notify_all()

    def _abandon_locked(self, reason: str) -> None:
        p = self._pending
        assert p is not None and p.decision is None
        gen = p.directive.generation
        p.decision, p.record.ok, p.record.reason = "abandoned", False, reason
        self._decisions[gen] = ("abandoned", reason)
        self._reason = f"rescale to generation {gen} ({p.directive.layout}) abandoned: {reason}"
        log.warning("job %s: %s", self.job, self._reason)
        self.metrics.record_rescale_failure()
        if self._recovery is not None:
            self._recovery = None
            self._fail_locked(f"recovery failed: {reason}")
        elif self._current is None:
            self._fail_locked(f"job could not start: {reason}")
        elif self._phase == "rescaling":
            self._phase = "paused" if self._current.hold else "running"
        self._cv.notify_all()

    def _go_locked(self) -> None:
        """Every member arrived with the same plan: the new generation becomes current."""
        p = self._pending
        assert p is not None
        d = p.directive
        info = p.plan_info
        new_ranks = {str(k): int(v) for k, v in info.get("new_ranks", {}).items()} or {
            w: i for i, w in enumerate(d.workers)}
        p.decision = "go"
        p.record.new_ranks = new_ranks
        p.record.planned_bytes = int(info.get("planned_bytes", 0))
        p.record.lower_bound_bytes = int(info.get("lower_bound_bytes", 0))
        p.record.plan_seconds = float(info.get("plan_seconds", 0.0))
        self._decisions[d.generation] = ("go", "")
        p.previous = self._current
        self._current = _Gen(d.generation, d.layout, new_ranks, d.switch_step, hold=d.hold,
                             give_up_checks=d.give_up_checks)
        self._gen_sizes[d.generation] = (d.layout, len(d.workers))
        self._max_begun = d.switch_step - 1
        self.metrics.record_generation(d.generation, len(d.workers))
        if not d.hold:
            self.metrics.record_paused(False)
        self._cv.notify_all()

    def _maybe_complete_locked(self) -> None:
        """The rescale is done once every new member reported and the first new step finished."""
        p = self._pending
        if p is None or p.decision != "go" or p.record.ok is not None:
            return
        d = p.directive
        if not set(d.members) <= set(p.results):
            return
        if not d.hold and not any(r.generation == d.generation for r in self._history[-3:]):
            return
        rec = p.record
        if self._recovery is not None:
            if rec.pause_seconds is None:
                rec.pause_seconds = self._clock() - self._recovery.started_at
            if self._recovery.oom is None:  # out of memory: no worker was lost, nothing recovered
                self.metrics.record_recovery()
            self._recovery = None
        if d.hold and p.stopped_at is not None and rec.pause_seconds is None:  # held: nothing will step
            rec.pause_seconds = self._clock() - p.stopped_at
        self._close_record_locked(p)
        if d.hold:
            self.metrics.record_paused(True, rec.bytes_moved)
        elif self._history and d.old_ranks:
            self.metrics.record_rescale(rec.pause_seconds or 0.0, rec.bytes_moved, rec.planned_bytes,
                                        rec.lower_bound_bytes,
                                        rec.gave_up_seconds if rec.gave_up_step is not None else None,
                                        kept=rec.kept_micro_batches > 0)
        if d.hold:
            self._reason = (f"paused at step {d.switch_step}: generation {d.generation} holds the state as {d.layout} "
                            f"on {len(d.workers)} keeper(s) off-GPU ({rec.bytes_moved} bytes moved in "
                            f"{rec.pause_seconds or 0.0:.3f} s)")
        else:
            self._reason = (f"generation {d.generation} on {d.layout} running since step {d.switch_step}"
                            + (f" (pause {rec.pause_seconds or 0.0:.3f} s, {rec.bytes_moved} bytes moved)"
                               if d.old_ranks else ""))
            if rec.recovery:
                self._reason = f"recovered ({rec.recovery}): {self._reason}"
        if self._phase in ("rescaling", "starting", "recovering"):
            self._phase = "paused" if d.hold else "running"
        self._pending = None
        self._cv.notify_all()

    @staticmethod
    def _close_record_locked(p: _Pending) -> RescaleRecord:
        """Mark ``p``'s rescale done, with the bytes and seconds its members reported."""
        p.record.ok = True
        return Coordinator._fill_record(p.record, p.results)

    @staticmethod
    def _fill_record(rec: RescaleRecord, results: dict[str, dict[str, Any]]) -> RescaleRecord:
        """``rec`` with the bytes and seconds the members reported (``results``: worker -> stats)."""
        rec.bytes_moved = sum(int(r.get("bytes_sent", 0)) for r in results.values())
        rec.execute_seconds = max((float(r.get("execute_seconds", 0.0)) for r in results.values()), default=0.0)
        rec.worker_stats = {w: dict(r) for w, r in results.items()}
        return rec

    def _record_report_locked(self, worker: str, gen: int, rep: StepReport) -> None:
        step = rep.step
        self._note_written_locked(worker, rep.checkpoint)
        key = (gen, step)
        if key[0] not in self._gen_sizes:
            return
        self._note_memory_locked(worker, gen, rep.memory)
        reps = self._reports.setdefault(key, {})
        reps[worker] = rep
        layout, size = self._gen_sizes[gen]
        if len(reps) < size:
            return
        del self._reports[key]
        losses = [r.loss for r in reps.values() if r.loss is not None and math.isfinite(r.loss)]
        rec = StepRecord(step, gen, layout, losses[0] if losses else None, max(r.tokens for r in reps.values()),
                         max(r.seconds for r in reps.values()))
        self._history.append(rec)
        self.metrics.record_step(rec.step, rec.loss, rec.tokens, rec.seconds)
        # each worker reports its last completed checkpoint write (step, generation): when every worker
        # of this generation names the same one, it is complete
        written = {r.checkpoint for r in reps.values()}
        if len(written) == 1 and (w := written.pop()) is not None and w[1] == gen:
            self._note_checkpoint_locked(w[0])
        failed = sorted(f"{w}: {r.checkpoint_error}" for w, r in reps.items() if r.checkpoint_error)
        if failed:
            at = self._saves.inflight[1] if self._saves.inflight else "?"
            self._save_failures.append(f"step {at}: " + "; ".join(failed))
            self._saves = write_failed(self._saves)
            self.metrics.record_checkpoint_failure()
            log.error("job %s: the checkpoint at step %s will not complete (%s); the previous complete one stands",
                      self.job, at, "; ".join(failed))
        self._maybe_complete_locked()
        self._cv.notify_all()

    def _note_memory_locked(self, worker: str, gen: int, doc: Any) -> None:
        """A rank's measured memory of one step: its generation keeps the worst rank's (largest device
        peak on a GPU, else most bytes), the one the controller checks against the per-GPU budget.
        A record that does not parse is logged and left out: a measurement never fails a step."""
        if not doc:
            return
        try:
            m = MeasuredMemory.from_json(doc, where=f"job {self.job}: worker {worker}'s measured memory")
        except SpecError as e:
            log.warning("%s", e)
            return
        cur = self._memory.get(gen)
        if cur is None or measured_peak(m) > measured_peak(cur):
            self._memory[gen] = m
        for old in sorted(self._memory)[:-MEMORY_GENERATIONS_KEPT]:  # a long job rescales thousands of times
            del self._memory[old]

    def _resume_from_locked(self, members: Sequence[str]) -> CheckpointRef | None:
        """Where a job's first generation starts: the newest complete checkpoint the coordinator sees,
        or (``coordinator_sees=False``) the newest one the members reported when they registered."""
        assert self.settings.checkpoint is not None
        if self.settings.checkpoint.coordinator_sees:
            return latest_checkpoint(self.settings.checkpoint.dir)
        seen = [r for m in members if (r := self._reported_checkpoints.get(m)) is not None]
        return max(seen, key=lambda r: r.step) if seen else None

    def _note_written_locked(self, w: str, written: tuple[int, int] | None) -> None:
        """A worker's last complete checkpoint write, (step, generation), from a step report or its
        rescale result (a leaver's last word)."""
        if written:
            self._written_by[w] = (int(written[0]), int(written[1]))

    def _note_checkpoint_locked(self, step: int) -> None:
        if step > self._checkpoint_step:
            self._checkpoint_step = step
            self.metrics.record_checkpoint(step)

    # ---- request handlers (HTTP threads) --------------------------------------------------
    def _touch(self, worker: str) -> None:
        self._seen[worker] = self._clock()
