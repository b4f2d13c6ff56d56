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

Megatron TP: q/k/v, gate/up and fc1 are column-parallel (whole heads per rank), attention
out, down and fc2 row-parallel, the embedding and head vocab-parallel; norms and
row-parallel biases are replicated.

Must not: communicate outside TP and the MoE layers' expert-parallel exchange (pipeline and
data parallelism live in the engine),
initialise weights (the engine does, from the global tensors), or hold optimizer state.
"""

from __future__ import annotations

import math

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
    copy_to_tp,
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


class Norm(nn.Module):
    """RMSNorm (``kind="rms"``) or LayerNorm (``"layer"``), optional bias; computed in fp32."""

    def __init__(self, hidden: int, kind: str, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        if self.kind == "layer":
            xf = xf - xf.mean(-1, keepdim=True)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        y = y.to(x.dtype) * self.weight
        return y if self.bias is None else y + self.bias


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x`` shaped ``[batch, heads, seq, head_dim]``."""
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    inv = 1.0 / ROPE_BASE ** (torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = torch.arange(seq, dtype=torch.float64, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rot if 2 * half == dim else torch.cat([rot, x[..., 2 * half:]], dim=-1)


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
        bsz, seq, _ = x.shape
        x = copy_to_tp(x, self.tp)
        q = self.q(x).view(bsz, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(bsz, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(bsz, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        if self.kv_heads != self.heads:
            # GQA: local query head j reads local kv head j // group (both split on whole heads)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(bsz, seq, self.heads * self.head_dim)
        return self.o(out)


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
        x = copy_to_tp(x, self.tp)
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Layer ``layer``: attention, then the dense MLP (``self.mlp``) or, in a MoE layer, ``self.moe``."""

    def __init__(self, model: ModelSpec, layer: int, tp: Comm, ep: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        kind = "rms" if model.mlp == "swiglu" else "layer"
        self.attn_norm = Norm(model.hidden, kind, model.has_bias, dtype, device)
        self.attn = Attention(model, tp, dtype, device)
        self.mlp_norm = Norm(model.hidden, kind, model.has_bias, dtype, device)
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
            self.final_norm = Norm(model.hidden, kind, model.has_bias, dtype, device)
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
                block.moe.loss_scale = scale

    def takes_tokens(self, chunk: int) -> bool:
        """Whether ``chunk`` is the first virtual stage (it embeds token ids)."""
        return self.is_first and chunk == 0

    def gives_logits(self, chunk: int) -> bool:
        """Whether ``chunk`` is the last virtual stage (it ends in the LM head and the loss)."""
        return self.is_last and chunk == self.vpp - 1

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Model chunk ``chunk`` (the rank's only one when vpp = 1). First virtual stage: token
        ids ``[b, s]``; others: hidden ``[b, s, h]``. Returns hidden (or this rank's vocab slice of
        the logits on the last virtual stage)."""
        h = self.embed(x) if self.takes_tokens(chunk) else x
        for i in self.chunk_layers[chunk]:
            h = self.layers[i](h)
        if not self.gives_logits(chunk):
            return h
        h = copy_to_tp(self.final_norm(h), self.tp)
        head = self.embed.weight if self.model_spec.tie_embeddings else self.head.weight
        return F.linear(h, head)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of this micro-batch (identical on every TP rank)."""
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), self.vocab_start, self.tp)
        return per_token.mean()
