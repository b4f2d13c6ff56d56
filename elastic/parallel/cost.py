"""Step-time model of 3D-parallel training: compute, TP/EP/PP/DP communication, bubble. Pure.

What it is for: ranking layouts that fit by tokens/s, fast enough to score thousands of
layouts per call. It is an analytical model in the spirit of Narayanan et al. (SC'21), not a
simulator; it must not read the clock or any hardware counter.

* FLOPs (Megatron's counting, non-causal attention): forward per token and layer
  ``2 * active layer params + 2*s*heads*(qk_dim + v_dim)``; LM head ``2hV``. Training does
  3 forward-equivalents; full recompute adds one more forward of the layers, selective
  one more of the attention core only. With ffn = 4h this is Megatron's
  ``96 B s l h^2 (1 + s/6h + V/16lh)`` for full recompute.
* Per micro-batch, a pipeline rank spends its FLOPs / tp at ``peak * efficiency``, plus TP
  collectives: 4 all-reduce-equivalents of ``2*s*b*h`` bytes per layer (2 forward, 2
  backward; +2 for full recompute) over intra-node bandwidth, MoE all-to-alls (dispatch and
  combine, forward and backward), and pipeline point-to-point sends.
* Pipeline: ``(m + (pp-1)/vpp) * t_slowest_stage`` (bubble fraction ``(pp-1)/(m*vpp)``).
* DP: ring all-reduce of fp32 gradients (ZeRO-1: reduce-scatter fp32 + all-gather bf16);
  a fraction ``dp_overlap`` of it hides behind the last micro-batch's backward.
* Optimizer offload: gradients down and weights up over PCIe plus a CPU Adam step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from elastic.model import HardwareSpec, Layout, ModelSpec
from elastic.parallel.memory import Recompute, StageProfile
from elastic.parallel.params import RankParams

PCIE_BANDWIDTH = 25e9  # bytes/s per GPU, PCIe Gen4 x16 in practice
CPU_ADAM_ELEMENTS_PER_SECOND = 1e9  # per GPU's share of host cores (DeepSpeed CPU-Adam order of magnitude)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one layer kind: matmuls and the attention core (per unit of seq)."""

    matmul: float
    core_per_seq: float


@lru_cache(maxsize=64)
def layer_flops(model: ModelSpec, moe_layer: bool) -> LayerFlops:
    if model.mla:
        qk, v = model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim, model.mla.v_head_dim
    else:
        qk = v = model.head_dim
    idx = next((i for i in range(model.layers) if model.is_moe_layer(i) == moe_layer), 0)
    params = model.layer_params(idx)
    if moe_layer and model.moe:
        params -= (model.moe.experts - model.moe.top_k) * model.mlp_params(model.moe.expert_ffn_hidden)
    return LayerFlops(matmul=2.0 * params, core_per_seq=2.0 * model.heads * (qk + v))


def head_flops_per_token(model: ModelSpec) -> float:
    return 2.0 * model.hidden * model.vocab


