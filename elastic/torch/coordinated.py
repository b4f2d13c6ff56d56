"""The Manager driven by the job's coordinator: a user's own loop as a worker of an elastic job.

What it is for: the controller launched this process for a user job (``elastic.torch.run``
reads ``ELASTIC_JOB``, ``ELASTIC_WORKER_ID``, ``ELASTIC_RENDEZVOUS_URL`` from the environment)
and decides its layouts. :class:`CoordinatedManager` is what ``elastic.torch.Manager(build,
global_batch=...)`` returns there: the same loop as with a local schedule, but the layouts,
the steps to train and the moment to stop come from the job's coordinator
(:mod:`elastic.train.rendezvous`), over the protocol the reference trainer's worker agent
speaks. One :class:`Session` per process holds what survives the user's function: the
registration, the heartbeat, the generation, the model and optimizer.

A rescale (``switch`` at a step boundary, inside ``step_done``), on every member of old union new:

1. **ranks**: the old members agree on which worker takes which position of the new mesh
   (:func:`elastic.torch.mesh_order` over the old world: the most bytes stay local) and the
   first of them publishes it in the job's store, where joiners read it; a recovery takes its
   positions from the directive (each survivor keeps its tensor/pipeline coordinate). The old
   members then describe their state (:func:`elastic.torch.reshard.freeze`) and destroy the
   old default group: the old model's local shards live on, its groups do not.
2. **groups**: a transient gloo group of old union new (the *union*, a raw backend on the
   store) and the new layout's default group (its members only, rank = position), each after a
   roll call that gives up when the coordinator gives the rescale up (a joiner that never came).
3. **build and plan**: the new members call the user's ``build(world)``; everyone hears of any
   build error and whether the optimizer has as many parameter groups as the running one; the
   reshard is planned collectively over the union (:func:`elastic.torch.reshard.prepare_reshard`:
   keys, shapes, dtypes checked on every worker alike) with nothing moved yet.
4. **meet**: every member arrives at the coordinator with the plan's digest, or with the error
   that stopped it. ``abandoned``: nothing moved; joiners leave, and the old members build the
   old layout again from their kept state (the same user ``build``, every byte local) and train
   on. ``go``: the bytes move into the new model's tensors; a transactional rescale
   (``Directive.rollback``) waits for every member's ``exchanged`` first, and a peer lost before
   that sends the old members back to their kept state for the coordinator's recovery.
5. **adopt**: the new members take the new model, optimizer and scheduler, with the old
   optimizer's hyperparameters, the scheduler's state and the user's own state (``state=``)
   from the first old member; leavers report and exit.

A peer lost during a step breaks the survivors' collectives inside the user's code: the
exception leaves the user's function, and :mod:`elastic.torch.run` hands it to
:meth:`Session.recover_from`, which keeps the state (described before the broken groups go),
reports what it holds (the last step whose optimizer update completed; an update broken
half-way makes the job fail instead of training on a mixed state) and waits for the
coordinator's recovery directive; then it calls the user's function again, whose new
``Manager`` finds the recovered model and the step to go on at. A survivor computing when the
loss is announced stops at its next micro-batch (:class:`StepInterrupted`).

A shrink need not wait for the step in progress (the coordinator's ``shrink_gives_up_step``:
inference waits for the GPUs it frees). A generation posted with ``give_up_checks`` checks
before each micro-batch ``micro_batches`` hands out: one all-reduce of a flag over the
generation's group, so every rank stops at the same micro-batch. When the coordinator asks
(on the heartbeat, or with the ``go`` of the step), the check raises :class:`StepGivenUp` out
of the user's loop: no optimizer update happened, so the state is the step boundary's (the
user's ``state=`` objects are put back as they were when the step began).
:mod:`elastic.torch.run` hands it to :meth:`Session.give_up`, which asks for the same step
again; the coordinator switches the shrink there, and the user's function is called again on
the new layout, which computes the step whole on the same samples (the work of the given-up
micro-batches is lost: the reference trainer can keep it, a user's loop cannot hand over its
gradients half-way). Leavers exit. A grow waits for the step boundary.

Must not: choose layouts, run user code on another thread than the caller's, or outlive its
coordinator (the heartbeat exits the process when the coordinator is gone or the job failed).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import Layout, SpecError
from elastic.torch.manager import Manager, RescaleRecord, World
from elastic.torch.rescale import RescaleMixin
from elastic.torch.session_io import _LONG_POLL_S, _REASK_S, GroupsMixin, _Sockets
from elastic.train.agent import AgentOptions, _is_comm_error, _short
from elastic.train.rendezvous.messages import Directive
from elastic.train.rendezvous.replies import Answer, Registered

log = logging.getLogger(__name__)

__all__ = ["CoordinatedManager", "Session", "StepGivenUp", "StepInterrupted", "current_session", "session_from_env",
           "warm_up"]



class StepGivenUp(BaseException):  # noqa: N818 - a control-flow signal, like GeneratorExit
    """Not an error: the step in progress is given up for a shrink (see the module doc). A
    ``BaseException`` so that a user's ``except Exception`` does not swallow it; let it leave
    your function, and :mod:`elastic.torch.run` calls it again on the new layout."""

    def __init__(self, step: int, micro: int, seconds: float) -> None:
        super().__init__(f"step {step} given up at micro-batch {micro} for a shrink ({seconds:.3f} s in)")
        self.step, self.micro, self.seconds = step, micro, seconds


class StepInterrupted(RuntimeError):
    """A peer of this generation was lost: the step in progress cannot complete. Raised by
    :meth:`Manager.micro_batches` before the next micro-batch; :mod:`elastic.torch.run` recovers."""


def _options_from_env(env: Mapping[str, str]) -> AgentOptions:
    """The reference worker's options from the same environment; a worker given a GPU
    (``CUDA_VISIBLE_DEVICES``) trains on it unless ``ELASTIC_DEVICE`` says otherwise."""
    from elastic.train.worker import options_from_env

    o = options_from_env(env)
    return o if env.get("ELASTIC_DEVICE") or not torch.cuda.is_available() else replace(o, device="cuda")


_SESSION: Session | None = None
_SESSION_LOCK = threading.Lock()
_WARM = threading.Event()


def warm_up() -> float:
    """Pay torch's first-use costs now: import FSDP2, tensor parallel and DTensor, build a mesh on a
    one-process group and take one optimizer step on a DTensor. A joiner does this before it
    registers (the launcher posts the directive once every joiner has), so the rescale's pause
    does not wait for its imports and first calls. Once per process; returns the seconds it took.
    Never raises: a worker that cannot warm up pays the costs inside its first build instead."""
    if _WARM.is_set():
        return 0.0
    t0 = time.perf_counter()
    try:
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from elastic.torch.caches import clear_dtensor_caches

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                mesh = DeviceMesh("cpu", torch.zeros(1, dtype=torch.int64))
                p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
                opt = torch.optim.AdamW([p], lr=1e-3)
                p.grad = torch.zeros_like(p)
                opt.step()
            finally:
                dist.destroy_process_group()
                clear_dtensor_caches()
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.info("warm-up skipped: %s: %s", type(e).__name__, e)
    _WARM.set()
    return time.perf_counter() - t0


def current_session() -> Session | None:
    return _SESSION


def session_from_env(env: Mapping[str, str] | None = None) -> Session:
    """The process's session, made from the worker environment the launcher set (once per process)."""
    global _SESSION
    env = os.environ if env is None else env
    with _SESSION_LOCK:
        if _SESSION is None:
            missing = [n for n in ("ELASTIC_JOB", "ELASTIC_WORKER_ID", "ELASTIC_RENDEZVOUS_URL") if not env.get(n)]
            if missing:
                raise SpecError(
                    f"Manager: no schedule= and no job to join (environment variable(s) {', '.join(missing)} not "
                    "set); run the script under an elastic job (python -m elastic.torch.run ...), or give a "
                    "local schedule=")
            _SESSION = Session(env["ELASTIC_WORKER_ID"], env["ELASTIC_RENDEZVOUS_URL"], _options_from_env(env),
                               job=env["ELASTIC_JOB"])
            # launched to hold a paused job's state (elastic.torch.keeper), not to train
            _SESSION.keeper = env.get("ELASTIC_KEEPER", "") in ("1", "true")
        return _SESSION


