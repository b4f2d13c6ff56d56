"""The reshard planner: every byte each new member needs arrives exactly once, from a worker
that held it, in as few bytes as the lower bound, within the staging cap.

The checker below rebuilds everything from ``sharding_spec(...).rank_pieces`` (the per-rank
reference), never from the planner's own structures, and counts coverage with numpy.
"""

from __future__ import annotations

import numpy as np
import pytest

from elastic.model import MODEL_PRESETS, Layout, ModelSpec, MoESpec, SpecError
from elastic.reshard.plan import ReshardError, estimate_reshard_bytes, example_plans, plan_reshard
from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS, Box, box_numel, box_shape, sharding_spec
from elastic.reshard.types import ReshardPlan

TINY = MODEL_PRESETS["tiny"]
P = Layout.parse


def _contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def _local(box: Box, origin: Box) -> Box:
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def _sl(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def local_numel(model: ModelSpec, old: Layout, old_ranks: dict[str, int], new: Layout, ranks: dict[str, int],
                kinds: tuple = FP32_KINDS) -> int:
    """Elements new members already hold under the rank map ``ranks`` (brute force)."""
    so, sn = sharding_spec(model, old, kinds), sharding_spec(model, new, kinds)
    total = 0
    for w, r in ranks.items():
        if w not in old_ranks:
            continue
        mine = so.rank_pieces(old_ranks[w])
        for key, nb in sn.rank_pieces(r).items():
            ob = mine.get(key)
            if ob is not None:
                total += box_numel(tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(ob, nb, strict=True)))
    return total


def check_plan(model: ModelSpec, old: Layout, old_ranks: dict[str, int], new: Layout, new_workers: list[str],
               plan: ReshardPlan, kinds: tuple = FP32_KINDS, cap: int | None = None, bpe: int = 4,
               nodes: dict[str, str] | None = None) -> None:
    so, sn = sharding_spec(model, old, kinds), sharding_spec(model, new, kinds)
    # the rank map is a bijection onto the new ranks over exactly the new members
    assert sorted(plan.new_ranks) == sorted(new_workers)
    assert sorted(plan.new_ranks.values()) == list(range(new.world_size))
    old_pieces = {w: so.rank_pieces(r) for w, r in old_ranks.items()}
    new_pieces = {w: sn.rank_pieces(r) for w, r in plan.new_ranks.items()}
    # new_shards: exactly every piece every new member must hold
    shards = {(s.worker, s.tensor, s.kind): s.region for s in plan.new_shards}
    assert len(shards) == len(plan.new_shards)
    assert shards == {(w, n, k): b for w, ps in new_pieces.items() for (n, k), b in ps.items()}
    count = {key: np.zeros(box_shape(b), dtype=np.int32) for key, b in shards.items()}

    def deliver(src: str, dst: str, tensor: str, kind: str, region: Box, src_box: Box, dst_box: Box) -> None:
        held = old_pieces[src].get((tensor, kind))
        assert held is not None and _contains(held, region), f"{src} never held {tensor}/{kind} {region}"
        assert src_box == _local(region, held)
        want = new_pieces[dst][(tensor, kind)]
        assert _contains(want, region)
        assert dst_box == _local(region, want)
        count[(dst, tensor, kind)][_sl(dst_box)] += 1

    for c in plan.local_copies:
        deliver(c.worker, c.worker, c.tensor, c.kind, c.region, c.src_box, c.dst_box)
    planned = 0
    for m in plan.messages:
        assert m.src != m.dst, "self-send"
        assert m.src in old_ranks
        deliver(m.src, m.dst, m.tensor, m.kind, m.region, m.src_box, m.dst_box)
        planned += m.numel * bpe
    for key, c in count.items():
        assert (c == 1).all(), f"{key}: delivered {c.min()}..{c.max()} times"
    # byte accounting
    local = sum(c.numel for c in plan.local_copies)
    needed = sum(box_numel(b) for b in shards.values())
    assert plan.bytes_needed == needed * bpe
    assert plan.bytes_planned == planned == plan.bytes_lower_bound == (needed - local) * bpe
    assert plan.bytes_lower_bound == (needed - local_numel(model, old, old_ranks, new, plan.new_ranks, kinds)) * bpe
    identity = {w: r for r, w in enumerate(new_workers)}
    assert plan.bytes_lower_bound_without_remap == (
        needed - local_numel(model, old, old_ranks, new, identity, kinds)) * bpe
    # the remap is never worse than the identity map (when the identity map is allowed at all)
    if nodes is None or all(len({nodes[w] for w in new_workers[g:g + new.tp]}) == 1
                            for g in range(0, len(new_workers), new.tp)):
        assert plan.bytes_lower_bound <= plan.bytes_lower_bound_without_remap
    assert sum(plan.send_bytes.values()) == sum(plan.recv_bytes.values()) == planned
    assert plan.bytes_total_state == sum(t.numel for t in so.tensors) * len(kinds) * bpe
    # staging cap: per worker, per round, send + receive
    if cap is not None:
        per: dict[tuple[str, int], int] = {}
        for m in plan.messages:
            for w in (m.src, m.dst):
                per[(w, m.round)] = per.get((w, m.round), 0) + m.numel * bpe
        assert max(per.values(), default=0) <= cap
    assert plan.rounds == (max((m.round for m in plan.messages), default=-1) + 1)
    assert list(plan.messages) == sorted(plan.messages, key=lambda m: m.round)
    assert set(plan.leavers) == set(old_ranks) - set(new_workers)
    assert set(plan.joiners) == set(new_workers) - set(old_ranks)


