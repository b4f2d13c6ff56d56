"""Rendezvous coordinator of one elastic training job, and the client its workers use.

What it is for: the controller (or a launcher) hosts one :class:`Coordinator` per training
job. It serves a small JSON-over-HTTP API (stdlib ``http.server`` in a thread) and hosts
the job's ``torch.distributed.TCPStore`` master, whose address it hands to workers for
their process groups. It is the single arbiter of three decisions that every worker must
see identically:

1. **At which step boundary a rescale happens.** Workers ask ``/v1/step`` before every
   step. When a directive is posted, the coordinator fixes ``switch_step = (highest step
   any member has begun) + 1 + lookahead``: a member may already be inside that step and
   its peers must join it, so the earliest safe boundary is the next one; the lookahead
   step lets every member see the directive one step early and prepare its receive buffers
   while it still trains. A shrink (members only leave) has its own lookahead
   (``shrink_lookahead_steps``). ``LaunchOptions`` makes both 0: someone waits for the GPUs a
   shrink frees -- inference, under load -- and a grow's joiners hold GPUs that idle until the
   switch; a step of latency costs more than preparing during the pause. Nor need the members
   wait for the boundary to hear of it: their heartbeats long-poll and are answered with the
   directive the moment it is posted (``pending``, once per post), so they plan and allocate
   beside the step in progress and only what that step leaves undone lands in the pause.
   A caller waiting for a shrink's GPUs need not wait for the new layout's first step either: ``wait_resumed``
   answers once it has begun (``wait_generation`` once it has finished).
   Nor for the step in progress (``shrink_gives_up_step``, or ``give_up_step`` per directive):
   the members, told on their heartbeat, give it up at their next micro-batch (every engine of a
   generation posted with ``Directive.give_up_checks`` agrees there through a one-float
   all-reduce) and ask for it again with ``gave_up``; the coordinator then moves the switch to
   that step (nobody has switched yet and a shrink has no joiners, so the directive can still
   change). The members keep the work of the micro-batches they had done and the new layout
   finishes the step from it when it can (every new member reports ``kept_micro_batches``): the
   pause counts from the boundary then; else the step is redone whole and the pause counts
   from the step's begin, its work lost. A grow does the same (``grow_gives_up_step``; one
   stage and the same TP split, so the work can be kept): its joiners' GPUs would idle until
   the step's end. They hold a copy of the directive from before the amendment: the ``go`` of
   ``/v1/arrive`` tells them the switch step as it stands and whether the work was kept.
2. **Whether the rescale goes ahead.** Members of old and new layout arrive at ``/v1/arrive``
   with a digest of the reshard plan they computed, or the error that kept them from
   planning or preparing it. ``go`` once all have arrived with equal digests; ``abandoned``
   when a member reports an error, the join deadline passes first (a joiner never came) or
   the digests differ. Both are decided before any byte moves, and are final. Arrivals and
   joiners' polls are long polls (``wait_s``): the answer leaves the moment it is decided.
   A directive whose switch step would come at or after ``max_steps`` is refused.
3. **Whether a generation trains or holds.** A *hold* directive (``hold=True``) pauses the
   job without losing it: its members are keepers that hold the whole training state in host
   memory and run no step; they sit at the switch step until the next directive moves the
   state back onto GPU workers, and the step counter goes on from there.
4. **Whether the job is alive, or recovers.** A worker lost while the job trains (its
   process exited, its heartbeat stopped, or a peer's collective broke on it) puts the job
   in ``recovering`` when ``recover`` is on and the layout has data-parallel replicas: every
   survivor shuts its communicators down and reports what it holds (the last step it
   applied; a step whose reduced gradients it holds unapplied); the coordinator picks the
   step they can all reach (the highest applied one: a survivor that passed a step's commit
   proves every rank reached it, so the others apply it from their own gradients) and posts
   a recovery directive: the same TP x PP split with as many replicas as the survivors fill,
   the state moving from survivors as in any rescale, training resuming at the next step.
   A member lost *during* a rescale's exchange, before every member reported its part done
   (``/v1/exchanged``: the commit), rolls the rescale back when the old generation was
   recoverable (``Directive.rollback``; members kept their old state whole): the job is back
   on the old generation and recovers from its survivors there, under a fresh generation
   number; the rolled-back rescale is recorded as failed with the reason. A loss after the
   commit (new groups being built, first step) is recovered from the new generation, whose
   state is whole by then; the rescale itself is recorded as done.
   Otherwise (or when recovery fails) the job turns ``failed`` with a reason and every later
   request from a worker is answered ``stop``.
5. **Where a start begins.** With ``checkpoint`` settings the workers write sharded
   checkpoints (:mod:`elastic.train.checkpoint`; the settings reach them at register) and the
   first directive of a job starts at the newest complete one (``Directive.resume``,
   ``switch_step`` = its step) on whatever layout it is given; else at step 0. A requested
   stop and a finish tell the workers to write a last one (``save``); a failed job's stop does
   not.
6. **When to save.** The coordinator decides, once per step for every rank of a generation
   (the first member to ask for step ``s`` fixes the answer the others get): ``go`` carries
   ``save`` when the state after step ``s`` is to be checkpointed -- at a multiple of
   ``every_steps``, once ``every_seconds`` have passed, or when asked
   (:meth:`Coordinator.request_checkpoint`). Never while a rescale is in flight (a leaver
   would not finish its write) nor while the previous checkpoint is incomplete (a rank still
   writing: the disk sets the pace, not the step); a postponed one is taken at the first step
   that allows it. One begun before a rescale or a recovery is complete once each of its
   ranks has reported its write (survivors with their next steps, a leaver with its rescale
   result); a rank gone without reporting it leaves it incomplete, and one is taken on the new
   layout at its first step (a caller waiting for one gets that one). A rank whose write
   fails reports it: that checkpoint is given up (the previous complete one stands), the next
   is due by the usual rules, and a caller waiting for one (:meth:`Coordinator.wait_checkpoint`)
   hears why.

It also aggregates per-step reports into the loss history and the Prometheus metrics
(:mod:`elastic.train.telemetry`), and records each rescale (pause, bytes moved, planned
and lower-bound bytes).

Who may talk to it: every request but ``/healthz`` carries the job's secret as a bearer token
(``Authorization: Bearer <secret>``; the coordinator generates one unless given, the launcher
hands it to the job's workers as ``ELASTIC_JOB_SECRET``), compared in constant time; anything
else gets 401 and learns nothing of the job. The HTTP API and the TCPStore master listen on
``host`` only (torch's store would otherwise listen on every interface). The store itself has
no authentication: what workers read from it that they would unpickle is signed with the
secret (:func:`sign`, :func:`verify`). Gloo's own connections between workers are not
authenticated; the job's network is the boundary there.

What it must not do: touch tensors, run collectives, or decide layouts (the controller
does; :meth:`Coordinator.directive` only validates and sequences them).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from elastic.model import Layout, SpecError
from elastic.train.checkpoint import CheckpointRef, CheckpointSettings
from elastic.train.checkpoint import latest as latest_checkpoint
from elastic.train.telemetry import TrainingMetrics

log = logging.getLogger(__name__)

API = "/v1"
SECRET_ENV = "ELASTIC_JOB_SECRET"
"""The environment variable that hands a job's secret to its workers."""
LONG_POLL_MAX_S = 5.0
"""Longest a long-polling request (``wait_s``) is held; well under the client's HTTP timeout."""


class RendezvousError(RuntimeError):
    """The coordinator could not be reached or answered with an error."""


