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

import datetime
import hashlib
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import Layout, SpecError
from elastic.torch.manager import Manager, MeshLayout, RescaleRecord, World, apply_carried, carried
from elastic.train.agent import FAILED_JOB_GRACE_S, AgentOptions, _hard_exit, _is_comm_error, _Phases, _short

log = logging.getLogger(__name__)

__all__ = ["CoordinatedManager", "Session", "StepGivenUp", "StepInterrupted", "current_session", "session_from_env",
           "warm_up"]

_REASK_S = 0.005
_LONG_POLL_S = 2.0
_ASK_ABORT_S = 0.1  # a roll call asks the coordinator whether its rescale was given up at most this often


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
        return _SESSION


class Session:
    """One worker process's membership of a job: everything that outlives one call of the user's function."""

    def __init__(self, worker: str, url: str, options: AgentOptions | None = None, *, job: str = "") -> None:
        from elastic.train.rendezvous import RendezvousClient

        self.worker = worker
        self.job = job
        self.opts = options or AgentOptions()
        self.client = RendezvousClient(url, worker, retry_s=self.opts.coordinator_timeout_s)
        self.config: dict[str, Any] = {}
        self.phase = "new"  # new | registered | training | broken | done | left
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
        reg = self.client.call("register", pid=os.getpid(), host=socket.gethostname())
        self.config = dict(reg.get("config") or {})
        self.job = str(reg.get("job") or self.job)
        self._beat = threading.Thread(target=self._heartbeat, args=(float(reg.get("heartbeat_interval_s", 1.0)),),
                                      name=f"heartbeat-{self.worker}", daemon=True)
        self._beat.start()
        self.phase = "registered"
        return self.config

    def _wait_directive(self) -> Any:
        """A registered worker with no generation polls until a directive lists it; None when the job ends."""
        from elastic.train.rendezvous import Directive

        while True:
            resp = self.client.call("poll", wait_s=_LONG_POLL_S)
            if resp["action"] == "join":
                return Directive.from_json(resp["directive"])
            if resp["action"] == "exit":
                self.reasons.append(str(resp.get("reason", "")))
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
        from elastic.train.rendezvous import Directive

        while True:
            if self.phase not in ("training", "broken"):
                return False
            broken = self.phase == "broken"
            result, self._last_result = self._last_result, None
            gave_up, self._gave_up = self._gave_up, None
            resp = self.client.call("step", generation=self.gen, step=step, result=result,
                                    **({"wait_s": _LONG_POLL_S} if broken else {}),
                                    **({"gave_up": gave_up} if gave_up else {}))
            action = resp["action"]
            if action == "go" and not broken:
                if resp.get("give_up") is not None:  # asked to give this step up before it began
                    self._give_up_req = (self.gen, int(resp["give_up"]))
                self.granted = self.next_step = step
                return True
            if action == "switch":
                d = Directive.from_json(resp["directive"])
                if d.commit_step is not None and self.applied < d.commit_step:
                    self._fail(f"recovery asks for step {d.commit_step}, whose update this worker did not apply "
                               f"(applied {self.applied})")
                    return False
                nxt = self._transition(d)
                if nxt is None:
                    return False
                step = self.next_step = nxt
            elif action == "break" and not broken:
                self._break(step, f"told to break: {resp.get('reason', '')}")
            elif action in ("hold", "break"):
                time.sleep(_REASK_S)
            elif action in ("stop", "finish"):
                log.info("worker %s: %s at step %d (%s)", self.worker, action, step, resp.get("reason", ""))
                self.reasons.append(f"{action}: {resp.get('reason', '')}")
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

    # ---- rescale ------------------------------------------------------------------------------------
    def _transition(self, d: Any) -> int | None:
        """Take part in directive ``d``; the step to go on at, or None when this worker no longer trains."""
        from elastic.reshard.plan import ReshardError
        from elastic.torch.reshard import NoPeers, execute_reshard, prepare_reshard

        t0 = time.perf_counter()
        clock = _Phases()
        was, will, first = self.worker in d.old_ranks, self.worker in d.workers, not d.old_ranks
        rec = RescaleRecord(d.switch_step, MeshLayout(self._dims(Layout.parse(d.layout)), tuple(range(len(d.workers)))),
                            done=False, role="stays" if was and will else "joins" if will else "leaves")
        if not first:
            self.records.append(rec)
        tag = f"{d.job}/u{d.generation}.{d.switch_step}"
        prep, built, error = None, None, ""
        self._replicated = None
        new_ranks: dict[str, int] = {}
        extras: Any = None
        # 1-3: before the meeting; any failure here is this member's error at the meeting
        try:
            if d.hold:
                raise SpecError("a user job cannot be paused into keepers; preempt it or give it GPUs")
            new_ranks = self._new_ranks(d, tag)
            # every member plans the way the publisher chose: a collective plan for some and a local
            # one for others would leave the first waiting in the exchange
            known = None if first else (self._replicated if self.worker == self._publisher(d)
                                        else self._shared(d, tag).get("replicated"))
            # replicas that only shrink: every member keeps its own copy and no byte crosses processes,
            # so no group of old and new members is built
            solo = known is not None and set(d.workers) <= set(d.old_ranks)
            clock.mark("ranks")
            self._building = d.generation
            self._comm_sockets.begin()
            if not first and not solo:
                self._union = self._raw_group(d, f"{tag}/union", sorted(d.members))
                if self.opts.device.startswith("cuda"):  # gloo carries no CUDA tensors point to point
                    self._union_bytes = self._raw_group(d, f"{tag}/union-nccl", sorted(d.members), nccl=True)
                clock.mark("union")
            if will:
                self._init_world(d, f"{tag}/train", new_ranks[self.worker], len(d.workers))
                clock.mark("world")
            self._building = None
            err = ""
            if will:
                built, err = self._build_new(d, new_ranks)
                clock.mark("build")
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            if not first:
                from elastic.torch.state import training_state

                # what is not a tensor comes from the first old member, through the store; a member whose
                # new model is wrong says so in the plan's exchange, where every member hears it
                extras = self._kept_extras if self.worker == self._publisher(d) else self._shared(d, tag)["extras"]
                want = len(extras["groups"])
                if built is not None and len(built[1].param_groups) != want:
                    err = (f"{self.worker}: build: the new optimizer has {len(built[1].param_groups)} parameter "
                           f"groups, the running one {want}; build the same optimizer on every layout")
                dst = training_state(built[0], built[1], init_optimizer=True) if built is not None and not err else None
                group = NoPeers(sorted(d.members).index(self.worker), len(d.members)) if solo else self._union
                prep = prepare_reshard(self._src if was else None, dst, group=group, transport=self._union_bytes,
                                       errors=[err] if err else [], agree=False, known=known)
                clock.mark("plan")
            elif err:
                raise SpecError(err)
        except (SpecError, ReshardError) as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a lost peer, an aborted roll call: the meeting decides
            error = f"{type(e).__name__}: {_short(e, 300)}"
        finally:
            self._building = None
        if error and prep is None:
            # peers may be waiting for us in the union's collectives: their reads fail now, and they
            # arrive with their errors too, rather than at the groups' timeout
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            self._comm_sockets.cut()
        # 4. meet
        plan = {"new_ranks": new_ranks} if new_ranks else {}
        if prep is not None:
            plan.update(planned_bytes=prep.plan.bytes_planned, lower_bound_bytes=prep.plan.bytes_lower_bound,
                        plan_seconds=prep.plan_seconds)
        decision, reason = self._meet(d, prep.digest if prep is not None else _digest(new_ranks), plan, error)
        clock.mark("meet")
        if decision != "go":
            rec.error = f"rescale abandoned: {reason}"
            log.warning("worker %s: rescale to generation %d (%s) abandoned: %s", self.worker, d.generation,
                        d.layout, reason)
            self.reasons.append(rec.error)
            self._drop_union()
            if not was:
                self._drop_world()
                self._exit_notice()
                self._end("left")
                return None
            try:
                self._restore(d)
            except Exception as e:  # noqa: BLE001 - a peer lost meanwhile: the coordinator recovers the old layout
                self._stand_broken(d.switch_step, f"rebuilding {self.layout} after an abandoned rescale: "
                                                  f"{type(e).__name__}: {_short(e, 200)}")
            return d.switch_step
        # 5. move the bytes; a transactional rescale commits once every member has its part
        stats: Any = None
        try:
            if prep is not None:
                stats = execute_reshard(prep, verify=self.opts.verify_reshard)
                clock.mark("exchange")
            if d.rollback and not first:
                verdict, why = self._exchanged(d)
                clock.mark("commit")
                if verdict == "rollback":
                    raise _RolledBack(why)
                if verdict != "go":
                    self._drop_union()
                    self._drop_world()
                    self._exit_notice()
                    self._end("done")
                    return None
        except Exception as e:  # noqa: BLE001 - after go: back to the kept state, the coordinator recovers
            return self._exchange_broke(d, was, f"{type(e).__name__}: {_short(e, 200)}")
        self._drop_union()
        # 6. adopt (or leave)
        result = {"bytes_sent": getattr(stats, "bytes_sent", 0), "bytes_received": getattr(stats, "bytes_received", 0),
                  **{f"{k}_seconds": round(v, 4) for k, v in clock.seconds.items()},
                  "execute_seconds": getattr(stats, "execute_seconds", 0.0),
                  **({"describe_exchange_seconds": round(prep.exchange_seconds, 4),
                      "plan_compute_seconds": round(prep.plan_seconds, 4)} if prep is not None else {})}
        rec.bytes_moved = getattr(stats, "bytes_moved", 0)
        rec.bytes_lower_bound = getattr(stats, "bytes_lower_bound", 0)
        if not will:
            self._src = None
            self.model = self.optimizer = self.scheduler = None
            rec.done, rec.seconds = True, time.perf_counter() - t0
            self.client.call("result", generation=d.generation, ok=True, stats=result)
            self._leave()
            return None
        assert built is not None
        self._adopt(built, extras)
        self.gen, self.layout, self.ranks = d.generation, Layout.parse(d.layout), dict(new_ranks)
        self._checks = bool(getattr(d, "give_up_checks", False))
        self._src, self.phase = None, "training"
        self.applied = d.switch_step - 1
        rec.done, rec.seconds = True, time.perf_counter() - t0
        # the parameters the code really builds (DTensors count their global size), for the planner's check
        params = sum(p.numel() for p in self.model.parameters()) if first else None
        self.client.call("result", generation=d.generation, ok=True,
                         stats={**result, "rank": new_ranks[self.worker], "seconds": rec.seconds,
                                **({"params": params} if params is not None else {})})
        return d.switch_step

    def _new_ranks(self, d: Any, tag: str) -> dict[str, int]:
        """Which worker takes which position of the new mesh (the same map on every member)."""
        if not d.old_ranks:
            return {w: i for i, w in enumerate(d.workers)}
        if d.commit_step is not None:  # a recovery: the old groups are broken, the directive decides
            if self.worker in d.old_ranks and self._src is None and self.model is not None:
                self._src = self._freeze()
                self._drop_world()
            ranks = _recovery_ranks(d)
            if self.worker == self._publisher(d):
                self._publish(d, tag, ranks)
            return ranks
        if self.worker in d.old_ranks:
            if self._src is None:
                from elastic.torch.reshard import mesh_order
                from elastic.torch.state import training_state

                live = training_state(self.model, self.optimizer)
                old = {w: r for w, r in d.old_ranks.items()}
                n_old = len(old)
                joiners = [w for w in d.workers if w not in old]
                ids = {**old, **{w: n_old + i for i, w in enumerate(joiners)}}
                lay = Layout.parse(d.layout)
                replicas = _replicas_only(live, self.layout, lay)
                if replicas:
                    # every old member holds all of it: any order keeps every byte local, and each
                    # member knows this one without asking its peers (a collective saved in the pause)
                    order = sorted((ids[w] for w in d.workers), key=lambda i: (i >= n_old, i))
                else:
                    dims = self._dims(lay)
                    order = mesh_order(live, tuple(n for _, n in dims), new_members=[ids[w] for w in d.workers],
                                       mesh_dim_names=tuple(k for k, _ in dims))
                by_id = {v: w for w, v in ids.items()}
                ranks = {by_id[i]: pos for pos, i in enumerate(order)}
                self._src = self._freeze(live)
                self._drop_world()
                if replicas and self.worker == self._publisher(d):
                    # the whole state, which every old member holds: each member plans from it and
                    # its own new state, without the descriptions' exchange (another collective)
                    self._replicated = _replicated_source(self._src, d)
            else:  # back from an abandoned rescale's rebuild that itself broke: the directive decides
                ranks = {w: i for i, w in enumerate(d.workers)}
            if self.worker == self._publisher(d):
                self._publish(d, tag, ranks)
            return ranks
        return dict(self._shared(d, tag)["ranks"])

    def _publish(self, d: Any, tag: str, ranks: dict[str, int]) -> None:
        """The first old member's word to the others: the new positions and what is not a tensor."""
        from elastic.train.rendezvous import sign

        payload = pickle.dumps({"ranks": ranks, "extras": self._kept_extras, "replicated": self._replicated})
        self._store_for(d).set(f"{tag}/shared", sign(self.client.secret, payload))

    def _shared(self, d: Any, tag: str) -> dict[str, Any]:
        """What the first old member published for directive ``d`` (waiting for it, given up with the rescale)."""
        if self._shared_cache is not None and self._shared_cache[0] == tag:
            return self._shared_cache[1]
        key = f"{tag}/shared"
        store = self._store_for(d)
        aborted = self._aborter(d.generation)
        deadline = time.monotonic() + self.opts.pg_timeout_s
        delay = 0.001
        while not store.check([key]):
            if (why := aborted()) is not None:
                raise RuntimeError(f"gloo rendezvous given up waiting for the first old member's word: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {self.opts.pg_timeout_s:g} s waiting for the first old "
                                   "member's word (new ranks, optimizer settings)")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        from elastic.train.rendezvous import verify

        # the store has no authentication: only what a holder of the job's secret signed is unpickled
        out = pickle.loads(verify(self.client.secret, store.get(key), f"entry {key}"))  # noqa: S301
        self._shared_cache = (tag, out)
        return out

    def _control_ports(self, d: Any) -> set[int]:
        """Ports of the connections that are not gloo's: the coordinator's HTTP and the job's store."""
        from urllib.parse import urlparse

        return {int(d.store_port), int(urlparse(self.client.url).port or 80)}

    @staticmethod
    def _publisher(d: Any) -> str:
        return min(d.old_ranks, key=d.old_ranks.__getitem__)

    def _dims(self, layout: Layout) -> tuple[tuple[str, int], ...]:
        from elastic.train.userjob import mesh_of_json

        return mesh_of_json(self.config, layout)

    def _build_new(self, d: Any, new_ranks: dict[str, int]) -> tuple[Any, str]:
        """The user's ``build`` on the new mesh: ``(built, "")`` or ``(None, error)``."""
        from torch.distributed.device_mesh import DeviceMesh

        lay = Layout.parse(d.layout)
        dims = self._dims(lay)
        ml = MeshLayout(dims, tuple(range(len(d.workers))))
        try:
            mesh = DeviceMesh(self.opts.device.split(":")[0], torch.arange(len(d.workers)).reshape(ml.shape),
                              mesh_dim_names=ml.names)
            self.world = World(ml, mesh, new_ranks[self.worker], generation=d.generation, device=self.opts.device,
                               dp_name=self.config.get("mesh_dims", {}).get("dp"))
            if self.build is None:
                raise SpecError("no build: create the Manager (Manager(build, ...)) before the job's first directive")
            built = self.build(self.world)
            if not isinstance(built, tuple) or len(built) not in (2, 3):
                raise SpecError("build(world) must return (model, optimizer) or (model, optimizer, scheduler)")
            return built, ""
        except Exception as e:  # noqa: BLE001 - every member must hear of it and abandon together
            log.warning("worker %s: build on %s raised", self.worker, d.layout, exc_info=True)
            return None, f"{self.worker}: build raised {type(e).__name__}: {_short(e, 300)}"

    def _extras(self) -> dict[str, Any]:
        """What is not a tensor: the optimizer's hyperparameters (a scheduler changes them), the
        scheduler's state, the user's own state objects."""
        return {**carried(self.optimizer, self.scheduler, self.user_state), "applied": self.applied}

    def _adopt(self, built: tuple, extras: Any) -> None:
        self.model, self.optimizer = built[0], built[1]
        self.scheduler = built[2] if len(built) == 3 else None
        if extras is not None:
            apply_carried(extras, self.optimizer, self.scheduler, self.user_state)
        self._hook(self.optimizer)

    def _hook(self, opt: Any) -> None:
        """Know whether an optimizer update is in progress (a step broken inside it cannot be recovered)
        and which step's update completed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooked = None
        self._in_update = False
        if opt is None or not hasattr(opt, "register_step_pre_hook"):
            return

        def pre(*_: Any) -> None:
            self._in_update = True

        def post(*_: Any) -> None:
            self._in_update = False
            if self.in_flight is not None:
                self.applied = self.in_flight

        self._hooks = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
        self._hooked = opt

    def _restore(self, d: Any) -> None:
        """An abandoned rescale: the old layout again, from the kept state (every byte local)."""
        from elastic.torch.reshard import reshard
        from elastic.torch.state import training_state

        assert self.layout is not None
        if self._src is None and self.model is not None:
            return  # the old groups were never dropped: the old model trains on as it is
        mine = self._kept_extras
        self._drop_world()
        old = {w: r for w, r in self.ranks.items()}
        fake = _Restore(d.job, self.gen, str(self.layout), tuple(sorted(old, key=old.__getitem__)), d.store_host,
                        d.store_port)
        self._building = self.gen
        try:
            self._comm_sockets.begin()
            self._init_world(fake, f"{d.job}/u{d.generation}.{d.switch_step}/restore", old[self.worker], len(old))
            built, err = self._build_new(fake, old)
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            if err:
                raise SpecError(f"rebuilding the old layout {self.layout} after the abandoned rescale: {err}")
            stats = reshard(self._src, training_state(built[0], built[1], init_optimizer=True), group=None)
        finally:
            self._building = None
        self._adopt(built, mine)
        self._src = None
        self.phase = "training"
        log.info("worker %s: back on %s (rebuilt, %d bytes moved)", self.worker, self.layout, stats.bytes_moved)

    def _freeze(self, live: Any = None) -> Any:
        from elastic.torch.reshard import freeze
        from elastic.torch.state import training_state

        self._kept_extras = self._extras()
        return freeze(live if live is not None else training_state(self.model, self.optimizer))

    def _exchange_broke(self, d: Any, was: bool, error: str) -> int | None:
        """A peer was lost after ``go``, before the commit: old members stand again as the old
        generation's members on their kept state; a joiner has nothing to go back to."""
        log.warning("worker %s: the rescale to generation %d broke (%s)", self.worker, d.generation, error)
        self._comm_sockets.cut()
        self._drop_union()
        self._drop_world()
        if not was:
            try:
                self.client.call("broken", generation=d.generation, step=d.switch_step, applied=-1, error=error,
                                 ready=None, dirty=False, local_apply=False)
            except Exception:  # noqa: BLE001
                pass
            self._exit_notice()
            self._end("left")
            return None
        self._stand_broken(d.switch_step, f"rescale to generation {d.generation} broke: {error}")
        return d.switch_step

    def _stand_broken(self, step: int, error: str) -> None:
        """Stand as a member of the current generation whose step ``step`` broke, holding the kept state,
        and report it; the coordinator's recovery directive comes as a ``switch`` (see :meth:`ask`)."""
        self._drop_world()
        self.model = self.optimizer = self.scheduler = None
        self.phase = "broken"
        self.client.call("broken", generation=self.gen, step=step, applied=self.applied, error=error, ready=None,
                         dirty=False, local_apply=True)

    # ---- groups ---------------------------------------------------------------------------------
    def _store_for(self, d: Any) -> Any:
        if self._store is None:
            self._store = dist.TCPStore(d.store_host, d.store_port, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.opts.pg_timeout_s))
        return self._store

    def _roll_call(self, d: Any, store: Any, rank: int, world: int, building: int) -> None:
        from elastic.train.abortable import roll_call

        roll_call(store, "roll-call", rank, world, self._aborter(building), self.opts.pg_timeout_s)

    def _raw_group(self, d: Any, prefix: str, members: list[str], *, nccl: bool = False) -> Any:
        store = dist.PrefixStore(prefix + "/", self._store_for(d))
        me = members.index(self.worker)
        self._roll_call(d, store, me, len(members), d.generation)
        timeout = datetime.timedelta(seconds=self.opts.pg_timeout_s)
        if nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, me, len(members), opts)
        return dist.ProcessGroupGloo(store, me, len(members), timeout)

    def _init_world(self, d: Any, prefix: str, rank: int, n: int) -> None:
        from elastic.torch.caches import clear_dtensor_caches

        self._drop_world()
        store = dist.PrefixStore(prefix + "/", self._store_for(d))
        self._roll_call(d, store, rank, n, self._building if self._building is not None else d.generation)
        dist.init_process_group("gloo" if self.opts.device == "cpu" else "cpu:gloo,cuda:nccl", store=store,
                                rank=rank, world_size=n, timeout=datetime.timedelta(seconds=self.opts.pg_timeout_s))
        clear_dtensor_caches()

    def _drop_world(self) -> None:
        from elastic.torch.caches import clear_dtensor_caches

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean teardown
                pass
        self.world = None
        clear_dtensor_caches()

    def _drop_union(self) -> None:
        for pg in (self._union, self._union_bytes):
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001
                    pass
        self._union = self._union_bytes = None

    def _aborter(self, building: int) -> Callable[[], str | None]:
        """``aborted()`` for a roll call of groups for generation ``building``: the coordinator's reason
        for giving it up (abandoned, rolled back, a peer lost, the job failed), or None."""
        from elastic.train.rendezvous import RendezvousClient, RendezvousError

        asked = [time.monotonic()]
        asker = RendezvousClient(self.client.url, self.worker, timeout_s=5.0, retry_s=0,
                                 secret=self.client.secret)

        def aborted() -> str | None:
            if time.monotonic() - asked[0] < _ASK_ABORT_S:
                return None
            asked[0] = time.monotonic()
            try:
                resp = asker.call("heartbeat", generation=self.gen, building=building)
            except RendezvousError:
                return None
            return str(resp.get("abort_reason") or "given up") if resp.get("abort") == building else None

        return aborted

    # ---- coordinator I/O --------------------------------------------------------------------------
    def _meet(self, d: Any, digest: str, plan: dict[str, Any], error: str) -> tuple[str, str]:
        while True:
            resp = self.client.call("arrive", generation=d.generation, digest=digest, plan=plan, error=error,
                                    wait_s=_LONG_POLL_S)
            if resp["decision"] != "wait":
                return resp["decision"], str(resp.get("reason", ""))
            time.sleep(_REASK_S)

    def _exchanged(self, d: Any) -> tuple[str, str]:
        while True:
            resp = self.client.call("exchanged", generation=d.generation, wait_s=_LONG_POLL_S)
            if resp["decision"] != "wait":
                return resp["decision"], str(resp.get("reason", ""))
            time.sleep(_REASK_S)

    def _exit_notice(self) -> None:
        try:
            self.client.call("exit")
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, reason: str) -> None:
        self.reasons.append(reason)
        try:
            self.client.call("fail", reason=reason)
        except Exception:  # noqa: BLE001
            pass
        self._end("done")

    def report_fail(self, reason: str) -> None:
        """The user's function failed (not a lost peer): the job's failure reason (or a lost worker)."""
        if self.phase in ("done", "left"):
            return
        self._fail(reason)

    def _leave(self) -> None:
        log.info("worker %s: left at generation %d", self.worker, self.gen)
        self._exit_notice()
        self._end("left")
        self._drop_world()
        if self.opts.exit_on_leave:
            from elastic.reshard import execute as ex

            ex.fast_exit(0)

    def _end(self, phase: str) -> None:
        self.phase = phase
        if phase in ("done", "left"):
            self._stop.set()

    def _heartbeat(self, interval: float) -> None:
        """Beat; note a lost peer of our generation (the step gives up at its next micro-batch); exit
        the process if the coordinator is gone or the job failed and we are stuck."""
        from elastic.train.rendezvous import RendezvousClient, RendezvousError

        lost_since: float | None = None
        failed_since: float | None = None
        beat = RendezvousClient(self.client.url, self.worker, timeout_s=interval + 5.0, retry_s=0,
                                secret=self.client.secret)
        pause = interval
        while not self._stop.wait(pause):
            now = time.monotonic()
            try:
                sent_from = self.gen
                resp = beat.call("heartbeat", generation=sent_from, wait_s=interval,
                                 **({"building": self._building} if self._building is not None else {}))
                lost_since = None
            except RendezvousError as e:
                lost_since = lost_since or now
                if now - lost_since > self.opts.coordinator_timeout_s:
                    _hard_exit(3, f"worker {self.worker}: coordinator unreachable for {now - lost_since:.0f} s "
                                  f"({e}); exiting")
                pause = interval
                continue
            pause = 0.0 if time.monotonic() - now >= 0.5 * interval else interval
            if resp.get("interrupt") is not None and int(resp["interrupt"]) == sent_from:
                if self._interrupt_gen != sent_from:
                    log.warning("worker %s: a peer of generation %d was lost; the step gives up", self.worker,
                                sent_from)
                    # a collective this process is blocked in waits for a peer that broke out of its
                    # own: gloo has no way to interrupt it but its connections failing
                    self._comm_sockets.cut()
                self._interrupt_gen = sent_from
            if (g := resp.get("give_up")) is not None and int(g["generation"]) == sent_from:
                self._give_up_req = (sent_from, int(g["step"]))  # checked before the next micro-batch
            if resp.get("failed"):
                failed_since = failed_since or now
                if now - failed_since > min(self.opts.pg_timeout_s, FAILED_JOB_GRACE_S):
                    _hard_exit(1, f"worker {self.worker}: job failed ({resp.get('reason')}); exiting")