def _plan_and_check(model: ModelSpec, old: str, new: str, n_survivors: int | None = None, **kw) -> ReshardPlan:
    A, B = P(old), P(new)
    ws = [f"w{i}" for i in range(A.world_size)]
    s = min(A.world_size, B.world_size) if n_survivors is None else n_survivors
    new_workers = ws[:s] + [f"w{A.world_size + i}" for i in range(B.world_size - s)]
    old_ranks = {w: i for i, w in enumerate(ws)}
    plan = plan_reshard(model, A, old_ranks, B, new_workers, **kw)
    check_plan(model, A, old_ranks, B, new_workers, plan, kw.get("kinds", FP32_KINDS), kw.get("staging_cap_bytes"))
    return plan


# --------------------------------------------------------------------------------------------
# Table tests
# --------------------------------------------------------------------------------------------

GELU = ModelSpec(name="g", layers=3, hidden=32, ffn_hidden=80, heads=4, kv_heads=4, vocab=50, seq_len=8, mlp="gelu",
                 tie_embeddings=True)
MOE = ModelSpec(name="m", layers=3, hidden=16, ffn_hidden=24, heads=2, kv_heads=2, vocab=30, seq_len=8,
                moe=MoESpec(experts=4, top_k=2, expert_ffn_hidden=8, shared_experts=1, dense_layers=1))


@pytest.mark.parametrize(("model", "old", "new", "survivors"), [
    (TINY, "tp2.pp2.dp1", "tp1.pp2.dp2", None),
    (TINY, "tp1.pp1.dp4", "tp2.pp1.dp1", None),  # 2 leave
    (TINY, "tp2.pp2.dp2.z1", "tp2.pp1.dp3.z1", 5),  # 3 leave, 1 joins
    (TINY, "tp1.pp4.dp1", "tp2.pp1.dp2", 2),
    (GELU, "tp2.pp3.dp1", "tp4.pp1.dp2", None),  # tied embedding on first and last stage
    (GELU, "tp1.pp1.dp2.z1", "tp2.pp3.dp2", None),  # grow 2 -> 12
    (MOE, "tp1.pp1.dp4.ep4.z1", "tp2.pp1.dp2.ep2", None),
    (MOE, "tp2.pp3.dp2.ep2", "tp1.pp1.dp4.ep4.z1", 3),
], ids=lambda x: x.name if isinstance(x, ModelSpec) else str(x))
def test_table_plans_are_complete_and_minimal(model: ModelSpec, old: str, new: str, survivors: int | None) -> None:
    _plan_and_check(model, old, new, survivors)


def test_unchanged_layout_moves_nothing_and_copies_everything_in_place() -> None:
    plan = _plan_and_check(TINY, "tp2.pp2.dp2", "tp2.pp2.dp2")
    assert plan.messages == () and plan.rounds == 0 and plan.bytes_planned == 0
    assert plan.new_ranks == {f"w{i}": i for i in range(8)}  # ties keep workers where they are
    assert all(c.region == c.src_box == c.dst_box or c.src_box == c.dst_box for c in plan.local_copies)


def test_remap_keeps_a_shuffled_worker_list_local() -> None:
    # new_workers in reverse order: the identity map would move almost everything, the remap nothing
    A = P("tp2.pp2.dp1")
    ws = [f"w{i}" for i in range(4)]
    old_ranks = {w: i for i, w in enumerate(ws)}
    plan = plan_reshard(TINY, A, old_ranks, A, ws[::-1])
    check_plan(TINY, A, old_ranks, A, ws[::-1], plan)
    assert plan.bytes_lower_bound == 0 < plan.bytes_lower_bound_without_remap
    assert plan.new_ranks == old_ranks
    fixed = plan_reshard(TINY, A, old_ranks, A, ws[::-1], remap=False)
    assert fixed.new_ranks == {w: r for r, w in enumerate(ws[::-1])}
    assert fixed.bytes_planned == fixed.bytes_lower_bound == plan.bytes_lower_bound_without_remap


