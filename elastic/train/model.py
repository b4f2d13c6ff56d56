"""The GPT decoder, cut into one pipeline stage and one tensor-parallel shard.

What it is for: :class:`GPTStage` is the part of the model one rank runs. Its parameter
names are exactly the tensor names of :mod:`elastic.reshard.spec` (``embed.weight``,
``layers.3.attn.q.weight``, ``layers.3.mlp.down.weight``, ``final_norm.weight``,
``head.weight``) and their shapes exactly this rank's boxes, so the engine can hand the
live parameters to the resharder and adopt the tensors it gets back. With ``vpp > 1`` a rank
holds ``vpp`` model chunks (the stage partition's chunks ``c*pp + pp_rank``, virtual padding
slots left out) and runs one at a time (``forward(x, chunk)``).

Mixture of experts (``model.moe``): layers from ``moe.dense_layers`` on replace the MLP by
:class:`elastic.train.moe.MoE` (``layers.5.moe.router.weight``, the stacked routed experts
``layers.5.moe.experts.*`` of which a rank holds its expert-parallel box, the shared experts
``layers.5.moe.shared.*``); the first ones stay dense, as in DeepSeek-V3.

Architecture: pre-norm decoder; causal self-attention with grouped-query heads (GQA) and
rotary position embeddings (RoPE); MLP ``swiglu`` (gate/up/down, RMSNorm) or ``gelu``
(fc1/fc2, LayerNorm); biases when ``model.has_bias``; optional tied embeddings (the last
stage then holds its own copy of ``embed.weight`` as the LM head).

Megatron TP with sequence parallelism (:mod:`elastic.train.tp`): q/k/v, gate/up and fc1 are
column-parallel (whole heads per rank), attention out, down and fc2 row-parallel, the embedding
and head vocab-parallel; norms and row-parallel biases are replicated. Whenever tp > 1 the hidden
states between TP regions are this rank's ``seq_len / tp`` positions: the embedding's output is
reduce-scattered along the sequence, norms and residual adds run on the shard, each block
all-gathers the sequence into its column-parallel linears and reduce-scatters it out of its
row-parallel one, pipeline stages pass the shard on (:meth:`GPTStage.boundary_shape`), and the
sequence is gathered again into the vocab-parallel head. ``seq_len`` must divide by tp.

Kernels hold what fused production kernels hold between forward and backward (what the
planner's activation count, :mod:`elastic.parallel.memory`, describes): a norm keeps its input
and per-token statistics, SwiGLU its two inputs, attention is PyTorch's scaled-dot-product
attention (a flash kernel on CPU: q, k, v, its output and the log-sum-exp; key/value heads are
shared by their query heads, never repeated), and a column-parallel linear keeps the
sequence shard of its input.

Must not: communicate outside TP and the MoE layers' expert-parallel exchange (pipeline and
data parallelism live in the engine),
initialise weights (the engine does, from the global tensors), or hold optimizer state.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic.model import ModelSpec, SpecError
from elastic.reshard.spec import ShardingSpec, box_shape, split_range
from elastic.train.groups import Comm
from elastic.train.moe import MoE
from elastic.train.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_linears,
    sp_param,
    vocab_parallel_cross_entropy,
)

NORM_EPS = 1e-5
ROPE_BASE = 10000.0


def check_supported(model: ModelSpec) -> None:
    """The reference trainer runs GPTs with GQA attention, dense or mixture-of-experts; say so clearly
    for the rest."""
    if model.mla is not None:
        raise SpecError(f"model {model.name}: multi-head latent attention is not supported by the reference "
                        "trainer; use a model with plain (GQA) attention")


def check_sequence_split(model: ModelSpec, tp: int) -> None:
    """Sequence parallelism splits every sequence into ``tp`` equal shards."""
    if model.seq_len % tp:
        raise SpecError(f"model {model.name}: seq_len={model.seq_len} is not divisible by tp={tp} "
                        f"({model.seq_len} % {tp} = {model.seq_len % tp}); the reference trainer splits the sequence "
                        "over the TP ranks (sequence parallelism): choose a tp dividing seq_len, or a seq_len "
                        "that is a multiple of tp")


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * w (+ b)``, keeping only ``x`` and the per-token ``rsqrt`` for backward
    (as a fused kernel does); the normalised values are recomputed there. Sums in fp32 for bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        ctx.save_for_backward(x, rstd, w)
        ctx.has_bias = b is not None
        y = (xf * rstd).to(x.dtype) * w
        return y if b is None else y + b

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, rstd, w = ctx.saved_tensors
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        n = xf * rstd
        lead = tuple(range(dy.dim() - 1))
        dw = (dy * n.to(dy.dtype)).sum(lead)
        db = dy.sum(lead) if ctx.has_bias else None
        dn = (dy * w).to(n.dtype)
        dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, db


class Norm(nn.Module):
    """RMSNorm (``kind="rms"``) or LayerNorm (``"layer"``), optional bias, on this rank's sequence shard
    (its weight's gradient summed over TP: :func:`elastic.train.tp.sp_param`)."""

    def __init__(self, hidden: int, kind: str, bias: bool, tp: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.kind = kind
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sp_param(self.weight, self.tp)
        b = None if self.bias is None else sp_param(self.bias, self.tp)
        if self.kind == "layer":  # PyTorch's fused kernel: keeps x, the mean and rsqrt of the variance
            return F.layer_norm(x, (x.shape[-1],), w, b, NORM_EPS)
        return _RMSNorm.apply(x, w, b)


@lru_cache(maxsize=16)
def _rope_tables(seq: int, half: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles ``[seq, 1, half]``, computed once (a fused RoPE kernel's table)."""
    inv = 1.0 / ROPE_BASE ** (torch.arange(half, dtype=torch.float64, device=device) / half)
    ang = torch.arange(seq, dtype=torch.float64, device=device)[:, None, None] * inv
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[batch, seq, heads, head_dim]`` by ``sign`` times the angles (-1: the
    inverse rotation, which is also the transpose: the backward)."""
    dim = x.shape[-1]
    half = dim // 2
    cos, sin = _rope_tables(x.shape[1], half, x.dtype, str(x.device))
    sin = sin if sign > 0 else -sin
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rot if 2 * half == dim else torch.cat([rot, x[..., 2 * half:]], dim=-1)


class _RoPE(torch.autograd.Function):
    """RoPE keeping nothing for backward (a rotation's gradient is the inverse rotation of the
    output's), as a fused kernel does; the cos/sin table is shared, not saved per call."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _rotate(x, 1.0)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        return _rotate(dy, -1.0)


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x`` shaped ``[batch, seq, heads, head_dim]``."""
    return _RoPE.apply(x)


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, tp: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        h, hd, b = model.hidden, model.head_dim, model.has_bias
        self.tp = tp
        self.head_dim = hd
        self.heads = model.heads // tp.size  # local query heads
        self.kv_heads = model.kv_heads // tp.size  # local key/value heads
        self.q = ColumnParallelLinear(h, self.heads * hd, b, dtype, device)
        self.k = ColumnParallelLinear(h, self.kv_heads * hd, b, dtype, device)
        self.v = ColumnParallelLinear(h, self.kv_heads * hd, b, dtype, device)
        self.o = RowParallelLinear(self.heads * hd, h, b, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's sequence shard ``[b, s/tp, h]``; returns the same shard of the output."""
        q, k, v = gather_linears(x, self.tp, [self.q.wb, self.k.wb, self.v.wb])
        bsz, seq = q.shape[0], q.shape[1]
        # [b, s, heads, head_dim] in memory, viewed [b, heads, s, head_dim]: the CPU flash kernel then
        # lays its output out [b, s, heads, head_dim] too, so the out-projection's input is a view of
        # it and keeps the very tensor attention keeps (no copy)
        q = rope(q.view(bsz, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = rope(k.view(bsz, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        # GQA: local query head j reads local kv head j // group (both split on whole heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(bsz, seq, self.heads * self.head_dim))


class _SwiGLU(torch.autograd.Function):
    """``silu(g) * u``, keeping only ``g`` and ``u`` for backward (Megatron's fused ``bias_swiglu``)."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        s = torch.sigmoid(g)
        return dy * u * s * (1 + g * (1 - s)), dy * (g * s)


class MLP(nn.Module):
    """The dense MLP (``width`` defaults to ``model.ffn_hidden``; a MoE layer's shared experts are one of these)."""

    def __init__(self, model: ModelSpec, tp: Comm, dtype: torch.dtype, device: str, width: int | None = None) -> None:
        super().__init__()
        h, b = model.hidden, model.has_bias
        # the width need not divide by tp: the spec's balanced split decides this rank's width
        lo, hi = split_range(model.ffn_hidden if width is None else width, tp.size, tp.index)
        w = hi - lo
        self.tp = tp
        self.kind = model.mlp
        if model.mlp == "swiglu":
            self.gate = ColumnParallelLinear(h, w, b, dtype, device)
            self.up = ColumnParallelLinear(h, w, b, dtype, device)
            self.down = RowParallelLinear(w, h, b, tp, dtype, device)
        else:
            self.fc1 = ColumnParallelLinear(h, w, b, dtype, device)
            self.fc2 = RowParallelLinear(w, h, b, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's sequence shard; returns the same shard of the output."""
        if self.kind == "swiglu":
            g, u = gather_linears(x, self.tp, [self.gate.wb, self.up.wb])
            return self.down(_SwiGLU.apply(g, u))
        (a,) = gather_linears(x, self.tp, [self.fc1.wb])
        return self.fc2(F.gelu(a))


class Block(nn.Module):
    """Layer ``layer``: attention, then the dense MLP (``self.mlp``) or, in a MoE layer, ``self.moe``."""

    def __init__(self, model: ModelSpec, layer: int, tp: Comm, ep: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        kind = "rms" if model.mlp == "swiglu" else "layer"
        self.attn_norm = Norm(model.hidden, kind, model.has_bias, tp, dtype, device)
        self.attn = Attention(model, tp, dtype, device)
        self.mlp_norm = Norm(model.hidden, kind, model.has_bias, tp, dtype, device)
        self.is_moe = model.is_moe_layer(layer)
        if self.is_moe:
            assert model.moe is not None
            m = model.moe
            shared = MLP(model, tp, dtype, device, m.shared_experts * m.expert_ffn_hidden) if m.shared_experts else None
            self.moe = MoE(model, tp, ep, dtype, device, shared)
        else:
            self.mlp = MLP(model, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + (self.moe if self.is_moe else self.mlp)(self.mlp_norm(x))


class GPTStage(nn.Module):
    """The layers of one pipeline rank (all its model chunks), TP-sharded. First stage: ids ->
    hidden; last: -> loss."""

    def __init__(self, spec: ShardingSpec, rank: int, tp: Comm, dtype: torch.dtype, device: str,
                 ep: Comm | None = None) -> None:
        super().__init__()
        model, layout = spec.model, spec.layout
        check_supported(model)
        check_sequence_split(model, layout.tp)
        tp_rank, dp_rank, pp_rank = layout.coords(rank)
        self.model_spec = model
        self.tp = tp
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == layout.pp - 1
        vocab_box = spec.param_box(spec.tensor("embed.weight"), tp_rank, dp_rank)[0]
        self.vocab_start = vocab_box[0]
        rows = vocab_box[1] - vocab_box[0]
        kind = "rms" if model.mlp == "swiglu" else "layer"
        if self.is_first or (self.is_last and model.tie_embeddings):
            self.embed = VocabParallelEmbedding(self.vocab_start, rows, model.hidden, tp, dtype, device)
        self.layers = nn.ModuleDict(
            {str(i): Block(model, i, tp, ep if ep is not None else Comm.solo(rank), dtype, device)
             for i in spec.partition.layers_of_rank(pp_rank)}
        )
        # the rank's model chunks (vpp of them): chunk c is virtual stage c*pp + pp_rank; its virtual
        # padding slots hold nothing and compute nothing (identity), so only real layers are listed
        part = spec.partition
        self.vpp = layout.vpp
        self.chunk_layers: tuple[tuple[str, ...], ...] = tuple(
            tuple(str(i) for i in part.chunks[c * layout.pp + pp_rank]) for c in range(layout.vpp))
        if self.is_last:
            self.final_norm = Norm(model.hidden, kind, model.has_bias, tp, dtype, device)
            if not model.tie_embeddings:
                self.head = nn.Module()
                self.head.weight = nn.Parameter(torch.empty(rows, model.hidden, dtype=dtype, device=device))
        self._check_against(spec, rank)

    def _check_against(self, spec: ShardingSpec, rank: int) -> None:
        """Every parameter is one of the spec's tensors, with this rank's box shape, and vice versa."""
        want = {name: box_shape(box) for (name, kind), box in spec.rank_pieces(rank).items() if kind == "param"}
        have = {name: tuple(p.shape) for name, p in self.named_parameters()}
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()))
            raise AssertionError(f"trainer parameters differ from the sharding spec at rank {rank}: {diff[:6]}")

    def set_moe_loss_scale(self, scale: float) -> None:
        """The weight of the MoE balance loss in the next micro-batch's objective (its LM loss's weight
        times the balance coefficient): the gradient the MoE layers give their balance terms."""
        for block in self.layers.values():
            if block.is_moe:
                moe = block.moe
                assert isinstance(moe, MoE)
                moe.loss_scale = scale

    def boundary_shape(self, micro_batch: int) -> tuple[int, int, int]:
        """The shape of what passes between pipeline stages: a micro-batch's hidden states, this rank's
        sequence shard ``[micro_batch, seq_len / tp, hidden]``."""
        m = self.model_spec
        return (micro_batch, m.seq_len // self.tp.size, m.hidden)

    def takes_tokens(self, chunk: int) -> bool:
        """Whether ``chunk`` is the first virtual stage (it embeds token ids)."""
        return self.is_first and chunk == 0

    def gives_logits(self, chunk: int) -> bool:
        """Whether ``chunk`` is the last virtual stage (it ends in the LM head and the loss)."""
        return self.is_last and chunk == self.vpp - 1

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Model chunk ``chunk`` (the rank's only one when vpp = 1). First virtual stage: token
        ids ``[b, s]``; others: hidden ``[b, s/tp, h]`` (this rank's sequence shard). Returns hidden
        (the shard), or on the last virtual stage this rank's vocab slice of the logits ``[b, s, V/tp]``
        (the whole sequence)."""
        h = self.embed(x) if self.takes_tokens(chunk) else x
        for i in self.chunk_layers[chunk]:
            h = self.layers[i](h)
        if not self.gives_logits(chunk):
            return h
        head = self.embed.weight if self.model_spec.tie_embeddings else self.head.weight
        assert isinstance(head, torch.Tensor)
        (logits,) = gather_linears(self.final_norm(h), self.tp, [(head, None)])
        return logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of this micro-batch (identical on every TP rank)."""
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), self.vocab_start, self.tp)
        return per_token.mean()
