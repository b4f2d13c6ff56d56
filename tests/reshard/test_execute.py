"""Reshard executor: real multi-process gloo reshards are bitwise exact; bad input fails before any byte moves.

Multi-process cases run on one pool of spawned processes (see ``_mp.py``); each worker
rebuilds the global reference from a seed, slices its old state, runs prepare + execute
with verification on, and compares its new tensors bit for bit with the slices of the
reference under the new layout and the planner's rank map.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch

from elastic.model import MODEL_PRESETS, Layout, ModelSpec
from elastic.reshard import execute as ex
from elastic.reshard.plan import ReshardError, plan_reshard
from elastic.reshard.spec import FP32_KINDS, Kind
from elastic.reshard.types import Message
from tests.reshard._mp import Pool, free_port, local_state, naive_plan, reshard_job

TINY = MODEL_PRESETS["tiny"]  # heads 4, kv_heads 2: tp <= 2
GELU = ModelSpec(name="gelu3", layers=3, hidden=32, ffn_hidden=80, heads=4, kv_heads=4, vocab=50, seq_len=8,
                 mlp="gelu", tie_embeddings=True)  # biases, LayerNorm bias, a tied embedding on two stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(9)
    yield p
    p.close()


def workers(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def plan_for(model: ModelSpec, old: str, n_old: int, new: str, survivors: int, joiners: int = 0,
             kinds: tuple[Kind, ...] = FP32_KINDS):
    old_ranks = {w: i for i, w in enumerate(workers(n_old))}
    new_workers = workers(n_old)[:survivors] + workers(joiners, "j")
    return plan_reshard(model, Layout.parse(old), old_ranks, Layout.parse(new), new_workers, kinds=kinds)


# --------------------------------------------------------------------------------------------
# Multi-process: bitwise equality after real reshards
# --------------------------------------------------------------------------------------------

CASES = [
    # (id, model, old layout, old workers, new layout, survivors, joiners, group mode)
    ("tp-to-dp", TINY, "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4, 0, "default"),
    # every replica holds everything: survivors only slice locally, leavers send nothing
    ("dp4-to-tp2-two-leave", TINY, "tp1.pp1.dp4", 4, "tp2.pp1.dp1", 2, 0, "default"),
    # the same with ZeRO-1: the leavers hold half the optimizer state and must ship it
    ("dp4z1-to-tp2-two-leave", TINY, "tp1.pp1.dp4.z1", 4, "tp2.pp1.dp1", 2, 0, "default"),
    ("zero-pp-dp-with-joiner", TINY, "tp2.pp2.dp2.z1", 8, "tp2.pp1.dp3.z1", 5, 1, "transient"),
    ("all-axes-gelu-tied", GELU, "tp1.pp3.dp2.z1", 6, "tp2.pp1.dp2", 4, 0, "default"),
    ("zero-on-to-off", GELU, "tp2.pp1.dp2.z1", 4, "tp1.pp1.dp3", 2, 1, "transient"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reshard_is_bitwise_exact(pool: Pool, case: tuple) -> None:
    _id, model, old, n_old, new, survivors, joiners, group = case
    plan = plan_for(model, old, n_old, new, survivors, joiners)
    assert bool(plan.messages) == (_id != "dp4-to-tp2-two-leave"), "case lost its point"
    results = pool.run(reshard_job, len(plan.members), model, plan, free_port(), 11, group, timeout=90)
    for r in results:
        assert r["error"] is None, r
        assert r["diff"] == [], f"{r['me']}: {r['diff'][:3]}"
        assert r["old_left"] == 0, f"{r['me']} still holds its old state dict"
        if r["me"] in plan.leavers:
            assert r["new_tensors"] == 0
            assert r["leftover_same"], f"{r['me']}: leftover is not exactly its old tensors"
        else:
            assert r["leftover"] == 0, f"{r['me']} is no leaver and must keep nothing aside"
    # every byte the plan sends is received once, and the stats say so
    assert sum(r["bytes_sent"] for r in results) == plan.bytes_planned
    assert sum(r["bytes_received"] for r in results) == plan.bytes_planned


@pytest.mark.parametrize(
    "old,n_old,new,survivors,joiners",
    [("tp1.pp2.dp1", 2, "tp1.pp2.dp2", 2, 2),  # grow: survivors keep everything in place
     ("tp1.pp1.dp4", 4, "tp1.pp1.dp2", 2, 0),  # shrink: nothing moves at all
     ("tp2.pp2.dp2.z1", 8, "tp2.pp2.dp2.z1", 8, 0)],  # no-op
    ids=["grow", "shrink", "same"],
)
def test_unchanged_regions_are_kept_as_the_same_objects(pool: Pool, old, n_old, new, survivors, joiners) -> None:
    plan = plan_for(TINY, old, n_old, new, survivors, joiners)
    results = pool.run(reshard_job, len(plan.members), TINY, plan, free_port(), 12, "default", timeout=90)
    for r in results:
        assert r["error"] is None and r["diff"] == [], r
        if r["me"] in plan.joiners or r["me"] in plan.leavers:
            continue
        # a survivor whose pieces did not change holds the very same tensor objects: zero copy
        assert r["kept_objects"] == r["new_tensors"] > 0, r
        assert r["bytes_local"] == 0 and r["bytes_received"] == 0, r
    if not joiners:
        assert not plan.messages and all(r["wire_ops"] == 0 for r in results)


@pytest.mark.parametrize("pack_below,expect", [(0, "direct"), (1 << 40, "packed")])
def test_rounds_and_wire_grouping_on_a_hand_shaped_plan(pool: Pool, pack_below: int, expect: str) -> None:
    # The naive builder forces three rounds and first-holder senders (a different message
    # pattern from the planner's); both wire modes must give the same bits.
    old_ranks = {w: i for i, w in enumerate(workers(4))}
    plan = naive_plan(GELU, "tp2.pp2.dp1", old_ranks, "tp1.pp1.dp2", ["w2", "w0"], FP32_KINDS, rounds=3)
    results = pool.run(reshard_job, 4, GELU, plan, free_port(), 13, "default", False, pack_below, timeout=90)
    for r in results:
        assert r["error"] is None and r["diff"] == [], r
        assert r["rounds"] == 3
    ops = sum(r["wire_ops"] for r in results)
    if expect == "packed":  # one wire per (round, ordered pair), counted at both ends
        pairs = {(m.round, m.src, m.dst) for m in plan.messages}
        assert ops == 2 * len(pairs)
    else:
        assert ops == 2 * len(plan.messages)


def test_recycles_memory_of_dropped_shards(pool: Pool) -> None:
    # tp2.pp1.dp2 -> tp1.pp2.dp2: every worker keeps half its layers and drops the other half;
    # with first-holder senders the second replica's dropped half is never read, so the
    # tensors it receives can live in that (already touched) memory.
    old_ranks = {w: i for i, w in enumerate(workers(4))}
    plan = naive_plan(TINY, "tp2.pp1.dp2", old_ranks, "tp1.pp2.dp2", workers(4), FP32_KINDS)
    results = pool.run(reshard_job, 4, TINY, plan, free_port(), 14, "default", timeout=90)
    assert all(r["error"] is None and r["diff"] == [] for r in results), results
    assert sum(r["recycled"] for r in results) > 0, results


def test_corruption_is_detected_on_every_member(pool: Pool) -> None:
    plan = plan_for(TINY, "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    results = pool.run(reshard_job, 4, TINY, plan, free_port(), 15, "default", True, timeout=90)
    for r in results:
        assert r["error"] is not None and "verification failed" in r["error"], r
    named = " ".join(r["error"] for r in results)
    assert "from 'w" in named and "to 'w" in named  # the tensor and the two peers are named


# --------------------------------------------------------------------------------------------
# In process: errors before any byte moves leave the old state intact
# --------------------------------------------------------------------------------------------


def _crcs(state: dict) -> dict:
    return {k: (id(t), tuple(t.shape), zlib.crc32(t.numpy().tobytes())) for k, t in state.items()}


def _sender_state(plan) -> tuple[str, dict]:
    me = plan.messages[0].src
    return me, local_state(TINY, Layout.parse(plan.old_layout), plan.old_ranks[me], FP32_KINDS, 3)


def _drop_source(plan, state: dict) -> None:
    m = plan.messages[0]
    del state[(m.tensor, m.kind)]


def _reshape_source(plan, state: dict) -> None:
    m = plan.messages[0]
    t = state[(m.tensor, m.kind)]
    state[(m.tensor, m.kind)] = torch.zeros(t.numel() // t.shape[0] * max(1, t.shape[0] // 2), dtype=t.dtype)


def _retype_source(plan, state: dict) -> None:
    m = plan.messages[0]
    state[(m.tensor, m.kind)] = state[(m.tensor, m.kind)].double()


@pytest.mark.parametrize(
    "damage,needle",
    [(_drop_source, "has no such tensor"), (_reshape_source, "needs box"), (_retype_source, "torch.float64")],
    ids=["missing-tensor", "wrong-shape", "wrong-dtype"],
)
def test_state_that_does_not_match_the_plan_fails_in_prepare(damage, needle: str) -> None:
    plan = plan_for(TINY, "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    me, state = _sender_state(plan)
    damage(plan, state)
    before = _crcs(state)
    with pytest.raises(ReshardError, match=needle):
        ex.prepare(plan, me, state)
    assert _crcs(state) == before  # same objects, same bits


def test_prepare_rejects_a_stranger_and_never_touches_values() -> None:
    plan = plan_for(TINY, "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    with pytest.raises(ReshardError, match="not a member"):
        ex.prepare(plan, "w9", {})
    me, state = _sender_state(plan)
    before = _crcs(state)
    prepared = ex.prepare(plan, me, state)
    assert _crcs(state) == before
    assert prepared.stats.bytes_allocated > 0 and prepared.stats.prepare_seconds > 0
    # fresh tensors are pre-touched (zero-filled), never aliases of old ones
    old_ptrs = {t.data_ptr() for t in state.values()}
    assert all(t.data_ptr() not in old_ptrs and not t.any() for t in prepared.fresh.values())


def test_prepare_over_its_allocation_budget_allocates_nothing_and_says_what_it_needs() -> None:
    # preparing beside a running step on a GPU: buffers that would not fit next to the step are
    # refused before any allocation, so the caller prepares after the step instead
    plan = plan_for(TINY, "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    me, state = _sender_state(plan)
    full = ex.prepare(plan, me, dict(state))
    need = full.stats.bytes_allocated
    assert need > 0
    with pytest.raises(ex.AllocBudgetExceeded, match=r"need .* MiB, over the .* MiB allowed") as e:
        ex.prepare(plan, me, dict(state), max_alloc_bytes=need - 1)
    assert (e.value.need, e.value.budget) == (need, need - 1)
    exact = ex.prepare(plan, me, dict(state), max_alloc_bytes=need)  # what it allocates is what it counted
    assert exact.stats.bytes_allocated == need


def test_execute_checks_group_ranks_and_runs_once() -> None:
    plan = plan_for(TINY, "tp1.pp1.dp1", 1, "tp1.pp1.dp1", 1)  # a one-worker no-op
    state = local_state(TINY, Layout.parse("tp1.pp1.dp1"), 0, FP32_KINDS, 4)
    ids = {k: id(t) for k, t in state.items()}
    prepared = ex.prepare(plan, "w0", state)
    with pytest.raises(ReshardError, match="group_rank lacks members"):
        ex.execute(prepared, None, {})
    pg, ranks = ex.reshard_group(["w0"], "w0", "127.0.0.1", free_port(), generation=1, timeout_s=10)
    new = ex.execute(prepared, pg, ranks, verify=True)
    assert {k: id(t) for k, t in new.items()} == ids  # everything kept in place
    assert state == {}  # the old dict was emptied
    with pytest.raises(ReshardError, match="already executed"):
        ex.execute(prepared, pg, ranks)


@pytest.mark.parametrize(
    "shape,box,contiguous",
    [((64, 32), ((8, 16), (0, 32)), True),  # leading rows
     ((64, 32), ((0, 64), (8, 16)), False),  # a column slab
     ((4, 8, 16), ((2, 3), (3, 5), (0, 16)), True),  # one index, then rows
     ((4, 8, 16), ((2, 3), (3, 5), (0, 8)), False),
     ((4, 8, 16), ((1, 3), (0, 8), (0, 16)), True),
     ((10,), ((3, 7),), True),
     ((4, 1, 16), ((0, 2), (0, 1), (0, 16)), True)],
)
def test_contiguity_of_boxes(shape, box, contiguous: bool) -> None:
    assert ex._contiguous(shape, box) is contiguous
    t = torch.empty(shape)
    assert ex._view(t, box).is_contiguous() is contiguous


def test_small_messages_share_one_wire_big_ones_travel_alone() -> None:
    def msg(numel: int, i: int) -> Message:
        return Message("a", "b", f"t{i}", "param", ((0, numel),), ((0, numel),), ((0, numel),))

    group = [msg(10, 0), msg(1000, 1), msg(20, 2), msg(5000, 3)]
    wires = ex._split_wire(group, pack_below=100)
    assert [[m.tensor for m in w] for w in wires] == [["t0", "t2"], ["t1"], ["t3"]]
    assert ex._split_wire([msg(1000, 1)], 100) == [[group[1]]]