def test_remap_keeps_pipeline_stages_of_survivors() -> None:
    # pp4 -> pp2 with only the last 4 workers surviving: survivors hold stages 2-3 (layers 2-3)
    # and should become the new stage 1; joiners take stage 0.
    A, B = P("tp1.pp4.dp2"), P("tp1.pp2.dp2")
    ws = [f"w{i}" for i in range(8)]
    old_ranks = {w: i for i, w in enumerate(ws)}
    new_workers = ["j0", "j1", "w4", "w5"][::-1]
    plan = plan_reshard(TINY, A, old_ranks, B, new_workers)
    check_plan(TINY, A, old_ranks, B, new_workers, plan)
    assert {plan.new_ranks[w] for w in ("w4", "w5")} == {2, 3}  # stage 1 = ranks 2, 3
    assert plan.bytes_lower_bound < plan.bytes_lower_bound_without_remap


def test_balanced_senders_split_big_pieces_across_replicas() -> None:
    # dp4 -> dp8 (4 joiners), fp32 state: every joiner needs a full copy; 4 replicas can send it.
    # Largest-first with splitting: each old worker sends exactly one copy's worth.
    plan = _plan_and_check(TINY, "tp1.pp1.dp4", "tp1.pp1.dp8", split_min_bytes=1024)
    copy = plan.bytes_needed // 8
    assert plan.max_send_bytes <= copy * 1.02
    assert plan.max_recv_bytes == copy


def test_leavers_send_only_when_that_lowers_the_makespan() -> None:
    # 2 survivors + 2 leavers hold the full state (dp4); 2 joiners need it (dp4 again).
    # Survivors are busy with nothing else, but using leavers halves the makespan, so they send.
    plan = _plan_and_check(TINY, "tp1.pp1.dp4", "tp1.pp1.dp4", 2, split_min_bytes=1024)
    assert plan.send_bytes["w2"] > 0 and plan.send_bytes["w3"] > 0
    # With one joiner and small pieces (no splitting), whole pieces spread over survivors first.
    A = P("tp1.pp1.dp4")
    old_ranks = {f"w{i}": i for i in range(4)}
    p2 = plan_reshard(TINY, A, old_ranks, P("tp1.pp1.dp3"), ["w0", "w1", "j0"], split_min_bytes=1 << 30)
    check_plan(TINY, A, old_ranks, P("tp1.pp1.dp3"), ["w0", "w1", "j0"], p2)
    assert p2.max_send_bytes < p2.bytes_lower_bound  # spread, not one sender