@lru_cache(maxsize=256)
def model_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Model FLOPs per trained token (3 forward-equivalents, no recompute): the MFU numerator."""
    dense_n = sum(1 for i in range(model.layers) if not model.is_moe_layer(i))
    fwd = 0.0
    for moe, n in ((False, dense_n), (True, model.layers - dense_n)):
        if n:
            lf = layer_flops(model, moe)
            fwd += n * (lf.matmul + lf.core_per_seq * seq)
    return 3.0 * (fwd + head_flops_per_token(model))


def _passes(recompute: Recompute) -> tuple[float, float]:
    """(multiplier of matmul FLOPs, multiplier of attention-core FLOPs) relative to one forward."""
    if recompute == "full":
        return 4.0, 4.0
    if recompute == "selective":
        return 3.0, 4.0
    return 3.0, 3.0


def _ring(bytes_: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce time: each rank sends and receives 2(n-1)/n of the buffer."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * bytes_ / bandwidth


@dataclass(frozen=True)
class CostInputs:
    efficiency: float
    dp_overlap: float
    gpus_per_node: int


def stage_seconds(model: ModelSpec, prof: StageProfile, layout: Layout, hw: HardwareSpec, ci: CostInputs, *,
                  seq: int, micro_batch: int, recompute: Recompute) -> float:
    """Time of one micro-batch (forward + backward) on one pipeline rank, all its chunks.

    Every term is proportional to the micro-batch's tokens, so the planner calls this once
    with micro_batch=1 and scales.
    """
    tokens = seq * micro_batch
    mm, core = _passes(recompute)
    flops = 0.0
    for moe, n in ((False, prof.dense), (True, prof.moe)):
        if n:
            lf = layer_flops(model, moe)
            flops += n * (lf.matmul * mm + lf.core_per_seq * seq * core)
    if prof.last:
        flops += 3.0 * head_flops_per_token(model)
    compute = flops * tokens / layout.tp / (hw.peak_flops * ci.efficiency)
    return compute + _comm_seconds(model, prof, layout, hw, ci, tokens=tokens, recompute=recompute)


def _comm_seconds(model: ModelSpec, prof: StageProfile, layout: Layout, hw: HardwareSpec, ci: CostInputs, *,
                  tokens: int, recompute: Recompute) -> float:
    t, h = layout.tp, model.hidden
    act = 2.0 * tokens * h  # bf16 activations of one micro-batch
    layers = prof.dense + prof.moe
    # 1. TP (+SP) collectives inside the node
    n_coll = 6 if recompute == "full" else 4
    secs = layers * n_coll * _ring(act, t, hw.intra_node_bandwidth)
    # 2. MoE all-to-all: dispatch + combine, forward + backward; inter-node once EP spans nodes
    if model.moe and layout.ep > 1 and prof.moe:
        bw = hw.intra_node_bandwidth if t * layout.ep <= ci.gpus_per_node else hw.inter_node_bandwidth
        volume = act / t * model.moe.top_k * (layout.ep - 1) / layout.ep
        secs += prof.moe * 4 * volume / bw
    # 3. pipeline sends (activation forward, gradient backward) per chunk boundary
    if layout.pp > 1:
        bw = hw.intra_node_bandwidth if t * layout.dp < ci.gpus_per_node else hw.inter_node_bandwidth
        secs += 2 * layout.vpp * act / t / bw
    return secs


def dp_seconds(rp: RankParams, layout: Layout, hw: HardwareSpec, ci: CostInputs) -> float:
    """Gradient synchronisation of one rank's parameters (experts over their dp/ep replicas)."""
    span = layout.tp * layout.dp
    bw = hw.intra_node_bandwidth if span <= ci.gpus_per_node else hw.inter_node_bandwidth
    dense = rp.params - rp.expert_params
    groups = ((dense, layout.dp), (rp.expert_params, layout.dp // layout.ep))
    total = 0.0
    for n, d in groups:
        if d <= 1 or n == 0:
            continue
        if layout.zero:
            total += (d - 1) / d * n * (4 + 2) / bw  # reduce-scatter fp32 grads + all-gather bf16 weights
        else:
            total += _ring(4.0 * n, d, bw)
    return total


def offload_seconds(rp: RankParams) -> float:
    """Optimizer offload: fp32 grads down, bf16 weights up, CPU Adam over the shard."""
    n = rp.optimizer_elements
    return n * (4 + 2) / PCIE_BANDWIDTH + n / CPU_ADAM_ELEMENTS_PER_SECOND


def step_seconds(t_stage_max: float, microbatches: int, layout: Layout, dp_time: float, offload_time: float,
                 ci: CostInputs) -> float:
    """One optimizer step: pipeline (with bubble) + exposed DP sync + offloaded optimizer."""
    pipeline = (microbatches + (layout.pp - 1) / layout.vpp) * t_stage_max
    # The gradient sync overlaps with the backward of the last micro-batch (about 2/3 of it).
    hidden = min(dp_time * ci.dp_overlap, 2.0 / 3.0 * t_stage_max)
    return pipeline + dp_time - hidden + offload_time
