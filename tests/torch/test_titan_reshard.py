"""``elastic.torch.reshard`` moves torchtitan's real llama3 training state in place, FSDP2 x TP2 -> FSDP4.

On the same four processes, torchtitan's llama3 debug model (``tests/torch/_titan.py``: its own
``parallelize_llama``, float64, gloo) trains ``K`` AdamW steps as FSDP2 x TP2; its parameters and
optimizer state are then resharded in memory into a freshly built FSDP4 model and optimizer.
The module proves that:

1. every key (parameters, ``exp_avg``, ``exp_avg_sq``, ``step``) has bitwise the same full tensor
   after the reshard as before, while the fresh FSDP4 state differed in every key beforehand;
2. the old state is left untouched, bit for bit, on every rank;
3. every new local shard is exactly the ``torch.chunk`` slice of the old full tensor that
   ``Shard(0)`` over four ranks gives;
4. the bytes the plan moves equal its lower bound, and that bound equals an independent count
   (new shard elements a rank's old shard does not hold at the same global position); the
   ranks' sent and received bytes add up to it, and each rank receives exactly its count;
5. training continues as if nothing happened: ``K`` more steps are bitwise equal (losses and
   every local tensor) to the checkpoint route (torchtitan's model and optimizer state through
   ``torch.distributed.checkpoint``: saved under FSDP2 x TP2, loaded into a fresh FSDP4), and
   agree to 1e-9 relative with the FSDP2 x TP2 run that was never resharded (another reduction
   order, so not bitwise). A continuation with a fresh optimizer instead of the moved one
   misses that tolerance by orders of magnitude from its second step on (the first step's loss
   depends on the parameters only), so it sees lost optimizer state.

Everything runs as one job on a pool of four spawned processes (``tests/reshard/_mp.py``); the
job returns digests, losses and per-rank findings, and the tests below judge them.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.reshard._mp import Pool, free_port

pytestmark = pytest.mark.slow

K = 3  # training steps before the reshard, and again after it
N = 4  # processes: FSDP2 x TP2 before, FSDP4 after
LR = 1e-3  # train_steps' default, given explicitly to the optimizers built here
GLOBAL_BATCH = 4


# --------------------------------------------------------------------------------------------
# Helpers that run inside the workers
# --------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor; for a DTensor a collective over its mesh (all ranks, same order)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _hash(t: torch.Tensor) -> str:
    """Dtype, shape and bytes (``_titan.digest`` cannot view a 0-d tensor, Adam's ``step``, as bytes)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(repr((t.dtype, tuple(t.shape))).encode() + data).hexdigest()[:16]


def _full_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: _hash(_full(t)) for k, t in state.items()}


def _local_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: _hash(_local(t)) for k, t in state.items()}


