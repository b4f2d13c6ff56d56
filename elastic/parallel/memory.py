"""Per-GPU memory model of 3D-parallel mixed-precision training, by component. Pure.

What it is for: deciding, before anything is launched, whether a (layout, micro-batch,
recompute, offload) choice fits on a GPU. The controller relies on it never to rescale
a job into an out-of-memory layout, so every term errs on the large side.

Accounting (Megatron-LM ``megatron/training/theoretical_memory_usage.py``):

* weights: bf16, 2 bytes per parameter held; gradients: fp32 main-grad buffer, 4 bytes;
  optimizer: fp32 master copy + two Adam moments, 12 bytes per parameter of the rank's
  optimizer shard (all of its parameters without ZeRO; about ``1/dp`` of them with ZeRO-1,
  so 2 + 4 + 12/dp = 6 + 12/dp bytes per parameter, Megatron's distributed optimizer).
  Parameter counts per rank are exactly ``elastic.parallel.sharding``'s boxes (``params.py``).
* activations per transformer layer (Korthikanti et al. 2022, Table 2), bytes per token of
  one micro-batch, with sequence parallelism whenever tp > 1 (so everything divides by tp):
  ``R = 10h`` (norm inputs, QKV and MLP inputs, dropout masks), attention
  ``2q + 2k + 2v + 2o`` (= 8h for MHA), MLP ``4*ffn`` (GeLU) or ``6*ffn`` (SwiGLU:
  gate, up and their product), attention scores ``5*heads*s``. GPT (ffn = 4h):
  ``sbh(34 + 5as/h)``; selective recompute drops the scores (``34 sbh/t``, also what
  flash attention stores); full recompute keeps only the layer input ``2sbh/t`` plus one
  layer's full working set during its backward. The reference trainer (``elastic.train``)
  runs this sequence parallelism and a flash attention kernel, so it holds the selective
  count (less the dropout masks: it has no dropout) whatever the plan's recompute says.
* in-flight micro-batches (1F1B): pipeline rank p holds ``min(m, pp - p)`` of them;
  interleaved (vpp chunks): ``min(m*vpp, 2(pp-p-1) + (vpp-1)pp + 1)`` chunk-micro-batches,
  which for p = 0 is Megatron's ``pp * (1 + (pp-1)/(pp*vpp))``.
* embedding inputs and dropout on the first stage (``8sb + sbh`` per micro-batch in
  flight), logits and loss on the last (``4sbh(1 + V/h)``, one micro-batch).
* reserve: fixed bytes (CUDA context, NCCL buffers) + a fraction of device memory
  (allocator fragmentation).
* precision (:data:`PRECISIONS`): the counts above are Megatron's bf16 mixed precision, the
  default. A job that trains in fp32 or fp64 holds 4 or 8 bytes per weight and gradient, Adam's
  two moments in the same width and no master copy, and activations 2 or 4 times the bf16 count
  (fp64 logits twice the fp32 ones).

The largest stage decides fit. What it must not do: read any hardware state; it is a
model, fed by ``ModelSpec``/``HardwareSpec`` numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from elastic.model import ModelSpec
from elastic.parallel.partition import StagePartition, partition_layers

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full")

WEIGHT_BYTES = 2  # bf16 weight
GRAD_BYTES = 4  # fp32 main gradient
OPTIMIZER_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq
GiB = 1024**3

Precision = Literal["bf16-mixed", "fp32", "fp64"]


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of what a job in one precision holds. ``activations``/``logits``: factors on
    the model's activation count (bf16 activations, fp32 logits)."""

    weight: int
    gradient: int
    optimizer: int  # per element of the rank's optimizer shard, every state kind together
    activations: float
    logits: float


