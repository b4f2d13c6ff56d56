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
redone on the recovered layout. Any other error is posted as the job's failure reason. A
coordinator unreachable for ``coordinator_timeout_s`` or a job the coordinator marked failed
makes the agent exit on its own (``watchdog``).

Checkpoints (``checkpoint`` settings from the coordinator): when the coordinator's ``go`` for a
step carries ``save`` (it decides, the same for every rank), the agent copies the pieces its
rank owns after that step and writes them in a background thread
(:mod:`elastic.train.checkpoint`); a write that fails is reported with the next step's
result (``checkpoint_error``), never fails the job. A first generation that the coordinator starts from a
checkpoint (``Directive.resume``) reads its boxes out of it instead of initialising them.

What it must not do: choose layouts, compute maths (the engine does), or keep running
after its coordinator is gone.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elastic.model import Layout, ModelSpec, SpecError, load_model
from elastic.train import checkpoint
from elastic.train.groups import StepGivenUp
from elastic.train.rendezvous import Directive, RendezvousClient, RendezvousError

log = logging.getLogger(__name__)

State = dict[tuple[str, str], torch.Tensor]


class Engine(Protocol):
    """What the agent needs from a trainer (``elastic.train.engine.TrainEngine`` implements it)."""

    def state(self) -> State: ...

    def train_step(self, step: int) -> Any: ...  # StepResult(step, loss, tokens, seconds)

    def close(self) -> None: ...


EngineFactory = Callable[[dict[str, Any], Layout, int, "State | None"], Engine]
"""``(job config, layout, rank, state or None) -> Engine``; called with the layout's default group ready."""


def default_engine_factory(config: dict[str, Any], layout: Layout, rank: int, state: State | None, *,
                           timeout_s: float = 120.0) -> Engine:
    from elastic.train.engine import TrainEngine

    return TrainEngine(train_config(config), layout, rank, state=state,
                       timeout=datetime.timedelta(seconds=timeout_s))


# ---- the job config on the wire (JSON) <-> the engine's TrainConfig ------------------------

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def config_json(cfg: Any) -> dict[str, Any]:
    """A ``TrainConfig`` as the JSON the coordinator hands every worker (model by preset name when it is one);
    a user job's config (``elastic.train.userjob.UserJobConfig``) as its own JSON."""
    from elastic.model import MODEL_PRESETS

    if hasattr(cfg, "to_json"):
        return cfg.to_json()

    d = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    m: ModelSpec = d["model"]
    d["model"] = m.name if MODEL_PRESETS.get(m.name) == m else m.model_dump(mode="json")
    d["dtype"] = str(d["dtype"]).removeprefix("torch.")
    d["betas"] = list(d["betas"])
    return d


def train_config(config: dict[str, Any]) -> Any:
    """The job config (JSON from the coordinator) as the engine's ``TrainConfig``."""
    from elastic.train.engine import TrainConfig

    d = dict(config)
    d["model"] = config_model(config)
    d["dtype"] = config_dtype(config)
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    try:
        return TrainConfig(**d)
    except TypeError as e:
        raise SpecError(f"job config: {e}; the keys are TrainConfig's fields") from None


