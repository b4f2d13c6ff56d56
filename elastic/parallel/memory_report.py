"""Per-GPU memory of planned layouts, by component and pipeline stage, predicted and measured. Pure.

What it is for: ``elastic plan --report PATH`` (the JSON and the plot are written by
``elastic.cli._plan_report``). For each layout reported it gives every pipeline stage's
most-loaded GPU (weights, gradients, optimizer, activations, reserve), which stage is the
worst (the one the planner's fit decision rests on: under 1F1B the first stage holds the
most micro-batches in flight, the last the logits), and, where a training run measured
that layout (:class:`MeasuredMemory`, what ``elastic.train.memory`` records), the measured
components next to the predicted ones.

Every number is the planner's own: a stage is evaluated with the same functions and the
same micro-batch, recompute and offload choice as ``planner.evaluate`` made, and the worst
stage equals the planner's ``PlannedLayout.memory`` exactly (a test holds them together).

Must not: read or write files, or import the trainer (``MeasuredMemory`` is declared here so
that both the trainer and the report use one type without the planner importing torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from elastic.model import HardwareSpec, Layout, ModelSpec, SpecError
from elastic.parallel.memory import (
    DTYPE_PRECISION,
    PRECISIONS,
    Recompute,
    StageProfile,
    activation_terms,
    chunks_in_flight,
    stage_mixes,
)
from elastic.parallel.params import params_for_counts
from elastic.parallel.planner import PlannedLayout, PlanOptions, evaluate

SCHEMA = "elastic.memory-report/1"
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "reserve")
#: The planner's recompute choice whose count matches what the reference trainer holds. The trainer
#: recomputes nothing, but its attention is a flash kernel that keeps no scores, which is what the
#: planner's "selective" count leaves out (its "none" keeps them, as unfused attention does).
TRAINER_RECOMPUTE: Recompute = "selective"

NEXT_BEST = 3  # layouts reported after the chosen one, in the planner's order


# --------------------------------------------------------------------------------------------
# Measured memory (one rank, one step)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes one training rank held in one step, by component (``elastic.train.memory`` measures it).

    ``*_elements`` count elements, the unit that compares across dtypes with the planner's
    (bf16 weights, fp32 gradients, fp32 optimizer state); ``optimizer_elements`` is per
    optimizer state kind (``exp_avg``, ``exp_avg_sq`` and, with bf16 weights, ``master``: each
    holds that many), ``optimizer_kinds`` how many kinds. ``activations``: the peak bytes
    autograd held for backward during the step. ``device_peak``: the GPU allocator's peak
    over the step, ``None`` on CPU. No reserve: that is the planner's allowance for what no
    tensor of the trainer holds (CUDA context, communication buffers, fragmentation).
    """

    model: str
    layout: Layout
    rank: int
    pp_rank: int
    step: int
    dtype: str
    micro_batch: int
    grad_accum: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    weight_elements: int
    gradient_elements: int
    optimizer_elements: int
    optimizer_kinds: int
    device_peak: int | None = None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def global_batch(self) -> int:
        return self.layout.dp * self.micro_batch * self.grad_accum

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = str(self.layout)
        out["total"] = self.total
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "measured memory") -> MeasuredMemory:
        """Parse one :meth:`as_json` object (``total`` is recomputed); a missing or mistyped field
        is named in the error."""
        if not isinstance(obj, dict):
            raise SpecError(f"{where}: expected a JSON object with the fields of MeasuredMemory, got "
                            f"{type(obj).__name__}")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in obj:
                if f.name == "device_peak":
                    continue
                raise SpecError(f"{where}: field {f.name!r} is missing (the trainer writes it with "
                                "MeasuredMemory.as_json)")
            v = obj[f.name]
            if f.name == "layout":
                if not isinstance(v, str):
                    _bad(where, f.name, v, "a layout such as 'tp2.pp1.dp4'")
                try:
                    v = Layout.parse(v)
                except SpecError as e:
                    raise SpecError(f"{where}: field 'layout': {e}") from None
            elif f.name in ("model", "dtype"):
                if not isinstance(v, str) or not v:
                    _bad(where, f.name, v, "a non-empty string")
            elif f.name == "device_peak" and v is None:
                pass
            elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _bad(where, f.name, v, "a whole number >= 0")
            kw[f.name] = v
        m = cls(**kw)
        if m.micro_batch < 1 or m.grad_accum < 1:
            raise SpecError(f"{where}: micro_batch={m.micro_batch}, grad_accum={m.grad_accum}: both must be >= 1")
        if m.rank >= m.layout.world_size or m.pp_rank >= m.layout.pp:
            raise SpecError(f"{where}: rank {m.rank} (pipeline stage {m.pp_rank}) is outside layout {m.layout} "
                            f"of {m.layout.world_size} ranks and {m.layout.pp} stages")
        return m


