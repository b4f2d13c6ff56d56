"""Reshard executor in mixed precision: bf16 ``param`` and fp32 ``master``/moments move bitwise.

Multi-process cases (gloo, CPU) rebuild a ``MIXED_KINDS`` state with one dtype per kind,
reshard it (old members let ``prepare`` infer their dtypes, joiners are told them) and
compare every new tensor bit for bit, dtype included, with the reference. In-process
cases cover dtype resolution errors (raised before any byte moves) and the byte layout
of packed wires and recycled memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from elastic.model import MODEL_PRESETS, Layout
from elastic.reshard import execute as ex
from elastic.reshard.plan import ReshardError, plan_reshard
from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS
from elastic.reshard.types import Message
from tests.reshard._mp import Pool, free_port, local_state, mixed_local_state, mixed_reshard_job, naive_plan

TINY = MODEL_PRESETS["tiny"]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = {"param": BF16, "master": FP32, "exp_avg": FP32, "exp_avg_sq": FP32}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(5)
    yield p
    p.close()


def workers(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def mixed_plan(old: str, n_old: int, new: str, survivors: int, joiners: int = 0):
    old_ranks = {w: i for i, w in enumerate(workers(n_old))}
    new_workers = workers(n_old)[:survivors] + workers(joiners, "j")
    return plan_reshard(TINY, Layout.parse(old), old_ranks, Layout.parse(new), new_workers, kinds=MIXED_KINDS)


# --------------------------------------------------------------------------------------------
# Multi-process: bitwise equality, every dtype preserved
# --------------------------------------------------------------------------------------------

CASES = [
    # (id, old layout, old workers, new layout, survivors, joiners, pack_below_bytes)
    ("tp-to-dp", "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4, 0, None),  # packed wires mix bf16 and fp32
    ("tp-to-dp-one-wire-each", "tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4, 0, 0),  # direct typed views
    # ZeRO-1 grow: one old worker leaves with its half of the fp32 optimizer state, three join
    ("zero-grow-with-joiners", "tp1.pp1.dp2.z1", 2, "tp2.pp1.dp2.z1", 1, 3, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mixed_reshard_is_bitwise_exact_and_keeps_dtypes(pool: Pool, case: tuple) -> None:
    _id, old, n_old, new, survivors, joiners, pack_below = case
    plan = mixed_plan(old, n_old, new, survivors, joiners)
    kinds_moved = {m.kind for m in plan.messages}
    assert {"param", "master"} <= kinds_moved, f"case lost its point: moves only {kinds_moved}"
    results = pool.run(mixed_reshard_job, len(plan.members), TINY, plan, free_port(), 21, DTYPES, None, None,
                       pack_below, timeout=90)
    want_dtypes = sorted((k, str(d)) for k, d in DTYPES.items())
    for r in results:
        assert r["error"] is None, r
        assert r["diff"] == [], f"{r['me']}: {r['diff'][:3]}"
        assert r["old_left"] == 0
        assert r["prepared_dtypes"] == {k: str(d) for k, d in DTYPES.items()}, r  # inferred or given
        if r["me"] in plan.new_ranks:
            assert r["new_dtypes"] == want_dtypes, r
        else:
            assert r["new_tensors"] == 0
    # real bytes: bf16 params at 2 bytes each, not the plan's single bytes_per_element
    real = ex.wire_bytes(plan, DTYPES)
    assert sum(r["bytes_sent"] for r in results) == sum(r["bytes_received"] for r in results) == real
    param_elems = sum(m.numel for m in plan.messages if m.kind == "param")
    assert real == plan.bytes_planned - param_elems * (plan.bytes_per_element - 2)
    if pack_below == 0:
        assert sum(r["wire_ops"] for r in results) == 2 * len(plan.messages)


def test_mixed_state_recycles_dropped_memory_across_dtypes(pool: Pool) -> None:
    # tp2.pp1.dp2 -> tp1.pp2.dp2 with first-holder senders: the second replica drops half
    # its layers unread, so received tensors (bf16 and fp32) land in that memory, by bytes.
    old_ranks = {w: i for i, w in enumerate(workers(4))}
    plan = naive_plan(TINY, "tp2.pp1.dp2", old_ranks, "tp1.pp2.dp2", workers(4), MIXED_KINDS)
    results = pool.run(mixed_reshard_job, 4, TINY, plan, free_port(), 22, DTYPES, timeout=90)
    assert all(r["error"] is None and r["diff"] == [] for r in results), results
    assert sum(r["recycled"] for r in results) > 0, results


def test_corrupt_bf16_piece_is_detected_and_named(pool: Pool) -> None:
    plan = mixed_plan("tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    # one wire per message, so every bf16 buffer on the wire is a bf16 tensor the hook can hit
    results = pool.run(mixed_reshard_job, 4, TINY, plan, free_port(), 23, DTYPES, None, BF16, 0, timeout=90)
    for r in results:
        assert r["error"] is not None and "verification failed" in r["error"], r
    named = " ".join(r["error"] for r in results)
    assert "[param]" in named and "from 'w" in named
    for fp32_kind in ("[master]", "[exp_avg]", "[exp_avg_sq]"):  # only the bf16 pieces were hit
        assert fp32_kind not in named, named


def test_members_disagreeing_on_a_dtype_fail_verification(pool: Pool) -> None:
    # fp16 and bf16 have the same size: the bytes fit, only the dtype code in the checksum tells
    plan = mixed_plan("tp1.pp1.dp2.z1", 2, "tp2.pp1.dp2.z1", 1, 3)
    wrong = {**DTYPES, "param": FP16}
    results = pool.run(mixed_reshard_job, len(plan.members), TINY, plan, free_port(), 24, DTYPES, wrong,
                       timeout=90)
    assert all(r["error"] is not None for r in results), results
    assert "another dtype" in " ".join(r["error"] for r in results)


# --------------------------------------------------------------------------------------------
# In process: dtype resolution, before any byte moves
# --------------------------------------------------------------------------------------------


def _survivor(plan) -> tuple[str, dict]:
    me = plan.messages[0].src
    return me, mixed_local_state(TINY, Layout.parse(plan.old_layout), plan.old_ranks[me], MIXED_KINDS, 3, DTYPES)


def test_survivor_infers_dtypes_per_kind_and_allocates_them() -> None:
    plan = mixed_plan("tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    me, state = _survivor(plan)
    prepared = ex.prepare(plan, me, state)
    assert prepared.dtypes == DTYPES and prepared.dtype is None
    assert prepared.fresh and all(t.dtype == DTYPES[k[1]] for k, t in prepared.fresh.items())
    # small messages of both dtypes share one packed wire per (round, peer): bytes on the wire
    wires = [w for r in prepared.rounds for w in (*r.sends, *r.recvs)]
    assert any(w.dtype == torch.uint8 and {m.kind for m in w.msgs} >= {"param", "master"} for w in wires)
    assert prepared.staging is not None and prepared.staging.dtype == torch.uint8


@pytest.mark.parametrize(
    "kwargs,needle",
    [({}, r"no \[param\] tensor"),  # a mixed joiner must be told
     ({"dtypes": {"param": BF16}}, r"no \[master\] tensor"),  # the first kind still missing is named
     ({"dtypes": {**DTYPES, "moment": FP32}}, r"kinds \['moment'\]"),  # a typo is not ignored
     ({"dtypes": {**DTYPES, "param": "bf16"}}, "not a torch.dtype")],
    ids=["nothing", "partial", "unknown-kind", "not-a-dtype"],
)
def test_mixed_joiner_without_dtypes_fails_naming_the_kind(kwargs: dict, needle: str) -> None:
    plan = mixed_plan("tp1.pp1.dp2.z1", 2, "tp2.pp1.dp2.z1", 1, 3)
    with pytest.raises(ReshardError, match=needle):
        ex.prepare(plan, "j0", {}, **kwargs)


def test_joiner_dtype_rules() -> None:
    mixed = mixed_plan("tp1.pp1.dp2.z1", 2, "tp2.pp1.dp2.z1", 1, 3)
    assert ex.prepare(mixed, "j0", {}, dtypes=DTYPES).dtypes == DTYPES
    # dtypes wins per kind, dtype fills the rest
    assert ex.prepare(mixed, "j0", {}, dtype=FP32, dtypes={"param": BF16}).dtypes == DTYPES
    # an all-fp32 plan needs nothing: the contract's CPU state is fp32 (as before dtypes existed)
    fp32 = plan_reshard(TINY, Layout.parse("tp1.pp1.dp2"), {"w0": 0, "w1": 1}, Layout.parse("tp1.pp1.dp3"),
                        ["w0", "w1", "j0"], kinds=FP32_KINDS)
    assert set(ex.prepare(fp32, "j0", {}).dtypes.values()) == {FP32}
    assert ex.prepare(fp32, "j0", {}, dtype=torch.float64).dtype == torch.float64


def test_state_in_the_wrong_dtype_for_its_kind_fails_naming_both() -> None:
    plan = mixed_plan("tp2.pp2.dp1", 4, "tp1.pp2.dp2", 4)
    me, state = _survivor(plan)
    with pytest.raises(ReshardError, match=r"\[param\] is torch.bfloat16 .* moves param as torch.float32"):
        ex.prepare(plan, me, state, dtype=FP32)  # one dtype for a mixed state
    key = next(k for k in state if k[1] == "master")
    state[key] = state[key].to(BF16)
    with pytest.raises(ReshardError, match=r"\[master\] tensors mix dtypes"):
        ex.prepare(plan, me, state)
    # the fp32 single-dtype path is unchanged for an fp32 state
    fp32_plan = plan_reshard(TINY, Layout.parse("tp2.pp2.dp1"), {w: i for i, w in enumerate(workers(4))},
                             Layout.parse("tp1.pp2.dp2"), workers(4))
    fp32_state = local_state(TINY, Layout.parse("tp2.pp2.dp1"), 0, FP32_KINDS, 3)
    assert ex.prepare(fp32_plan, "w0", fp32_state).dtype == FP32


# --------------------------------------------------------------------------------------------
# Byte layout
# --------------------------------------------------------------------------------------------


def _msg(numel: int, kind: str, i: int) -> Message:
    return Message("a", "b", f"t{i}", kind, ((0, numel),), ((0, numel),), ((0, numel),))


def test_packed_wire_puts_larger_elements_first_so_no_offset_is_misaligned() -> None:
    part = [_msg(5, "param", 0), _msg(3, "master", 1), _msg(7, "param", 2), _msg(1, "exp_avg", 3)]
    ordered, offsets, total = ex._layout(part, DTYPES)
    # fp32 (plan order) then bf16 (plan order): 3*4=12, +1*4=16, then 5*2=10 -> 26, +7*2 = 40 bytes, no padding
    assert [m.tensor for m in ordered] == ["t1", "t3", "t0", "t2"]
    assert offsets == (0, 12, 16, 26) and total == 40
    # an odd mix still aligns every message to its own element size
    _, offsets, total = ex._layout([_msg(3, "param", 0), _msg(1, "master", 1)], {"param": torch.uint8,
                                                                                  "master": FP32})
    assert offsets == (0, 4) and total == 7


def test_new_bf16_and_fp32_tensors_fit_into_dropped_fp32_memory_by_bytes() -> None:
    donor = torch.zeros(10, dtype=FP32)[1:]  # 36 bytes at byte address 4 of its storage
    new_shapes = {("a", "param"): (5,), ("b", "master"): (4,), ("c", "param"): (3,)}
    placed = ex._place_in_donors(list(new_shapes), new_shapes, [("d", "exp_avg")], {("d", "exp_avg"): donor},
                                 DTYPES)
    # largest first: b (16 bytes) at 0, a (10 bytes) at 16, c (6 bytes) at 26; 32 of 36 bytes used
    assert placed == {("b", "master"): (("d", "exp_avg"), 0), ("a", "param"): (("d", "exp_avg"), 16),
                      ("c", "param"): (("d", "exp_avg"), 26)}
    for key, (_d, off) in placed.items():  # every view is legal and lies inside the donor
        dt = DTYPES[key[1]]
        v = ex._as_bytes(donor)[off: off + 2 * new_shapes[key][0] * (2 if dt == FP32 else 1)].view(dt)
        assert v.numel() == new_shapes[key][0]