def config_model(config: dict[str, Any]) -> ModelSpec:
    m = config.get("model")
    if isinstance(m, ModelSpec):
        return m
    if isinstance(m, dict):
        return ModelSpec.from_mapping(m, source="job config 'model'")
    if not isinstance(m, str):
        raise SpecError("job config: 'model' must be a preset name, a model file path or a ModelSpec mapping")
    return load_model(m)


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    v = config.get("dtype", "float32")
    if isinstance(v, torch.dtype):
        return v
    name = str(v).removeprefix("torch.")
    if name not in _DTYPES:
        raise SpecError(f"job config: dtype={name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def config_kinds(config: dict[str, Any]) -> tuple[str, ...]:
    from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS

    return MIXED_KINDS if config_dtype(config) == torch.bfloat16 else FP32_KINDS


def config_kind_dtypes(config: dict[str, Any]) -> dict[str, torch.dtype]:
    """Kind -> dtype of the job's state tensors (bf16: bf16 ``param``, fp32 master and moments)."""
    return {k: train_config(config).kind_dtype(k) for k in config_kinds(config)}


_REASK_S = 0.005  # between two long polls that both came back "wait"

FAILED_JOB_GRACE_S = 3.0
"""A worker still running this long after its job failed exits on its own (see ``_heartbeat``)."""


@dataclass(frozen=True)
class AgentOptions:
    pg_timeout_s: float = 120.0  # a silent peer fails a collective after this long
    coordinator_timeout_s: float = 30.0  # exit when the coordinator is unreachable this long
    long_poll_s: float = 2.0  # joiners and the meeting point wait this long per request for an answer
    device: str = "cpu"
    verify_reshard: bool = False  # checksum every reshard message (slower; for tests)
    # A leaver ends its process with os._exit once its bytes have landed (no interpreter teardown
    # of GBs of tensors; the launcher sees the process go). False: run() returns instead, for
    # hosts that must end the process themselves (a Ray actor: os._exit there reads as a crash).
    exit_on_leave: bool = True
    # a collective that breaks because a peer died: report and wait for the coordinator's recovery
    # directive (it fails the job itself when no recovery is possible); False: fail at once
    recover: bool = True
    # the job's checkpoint directory as this worker sees it: what it holds is reported at register
    # (a coordinator that cannot see the directory starts the job there); "" = none
    checkpoint_dir: str = ""


@dataclass
class _Prep:
    """A reshard plan and the executor's prepared buffers for one directive."""

    directive: Directive
    plan: Any  # ReshardPlan, or None for the first generation
    prepared: Any  # execute.Prepared, or None
    digest: str
    plan_info: dict[str, Any]
    old_state: State
    error: str = ""  # planning or preparing failed: the rescale must be abandoned (nothing moved)
    waited: float = 0.0  # seconds the step loop spent on it at the switch (the rest was done in the background)
    ahead: float = 0.0  # seconds between beginning it in the background and the switch (0: prepared at the switch)
    deferred: str = ""  # begun beside a step, it would not fit next to it (GPU memory): prepare at the switch


class WorkerAgent:
    """Runs one worker until the job stops, this worker leaves, or something fails."""

    def __init__(self, worker: str, url: str, *, engine_factory: EngineFactory | None = None,
                 options: AgentOptions | None = None) -> None:
        self.worker = worker
        self.opts = options or AgentOptions()
        self.client = RendezvousClient(url, worker, retry_s=self.opts.coordinator_timeout_s)
        self.factory = engine_factory or functools.partial(default_engine_factory, timeout_s=self.opts.pg_timeout_s)
        self.config: dict[str, Any] = {}
        self.engine: Engine | None = None
        self.generation = 0
        self.layout: Layout | None = None
        self.rank = -1  # in self.layout
        self._store: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prepare-{worker}")
        self._reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reaper-{worker}")
        # periodic checkpoints (elastic.train.checkpoint), settings from the coordinator at register
        self._ckpt: checkpoint.CheckpointSettings | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"checkpoint-{worker}")
        self._writing: Future[Any] | None = None
        self._writing_step = -1
        self._written = (-1, -1)  # (step, generation) of this worker's last checkpoint write that completed
        self._write_error = ""  # why the last write failed, until reported with a step result
        self._snap: dict[Any, Any] | None = None  # host buffers of the last snapshot, refilled by the next
        self._snap_ready: Future[dict[Any, Any]] | None = None  # buffers for a new layout, being allocated
        self._job = ""
        self._graveyard: list[Any] = []  # shut-down groups, destroyed after the next step (_bury)
        self._prep: Future[_Prep] | None = None
        self._prep_d: Directive | None = None  # the directive the early preparation is for
        self._prep_at = 0.0  # when it was begun (monotonic)
        # the step loop and the heartbeat thread (told of a directive mid-step) both begin one;
        # _taken: the directive whose transition took its preparation (none is begun for it after)
        self._prep_lock = threading.Lock()
        self._taken: Directive | None = None
        self._seen_post = 0  # the last posted directive a heartbeat told us of (Coordinator ``pending_seq``)
        # the generation whose groups this worker is building (its heartbeats say so): blocked in
        # gloo's rendezvous with a lost peer it is alive, and the coordinator waits for its report
        self._building: int | None = None
        self._stop = threading.Event()
        self._job_failed = ""
        self._applied = -1  # the last step whose optimizer update this worker applied
        self._broken = False  # a peer failed: communicators shut down, waiting for the recovery directive
        # engine and generation change together under it: the heartbeat thread interrupts the
        # engine of the generation the coordinator named, never a newer one
        self._engine_lock = threading.Lock()
        self._interrupted_gen = -1  # the generation we were last told to interrupt (logged once)
        self._given_up: tuple[int, int] | None = None  # (generation, step) last given up: asked once
        self._gave_up: dict[str, Any] | None = None  # reported with the next step request
        self._carry: Any = None  # a given-up step's kept work (engine.PartialStep) for the next layout
        # a group's roll call (elastic.train.abortable) asks the coordinator on a line of its own
        # whether the generation it is for was given up (a peer lost: recovered or rolled back)
        self._asker: RendezvousClient | None = None
        # fault injection for tests and chaos drills: "<worker>:<generation>:<where>" makes that worker
        # die (os._exit, as a lost node) in that rescale: "group" before it joins the reshard group,
        # "rendezvous" after that group's roll call, before its own part of gloo's rendezvous,
        # "exchange" inside the exchange, "commit" just after its part of it, "init_pg" after the commit
        # before it joins the new default group, "engine" once its new engine is built (its peers are
        # then in the first step)
        self._fault = os.environ.get("ELASTIC_FAULT_EXCHANGE", "")
        # "<worker>:<seconds>": that worker's checkpoint writes take that much longer (a slow disk)
        slow = os.environ.get("ELASTIC_FAULT_SLOW_CHECKPOINT", "")
        self._slow_write = float(slow.split(":", 1)[1]) if slow.startswith(f"{worker}:") else 0.0
        # "<seconds>": a leaver whose bytes have landed waits that long before it goes (a node slow to
        # let its GPU go); the crash test lands a controller's kill while a shrink waits for its leaver
        self._slow_leave = float(os.environ.get("ELASTIC_FAULT_SLOW_LEAVE", "") or 0.0)

    # ---- entry ----------------------------------------------------------------------------
    def run(self) -> int:
        """1. preload, 2. register, 3. heartbeat, 4. wait for a generation that includes us, 5. train.

        Returns an exit code."""
        _preload(self.factory)  # before registering: the launcher waits for this, the rescale pause does not
        try:
            seen = None
            if self.opts.checkpoint_dir:
                ref = checkpoint.latest(self.opts.checkpoint_dir)
                seen = ref.to_json() if ref else None
            reg = self.client.call("register", pid=os.getpid(), host=socket.gethostname(), checkpoint_latest=seen)
        except RendezvousError as e:
            log.error("worker %s: %s", self.worker, e)
            return 3
        self.config = dict(reg.get("config") or {})
        self._ckpt = checkpoint.CheckpointSettings.from_json(reg.get("checkpoint"))
        self._job = str(reg.get("job", ""))
        beat = threading.Thread(target=self._heartbeat, args=(float(reg.get("heartbeat_interval_s", 1.0)),),
                                name=f"heartbeat-{self.worker}", daemon=True)
        beat.start()
        try:
            return self._main()
        except RendezvousError as e:
            log.error("worker %s lost its coordinator: %s", self.worker, e)
            return 3
        except SpecError as e:  # bad configuration: the job cannot run as configured
            log.error("worker %s: %s", self.worker, e)
            self._report_fail(f"configuration: {e}")
            return 2
        except Exception as e:  # noqa: BLE001 - every failure becomes the job's reason, then an exit
            reason = f"{type(e).__name__}: {_short(e)}"
            log.exception("worker %s failed", self.worker)
            self._report_fail(reason)
            return 1
        finally:
            self._stop.set()
            self._pool.shutdown(wait=False)
            self._reaper.shutdown(wait=False)
            self._writer.shutdown(wait=True)  # a checkpoint being written is finished (the launcher bounds it)
            self.client.close()

    def _main(self) -> int:
        d = self._wait_for_directive()
        if d is None:
            return 0
        step = self._transition(d, self._prepare_now(d))
        if step is None:
            return 0
        return self._train(step)

    def _wait_for_directive(self) -> Directive | None:
        """A worker with no generation yet polls until a directive lists it (or the job ends)."""
        while True:
            resp = self.client.call("poll", wait_s=self.opts.long_poll_s)  # long poll: answered on the event
            if resp["action"] == "join":
                return Directive.from_json(resp["directive"])
            if resp["action"] == "exit":
                log.info("worker %s: exiting without joining (%s)", self.worker, resp.get("reason"))
                self._exit_notice()
                return None
            time.sleep(_REASK_S)  # never spin on a coordinator that answers "wait" at once (shutting down)

    # ---- step loop ----------------------------------------------------------------------------
    def _train(self, step: int) -> int:
        last: dict[str, Any] | None = None
        while True:
            held = isinstance(self.engine, HeldState) or self._broken
            gave_up, self._gave_up = self._gave_up, None
            asked_at = time.monotonic()
            resp = self.client.call("step", generation=self.generation, step=step, result=last,
                                    **({"wait_s": self.opts.long_poll_s} if held else {}),
                                    **({"gave_up": gave_up} if gave_up else {}))
            action = resp["action"]
            log.debug("worker %s gen %d step %d: %s", self.worker, self.generation, step, action)
            if action == "go":
                if resp.get("pending"):
                    self._prepare_early(Directive.from_json(resp["pending"]))
                else:
                    self._drop_stale_prep(asked_at)
                save = bool(resp.get("save"))
                assert self.engine is not None
                if resp.get("give_up") is not None:  # asked to give this step up before it began
                    self._give_up(self.generation, int(resp["give_up"]))
                try:
                    result = self.engine.train_step(step)
                except StepGivenUp as e:
                    # every rank gave it up at the same micro-batch: ask for the same step again, and
                    # the coordinator switches the pending shrink there (nothing of the state changed)
                    log.info("worker %s: %s", self.worker, e)
                    self._carry = getattr(e, "carry", None)
                    last, self._gave_up = None, {"step": step, "seconds": round(e.seconds, 4), "micro": e.micro,
                                                 "kept": self._carry is not None}
                    continue
                except Exception as e:
                    if not (self.opts.recover and _is_comm_error(e) and hasattr(self.engine, "recovery_state")):
                        raise
                    last = None
                    self._break(step, f"{type(e).__name__}: {_short(e, 160)}")
                    continue
                last = _result_json(result)
                if self._ckpt is not None:
                    last["checkpoint"] = list(self._written)
                    if self._write_error:
                        last["checkpoint_error"], self._write_error = self._write_error, ""
                self._applied = step
                step += 1
                if save:
                    self._checkpoint(step)
                self._bury()  # the first step after a rescale is done: its old groups may go now
            elif action == "break" and not self._broken:
                last = None  # a peer was lost while we were between steps: report what we hold, then wait
                self._break(step, f"told to break: {resp.get('reason', '')}")
            elif action == "switch":
                last = None
                d = Directive.from_json(resp["directive"])
                if d.commit_step is not None and self._applied < d.commit_step:
                    # recovery: a survivor passed this step's commit, so our reduced gradients are final
                    self.engine.apply_ready(d.commit_step)  # type: ignore[union-attr]
                    self._applied = d.commit_step
                if self._broken:
                    self._prep, self._broken = None, False
                    nxt = self._transition(d, self._prepare_now(d))
                else:
                    nxt = self._transition(d, self._take_prep(d))
                if nxt is None:
                    return 0  # a leaver (normally gone already through os._exit)
                step = nxt
            elif action in ("hold", "break") and held:
                # a keeper (its job is paused at ``step``) or a survivor waiting for its recovery
                # directive; the coordinator long-polled already
                last = None
                self._bury()  # a keeper: the reshard group that brought the state in
                time.sleep(_REASK_S)
            elif action in ("stop", "finish"):
                log.info("worker %s: %s at step %d (%s)", self.worker, action, step, resp.get("reason", ""))
                if resp.get("save") and not self._broken:
                    self._checkpoint(step, final=True)
                self._close_engine()
                self._exit_notice()
                return 0
            else:
                raise RendezvousError(f"coordinator answered unknown action {action!r}")

    # ---- rescale ------------------------------------------------------------------------------
    def _prepare_early(self, d: Directive, *, told_on: int | None = None) -> None:
        """Plan and allocate for ``d`` in the background while the current step runs.

        From the step loop (a ``go`` that carries the pending directive: with a lookahead) or from
        the heartbeat thread (``told_on``: the generation the beat was sent from), which hears of a
        directive the moment it is posted; with no lookahead its switch is the next boundary, and
        what is not prepared by then is prepared inside the pause. ``prepare`` reads only shapes,
        so it runs beside the step; at the switch the step loop waits for what is left of it.
        """
        with self._engine_lock:  # the engine of the generation the directive rescales, never a newer one
            if told_on is not None and (told_on != self.generation or self._broken or self.engine is None):
                return
            with self._prep_lock:
                # the whole directive, not its number: a rescale abandoned before its switch step leaves
                # its number to the next try, which may name other workers or another layout
                if _same_rescale(self._taken, d) or (self._prep is not None and _same_rescale(self._prep_d, d)):
                    return
                self._prep_d, self._prep_at = d, time.monotonic()
                self._prep = self._pool.submit(self._plan_and_prepare, d, self.engine.state() if self.engine else {},
                                               early=True)

    def _drop_stale_prep(self, asked_at: float) -> None:
        """No rescale is pending (the coordinator said so after ``asked_at``): buffers prepared for
        one that was abandoned before its switch are let go rather than held until the next."""
        with self._prep_lock:
            if self._prep is not None and self._prep_at < asked_at:
                self._prep = self._prep_d = None

    def _take_prep(self, d: Directive) -> _Prep:
        """The early preparation if it is for ``d`` and still matches the engine's tensors, else prepare
        now. ``waited`` on the result: the seconds this took (inside the pause)."""
        t0 = time.perf_counter()
        with self._prep_lock:
            fut, self._prep, prep_d, prep_at, self._taken = self._prep, None, self._prep_d, self._prep_at, d
        prep: _Prep | None = None
        if fut is not None and _same_rescale(prep_d, d):
            ahead = time.monotonic() - prep_at
            prep = fut.result()
            prep.ahead = ahead
            now = self.engine.state() if self.engine is not None else {}
            if prep.deferred:
                log.info("worker %s: preparing generation %d at the switch: %s", self.worker, d.generation,
                         prep.deferred)
                prep = None
            elif not (prep.error or _same_tensors(prep.old_state, now)):
                log.warning("worker %s: engine replaced its state tensors after prepare; preparing again", self.worker)
                prep = None
        if prep is None:
            prep = self._prepare_now(d)
        prep.waited = time.perf_counter() - t0
        return prep

    def _prepare_now(self, d: Directive) -> _Prep:
        t0 = time.perf_counter()
        with self._prep_lock:
            self._taken = d
        state = self.engine.state() if self.engine is not None else {}
        prep = self._plan_and_prepare(d, state)
        prep.waited = time.perf_counter() - t0
        return prep

    def _plan_and_prepare(self, d: Directive, old_state: State, *, early: bool = False) -> _Prep:
        """Plan and prepare; a failure here is reported at the meeting (the rescale is abandoned), never raised.

        Nothing has moved yet and ``prepare`` never writes the old state, so whatever went wrong
        (an impossible plan, a staging cap, memory for the receive buffers), the job can go on
        on its old layout. ``early``: beside a running step. On a GPU the buffers must then fit in
        memory nobody has reserved (the step's peak may need its allocator's cache); if they do
        not, or allocating them fails, the result is ``deferred`` and the switch prepares again
        after the step, when its activations are gone -- never an abandoned rescale.
        """
        if not d.old_ranks:  # the first generation: nothing to move, everyone starts fresh
            return _Prep(d, None, None, "", {"new_ranks": {w: i for i, w in enumerate(d.workers)}}, {})
        from elastic.reshard.execute import AllocBudgetExceeded

        try:
            budget = _early_alloc_budget(self.opts.device) if early else None
            return self._plan_and_prepare_or_raise(d, old_state, max_alloc_bytes=budget)
        except Exception as e:  # noqa: BLE001 - any error before a byte moves abandons instead of failing
            if early and isinstance(e, (AllocBudgetExceeded, torch.OutOfMemoryError)):
                return _Prep(d, None, None, "", {}, old_state, deferred=f"{type(e).__name__}: {_short(e)}")
            log.warning("worker %s: cannot reshard to generation %d (%s)", self.worker, d.generation, e,
                        exc_info=not isinstance(e, SpecError))
            return _Prep(d, None, None, "", {}, old_state, error=f"{type(e).__name__}: {_short(e)}")

    def _plan_and_prepare_or_raise(self, d: Directive, old_state: State, *,
                                   max_alloc_bytes: int | None = None) -> _Prep:
        from elastic.reshard.execute import prepare
        from elastic.reshard.plan import plan_reshard

        model = config_model(self.config)
        dtype = config_dtype(self.config)
        kinds = config_kinds(self.config)
        t0 = time.perf_counter()
        plan = plan_reshard(model, Layout.parse(d.old_layout or ""), d.old_ranks, Layout.parse(d.layout),
                            list(d.workers), kinds=kinds,
                            bytes_per_element=torch.empty((), dtype=dtype).element_size(), remap=d.remap)
        plan_s = time.perf_counter() - t0
        # a transactional rescale keeps the old state whole until every member exchanged: no new
        # tensor may live in the memory of an old shard that is dropped
        prepared = prepare(plan, self.worker, dict(old_state), device=self.opts.device,
                           dtypes=config_kind_dtypes(self.config), recycle_dropped=not d.rollback,
                           max_alloc_bytes=max_alloc_bytes)
        info = {"new_ranks": dict(plan.new_ranks), "planned_bytes": plan.bytes_planned,
                "lower_bound_bytes": plan.bytes_lower_bound, "plan_seconds": plan_s}
        return _Prep(d, plan, prepared, plan_digest(plan), info, old_state)

    def _transition(self, d: Directive, prep: _Prep) -> int | None:
        """Meet, move the bytes, rebuild. Returns the step to continue at, or None when this worker leaves.

        Per-phase seconds go to the coordinator with the result (``RescaleRecord.worker_stats``):
        meet, group (the reshard group), exchange, close (old engine), init_pg (the new default
        group: when a worker joins it is built during group + exchange, and this is only the
        wait beyond them), engine (the new engine); ``execute_seconds`` = group + exchange,
        ``rebuild_seconds`` = close + init_pg + engine.
        """
        clock = _Phases()
        # what the step loop spent on the plan and buffers at the switch (the rest was done beside
        # the step before it); for an old member inside the pause, for a joiner before it
        clock.seconds["prepare_wait"] = prep.waited
        carry, self._carry = self._carry, None  # a given-up step's work: only this transition may use it
        # 1. meet: the coordinator decides go / abandoned before any byte moves
        decision, reason, told = self._meet(d, prep)
        clock.mark("meet")
        if decision == "go" and told.get("switch_step") not in (None, d.switch_step):
            # a joiner: the members gave the step in progress up, and the switch moved there
            d = dataclasses.replace(d, switch_step=int(told["switch_step"]))
        if decision != "go":
            log.warning("worker %s: rescale to generation %d abandoned: %s", self.worker, d.generation, reason)
            if self.engine is None:  # a joiner: nothing to continue
                self._exit_notice()
                return None
            return d.switch_step
        new_ranks = {str(k): int(v) for k, v in prep.plan_info["new_ranks"].items()}
        layout, rank = Layout.parse(d.layout), new_ranks.get(self.worker)
        keep_default = self._keeps_default_group(d, new_ranks)
        old_group = prep.prepared is not None and self._old_group_is_members(d, prep)
        # transactional (Directive.rollback): the old state stays whole, and the new layout is not
        # built, until every member has exchanged its part; a loss before that rolls the job back
        txn = d.rollback and prep.prepared is not None
        snapshot = (_Snapshot(self.generation, self.layout, prep.old_state, self._applied)
                    if txn and self.engine is not None else None)
        new_pg: Future[None] | None = None
        if prep.prepared is not None and not old_group:
            # 2a. a transient group will carry the bytes (someone joins): the old groups are idle
            # already, so drop them now and build the new default group while the bytes move
            # (keepers of a held generation need none: they run no collective; a transactional
            # rescale builds it after the commit: a member lost meanwhile would hang its rendezvous)
            self._close_engine()
            clock.mark("close")
            if rank is not None and not d.hold and not txn:
                new_pg = self._pool.submit(self._init_default_group, d, layout, rank, own_store=True)
        # 2. move the bytes over a group of old union new (the old default group when it is exactly that)
        broke = ""
        try:
            new_state, stats = self._execute(d, prep, clock, old_group=old_group)
        except Exception as e:
            if not (txn and self.opts.recover and _is_comm_error(e)):
                raise
            broke = f"{type(e).__name__}: {_short(e, 160)}"
        if broke:  # outside the except: the traceback no longer holds the broken groups
            return self._exchange_broke(d, snapshot, broke)
        if txn:
            # 2b. the commit: every member has its new bytes (and still its old ones)
            self._maybe_die(d, "commit")
            verdict, why = self._exchanged(d)
            clock.mark("commit")
            if verdict == "rollback":
                new_state = {}
                return self._exchange_broke(d, snapshot, why, rolled_back=True)
            if verdict != "go":  # the job failed or is stopping meanwhile
                log.info("worker %s: stop at the commit of generation %d (%s)", self.worker, d.generation, why)
                self._close_engine()
                self._exit_notice()
                return None
            snapshot = None
        # 3. the old engine and its groups go (if still there)
        if self.engine is not None or (dist.is_initialized() and new_pg is None):
            self._close_engine(keep_default=keep_default)
        clock.mark("close")
        if rank is None:
            self._report_result(d, {**stats, **clock.report(), "prepare_ahead_seconds": prep.ahead})
            return self._leave()
        # 4. the new layout's default group (or what is left of building it) and engine
        self._building = d.generation
        try:
            if new_pg is not None:
                new_pg.result()
            elif not keep_default and not d.hold:
                self._maybe_die(d, "init_pg")
                self._init_default_group(d, layout, rank)
            clock.mark("init_pg")
            if d.hold:  # a keeper: hold the state as received, build nothing, step nothing
                engine: Engine = HeldState(new_state)
            else:
                from elastic.train.abortable import abortable_groups

                # the engine's own groups (TP, DP, PP) hold a roll call each, given up on a lost peer
                with abortable_groups(self._aborter(d), self.opts.pg_timeout_s,
                                      before=lambda: self._maybe_die(d, "groups")):
                    engine = self.factory(self.config, layout, rank,
                                          new_state if d.old_ranks else self._initial_state(d, layout, rank))
                if d.give_up_checks and hasattr(engine, "give_up_checks"):
                    engine.give_up_checks = True  # type: ignore[attr-defined]
                    if hasattr(engine, "keep_given_up"):
                        engine.keep_given_up = True  # type: ignore[attr-defined]
                finish = self._kept_step(d, told, carry, new_ranks)
                if finish is not None and hasattr(engine, "resume_partial"):
                    engine.resume_partial(finish[0], contribute=finish[1])  # type: ignore[attr-defined]
                    stats = {**stats, "kept_micro_batches": finish[0].micro}
        except Exception as e:
            # past a transactional commit the new state is whole on every member: a peer lost while
            # the groups are built is recovered from the new generation, like one lost in a step
            if not (txn and self.opts.recover and _is_comm_error(e)):
                raise
            broke = f"{type(e).__name__}: {_short(e, 160)}"
        finally:
            self._building = None
        if broke:
            return self._build_broke(d, layout, new_state, broke)
        with self._engine_lock:
            self.engine, self.generation, self.layout, self.rank = engine, d.generation, layout, rank
        self._applied = d.switch_step - 1
        clock.mark("engine")
        self._maybe_die(d, "engine")
        self._report_result(d, {**stats, "rank": rank, **clock.report(), "prepare_ahead_seconds": prep.ahead})
        self._prepare_snapshot_buffers()
        return d.switch_step

    # ---- checkpoints ----------------------------------------------------------------------------
    def _initial_state(self, d: Directive, layout: Layout, rank: int) -> State | None:
        """A first generation's state: read out of the checkpoint the coordinator starts from (any saved
        layout), or None (the engine initialises it from the seed)."""
        if not d.resume:
            return None
        ref = checkpoint.CheckpointRef(d.resume, d.switch_step, d.resume_layout or "")
        t0 = time.perf_counter()
        state = checkpoint.load_rank(ref, config_model(self.config), layout, rank, config_kind_dtypes(self.config),
                                     device=self.opts.device)
        log.info("worker %s: rank %d of %s read from %s (saved on %s) in %.2f s", self.worker, rank, layout,
                 d.resume, d.resume_layout, time.perf_counter() - t0)
        return state

    def _prepare_snapshot_buffers(self) -> None:
        """On a new layout (or the first), allocate and touch this rank's host buffers for its next
        checkpoint in the background: that checkpoint's copy, which the step waits for, then
        refills warm memory instead of faulting fresh pages in (0.2-5 s for gpt-100m here)."""
        if self._ckpt is None or self.layout is None or self.engine is None or isinstance(self.engine, HeldState):
            return
        from elastic.reshard.spec import sharding_spec

        spec = sharding_spec(config_model(self.config), self.layout, config_kinds(self.config))
        shapes = checkpoint.buffer_shapes(spec, self.rank, self.engine.state())
        if self._snap is not None and {k: (tuple(v.shape), v.dtype) for k, v in self._snap.items()} == {
                k: (v[0], v[1]) for k, v in shapes.items()}:
            return  # the same boxes (a rescale that left this rank's part alone): refilled as they are
        self._snap = None  # the old layout's buffers go (a write still running holds its own)
        self._snap_ready = self._writer.submit(checkpoint.host_buffers, shapes)

    def _checkpoint(self, step: int, *, final: bool = False) -> None:
        """Save the state at ``step`` (the coordinator said so): copy the pieces this rank owns now
        (the next step changes the tensors in place), write them in the background.

        The coordinator begins no checkpoint before the last one is complete, so a write still
        running here is rare (its completion not reported yet); it is waited for, as every rank
        must write its part. ``final`` (the job stops or finishes at ``step``): after the last
        write, and waited for (the launcher bounds it by its exit timeout; cut short, the
        checkpoint is incomplete and the previous one stands)."""
        c = self._ckpt
        if c is None or self.layout is None or self.engine is None or isinstance(self.engine, HeldState):
            return
        if self._writing is not None and not self._writing.done():
            log.info("worker %s: the checkpoint at step %d waits for the write of step %d", self.worker, step,
                     self._writing_step)
        if self._writing is not None:
            self._writing.result()
        if final and self._writing_step == step:
            return
        if self._snap_ready is not None:  # buffers allocated for this layout in the background
            try:
                self._snap = self._snap_ready.result()
            except Exception:  # noqa: BLE001 - out of host memory there: snapshot allocates, or fails itself
                log.exception("worker %s: preparing the checkpoint's host buffers failed", self.worker)
            self._snap_ready = None
        from elastic.reshard.spec import sharding_spec

        assert self.engine is not None
        spec = sharding_spec(config_model(self.config), self.layout, config_kinds(self.config))
        # the last snapshot's buffers are refilled (none is being written here: see above)
        pieces = checkpoint.snapshot(spec, self.rank, self.engine.state(), into=self._snap)
        self._snap = pieces
        root, rank, job, gen = c.dir, self.rank, self._job, self.generation

        def write() -> None:
            try:
                if self._slow_write:
                    time.sleep(self._slow_write)
                checkpoint.write_rank(root, step, spec, rank, pieces, job=job)
                self._written = (step, gen)
                if rank == 0:
                    checkpoint.prune(root, c.keep)
            except Exception as e:  # noqa: BLE001 - a failed write costs this checkpoint, never the job
                log.exception("worker %s: writing the checkpoint at step %d failed", self.worker, step)
                self._write_error = f"{type(e).__name__}: {_short(e, 200)}"

        self._writing, self._writing_step = self._writer.submit(write), step
        if final:
            self._writing.result()

    def _build_broke(self, d: Directive, layout: Layout, new_state: State, error: str) -> int:
        """A peer was lost while this member built the new generation's groups, after the commit:
        drop what was built, hold the new state as received and report like a broken step."""
        log.warning("worker %s: building generation %d broke (%s); holding its state for the recovery",
                    self.worker, d.generation, error)
        self._drop_communicators()
        return self._stand_broken(_Snapshot(d.generation, layout, new_state, d.switch_step - 1), d.switch_step,
                                  f"building generation {d.generation}: {error}")

    def _stand_broken(self, held: _Snapshot, step: int, error: str) -> int:
        """Stand as a member of ``held.generation`` whose step ``step`` broke, holding ``held.state``
        (no engine, no communicator), and report it; the recovery directive comes as a ``switch``."""
        with self._engine_lock:
            self.engine, self.generation, self.layout = HeldState(held.state), held.generation, held.layout
        self._applied = held.applied
        self._prep, self._broken = None, True
        self.client.call("broken", generation=held.generation, step=step, applied=held.applied, error=error,
                         ready=None, dirty=False, local_apply=True)
        return step

    def _maybe_die(self, d: Directive, where: str) -> None:
        if self._fault == f"{self.worker}:{d.generation}:{where}":
            _hard_exit(9, f"worker {self.worker}: fault injected at the {where} of generation {d.generation}")

    def _exchanged(self, d: Directive) -> tuple[str, str]:
        """Report our part of a transactional rescale done; long-poll for the commit (``go``), a
        ``rollback``, or ``stop``."""
        while True:
            resp = self.client.call("exchanged", generation=d.generation, wait_s=self.opts.long_poll_s)
            if resp["decision"] != "wait":
                return resp["decision"], resp.get("reason", "")
            time.sleep(_REASK_S)

    def _exchange_broke(self, d: Directive, snapshot: _Snapshot | None, error: str, *,
                        rolled_back: bool = False) -> int | None:
        """A transactional rescale failed before its commit (a peer was lost mid-exchange): shut every
        communicator down at once, and either stand again as the old generation's member with the
        old state kept whole (report it, like a broken step, and wait for the recovery directive)
        or, with nothing old to go back to (a joiner), leave. Returns the step to continue at, or
        None when this worker leaves."""
        what = "was rolled back" if rolled_back else "broke"
        self._drop_communicators()
        if snapshot is None:
            log.warning("worker %s: the rescale to generation %d %s (%s); a joiner has nothing to go back "
                        "to: leaving", self.worker, d.generation, what, error)
            with self._engine_lock:
                self.engine = None
            try:
                self.client.call("broken", generation=d.generation, step=d.switch_step, applied=-1, error=error,
                                 ready=None, dirty=False, local_apply=False)
            except RendezvousError:
                pass
            self._exit_notice()
            return None
        log.warning("worker %s: the rescale to generation %d %s (%s); back on generation %d with the old "
                    "state, waiting for the recovery", self.worker, d.generation, what, error, snapshot.generation)
        return self._stand_broken(snapshot, d.switch_step, f"rescale to generation {d.generation} {what}: {error}")

    def _meet(self, d: Directive, prep: _Prep) -> tuple[str, str, dict[str, Any]]:
        """Arrive with the plan digest (or the preparation error) and long-poll for the decision;
        returns it, the reason and the whole answer (a ``go`` says the switch step as it stands and
        whether the step given up for it was kept)."""
        while True:
            resp = self.client.call("arrive", generation=d.generation, digest=prep.digest, plan=prep.plan_info,
                                    error=prep.error, wait_s=self.opts.long_poll_s)
            if resp["decision"] != "wait":
                return resp["decision"], resp.get("reason", ""), resp
            time.sleep(_REASK_S)

    def _kept_step(self, d: Directive, told: dict[str, Any], carry: Any,
                   new_ranks: dict[str, int]) -> tuple[Any, bool] | None:
        """(the given-up step's kept work, whether this worker adds it) when the new layout finishes
        that step from it, else None. Every member agrees: the ``go`` said every old member kept it
        (``gave_up.kept``) and :func:`_kept_contributors` reads the directive and the agreed plan.
        A joiner holds no kept work: it computes its share of the samples left and adds nothing."""
        gave = told.get("gave_up") or {}
        if not gave.get("kept") or int(gave.get("step", -1)) != d.switch_step:
            return None
        contributors = _kept_contributors(d, new_ranks)
        if contributors is None:
            return None
        if self.worker in contributors:
            if carry is None or carry.step != d.switch_step:  # cannot be: the coordinator saw it kept
                raise RuntimeError(f"worker {self.worker}: told to finish step {d.switch_step} from its kept work, "
                                   "which it does not hold")
            return carry, True
        from elastic.train.engine import PartialStep

        cfg, old = train_config(self.config), Layout.parse(d.old_layout or "")
        return PartialStep(d.switch_step, int(gave["micro"]), old.dp, cfg.grad_accum(old), cfg.micro_batch_for(old),
                           None, 0.0), False

    def _old_group_is_members(self, d: Directive, prep: _Prep) -> bool:
        """Every member of the reshard is an old member (no joiner) and the old default group exists."""
        return (dist.is_initialized() and set(prep.plan.members) == set(d.old_ranks)
                and dist.get_world_size() == len(d.old_ranks))

    def _keeps_default_group(self, d: Directive, new_ranks: dict[str, int]) -> bool:
        """Same workers on the same ranks: the old default group serves the new layout as it is."""
        return dist.is_initialized() and new_ranks == d.old_ranks and dist.get_world_size() == len(new_ranks)

    def _execute(self, d: Directive, prep: _Prep, clock: _Phases, *, old_group: bool) -> tuple[State, dict[str, Any]]:
        if prep.prepared is None:
            clock.mark("group")
            clock.mark("exchange")
            return {}, {}
        from elastic.reshard.execute import execute

        pg: Any = None
        if old_group:
            # no joiner: the old default group already connects every member (saves a gloo rendezvous)
            grank = dict(d.old_ranks)
        else:
            members = list(prep.plan.members)
            grank = {w: i for i, w in enumerate(members)}
            self._maybe_die(d, "group")
            store = dist.PrefixStore(f"{d.job}/g{d.generation}/reshard/", self._store_for(d))
            self._building = d.generation
            try:
                self._roll_call(d, store, grank[self.worker], len(members))
                self._maybe_die(d, "rendezvous")  # after the roll call, before its part of gloo's rendezvous
                pg = dist.ProcessGroupGloo(store, grank[self.worker], len(members), self._timeout())
            finally:
                self._building = None
        clock.mark("group")
        self._maybe_die(d, "exchange")
        try:
            new_state = execute(prep.prepared, pg, grank, verify=self.opts.verify_reshard)
        except BaseException:
            if pg is not None:  # destroyed now, not retired: a peer blocked on it fails at once
                _shutdown(pg)
                pg = None
            raise
        finally:
            if pg is not None:
                _shutdown(pg)
                self._retire([pg])
        clock.mark("exchange")
        st = prep.prepared.stats
        return new_state, {"bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                           "prepare_seconds": st.prepare_seconds, "exchange_seconds": st.exchange_seconds}

    def _break(self, step: int, error: str) -> None:
        """A peer failed (or the coordinator says one did): shut every communicator down so peers
        blocked on us fail now rather than at their timeout, keep the state (and reduced
        gradients), and report what we hold. The recovery directive comes as a ``switch``."""
        log.warning("worker %s: step %d broke (%s); waiting for the recovery", self.worker, step, error)
        info: dict[str, Any] = {"ready": None, "dirty": False, "local_apply": True}
        if self.engine is not None and hasattr(self.engine, "recovery_state"):
            info.update(self.engine.recovery_state())  # type: ignore[union-attr]
        self._drop_communicators()
        self._broken = True
        self._carry = None  # a given-up step's work is not used by a recovery (a survivor may lack it)
        self.client.call("broken", generation=self.generation, step=step, applied=self._applied, error=error,
                         **info)

    def _drop_communicators(self) -> None:
        """Shut every communicator of this worker down and destroy it now, not after the next step
        like a rescale's: ``shutdown()`` alone leaves the connections open, and a peer blocked on
        one of them would wait for its timeout. The engine's state tensors (and gradients) stay."""
        retired: list[Any] = []
        if self.engine is not None and hasattr(self.engine, "abort"):
            retired += _engine_backends(self.engine)
            self.engine.abort()  # type: ignore[union-attr]
        if dist.is_initialized():
            retired.append(dist.group.WORLD)
            dist.destroy_process_group()
        for pg in retired:
            _shutdown(pg)

    def _give_up(self, generation: int, step: int) -> None:
        """A shrink is pending: ask our engine to give ``step`` up (all ranks agree at a micro-batch;
        past the last one the step completes and the shrink switches after it). Once per step."""
        with self._engine_lock:
            eng = self.engine
            if (generation != self.generation or self._broken or self._given_up == (generation, step)
                    or not hasattr(eng, "give_up")):
                return
            self._given_up = (generation, step)
            eng.give_up(step)  # type: ignore[union-attr]

    def _interrupt(self, generation: int) -> None:
        """The coordinator is recovering ``generation`` from a lost worker: stop our running step
        (it would end at a collective with the dead peer; the broken-step path then reports)."""
        with self._engine_lock:
            eng = self.engine
            if generation != self.generation or self._broken or eng is None or not hasattr(eng, "interrupt"):
                return
            if self._interrupted_gen != generation:  # the coordinator repeats it until we report
                self._interrupted_gen = generation
                log.warning("worker %s: a peer of generation %d was lost; giving the running step up",
                            self.worker, generation)
            eng.interrupt()

    def _init_default_group(self, d: Directive, layout: Layout, rank: int, *, own_store: bool = False) -> None:
        """The new layout's default group. ``own_store``: on a TCPStore connection of its own (it is
        being built in the background while the main thread's exchange uses the shared one)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if layout.world_size == 1:
            return  # a 1-rank layout needs no process group (the engine uses solo communicators)
        base = self._new_store(d) if own_store else self._store_for(d)
        store = dist.PrefixStore(f"{d.job}/g{d.generation}/train/", base)
        self._roll_call(d, store, rank, layout.world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world_size,
                                timeout=self._timeout())

    def _roll_call(self, d: Directive, store: Any, rank: int, world: int) -> None:
        """Before a group of generation ``d`` is built: wait until every member is at its door, and
        give up as soon as the coordinator says a peer of that generation was lost (its rendezvous
        would wait for the dead peer's key until ``pg_timeout_s``). See ``elastic.train.abortable``."""
        from elastic.train.abortable import roll_call

        roll_call(store, "roll-call", rank, world, self._aborter(d), self.opts.pg_timeout_s)

    def _aborter(self, d: Directive) -> Callable[[], str | None]:
        """``aborted()`` for the roll calls of generation ``d``'s groups: the reason the coordinator
        gave that generation up (a peer lost), or None; it asks at most every ROLL_CALL_ASK_S."""
        asked = [time.monotonic()]

        def aborted() -> str | None:
            # a wait beyond a moment (a roll call of live members takes milliseconds): ask whether the
            # coordinator gave this generation up, at most every ROLL_CALL_ASK_S
            if time.monotonic() - asked[0] < ROLL_CALL_ASK_S:
                return None
            asked[0] = time.monotonic()
            if self._asker is None:
                self._asker = RendezvousClient(self.client.url, self.worker, timeout_s=5.0, retry_s=0,
                                               secret=self.client.secret)
            try:
                resp = self._asker.call("heartbeat", generation=self.generation, building=d.generation)
            except RendezvousError:
                return None  # the heartbeat thread decides what a lost coordinator means
            if resp.get("abort") != d.generation:
                return None
            why = str(resp.get("abort_reason") or "a peer was lost")
            log.warning("worker %s: a peer of generation %d was lost while its groups were built; giving "
                        "their rendezvous up (%s)", self.worker, d.generation, why)
            return why

        return aborted

    def _store_for(self, d: Directive) -> Any:
        if self._store is None:
            self._store = self._new_store(d)
        return self._store

    def _new_store(self, d: Directive) -> Any:
        return dist.TCPStore(d.store_host, d.store_port, is_master=False, timeout=self._timeout(),
                             wait_for_workers=False)

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.opts.pg_timeout_s)

    def _close_engine(self, *, keep_default: bool = False) -> None:
        retired: list[Any] = []
        if self.engine is not None:
            retired += _engine_backends(self.engine)
            self.engine.close()
            self.engine = None
        if dist.is_initialized() and not keep_default:
            retired.append(dist.group.WORLD)
            dist.destroy_process_group()
        self._retire(retired)

    def _retire(self, groups: list[Any]) -> None:
        """Keep shut-down process groups alive until the pause is over (see :meth:`_bury`).

        Destroying a gloo group that has carried traffic takes ~20 ms even after
        ``shutdown()`` (its destructor tears down every pair); a rescale drops 2-5 of them
        (old TP/DP/PP, old default, the reshard group). The destructor runs with the GIL
        held, so even on a background thread it stops the main thread: measured, a grow's
        pause carried 20-40 ms of "close" for a reshard group destroyed on the reaper thread
        while the new engine was being built. Holding a reference is all it takes to defer it.
        """
        self._graveyard.extend(groups)

    def _bury(self) -> None:
        """Destroy the retired groups on the reaper thread, now that training runs again."""
        if self._graveyard:
            dead, self._graveyard = self._graveyard, []
            self._reaper.submit(dead.clear)

    def _leave(self) -> None:
        """A leaver's bytes have landed: free everything at once (the launcher sees the process go)."""
        log.info("worker %s: left at generation %d", self.worker, self.generation)
        if self._slow_leave > 0:
            time.sleep(self._slow_leave)  # fault injection (ELASTIC_FAULT_SLOW_LEAVE): slow to go
        self._exit_notice()
        if not self.opts.exit_on_leave:
            return None  # the host ends the process (Ray: the handle ray.kill()s the actor)
        from elastic.reshard.execute import fast_exit

        fast_exit(0)
        return None

    # ---- coordinator I/O ------------------------------------------------------------------
    def _report_result(self, d: Directive, stats: dict[str, Any]) -> None:
        # with its last complete checkpoint write: a leaver's last word on the checkpoint in flight
        # (it does not wait for a write still running: its GPU is not held back for it)
        extra = {"checkpoint": list(self._written)} if self._ckpt is not None and self._written[0] >= 0 else {}
        self.client.call("result", generation=d.generation, ok=True, stats=stats, **extra)

    def _report_fail(self, reason: str) -> None:
        try:
            self.client.call("fail", reason=reason)
        except RendezvousError:
            pass

    def _exit_notice(self) -> None:
        try:
            self.client.call("exit")
        except RendezvousError:
            pass

    def _heartbeat(self, interval: float) -> None:
        """Beat; interrupt the running step when a peer was lost; exit the process if the
        coordinator is gone or the job failed and we are stuck.

        Each beat long-polls for ``interval``: the coordinator answers at once when it starts
        recovering this worker's generation, so a survivor deep in a long step gives the step
        up at its next micro-batch instead of computing on to a collective with the dead peer.
        """
        lost_since: float | None = None
        failed_since: float | None = None
        beat = RendezvousClient(self.client.url, self.worker, timeout_s=interval + 5.0, retry_s=0,
                                secret=self.client.secret)
        pause = interval
        while not self._stop.wait(pause):
            now = time.monotonic()
            try:
                building, sent_from = self._building, self.generation
                resp = beat.call("heartbeat", generation=sent_from, wait_s=interval, seen=self._seen_post,
                                 **({"building": building} if building is not None else {}))
                lost_since = None
            except RendezvousError as e:
                lost_since = lost_since or now
                if now - lost_since > self.opts.coordinator_timeout_s:
                    _hard_exit(3, f"worker {self.worker}: coordinator unreachable for "
                                  f"{now - lost_since:.0f} s ({e}); exiting")
                pause = interval
                continue
            # a coordinator that long-polled has already waited; one that answered at once has not
            pause = 0.0 if time.monotonic() - now >= 0.5 * interval else interval
            if resp.get("interrupt") is not None:
                self._interrupt(int(resp["interrupt"]))
            if resp.get("give_up") is not None:
                self._give_up(int(resp["give_up"]["generation"]), int(resp["give_up"]["step"]))
            if resp.get("pending") is not None:  # a rescale of our generation was posted: prepare meanwhile
                self._seen_post = int(resp["pending_seq"])
                try:
                    self._prepare_early(Directive.from_json(resp["pending"]), told_on=sent_from)
                except Exception as e:  # noqa: BLE001 - the step loop prepares at the switch instead
                    log.warning("worker %s: could not begin preparing generation %s early: %s", self.worker,
                                resp["pending"].get("generation"), e)
            if resp.get("failed"):
                # The main thread may sit in a collective with a dead peer; give it a grace period
                # to notice on its own (and exit with its own reason), then leave so no process
                # outlives its job. The job's reason is already recorded: a few seconds suffice.
                failed_since = failed_since or now
                if now - failed_since > min(self.opts.pg_timeout_s, FAILED_JOB_GRACE_S):
                    _hard_exit(1, f"worker {self.worker}: job failed ({resp.get('reason')}); exiting")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    """A generation's state a member holds without an engine: the old one a transactional rescale
    goes back to if it is rolled back, or the new one received when building its groups broke."""

    generation: int
    layout: Layout | None
    state: State
    applied: int


class HeldState:
    """What a keeper holds while its job is paused: the state tensors of its box, nothing else.

    It stands where the engine stands so the next directive's plan and prepare read
    ``state()`` as from any engine; it has no model, no process group and runs no step.
    """

    def __init__(self, state: State) -> None:
        self._state = state

    def state(self) -> State:
        return self._state

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state.values())

    def train_step(self, step: int) -> Any:
        raise RuntimeError(f"a keeper holds a paused job's state and runs no step (asked for step {step})")

    def close(self) -> None:
        self._state = {}


