"""The training engine of one rank: model shard + 1F1B pipeline + DP/ZeRO-1 + Adam.

What it is for: ``TrainEngine(cfg, layout, rank, state=..., pg=...)`` is everything one worker
needs to run optimizer steps of a 3D-parallel (TP x PP x DP) GPT under one layout
generation (``vpp > 1``: Megatron's interleaved 1F1B over ``vpp`` model chunks per rank; a
mixture-of-experts model with ``ep > 1``: experts split over ``ep`` dp ranks, see
:mod:`elastic.train.moe`), and to hand its complete training state to the resharder between
steps:

* ``state()`` returns the *live* tensors, keyed ``(tensor name, kind)`` exactly as
  :func:`elastic.reshard.spec.sharding_spec` names and shapes this rank's pieces;
* ``TrainEngine(..., state=new_state)`` adopts the tensors the resharder returns, without
  copying them, and continues at the same step.

The maths is layout-invariant: ``dp * micro_batch * grad_accum == global_batch`` at every
layout, every layout reads the same samples at a step (:mod:`elastic.train.data`), and a
fresh engine initialises each *global* tensor from a generator seeded by
``(seed, tensor name)`` before slicing its box, so all layouts start from the same weights
and follow the same loss curve up to floating-point reduction order.

Must not: decide layouts, talk to the controller, or rendezvous (the worker agent does
those); create or destroy the members' process group (it only builds subgroups of it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic.model import Layout, ModelSpec, SpecError
from elastic.parallel.planner import capped_micro_batch
from elastic.reshard.execute_wire import State
from elastic.reshard.spec import (
    FP32_KINDS,
    MIXED_KINDS,
    Kind,
    ShardingSpec,
    box_shape,
    sharding_spec,
    split_range,
)
from elastic.train.data import SyntheticData, _mix
from elastic.train.groups import DEFAULT_TIMEOUT, ParallelGroups, StepGivenUp, StepInterrupted, build_groups
from elastic.train.memory import MeasuredMemory, MemoryMeter
from elastic.train.model import GPTStage, check_sequence_split, check_supported
from elastic.train.optim import AdamHyper, ShardedAdam
from elastic.train.pipeline import P2PShape, interleaved_one_f_one_b, one_f_one_b

MEMORY_FIRST_STEPS = 2  # a new layout's first steps are measured: its peak is known at once
MEMORY_EVERY = 100  # then every this many steps

INIT_STD = 0.02
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def precision_dtype(precision: str | None) -> torch.dtype:
    """The weights' dtype of a job spec's ``precision`` (bf16 weights keep an fp32 master copy);
    none named: float32, a CPU's."""
    return torch.float32 if precision is None else _PRECISION_DTYPES[precision]


