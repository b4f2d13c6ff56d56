"""Never out of memory: whether a training layout overran the per-GPU memory the planner gave it,
and the job's throughput table without the layouts dropped for it. Pure.

What it is for: the controller's observe step hands it what a job reports (its worst rank's
measured memory, ``JobRuntime.memory``, or the error it failed with) and keeps what it returns;
its decide step plans the job on :func:`without_dropped`'s table and moves a job still on a dropped
layout with :func:`relayout_target`.

The check (:func:`check_measured`): the measured peak of a rank's step (the GPU allocator's peak,
else the sum of the measured components) against the per-GPU budget the planner fitted the layout
in (:func:`budget_bytes`: device memory less the planner's reserve; the reserve is what no tensor
of the trainer holds, so the measured bytes compare with what is left). Over it: the layout is
dropped, with the peak, the budget and the planner's prediction per component beside the
measured bytes. A worker that failed with an out-of-memory error (:func:`check_failure`) drops
its layout too, with what it held when it failed where the trainer reports it (the reference
trainer gives the step up and waits for another layout instead of failing the job). A missing
measurement changes nothing.

The re-plan (:func:`without_dropped`), with more headroom: at each GPU count whose layout was
dropped, only layouts the planner predicts to need less memory per GPU than the dropped one (one
predicted to need more would overrun too); among them the same layout with ZeRO-1 first (the
optimizer state sharded over the data-parallel ranks: headroom without changing what the step
computes) when the job's options allow it, else the planner's fastest. A count with none left
leaves the table, and the co-scheduler gives the job fewer GPUs. Recompute and offload are the planner's own
choice per layout (it already takes the cheapest that fits); the reference trainer runs neither,
so no layout is asked of it with more of them.

Must not: read the clock, the store or a backend (``now`` and every input come in as values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from elastic.controller.tables import trainer_choices
from elastic.model import HardwareSpec, Layout, ModelSpec, SpecError
from elastic.parallel.memory import Precision
from elastic.parallel.memory_report import (
    MeasuredMemory,
    StageMemory,
    measured_options,
    measured_peak,
    stage_memory,
)
from elastic.parallel.planner import PlanOptions, evaluate, feasible_layouts
from elastic.reasons import DecisionReason

Table = Mapping[int, tuple[Layout, float]]


@dataclass(frozen=True)
class Candidate:
    """A layout the planner offers for a GPU count: its speed and its predicted per-GPU bytes."""

    layout: Layout
    tokens_per_second: float
    memory_bytes: int

_DROP_REASONS = (DecisionReason.MEMORY_EXCEEDED, DecisionReason.OUT_OF_MEMORY)  # why a layout is dropped
#: what a worker's failure says when it ran out of memory (torch.OutOfMemoryError, the CUDA
#: allocator's "CUDA out of memory", a host allocation's "DefaultCPUAllocator: can't allocate")
OOM_MARKERS = ("outofmemoryerror", "out of memory", "can't allocate memory")
COMPONENTS = ("weights", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class Dropped:
    """A layout a job may not run again: why (``MemoryExceeded``, ``OutOfMemory``), what it peaked
    at against which budget (``peak_bytes`` None: it failed before a measurement), and the message
    the decision log carries."""

    layout: Layout
    reason: DecisionReason  # MEMORY_EXCEEDED or OUT_OF_MEMORY
    peak_bytes: int | None
    budget_bytes: int
    message: str
    at: float  # when it was dropped (the tick's ``now``)

    def as_json(self) -> dict[str, Any]:
        return {"layout": str(self.layout), "reason": self.reason, "peakBytes": self.peak_bytes,
                "budgetBytes": self.budget_bytes, "message": self.message, "at": self.at}

    @classmethod
    def from_json(cls, obj: Any, where: str = "dropped layout") -> Dropped:
        """One :meth:`as_json` object, as the job's status holds it; a bad field is named."""
        if not isinstance(obj, dict):
            raise SpecError(f"{where}: expected an object with layout, reason, peakBytes, budgetBytes, message, "
                            f"at; got {type(obj).__name__}")
        try:
            layout = Layout.parse(str(obj["layout"]))
            reason = obj["reason"]
            if reason not in _DROP_REASONS:
                raise SpecError(f"reason must be {' or '.join(_DROP_REASONS)}, got {reason!r}")
            peak = obj.get("peakBytes")
            return cls(layout, DecisionReason(reason), None if peak is None else int(peak), int(obj["budgetBytes"]),
                       str(obj.get("message", "")), float(obj.get("at", 0.0)))
        except KeyError as e:
            raise SpecError(f"{where}: field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError, SpecError) as e:
            raise SpecError(f"{where}: {e}") from None


def budget_bytes(hardware: HardwareSpec, options: PlanOptions | None = None, *,
                 memory_limit_bytes: int | None = None) -> int:
    """Per-GPU bytes the planner lets a layout's tensors use: device memory less its reserve (CUDA
    context, communication buffers, fragmentation: ``reserve_bytes`` + ``reserve_fraction``), at most
    the job's ``memory_limit_bytes``."""
    o = options or PlanOptions()
    if memory_limit_bytes is not None:
        o = replace(o, memory_limit_bytes=memory_limit_bytes)
    return o.budget(hardware)


def predicted_stage(model: ModelSpec, m: MeasuredMemory, hardware: HardwareSpec, *,
                    gpus_per_node: int | None = None) -> StageMemory | None:
    """The planner's prediction for exactly what ran (``memory_report.measured_options``: its
    micro-batch, global batch and precision, the count of what the reference trainer holds, no
    offload), on the measured rank's pipeline stage; None when the planner cannot evaluate it
    (another model, a layout it refuses)."""
    o = measured_options(PlanOptions(gpus_per_node=gpus_per_node), m)
    try:
        p = evaluate(model, m.layout, hardware, options=o)
        return stage_memory(model, p, hardware, o)[m.pp_rank]
    except (SpecError, IndexError):
        return None


def _gib(n: float) -> str:
    """Bytes for a message: GiB, or MiB below a tenth of one (a small model's figures stay readable)."""
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 0.1 * 1024**3 else f"{n / 1024**2:.2f} MiB"


def check_measured(m: MeasuredMemory | None, budget: int, now: float,
                   predicted: StageMemory | None = None) -> Dropped | None:
    """``m``'s layout, dropped when its step peaked over ``budget``; None when it fit or when there is
    no measurement (nothing is known: nothing changes)."""
    if m is None:
        return None
    peak = measured_peak(m)
    if peak <= budget:
        return None
    what = "GPU allocator peak" if m.device_peak is not None else "measured tensors"
    msg = (f"{m.layout}: step {m.step} peaked at {_gib(peak)} ({what}) on rank {m.rank} (stage {m.pp_rank}), over "
           f"the per-GPU budget of {_gib(budget)} (device memory less the planner's reserve); measured "
           + ", ".join(f"{c} {_gib(getattr(m, c))}" for c in COMPONENTS))
    if predicted is not None:
        msg += ("; the planner predicted " + ", ".join(f"{c} {_gib(getattr(predicted, c))}" for c in COMPONENTS)
                + f" ({_gib(predicted.total - predicted.reserve)} in all)")
    return Dropped(m.layout, DecisionReason.MEMORY_EXCEEDED, peak, budget, msg, now)


def check_failure(layout: Layout | None, error: str | None, budget: int, now: float,
                  measured: MeasuredMemory | None = None) -> Dropped | None:
    """``layout`` dropped when a worker running it failed out of memory (``error`` is the job's
    failure reason, what it lost a worker to, or why it waits for another layout); None for any
    other failure or none. ``measured``: what the failing rank held when it did (the reference
    trainer reports it), named in the message as the peak when it is of ``layout``."""
    if layout is None or not error or not any(k in error.lower() for k in OOM_MARKERS):
        return None
    if measured is None or measured.layout != layout:
        return Dropped(layout, DecisionReason.OUT_OF_MEMORY, None, budget,
                       f"{layout}: a worker ran out of memory ({error[:300]})", now)
    peak = measured_peak(measured)
    what = "GPU allocator peak" if measured.device_peak is not None else "measured tensors"
    msg = (f"{layout}: step {measured.step} ran out of memory on rank {measured.rank} (stage {measured.pp_rank}) at "
           f"{_gib(peak)} ({what}: " + ", ".join(f"{c} {_gib(getattr(measured, c))}" for c in COMPONENTS)
           + f"; the per-GPU budget the planner fitted it in is {_gib(budget)}) ({error[:300]})")
    return Dropped(layout, DecisionReason.OUT_OF_MEMORY, peak, budget, msg, now)


def alternatives(model: ModelSpec, hardware: HardwareSpec, gpus: int, *, gpus_per_node: int, global_batch: int,
                 allowed_tp: Sequence[int] | None = None, allowed_pp: Sequence[int] | None = None, zero: int = 0,
                 replicate_optimizer: bool = False, precision: Precision = "bf16-mixed",
                 micro_batch_cap: int | None = None, memory_limit_bytes: int | None = None,
                 recompute: str | None = None, offload: bool | None = None) -> list[Candidate]:
    """Every layout of exactly ``gpus`` GPUs the planner finds fits, fastest first, under the job's
    options (as ``controller.tables.throughput_table`` builds its table: allowed tp/pp, ``zero=1``
    wherever dp > 1, ``replicate_optimizer``: no ZeRO-1, its precision, micro-batch cap, recompute,
    offload and memory limit; vpp 1, the reference trainer's schedule)."""
    out: list[Candidate] = []
    for p in feasible_layouts(model, gpus, hardware, gpus_per_node=gpus_per_node, global_batch=global_batch,
                              vpps=(1,), precision=precision, micro_batch_cap=micro_batch_cap,
                              memory_limit_bytes=memory_limit_bytes, **trainer_choices(recompute, offload)):
        L = p.layout
        if L.world_size != gpus or (allowed_tp and L.tp not in allowed_tp) or (allowed_pp and L.pp not in allowed_pp):
            continue
        if (zero and L.dp > 1 and not L.zero) or (replicate_optimizer and L.zero):
            continue
        out.append(Candidate(L, p.tokens_per_second, p.memory.total))
    return out


def without_dropped(table: Table, dropped: Iterable[Layout],
                    candidates: Callable[[int], Sequence[Candidate]]) -> dict[int, tuple[Layout, float]]:
    """``table`` with each count whose layout was dropped re-planned from ``candidates(count)`` (the
    planner's layouts of that count, fastest first): of those not dropped and predicted to need less
    memory than the dropped layout (any, when the planner does not offer the dropped one), the same
    layout with ZeRO-1, else the fastest; a count with none left is left out."""
    gone = set(dropped)
    out: dict[int, tuple[Layout, float]] = {}
    for n, (lay, tps) in table.items():
        if lay not in gone:
            out[n] = (lay, tps)
            continue
        offered = list(candidates(n))
        limit = next((c.memory_bytes for c in offered if c.layout == lay), None)
        roomier = [c for c in offered if c.layout not in gone and (limit is None or c.memory_bytes < limit)]
        sharded = replace(lay, zero=1)
        pick = next((c for c in roomier if c.layout == sharded), None) or next(iter(roomier), None)
        if pick is not None:
            out[n] = (pick.layout, pick.tokens_per_second)
    return out


def relayout_target(running: Layout | None, gpus: int, dropped: Iterable[Layout], table: Table) -> Layout | None:
    """Where a job running ``running`` on ``gpus`` GPUs moves in place: the table's layout of the same
    count when ``running`` was dropped and that count has another layout; None otherwise (it is not
    dropped, or the count has none left and the co-scheduler gives the job fewer GPUs)."""
    if running is None or not gpus:
        return None
    if running not in set(dropped) or gpus not in table:
        return None
    to = table[gpus][0]
    return None if to == running else to