@pytest.mark.parametrize("cap", [4096, 20000, 1 << 20])
def test_staging_cap_bounds_each_round(cap: int) -> None:
    plan = _plan_and_check(TINY, "tp2.pp2.dp1", "tp1.pp1.dp4", staging_cap_bytes=cap)
    worst = max(max(plan.send_bytes.values()), max(plan.recv_bytes.values()))
    assert plan.rounds >= -(-worst // cap)  # at least the volume lower bound


def test_mixed_kinds_and_bf16_elements() -> None:
    _plan_and_check(TINY, "tp2.pp1.dp2.z1", "tp1.pp2.dp2", kinds=MIXED_KINDS)
    A, B = P("tp2.pp1.dp1"), P("tp1.pp1.dp2")
    old_ranks = {"a": 0, "b": 1}
    plan = plan_reshard(TINY, A, old_ranks, B, ["a", "b"], bytes_per_element=2)
    check_plan(TINY, A, old_ranks, B, ["a", "b"], plan, bpe=2)


def test_nodes_keep_tp_groups_inside_a_node() -> None:
    # 8 old workers on 2 nodes (4 each), tp1 -> tp2; joiners on a third node.
    A, B = P("tp1.pp1.dp8"), P("tp2.pp1.dp6")
    ws = [f"w{i}" for i in range(8)]
    old_ranks = {w: i for i, w in enumerate(ws)}
    new_workers = ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w0"] + ["j0", "j1", "j2", "j3"]
    nodes = {w: f"n{i // 4}" for i, w in enumerate(ws)} | {f"j{i}": "n2" for i in range(4)}
    plan = plan_reshard(TINY, A, old_ranks, B, new_workers, nodes=nodes)
    check_plan(TINY, A, old_ranks, B, new_workers, plan, nodes=nodes)
    for g in range(B.world_size // B.tp):
        members = [w for w, r in plan.new_ranks.items() if r // B.tp == g]
        assert len({nodes[w] for w in members}) == 1, members


def test_example_plans_are_valid() -> None:
    plans = example_plans()
    assert len(plans) == 3
    for p in plans.values():
        assert p.bytes_planned == p.bytes_lower_bound
    assert plans["tp1.pp1.dp4->tp2.pp1.dp1"].leavers == ("w2", "w3")
    assert plans["tp2.pp2.dp2.z1->tp2.pp1.dp3.z1"].joiners == ("w8",)
    # plans travel to worker processes: they pickle to plain tuples with the same items
    import pickle

    p = plans["tp2.pp2.dp2.z1->tp2.pp1.dp3.z1"]
    q = pickle.loads(pickle.dumps(p))
    assert isinstance(q.messages, tuple) and q.messages == p.messages and q.new_shards == p.new_shards


def test_estimate_matches_the_planned_lower_bound() -> None:
    for old, new in [("tp2.pp2.dp1", "tp1.pp2.dp2"), ("tp1.pp4.dp2", "tp2.pp2.dp1"), ("tp2.pp1.dp2.z1", "tp1.pp2.dp4")]:
        plan = _plan_and_check(TINY, old, new)
        assert estimate_reshard_bytes(TINY, P(old), P(new)) == plan.bytes_lower_bound


# --------------------------------------------------------------------------------------------
# Errors: raised before any byte moves, naming the field and the fix
# --------------------------------------------------------------------------------------------

_W4 = {f"w{i}": i for i in range(4)}


@pytest.mark.parametrize(("old", "old_ranks", "new", "new_workers", "kw", "match"), [
    ("tp2.pp2.dp1", _W4, "tp3.pp1.dp1", ["w0", "w1", "w2"], {}, "tp=3 does not divide heads=4"),
    ("tp2.pp2.dp1", _W4, "tp1.pp1.dp2", ["w0"], {}, "needs world size 1\\*1\\*2=2"),
    ("tp2.pp2.dp1", _W4, "tp1.pp1.dp2", ["w0", "w0"], {}, "w0 more than once"),
    ("tp2.pp2.dp1", {"w0": 0, "w1": 0}, "tp1.pp1.dp2", ["w0", "w1"], {}, "gives rank 0 to both"),
    ("tp2.pp2.dp1", {"w0": 9}, "tp1.pp1.dp2", ["w0", "w1"], {}, "outside old layout"),
    # both workers of stage 1 are gone: the layers on it exist nowhere
    ("tp2.pp2.dp1", {"w0": 0, "w1": 1}, "tp1.pp1.dp2", ["w0", "w1"], {}, "holds layers.2.* every replica of it under tp2.pp2.dp1 \\(pipeline stage 1\\) is gone"),
    ("tp2.pp2.dp1", _W4, "tp1.pp1.dp2", ["w0", "w1"], {"staging_cap_bytes": 64},
     "raise the staging cap to at least \\d+ bytes"),
    ("tp2.pp2.dp1", _W4, "tp1.pp1.dp2", ["w0", "w1"], {"staging_cap_bytes": 0}, "must be positive"),
    ("tp2.pp2.dp1", _W4, "tp2.pp1.dp1", ["w0", "w1"], {"nodes": {"w0": "a"}}, "no entry for new worker"),
    ("tp2.pp2.dp1", _W4, "tp2.pp1.dp1", ["w0", "w1"], {"nodes": {"w0": "a", "w1": "b"}}, "node a has 1 workers"),
    ("tp2.pp2.dp1", _W4, "tp2.pp1.dp1", ["w0", "w1"], {"nodes": {"w0": "a", "w1": "b"}, "remap": False},
     "TP group 0 .* spans nodes a, b"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_impossible_plans_raise_reshard_error(old, old_ranks, new, new_workers, kw, match) -> None:
    with pytest.raises(ReshardError, match=match) as e:
        plan_reshard(TINY, P(old), old_ranks, P(new), new_workers, **kw)
    assert isinstance(e.value, SpecError)


def test_cap_error_names_the_tensor_and_the_minimum() -> None:
    with pytest.raises(ReshardError) as e:
        plan_reshard(TINY, P("tp2.pp2.dp1"), _W4, P("tp1.pp1.dp2"), ["w0", "w1"], staging_cap_bytes=64)
    msg = str(e.value)
    assert "one row of" in msg and "(" in msg
    minimum = int(msg.rsplit("at least ", 1)[1].split()[0])
    _plan_and_check(TINY, "tp2.pp2.dp1", "tp1.pp1.dp2", staging_cap_bytes=minimum)  # the minimum is enough