def _copied(sd: Any) -> Any:
    """A state dict detached from the live object (tensors cloned), to load back later."""
    import copy

    return copy.deepcopy(sd)


class _RolledBack(RuntimeError):
    pass


class _Sockets:
    """The TCP connections a generation's gloo groups opened, to cut when a peer is lost.

    A collective blocked on a peer that is alive but broke out of its own collective (its
    neighbour in the ring died) waits for the group's timeout: gloo's ``shutdown()`` and
    ``abort()`` leave the connections open, and destroying the groups does not close them
    while anything still references them (DTensors, FSDP, a traceback). Shutting the sockets
    down makes every read and write on them fail at once, on both ends: the blocked collective
    raises, and the process reports to the coordinator. The sockets are told apart by when they
    were opened (while the generation's groups were built) and by their peer (not the
    coordinator's HTTP port nor the store's). Linux only (``/proc/self/fd``); elsewhere nothing
    is cut and a blocked peer waits for its timeout.
    """

    def __init__(self) -> None:
        self._before: dict[int, str] | None = None  # the sockets open at begin(), until end()
        self.fds: dict[int, str] = {}

    @staticmethod
    def _open() -> dict[int, str]:
        out: dict[int, str] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return out
        for name in names:
            try:
                link = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if link.startswith("socket:"):
                out[int(name)] = link
        return out

    def begin(self) -> None:
        self._before = self._open()

    def end(self, exclude_ports: set[int]) -> None:
        if self._before is None:  # no begin(): every socket would look new (Ray's own among them)
            return
        before, self._before = self._before, None
        new = {fd: link for fd, link in self._open().items() if before.get(fd) != link}
        for fd, link in new.items():
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    peer = s.getpeername()
            except OSError:
                continue  # a listener, or closed meanwhile
            if int(peer[1]) not in exclude_ports:
                self.fds[fd] = link

    def cut(self) -> None:
        fds, self.fds = self.fds, {}
        for fd, link in fds.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue  # closed, and the number reused by another socket
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass(frozen=True)
class _Restore:
    """The old generation as a directive-like value (for rebuilding it after an abandoned rescale)."""

    job: str
    generation: int
    layout: str
    workers: tuple[str, ...]
    store_host: str
    store_port: int