class _Phases:
    """Seconds between successive ``mark``s, by phase name (the rescale's per-worker breakdown)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def report(self) -> dict[str, float]:
        s = self.seconds
        out = {f"{k}_seconds": v for k, v in s.items()}
        out["execute_seconds"] = s.get("group", 0.0) + s.get("exchange", 0.0)
        out["rebuild_seconds"] = s.get("close", 0.0) + s.get("init_pg", 0.0) + s.get("engine", 0.0)
        return out


ROLL_CALL_ASK_S = 0.1
"""A roll call still waiting after this long asks the coordinator whether to give up (then as often)."""


def _preload(factory: Any) -> None:
    """Import what a rescale needs now, so that a joiner's first plan and engine do not pay for it.

    On a loaded 2-core VM importing the planner (numpy/scipy) and the engine took ~0.3 s,
    all of it inside the pause of the first rescale a joiner took part in.
    """
    import elastic.reshard.execute  # noqa: F401
    import elastic.reshard.plan  # noqa: F401

    if getattr(factory, "func", factory) is default_engine_factory:
        import elastic.train.engine  # noqa: F401


def plan_digest(plan: Any) -> str:
    """The same for two plans exactly when they move the same bytes to the same ranks."""
    h = hashlib.sha256()
    h.update(repr(sorted(plan.new_ranks.items())).encode())
    h.update(repr(plan.messages).encode())
    h.update(repr(plan.local_copies).encode())
    h.update(repr(plan.new_shards).encode())
    return h.hexdigest()[:32]


def _engine_backends(engine: Any) -> list[Any]:
    """The communicators' backends of a ``TrainEngine`` (none for other engines), to retire after close()."""
    groups = getattr(engine, "groups", None)
    comms = [getattr(groups, axis, None) for axis in ("tp", "dp", "pp", "embed")]
    return [b for c in comms if (b := getattr(c, "backend", None)) is not None]