class Session(RescaleMixin, GroupsMixin):
    """One worker process's membership of a job: everything that outlives one call of the user's function.
    Its rescale is :class:`elastic.torch.rescale.RescaleMixin`'s, its groups and coordinator calls
    :class:`elastic.torch.session_io.GroupsMixin`'s."""

    def __init__(self, worker: str, url: str, options: AgentOptions | None = None, *, job: str = "") -> None:
        from elastic.train.rendezvous import RendezvousClient

        self.worker = worker
        self.job = job
        self.opts = options or AgentOptions()
        self.client = RendezvousClient(url, worker, retry_s=self.opts.coordinator_timeout_s)
        self.config: dict[str, Any] = {}
        self.phase = "new"  # new | registered | training | held | broken | done | left
        self.keeper = False  # a keeper of a paused job (elastic.torch.keeper): holds the state, trains nothing
        self._held: dict[str, Any] | None = None  # a keeper's share of the paused job's state
        self.gen = 0
        self.layout: Layout | None = None
        self.ranks: dict[str, int] = {}
        self.world: World | None = None
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.user_state: dict[str, Any] = {}
        self.build: Callable[[World], tuple] | None = None
        self.next_step = 0  # the step to train next
        self.granted: int | None = None  # the step the coordinator said go for (not asked again)
        self.in_flight: int | None = None  # the step the user trains now
        self.applied = -1  # the last step whose optimizer update completed
        self.records: list[RescaleRecord] = []
        self.reasons: list[str] = []  # why rescales were abandoned, and the job's end
        self._in_update = False
        self._kept_extras: dict[str, Any] | None = None  # the old state's non-tensor part, kept with _src
        self._shared_cache: tuple[str, dict[str, Any]] | None = None  # (tag, what the first old member published)
        self._hooked: Any = None  # the optimizer our step hooks are on
        self._hooks: list[Any] = []
        self._last_result: dict[str, Any] | None = None
        self._src: Any = None  # the old state, described, while the old groups are gone
        # the publisher's replicated source of a rescale planned without exchanging descriptions
        # (plain data parallelism on both sides); published with the new ranks for the others
        self._replicated: Any = None
        self._union: Any = None
        self._union_bytes: Any = None  # on CUDA: the union's NCCL backend for the bytes (gloo keeps the metadata)
        self._store: Any = None
        self._building: int | None = None
        self._interrupt_gen = -1
        self._checks = False  # this generation checks for a give-up before each micro-batch
        self._give_up_req: tuple[int, int] | None = None  # (generation, step) the coordinator asked to give up
        # the (generation, step) given up last: heeded once (after an abandoned shrink the old generation
        # redoes that step whole, and a late heartbeat may still carry the old request)
        self._given_up: tuple[int, int] | None = None
        self._gave_up: dict[str, Any] | None = None  # what the next step request says of a given-up step
        self._micro = 0  # micro-batches handed out of the step in flight
        self._at_begin: dict[str, Any] | None = None  # the user's state objects as the step in flight began
        self._comm_sockets = _Sockets()  # the TCP connections of this generation's gloo groups
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._t_step = 0.0

    # ---- entry ------------------------------------------------------------------------------
    def register(self) -> dict[str, Any]:
        """Register with the coordinator (once) and begin heartbeats; the job's config."""
        if self.phase != "new":
            return self.config
        reg = self.client.ask("register", Registered, pid=os.getpid(), host=socket.gethostname())
        self.config = dict(reg.config)
        self.job = reg.job or self.job
        self._beat = threading.Thread(target=self._heartbeat, args=(reg.heartbeat_interval_s,),
                                      name=f"heartbeat-{self.worker}", daemon=True)
        self._beat.start()
        self.phase = "registered"
        return self.config

    def _wait_directive(self) -> Directive | None:
        """A registered worker with no generation polls until a directive lists it; None when the job ends."""
        while True:
            resp = self.client.ask("poll", Answer, wait_s=_LONG_POLL_S)
            if resp.action == "join" and resp.directive is not None:
                return resp.directive
            if resp.action == "exit":
                self.reasons.append(resp.reason or "")
                self._end("done")
                return None
            time.sleep(_REASK_S)

    def start(self) -> bool:
        """Register, wait for a directive that includes this worker and take part in it. True once this
        worker trains; False when the job ended first (or the rescale it was to join was abandoned)."""
        if self.phase == "new":
            self.register()
        if self.phase != "registered":
            return self.phase == "training"
        d = self._wait_directive()
        if d is None:
            return False
        step = self._transition(d)
        if step is None:
            return False
        self.next_step = step
        return True

    def refuse(self, error: str) -> None:
        """This worker cannot take part (its entrypoint does not load, its settings disagree with the job's):
        arrive at its directive with ``error``, so the rescale (or the start) is abandoned with the reason
        in the job's status and nothing changes; then leave."""
        if self.phase == "new":
            self.register()
        if self.phase == "registered":
            d = self._wait_directive()
            if d is not None:
                self._meet(d, "", {}, error)
        self.reasons.append(error)
        self._exit_notice()
        self._end("left")

    def ask(self, step: int) -> bool:
        """Before ``step``: True to train it (:attr:`next_step` may have moved: a rescale in between),
        False when the job stopped or finished, or this worker left."""
        if self.granted == step and self.phase == "training":
            return True
        while True:
            if self.phase not in ("training", "broken", "held"):
                return False
            broken = self.phase != "training"  # a broken member or a keeper: it waits for a directive
            result, self._last_result = self._last_result, None
            gave_up, self._gave_up = self._gave_up, None
            resp = self.client.ask("step", Answer, generation=self.gen, step=step, result=result,
                                   **({"wait_s": _LONG_POLL_S} if broken else {}),
                                   **({"gave_up": gave_up} if gave_up else {}))
            action = resp.action
            if action == "go" and not broken:
                if resp.give_up is not None:  # asked to give this step up before it began
                    self._give_up_req = (self.gen, resp.give_up)
                self.granted = self.next_step = step
                return True
            if action == "switch" and resp.directive is not None:
                d = resp.directive
                if d.commit_step is not None and self.applied < d.commit_step:
                    self._fail(f"recovery asks for step {d.commit_step}, whose update this worker did not apply "
                               f"(applied {self.applied})")
                    return False
                nxt = self._transition(d)
                if nxt is None:
                    return False
                step = self.next_step = nxt
            elif action == "break" and not broken:
                self._break(step, f"told to break: {resp.reason or ''}")
            elif action in ("hold", "break"):
                time.sleep(_REASK_S)
            elif action in ("stop", "finish"):
                log.info("worker %s: %s at step %d (%s)", self.worker, action, step, resp.reason or "")
                self.reasons.append(f"{action}: {resp.reason or ''}")
                self._end("done")
                return False
            else:
                time.sleep(_REASK_S)

    def begin(self, step: int) -> None:
        self.in_flight, self.granted = step, None
        self._micro = 0
        # a step given up half-way goes back to the boundary: the user's state objects too (a data
        # position, the RNG) may have moved inside it
        self._at_begin = ({k: _copied(v.state_dict()) for k, v in self.user_state.items()}
                          if self._checks and self.user_state else None)
        self._t_step = time.perf_counter()

    def finish(self, step: int, loss: float | None, tokens: int) -> None:
        """The user's step ``step`` is done (``step_done``); reported with the next step's request."""
        if self.in_flight != step:
            raise SpecError(f"step_done({step}): the step in progress is {self.in_flight}")
        if self._hooked is not self.optimizer:  # an optimizer without our hooks: the step is its update
            self.applied = step
        self.in_flight = None
        self.next_step = step + 1
        self._last_result = {"step": step, "loss": loss, "tokens": tokens,
                             "seconds": time.perf_counter() - self._t_step}

    def check_interrupt(self) -> None:
        if self._interrupt_gen == self.gen and self.phase == "training":
            raise StepInterrupted(f"a peer of generation {self.gen} was lost; the step cannot complete")

    def before_batch(self) -> None:
        """Before each micro-batch: a lost peer stops the step; in a generation that checks, every
        rank learns whether any was asked to give the step up (one flag, all-reduced), and all of
        them give it up at this same micro-batch."""
        self.check_interrupt()
        step = self.in_flight
        if not self._checks or step is None or self.phase != "training":
            return
        asked = self._give_up_req == (self.gen, step) != self._given_up
        # on the CPU (the world group has gloo beside NCCL on CUDA): no device sync per micro-batch
        flag = torch.tensor([1.0 if asked else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        micro, self._micro = self._micro, self._micro + 1
        if flag.item() > 0:
            raise StepGivenUp(step, micro, time.perf_counter() - self._t_step)

    def give_up(self, e: StepGivenUp) -> bool:
        """The user's step ``e.step`` was given up for a shrink: back to its boundary, ask for the same
        step again (the coordinator switches the shrink there) and take part in the rescale. True
        when this worker trains on (call the user's function again), False when it left."""
        log.info("worker %s: %s", self.worker, e)
        self._given_up, self._give_up_req = (self.gen, e.step), None
        if self._at_begin is not None:
            for k, sd in self._at_begin.items():
                self.user_state[k].load_state_dict(sd)
        self._at_begin = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the given-up micro-batches' gradients
        self.in_flight = self.granted = None
        self.next_step = e.step
        self._gave_up = {"step": e.step, "seconds": round(e.seconds, 4), "micro": e.micro, "kept": False}
        return self.ask(e.step)

    # ---- recovery from a broken step ------------------------------------------------------------
    def recoverable(self, e: BaseException) -> bool:
        return (self.opts.recover and self.phase == "training"
                and (isinstance(e, StepInterrupted) or _is_comm_error(e) or "RendezvousAborted" in type(e).__name__))

    def recover_from(self, e: BaseException) -> bool:
        """The user's step broke because a peer was lost: keep the state, report, wait for the recovery
        directive and take part in it. True when this worker trains again (call the user's function
        again), False when the job ended or failed."""
        step = self.in_flight if self.in_flight is not None else self.next_step
        self._break(step, f"{type(e).__name__}: {_short(e, 200)}")
        self.in_flight = None
        return self.ask(step)

    def _break(self, step: int, error: str) -> None:
        log.warning("worker %s: step %d broke (%s); waiting for the recovery", self.worker, step, error)
        dirty = self._in_update
        if self.model is not None and self._src is None:
            self._src = self._freeze()
        self._comm_sockets.cut()  # peers blocked on us fail now, not at their timeout
        self._drop_world()
        self.model = self.optimizer = self.scheduler = None
        self.phase = "broken"
        self.client.call("broken", generation=self.gen, step=step, applied=self.applied, error=error, ready=None,
                         dirty=dirty, local_apply=True)


def _copied(sd: Any) -> Any:
    """A state dict detached from the live object (tensors cloned), to load back later."""
    import copy

    return copy.deepcopy(sd)


class CoordinatedManager(Manager):
    """:class:`elastic.torch.Manager` under a job's coordinator (see the module doc).

    ``Manager(build, global_batch=...)`` with no ``schedule`` makes one. The job's config (what
    the coordinator hands every worker) is authoritative: ``global_batch``, ``micro_batch_size``
    and ``seed`` given here must agree with it or the worker stops with a message naming the
    field. ``state``: objects with ``state_dict``/``load_state_dict`` (a data loader's position,
    a metrics tracker) carried from the first old member to every new one at a rescale.
    """

    def __init__(self, build: Callable[[World], tuple], *, global_batch: int | None = None, corpus: Any = None,
                 micro_batch_size: int | None = None, seed: int | None = None, device: str | None = None,
                 state: Mapping[str, Any] | None = None, schedule: Any = None, total_steps: int | None = None,
                 group: Any = None, session: Session | None = None) -> None:
        if schedule is not None:
            raise SpecError("CoordinatedManager: a schedule= makes a local Manager; use elastic.torch.Manager")
        self.session = session or session_from_env()
        s = self.session
        s.build = build
        for k, v in (state or {}).items():
            if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
                raise SpecError(f"state[{k!r}]: a {type(v).__name__} has no state_dict()/load_state_dict()")
        s.user_state = dict(state or {})
        self.corpus = corpus
        self._given = {"global_batch": global_batch, "micro_batch_size": micro_batch_size, "seed": seed}
        self.device = device or s.opts.device
        self.build = build
        self.total_steps = total_steps

    # the job's settings, once registered
    @property
    def global_batch(self) -> int:
        return int(self.session.config.get("global_batch") or self._given["global_batch"] or 0)

    @property
    def micro_batch_size(self) -> int | None:
        return self._given["micro_batch_size"] or self.session.config.get("micro_batch")

    @property
    def seed(self) -> int:
        g = self._given["seed"]
        return int(g if g is not None else self.session.config.get("seed") or 0)

    @property
    def world(self) -> World | None:  # type: ignore[override]
        return self.session.world

    @property
    def model(self) -> Any:  # type: ignore[override]
        return self.session.model

    @property
    def optimizer(self) -> Any:  # type: ignore[override]
        return self.session.optimizer

    @property
    def scheduler(self) -> Any:  # type: ignore[override]
        return self.session.scheduler

    @property
    def records(self) -> list[RescaleRecord]:  # type: ignore[override]
        return self.session.records

    @property
    def errors(self) -> list[str]:
        return [f"step {r.step}: {r.error}" for r in self.session.records if r.error]

    def _check_config(self) -> None:
        cfg = self.session.config
        for name, key in (("global_batch", "global_batch"), ("micro_batch_size", "micro_batch"), ("seed", "seed")):
            mine, theirs = self._given[name], cfg.get(key)
            if mine is not None and theirs is not None and int(mine) != int(theirs):
                raise SpecError(f"Manager({name}={mine}) but job {self.session.job} trains with {key}={theirs}; "
                                "the job's config wins: drop the argument or fix the job spec")

    def start(self) -> tuple[Any, Any]:
        """Join the job (its first layout, or a rescale that adds this worker); ``(model, optimizer)``,
        or ``(None, None)`` when the job ended first. After a recovery (the user's function called
        again) the recovered model and optimizer, at once."""
        s = self.session
        if s.keeper:  # the user's script started as a keeper (its pod's command): keep, never train
            from elastic.torch.keeper import keep

            raise SystemExit(keep(s))
        if s.phase == "new":
            s.register()
        if s.phase == "registered":
            try:
                self._check_config()
            except SpecError as e:
                s.refuse(str(e))
                raise
        trains = s.start()
        return (s.model, s.optimizer) if trains else (None, None)

    def steps(self) -> Iterator[int]:
        s = self.session
        if s.phase == "new":
            raise SpecError("call start() before steps()")
        while s.phase == "training":
            if self.total_steps is not None and s.next_step >= self.total_steps:
                return
            if not s.ask(s.next_step):
                return
            step = s.next_step
            s.begin(step)
            yield step
            if s.in_flight == step:
                raise SpecError(f"step_done({step}) was not called: call it at the end of every step")

    def step_done(self, step: int, loss: Any = None) -> tuple[Any, Any]:
        """End of ``step`` (``loss``: its loss, for the job's loss history): at a rescale the new mesh's
        model and optimizer, the state moved in place; ``(None, None)`` once this worker no longer trains."""
        s = self.session
        value = None
        if loss is not None:
            value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else float(loss)
        s.finish(step, value, self.global_batch * int(getattr(self.corpus, "seq_len", 1) or 1))
        if self.total_steps is None or step + 1 < self.total_steps:
            s.ask(step + 1)
        return (s.model, s.optimizer) if s.phase == "training" else (None, None)

    def _trains(self) -> bool:
        return self.world is not None and self.session.phase == "training"

    def _before_batch(self) -> None:
        self.session.before_batch()