@dataclass(frozen=True)
class TrainConfig:
    """What a training job computes; identical for every layout of the job."""

    model: ModelSpec
    global_batch: int
    micro_batch: int = 1
    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    data_noise: float = 0.1
    # When set, each layout uses the largest micro-batch <= this cap that divides its
    # per-replica batch (keeping >= pp micro-batches so the pipeline fills), instead of the
    # fixed ``micro_batch``: fewer, larger micro-batches at small dp. The global batch and
    # the samples of each step are unchanged, so the loss curve is too (up to float
    # reduction order).
    micro_batch_cap: int | None = None
    # Weight of a mixture-of-experts model's sequence-wise balance loss (DeepSeek-V3's
    # complementary loss, see elastic.train.moe) in the objective; 0 turns it off.
    moe_balance: float = 0.01
    # A test and rehearsal aid: the bytes one rank may hold (weights, gradients, optimizer state and
    # the activations autograd saves), standing in for a device's capacity on CPU. A step that would
    # hold more raises torch.OutOfMemoryError where it goes over, as the CUDA allocator does (see
    # elastic.train.memory); every step is then measured. None: no limit (on a GPU the allocator's own).
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.micro_batch < 1:
            raise SpecError(f"global_batch={self.global_batch}, micro_batch={self.micro_batch}: both must be >= 1")
        if self.micro_batch_cap is not None and self.micro_batch_cap < 1:
            raise SpecError(f"micro_batch_cap={self.micro_batch_cap}: must be >= 1 (or None for a fixed micro_batch)")
        if self.memory_limit_bytes is not None and (isinstance(self.memory_limit_bytes, bool)
                                                    or not isinstance(self.memory_limit_bytes, int)
                                                    or self.memory_limit_bytes < 1):
            raise SpecError(f"memory_limit_bytes={self.memory_limit_bytes!r}: the bytes one rank may hold must be an "
                            "integer >= 1 (or None for no limit)")
        if not self.moe_balance >= 0:
            raise SpecError(f"moe_balance={self.moe_balance}: the balance loss weight must be >= 0 (0 turns it off)")
        if self.dtype not in _DTYPES:
            raise SpecError(f"dtype={self.dtype}: use torch.float32 (CPU default), torch.float64 or torch.bfloat16")
        check_supported(self.model)

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """State kinds: bf16 weights carry an fp32 master copy; fp32/fp64 weights are their own."""
        return MIXED_KINDS if self.dtype == torch.bfloat16 else FP32_KINDS

    @property
    def optimizer_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def micro_batch_for(self, layout: Layout) -> int:
        """The micro-batch size under ``layout`` (``micro_batch``, or chosen under ``micro_batch_cap``)."""
        if self.micro_batch_cap is None or self.global_batch % layout.dp:
            return self.micro_batch
        mb = capped_micro_batch(self.global_batch // layout.dp, self.micro_batch_cap, layout.pp, layout.vpp)
        return self.micro_batch if mb is None else mb

    def grad_accum(self, layout: Layout) -> int:
        """Micro-batches per step and DP replica; raises if the global batch does not split (or, with
        ``vpp > 1``, if they are not a multiple of ``pp``, as the interleaved schedule needs)."""
        mb = self.micro_batch_for(layout)
        per_step = layout.dp * mb
        if self.global_batch % per_step:
            raise SpecError(
                f"global_batch={self.global_batch} is not divisible by dp*micro_batch={layout.dp}*{mb}"
                f"={per_step} under layout {layout}; choose dp and micro_batch so that "
                "dp * micro_batch * grad_accum == global_batch"
            )
        n = self.global_batch // per_step
        if layout.vpp > 1 and n % layout.pp:
            raise SpecError(
                f"layout {layout}: the interleaved schedule (vpp={layout.vpp}) needs grad_accum, the micro-batches "
                f"per step and replica, to be a multiple of pp={layout.pp}, but grad_accum = global_batch / "
                f"(dp * micro_batch) = {self.global_batch}/({layout.dp}*{mb}) = {n}; change global_batch or "
                "micro_batch, or use vpp=1"
            )
        return n

    def kind_dtype(self, kind: str) -> torch.dtype:
        return self.dtype if kind == "param" else self.optimizer_dtype


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean token loss over the global batch (the same on every rank)
    tokens: int  # tokens in the global batch
    seconds: float  # wall time of this rank's step
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class PartialStep:
    """The work of a step given up part-way by a rescale, kept for the next layout (``StepGivenUp.carry``).

    Every replica of the old layout (``dp`` replicas of ``grad_accum`` micro-batches of
    ``micro_batch`` samples) had run its first ``micro`` micro-batches of ``step``. ``grads``: this
    rank's gradient of those samples, summed over the replicas and in the step's final units
    (1 / global batch per sample), so identical on every DP replica of the same TP coordinate and
    shaped like this rank's parameters; ``loss_sum``: the sum of those samples' mean losses, over
    every replica. A new layout finishes the step from it (:meth:`TrainEngine.resume_partial`):
    only the samples not yet computed are; one rank per TP coordinate holding the same parameter
    boxes adds the kept work. A rank that adds nothing (a joiner) holds ``grads=None``.
    """

    step: int
    micro: int
    dp: int
    grad_accum: int
    micro_batch: int
    grads: dict[str, torch.Tensor] | None
    loss_sum: float

    def remaining(self) -> list[int]:
        """Global sample indices of the step not computed yet, in replica-major order (every rank alike)."""
        out: list[int] = []
        per_replica = self.grad_accum * self.micro_batch
        for d in range(self.dp):
            out.extend(range(d * per_replica + self.micro * self.micro_batch, (d + 1) * per_replica))
        return out


def init_global_tensor(name: str, kind: str, shape: tuple[int, ...], cfg: TrainConfig) -> torch.Tensor:
    """The full (unsharded) initial value of ``(name, kind)``: the same on every layout.

    Weights ~ N(0, 0.02) (output projections scaled by 1/sqrt(2*layers), as GPT-2), norm
    weights 1, biases 0, Adam moments 0; ``master`` equals the weight in fp32.
    """
    dtype = cfg.kind_dtype(kind)
    if kind in ("exp_avg", "exp_avg_sq"):
        return torch.zeros(shape, dtype=dtype)
    leaf = name.rsplit(".", 2)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(_mix(cfg.seed, zlib.crc32(name.encode())))
    std = INIT_STD
    if leaf[-2] in ("o", "down", "fc2"):
        std /= (2 * cfg.model.layers) ** 0.5
    w = torch.randn(shape, generator=g, dtype=torch.float32) * std
    return w.to(dtype)


def _slice(t: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)].contiguous()