_COMM_ERRORS = ("connection closed", "connection reset", "read error", "write error", "timed out", "gloo",
                "nccl", "broken pipe", "socket")


EARLY_PREPARE_HEADROOM = 0.9
"""Of a GPU's unreserved memory, the share a preparation beside a running step may take."""


def _early_alloc_budget(device: str | torch.device) -> int | None:
    """Bytes a preparation beside a running step may allocate on ``device``: None (no limit) for
    host memory; on a GPU, ``EARLY_PREPARE_HEADROOM`` of what no allocator has reserved, so the
    step never finds its own cached blocks taken (whatever it took from the cache it can get back
    from the driver)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free * EARLY_PREPARE_HEADROOM)


def _kept_contributors(d: Directive, new_ranks: dict[str, int]) -> set[str] | None:
    """Who adds a given-up step's kept work when the new layout of ``d`` finishes it: per TP
    coordinate, the old member at that coordinate on both sides with the lowest new rank (its kept
    gradients are exactly its new boxes', summed over the old replicas already); the new DP
    all-reduce hands them to everyone, joiners included. None: the work cannot be used (no
    directive switching from one stage to one stage with the same TP split, a recovery or a hold,
    or a TP coordinate no such old member holds). The same answer on every member: it reads
    only the directive and the agreed plan's ranks."""
    if d.hold or d.commit_step is not None or not d.old_layout:
        return None
    old, new = Layout.parse(d.old_layout), Layout.parse(d.layout)
    if old.pp != 1 or new.pp != 1 or old.tp != new.tp or old.ep != 1 or new.ep != 1:
        return None
    chosen: dict[int, tuple[int, str]] = {}
    for w, r in new_ranks.items():
        t = new.coords(r)[0]
        if w in d.old_ranks and old.coords(d.old_ranks[w])[0] == t and (t not in chosen or r < chosen[t][0]):
            chosen[t] = (r, w)
    if len(chosen) != new.tp:
        return None
    return {w for _, w in chosen.values()}


def _same_rescale(a: Directive | None, b: Directive) -> bool:
    """``a`` is ``b`` up to its switch step (a shrink whose step in progress was given up switches
    one step earlier than first posted; the plan and the buffers prepared for it are the same)."""
    return a is not None and dataclasses.replace(a, switch_step=b.switch_step) == b


def _is_comm_error(e: BaseException) -> bool:
    """A collective failed because a peer went away (as opposed to a bug or a bad input here), or
    the step was given up because the coordinator said one did (``StepInterrupted``)."""
    from elastic.train.groups import StepInterrupted

    if isinstance(e, (StepInterrupted, getattr(dist, "DistError", ()))):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _COMM_ERRORS)


def _same_tensors(a: State, b: State) -> bool:
    """Whether both states are views of the same memory, tensor by tensor.

    Not ``is``: ``param.data`` is a new tensor object on every call, so identity would call
    every early preparation stale and redo it inside the pause.
    """
    return a.keys() == b.keys() and all(_same_memory(a[k], b[k]) for k in a)


def _same_memory(x: Any, y: Any) -> bool:
    return x is y or (x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
                      and x.dtype == y.dtype and x.device == y.device)


def _result_json(r: Any) -> dict[str, Any]:
    loss = getattr(r, "loss", None)
    loss = float(loss) if loss is not None and math.isfinite(float(loss)) else None
    return {"step": int(r.step), "loss": loss, "tokens": int(getattr(r, "tokens", 0)),
            "seconds": float(getattr(r, "seconds", 0.0))}


def _short(e: BaseException, limit: int = 400) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _shutdown(pg: Any) -> None:
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean shutdown
        pass


def _hard_exit(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)