def _row_chunk(full: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank ``r``'s piece of ``Shard(0)`` over ``n``: torch.chunk's ``r``-th piece, empty past the last."""
    pieces = torch.chunk(full, n, dim=0)
    return pieces[r] if r < len(pieces) else full[full.shape[0]:]


def _remote_elements(t: torch.Tensor, rank: int, cache: dict) -> int:
    """How many elements of rank ``rank``'s FSDP4 shard of ``t``'s key its FSDP2 x TP2 shard ``t`` does
    not hold at the same global position: what must cross the network to it, at least.

    The old shard's global positions come from torch itself (``distribute_tensor`` of a tensor of
    global indices with ``t``'s mesh and placements), not from elastic's region math, and are
    checked against the real shard's values by the caller."""
    from torch.distributed.tensor import distribute_tensor

    sig = (tuple(t.shape), t.placements, id(t.device_mesh))
    if sig not in cache:
        idx = torch.arange(t.numel(), dtype=torch.int64).reshape(t.shape)
        old = distribute_tensor(idx, t.device_mesh, t.placements, src_data_rank=None).to_local()
        new = _row_chunk(idx, N, rank)
        cache[sig] = (old, new.numel() - int(torch.isin(new.flatten(), old.flatten()).sum()))
    return cache[sig]


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def _build(dp_shard: int, tp: int) -> Any:
    from torchtitan.components.checkpointer.utils import canonical_fqn

    from tests.torch._titan import build_titan_llama

    m = build_titan_llama(dp_shard=dp_shard, tp=tp, dtype=torch.float64, seed=0)
    # train_steps' optimizer, given the parameters' names as torchtitan's optimizer builder does:
    # its checkpoint code keys the optimizer state by them (the names change no arithmetic)
    m.optimizer = torch.optim.AdamW([(canonical_fqn(k), p) for k, p in m.model.named_parameters()], lr=LR)
    return m


def _checkpoint_state(m: Any) -> tuple[Any, dict[str, Any]]:
    """What torchtitan's checkpointer hands DCP: its ``ModelWrapper`` state (the fused ``wqkv``
    split into ``wq``/``wk``/``wv`` by torchtitan's state-dict hook) and the flat, name-keyed
    optimizer state (created first if the optimizer has none, as its ``OptimizersContainer`` does).

    Not ``torch.distributed.checkpoint.state_dict.get_state_dict``: in torch 2.13 it maps every
    state-dict key back to a module attribute, and torchtitan's FusedQKVLinear has no ``wq``
    (``AttributeError: 'FusedQKVLinear' object has no attribute 'wq'``)."""
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state

    wrapper = ModelWrapper(m.model)
    init_optim_state(m.optimizer)
    return wrapper, {"model": wrapper.state_dict(), "optim": get_flat_optim_state_dict(m.optimizer)}


def reshard_job(rank: int, n: int, port: int, ckpt: str) -> dict[str, Any]:
    """FSDP2 x TP2 -> FSDP4 on ``n`` processes, in place and through DCP; see the module docstring."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    from torchtitan.components.optimizer.utils import load_flat_optim_state_dict

    from elastic.torch import reshard, training_state
    from tests.torch._titan import train_steps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out: dict[str, Any] = {}
        # 1. the old layout trains K steps and is checkpointed (for the twin of step 4)
        old = _build(dp_shard=2, tp=2)
        out["losses_before"] = train_steps(old, K, global_batch=GLOBAL_BATCH, lr=LR)
        dcp.save(_checkpoint_state(old)[1], checkpoint_id=ckpt)

        # 2. the reshard
        src = training_state(old.model, old.optimizer)
        out["src_before_full"] = _full_digests(src)
        out["src_before_local"] = _local_digests(src)
        new = _build(dp_shard=4, tp=1)
        dst = training_state(new.model, new.optimizer, init_optimizer=True)
        out["dst_fresh_full"] = _full_digests(dst)
        stats = reshard(src, dst)
        out["stats"] = {f: getattr(stats, f) for f in (
            "bytes_moved", "bytes_lower_bound", "bytes_needed", "bytes_local", "messages", "bytes_sent",
            "bytes_received", "scalars", "leavers", "joiners", "seconds")}
        out["src_after_local"] = _local_digests(src)
        out["dst_after_full"] = _full_digests(dst)

        # 3. the new shards against the old full tensors, and the independent byte count
        out["placements"] = {"src": sorted({repr((tuple(t.device_mesh.shape), t.placements))
                                            for t in src.values() if isinstance(t, DTensor)}),
                             "dst": sorted({repr((tuple(t.device_mesh.shape), t.placements))
                                            for t in dst.values() if isinstance(t, DTensor)})}
        chunk_wrong, where_wrong, remote_bytes, shards_checked = [], [], 0, 0
        cache: dict = {}
        for key in src:  # the same order on every rank: full_tensor is collective
            t, d = src[key], dst[key]
            full = _full(t)
            if not isinstance(d, DTensor):
                continue  # a 0-d step: its value is compared through the digests
            shards_checked += 1
            if _hash(_local(d)) != _hash(_row_chunk(full, N, rank)):
                chunk_wrong.append(key)
            old_idx, remote = _remote_elements(t, rank, cache)
            if not torch.equal(_local(t).flatten(), full.flatten()[old_idx.flatten()]):
                where_wrong.append(key)  # the index oracle does not describe the real shard
            remote_bytes += remote * d.element_size()
        out.update(chunk_wrong=chunk_wrong, where_wrong=where_wrong, remote_bytes=remote_bytes,
                   shards_checked=shards_checked)

        # 4. the twin: a fresh FSDP4 model and optimizer loaded from the checkpoint
        twin = _build(dp_shard=4, tp=1)
        wrapper, sd = _checkpoint_state(twin)
        dcp.load(sd, checkpoint_id=ckpt)
        wrapper.load_state_dict(sd["model"])
        load_flat_optim_state_dict(twin.optimizer, sd["optim"])
        out["twin_equal_after_load"] = (_local_digests(training_state(twin.model, twin.optimizer))
                                        == _local_digests(dst))

        # 5. K more steps: resharded, checkpoint twin, and the old layout that never resharded
        out["losses_resharded"] = train_steps(new, K, global_batch=GLOBAL_BATCH, lr=LR, first_step=K)
        out["losses_twin"] = train_steps(twin, K, global_batch=GLOBAL_BATCH, lr=LR, first_step=K)
        out["losses_straight"] = train_steps(old, K, global_batch=GLOBAL_BATCH, lr=LR, first_step=K)
        out["final_resharded"] = _local_digests(training_state(new.model, new.optimizer))
        out["final_twin"] = _local_digests(training_state(twin.model, twin.optimizer))
        return out
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    pool = Pool(N)
    try:
        yield pool.run(reshard_job, N, free_port(), str(tmp_path_factory.mktemp("dcp")), timeout=300)
    finally:
        pool.close()


def test_layouts_are_fsdp2_tp2_and_fsdp4(ranks: list[dict[str, Any]]) -> None:
    """The premise: the old state really is 2-D (FSDP-strided over TP) and the new one 1-D Shard(0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for r, res in enumerate(ranks):
        src = set(res["placements"]["src"])
        assert repr(((2, 2), (_StridedShard(0, split_factor=2), Shard(0)))) in src, f"rank {r}: {src}"
        assert repr(((2, 2), (Shard(0), Shard(1)))) in src, f"rank {r}: {src}"
        assert repr(((2, 2), (Shard(0), Replicate()))) in src, f"rank {r}: {src}"
        assert res["placements"]["dst"] == [repr(((4,), (Shard(0),)))], f"rank {r}"


def test_every_key_moves_bitwise(ranks: list[dict[str, Any]]) -> None:
    before = ranks[0]["src_before_full"]
    kinds = {k.partition("::")[2] for k in before}
    assert kinds == {"", "exp_avg", "exp_avg_sq", "step"}, kinds  # parameters and all of AdamW's state
    for r, res in enumerate(ranks):
        assert res["src_before_full"] == before, f"rank {r} gathered other full tensors"
        # the fresh FSDP4 state differed in every key (else "equal after" would prove nothing)
        same = sorted(k for k in before if res["dst_fresh_full"][k] == before[k])
        assert not same, f"rank {r}: the fresh state already equals the trained one in {same[:3]}"
        wrong = sorted(k for k in before if res["dst_after_full"].get(k) != before[k])
        assert not wrong and set(res["dst_after_full"]) == set(before), f"rank {r}: differ after: {wrong[:5]}"


def test_old_state_is_untouched(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        changed = sorted(k for k, v in res["src_before_local"].items() if res["src_after_local"][k] != v)
        assert not changed, f"rank {r}: the reshard wrote into src: {changed[:5]}"


def test_new_shards_are_the_torch_chunk_slices(ranks: list[dict[str, Any]]) -> None:
    n_tensors = sum(1 for k in ranks[0]["src_before_full"] if not k.endswith("::step"))
    for r, res in enumerate(ranks):
        assert res["shards_checked"] == n_tensors, f"rank {r}"
        assert res["where_wrong"] == [], f"rank {r}: the index oracle is wrong for {res['where_wrong'][:3]}"
        assert res["chunk_wrong"] == [], f"rank {r}: not the Shard(0) slice: {res['chunk_wrong'][:5]}"


def test_bytes_moved_are_the_lower_bound(ranks: list[dict[str, Any]]) -> None:
    stats = [res["stats"] for res in ranks]
    plan = stats[0]
    for r, st in enumerate(stats):  # the plan's totals are the same on every rank
        assert {k: st[k] for k in ("bytes_moved", "bytes_lower_bound", "messages")} == \
               {k: plan[k] for k in ("bytes_moved", "bytes_lower_bound", "messages")}, f"rank {r}"
    independent = sum(res["remote_bytes"] for res in ranks)
    assert 0 < plan["bytes_moved"] < plan["bytes_needed"], plan
    assert plan["bytes_lower_bound"] == independent, (plan, independent)
    assert plan["bytes_moved"] == plan["bytes_lower_bound"], plan
    assert sum(st["bytes_sent"] for st in stats) == plan["bytes_moved"]
    # each rank receives exactly what it lacked, no more
    assert [st["bytes_received"] for st in stats] == [res["remote_bytes"] for res in ranks]
    assert plan["leavers"] == plan["joiners"] == ()
    steps = sum(1 for k in ranks[0]["src_before_full"] if k.endswith("::step"))
    assert plan["scalars"] == steps > 0


def test_training_continues_bitwise_like_the_checkpoint_route(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        assert res["twin_equal_after_load"], f"rank {r}: the DCP-loaded state differs from the resharded one"
        assert len(res["losses_resharded"]) == K
        assert res["losses_resharded"] == res["losses_twin"], f"rank {r}"
        assert res["final_resharded"] == res["final_twin"], f"rank {r}"
        # the continued run is the same run on every rank (each returns the global mean)
        assert res["losses_resharded"] == ranks[0]["losses_resharded"], f"rank {r}"


def test_training_continues_like_a_never_resharded_run(ranks: list[dict[str, Any]]) -> None:
    res = ranks[0]
    for step, (got, want) in enumerate(zip(res["losses_resharded"], res["losses_straight"], strict=True)):
        assert abs(got - want) <= 1e-9 * abs(want), f"step {K + step}: resharded {got!r}, straight {want!r}"