#: Megatron's mixed precision (bf16 weights and activations, fp32 main gradients, master copy and
#: Adam moments), the GPU default; and plain fp32 or fp64 training (the weights are their own master
#: copy: Adam's two moments only), which is what the reference trainer runs on CPU.
PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, 1.0, 1.0),
    "fp32": PrecisionBytes(4, 4, 8, 2.0, 1.0),
    "fp64": PrecisionBytes(8, 8, 16, 4.0, 2.0),
}
#: the precision of a trainer's torch dtype name (what ``MeasuredMemory.dtype`` records)
DTYPE_PRECISION: dict[str, Precision] = {"bfloat16": "bf16-mixed", "float32": "fp32", "float64": "fp64"}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of the stage that decides fit. ``host_optimizer``: bytes moved to host by offload."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    reserve: int
    stage: int = 0
    host_optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "reserve": self.reserve, "total": self.total}


# --------------------------------------------------------------------------------------------
# Activations per layer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivation:
    """Activation bytes per token of one micro-batch for one layer kind (before dividing by tp)."""

    replicated: float  # R: norm inputs, QKV/MLP inputs, dropout masks
    sharded: float  # attention projections + MLP intermediates
    scores_per_seq: float  # attention scores/softmax/dropout: this x seq_len


@lru_cache(maxsize=64)
def layer_activation(model: ModelSpec, moe_layer: bool) -> LayerActivation:
    h = model.hidden
    if model.mla:
        m = model.mla
        q = k = model.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        v = o = model.heads * m.v_head_dim
    else:
        q = o = model.heads * model.head_dim
        k = v = model.kv_heads * model.head_dim
    attention = 2 * q + 2 * k + 2 * v + 2 * o
    per_width = 6 if model.mlp == "swiglu" else 4
    if moe_layer and model.moe:
        e = model.moe
        # each token is copied to top_k experts (their input and intermediates) plus the shared ones
        mlp = e.top_k * (2 * h + per_width * e.expert_ffn_hidden) + per_width * e.expert_ffn_hidden * e.shared_experts
    else:
        mlp = per_width * model.ffn_hidden
    return LayerActivation(replicated=10 * h, sharded=attention + mlp, scores_per_seq=5 * model.heads)


def layer_bytes_per_token(act: LayerActivation, tp: int, seq: int, recompute: Recompute, h: int) -> float:
    """Stored bytes per token of one micro-batch for one layer. tp > 1 implies sequence parallel."""
    if recompute == "full":
        return 2 * h / tp
    total = act.replicated + act.sharded
    if recompute == "none":
        total += act.scores_per_seq * seq
    return total / tp


def working_bytes_per_token(act: LayerActivation, tp: int, seq: int, h: int) -> float:
    """Full recompute: the one layer being recomputed holds its complete activations."""
    return layer_bytes_per_token(act, tp, seq, "none", h)


# --------------------------------------------------------------------------------------------
# Pipeline schedule: micro-batches in flight
# --------------------------------------------------------------------------------------------


def chunks_in_flight(pp: int, vpp: int, microbatches: int, pp_rank: int) -> int:
    """Chunk-micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak."""
    if vpp == 1:
        return min(microbatches, pp - pp_rank)
    warmup = 2 * (pp - pp_rank - 1) + (vpp - 1) * pp  # Megatron's interleaved warm-up
    return min(microbatches * vpp, warmup + 1)


# --------------------------------------------------------------------------------------------
# Stage profiles: the few stages that can be the largest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageProfile:
    """Layer mix of one pipeline rank. ``chunks``: distinct (dense, moe) layer counts of its chunks."""

    pp_rank: int
    dense: int
    moe: int
    chunks: tuple[tuple[int, int], ...]
    first: bool
    last: bool


@lru_cache(maxsize=4096)
def _partition(layers: int, pp: int, vpp: int) -> StagePartition:
    return partition_layers(layers, pp, vpp)