def measured_peak(m: MeasuredMemory) -> int:
    """The bytes a rank's measured step peaked at: the GPU allocator's peak where there is one (it
    sees everything the step allocated), else the sum of the measured components (CPU)."""
    return m.device_peak if m.device_peak is not None else m.total


def _bad(where: str, name: str, value: Any, want: str) -> Any:
    raise SpecError(f"{where}: field {name!r} must be {want}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Predicted memory per stage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on the most-loaded GPU of one pipeline stage. ``in_flight``: the
    (chunk-)micro-batches whose activations the stage holds at its peak; ``host_optimizer``:
    optimizer bytes offloaded to host memory (not in ``total``)."""

    pp_rank: int
    layers: int
    in_flight: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    reserve: int
    host_optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve

    def as_json(self) -> dict[str, int]:
        out = asdict(self)
        out["total"] = self.total
        return out


def stage_memory(model: ModelSpec, plan: PlannedLayout, hardware: HardwareSpec,
                 options: PlanOptions | None = None) -> tuple[StageMemory, ...]:
    """Every pipeline stage of ``plan`` under its own micro-batch, recompute and offload choice.

    The same arithmetic as the planner's (``planner._evaluate_choice``) applied to every stage
    instead of one per distinct layer mix: parameters of the stage's most-loaded rank
    (``params.py``), activations of its biggest chunk times the micro-batches it holds
    (``memory.py``), the reserve."""
    o = options or PlanOptions()
    L = plan.layout
    seq = o.seq(model)
    m = o.global_batch // (L.dp * plan.micro_batch)
    reserve = o.reserve(hardware)
    b = PRECISIONS[o.precision]
    out = []
    for p, mix in enumerate(stage_mixes(model, L.pp, L.vpp)):
        dense, moe = sum(d for d, _ in mix), sum(x for _, x in mix)
        first, last = p == 0, p == L.pp - 1
        prof = StageProfile(p, dense, moe, tuple(sorted(set(mix))), first, last)
        rp = params_for_counts(model, L, dense, moe, first=first, last=last)
        held = chunks_in_flight(L.pp, L.vpp, m, p)
        act = activation_terms(model, prof, L.tp, seq, plan.recompute, o.precision).bytes(
            seq * plan.micro_batch, held, L.vpp)
        opt = rp.optimizer_elements * b.optimizer
        out.append(StageMemory(p, dense + moe, held, rp.params * b.weight, rp.params * b.gradient,
                               0 if plan.offload else opt, act, reserve, opt if plan.offload else 0))
    return tuple(out)


def worst_stage(stages: Sequence[StageMemory]) -> StageMemory:
    """The stage needing the most memory (the first of equals, as the planner picks)."""
    best = stages[0]
    for s in stages[1:]:
        if s.total > best.total:
            best = s
    return best


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutMemory:
    """One reported layout. ``place``: 1 for the chosen layout, 2.. for the next best in the
    planner's order, 0 for one reported only because it was measured (or given by ``--layout``
    and not among the planner's feasible layouts)."""

    plan: PlannedLayout
    place: int
    stages: tuple[StageMemory, ...]
    measured: MeasuredMemory | None = None

    @property
    def worst(self) -> StageMemory:
        return worst_stage(self.stages)

    def as_json(self) -> dict[str, Any]:
        p, w = self.plan, self.worst
        return {"layout": str(p.layout), "place": self.place, "fits": p.fits, "gpus_used": p.gpus_used,
                "micro_batch": p.micro_batch, "grad_accum": p.grad_accum, "recompute": p.recompute,
                "offload": p.offload, "global_batch": p.layout.dp * p.micro_batch * p.grad_accum,
                "budget_bytes": p.gpu_memory_bytes, "worst_stage": w.pp_rank,
                "worst": {k: getattr(w, k) for k in (*COMPONENTS, "total")},
                "stages": [s.as_json() for s in self.stages],
                "measured": None if self.measured is None else self.measured.as_json()}


@dataclass(frozen=True)
class MemoryReport:
    model: str
    gpus: int
    hardware: str
    budget: int
    global_batch: int
    layouts: tuple[LayoutMemory, ...]
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": self.model, "gpus": self.gpus, "hardware": self.hardware,
                "budget_bytes": self.budget, "global_batch": self.global_batch, "components": list(COMPONENTS),
                "layouts": [x.as_json() for x in self.layouts], "reason": self.reason}