class RescaleFailed(RuntimeError):
    """A rescale was abandoned (job continues on its old layout) or failed (job failed)."""

    def __init__(self, message: str, record: RescaleRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class RescaleCancelled(RescaleFailed):
    """A rescale was called off before its directive (``JobHandle.cancel_pending``): its
    joiners were dismissed, nothing moved, the job continues on its old layout."""


class JobFailed(RuntimeError):
    """The training job failed; ``str(e)`` carries the reason."""


# --------------------------------------------------------------------------------------------
# Wire types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Directive:
    """Generation ``generation`` trains ``layout`` on ``workers`` from ``switch_step`` on.

    ``remap=False``: new ranks follow the order of ``workers``; ``remap=True``: the reshard
    planner chooses the rank map (it keeps the most bytes local). ``old_ranks`` is the rank
    map of the generation being replaced (empty for the first one).
    """

    job: str
    generation: int
    layout: str
    workers: tuple[str, ...]
    remap: bool
    old_layout: str | None
    old_ranks: dict[str, int]
    switch_step: int
    store_host: str
    store_port: int
    join_timeout_s: float
    hold: bool = False  # a paused generation: its workers keep the state and run no step
    commit_step: int | None = None  # recovery: survivors first apply this step if they hold it ready
    # a transactional rescale: members keep their old state untouched (no recycling of dropped
    # shards) until every member has exchanged its part, and report ``exchanged`` before they
    # build the new layout; a member lost before that rolls the job back to the old generation,
    # which then recovers from its survivors (set when the old layout is recoverable)
    rollback: bool = False
    # a start (no old generation) from a checkpoint: its path; ``switch_step`` is its step and every
    # worker reads its boxes out of it (elastic.train.checkpoint) instead of initialising them
    resume: str | None = None
    resume_layout: str | None = None
    # every engine of this generation checks before each micro-batch whether a shrink asks for the
    # step in progress (TrainEngine.give_up_checks): a property of the generation, so its ranks all
    # run the check's collective or none does (the coordinator's shrink_gives_up_step when posted)
    give_up_checks: bool = False

    @property
    def members(self) -> tuple[str, ...]:
        """Everyone who takes part in the transition: old union new, sorted."""
        return tuple(sorted(set(self.old_ranks) | set(self.workers)))

    @property
    def leavers(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.old_ranks) - set(self.workers)))

    @property
    def joiners(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.workers) - set(self.old_ranks)))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["workers"] = list(self.workers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Directive:
        d = dict(d)
        d["workers"] = tuple(d["workers"])
        d["old_ranks"] = {str(k): int(v) for k, v in d["old_ranks"].items()}
        return cls(**d)


@dataclass
class StepRecord:
    """One finished step of the whole job (aggregated over the generation's workers)."""

    step: int
    generation: int
    layout: str
    loss: float | None
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class CheckpointFailed(RuntimeError):
    """A checkpoint asked for could not be written (a rank's write failed); nothing else changed."""


@dataclass
class RescaleRecord:
    """One directive's fate. ``ok`` is None while it is in progress."""

    generation: int
    from_layout: str | None
    to_layout: str
    workers: list[str]
    joiners: list[str]
    leavers: list[str]
    switch_step: int
    ok: bool | None = None
    reason: str = ""
    pause_seconds: float | None = None
    bytes_moved: int = 0
    planned_bytes: int = 0
    lower_bound_bytes: int = 0
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0
    new_ranks: dict[str, int] = field(default_factory=dict)
    worker_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    hold: bool = False  # the job was paused by this directive (pause_seconds: until the state was held)
    recovery: str = ""  # a recovery directive: which workers were lost and why
    # a shrink that gave the step in progress up (shrink_gives_up_step): that step, and how long
    # the members had computed on it (the longest; counted in pause_seconds: work thrown away)
    gave_up_step: int | None = None
    gave_up_seconds: float = 0.0
    # of the given-up step, the micro-batches per replica whose work the new layout kept and
    # finished from (0: none, the step was redone whole and gave_up_seconds were thrown away)
    kept_micro_batches: int = 0


@dataclass
class JobStatus:
    job: str
    phase: str  # starting | running | rescaling | paused | recovering | failed | stopping | stopped | finished
    generation: int
    layout: str | None
    workers: list[str]  # current generation's workers in rank order
    step: int  # last completed step, -1 before the first
    loss: float | None
    tokens_per_second: float | None
    step_seconds: float | None
    error: str | None
    last_rescale: RescaleRecord | None
    reason: str = ""  # the last notable event (e.g. why a rescale was abandoned)
    failures: list[str] = field(default_factory=list)  # every failure report, first one = error
    checkpoint_step: int | None = None  # the newest complete checkpoint's step (-1: none yet; None: off)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Coordinator
# --------------------------------------------------------------------------------------------


@dataclass
class _Gen:
    generation: int
    layout: str
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


Validator = Callable[[Layout, Sequence[str]], None]


class Coordinator:
    """One job's rendezvous. ``start()`` it, post ``directive()``s, read ``status()``."""

    def __init__(
        self,
        job: str,
        config: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        registry: CollectorRegistry | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 15.0,
        join_timeout_s: float = 60.0,
        lookahead_steps: int = 1,
        shrink_lookahead_steps: int | None = None,
        max_steps: int | None = None,
        validator: Validator | None = None,
        recover: bool = False,
        transactional: bool = True,
        recovery_timeout_s: float | None = None,
        rendezvous_timeout_s: float | None = None,
        checkpoint: CheckpointSettings | None = None,
        shrink_gives_up_step: bool = False,
        grow_gives_up_step: bool = False,
        prepare_beside_step: bool = True,
        secret: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise SpecError(
                f"heartbeat_timeout_s={heartbeat_timeout_s} must exceed heartbeat_interval_s={heartbeat_interval_s}"
                " (a worker needs a few beats of slack)"
            )
        self.job = job
        self.config = dict(config or {})
        if secret is not None and len(secret) < 16:
            raise SpecError("secret: at least 16 characters (or None: the coordinator generates one)")
        # every request but /healthz must carry it (see the module doc); never logged
        self.secret = secret or secrets.token_urlsafe(32)
        self._auth = f"Bearer {self.secret}".encode()
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.join_timeout_s = join_timeout_s
        self.lookahead_steps = lookahead_steps
        # None: as any rescale
        self.shrink_lookahead_steps = lookahead_steps if shrink_lookahead_steps is None else shrink_lookahead_steps
        if min(self.lookahead_steps, self.shrink_lookahead_steps) < 0:
            raise SpecError(f"lookahead_steps={lookahead_steps}, shrink_lookahead_steps={shrink_lookahead_steps}: "
                            "a lookahead counts steps, >= 0")
        self.max_steps = max_steps
        self.validator = validator
        # a shrink (with no lookahead, on one pipeline stage) asks its members to give the step in
        # progress up instead of finishing it: the GPUs go a step sooner, the partial step is lost
        self.shrink_gives_up_step = shrink_gives_up_step
        # a grow (same: no lookahead, one pipeline stage; and the same TP split, so the work is
        # kept) asks the same: its joiners' GPUs idle until the switch; the members keep the step's
        # work and the new layout, joiners included, finishes it. Needs engines that check
        # (generations posted with shrink_gives_up_step)
        self.grow_gives_up_step = grow_gives_up_step
        # members hear of a posted rescale on their heartbeat and prepare beside the step in
        # progress (False: at the switch, or during the lookahead steps; for A/B measurements)
        self.prepare_beside_step = prepare_beside_step
        self.recover = recover
        # rescales of a recoverable generation roll back on a loss mid-exchange (Directive.rollback)
        self.transactional = transactional
        # survivors must report within this after a loss (default: the heartbeat timeout)
        self.recovery_timeout_s = recovery_timeout_s if recovery_timeout_s is not None else heartbeat_timeout_s
        # how long a worker may block inside a group's rendezvous (its pg_timeout_s): gloo's C++
        # rendezvous cannot be given up from Python, so a survivor that still beats and says it is
        # building groups is waited for that long before it is given up (None: not at all)
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self._building: dict[str, Any] = {}  # worker -> the generation its last heartbeat said it builds
        # periodic checkpoints (the workers write them; a start begins at the newest complete one)
        self.checkpoint = checkpoint
        self.resumed_from: CheckpointRef | None = None
        self._checkpoint_step = -1  # every worker of a generation wrote its part (from their step reports)
        self._reported_checkpoints: dict[str, CheckpointRef | None] = {}  # worker -> what it sees, at register
        # when to save (section 6 above): (generation, step) -> the answer every member gets; the save
        # decided last, (generation, step it saves), until complete; its step and clock time; a request
        self._save_answers: dict[tuple[int, int], bool] = {}
        self._save_inflight: tuple[int, int] | None = None
        self._save_last_step: int | None = None
        self._save_last_at: float | None = None
        self._save_requested = False
        # the ranks that write the save in flight (its generation's members), each worker's last
        # complete write as it reported it (step, generation), and a save cut short by a rescale or a
        # recovery (a rank left before its write was reported): one is due at once on the new layout
        self._save_writers: frozenset[str] = frozenset()
        self._written_by: dict[str, tuple[int, int]] = {}
        self._save_redo = False
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
        self._reports: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        self._gen_sizes: dict[int, tuple[str, int]] = {}  # generation -> (layout, world size)
        self._history: list[StepRecord] = []
        self._rescales: dict[int, RescaleRecord] = {}
        self._decisions: dict[int, tuple[str, str]] = {}
        self._finished: set[str] = set()
        self._failures: list[str] = []
        self._recovery: _Recovery | None = None
        self._rolled_back: dict[int, str] = {}  # generation -> why its exchange was rolled back
        self.lost: set[str] = set()  # workers given up for lost (a launcher makes sure they are gone)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Coordinator:
        """1. host the TCPStore master, 2. serve HTTP, 3. watch heartbeats and deadlines."""

        if self.checkpoint is not None and self.checkpoint.coordinator_sees:
            self.checkpoint.check_writable()
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
            self._check_can_post(generation)
            cur = self._current
            if hold and (cur is None or cur.hold):
                raise SpecError(f"job {self.job}: " + ("a job that has not started has no state to hold; start it"
                                                       if cur is None else "is paused already; resume it first"))
            old_ranks = dict(cur.ranks) if cur else {}
            resume = self._resume_from_locked(members) if self.checkpoint and cur is None else None
            shrink = cur is not None and not hold and not cur.hold and set(members) < set(cur.ranks)
            switch = self._switch_step_locked(shrink) if cur else resume.step if resume else 0
            self._check_before_max_steps(generation, switch)
            d = Directive(
                job=self.job, generation=generation, layout=str(lay), workers=tuple(members), remap=remap,
                old_layout=cur.layout if cur else None, old_ranks=old_ranks, switch_step=switch,
                store_host=self.advertise_host, store_port=self.store_port,
                join_timeout_s=join_timeout_s if join_timeout_s is not None else self.join_timeout_s,
                hold=hold, rollback=self.transactional and cur is not None and not hold and self._recoverable(cur),
                resume=resume.path if resume else None, resume_layout=resume.layout if resume else None,
                give_up_checks=self.shrink_gives_up_step,
            )
            if resume is not None:
                self.resumed_from = resume
                self._note_checkpoint_locked(resume.step)
                log.info("job %s starts from checkpoint %s (step %d, saved on %s)", self.job, resume.path,
                         resume.step, resume.layout)
            rec = RescaleRecord(generation, d.old_layout, d.layout, list(members), list(d.joiners),
                                list(d.leavers), switch, hold=hold)
            self._post_seq += 1
            self._pending = _Pending(d, rec, self._clock(), seq=self._post_seq)
            self._alarm.notify_all()  # heartbeats tell the members in the step, who prepare meanwhile
            grow = (cur is not None and not hold and not cur.hold and set(cur.ranks) < set(members)
                    and _keeps_work(Layout.parse(cur.layout), lay))
            asks = ((self.shrink_gives_up_step if shrink else self.grow_gives_up_step if grow else False)
                    if give_up_step is None else give_up_step)
            if (shrink or grow) and asks and self._gives_up_locked(cur, switch):
                self._pending.give_up_step, self._pending.give_up_begun_at = switch - 1, self._max_begun_at
                # (the heartbeats woken above carry the request too: they answer once the lock is free)
            self._rescales[generation] = rec
            # an abandoned (or rolled back) earlier try of this number decided nothing about this one
            self._decisions.pop(generation, None)
            self._rolled_back.pop(generation, None)
            self._phase = "rescaling" if cur else "starting"
            self._cv.notify_all()
            return d

    def _switch_step_locked(self, shrink: bool = False) -> int:
        """The earliest step boundary every member of the current generation can still stop at.

        Training: after the highest step any member has begun, plus the lookahead (a shrink's
        own). Held: the step the keepers sit at (they begin no step)."""
        cur = self._current
        assert cur is not None
        if cur.hold:
            return cur.start_step
        ahead = self.shrink_lookahead_steps if shrink else self.lookahead_steps
        return max(self._max_begun + 1 + ahead, cur.start_step)

    def _gives_up_locked(self, cur: _Gen, switch: int) -> bool:
        """Whether a shrink or grow switching at ``switch`` can ask for the step in progress: no
        lookahead (the step before the switch is the one in progress), engines that check (the
        generation was posted with them), one pipeline stage (members meet at every micro-batch),
        and a step of this generation in progress."""
        return (min(self.shrink_lookahead_steps, self.lookahead_steps) == 0 and cur.give_up_checks
                and Layout.parse(cur.layout).pp == 1 and switch - 1 == self._max_begun >= cur.start_step)

    def _begin_step_locked(self, step: int) -> None:
        if step > self._max_begun:
            self._max_begun, self._max_begun_at = step, self._clock()

    def _check_can_post(self, generation: int) -> None:
        if self._phase in ("failed", "stopped", "stopping", "finished"):
            raise SpecError(f"job {self.job} is {self._phase} ({self._error or self._reason}); cannot rescale it")
        if self._pending is not None and self._pending.decision != "abandoned":
            raise SpecError(
                f"job {self.job}: generation {self._pending.directive.generation} is still in flight; "
                "wait for it (wait_generation) before posting another"
            )
        if self._recovery is not None:
            raise SpecError(f"job {self.job} is recovering from a lost worker ({self._recovery.reason}); "
                            "post the rescale once it runs again")
        expected = (self._current.generation if self._current else 0) + 1
        if generation != expected:
            raise SpecError(f"job {self.job}: directive generation={generation}, expected {expected} "
                            "(generations count up by one from the current one)")

    def check_directive(self, generation: int) -> None:
        """Refuse (SpecError) now what :meth:`directive` would refuse for sequencing reasons, so a launcher
        need not start joiners for it: job not running, another rescale in flight, wrong generation, or
        the job's ``max_steps`` coming before the earliest switch step."""
        with self._cv:
            self._check_can_post(generation)
            if self._current is not None:
                self._check_before_max_steps(generation, self._switch_step_locked())

    def _check_before_max_steps(self, generation: int, switch: int) -> None:
        """A rescale must switch before the job's last step, or the old layout finishes first and the
        joiners wait for a boundary that never comes."""
        if self.max_steps is None or generation == 1 or switch < self.max_steps:
            return
        raise SpecError(
            f"job {self.job}: generation {generation} would switch at step {switch} (after the step in progress "
            f"and the lookahead), but the job ends at max_steps={self.max_steps} "
            f"(last step {self.max_steps - 1}); nothing changed: the job finishes on its current layout"
        )

    def status(self) -> JobStatus:
        with self._cv:
            return self._status_locked()

    def _status_locked(self) -> JobStatus:
        cur, last = self._current, (self._history[-1] if self._history else None)
        workers = sorted(cur.ranks, key=cur.ranks.__getitem__) if cur else []
        rec = self._rescales[max(self._rescales)] if self._rescales else None
        return JobStatus(
            job=self.job, phase=self._phase, generation=cur.generation if cur else 0,
            layout=cur.layout if cur else None, workers=workers, step=last.step if last else -1,
            loss=last.loss if last else None, tokens_per_second=last.tokens_per_second if last else None,
            step_seconds=last.seconds if last else None, error=self._error,
            last_rescale=RescaleRecord(**asdict(rec)) if rec else None, reason=self._reason,
            failures=list(self._failures),
            checkpoint_step=self._checkpoint_step if self.checkpoint else None,
        )

    def history(self) -> list[StepRecord]:
        with self._cv:
            return list(self._history)

    def rescale_record(self, generation: int) -> RescaleRecord | None:
        with self._cv:
            rec = self._rescales.get(generation)
            return RescaleRecord(**asdict(rec)) if rec else None

    def wait_generation(self, generation: int, timeout: float) -> RescaleRecord:
        """Block until ``generation`` ran its first step. Raises RescaleFailed / JobFailed / TimeoutError."""

        with self._cv:
            if not self._cv.wait_for(lambda: self._generation_over_locked(generation), timeout):
                raise TimeoutError(f"job {self.job}: generation {generation} did not run a step within {timeout:.0f} s "
                                   f"(phase {self._phase}, {self._reason or 'no reason recorded'})")
            rec = self._rescales.get(generation)
            if rec is not None and rec.ok:
                return RescaleRecord(**asdict(rec))
            if rec is not None and rec.ok is False:
                raise RescaleFailed(rec.reason, RescaleRecord(**asdict(rec)))
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
                return self._fill_record(RescaleRecord(**asdict(p.record)), p.results)
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
            self._recovery = None
            self.metrics.record_recovery()
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

    def _record_report_locked(self, worker: str, gen: int, rep: dict[str, Any]) -> None:
        step = int(rep["step"])
        self._note_written_locked(worker, rep.get("checkpoint"))
        key = (gen, step)
        if key[0] not in self._gen_sizes:
            return
        reps = self._reports.setdefault(key, {})
        reps[worker] = rep
        layout, size = self._gen_sizes[gen]
        if len(reps) < size:
            return
        del self._reports[key]
        losses = [float(r["loss"]) for r in reps.values() if r.get("loss") is not None and math.isfinite(r["loss"])]
        rec = StepRecord(step, gen, layout, losses[0] if losses else None,
                         max(int(r.get("tokens", 0)) for r in reps.values()),
                         max(float(r.get("seconds", 0.0)) for r in reps.values()))
        self._history.append(rec)
        self.metrics.record_step(rec.step, rec.loss, rec.tokens, rec.seconds)
        # each worker reports its last completed checkpoint write (step, generation): when every worker
        # of this generation names the same one, it is complete
        written = {tuple(r["checkpoint"]) if r.get("checkpoint") else None for r in reps.values()}
        if len(written) == 1 and (w := written.pop()) is not None and int(w[1]) == gen:
            self._note_checkpoint_locked(int(w[0]))
        failed = sorted(f"{w}: {r['checkpoint_error']}" for w, r in reps.items() if r.get("checkpoint_error"))
        if failed:
            at = self._save_inflight[1] if self._save_inflight else "?"
            self._save_failures.append(f"step {at}: " + "; ".join(failed))
            self._save_inflight = None  # given up: the next is due by the usual rules
            self.metrics.record_checkpoint_failure()
            log.error("job %s: the checkpoint at step %s will not complete (%s); the previous complete one stands",
                      self.job, at, "; ".join(failed))
        self._maybe_complete_locked()
        self._cv.notify_all()

    def _resume_from_locked(self, members: Sequence[str]) -> CheckpointRef | None:
        """Where a job's first generation starts: the newest complete checkpoint the coordinator sees,
        or (``coordinator_sees=False``) the newest one the members reported when they registered."""
        assert self.checkpoint is not None
        if self.checkpoint.coordinator_sees:
            return latest_checkpoint(self.checkpoint.dir)
        seen = [r for m in members if (r := self._reported_checkpoints.get(m)) is not None]
        return max(seen, key=lambda r: r.step) if seen else None

    def _note_written_locked(self, w: str, written: Any) -> None:
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

    def handle(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = _ROUTES.get(route)
        if fn is None:
            raise KeyError(route)
        with self._cv:
            return fn(self, body)

    def _h_register(self, b: dict[str, Any]) -> dict[str, Any]:
        w = str(b["worker"])
        self._touch(w)
        self._left.discard(w)
        self._registered.add(w)
        if self.checkpoint is not None:
            self._reported_checkpoints[w] = CheckpointRef.from_json(b.get("checkpoint_latest"))
        return {"job": self.job, "config": self.config, "heartbeat_interval_s": self.heartbeat_interval_s,
                "heartbeat_timeout_s": self.heartbeat_timeout_s,
                "checkpoint": self.checkpoint.to_json() if self.checkpoint else None}

    def _h_heartbeat(self, b: dict[str, Any]) -> dict[str, Any]:
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
        w = str(b["worker"])
        gen = b.get("generation")
        building = b.get("building")  # the generation whose groups it is building, if any
        wait_s = min(float(b.get("wait_s") or 0.0), LONG_POLL_MAX_S)
        if w not in self._left:
            self._touch(w)
            self._building[w] = building

        def unreported(g: Any) -> bool:
            rec = self._recovery
            return (rec is not None and g is not None and int(g) == rec.generation and not rec.posted
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
            if int(building) in self._rolled_back:
                return self._rolled_back[int(building)]
            decided = self._decisions.get(int(building))
            if decided is not None and decided[0] == "abandoned":  # e.g. a joiner never came: nothing will form
                return f"the rescale to generation {building} was abandoned: {decided[1]}"
            rec = self._recovery
            return rec.reason if unreported(building) and rec is not None else None

        def give_up() -> int | None:
            return None if gen is None else self._give_up_asked_locked(w, int(gen))

        seen = b.get("seen")

        def pending() -> _Pending | None:
            p, cur = self._pending, self._current
            if (not self.prepare_beside_step or seen is None or gen is None or p is None or p.decision is not None or p.seq == int(seen)
                    or p.record.recovery or cur is None or cur.hold or int(gen) != cur.generation
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
        out: dict[str, Any] = {"phase": self._phase, "failed": self._phase == "failed", "reason": self._error or ""}
        if interrupt():
            out["interrupt"] = int(gen)  # type: ignore[arg-type]
        if (s := give_up()) is not None:
            out["give_up"] = {"generation": int(gen), "step": s}  # type: ignore[arg-type]
        if (why := abort()) is not None:
            out["abort"], out["abort_reason"] = int(building), why  # type: ignore[arg-type]
        if (p := pending()) is not None:
            out["pending"], out["pending_seq"] = p.directive.to_json(), p.seq
        return out

    def _h_poll(self, b: dict[str, Any]) -> dict[str, Any]:
        """A worker without a generation asks whether a directive includes it (``wait_s``: long poll)."""
        w = str(b["worker"])
        self._touch(w)
        wait_s = min(float(b.get("wait_s") or 0.0), LONG_POLL_MAX_S)
        answer: dict[str, Any] = {}

        def decided() -> bool:
            answer.clear()
            answer.update(self._poll_answer_locked(w))
            return answer["action"] != "wait" or self._closing.is_set()

        if not decided() and wait_s > 0:
            self._cv.wait_for(decided, wait_s)
        return answer

    def _poll_answer_locked(self, w: str) -> dict[str, Any]:
        if self._phase in ("failed", "stopping", "stopped", "finished"):
            return {"action": "exit", "reason": self._error or self._reason or self._phase}
        p = self._pending
        if p is not None and p.decision is None and w in p.directive.workers:
            return {"action": "join", "directive": p.directive.to_json()}
        if p is not None and p.decision == "abandoned" and w in p.directive.joiners:
            # launched for a rescale that will not happen: leave now rather than wait to be killed
            return {"action": "exit", "reason": p.record.reason}
        return {"action": "wait"}

    def _h_step(self, b: dict[str, Any]) -> dict[str, Any]:
        """Before step ``step``: go, switch to the pending generation, or stop. Carries the last result."""
        w, gen, step = str(b["worker"]), int(b["generation"]), int(b["step"])
        self._touch(w)
        if b.get("result"):
            self._record_report_locked(w, gen, b["result"])
        self._note_resumed_locked(w, gen, step)
        if self._phase in ("failed", "stopping", "stopped"):
            # a requested stop at a step boundary: every worker of the generation is at the same step
            # with a whole state, which is worth a last checkpoint (a failed job's is not)
            return {"action": "stop", "reason": self._error or self._reason or self._phase,
                    "save": self._phase != "failed" and self._recovery is None}
        if self._recovery is not None and gen == self._recovery.generation:
            return self._recovery_answer_locked(w, gen, float(b.get("wait_s") or 0.0))
        cur = self._current
        if cur is None or gen != cur.generation:
            return {"action": "stop", "reason": f"worker {w} is on generation {gen}, the job on "
                                                f"{cur.generation if cur else 'none'}; stale worker"}
        if cur.hold:
            return self._hold_answer_locked(w, gen, float(b.get("wait_s") or 0.0))
        if self.max_steps is not None and step >= self.max_steps:
            self._finished.add(w)
            if set(cur.ranks) <= self._finished:
                if self._pending is not None and self._pending.decision is None:  # defensive: refused at post
                    self._abandon_locked(f"the job reached max_steps={self.max_steps} before the switch step "
                                         f"{self._pending.directive.switch_step}")
                self._phase, self._reason = "finished", f"reached max_steps={self.max_steps}"
                self._cv.notify_all()
            return {"action": "finish", "reason": f"reached max_steps={self.max_steps}", "save": True}
        p = self._pending
        if p is not None and p.decision is None and w in p.directive.old_ranks:
            if b.get("gave_up") and int(b["gave_up"]["step"]) == step:
                self._gave_up_locked(p, w, step, float(b["gave_up"].get("seconds") or 0.0),
                                     int(b["gave_up"].get("micro") or 0), bool(b["gave_up"].get("kept")))
            if step >= p.directive.switch_step:
                self._note_boundary_locked(p, w)
                return {"action": "switch", "directive": p.directive.to_json()}
            self._begin_step_locked(step)
            out = {"action": "go", "pending": p.directive.to_json()}  # no save while a rescale is in flight
            if self._give_up_asked_locked(w, gen) == step:  # its peers may be computing it: give it up too
                out["give_up"] = step
            return out
        self._begin_step_locked(step)
        return {"action": "go", "save": True} if self._save_answer_locked(gen, step) else {"action": "go"}

    def _save_answer_locked(self, gen: int, step: int) -> bool:
        """Whether the state after ``step`` of generation ``gen`` is to be checkpointed: decided when
        the first member asks, the same answer for the others (section 6 of the module doc)."""
        c = self.checkpoint
        if c is None:
            return False
        key = (gen, step)
        if key in self._save_answers:
            return self._save_answers[key]
        now = self._clock()
        if self._save_last_step is None:  # the first step asked for: the clocks start here
            self._save_last_step, self._save_last_at = step, now
        if self._save_inflight is not None:
            g, at = self._save_inflight
            if self._checkpoint_step >= at:
                self._save_inflight = None
            elif g != gen:
                # begun on an older generation, then a rescale or a recovery: complete once each of its
                # ranks has reported its write (survivors report theirs with their next steps); a rank
                # gone without reporting it (a leaver exits at once, its GPU is not held back for a
                # write; a lost one) leaves it incomplete, and one is taken on the new layout at once
                members = set(self._current.ranks) if self._current is not None else set()
                gone = sorted(w for w in self._save_writers - members if self._written_by.get(w) != (at, g))
                if all(self._written_by.get(w) == (at, g) for w in self._save_writers):
                    self._note_checkpoint_locked(at)
                    self._save_inflight = None
                elif gone:
                    log.warning("job %s: the checkpoint at step %d is incomplete (%s left generation %d before "
                                "reporting its write); taking one on %s now", self.job, at, ", ".join(gone), g,
                                self._current.layout if self._current is not None else "the new layout")
                    self._save_inflight = None
                    self._save_redo = True
        due = (self._save_redo or self._save_requested
               or (c.every_steps is not None and (step + 1) // c.every_steps > self._save_last_step // c.every_steps)
               or (c.every_seconds is not None and self._save_last_at is not None
                   and now - self._save_last_at >= c.every_seconds))
        in_flight = self._pending is not None and self._pending.decision is None  # a rescale not decided yet
        save = due and self._save_inflight is None and not in_flight
        if save:
            self._save_inflight, self._save_last_step, self._save_last_at = (gen, step + 1), step + 1, now
            self._save_writers = frozenset(self._current.ranks) if self._current is not None else frozenset()
            self._save_requested = self._save_redo = False
        self._save_answers[key] = save
        if len(self._save_answers) > 64:  # members are at most a step or two apart
            for k in sorted(self._save_answers)[:-32]:
                del self._save_answers[k]
        return save

    def request_checkpoint(self) -> tuple[int, int]:
        """Ask for a checkpoint at the next step that allows one. Returns a ticket for
        :meth:`wait_checkpoint`: (the newest complete checkpoint's step now, -1 for none; the
        number of failed writes so far). Raises SpecError when the job has no checkpoint
        settings or has ended (nothing asked)."""
        with self._cv:
            if self.checkpoint is None:
                raise SpecError(f"job {self.job} has no checkpoint settings; give it checkpoint.dir to save one")
            if self._phase in ("failed", "stopping", "stopped", "finished"):
                raise SpecError(f"job {self.job} is {self._phase}; a checkpoint needs a running job")
            if self._current is not None and self._current.hold:
                raise SpecError(f"job {self.job} is paused: its keepers hold the state and run no step; resume it "
                                "to save a checkpoint")
            self._save_requested = True
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
                           "the previous checkpoint is still being written" if self._save_inflight is not None else
                           "the workers have not reached a step boundary")
                    raise TimeoutError(f"job {self.job}: no checkpoint after step {after} within {timeout:g} s "
                                       f"({why})")
                self._cv.wait(min(left, 1.0))
            return self._checkpoint_step

    def _hold_answer_locked(self, w: str, gen: int, wait_s: float) -> dict[str, Any]:
        """A keeper of a held generation asks before the step it sits at: switch when the next
        directive is posted, stop when the job stops, else ``hold`` (after a long poll)."""

        def over() -> bool:
            cur = self._current
            return cur is None or cur.generation != gen

        def answer() -> dict[str, Any] | None:
            if over():
                cur = self._current
                return {"action": "stop", "reason": f"worker {w} is on generation {gen}, the job on "
                                                    f"{cur.generation if cur else 'none'}; stale worker"}
            return None

        return self._wait_for_switch_locked(w, answer, over, wait_s)

    def _wait_for_switch_locked(self, w: str, answer: Callable[[], dict[str, Any] | None],
                                over: Callable[[], bool], wait_s: float) -> dict[str, Any]:
        """For a worker that waits between steps (a keeper, a survivor): ``stop`` when the job stops,
        ``answer()`` when it has one, ``switch`` once a directive lists it as an old member, else
        ``hold`` after a long poll of up to ``wait_s`` (``over()``: ``answer`` would now say something)."""

        def switch() -> bool:
            p = self._pending
            return p is not None and p.decision is None and w in p.directive.old_ranks

        def now() -> dict[str, Any] | None:
            if self._phase in ("failed", "stopping", "stopped"):
                return {"action": "stop", "reason": self._error or self._reason or self._phase}
            out = answer()
            if out is None and switch():
                p = self._pending
                assert p is not None
                self._note_boundary_locked(p, w)
                out = {"action": "switch", "directive": p.directive.to_json()}
            return out

        out = now()
        if out is None and wait_s > 0:  # the predicate has no side effects: wait_for re-checks it
            self._cv.wait_for(lambda: (self._closing.is_set() or self._phase in ("failed", "stopping", "stopped")
                                       or over() or switch()), min(wait_s, LONG_POLL_MAX_S))
            out = now()
        return out or {"action": "hold", "reason": self._reason}

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

    def _h_arrive(self, b: dict[str, Any]) -> dict[str, Any]:
        """A member is at the meeting point of ``generation`` with its plan digest; returns the decision.

        ``error`` (optional): this member could not plan or prepare the reshard; the rescale is
        abandoned for everyone before any byte moves. ``wait_s`` (optional): hold the answer up
        to that long while the decision is still open (long poll: every member hears ``go`` the
        moment the last one arrives, instead of on its next poll).
        """
        w, gen = str(b["worker"]), int(b["generation"])
        self._touch(w)
        p = self._pending
        if gen not in self._decisions and (p is None or p.directive.generation != gen
                                           or w not in p.directive.members):
            return {"decision": "abandoned", "reason": f"worker {w} is not a member of generation {gen}"}
        if gen not in self._decisions:
            self._arrive_locked(w, b)
        wait_s = min(float(b.get("wait_s") or 0.0), LONG_POLL_MAX_S)
        if gen not in self._decisions and wait_s > 0:
            self._cv.wait_for(lambda: gen in self._decisions or self._closing.is_set(), wait_s)
        if gen in self._decisions:
            decision, reason = self._decisions[gen]
            out: dict[str, Any] = {"decision": decision, "reason": reason}
            p = self._pending
            if decision == "go" and p is not None and p.directive.generation == gen:
                # the switch step as it stands (a joiner's copy predates a give-up's amendment) and
                # whether every old member kept the given-up step's work (the new layout finishes it)
                out["switch_step"] = p.directive.switch_step
                if p.record.gave_up_step is not None:
                    out["gave_up"] = {"step": p.record.gave_up_step, "micro": p.gave_up_micro,
                                      "kept": set(p.directive.old_ranks) <= p.kept_by}
            return out
        return {"decision": "wait", "reason": ""}

    def _arrive_locked(self, w: str, b: dict[str, Any]) -> None:
        p = self._pending
        assert p is not None
        if b.get("error"):
            self._abandon_locked(f"worker {w} could not plan or prepare the reshard: {b['error']}; nothing moved, "
                                 "the job continues on its old layout")
            return
        if w not in p.arrived:
            plan = dict(b.get("plan") or {})
            ranks = {str(k): int(v) for k, v in (plan.get("new_ranks") or {}).items()}
            d = p.directive
            if ranks and (set(ranks) != set(d.workers) or sorted(ranks.values()) != list(range(len(d.workers)))):
                # a plan for another directive (of the same number): never make it the job's layout
                self._abandon_locked(f"worker {w} arrived with a plan for other workers ({ranks}) than generation "
                                     f"{d.generation}'s {list(d.workers)}; nothing moved, the job continues on its "
                                     "old layout")
                return
            p.arrived[w] = str(b.get("digest", ""))
            if plan:
                p.plan_info = plan
        digests = sorted(set(p.arrived.values()))
        if len(digests) > 1:
            by = {dg: sorted(x for x, y in p.arrived.items() if y == dg) for dg in digests}
            self._abandon_locked(f"members computed different reshard plans {by}; the planner must be "
                                 "deterministic for equal inputs")
        elif set(p.directive.members) <= set(p.arrived):
            self._go_locked()

    def _h_result(self, b: dict[str, Any]) -> dict[str, Any]:
        """A member finished (or failed) its part of a rescale."""
        w, gen = str(b["worker"]), int(b["generation"])
        self._touch(w)
        if not b.get("ok", False):
            self._fail_locked(f"worker {w} failed during the rescale to generation {gen}: {b.get('error')}")
            return {}
        p = self._pending
        self._note_written_locked(w, b.get("checkpoint"))
        if p is not None and p.directive.generation == gen:
            p.results[w] = dict(b.get("stats") or {})
            if w not in p.directive.workers:  # a leaver: it exits now, its silence is expected
                self._left.add(w)
                self._seen.pop(w, None)
                self._building.pop(w, None)
            self._maybe_complete_locked()
            self._cv.notify_all()  # wait_resumed
        return {}

    def _h_exchanged(self, b: dict[str, Any]) -> dict[str, Any]:
        """A member of a transactional rescale (``Directive.rollback``) moved its part of the bytes and
        still holds its old state: ``go`` once every member has (the commit: from here the old state
        may go and the new layout is built), ``rollback`` when the rescale was rolled back meanwhile,
        ``wait`` after a long poll of up to ``wait_s``."""
        w, gen = str(b["worker"]), int(b["generation"])
        self._touch(w)
        wait_s = min(float(b.get("wait_s") or 0.0), LONG_POLL_MAX_S)

        def answer() -> dict[str, Any] | None:
            if gen in self._rolled_back:
                return {"decision": "rollback", "reason": self._rolled_back[gen]}
            if self._phase in ("failed", "stopping", "stopped"):
                return {"decision": "stop", "reason": self._error or self._reason or self._phase}
            p = self._pending
            if p is None or p.directive.generation != gen:
                # committed and finished already (a late ask), or never ours
                rec = self._rescales.get(gen)
                return ({"decision": "go", "reason": ""} if rec is not None and rec.ok
                        else {"decision": "stop", "reason": f"generation {gen} is not in flight"})
            if self._committed(p):
                return {"decision": "go", "reason": ""}
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
        return out or {"decision": "wait", "reason": ""}

    def _h_fail(self, b: dict[str, Any]) -> dict[str, Any]:
        """A worker failed and exits: a lost worker (the job recovers without it if it can, else fails)."""
        w = str(b["worker"])
        self._lost_locked(w, f"worker {w}: {b.get('reason', 'no reason given')}")
        return {}

    def _h_broken(self, b: dict[str, Any]) -> dict[str, Any]:
        """A worker's collective broke (a peer died) or it was told to ``break``: it has shut its
        communicators down and reports what it holds: ``applied`` (last step whose update it
        applied), ``ready`` (a step whose reduced gradients it holds unapplied, or None),
        ``dirty`` (an update broke half-way), ``local_apply`` (it can apply ``ready`` alone)."""
        w, gen = str(b["worker"]), int(b["generation"])
        self._touch(w)
        error = str(b.get("error") or "told to break")
        p = self._rollback_pending_locked()
        if p is not None and p.previous is not None and gen in (p.previous.generation, p.directive.generation):
            # an exchange broke (``gen``: the old generation, reported from the old state it kept; the
            # new one: a joiner, which has none): back to the old generation, recovered from there
            self._rollback_locked(f"worker {w}'s exchange broke: {error}")
        if gen in self._rolled_back and (self._current is None or gen != self._current.generation):
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
            return {"action": "stop", "reason": self._rolled_back[gen]}
        cur = self._current
        if self._phase in ("failed", "stopping", "stopped") or cur is None or gen != cur.generation:
            return {"action": "stop", "reason": self._error or self._reason or f"generation {gen} is over"}
        if self._recovery is None:
            if not self._can_recover_locked():
                self._fail_locked(f"worker {w} at step {b.get('step')}: {error}")
                return {"action": "stop", "reason": self._error or ""}
            self._start_recovery_locked(f"worker {w}'s collective broke at step {b.get('step')}: {error}")
        assert self._recovery is not None
        if w not in self._recovery.lost:
            self._recovery.reports[w] = {k: b.get(k) for k in ("step", "applied", "ready", "dirty", "local_apply")}
        self._maybe_post_recovery_locked()
        return {"action": "hold"}

    # ---- recovery from surviving replicas (call with _cv held) ----------------------------
    def _can_recover_locked(self) -> bool:
        cur, p = self._current, self._pending
        if cur is None or self._phase not in ("running", "rescaling", "recovering"):
            return False
        if p is not None and p.decision == "go" and not self._committed(p):  # bytes in flight
            return False
        return self._recoverable(cur)

    @staticmethod
    def _committed(p: _Pending) -> bool:
        """Every member of a transactional rescale exchanged its part: the new generation's state
        is whole on its members (a loss from here on is recovered from the new generation)."""
        return p.directive.rollback and set(p.directive.members) <= p.exchanged

    def _recoverable(self, gen: _Gen) -> bool:
        """A loss in ``gen`` can be recovered: every box has a surviving copy (replicas, dp >= 2,
        without ZeRO sharding their optimizer state) and recovery is on."""
        if not self.recover or gen.hold:
            return False
        lay = Layout.parse(gen.layout)
        # a user job says whether its data-parallel ranks hold copies (DDP) or shards (FSDP) of the state
        return lay.dp >= 2 and not lay.zero and bool(self.config.get("dp_replicas", True))

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

    def _start_recovery_locked(self, reason: str) -> None:
        cur = self._current
        assert cur is not None
        p = self._pending
        if p is not None and p.decision is None:  # a rescale not yet begun: call it off first
            self._abandon_locked(f"a worker was lost before the switch ({reason})")
        elif p is not None and p.decision == "go" and p.record.ok is None and self._committed(p):
            # committed, its first step not done: the rescale itself is over (the state is on the
            # new generation, from which we recover); record it as done with what is known
            rec = self._close_record_locked(p)
            if rec.pause_seconds is None and p.stopped_at is not None:
                rec.pause_seconds = self._clock() - p.stopped_at
            rec.reason = f"done; a worker was lost before its first step finished ({reason})"
            self._pending = None
        self._phase = "recovering"
        self._recovery = _Recovery(cur.generation, self._clock(), reason)
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

    def _recovery_answer_locked(self, w: str, gen: int, wait_s: float) -> dict[str, Any]:
        """A survivor of the broken generation asks before a step: break (report first), switch to
        the recovery directive, stop (given up for lost), or hold (after a long poll)."""

        def over() -> bool:
            rec = self._recovery
            return rec is None or rec.generation != gen or w in rec.lost or w not in rec.reports

        def answer() -> dict[str, Any] | None:
            rec = self._recovery
            if rec is None or rec.generation != gen:
                return {"action": "stop", "reason": self._error or self._reason or "the recovery is over"}
            if w in rec.lost:
                return {"action": "stop", "reason": f"worker {w} was given up for lost"}
            if w not in rec.reports:
                return {"action": "break", "reason": rec.reason}
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
            rec.lost[w] = (f"worker {w} did not report within recovery_timeout_s={self.recovery_timeout_s:g}"
                           + (f" (nor within rendezvous_timeout_s={self.rendezvous_timeout_s:g} while it built groups)"
                              if self._building.get(w) is not None and self.rendezvous_timeout_s is not None else ""))
            self.lost.add(w)
            self._left.add(w)
            self._seen.pop(w, None)
            self._building.pop(w, None)
        survivors = sorted((w for w in cur.ranks if w not in rec.lost), key=cur.ranks.__getitem__)
        why = "lost " + ", ".join(sorted(rec.lost)) + " (" + "; ".join(rec.lost[w] for w in sorted(rec.lost)) + ")"
        if rec.rollback:
            why = f"{rec.reason}; " + (why if rec.lost else "every old member alive")
        if not rec.lost and not rec.rollback:  # every worker is alive: a bug or a network fault, which a retry would repeat
            self._fail_locked(f"{rec.reason}; every worker reported back alive, so no worker was lost: failing "
                              "rather than retrying the step")
            return
        if not survivors:
            self._fail_locked(f"{why}; no survivor to recover from")
            return
        # 1. the step every survivor can reach: a survivor that applied step r passed r's commit,
        #    so every rank had reduced r's gradients; the others hold them ready and apply them
        reps = {w: rec.reports[w] for w in survivors}
        r = max(int(x["applied"]) for x in reps.values())
        for w, x in reps.items():
            applied, ready = int(x["applied"]), x.get("ready")
            if x.get("dirty"):
                self._fail_locked(f"{why}; worker {w} broke inside an optimizer update (state at two steps); "
                                  "cannot recover")
                return
            if applied != r and not (applied == r - 1 and ready == r and x.get("local_apply")):
                self._fail_locked(f"{why}; worker {w} holds step {applied} (ready {ready}) while others applied "
                                  f"{r}; cannot recover a consistent state")
                return
        # 2. the layout: the same model-parallel split, as many replicas as the survivors fill
        old = Layout.parse(cur.layout)
        per = old.tp * old.pp
        members, lay, refusals = self._recovery_members(old, survivors)
        if lay is None:
            self._fail_locked(f"{why}; no layout fits the {len(survivors)} survivor(s): {'; '.join(refusals)}")
            return
        if self.max_steps is not None and r + 1 >= self.max_steps:
            self._recovery = None
            self._phase, self._reason = "finished", f"reached max_steps={self.max_steps} ({why})"
            self._cv.notify_all()
            return
        # 3. the step of the commit goes on record if a survivor reported it
        gen = cur.generation
        # a fresh number: a rolled-back rescale used cur + 1 already (stores and records are keyed by it)
        nxt = max([gen, *self._rescales]) + 1
        if not any(h.step == r for h in self._history[-3:]) and (parts := self._reports.pop((gen, r), None)):
            losses = [float(x["loss"]) for x in parts.values() if x.get("loss") is not None and math.isfinite(x["loss"])]
            step_rec = StepRecord(r, gen, cur.layout, losses[0] if losses else None,
                                  max(int(x.get("tokens", 0)) for x in parts.values()),
                                  max(float(x.get("seconds", 0.0)) for x in parts.values()))
            self._history.append(step_rec)
            self.metrics.record_step(step_rec.step, step_rec.loss, step_rec.tokens, step_rec.seconds)
        d = Directive(
            job=self.job, generation=nxt, layout=str(lay), workers=tuple(members), remap=True,
            old_layout=cur.layout, old_ranks={w: cur.ranks[w] for w in survivors}, switch_step=r + 1,
            store_host=self.advertise_host, store_port=self.store_port, join_timeout_s=self.join_timeout_s,
            commit_step=r, give_up_checks=self.shrink_gives_up_step,
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

    def _recovery_members(self, old: Layout, survivors: list[str]) -> tuple[list[str], Layout | None, list[str]]:
        """The most replicas the survivors fill whose layout the validator accepts; intact replicas first."""
        cur = self._current
        assert cur is not None
        per = old.tp * old.pp
        by_replica: dict[int, list[str]] = {}
        for w in survivors:
            by_replica.setdefault(old.coords(cur.ranks[w])[1], []).append(w)
        ordered = [w for _, ws in sorted(by_replica.items(), key=lambda kv: (len(kv[1]) < per, kv[0])) for w in ws]
        refusals: list[str] = []
        for dp in range(len(survivors) // per, 0, -1):
            lay = Layout(old.tp, old.pp, dp, vpp=old.vpp)
            members = ordered[:per * dp]
            try:
                if self.validator is not None:
                    self.validator(lay, members)
                gb, mb = self.config.get("global_batch"), int(self.config.get("micro_batch") or 1)
                if gb is not None and int(gb) % (dp * mb):
                    raise SpecError(f"global_batch={gb} does not split into dp={dp} x micro_batch={mb}")
            except SpecError as e:
                refusals.append(f"{lay}: {e}")
                continue
            return members, lay, refusals
        return [], None, refusals or [f"fewer than tp*pp={per} survivors"]

    def _h_exit(self, b: dict[str, Any]) -> dict[str, Any]:
        """A worker exits on purpose (stop, finish, abandoned joiner): stop watching it."""
        w = str(b["worker"])
        self._left.add(w)
        self._seen.pop(w, None)
        self._building.pop(w, None)
        if self._phase == "stopping" and self._current and set(self._current.ranks) <= self._left:
            self._phase = "stopped"
            self._cv.notify_all()
        return {}

    def _h_status(self, b: dict[str, Any]) -> dict[str, Any]:
        return self._status_locked().to_json()

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
                quiet = 2.5 * self.heartbeat_interval_s
                for w in [w for w in cur.ranks if w not in rec.lost and w not in rec.reports]:
                    if now - self._seen.get(w, now) > quiet:
                        self._lost_locked(w, f"worker {w} silent for {now - self._seen[w]:.1f} s during a recovery "
                                             f"(> {quiet:g} s: {2.5:g} heartbeats)")
            if (rec is not None and not rec.posted and now - rec.started_at > self.recovery_timeout_s
                    and not self._in_rendezvous_locked(rec, cur, now)):
                self._maybe_post_recovery_locked(timed_out=True)

    def _in_rendezvous_locked(self, rec: _Recovery, cur: _Gen | None, now: float) -> bool:
        """A silent survivor still beats and builds groups: it is blocked in gloo's rendezvous with a
        lost peer (lost between the roll call and its own part of it) and reports once the
        rendezvous times out; wait for it up to ``rendezvous_timeout_s`` (+ the recovery timeout)."""
        if self.rendezvous_timeout_s is None or cur is None:
            return False
        if now - rec.started_at > self.rendezvous_timeout_s + self.recovery_timeout_s:
            return False
        quiet = 2.5 * self.heartbeat_interval_s
        return any(self._building.get(w) is not None and now - self._seen.get(w, float("-inf")) <= quiet
                   for w in cur.ranks if w not in rec.lost and w not in rec.reports)

    def _check_deadline_locked(self) -> None:
        p = self._pending
        if p is None or p.decision is not None:
            return
        waited = self._clock() - p.issued_at
        if waited <= p.directive.join_timeout_s:
            return
        missing = sorted(set(p.directive.members) - set(p.arrived))
        joiners = [m for m in missing if m in p.directive.joiners]
        who = ", ".join(missing)
        what = "joiner(s)" if joiners and len(joiners) == len(missing) else "member(s)"
        self._abandon_locked(f"{what} {who} did not arrive within join_timeout_s={p.directive.join_timeout_s:g}; "
                             "nothing moved, the job continues on its old layout")

    def _check_heartbeats_locked(self) -> None:
        if self._phase in ("failed", "stopped", "stopping", "finished"):
            return
        now = self._clock()
        watched: set[str] = set(self._current.ranks) if self._current else set()
        if self._pending is not None and self._pending.decision == "go":
            watched |= set(self._pending.directive.members)
        for w in sorted(watched - self._left):
            last = self._seen.get(w)
            if last is not None and now - last > self.heartbeat_timeout_s:
                step = self._history[-1].step if self._history else -1
                self._lost_locked(w, f"worker {w} lost: no heartbeat for {now - last:.1f} s "
                                     f"(heartbeat_timeout_s={self.heartbeat_timeout_s:g}; process died or hung; "
                                     f"last completed step {step})")
                return


_ROUTES: dict[str, Callable[[Coordinator, dict[str, Any]], dict[str, Any]]] = {
    f"{API}/register": Coordinator._h_register,
    f"{API}/heartbeat": Coordinator._h_heartbeat,
    f"{API}/poll": Coordinator._h_poll,
    f"{API}/step": Coordinator._h_step,
    f"{API}/arrive": Coordinator._h_arrive,
    f"{API}/result": Coordinator._h_result,
    f"{API}/exchanged": Coordinator._h_exchanged,
    f"{API}/fail": Coordinator._h_fail,
    f"{API}/broken": Coordinator._h_broken,
    f"{API}/exit": Coordinator._h_exit,
    f"{API}/status": Coordinator._h_status,
}


def _keeps_work(old: Layout, new: Layout) -> bool:
    """Whether ``new`` can finish a step ``old`` gave up from its kept work (the agent decides for
    good with the plan's ranks): one pipeline stage on both sides and the same TP split."""
    return old.pp == new.pp == 1 and old.tp == new.tp and old.ep == new.ep == 1


def _check_members(layout: Layout, members: list[str]) -> None:
    if len(members) != layout.world_size:
        raise SpecError(f"layout {layout} needs {layout.world_size} workers (tp*pp*dp = {layout.tp}*{layout.pp}*"
                        f"{layout.dp}), got {len(members)}: {members}")
    dup = sorted({m for m in members if members.count(m) > 1})
    if dup:
        raise SpecError(f"workers listed twice: {dup}; every worker holds one rank")
    if any(not m for m in members):
        raise SpecError("worker ids must be non-empty strings")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a worker killed in the middle of a request resets its connection: the launcher and the
        # heartbeat report the loss; a traceback on stderr would only alarm
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


def _make_handler(coord: Coordinator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The reply goes out as two writes (headers, body); with Nagle on, the body waits for the
        # client's delayed ACK: +40 ms on every request (every training step, every meeting).
        disable_nagle_algorithm = True
        timeout = 300  # an idle kept-alive connection is dropped after this (its client reconnects)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            return

        def _reply(self, code: int, payload: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _authorized(self) -> bool:
            """The job's secret as a bearer token; else 401, and the connection is closed (an unread body)."""
            if hmac.compare_digest(self.headers.get("Authorization", "").encode(), coord._auth):
                return True
            self.close_connection = True
            self._reply(401, b'{"error": "unauthorized: requests to a job\'s coordinator carry its secret as '
                             b'Authorization: Bearer (workers get it as ELASTIC_JOB_SECRET)"}')
            return False

        def _gone(self) -> bool:
            """After ``stop()``: answer nothing on a kept-alive connection, as a closed port would."""
            if coord._closing.is_set():
                self.close_connection = True
                return True
            return False

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self._gone():
                return
            if self.path == "/healthz":  # liveness only: nothing about the job
                self._reply(200, b'{"ok": true}')
                return
            if not self._authorized():
                return
            if self.path == "/metrics":
                self._reply(200, generate_latest(coord.metrics.registry), "text/plain; version=0.0.4")
            elif self.path == f"{API}/status":
                self._reply(200, json.dumps(coord.handle(f"{API}/status", {})).encode())
            else:
                self._reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self._gone() or not self._authorized():
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"{}")
                out = coord.handle(self.path, body)
            except KeyError as e:
                self._reply(404 if str(e).strip("'") == self.path else 400,
                            json.dumps({"error": f"bad request: missing {e}"}).encode())
                return
            except Exception as e:  # noqa: BLE001 - any handler bug is a 500 with its message
                log.exception("rendezvous handler %s", self.path)
                self._reply(500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                return
            self._reply(200, json.dumps(out).encode())

    return Handler


# --------------------------------------------------------------------------------------------
# Client (used by the worker agent)
# --------------------------------------------------------------------------------------------


class RendezvousClient:
    """JSON calls to a :class:`Coordinator`. Retries connection errors for up to ``retry_s``.

    Keeps one HTTP/1.1 connection open across calls (a worker asks before every step: a new
    TCP connection, and a new server thread, per step costs more than the answer), and
    reconnects transparently when the coordinator closed it. Thread-safe (one call at a time).
    """

    def __init__(self, url: str, worker: str, *, timeout_s: float = 10.0, retry_s: float = 30.0,
                 secret: str | None = None) -> None:
        self.url = url.rstrip("/")
        # None: the job's secret from the environment, as the launcher hands it to workers
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
        self._headers = {"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {self.secret}"} if self.secret else {})}
        self.worker = worker
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise SpecError(f"rendezvous URL {url!r}: expected http://HOST:PORT")
        self._host, self._port = parts.hostname, parts.port or 80
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def call(self, route: str, **body: Any) -> dict[str, Any]:
        """POST ``body`` (plus this worker's id) to ``route``; a long poll (``wait_s``) extends the read timeout."""
        data = json.dumps({"worker": self.worker, **body}).encode()
        timeout = self.timeout_s + float(body.get("wait_s") or 0.0)
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        with self._lock:
            while True:
                try:
                    status, payload = self._post(f"{API}/{route}", data, timeout)
                except (ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
                    self._close()
                    if time.monotonic() + delay > deadline:
                        raise RendezvousError(f"coordinator {self.url} unreachable for {self.retry_s:g} s "
                                              f"({route}): {e}") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                if status != 200:
                    raise RendezvousError(f"coordinator {self.url} {route}: HTTP {status} {payload[:300]!r}")
                return json.loads(payload or b"{}")

    def _post(self, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        fresh = self._conn is None
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            try:
                self._conn.request("POST", path, body=data, headers=self._headers)
                r = self._conn.getresponse()
                return r.status, r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # a kept-alive connection the server closed meanwhile: one retry on a new one
                self._close()
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def status(self) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{API}/status", headers=self._headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())


def _bound_store(host: str) -> Any:
    """The job's TCPStore master listening on ``host`` only: torch's own would listen on every
    interface whatever host it is given, so it gets a socket bound here (and owns it from then)."""
    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


def sign(secret: str | None, payload: bytes) -> bytes:
    """``payload`` with an HMAC-SHA256 of it under the job's secret in front (for the store)."""
    if not secret:
        raise RendezvousError(f"no job secret to sign with: {SECRET_ENV} is not set")
    return hmac.new(secret.encode(), payload, hashlib.sha256).digest() + payload


def verify(secret: str | None, signed: bytes, what: str) -> bytes:
    """The payload of :func:`sign`'s output; RendezvousError when the signature does not match
    (written by someone without the secret: never unpickled)."""
    if not secret:
        raise RendezvousError(f"no job secret to check {what} with: {SECRET_ENV} is not set")
    mac, payload = signed[:32], signed[32:]
    if len(signed) < 32 or not hmac.compare_digest(mac, hmac.new(secret.encode(), payload, hashlib.sha256).digest()):
        raise RendezvousError(f"{what} in the job's store fails its signature check: not written by a member "
                              "of this job; refusing to read it")
    return payload