@lru_cache(maxsize=4096)
def stage_mixes(model: ModelSpec, pp: int, vpp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per pipeline rank: the (dense, moe) layer counts of each of its chunks."""
    part = _partition(model.layers, pp, vpp)
    moe_layer = [model.is_moe_layer(i) for i in range(model.layers)]
    per_chunk = []
    for ls in part.chunks:
        moe = sum(1 for i in ls if moe_layer[i])
        per_chunk.append((len(ls) - moe, moe))
    return tuple(tuple(per_chunk[c] for c in range(p, pp * vpp, pp)) for p in range(pp))


@lru_cache(maxsize=4096)
def stage_profiles(model: ModelSpec, pp: int, vpp: int) -> tuple[StageProfile, ...]:
    """Candidate stages for the memory maximum.

    Activations in flight fall with the rank (rank p holds ``pp - p`` micro-batches), so of
    two ranks with the same layer mix the earlier one needs at least as much; only the
    first rank of each distinct mix, plus the first and last rank, can decide fit.
    """
    out: list[StageProfile] = []
    seen: set[tuple[object, ...]] = set()
    for p, mix in enumerate(stage_mixes(model, pp, vpp)):
        dense = sum(d for d, _ in mix)
        moe = sum(m for _, m in mix)
        prof = StageProfile(p, dense, moe, tuple(sorted(set(mix))), p == 0, p == pp - 1)
        key = (dense, moe, prof.chunks, prof.first, prof.last)
        if key not in seen:
            seen.add(key)
            out.append(prof)
    return tuple(out)


@dataclass(frozen=True)
class ActivationTerms:
    """Activation bytes per token of a micro-batch on one pipeline rank, split by how they scale."""

    chunk: float  # per chunk-micro-batch in flight (the rank's biggest chunk)
    embed: float  # per micro-batch in flight of the first chunk (first stage only)
    once: float  # held once: the layer being recomputed (full), logits and loss (last stage)

    def bytes(self, tokens: int, held: int, vpp: int) -> int:
        return int(tokens * (self.chunk * held + self.embed * held / vpp + self.once))


@lru_cache(maxsize=65536)
def activation_terms(model: ModelSpec, prof: StageProfile, tp: int, seq: int, recompute: Recompute,
                     precision: Precision = "bf16-mixed") -> ActivationTerms:
    """The terms of one pipeline rank in ``precision`` (the counts below are bf16 activations and
    fp32 logits, scaled by :data:`PRECISIONS`)."""
    b = PRECISIONS[precision]
    t = _activation_terms(model, prof, tp, seq, recompute)
    return ActivationTerms(t.chunk * b.activations, t.embed * b.activations,
                           t.once_layer * b.activations + t.logits * b.logits)


@dataclass(frozen=True)
class _Terms:
    chunk: float
    embed: float
    once_layer: float
    logits: float


@lru_cache(maxsize=65536)
def _activation_terms(model: ModelSpec, prof: StageProfile, tp: int, seq: int, recompute: Recompute) -> _Terms:
    h = model.hidden
    dense = layer_activation(model, False)
    moe = layer_activation(model, True)
    per_dense = layer_bytes_per_token(dense, tp, seq, recompute, h)
    per_moe = layer_bytes_per_token(moe, tp, seq, recompute, h)
    # 1. the biggest chunk of this rank (held once per chunk-micro-batch in flight)
    chunk = max(d * per_dense + m * per_moe for d, m in prof.chunks)
    once = 0.0
    # 2. full recompute: one layer's complete activations while it is recomputed in backward
    if recompute == "full":
        kinds = [dense] * (prof.dense > 0) + [moe] * (prof.moe > 0)
        once += max((working_bytes_per_token(a, tp, seq, h) for a in kinds), default=0.0)
    # 3. embedding input ids (int64) and dropout mask, per micro-batch in flight (Megatron)
    embed = (8 + h) / tp if prof.first else 0.0
    # 4. logits (fp32) and the final-norm output for the loss: one micro-batch on the last stage
    logits = 4 * (h + model.vocab) / tp if prof.last else 0.0
    return _Terms(chunk, embed, once, logits)


def stage_activation_bytes(model: ModelSpec, prof: StageProfile, *, tp: int, pp: int, vpp: int, seq: int,
                           micro_batch: int, microbatches: int, recompute: Recompute,
                           precision: Precision = "bf16-mixed") -> int:
    """Peak activation bytes on the GPUs of one pipeline rank."""
    held = chunks_in_flight(pp, vpp, microbatches, prof.pp_rank)
    return activation_terms(model, prof, tp, seq, recompute, precision).bytes(seq * micro_batch, held, vpp)