def measured_options(o: PlanOptions, m: MeasuredMemory) -> PlanOptions:
    """``o`` narrowed to exactly what ``m``'s step ran: its global batch and micro-batch, its precision,
    :data:`TRAINER_RECOMPUTE`, no offload."""
    return replace(o, global_batch=m.global_batch, micro_batches=(m.micro_batch,), micro_batch_cap=None,
                   recompute=(TRAINER_RECOMPUTE,), offload=(False,),
                   precision=DTYPE_PRECISION.get(m.dtype, o.precision))


def _same_choice(p: PlannedLayout, m: MeasuredMemory, o: PlanOptions) -> bool:
    return (p.layout == m.layout and p.micro_batch == m.micro_batch and p.grad_accum == m.grad_accum
            and p.recompute == TRAINER_RECOMPUTE and not p.offload
            and DTYPE_PRECISION.get(m.dtype, o.precision) == o.precision)


def _worst_measured(measured: Sequence[MeasuredMemory]) -> dict[Layout, MeasuredMemory]:
    """Per layout, the rank (and step) that held the most."""
    out: dict[Layout, MeasuredMemory] = {}
    for m in measured:
        cur = out.get(m.layout)
        if cur is None or m.total > cur.total:
            out[m.layout] = m
    return out


def memory_report(model: ModelSpec, gpus: int, hardware: HardwareSpec, plans: Sequence[PlannedLayout], *,
                  options: PlanOptions | None = None, reason: str = "",
                  measured: Sequence[MeasuredMemory] = ()) -> MemoryReport:
    """The report of ``plans`` (the chosen layout first, then the next best, as the planner
    ranked them; the first ``1 + NEXT_BEST`` are kept) and of every measured layout.

    A measured layout is predicted for exactly what ran (:func:`measured_options`: its micro-batch,
    global batch and precision, :data:`TRAINER_RECOMPUTE`, no offload); when a reported plan made
    that same choice the measurement goes next to it, otherwise it gets an entry of its own.
    """
    o = options or PlanOptions()
    # 1. the planned layouts, in the planner's order
    entries = [LayoutMemory(p, i, stage_memory(model, p, hardware, o))
               for i, p in enumerate(plans[:1 + NEXT_BEST], 1)]
    # 2. each measured layout next to its prediction
    for lay, m in _worst_measured(measured).items():
        if m.model != model.name:
            raise SpecError(f"measured memory is of model {m.model!r}, the plan is of {model.name!r}: measure "
                            f"the same model or plan with --model {m.model}")
        k = next((i for i, e in enumerate(entries) if _same_choice(e.plan, m, o)), None)
        if k is not None:
            entries[k] = LayoutMemory(entries[k].plan, entries[k].place, entries[k].stages, m)
            continue
        mo = measured_options(o, m)
        p = evaluate(model, lay, hardware, n_gpus=max(gpus, lay.world_size), options=mo)
        entries.append(LayoutMemory(p, 0, stage_memory(model, p, hardware, mo), m))
    budget = entries[0].plan.gpu_memory_bytes if entries else hardware.memory_bytes
    return MemoryReport(model.name, gpus, hardware.name, budget, o.global_batch, tuple(entries), reason)
