"""Layout planner: every valid layout for N GPUs, whether it fits, how fast it runs. Pure.

What it is for: the co-scheduler lends a training job N GPUs and asks "which TP x PP x DP
(x EP, vpp, ZeRO), micro-batch, recompute and offload should it run, and does it fit?".
:func:`feasible_layouts` answers for one N, :func:`best_by_gpu_count` for every N up to a
maximum (memoised), :func:`evaluate` for one given layout. All are pure functions of their
arguments; they must not read the clock, files or devices.

Steps for one GPU count (``feasible_layouts``):

1. enumerate structures: tp dividing heads/kv_heads and the node size, pp up to the layers,
   vpp with pp*vpp chunks of at least one real layer, ep dividing experts and dp, and the
   largest dp <= floor(N/(tp*pp)) that divides the global batch (leftover GPUs reported);
2. for each, try micro-batches x recompute (none, selective, full) x offload and keep the
   fastest choice that fits (memory: ``memory.py``; time: ``cost.py``);
3. sort by tokens/s; ties (within 0.1%) go to fewer GPUs, then smaller TP, then smaller PP.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from elastic.model import HardwareSpec, Layout, ModelSpec, SpecError, check_layout, padded_layers
from elastic.parallel.cost import (
    CostInputs,
    dp_seconds,
    head_flops_per_token,
    layer_flops,
    model_flops_per_token,
    offload_seconds,
    stage_seconds,
    step_seconds,
)
from elastic.parallel.memory import (
    PRECISIONS,
    RECOMPUTE_CHOICES,
    ActivationTerms,
    GiB,
    MemoryBreakdown,
    Precision,
    Recompute,
    StageProfile,
    activation_terms,
    chunks_in_flight,
    stage_mixes,
    stage_profiles,
)
from elastic.parallel.params import RankParams, params_for_counts

DEFAULT_GLOBAL_BATCH = 1024


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the planner. Hashable, so results can be memoised per (model, hardware, options)."""

    global_batch: int = DEFAULT_GLOBAL_BATCH
    seq_len: int | None = None  # None: the model's seq_len
    gpus_per_node: int | None = None  # None: the hardware's
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[Recompute, ...] = RECOMPUTE_CHOICES
    offload: tuple[bool, ...] = (False, True)
    vpps: tuple[int, ...] = (1, 2, 3, 4)
    zero: tuple[int, ...] = (0, 1)
    reserve_bytes: int = 2 * GiB  # CUDA context, cuBLAS workspace, NCCL buffers
    reserve_fraction: float = 0.05  # allocator fragmentation, of device memory
    efficiency: float = 0.6  # achieved fraction of peak FLOP/s in the GEMMs
    dp_overlap: float = 0.5  # share of the gradient sync hidden behind backward at most
    host_fraction: float = 0.8  # share of host memory that offloaded optimizer state may use
    precision: Precision = "bf16-mixed"  # what the job trains in (memory.PRECISIONS)
    # the per-GPU bytes a job's tensors may use (weights, gradients, optimizer, activations), below
    # what the device leaves after the reserve; None: the device's
    memory_limit_bytes: int | None = None
    # the trainer picks each layout's micro-batch by this cap (:func:`capped_micro_batch`), so the
    # planner sizes exactly that one instead of choosing from ``micro_batches``; None: it chooses
    micro_batch_cap: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise SpecError(f"global_batch={self.global_batch}: must be >= 1")
        if self.precision not in PRECISIONS:
            raise SpecError(f"precision={self.precision!r}: choose from {', '.join(PRECISIONS)}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise SpecError(f"memory_limit_bytes={self.memory_limit_bytes}: must be >= 1 (or None: the device's)")
        if self.micro_batch_cap is not None and self.micro_batch_cap < 1:
            raise SpecError(f"micro_batch_cap={self.micro_batch_cap}: must be >= 1 (or None: the planner chooses)")
        if self.seq_len is not None and self.seq_len < 1:
            raise SpecError(f"seq_len={self.seq_len}: must be >= 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise SpecError(f"gpus_per_node={self.gpus_per_node}: must be >= 1")
        if not 0 < self.efficiency <= 1:
            raise SpecError(f"efficiency={self.efficiency}: must be in (0, 1]")
        bad = [r for r in self.recompute if r not in RECOMPUTE_CHOICES]
        if bad or not self.recompute:
            raise SpecError(f"recompute={self.recompute}: choose from {', '.join(RECOMPUTE_CHOICES)}")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise SpecError(f"micro_batches={self.micro_batches}: give sizes >= 1")

    def seq(self, model: ModelSpec) -> int:
        return self.seq_len or model.seq_len

    def node(self, hw: HardwareSpec) -> int:
        return self.gpus_per_node or hw.gpus_per_node

    def reserve(self, hw: HardwareSpec) -> int:
        """Bytes of a device no tensor of the job may use: CUDA context, buffers, fragmentation."""
        return int(self.reserve_bytes + self.reserve_fraction * hw.memory_bytes)

    def budget(self, hw: HardwareSpec) -> int:
        """Per-GPU bytes the job's tensors may use: the device's less the reserve, at most the job's limit."""
        left = hw.memory_bytes - self.reserve(hw)
        return left if self.memory_limit_bytes is None else min(left, self.memory_limit_bytes)


def capped_micro_batch(per_replica: int, cap: int, pp: int, vpp: int = 1) -> int | None:
    """The micro-batch a trainer with ``micro_batch_cap`` runs: the largest size <= ``cap`` that
    divides the per-replica batch into at least ``pp`` micro-batches (the pipeline fills), a
    multiple of ``pp`` of them when interleaved; None when no size does."""
    fits = [m for m in range(1, min(cap, per_replica) + 1)
            if per_replica % m == 0 and per_replica // m >= min(pp, per_replica)
            and (vpp == 1 or (per_replica // m) % pp == 0)]
    return max(fits) if fits else None


@dataclass(frozen=True)
class PlannedLayout:
    """One layout with its chosen micro-batch/recompute/offload, memory and speed."""

    layout: Layout
    gpus_used: int
    leftover_gpus: int
    micro_batch: int
    grad_accum: int
    recompute: Recompute
    offload: bool
    fits: bool
    memory: MemoryBreakdown
    gpu_memory_bytes: int
    stage_layers: tuple[int, ...]
    layer_slots: int
    virtual_layers: int
    imbalance: float
    step_seconds: float
    tokens_per_second: float
    mfu: float
    reason: str
    host_memory_bytes_per_node: int = 0

    def as_json(self) -> dict[str, Any]:
        """The ``elastic plan --json`` object of one plan (keys as issue 3 specifies)."""
        L = self.layout
        return {"layout": str(L), "tp": L.tp, "pp": L.pp, "dp": L.dp, "ep": L.ep, "vpp": L.vpp, "zero": L.zero,
                "gpus_used": self.gpus_used, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "recompute": self.recompute, "offload": self.offload, "fits": self.fits,
                "memory_bytes": self.memory.as_dict(), "gpu_memory_bytes": self.gpu_memory_bytes,
                "stage_layers": list(self.stage_layers), "step_seconds": self.step_seconds,
                "tokens_per_second": self.tokens_per_second, "mfu": self.mfu}


def _given(**kw: Any) -> dict[str, Any]:
    """The keywords a caller gave (not None): one left out must not replace ``options``' value."""
    return {k: v for k, v in kw.items() if v is not None}


def _opts(options: PlanOptions | None, kw: dict[str, Any]) -> PlanOptions:
    base = options or PlanOptions()
    if not kw:
        return base
    for k, v in kw.items():
        if isinstance(v, list):
            kw[k] = tuple(v)
    try:
        return replace(base, **kw)
    except TypeError as e:
        raise SpecError(f"planner option: {e}") from None


# --------------------------------------------------------------------------------------------
# Evaluation of one (layout, micro-batch, recompute, offload)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Structure:
    """Everything about a layout that does not depend on micro-batch, recompute or offload."""

    layout: Layout
    profiles: tuple[StageProfile, ...]
    params: tuple[RankParams, ...]  # most-loaded rank of each profile
    stage_layers: tuple[int, ...]
    imbalance: float


@lru_cache(maxsize=65536)
def _structure(model: ModelSpec, layout: Layout, seq: int) -> _Structure:
    profiles = stage_profiles(model, layout.pp, layout.vpp)
    params = tuple(params_for_counts(model, layout, p.dense, p.moe, first=p.first, last=p.last) for p in profiles)
    stage_layers = tuple(sum(d + m for d, m in mix) for mix in stage_mixes(model, layout.pp, layout.vpp))
    return _Structure(layout, profiles, params, stage_layers, _imbalance(model, layout.pp, layout.vpp, seq))


@lru_cache(maxsize=4096)
def _imbalance(model: ModelSpec, pp: int, vpp: int, seq: int) -> float:
    """Slowest / mean pipeline-rank compute per micro-batch (LM head on the last rank)."""
    dense_f, moe_f = (layer_flops(model, k) for k in (False, True))
    per_dense = dense_f.matmul + dense_f.core_per_seq * seq
    per_moe = moe_f.matmul + moe_f.core_per_seq * seq
    costs = [sum(d * per_dense + m * per_moe for d, m in mix) for mix in stage_mixes(model, pp, vpp)]
    costs[-1] += head_flops_per_token(model)
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean else 1.0


@dataclass(frozen=True)
class _Choice:
    micro_batch: int
    recompute: Recompute
    offload: bool
    fits: bool
    memory: MemoryBreakdown
    host: int
    step: float


@dataclass(frozen=True)
class _Static:
    """Per (structure, hardware, options): what no micro-batch/recompute choice changes."""

    reserve: int
    weights: tuple[int, ...]  # per profile
    gradients: tuple[int, ...]
    optimizer: tuple[int, ...]
    dp_time: float
    offload_time: float
    ci: CostInputs


def _static(model: ModelSpec, st: _Structure, hw: HardwareSpec, o: PlanOptions) -> _Static:
    ci = CostInputs(o.efficiency, o.dp_overlap, o.node(hw))
    b = PRECISIONS[o.precision]
    return _Static(
        reserve=o.reserve(hw),
        weights=tuple(rp.params * b.weight for rp in st.params),
        gradients=tuple(rp.params * b.gradient for rp in st.params),
        optimizer=tuple(rp.optimizer_elements * b.optimizer for rp in st.params),
        dp_time=max(dp_seconds(rp, st.layout, hw, ci) for rp in st.params),
        offload_time=max(offload_seconds(rp) for rp in st.params),
        ci=ci,
    )


def _evaluate_choice(model: ModelSpec, st: _Structure, sx: _Static, hw: HardwareSpec, o: PlanOptions, *,
                     micro_batch: int, recompute: Recompute, offload: bool, sec_per_token: float,
                     terms: tuple[ActivationTerms, ...]) -> _Choice:
    L = st.layout
    seq = o.seq(model)
    tokens = seq * micro_batch
    m = o.global_batch // (L.dp * micro_batch)
    # 1. memory: the largest stage decides (offloaded optimizer bytes count as host, not GPU)
    best_i, best_total, best_act = 0, -1, 0
    for i, prof in enumerate(st.profiles):
        held = chunks_in_flight(L.pp, L.vpp, m, prof.pp_rank)
        act = terms[i].bytes(tokens, held, L.vpp)
        total = sx.weights[i] + sx.gradients[i] + (0 if offload else sx.optimizer[i]) + act
        if total > best_total:
            best_i, best_total, best_act = i, total, act
    opt = sx.optimizer[best_i]
    mem = MemoryBreakdown(weights=sx.weights[best_i], gradients=sx.gradients[best_i],
                          optimizer=0 if offload else opt, activations=best_act, reserve=sx.reserve,
                          stage=st.profiles[best_i].pp_rank, host_optimizer=opt if offload else 0)
    host = max(sx.optimizer) * min(o.node(hw), L.world_size) if offload else 0
    fits = (mem.total - mem.reserve <= o.budget(hw)
            and (not offload or host <= o.host_fraction * hw.host_memory_bytes))
    # 2. step time: slowest stage x (m + bubble) + exposed DP sync + offloaded optimizer
    step = step_seconds(sec_per_token * tokens, m, L, sx.dp_time, sx.offload_time if offload else 0.0, sx.ci)
    return _Choice(micro_batch, recompute, offload, fits, mem, host, step)


def _planned_layout(model: ModelSpec, st: _Structure, hw: HardwareSpec, o: PlanOptions, c: _Choice,
                    n_gpus: int) -> PlannedLayout:
    L = st.layout
    seq = o.seq(model)
    tps = o.global_batch * seq / c.step
    slots = padded_layers(model.layers, L.pp, L.vpp)
    return PlannedLayout(
        layout=L, gpus_used=L.world_size, leftover_gpus=max(0, n_gpus - L.world_size), micro_batch=c.micro_batch,
        grad_accum=o.global_batch // (L.dp * c.micro_batch), recompute=c.recompute, offload=c.offload, fits=c.fits,
        memory=c.memory, gpu_memory_bytes=hw.memory_bytes, stage_layers=st.stage_layers, layer_slots=slots,
        virtual_layers=slots - model.layers, imbalance=st.imbalance, step_seconds=c.step, tokens_per_second=tps,
        mfu=model_flops_per_token(model, seq) * tps / (L.world_size * hw.peak_flops),
        reason=_reason(c.memory, hw, c.fits, c.host, o, c.offload), host_memory_bytes_per_node=c.host)


def _seconds_per_token(model: ModelSpec, st: _Structure, hw: HardwareSpec, ci: CostInputs, seq: int,
                       recompute: Recompute) -> float:
    """Slowest stage's time per micro-batch token (all stage terms scale with the tokens)."""
    return max(stage_seconds(model, p, st.layout, hw, ci, seq=seq, micro_batch=1, recompute=recompute)
               for p in st.profiles) / seq


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _reason(mem: MemoryBreakdown, hw: HardwareSpec, fits: bool, host: int, o: PlanOptions, offload: bool) -> str:
    parts = (f"weights {_gib(mem.weights)}, gradients {_gib(mem.gradients)}, optimizer {_gib(mem.optimizer)}, "
             f"activations {_gib(mem.activations)}, reserve {_gib(mem.reserve)}")
    if offload and host > o.host_fraction * hw.host_memory_bytes:
        return (f"offloaded optimizer needs {_gib(host)} of host memory per node, more than "
                f"{o.host_fraction:.0%} of {_gib(hw.host_memory_bytes)}")
    verb = "fits" if fits else "does not fit"
    rel = "<=" if fits else ">"
    if o.memory_limit_bytes is not None and o.budget(hw) == o.memory_limit_bytes:
        return (f"{verb}: stage {mem.stage} needs {_gib(mem.total - mem.reserve)} {rel} the job's memory limit of "
                f"{_gib(o.memory_limit_bytes)} ({parts})")
    return f"{verb}: stage {mem.stage} needs {_gib(mem.total)} {rel} {_gib(hw.memory_bytes)} ({parts})"


def _micro_batches(o: PlanOptions, L: Layout) -> list[int]:
    """Micro-batch sizes that divide the per-replica batch (and suit the interleaved schedule); with
    ``micro_batch_cap`` the one the trainer picks."""
    per_replica = o.global_batch // L.dp
    if o.micro_batch_cap is not None:
        mb = capped_micro_batch(per_replica, o.micro_batch_cap, L.pp, L.vpp)
        return [] if mb is None else [mb]
    out = []
    for mb in sorted(set(o.micro_batches)):
        if per_replica % mb:
            continue
        if L.vpp > 1 and (per_replica // mb) % L.pp:
            continue  # Megatron's interleaved schedule needs the micro-batch count in multiples of pp
        out.append(mb)
    return out


def _best_for_structure(model: ModelSpec, st: _Structure, hw: HardwareSpec, o: PlanOptions,
                        n_gpus: int) -> PlannedLayout | None:
    """The fastest fitting choice; if none fits, the one needing the least memory (fits=False).

    Recompute choices are tried cheapest first (none, selective, full): the first that fits
    is the fastest for that micro-batch. Offload is tried only when nothing fits without it.
    """
    best: _Choice | None = None
    smallest: _Choice | None = None
    sx = _static(model, st, hw, o)
    seq = o.seq(model)
    spt = {rc: _seconds_per_token(model, st, hw, sx.ci, seq, rc) for rc in o.recompute}
    terms = {rc: tuple(activation_terms(model, p, st.layout.tp, seq, rc, o.precision) for p in st.profiles)
             for rc in o.recompute}
    for offload in sorted(set(o.offload)):
        for mb in _micro_batches(o, st.layout):
            for rc in o.recompute:
                c = _evaluate_choice(model, st, sx, hw, o, micro_batch=mb, recompute=rc, offload=offload,
                                     sec_per_token=spt[rc], terms=terms[rc])
                if c.fits:
                    if best is None or c.step < best.step:
                        best = c
                    break
                if smallest is None or c.memory.total < smallest.memory.total:
                    smallest = c
        if best is not None:
            break
    chosen = best or smallest
    return None if chosen is None else _planned_layout(model, st, hw, o, chosen, n_gpus)


# --------------------------------------------------------------------------------------------
# Enumeration
# --------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=256)
def tp_choices(model: ModelSpec, gpus_per_node: int) -> tuple[int, ...]:
    """tp dividing heads (and kv_heads unless MLA) and the node size, so TP groups never span nodes,
    and the sequence length (sequence parallelism splits every sequence over the TP ranks)."""
    return tuple(t for t in _divisors(gpus_per_node)
                 if model.heads % t == 0 and (model.mla is not None or model.kv_heads % t == 0)
                 and model.seq_len % t == 0)


def ep_choices(model: ModelSpec) -> tuple[int, ...]:
    return tuple(_divisors(model.moe.experts)) if model.moe else (1,)


def _largest_dp(dp_max: int, ep: int, global_batch: int) -> int | None:
    for d in range(dp_max, 0, -1):
        if d % ep == 0 and global_batch % d == 0:
            return d
    return None


def _structures(model: ModelSpec, max_gpus: int, o: PlanOptions, gpn: int, *, all_dp: bool) -> Iterator[Layout]:
    """Valid layouts using at most ``max_gpus``: the largest valid dp, or every valid dp (``all_dp``)."""
    for tp in tp_choices(model, gpn):
        for pp in range(1, min(model.layers, max_gpus // tp) + 1):
            dp_max = max_gpus // (tp * pp)
            for vpp in sorted(set(o.vpps)):
                if (vpp > 1 and pp == 1) or pp * vpp > model.layers:
                    continue
                for ep in ep_choices(model):
                    if ep > dp_max:
                        break
                    if all_dp:
                        dps = [d for d in range(ep, dp_max + 1, ep) if o.global_batch % d == 0]
                    else:
                        d = _largest_dp(dp_max, ep, o.global_batch)
                        dps = [d] if d else []
                    for dp in dps:
                        for z in sorted(set(o.zero)):
                            if z and dp == 1:
                                continue
                            yield Layout(tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp, zero=z)


def _rank_key(p: PlannedLayout) -> tuple[int, ...]:
    # speeds in the same 0.1% bucket tie; ties go to fewer GPUs, then smaller TP
    bucket = round(math.log(max(p.tokens_per_second, 1e-300)) / math.log(1.001))
    L = p.layout
    return (-bucket, p.gpus_used, L.tp, L.pp, L.vpp, L.ep, -L.zero, p.micro_batch)


@lru_cache(maxsize=200_000)
def _planned(model: ModelSpec, layout: Layout, hw: HardwareSpec, o: PlanOptions) -> PlannedLayout | None:
    """Best choice for one layout, independent of the GPU count offered (leftover filled in later)."""
    st = _structure(model, layout, o.seq(model))
    return _best_for_structure(model, st, hw, o, layout.world_size)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanResult:
    """All evaluated layouts for one GPU count: the feasible ones best first, and why none fit if so."""

    model: str
    gpus: int
    plans: tuple[PlannedLayout, ...]
    reason: str
    evaluated: int = 0
    closest: PlannedLayout | None = field(default=None, compare=False)


def _check_gpus(n_gpus: int) -> None:
    if not isinstance(n_gpus, int) or n_gpus < 1:
        raise SpecError(f"gpus={n_gpus}: need at least 1 GPU to plan a layout")


def plan(model: ModelSpec, n_gpus: int, hardware: HardwareSpec, *, options: PlanOptions | None = None,
         **kw: Any) -> PlanResult:
    """Evaluate every valid layout for ``n_gpus`` (see module steps); feasible ones best first."""
    _check_gpus(n_gpus)
    o = _opts(options, kw)
    gpn = o.node(hardware)
    # 1. enumerate
    layouts = list(_structures(model, n_gpus, o, gpn, all_dp=False))
    # 2. best choice per layout
    evaluated = [p for L in layouts if (p := _planned(model, L, hardware, o)) is not None]
    evaluated = [replace(p, leftover_gpus=n_gpus - p.gpus_used) for p in evaluated]
    feasible = sorted((p for p in evaluated if p.fits), key=_rank_key)
    # 3. explain
    if feasible:
        best = feasible[0]
        left = f", {best.leftover_gpus} GPUs left over" if best.leftover_gpus else ""
        reason = f"{len(feasible)} of {len(evaluated)} layouts fit; best {best.layout}{left}"
        return PlanResult(model.name, n_gpus, tuple(feasible), reason, len(evaluated))
    closest = min(evaluated, key=lambda p: p.memory.total - p.gpu_memory_bytes, default=None)
    return PlanResult(model.name, n_gpus, (), _no_fit_reason(model, n_gpus, hardware, o, layouts, closest),
                      len(evaluated), closest)


def feasible_layouts(model: ModelSpec, n_gpus: int, hardware: HardwareSpec, *, gpus_per_node: int | None = None,
                     global_batch: int | None = None, seq_len: int | None = None,
                     options: PlanOptions | None = None, **kw: Any) -> list[PlannedLayout]:
    """Every layout for ``n_gpus`` that fits, fastest first (ties: fewer GPUs, smaller TP).
    A keyword left out takes ``options``' value (``PlanOptions``' default without options)."""
    kw.update(_given(gpus_per_node=gpus_per_node, global_batch=global_batch, seq_len=seq_len))
    return list(plan(model, n_gpus, hardware, options=options, **kw).plans)


def evaluate(model: ModelSpec, layout: Layout, hardware: HardwareSpec, *, micro_batch: int | None = None,
             recompute: Recompute | None = None, offload: bool | None = None, n_gpus: int | None = None,
             gpus_per_node: int | None = None, global_batch: int | None = None, seq_len: int | None = None,
             options: PlanOptions | None = None, **kw: Any) -> PlannedLayout:
    """Evaluate exactly ``layout``. Unset micro_batch/recompute/offload are chosen (fastest that fits).

    Raises SpecError when the layout cannot split the model or the batch; returns
    ``fits=False`` (with the smallest-memory choice and its reason) when it does not fit.
    """
    kw.update(_given(gpus_per_node=gpus_per_node, global_batch=global_batch, seq_len=seq_len))
    if micro_batch is not None:
        kw["micro_batches"] = (micro_batch,)
        kw["micro_batch_cap"] = None  # the size given, not the one a cap would pick
    if recompute is not None:
        kw["recompute"] = (recompute,)
    if offload is not None:
        kw["offload"] = (offload,)
    o = _opts(options, kw)
    gpn = o.node(hardware)
    _validate_layout(model, layout, o, gpn)
    n = layout.world_size if n_gpus is None else n_gpus
    if n < layout.world_size:
        raise SpecError(f"layout {layout} needs {layout.world_size} GPUs (tp*pp*dp = {layout.tp}*{layout.pp}*"
                        f"{layout.dp}) but only {n} are offered")
    p = _planned(model, layout, hardware, o)
    if p is None:
        per = o.global_batch // layout.dp
        extra = f" into a multiple of pp={layout.pp} micro-batches (interleaved)" if layout.vpp > 1 else ""
        raise SpecError(f"layout {layout}: no micro-batch in {list(o.micro_batches)} divides the {per} sequences "
                        f"per replica{extra}")
    return replace(p, leftover_gpus=n - p.gpus_used)


def _validate_layout(model: ModelSpec, layout: Layout, o: PlanOptions, gpn: int) -> None:
    check_layout(model, layout, gpn)
    if gpn % layout.tp:
        raise SpecError(f"layout {layout}: tp={layout.tp} does not divide gpus_per_node={gpn}; "
                        "a TP group would straddle two nodes")
    if o.global_batch % layout.dp:
        raise SpecError(f"layout {layout}: dp={layout.dp} does not divide global_batch={o.global_batch} "
                        f"({o.global_batch} % {layout.dp} = {o.global_batch % layout.dp}); the global batch "
                        "must split evenly over data-parallel replicas")


def best_by_gpu_count(model: ModelSpec, hardware: HardwareSpec, max_gpus: int, *,
                      options: PlanOptions | None = None, **kw: Any) -> dict[int, PlannedLayout]:
    """Best feasible plan for every GPU count 1..max_gpus that has one (a count may leave GPUs over).

    Every layout is evaluated once (memoised across calls); the best for N is the best of
    all layouts using at most N GPUs, so the co-scheduler can ask for many counts cheaply.
    """
    _check_gpus(max_gpus)
    return dict(_best_by_count(model, hardware, max_gpus, _opts(options, kw)))


@lru_cache(maxsize=256)
def _best_by_count(model: ModelSpec, hw: HardwareSpec, max_gpus: int,
                   o: PlanOptions) -> tuple[tuple[int, PlannedLayout], ...]:
    by_size: dict[int, PlannedLayout] = {}
    for L in _structures(model, max_gpus, o, o.node(hw), all_dp=True):
        p = _planned(model, L, hw, o)
        if p is None or not p.fits:
            continue
        cur = by_size.get(L.world_size)
        if cur is None or _rank_key(p) < _rank_key(cur):
            by_size[L.world_size] = p
    out: list[tuple[int, PlannedLayout]] = []
    best: PlannedLayout | None = None
    for n in range(1, max_gpus + 1):
        cand = by_size.get(n)
        if cand is not None and (best is None or _rank_key(cand) < _rank_key(best)):
            best = cand
        if best is not None:
            out.append((n, replace(best, leftover_gpus=n - best.gpus_used)))
    return tuple(out)


def _no_fit_reason(model: ModelSpec, n_gpus: int, hw: HardwareSpec, o: PlanOptions, layouts: list[Layout],
                   closest: PlannedLayout | None) -> str:
    """Say what would make a layout fit: more GPUs, recompute, offload, a smaller micro-batch."""
    gpn = o.node(hw)
    if not tp_choices(model, gpn):
        return f"no tp divides heads={model.heads}, kv_heads={model.kv_heads} and gpus_per_node={gpn}"
    if not layouts:
        return (f"no layout of at most {n_gpus} GPUs splits global_batch={o.global_batch} evenly over its "
                "data-parallel replicas; use a global batch with more small factors or change the GPU count")
    if closest is None:
        return (f"no micro-batch in {list(o.micro_batches)} divides the per-replica batch of any layout; "
                "allow micro-batch 1 or change the global batch")
    # Lower bound: weights + gradients (6 bytes/param in bf16 mixed precision) are never sharded by ZeRO-1.
    b = PRECISIONS[o.precision]
    need = max(n_gpus + 1, math.ceil((b.weight + b.gradient) * model.total_params() / max(o.budget(hw), 1)))
    hints = [f"more GPUs (at least about {need})"]
    if "full" not in o.recompute:
        hints.append("full activation recompute")
    if True not in o.offload:
        hints.append("optimizer CPU offload")
    if 1 not in o.zero:
        hints.append("ZeRO-1")
    if closest.micro_batch > 1 or min(o.micro_batches) > 1:
        hints.append("micro-batch 1")
    return (f"no layout of {n_gpus} {hw.name} GPUs fits {model.name}: the closest, {closest.layout} "
            f"(micro-batch {closest.micro_batch}, recompute {closest.recompute}"
            f"{', offload' if closest.offload else ''}), {closest.reason}; would fit with "
            + ", ".join(hints))
