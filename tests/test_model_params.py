"""``ModelSpec.total_params()`` counts what the sharding spec allocates: the sum of the sizes of
``sharding_spec(...).tensors``, for every preset and for random specs (MoE with biases and
several shared experts, MLA, tied embeddings, dense layers)."""

from __future__ import annotations

import math
import random

import pytest

from elastic.model import MODEL_PRESETS, Layout, MLASpec, ModelSpec, MoESpec, load_model
from elastic.reshard.spec import sharding_spec

ONE = Layout(tp=1, pp=1, dp=1)


def allocated(model: ModelSpec) -> int:
    return sum(math.prod(t.shape) for t in sharding_spec(model, ONE).tensors)


def inactive_routed(model: ModelSpec) -> int:
    """Routed expert weights a token does not touch: ``experts - top_k`` of every stacked tensor."""
    if model.moe is None:
        return 0
    e, k = model.moe.experts, model.moe.top_k
    return sum(math.prod(t.shape) // e * (e - k) for t in sharding_spec(model, ONE).tensors if t.expert)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_counts_what_the_sharding_spec_allocates(name: str) -> None:
    model = load_model(name)
    assert model.total_params() == allocated(model)
    assert model.active_params() == allocated(model) - inactive_routed(model)


def _moe_model(rng: random.Random) -> ModelSpec:
    heads = rng.choice([1, 2, 4, 6])
    experts = rng.randint(1, 8)
    layers = rng.randint(1, 5)
    mla = None
    if rng.random() < 0.3:
        mla = MLASpec(q_lora_rank=rng.randint(1, 9), kv_lora_rank=rng.randint(1, 5), qk_nope_head_dim=rng.randint(1, 3),
                      qk_rope_head_dim=rng.randint(1, 2), v_head_dim=rng.randint(1, 3))
    return ModelSpec(
        name="moe", layers=layers, hidden=heads * rng.randint(1, 8), ffn_hidden=rng.randint(1, 40), heads=heads,
        kv_heads=rng.choice([d for d in (1, 2, 3, 6) if heads % d == 0]), vocab=rng.randint(1, 50), seq_len=8,
        mlp=rng.choice(["gelu", "swiglu"]), bias=rng.choice([True, True, None]), tie_embeddings=rng.random() < 0.5,
        moe=MoESpec(experts=experts, top_k=rng.randint(1, experts), expert_ffn_hidden=rng.randint(1, 12),
                    shared_experts=rng.randint(2, 4), dense_layers=rng.randint(0, layers)),
        mla=mla,
    )


@pytest.mark.parametrize("seed", range(60))
def test_moe_with_biases_and_several_shared_experts_counts_what_is_allocated(seed: int) -> None:
    model = _moe_model(random.Random(seed))
    assert model.total_params() == allocated(model)
    assert model.active_params() == allocated(model) - inactive_routed(model)


def test_shared_experts_have_one_down_bias_between_them() -> None:
    # 3 shared experts of width 4 run as one MLP of width 12: one down-projection bias of size
    # hidden, where counting them one by one would add 2 * hidden more per MoE layer.
    m = ModelSpec(name="m", layers=2, hidden=6, ffn_hidden=8, heads=2, kv_heads=2, vocab=10, seq_len=8, mlp="swiglu",
                  bias=True, moe=MoESpec(experts=4, top_k=2, expert_ffn_hidden=4, shared_experts=3))
    h, w = 6, 12
    shared = 3 * h * w + 2 * w + h  # gate, up, down weights; gate, up, down biases
    names = {t.name: math.prod(t.shape) for t in sharding_spec(m, ONE).tensors if ".moe.shared." in t.name}
    assert sum(v for k, v in names.items() if k.startswith("layers.0.")) == shared
    assert m.total_params() == allocated(m)
