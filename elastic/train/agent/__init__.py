"""The worker agent: one process per training worker, driving the engine step by step.

What it is for: a worker (Ray actor, Kubernetes pod, local process) has a stable id and
runs :meth:`WorkerAgent.run`. Before every step it asks the job's coordinator
(:mod:`elastic.train.rendezvous`) whether to go on, switch to a new layout generation, or
stop. A rescale directive is always applied at a step boundary:

1. The coordinator announces the directive one step early (``pending``); the agent plans
   the reshard (``plan_reshard``, a pure function every member computes identically) and
   ``prepare``s its receive buffers (per-kind dtypes: bf16 ``param``, fp32 master and
   moments) in a background thread while that step still runs. A planning or preparing
   error is not raised: it travels to the meeting point instead.
2. At the boundary (``switch``) every member of old union new meets at the coordinator
   with a digest of its plan (or its error), long-polling for the answer. The coordinator
   answers ``go`` (all there, same plan) or ``abandoned`` (a member could not plan or
   prepare, a joiner never came, plans differ); abandoned means nothing moved and the old
   engine simply continues on its intact state.
3. On ``go``: the bytes move over a group of all members -- the old default group when
   no worker joins (every member is already in it), else a transient gloo group (keys
   under ``<job>/g<generation>/reshard`` in the job's TCPStore) -- through ``execute``;
   then the old engine is closed, leavers report and leave (``os._exit``, or return from
   ``run()`` inside a Ray actor: ``AgentOptions.exit_on_leave``), and the new layout's
   members form the new default process group (``<job>/g<generation>/train``, layout rank
   = group rank; kept as it is when no rank changes) and build
   ``TrainEngine(cfg, layout, rank, state=new_state)``, continuing at the same step.
   Joiners arrive with no state and receive theirs. Old process groups are destroyed by a
   background thread (a used gloo group's destructor blocks ~20 ms).
   A *transactional* rescale (``Directive.rollback``: the coordinator sets it when the old
   layout is recoverable, replicas without ZeRO) differs in three ways: ``prepare`` recycles
   no dropped shard (the old state stays whole), each member reports ``exchanged`` when its
   part has moved and waits for the commit (every member exchanged) before it builds the
   new layout's groups and engine, and until then it keeps its old state. A peer lost
   before the commit breaks the exchange (or the commit answers ``rollback``): the member
   destroys its communicators, stands again as a member of the old generation on its
   kept state and reports like a broken step; the coordinator recovers the old generation
   from its survivors. A joiner has nothing to go back to and leaves.

4. A *hold* directive (the job is paused) makes the new members keepers: they receive the
   state like any joiner but build no engine and no process group (:class:`HeldState`),
   and wait (``hold``) until the next directive moves the state back onto GPU workers.
5. A *shrink that does not wait for the step in progress* (the coordinator's
   ``shrink_gives_up_step``; a generation posted with it on has ``Directive.give_up_checks``,
   and every engine of that generation checks before each micro-batch):
   the heartbeat (or the ``go`` of a member that had not begun it yet) says ``give_up``; the
   engine gives the step up at its next micro-batch, on every rank alike (``StepGivenUp``:
   nothing of the state changed), and the agent asks for the same step again with
   ``gave_up``: the coordinator switches the shrink there and the new layout computes the
   step on the same samples. The work of the micro-batches done is kept (``PartialStep``:
   their gradients summed over the replicas, one DP all-reduce, and their losses): when every
   member of the new layout holds the parameter boxes it held before (one pipeline stage, the
   same TP split and TP coordinate: a DP shrink), the new engine computes only the samples
   not done yet and adds the kept work; otherwise (or when a recovery intervenes) the step
   is redone whole. A step already past its last micro-batch's check completes, and the
   shrink switches after it as usual. A *grow* does the same (the coordinator's
   ``grow_gives_up_step``): one old member per TP coordinate adds the kept work and the new
   DP all-reduce hands it to the joiners, which learn the amended switch step and whether the
   work was kept from the ``go``.

Failures are reported, never hung on. A step whose collective breaks because a peer died
(gloo sees the closed socket, or times out after ``pg_timeout_s``) is *broken*, not failed
(``AgentOptions.recover``): the agent destroys its communicators at once (peers blocked on
it fail now), keeps its state and any reduced gradients, reports what it holds and waits;
the coordinator's recovery directive arrives as a ``switch`` with a ``commit_step`` the
agent first applies if it holds it ready. A survivor still computing its micro-batches learns
of the loss from its heartbeat (a long poll the coordinator answers with ``interrupt`` when the
recovery starts) and gives the step up at its next micro-batch (``StepInterrupted``: before the
commit nothing changed) instead of computing on to a collective with the dead peer; the step is
redone on the recovered layout. A step that runs out of memory (``torch.OutOfMemoryError``:
the CUDA allocator, or ``TrainConfig.memory_limit_bytes`` on CPU) is not a failure either: the
engine gives it up with its state intact (nothing applied, gradients dropped), the agent reports
it to the coordinator (``broken`` with ``out_of_memory``: layout, rank, step, what the rank held)
*before* it shuts its communicators down, so peers blocked on it break second and the
coordinator knows the cause; every member then waits, held, for the directive onto a layout that
fits (the controller's), which arrives as a ``switch`` like a recovery's and redoes the failed
step. Any other error is posted as the job's failure reason. A
coordinator unreachable for ``coordinator_timeout_s`` or a job the coordinator marked failed
makes the agent exit on its own (``watchdog``).

Checkpoints (``checkpoint`` settings from the coordinator): when the coordinator's ``go`` for a
step carries ``save`` (it decides, the same for every rank), the agent copies the pieces its
rank owns after that step and writes them in a background thread
(:mod:`elastic.train.checkpoint`); a write that fails is reported with the next step's
result (``checkpoint_error``), never fails the job. A first generation that the coordinator starts from a
checkpoint (``Directive.resume``) reads its boxes out of it instead of initialising them.

Fault injection (tests and chaos drills): the agent takes a :class:`Faults` (``faults=``; the
default :data:`NO_FAULTS` injects none) and asks it at its fault points: die at a point of a
rescale, slow checkpoint writes, a slow leaver, a step held while a file exists
(:mod:`elastic.train.agent.faults`; a worker process reads them from its environment at start).

What it must not do: choose layouts, compute maths (the engine does), or keep running
after its coordinator is gone.
"""

from elastic.train.agent.core import WorkerAgent
from elastic.train.agent.faults import NO_FAULTS, Faults
from elastic.train.agent.options import (
    FAILED_JOB_GRACE_S,
    AgentOptions,
    Engine,
    EngineBase,
    EngineFactory,
    State,
    config_dtype,
    config_json,
    config_kind_dtypes,
    config_kinds,
    config_model,
    default_engine_factory,
    train_config,
)
from elastic.train.agent.support import (
    HeldState,
    _early_alloc_budget,
    _hard_exit,
    _is_comm_error,
    _Phases,
    _same_tensors,
    _short,
    plan_digest,
)

__all__ = [
    "FAILED_JOB_GRACE_S",
    "NO_FAULTS",
    "AgentOptions",
    "Engine",
    "EngineBase",
    "EngineFactory",
    "Faults",
    "HeldState",
    "State",
    "WorkerAgent",
    "_Phases",
    "_early_alloc_budget",
    "_hard_exit",
    "_is_comm_error",
    "_same_tensors",
    "_short",
    "config_dtype",
    "config_json",
    "config_kind_dtypes",
    "config_kinds",
    "config_model",
    "default_engine_factory",
    "plan_digest",
    "train_config",
]
