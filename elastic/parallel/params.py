"""Parameters held by one rank under a layout, counted exactly as ``elastic.parallel.sharding`` shards them. Pure.

What it is for: the memory model needs "how many weight elements does rank r hold" and
"how many optimizer-state elements does its ZeRO-1 shard hold" for thousands of
candidate layouts. ``ShardingSpec.rank_pieces`` answers that exactly but walks every
tensor of the model for one rank; here the same boxes are summed once per *kind of
layer* (dense, MoE) and per placement group (first stage, last stage), then multiplied
by the layer counts of a stage. The answer is identical to the spec's (a test checks it
for every rank of several layouts), only far cheaper.

What it must not do: invent its own sharding rules. Every box comes from
``ShardingSpec.param_box`` / ``replica_group`` / ``split_range``, so when the spec
changes, this changes with it.

Most-loaded rank: balanced splits give the *last* index the ceiling share
(``split_range(n, k, k-1)`` has ``ceil(n/k)`` units), so within a pipeline stage the rank
``(tp_rank=tp-1, dp_rank=dp-1)`` holds the most of every tensor at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from elastic.model import Layout, ModelSpec
from elastic.parallel.partition import StagePartition, model_partition
from elastic.parallel.sharding import TensorSpec, box_numel, model_tensors, sharding_spec, split_range

_GROUPS = ("dense", "moe", "first", "last", "first+last")


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds. ``optimizer_elements`` is per optimizer kind (master, exp_avg, exp_avg_sq)."""

    params: int
    expert_params: int  # part of ``params`` in expert tensors (DP-replicated over dp/ep ranks only)
    optimizer_elements: int  # = params without ZeRO; this rank's ZeRO-1 shard with it

    def __add__(self, other: RankParams) -> RankParams:
        return RankParams(self.params + other.params, self.expert_params + other.expert_params,
                          self.optimizer_elements + other.optimizer_elements)

    def scaled(self, k: int) -> RankParams:
        return RankParams(self.params * k, self.expert_params * k, self.optimizer_elements * k)



@lru_cache(maxsize=32)
def _grouped_tensors(model: ModelSpec) -> dict[str, tuple[TensorSpec, ...]]:
    """Tensors of one representative dense layer, one MoE layer, and the first/last-stage extras."""
    first_dense = next((i for i in range(model.layers) if not model.is_moe_layer(i)), None)
    first_moe = next((i for i in range(model.layers) if model.is_moe_layer(i)), None)
    groups: dict[str, list[TensorSpec]] = {g: [] for g in _GROUPS}
    for t in model_tensors(model):
        if t.layer is None:
            groups[t.placement].append(t)
        elif t.layer == first_dense:
            groups["dense"].append(t)
        elif t.layer == first_moe:
            groups["moe"].append(t)
    return {g: tuple(ts) for g, ts in groups.items()}


@lru_cache(maxsize=4096)
def _group_counts(model: ModelSpec, tp: int, dp: int, ep: int, zero: int, tp_rank: int,
                  dp_rank: int) -> dict[str, RankParams]:
    """Per group: the elements the rank (tp_rank, dp_rank) holds, from the spec's own box rules."""
    spec = sharding_spec(model, Layout(tp=tp, pp=1, dp=dp, ep=ep, zero=zero), kinds=("param",))
    out: dict[str, RankParams] = {}
    for g, tensors in _grouped_tensors(model).items():
        n = ne = no = 0
        for t in tensors:
            box = spec.param_box(t, tp_rank, dp_rank)
            k = box_numel(box)
            n += k
            ne += k if t.expert else 0
            if zero:
                # ZeRO-1 splits the local box on dim 0 across the parameter's replicas (spec.box).
                idx, count = spec.replica_group(t, dp_rank)
                a, b = box[0]
                lo, hi = split_range(b - a, count, idx)
                no += k // max(1, b - a) * (hi - lo) if b > a else 0
            else:
                no += k
        out[g] = RankParams(n, ne, no)
    return out


def stage_layer_kinds(model: ModelSpec, partition: StagePartition, pp_rank: int) -> tuple[int, int]:
    """(dense layers, MoE layers) held by pipeline rank ``pp_rank``."""
    layers = partition.layers_of_rank(pp_rank)
    moe = sum(1 for i in layers if model.is_moe_layer(i))
    return len(layers) - moe, moe


def rank_params(model: ModelSpec, layout: Layout, pp_rank: int, tp_rank: int | None = None,
                dp_rank: int | None = None, partition: StagePartition | None = None) -> RankParams:
    """Elements held by rank ``(tp_rank, dp_rank, pp_rank)``; default: the most-loaded rank of the stage."""
    part = partition or model_partition(model, layout.pp, layout.vpp)
    dense, moe = stage_layer_kinds(model, part, pp_rank)
    return params_for_counts(model, layout, dense, moe, first=pp_rank == 0, last=pp_rank == layout.pp - 1,
                             tp_rank=tp_rank, dp_rank=dp_rank)


def params_for_counts(model: ModelSpec, layout: Layout, dense: int, moe: int, *, first: bool, last: bool,
                      tp_rank: int | None = None, dp_rank: int | None = None) -> RankParams:
    """Elements held by a rank of a stage with ``dense`` + ``moe`` layers (first/last stage extras)."""
    tp_rank = layout.tp - 1 if tp_rank is None else tp_rank
    dp_rank = layout.dp - 1 if dp_rank is None else dp_rank
    g = _group_counts(model, layout.tp, layout.dp, layout.ep, layout.zero, tp_rank, dp_rank)
    total = g["dense"].scaled(dense) + g["moe"].scaled(moe)
    if first:
        total = total + g["first"] + g["first+last"]
    if last:
        total = total + g["last"]
        if not first:
            total = total + g["first+last"]
    return total