def _recovery_ranks(d: Any) -> dict[str, int]:
    """Recovery positions: each survivor keeps its tensor/pipeline coordinate, replicas renumbered in the
    directive's order (its complete replicas first); the directive's order where that is no bijection."""
    old, new = Layout.parse(d.old_layout), Layout.parse(d.layout)
    replicas: dict[int, int] = {}
    out: dict[str, int] = {}
    for w in d.workers:
        t, r, p = old.coords(d.old_ranks[w])
        k = replicas.setdefault(r, len(replicas))
        if k >= new.dp or t >= new.tp or p >= new.pp:
            return {w: i for i, w in enumerate(d.workers)}
        out[w] = new.rank(t, k, p)
    if sorted(out.values()) != list(range(len(d.workers))):
        return {w: i for i, w in enumerate(d.workers)}
    return out


def _replicas_only(live: Any, old: Layout | None, new: Layout) -> bool:
    """Plain data parallelism on both sides: no tensor or pipeline split, and no DTensor in the
    state (no FSDP shard): every old member's state is the whole of it."""
    from elastic.torch.regions import is_dtensor

    return (old is not None and old.tp == old.pp == new.tp == new.pp == 1
            and not any(is_dtensor(t) for t in live.values()))


def _replicated_source(src: Any, d: Any) -> Any:
    """The old state as every member's known source of directive ``d`` (ranks in the union group,
    whose members are ``d.members`` in sorted order); None (exchange the descriptions) if it holds
    a DTensor after all."""
    from elastic.reshard.plan import ReshardError
    from elastic.torch.reshard import replicated

    members = sorted(d.members)
    try:
        return replicated(src, [i for i, w in enumerate(members) if w in d.old_ranks],
                          [i for i, w in enumerate(members) if w in d.workers])
    except ReshardError:
        return None


def _digest(ranks: dict[str, int]) -> str:
    return hashlib.blake2b(json.dumps(sorted(ranks.items())).encode(), digest_size=12).hexdigest()


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

