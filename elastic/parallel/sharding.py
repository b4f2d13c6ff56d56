"""Sharding specs: the exact box of every tensor each rank holds under a layout. Pure.

This module is the contract between the trainer (which allocates exactly these
local shapes, under exactly these names), the reshard planner (which moves the
boxes between layouts) and the layout planner's memory model (which counts them, see
``params.py``). It lives in ``elastic.parallel`` because the reshard planner builds on the
layout planner and never the other way round; ``elastic.reshard.spec`` re-exports it.

A *tensor* is a global parameter (``layers.3.mlp.up.weight``, global shape). A
*state kind* is what follows the parameter: ``param`` (the model weight), ``master``
(fp32 master copy, only when weights are kept in low precision), ``exp_avg`` and
``exp_avg_sq`` (Adam moments). The Adam step count is the training step, carried by
the rescale directive, not by a tensor. A *box* is a tuple of per-dimension
``(start, stop)`` half-open ranges into the global shape.

Sharding rules (Megatron-LM):

* TP: column-parallel weights (q/k/v, gate/up, fc1, and their biases) split on dim 0
  (the output dim), row-parallel weights (attention out, down, fc2) on dim 1 (the input
  dim), vocab-parallel embedding and LM head on dim 0 (vocab). q/k/v split on whole
  heads. Norms and row-parallel biases are replicated across TP. Splits that do not
  divide evenly are balanced: rank i of k gets ``[n*i//k, n*(i+1)//k)`` units.
* PP: a layer's tensors live on the pipeline rank that the stage partition assigns
  (``elastic.parallel.partition``), embedding on the first, final norm and head on the
  last, a tied embedding on both.
* EP: stacked expert tensors ``[experts, ...]`` split on dim 0 across the ``ep`` ranks
  formed by consecutive dp ranks (ep rank = dp_rank % ep); experts are replicated
  across the ``dp/ep`` such groups.
* DP: parameters are replicated. With ZeRO-1 (``layout.zero == 1``), the optimizer kinds
  (``master``, ``exp_avg``, ``exp_avg_sq``) of each parameter's local box are further
  split on dim 0 across its replicas (per-parameter, as FSDP2 does, so boxes stay boxes).
  A replica may then hold an empty box for a small tensor: such pieces are omitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from elastic.model import Layout, ModelSpec, check_layout
from elastic.parallel.partition import StagePartition, model_partition

Box = tuple[tuple[int, int], ...]
Kind = Literal["param", "master", "exp_avg", "exp_avg_sq"]
OPTIMIZER_KINDS: tuple[Kind, ...] = ("master", "exp_avg", "exp_avg_sq")
FP32_KINDS: tuple[Kind, ...] = ("param", "exp_avg", "exp_avg_sq")
"""State kinds of fp32 training (the weight is its own master copy): the CPU default."""
MIXED_KINDS: tuple[Kind, ...] = ("param", "master", "exp_avg", "exp_avg_sq")
"""State kinds of bf16 training with fp32 master weights."""

Placement = Literal["first", "last", "first+last", "layer"]


@dataclass(frozen=True)
class TensorSpec:
    """One global parameter and how it is sharded."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dim split across TP, None = replicated across TP
    tp_unit: int = 1  # split granularity along tp_dim (head_dim for q/k/v)
    placement: Placement = "layer"
    layer: int | None = None
    expert: bool = False  # dim 0 indexes experts and is split across EP

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def split_range(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """Balanced contiguous split of ``n`` elements (in units of ``unit``) into ``parts``."""
    units = n // unit
    return (units * index // parts * unit, units * (index + 1) // parts * unit)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


# --------------------------------------------------------------------------------------------
# Global tensor list
# --------------------------------------------------------------------------------------------


def model_tensors(model: ModelSpec) -> list[TensorSpec]:
    """Every parameter of ``model`` in a fixed, model order. Names are the trainer's names."""
    h, hd, b = model.hidden, model.head_dim, model.has_bias
    out: list[TensorSpec] = [
        TensorSpec("embed.weight", (model.vocab, h), 0, placement="first+last" if model.tie_embeddings else "first"),
    ]

    def norm(prefix: str, layer: int | None, placement: Placement = "layer") -> list[TensorSpec]:
        ts = [TensorSpec(f"{prefix}.weight", (h,), None, placement=placement, layer=layer)]
        if b:
            ts.append(TensorSpec(f"{prefix}.bias", (h,), None, placement=placement, layer=layer))
        return ts

    for i in range(model.layers):
        p = f"layers.{i}"
        out += norm(f"{p}.attn_norm", i)
        if model.mla:
            m = model.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            out += [
                TensorSpec(f"{p}.attn.q_down.weight", (m.q_lora_rank, h), None, layer=i),
                TensorSpec(f"{p}.attn.q_norm.weight", (m.q_lora_rank,), None, layer=i),
                TensorSpec(f"{p}.attn.q_up.weight", (model.heads * qk, m.q_lora_rank), 0, qk, layer=i),
                TensorSpec(f"{p}.attn.kv_down.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), None, layer=i),
                TensorSpec(f"{p}.attn.kv_norm.weight", (m.kv_lora_rank,), None, layer=i),
                TensorSpec(f"{p}.attn.kv_up.weight", (model.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                           0, m.qk_nope_head_dim + m.v_head_dim, layer=i),
                TensorSpec(f"{p}.attn.o.weight", (h, model.heads * m.v_head_dim), 1, m.v_head_dim, layer=i),
            ]
        else:
            q, kv = model.heads * hd, model.kv_heads * hd
            out += [
                TensorSpec(f"{p}.attn.q.weight", (q, h), 0, hd, layer=i),
                TensorSpec(f"{p}.attn.k.weight", (kv, h), 0, hd, layer=i),
                TensorSpec(f"{p}.attn.v.weight", (kv, h), 0, hd, layer=i),
            ]
            if b:
                out += [
                    TensorSpec(f"{p}.attn.q.bias", (q,), 0, hd, layer=i),
                    TensorSpec(f"{p}.attn.k.bias", (kv,), 0, hd, layer=i),
                    TensorSpec(f"{p}.attn.v.bias", (kv,), 0, hd, layer=i),
                ]
            out.append(TensorSpec(f"{p}.attn.o.weight", (h, q), 1, hd, layer=i))
            if b:
                out.append(TensorSpec(f"{p}.attn.o.bias", (h,), None, layer=i))
        out += norm(f"{p}.mlp_norm", i)
        if model.is_moe_layer(i):
            assert model.moe is not None
            e, f = model.moe.experts, model.moe.expert_ffn_hidden
            out.append(TensorSpec(f"{p}.moe.router.weight", (e, h), None, layer=i))
            out += _mlp(model, f"{p}.moe.experts", f, i, experts=e)
            if model.moe.shared_experts:
                out += _mlp(model, f"{p}.moe.shared", f * model.moe.shared_experts, i)
        else:
            out += _mlp(model, f"{p}.mlp", model.ffn_hidden, i)
    out += norm("final_norm", None, "last")
    if not model.tie_embeddings:
        out.append(TensorSpec("head.weight", (model.vocab, h), 0, placement="last"))
    return out


def _mlp(model: ModelSpec, prefix: str, width: int, layer: int, experts: int | None = None) -> list[TensorSpec]:
    h, b = model.hidden, model.has_bias
    lead = (experts,) if experts else ()
    ex = experts is not None
    d0 = 1 if ex else 0  # output dim of a column-parallel weight
    d1 = 2 if ex else 1  # input dim of a row-parallel weight
    ts: list[TensorSpec] = []
    if model.mlp == "swiglu":
        ts += [
            TensorSpec(f"{prefix}.gate.weight", lead + (width, h), d0, layer=layer, expert=ex),
            TensorSpec(f"{prefix}.up.weight", lead + (width, h), d0, layer=layer, expert=ex),
        ]
        if b:
            ts += [
                TensorSpec(f"{prefix}.gate.bias", lead + (width,), d0, layer=layer, expert=ex),
                TensorSpec(f"{prefix}.up.bias", lead + (width,), d0, layer=layer, expert=ex),
            ]
        ts.append(TensorSpec(f"{prefix}.down.weight", lead + (h, width), d1, layer=layer, expert=ex))
        if b:
            ts.append(TensorSpec(f"{prefix}.down.bias", lead + (h,), None, layer=layer, expert=ex))
    else:
        ts.append(TensorSpec(f"{prefix}.fc1.weight", lead + (width, h), d0, layer=layer, expert=ex))
        if b:
            ts.append(TensorSpec(f"{prefix}.fc1.bias", lead + (width,), d0, layer=layer, expert=ex))
        ts.append(TensorSpec(f"{prefix}.fc2.weight", lead + (h, width), d1, layer=layer, expert=ex))
        if b:
            ts.append(TensorSpec(f"{prefix}.fc2.bias", lead + (h,), None, layer=layer, expert=ex))
    return ts


# --------------------------------------------------------------------------------------------
# Boxes per rank
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardingSpec:
    """Sharding of one model under one layout. Build with :func:`sharding_spec` (cached)."""

    model: ModelSpec
    layout: Layout
    partition: StagePartition
    tensors: tuple[TensorSpec, ...]
    kinds: tuple[Kind, ...]

    def pp_ranks_of(self, t: TensorSpec) -> tuple[int, ...]:
        last = self.layout.pp - 1
        if t.placement == "first":
            return (0,)
        if t.placement == "last":
            return (last,)
        if t.placement == "first+last":
            return (0,) if last == 0 else (0, last)
        assert t.layer is not None
        return (self.partition.rank_of_layer(t.layer),)

    def param_box(self, t: TensorSpec, tp_rank: int, dp_rank: int) -> Box:
        """The box of the weight itself (identical on every DP replica of the same EP rank)."""
        L = self.layout
        box = list(full_box(t.shape))
        if t.expert and L.ep > 1:
            box[0] = split_range(t.shape[0], L.ep, dp_rank % L.ep)
        if t.tp_dim is not None and L.tp > 1:
            box[t.tp_dim] = split_range(t.shape[t.tp_dim], L.tp, tp_rank, t.tp_unit)
        return tuple(box)

    def replica_group(self, t: TensorSpec, dp_rank: int) -> tuple[int, int]:
        """(index, count) of this rank among the DP replicas of ``t``'s param box."""
        L = self.layout
        if t.expert and L.ep > 1:
            return dp_rank // L.ep, L.dp // L.ep
        return dp_rank, L.dp

    def box(self, t: TensorSpec, kind: Kind, rank: int) -> Box | None:
        """The box of ``(t, kind)`` that ``rank`` holds, or None."""
        tp_rank, dp_rank, pp_rank = self.layout.coords(rank)
        if pp_rank not in self.pp_ranks_of(t):
            return None
        box = self.param_box(t, tp_rank, dp_rank)
        if kind != "param" and self.layout.zero:
            idx, count = self.replica_group(t, dp_rank)
            a, b = box[0]
            lo, hi = split_range(b - a, count, idx)
            box = ((a + lo, a + hi),) + box[1:]
        if box_numel(box) == 0:
            return None
        return box

    def rank_pieces(self, rank: int) -> dict[tuple[str, Kind], Box]:
        """Everything ``rank`` holds: ``(tensor name, kind) -> box``."""
        out: dict[tuple[str, Kind], Box] = {}
        for t in self.tensors_on_pp_rank(self.layout.coords(rank)[2]):
            for k in self.kinds:
                bx = self.box(t, k, rank)
                if bx is not None:
                    out[(t.name, k)] = bx
        return out

    def tensors_on_pp_rank(self, pp_rank: int) -> list[TensorSpec]:
        return [t for t in self.tensors if pp_rank in self.pp_ranks_of(t)]

    def iter_pieces(self) -> Iterator[tuple[int, str, Kind, Box]]:
        """(rank, tensor name, kind, box) for every piece every rank holds."""
        for r in range(self.layout.world_size):
            for (name, kind), bx in self.rank_pieces(r).items():
                yield r, name, kind, bx

    def tensor(self, name: str) -> TensorSpec:
        return _index(self.tensors)[name]

    def bytes_per_rank(self, rank: int, bytes_per_element: int = 4) -> int:
        return sum(box_numel(b) for b in self.rank_pieces(rank).values()) * bytes_per_element


@lru_cache(maxsize=64)
def _index(tensors: tuple[TensorSpec, ...]) -> dict[str, TensorSpec]:
    return {t.name: t for t in tensors}


@lru_cache(maxsize=64)
def _tensors_cached(model: ModelSpec) -> tuple[TensorSpec, ...]:
    return tuple(model_tensors(model))


def sharding_spec(model: ModelSpec, layout: Layout, kinds: tuple[Kind, ...] = FP32_KINDS) -> ShardingSpec:
    """Validate ``layout`` for ``model`` and build its sharding spec."""
    check_layout(model, layout)
    return ShardingSpec(model, layout, model_partition(model, layout.pp, layout.vpp), _tensors_cached(model), kinds)