class TrainEngine:
    """One rank of a 3D-parallel training job under one layout generation."""

    def __init__(self, cfg: TrainConfig, layout: Layout, rank: int, *, state: State | None = None,
                 pg: dist.ProcessGroup | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        # 1. validate everything before touching the network (the spec refuses ep > 1 without
        #    experts, or not dividing them)
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.spec: ShardingSpec = sharding_spec(cfg.model, layout, cfg.kinds)
        self.grad_accum = cfg.grad_accum(layout)
        self.micro_batch = cfg.micro_batch_for(layout)
        self.tp_rank, self.dp_rank, self.pp_rank = layout.coords(rank)
        check_sequence_split(cfg.model, layout.tp)  # before any communicator is built
        self.pieces = self.spec.rank_pieces(rank)
        if state is not None:
            _check_state(state, self.pieces, cfg, rank, layout)
        # 2. communicators of this generation
        self.groups: ParallelGroups = build_groups(
            layout, rank, pg, tied_embeddings=cfg.model.tie_embeddings, timeout=timeout, device=cfg.device)
        # 3. the model shard, holding exactly the state's tensors
        self._state: State = dict(state) if state is not None else self._initial_state()
        self.stage = GPTStage(self.spec, rank, self.groups.tp, cfg.dtype, cfg.device, ep=self.groups.ep)
        self.params: dict[str, nn.Parameter] = {}
        for (name, kind) in self.pieces:  # spec order: DP and ZeRO buffers pack in the same order everywhere
            if kind == "param":
                self.params[name] = _install(self.stage, name, self._state[(name, kind)])
        self.stage._check_against(self.spec, rank)
        # parameters whose replicas are the ranks holding the same experts, not every DP rank (ep > 1)
        self.expert_names: frozenset[str] = frozenset(
            n for n in self.params if layout.ep > 1 and self.spec.tensor(n).expert)
        # 4. optimizer over the state's optimizer tensors; with ep > 1 the experts' ZeRO-1 slices
        #    are shared among their own replicas
        hp = AdamHyper(cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
        if not self.expert_names:
            self.optimizer: ShardedAdam | _Adams = ShardedAdam(
                self.spec, rank, self.params, self._state, self.groups.dp, hp)
        else:
            dense = {n: p for n, p in self.params.items() if n not in self.expert_names}
            experts = {n: p for n, p in self.params.items() if n in self.expert_names}
            assert self.groups.edp is not None
            self.optimizer = _Adams([ShardedAdam(self.spec, rank, dense, self._state, self.groups.dp, hp),
                                     ShardedAdam(self.spec, rank, experts, self._state, self.groups.edp, hp)])
        self.data = SyntheticData(cfg.model.vocab, cfg.model.seq_len, cfg.seed, cfg.data_noise)
        self.ready_step: int | None = None  # gradients of this step reduced, update not applied yet
        self.dirty = False  # an optimizer update was interrupted half-way
        self._interrupted = threading.Event()  # a peer was lost: give the running step up (interrupt())
        # A rescale may ask for the step in progress (give_up()): every rank must have this on, or
        # none (the agent sets it from its generation's directive); pp = 1 only (see can_give_up)
        self.give_up_checks = False
        # ... and keep the work of the micro-batches done (StepGivenUp.carry) for the next layout,
        # at the cost of one DP all-reduce of the gradients (every rank alike, like the checks)
        self.keep_given_up = False
        self._give_up_step: int | None = None
        self._carry: PartialStep | None = None  # a given-up step's work to finish from (resume_partial)
        self._contribute = False  # ... and whether this rank adds it
        self._step_started = 0.0
        self.act = P2PShape(self.stage.boundary_shape(self.micro_batch), cfg.dtype, cfg.device)
        self.meter = MemoryMeter()
        self.memory: MeasuredMemory | None = None  # the last measured step's memory by component
        # the last step that ran out of memory: what it held when it did (its gradients counted whole)
        self.oom_memory: MeasuredMemory | None = None
        self._steps_run = 0

    # ---- state ------------------------------------------------------------------------------
    def _initial_state(self) -> State:
        out: State = {}
        full: dict[str, torch.Tensor] = {}  # one global weight per tensor, shared by param and master
        for (name, kind), box in self.pieces.items():
            if kind in ("exp_avg", "exp_avg_sq"):
                out[(name, kind)] = torch.zeros(box_shape(box), dtype=self.cfg.kind_dtype(kind), device=self.cfg.device)
                continue
            if name not in full:
                full[name] = init_global_tensor(name, "master", self.spec.tensor(name).shape, self.cfg)
            out[(name, kind)] = _slice(full[name], box).to(self.cfg.kind_dtype(kind)).to(self.cfg.device)
        return out

    def state(self) -> State:
        """The live tensors (no copies): params (their ``.data``) and optimizer state."""
        out: State = {}
        for (name, kind) in self.pieces:
            out[(name, kind)] = self.params[name].data if kind == "param" else self._state[(name, kind)]
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    # ---- one optimizer step -----------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """One optimizer step over the global batch of ``step``. The first steps of an engine (a
        layout's) and every ``MEMORY_EVERY``-th step are measured: ``self.memory`` then holds what
        the step held by component (:mod:`elastic.train.memory`). Not every step: the meter's hook
        on each tensor autograd saves costs the step several percent on small ops.

        Failure points, for recovery from surviving replicas (see :meth:`recovery_state`): until
        the commit (step 4) nothing of the state has changed; a rank that passed the commit
        knows every rank had reduced its gradients, so any rank left with ``ready_step ==
        step`` may apply the step later (:meth:`apply_ready`) and all end on the same state.
        """
        self._steps_run += 1
        limit = self.cfg.memory_limit_bytes
        if limit is None and self._steps_run > MEMORY_FIRST_STEPS and step % MEMORY_EVERY:
            return self._oom_guarded(step, self._train_step)
        # with a limit: what the rank holds besides activations, its gradients as large as its weights
        base = 0 if limit is None else self._held_bytes()

        def measured(s: int) -> StepResult:
            with self.meter.track(self.params.values(), self.cfg.device, limit=limit, base=base):
                return self._train_step(s)

        result = self._oom_guarded(step, measured)
        self.memory = self.meter.measure(self, step)
        return result

    def _held_bytes(self) -> int:
        """Bytes this rank holds through a step besides activations: weights, optimizer state and
        gradients of every parameter (as the measurement after a step counts them)."""
        weights = sum(p.numel() * p.element_size() for p in self.params.values())
        opt = sum(t.numel() * t.element_size() for (_, kind), t in self.state().items() if kind != "param")
        return 2 * weights + opt

    def _oom_guarded(self, step: int, run: Callable[[int], StepResult]) -> StepResult:
        """``run(step)``; a step that runs out of memory (``torch.OutOfMemoryError``: the GPU allocator,
        or ``memory_limit_bytes`` on CPU) is given up with the state intact: before the commit nothing
        was applied; its gradients are dropped (the rest it allocated is freed with the error's
        traceback), what it held when it failed is kept in ``oom_memory``, and the error is raised on
        (the agent reports it; the job moves to another layout and redoes the step). Past the commit
        (``ready_step``) its reduced gradients stay, as after a broken collective (``recovery_state``)."""
        try:
            return run(step)
        except torch.OutOfMemoryError:
            self.oom_memory = self._failed_measurement(step)
            if self.ready_step != step:  # before the commit (past it, the reduced gradients may yet be applied)
                for p in self.params.values():
                    p.grad = None
            raise  # the step's other tensors go with the traceback, once the caller has handled it

    def _failed_measurement(self, step: int) -> MeasuredMemory | None:
        """What the rank held when ``step`` ran out of memory: gradients counted whole (the limit does),
        activations up to and with the save that was refused; on a GPU the allocator's peak."""
        try:
            m = self.meter.measure(self, step)
        except Exception:  # noqa: BLE001 - a measurement never hides the error it is about
            return None
        acts = self.meter.refused if self.meter.refused is not None else m.activations
        return dataclasses.replace(m, gradients=m.weights, gradient_elements=m.weight_elements,
                                   activations=max(acts, m.activations))

    def _train_step(self, step: int) -> StepResult:
        t0 = self._step_started = time.perf_counter()
        self.ready_step = None
        # 1. forget the previous step's gradients
        for p in self.params.values():
            p.grad = None
        if self._carry is not None and self._carry.step == step:
            return self._finish_partial(step, self._carry, t0)
        # 2. forward/backward of this replica's micro-batches through the pipeline
        losses: list[torch.Tensor] = []
        if self.layout.vpp == 1:
            one_f_one_b(lambda m, x: self._forward_step(step, m, x, losses), self.grad_accum, self.groups.pp, self.act)
        else:
            interleaved_one_f_one_b(lambda c, m, x: self._forward_step(step, m, x, losses, chunk=c), self.grad_accum,
                                    self.layout.vpp, self.groups.pp, self.act)
        # 3. gradients: tied-embedding copies, then the DP mean
        self._reduce_grads()
        # 4. commit: one all-reduce over every rank carries the global-batch mean loss; passing it
        #    means every rank has its gradients reduced (the step can be applied everywhere)
        self.ready_step = step
        loss = self._commit_loss(losses)
        # 5. Adam on this rank's (ZeRO) slices, bias correction at t = step + 1
        self.apply_ready(step)
        tokens = self.cfg.global_batch * self.cfg.model.seq_len
        return StepResult(step, loss, tokens, time.perf_counter() - t0)

    def apply_ready(self, step: int) -> None:
        """Apply the optimizer update of ``step``, whose gradients are reduced (``ready_step``)."""
        if self.ready_step != step:
            raise RuntimeError(f"rank {self.rank}: step {step} is not ready to apply (ready: {self.ready_step})")
        self.dirty = True  # a failure inside a ZeRO-1 update leaves slices at two steps
        self.optimizer.step(step)
        self.dirty = False
        self.ready_step = None

    # the agent's Engine: a broken step keeps the state whole, and a given-up step's kept work is finished
    recoverable = True
    resumes_partial = True

    def communicators(self) -> list[Any]:
        """The backends of this generation's own groups (TP, DP, PP, embedding), for the agent to
        retire after an abort or a close."""
        comms = [getattr(self.groups, axis, None) for axis in ("tp", "dp", "pp", "embed")]
        return [b for c in comms if (b := getattr(c, "backend", None)) is not None]

    def recovery_state(self) -> dict[str, object]:
        """What this rank can contribute after a peer failed mid-step: ``ready`` (a step whose
        reduced gradients it holds and has not applied), ``dirty`` (an update broke half-way),
        ``local_apply`` (the update needs no peer: no ZeRO-1 across replicas)."""
        return {"ready": self.ready_step, "dirty": self.dirty, "local_apply": not self.optimizer.zero}

    def interrupt(self) -> None:
        """A peer was lost (another thread learnt it from the coordinator): the running step, or
        the next, stops at its next micro-batch with :class:`StepInterrupted`. Only micro-batches
        check it, so a step past its forward/backward (reducing, committing, applying) ends as
        it would have; before the commit nothing of the state has changed."""
        self._interrupted.set()

    def abort(self) -> None:
        """A peer failed: shut this generation's communicators down (peers blocked on us error out
        at once instead of at their timeout); state tensors and gradients stay."""
        self.groups.close()

    @property
    def can_give_up(self) -> bool:
        """Whether a step can be given up part-way: checks on and one pipeline stage (every rank
        then runs the same micro-batches in the same order and meets at each one's check; 1F1B
        stages run theirs at different times)."""
        return self.give_up_checks and self.layout.pp == 1

    def resume_partial(self, carry: PartialStep, *, contribute: bool = True) -> None:
        """Finish ``carry.step`` from the work a given-up try of it kept: its next
        ``train_step(carry.step)`` computes only the samples not done yet, split over this layout's
        replicas, and the kept gradients and losses are added; the result is the step's, up to
        float reduction order. Every rank of the layout must be given the step (or none), and
        exactly one rank per TP coordinate ``contribute`` (it holds the kept gradients of this
        rank's parameter boxes, summed over the old replicas; the DP all-reduce hands them on).
        Needs one pipeline stage."""
        if self.layout.pp != 1:
            raise SpecError(f"layout {self.layout}: a given-up step's work is kept on one pipeline stage only (pp=1)")
        if self.layout.ep != 1:
            # the replicas would run different numbers of micro-batches, and an expert exchange
            # needs every member of its group in each one
            raise SpecError(f"layout {self.layout}: a given-up step's work is not kept with experts split (ep > 1); "
                            "redo the step whole")
        if carry.dp * carry.grad_accum * carry.micro_batch != self.cfg.global_batch:
            raise SpecError(f"step {carry.step} was given up on dp={carry.dp} x {carry.grad_accum} micro-batches x "
                            f"{carry.micro_batch} samples, not the global batch {self.cfg.global_batch}")
        if not contribute:
            self._carry, self._contribute = carry, False
            return
        if carry.grads is None:
            raise SpecError(f"rank {self.rank}: asked to add the kept work of step {carry.step} but holds none "
                            "(a joiner never does)")
        if set(carry.grads) != set(self.params):
            missing, extra = sorted(set(self.params) - set(carry.grads)), sorted(set(carry.grads) - set(self.params))
            raise SpecError(f"rank {self.rank}: the kept gradients of step {carry.step} do not match this rank's "
                            f"parameters (missing {missing[:4]}, unexpected {extra[:4]})")
        for name, g in carry.grads.items():
            if tuple(g.shape) != tuple(self.params[name].shape):
                raise SpecError(f"rank {self.rank}: kept gradient {name} has shape {tuple(g.shape)}, the parameter "
                                f"{tuple(self.params[name].shape)}: the layouts shard it differently")
        self._carry, self._contribute = carry, True

    def give_up(self, step: int) -> None:
        """Ask (from any thread) that ``step`` be given up at its next micro-batch, on every rank
        (:class:`StepGivenUp`). Past its last micro-batch's check the step completes as usual."""
        self._give_up_step = step

    def _check_give_up(self, step: int, micro: int, losses: list[torch.Tensor]) -> None:
        """The give-up decision before micro-batch ``micro``: the MAX of every rank's wish, so all
        give up at the same micro-batch or none does (on the CPU gloo group of the commit).
        With ``keep_given_up`` the work of the ``micro`` micro-batches done goes with it."""
        flag = torch.tensor([1.0 if self._give_up_step == step else 0.0])
        if self.groups.world is not None:
            self.groups.world.all_reduce(flag, "max")
        if flag.item() > 0:
            self._give_up_step = None
            keep = self.keep_given_up and micro > 0 and self.layout.ep == 1  # no layout with ep > 1 finishes it
            carry = self._keep_partial(step, micro, losses) if keep else None
            for p in self.params.values():
                p.grad = None
            raise StepGivenUp(step, micro, time.perf_counter() - self._step_started, self.rank, carry=carry)

    def _keep_partial(self, step: int, micro: int, losses: list[torch.Tensor]) -> PartialStep:
        """The work of the first ``micro`` micro-batches of every replica: gradients summed over the
        replicas (one DP all-reduce, as at the end of a step) and losses over every rank."""
        flat = self._flat_grads()
        self._sum_over_replicas(flat)
        flat.div_(self.layout.dp)  # per sample: 1 / (grad_accum * micro_batch) / dp = 1 / global batch
        grads, off = {}, 0
        for name, p in self.params.items():
            grads[name] = flat[off:off + p.numel()].view(p.shape)
            off += p.numel()
        t = torch.zeros(1, dtype=torch.float64)
        if self.tp_rank == 0 and losses:  # pp = 1: every rank is a last stage; one per replica counts
            t += (torch.stack([v.double() for v in losses]).sum() * self.micro_batch).cpu()
        assert self.groups.world is not None
        self.groups.world.all_reduce(t)
        return PartialStep(step, micro, self.layout.dp, self.grad_accum, self.micro_batch, grads, float(t.item()))

    def _flat_grads(self) -> torch.Tensor:
        """Every gradient in one flat tensor (fp32 on the wire for bf16 weights; zeros for none)."""
        wire = torch.float32 if self.cfg.dtype == torch.bfloat16 else self.cfg.dtype
        return torch.cat([p.grad.reshape(-1).to(wire) if p.grad is not None
                          else torch.zeros(p.numel(), dtype=wire, device=p.device) for p in self.params.values()])

    def _set_grads(self, flat: torch.Tensor) -> None:
        """Write ``flat`` (in parameter order, as :meth:`_flat_grads` packs it) into the gradients."""
        off = 0
        for p in self.params.values():
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

    def _finish_partial(self, step: int, carry: PartialStep, t0: float) -> StepResult:
        """``step`` from a given-up try's kept work: this replica's share of the samples not done yet
        (the rest split evenly over the replicas, in micro-batches of at most ``micro_batch``),
        weighted 1 / global batch per sample, reduced over DP and added to the kept gradients.
        No give-up checks here (replicas may run different numbers of micro-batches)."""
        gb = self.cfg.global_batch
        todo = carry.remaining()
        lo, hi = split_range(len(todo), self.layout.dp, self.dp_rank)
        mine = todo[lo:hi]
        weighted: list[torch.Tensor] = []  # each micro-batch's mean loss x its samples (on the device)
        for i in range(0, len(mine), self.micro_batch):
            if self._interrupted.is_set():
                raise StepInterrupted(f"rank {self.rank}: step {step} (finishing a given-up try) stopped: "
                                      "a peer was lost")
            idx = mine[i:i + self.micro_batch]
            inputs, targets = self.data.samples(step, idx, self.cfg.device)
            self.stage.set_moe_loss_scale(self.cfg.moe_balance * len(idx) / gb)
            loss = self.stage.loss(self.stage(inputs), targets)
            (loss * (len(idx) / gb)).backward()
            weighted.append(loss.detach().double() * len(idx))
        flat = self._flat_grads()
        if self._contribute:  # one rank per TP coordinate: the DP sum hands the kept work to every replica
            assert carry.grads is not None
            flat.add_(torch.cat([carry.grads[name].reshape(-1) for name in self.params]).to(flat.device, flat.dtype))
        self._sum_over_replicas(flat)  # a sum: each sample already weighs 1 / global batch
        self._set_grads(flat)
        # the commit, as in train_step: every rank passing it has its gradients reduced
        self.ready_step = step
        t = torch.zeros(1, dtype=torch.float64)
        if self.tp_rank == 0 and weighted:
            t += torch.stack(weighted).sum().cpu()
        if self._contribute and self.tp_rank == 0:  # once over all ranks
            t += carry.loss_sum
        assert self.groups.world is not None
        self.groups.world.all_reduce(t)
        self._carry, self._contribute = None, False
        self.apply_ready(step)
        tokens = gb * self.cfg.model.seq_len
        return StepResult(step, float(t.item()) / gb, tokens, time.perf_counter() - t0,
                          {"kept_micro_batches": float(carry.micro)})

    def _forward_step(self, step: int, micro: int, x: torch.Tensor | None, losses: list[torch.Tensor],
                      chunk: int = 0) -> torch.Tensor:
        if self._interrupted.is_set():
            raise StepInterrupted(f"rank {self.rank}: step {step} given up at micro-batch {micro} of "
                                  f"{self.grad_accum}: a peer was lost")
        if self.can_give_up:
            self._check_give_up(step, micro, losses)
        mb = self.micro_batch
        # global sample index of this micro-batch: replica-major, so every layout reads the same set
        start = (self.dp_rank * self.grad_accum + micro) * mb
        stage = self.stage
        first, last = stage.takes_tokens(chunk), stage.gives_logits(chunk)
        if first or last:
            inputs, targets = self.data.batch(step, start, mb, self.cfg.device)
        if self.cfg.model.moe is not None:  # the balance loss weighs as this micro-batch's LM loss
            stage.set_moe_loss_scale(self.cfg.moe_balance / self.grad_accum)
        out = stage(inputs if first else x, chunk)
        if not last:
            return out
        loss = stage.loss(out, targets)
        losses.append(loss.detach())
        return loss / self.grad_accum

    def _reduce_grads(self) -> None:
        # Megatron keeps the first and last stage's copies of a tied embedding equal by
        # summing their gradients (each copy saw one use of the weight).
        if self.groups.embed is not None:
            g = self.params["embed.weight"].grad
            assert g is not None
            self.groups.embed.all_reduce(g)
        dp = self.groups.dp
        if dp.size == 1:
            return
        # one flat all-reduce of every gradient (sum over replicas, then / dp = mean)
        grads = [p.grad for p in self.params.values()]
        if any(g is None for g in grads):
            missing = [n for n, p in self.params.items() if p.grad is None]
            raise RuntimeError(f"no gradient for {missing[:4]} on rank {self.rank}")
        flat = self._flat_grads()
        self._sum_over_replicas(flat)
        flat.div_(dp.size)
        self._set_grads(flat)

    def _sum_over_replicas(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` (every gradient, in parameter order) over each parameter's replicas: every
        DP rank for most, the ranks holding the same experts for experts split by ``ep > 1``
        (an expert's gradient already holds the tokens of its whole EP group)."""
        if not self.expert_names:
            self.groups.dp.all_reduce(flat)
            return
        assert self.groups.edp is not None
        dense, experts = [], []
        off = 0
        for name, p in self.params.items():
            (experts if name in self.expert_names else dense).append((off, off + p.numel()))
            off += p.numel()
        for comm, ranges in ((self.groups.dp, dense), (self.groups.edp, experts)):
            part = torch.cat([flat[a:b] for a, b in ranges])
            comm.all_reduce(part)
            at = 0
            for a, b in ranges:
                flat[a:b].copy_(part[at:at + b - a])
                at += b - a

    def _commit_loss(self, losses: list[torch.Tensor]) -> float:
        """The global-batch mean loss on every rank, from one all-reduce over all ranks (the commit):
        each replica's last stage (its first TP rank) contributes its mean, everyone else zero."""
        t = torch.zeros(1, dtype=torch.float64)
        if self.stage.is_last and self.tp_rank == 0:
            t += (torch.stack([v.double() for v in losses]).sum() / self.grad_accum).cpu()
        assert self.groups.world is not None
        self.groups.world.all_reduce(t)
        return float(t.item()) / self.layout.dp

    def close(self) -> None:
        """Destroy this generation's communicators and drop gradients (the state tensors stay valid)."""
        for p in self.params.values():
            p.grad = None
        self.groups.close()


class _Adams:
    """Several :class:`ShardedAdam` stepped as one: with ``ep > 1``, one over the parameters every DP
    rank holds and one over the experts, whose replicas (and ZeRO-1 slices) are fewer."""

    def __init__(self, parts: list[ShardedAdam]) -> None:
        self.parts = parts

    @property
    def zero(self) -> bool:
        return any(p.zero for p in self.parts)

    def step(self, step: int) -> None:
        for p in self.parts:
            p.step(step)


def _install(root: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    """Make ``tensor`` (not a copy) the parameter ``name`` of ``root``."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        mod = getattr(mod, part)
    p = nn.Parameter(tensor, requires_grad=True)
    setattr(mod, leaf, p)
    return p


def _check_state(state: State, pieces: dict[tuple[str, Kind], tuple[tuple[int, int], ...]], cfg: TrainConfig,
                 rank: int, layout: Layout) -> None:
    want, have = set(pieces), set(state)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise SpecError(
            f"state for rank {rank} of {layout} does not match the sharding spec: missing {missing[:4]}"
            f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    for key, box in pieces.items():
        t = state[key]
        if tuple(t.shape) != box_shape(box):
            raise SpecError(f"state {key} on rank {rank} of {layout}: shape {tuple(t.shape)}, spec box {box} "
                            f"needs {box_shape(box)}")
        if t.dtype != cfg.kind_dtype(key[1]):
            raise SpecError(f"state {key}: dtype {t.dtype}, expected {cfg.kind_dtype(key[1])} for dtype={cfg.dtype}")
        if not t.is_contiguous():
            raise SpecError(f"state {key}: tensor must be contiguous (row-major)")
