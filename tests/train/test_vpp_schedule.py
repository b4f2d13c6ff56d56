"""The interleaved 1F1B order, its model of time, and what the trainer accepts for ``vpp > 1``.

Pure tests (no torch.distributed): every rank's order runs each (chunk, micro-batch) forward
and backward exactly once, backward after forward, with Megatron's warm-up count; the orders
of all ranks together never deadlock; simulated, their bubble is Megatron's ``(p-1)/(v*m)``
and their peak of held activations is what the memory planner assumes; the model chunks
of a rank are the stage partition's (padding slots hold no parameters); micro-batch counts
that are not a multiple of ``pp`` are refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from elastic.model import Layout, ModelSpec, SpecError
from elastic.parallel.memory import chunks_in_flight
from elastic.parallel.partition import partition_layers
from elastic.reshard.spec import sharding_spec
from elastic.train.engine import TrainConfig, TrainEngine
from elastic.train.groups import Comm
from elastic.train.model import GPTStage
from elastic.train.pipeline import interleaved_order, interleaved_warmup, one_f_one_b_order, simulate

SEVEN = ModelSpec(name="tiny7", layers=7, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16)
GRID = [(pp, vpp, m) for pp in (2, 3, 4) for vpp in (2, 3) for m in (pp, 2 * pp, 3 * pp)]


@pytest.mark.parametrize("pp,vpp,m", GRID)
def test_each_rank_runs_every_chunk_micro_batch_once_forward_before_backward(pp: int, vpp: int, m: int) -> None:
    for r in range(pp):
        ops = interleaved_order(pp, vpp, r, m)
        every = {(c, i) for c in range(vpp) for i in range(m)}
        assert sorted((c, i) for k, c, i in ops if k == "F") == sorted(every)
        assert sorted((c, i) for k, c, i in ops if k == "B") == sorted(every)
        seen = set()
        for k, c, i in ops:
            assert k == "F" or (c, i) in seen, f"rank {r}: backward of {(c, i)} before its forward"
            seen.add((c, i))
        # Megatron's warm-up: forwards before the first backward
        warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, m * vpp)
        assert interleaved_warmup(pp, vpp, r, m) == warmup
        first_b = next(j for j, op in enumerate(ops) if op[0] == "B")
        # the steady state starts with a forward, so the first backward follows warmup + 1 forwards
        assert first_b == (warmup + 1 if warmup < m * vpp else m * vpp)


def test_the_order_of_pp2_vpp2_with_four_micro_batches_is_megatrons() -> None:
    # rank 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards: chunk 0 on micro-batches 0, 1, chunk 1 on 0, 1
    assert interleaved_order(2, 2, 0, 4) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3)]
    assert interleaved_order(2, 2, 1, 4)[:3] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0)]


@pytest.mark.parametrize("pp,vpp,m", GRID)
def test_orders_never_deadlock_and_hold_what_the_planner_assumes(pp: int, vpp: int, m: int) -> None:
    t = simulate([interleaved_order(pp, vpp, r, m) for r in range(pp)], vpp, 1 / vpp, 2 / vpp)
    assert list(t.peak_in_flight) == [chunks_in_flight(pp, vpp, m, r) for r in range(pp)]
    # chunks cost 1/vpp of a stage: Megatron's bubble model holds exactly on uniform costs
    assert t.bubble == pytest.approx((pp - 1) / (vpp * m), rel=1e-12)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_plain_1f1b_bubble_is_p_minus_1_over_m(pp: int, m: int) -> None:
    t = simulate([one_f_one_b_order(pp, r, m) for r in range(pp)], 1)
    assert t.bubble == pytest.approx((pp - 1) / m, rel=1e-12)
    assert list(t.peak_in_flight) == [min(pp - r, m) for r in range(pp)]


def test_a_wrong_order_is_reported_as_a_deadlock() -> None:
    # rank 1 wants micro-batch 1 before micro-batch 0, whose forward rank 0 runs second
    orders = [[("F", 0, 1), ("F", 0, 0), ("B", 0, 1), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 1), ("F", 0, 1), ("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(orders, 1)


# ---- the trainer's side -------------------------------------------------------------------------


def test_micro_batches_not_a_multiple_of_pp_are_refused_naming_the_field() -> None:
    cfg = TrainConfig(SEVEN, global_batch=6, micro_batch=1)
    assert cfg.grad_accum(Layout(1, 2, 1, vpp=2)) == 6
    with pytest.raises(SpecError, match=r"tp1.pp2.dp2.vpp2: .*grad_accum.* multiple of pp=2.* = 6/\(2\*1\) = 3"):
        cfg.grad_accum(Layout(1, 2, 2, vpp=2))
    assert cfg.grad_accum(Layout(1, 2, 2)) == 3  # plain 1F1B takes any count
    with pytest.raises(SpecError, match="grad_accum"):
        TrainEngine(cfg, Layout(1, 2, 2, vpp=2), 0)


def test_micro_batch_cap_picks_a_count_the_interleaved_schedule_takes() -> None:
    cfg = TrainConfig(SEVEN, global_batch=12, micro_batch_cap=4)
    assert cfg.micro_batch_for(Layout(1, 3, 1)) == 4  # 3 micro-batches of 4
    assert cfg.micro_batch_for(Layout(1, 3, 1, vpp=2)) == 4  # 3 is a multiple of pp=3
    assert cfg.micro_batch_for(Layout(1, 2, 1, vpp=2)) == 3  # 4 micro-batches, not 3 of 4
    assert cfg.grad_accum(Layout(1, 2, 1, vpp=2)) % 2 == 0


def test_ep_without_experts_is_refused() -> None:
    with pytest.raises(SpecError, match="has no experts"):
        TrainEngine(TrainConfig(SEVEN, global_batch=4), Layout(1, 1, 2, ep=2), 0)


@pytest.mark.parametrize("layout", ["tp1.pp2.dp1.vpp2", "tp2.pp2.dp1.vpp2", "tp1.pp3.dp1.vpp2"])
def test_chunks_are_the_partitions_and_padding_slots_hold_nothing(layout: str) -> None:
    lay = Layout.parse(layout)
    spec = sharding_spec(SEVEN, lay)
    part = partition_layers(7, lay.pp, lay.vpp)
    total = 0
    for rank in range(lay.world_size):
        tp_rank, _, pp_rank = lay.coords(rank)
        tp = Comm(tuple(range(lay.tp)), tp_rank, object() if lay.tp > 1 else None)  # shapes only
        stage = GPTStage(spec, rank, tp, torch.float32, "cpu")  # raises if names or shapes differ
        for c in range(lay.vpp):
            assert stage.chunk_layers[c] == tuple(str(i) for i in part.chunks[c * lay.pp + pp_rank])
        total += sum(p.numel() for p in stage.parameters()) if tp_rank == 0 else 0
    one = sum(t.numel for t in spec.tensors)
    if lay.tp == 1:
        assert total == one  # the padding slot added no parameter
    if layout == "tp1.pp2.dp1.vpp2":
        # 7 layers in 8 slots: chunks (0,1) (2,3) (4,5) (6,<pad>); rank 0 holds chunks 0 and 2
        assert part.chunks == ((0, 1), (2, 3), (4, 5), (6,)) and part.virtual == (0, 0, 0, 1)
