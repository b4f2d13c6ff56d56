"""Property tests of the reshard planner over random model shapes, layout pairs, survivor
subsets and joiners (the checker lives in test_plan.py and rebuilds everything from the
per-rank sharding spec)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.model import MODEL_PRESETS, Layout, ModelSpec, MoESpec
from elastic.reshard.plan import ReshardError, plan_reshard
from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS

try:  # tests/reshard as a package or as a plain directory on sys.path
    from .test_plan import check_plan
except ImportError:
    from test_plan import check_plan  # type: ignore[no-redef]

TINY = MODEL_PRESETS["tiny"]


# --------------------------------------------------------------------------------------------
# Property tests over random models and layout pairs
# --------------------------------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 6]))
    kv = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6) if heads % d == 0]))
    head_dim = draw(st.sampled_from([1, 2, 3]))
    moe = None
    if draw(st.booleans()) and draw(st.booleans()):
        moe = MoESpec(experts=draw(st.sampled_from([2, 4, 6])), top_k=1, expert_ffn_hidden=draw(st.integers(1, 5)),
                      shared_experts=draw(st.integers(0, 1)), dense_layers=draw(st.integers(0, 1)))
    return ModelSpec(
        name="h", layers=draw(st.integers(1, 5)), hidden=heads * head_dim, ffn_hidden=draw(st.integers(1, 9)),
        heads=heads, kv_heads=kv, vocab=draw(st.integers(1, 13)), seq_len=4, mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        tie_embeddings=draw(st.booleans()), moe=moe,
    )


@st.composite
def layouts(draw: st.DrawFn, model: ModelSpec) -> Layout:
    tp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if model.heads % d == 0 and model.kv_heads % d == 0]))
    pp = draw(st.integers(1, min(3, model.layers)))
    dp = draw(st.integers(1, 4))
    ep = 1
    if model.moe:
        ep = draw(st.sampled_from([e for e in (1, 2, 3, 4) if dp % e == 0 and model.moe.experts % e == 0]))
    return Layout(tp=tp, pp=pp, dp=dp, ep=ep, zero=draw(st.integers(0, 1)))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    model = draw(models())
    A, B = draw(layouts(model)), draw(layouts(model))
    old_ws = [f"o{i}" for i in range(A.world_size)]
    n_surv = draw(st.integers(0, min(A.world_size, B.world_size)))
    survivors = draw(st.permutations(old_ws))[:n_surv]
    new_workers = survivors + [f"j{i}" for i in range(B.world_size - n_surv)]
    new_workers = draw(st.permutations(new_workers))
    kinds = draw(st.sampled_from([FP32_KINDS, MIXED_KINDS, ("param",)]))
    cap = draw(st.sampled_from([None, None, 64, 1000]))
    split = draw(st.sampled_from([1, 64, 1 << 20]))
    return model, A, {w: i for i, w in enumerate(old_ws)}, B, list(new_workers), kinds, cap, split


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_every_needed_element_arrives_exactly_once(sc: tuple) -> None:
    model, A, old_ranks, B, new_workers, kinds, cap, split = sc
    try:
        plan = plan_reshard(model, A, old_ranks, B, new_workers, kinds=kinds, staging_cap_bytes=cap,
                            split_min_bytes=split)
    except ReshardError as e:
        # the only legitimate failure here: a cap below one row
        assert cap is not None and "staging cap" in str(e)
        return
    check_plan(model, A, old_ranks, B, new_workers, plan, kinds, cap)


@settings(max_examples=25, deadline=None)
@given(st.randoms(use_true_random=False))
def test_property_nodes_constraint_holds(rnd: random.Random) -> None:
    A = Layout(tp=rnd.choice([1, 2]), pp=rnd.choice([1, 2]), dp=rnd.choice([1, 2, 4]))
    B = Layout(tp=rnd.choice([1, 2]), pp=rnd.choice([1, 2]), dp=rnd.choice([1, 2, 3, 4]))
    per_node = 4
    old_ws = [f"o{i}" for i in range(A.world_size)]
    old_ranks = {w: i for i, w in enumerate(old_ws)}
    n_surv = min(A.world_size, B.world_size)
    n_surv -= n_surv % B.tp
    nodes = {w: f"n{i // per_node}" for i, w in enumerate(old_ws)}
    # survivors: whole TP-sized chunks of nodes so every node count stays a multiple of tp
    survivors = old_ws[:n_surv] if n_surv % per_node == 0 or per_node % B.tp == 0 else []
    joiners = [f"j{i}" for i in range(B.world_size - len(survivors))]
    nodes |= {j: f"m{i // B.tp}" for i, j in enumerate(joiners)}
    new_workers = survivors + joiners
    rnd.shuffle(new_workers)
    plan = plan_reshard(TINY, A, old_ranks, B, new_workers, nodes=nodes)
    check_plan(TINY, A, old_ranks, B, new_workers, plan, nodes=nodes)
    for g in range(B.world_size // B.tp):
        assert len({nodes[w] for w, r in plan.new_ranks.items() if r // B.tp == g}) == 1
