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
   A step that ran out of memory (the failing worker's ``broken`` carries ``out_of_memory``,
   sent before its peers break on it) puts the job in ``recovering`` too, on any layout: nobody
   is lost, and retrying the layout would fail again, so once every member reported the job is
   *held* (status ``out_of_memory``, error ``OutOfMemory: ...``) until a directive onto another
   layout arrives (the controller's); that directive moves every member's kept state and redoes
   the failed step. Members whose states are not at one step (one broke inside its optimizer
   update) fail the job instead. A pause is refused while held.
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

Every request body is read into its typed request (:mod:`elastic.train.rendezvous.requests`, one
frozen dataclass per route) before a handler sees it: :meth:`Coordinator.handle` is that parse
followed by :meth:`Coordinator.receive`, which tests drive directly. A body that does not read is
refused with HTTP 400 naming the route and the field.

The decisions above are pure functions of the state the coordinator passes in and ``now``, with
no lock, clock or I/O inside: posting a directive (:mod:`~elastic.train.rendezvous.posting`, 1),
a rescale's meeting and the deadlines (:mod:`~elastic.train.rendezvous.meeting`, 2 and 4),
recovering from the survivors (:mod:`~elastic.train.rendezvous.recovery`, 4) and the save
schedule (:mod:`~elastic.train.rendezvous.saves`, 6). The coordinator reads its state under its
lock, calls them and applies what they return.

What it must not do: touch tensors, run collectives, or decide layouts (the controller
does; :meth:`Coordinator.directive` only validates and sequences them).
"""

from elastic.train.rendezvous.coordinator import Coordinator
from elastic.train.rendezvous.messages import (
    API,
    LONG_POLL_MAX_S,
    SECRET_ENV,
    CheckpointFailed,
    Directive,
    JobFailed,
    JobStatus,
    RendezvousError,
    RescaleCancelled,
    RescaleFailed,
    RescaleRecord,
    StepRecord,
)
from elastic.train.rendezvous.requests import BadRequest, Request, parse
from elastic.train.rendezvous.settings import CoordinatorSettings
from elastic.train.rendezvous.state import Validator
from elastic.train.rendezvous.wire import RendezvousClient, sign, verify

__all__ = [
    "API",
    "LONG_POLL_MAX_S",
    "SECRET_ENV",
    "BadRequest",
    "CheckpointFailed",
    "Coordinator",
    "CoordinatorSettings",
    "Directive",
    "JobFailed",
    "JobStatus",
    "RendezvousClient",
    "RendezvousError",
    "Request",
    "RescaleCancelled",
    "RescaleFailed",
    "RescaleRecord",
    "StepRecord",
    "Validator",
    "parse",
    "sign",
    "verify",
]
