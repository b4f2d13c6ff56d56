"""``elastic.torch.reshard`` moves real DTensor training state between device meshes, in place.

What this proves, on four gloo processes:

- **fidelity**: the example Llama (torchtitan's TP plan, FSDP2, pipeline stages) trained in
  float64 through chains of layouts (FSDP4 -> FSDP2xTP2 -> TP2 on two ranks -> PP2xTP2 ->
  FSDP3, and DDP2 -> DDP4 -> re-ranked FSDP4 and FSDP2xTP2 -> PP2 -> FSDP2xTP2 ordered
  by ``mesh_order`` -> one process) follows the never-resharded single process's loss curve to
  1e-9; every key's full tensor, parameters and optimizer state, is bitwise the same before and
  after each transition; the optimizer's step count moves; the old shards are untouched; the
  bytes sent equal the lower bound; and where DCP can do the same transition (save, load into
  a second new model), the two new models hold the same bytes and train bitwise alike;
- **shards**: torch's chunking rule with uneven and empty shards (10 rows and 2 rows over 4),
  replicated plain tensors, meshes whose ranks do not ascend, and mixed dtypes (bfloat16
  parameters with a float32 master copy and moments) land exactly where torch expects them;
- **refusals**: a key only the new state has, a shape or dtype change, a ``Partial`` shard, a
  ``from_local`` shard that does not follow the chunking rule, state no live worker holds, and
  a new optimizer without state, and ranks that pass neither side are refused on every rank with an error naming the key and the
  fix, before any byte moves (old and new shards unchanged); a valid reshard then works.

Jobs run on one pool of spawned processes (``tests/reshard/_mp.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tests.torch._layouts as L
from tests.reshard._mp import Pool, free_port

pytestmark = pytest.mark.slow

STEPS = 2  # training steps under each layout

#: transitions DCP can also do (every mesh's ranks ascend): compared with DCP twins
CHAIN_DCP = [("fsdp4", (0, 1, 2, 3)), ("fsdp2xtp2", (0, 1, 2, 3)), ("tp2", (1, 3)), ("pp2xtp2", (0, 1, 2, 3)),
             ("fsdp3", (0, 2, 3))]
#: replicated grow, re-ranked meshes, pipeline stages, ``mesh_order``, down to one process. The
#: re-ranked meshes reorder the data-parallel dim only: torch's tensor-parallel modules train
#: wrongly on a tp dim whose ranks do not ascend, with or without a reshard (see _layouts.py)
CHAIN_RERANKED = [("ddp2", (0, 1)), ("ddp4", (0, 1, 2, 3)), ("fsdp4", (2, 0, 3, 1)), ("fsdp2xtp2", (2, 3, 0, 1)),
                  ("pp2", (0, 1)), ("fsdp2xtp2", None), ("single", (2,))]


@pytest.fixture(scope="module")
def reference(pool: Pool) -> dict[str, Any]:
    steps = STEPS * max(len(CHAIN_DCP), len(CHAIN_RERANKED))
    (out,) = pool.run(L.reference_job, 1, free_port(), steps, timeout=120)
    return out


# --------------------------------------------------------------------------------------------
# Fidelity: the example Llama through chains of layouts
# --------------------------------------------------------------------------------------------


def _union(dicts: list[dict[str, str]], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for d in dicts:
        for k, v in d.items():
            assert out.setdefault(k, v) == v, f"{what}: ranks disagree on {k}"
    return out


def _check_chain(results: list[dict[str, Any]], chain: list, reference: dict[str, Any], *, dcp: bool) -> None:
    total = STEPS * len(chain)
    losses: dict[int, float] = {}
    for r in results:
        for s, v in r["losses"].items():
            assert losses.setdefault(s, v) == v, f"step {s}: ranks report different losses"
    assert sorted(losses) == list(range(total))
    for s, got in losses.items():
        want = reference["losses"][s]
        assert abs(got - want) <= 1e-9 * abs(want), f"step {s}: {got!r} != {want!r} (one process)"
    assert losses[total - 1] < losses[0] - 1.0, "training did not learn"

    keys = set(reference["final_full"])
    for i, (name, _) in enumerate(chain[1:]):
        recs = [r["transitions"][i] for r in results]
        assert {rec["to"] for rec in recs} == {name}
        before = _union([rec["before"] for rec in recs], f"{name} before")
        after = _union([rec["after"] for rec in recs], f"{name} after")
        assert set(before) == keys, f"-> {name}: the old state does not hold every key"
        assert after == before, f"-> {name}: the full tensors changed: {sorted(k for k in before if after.get(k) != before[k])[:4]}"
        for r, rec in enumerate(recs):
            assert rec["src_intact"], f"-> {name}: rank {r}'s old shards changed"
            assert rec["bytes_moved"] == rec["bytes_lower_bound"], f"-> {name}"
            if rec["member"]:
                assert rec["step_scalars"] == [float(STEPS * (i + 1))], f"-> {name} rank {r}"
                if dcp:
                    assert rec["dcp_equal"], f"-> {name} rank {r}: the DCP-loaded twin holds other bytes"
                    assert rec["dcp_losses_equal"] and rec["dcp_states_equal"], f"-> {name} rank {r}"
        old_ranks = set(results[0]["transitions"][i - 1]["ranks"]) if i else set(chain[0][1])
        new_ranks = set(recs[0]["ranks"])
        assert set(recs[0]["leavers"]) == old_ranks - new_ranks, f"-> {name}"
        assert set(recs[0]["joiners"]) == new_ranks - old_ranks, f"-> {name}"

    (final,) = [r["final_full"] for r in results if r["final_full"] is not None]
    assert set(final) == set(reference["final_full"])
    # the reference's end state is that of the longest chain; a shorter one is checked by its curve
    if total == len(reference["losses"]):
        for k, want in reference["final_full"].items():
            torch.testing.assert_close(final[k], want, rtol=1e-9, atol=1e-12, msg=k)


def test_chain_with_dcp_twins(pool: Pool, reference: dict[str, Any], tmp_path: Any) -> None:
    results = pool.run(L.chain_job, 4, free_port(), CHAIN_DCP, STEPS, str(tmp_path), timeout=300)
    _check_chain(results, CHAIN_DCP, reference, dcp=True)


def test_chain_through_reranked_meshes_and_mesh_order(pool: Pool, reference: dict[str, Any]) -> None:
    # runs in the processes the DCP chain used, with meshes equal to its (fsdp2xtp2 on 0..3):
    # without elastic.torch.caches.clear_dtensor_caches in L.init this fails on a stale mesh
    results = pool.run(L.chain_job, 4, free_port(), CHAIN_RERANKED, STEPS, None, timeout=300)
    _check_chain(results, CHAIN_RERANKED, reference, dcp=False)
    moved = [r["bytes_moved"] for r in results[0]["transitions"]]
    # DDP4 -> FSDP4: every new shard is already local (a replica holds everything); the others move
    assert moved[1] == 0 and all(m > 0 for i, m in enumerate(moved) if i != 1), moved


# --------------------------------------------------------------------------------------------
# Shards: a toy model with uneven and empty shards, re-ranked meshes, mixed dtypes
# --------------------------------------------------------------------------------------------


class Toy(nn.Module):
    """10 rows over 4 FSDP ranks are 3,3,3,1 (torch.chunk); 2 rows are 1,1,0,0."""

    def __init__(self, rows: int = 10, extra: bool = False):
        super().__init__()
        self.a = nn.Linear(6, rows)
        self.b = nn.Linear(rows, 2)
        if extra:
            self.c = nn.Parameter(torch.zeros(3))


class MasterAdam(torch.optim.Optimizer):
    """Low-precision parameters stepped from a float32 master copy, with float32 moments."""

    def __init__(self, params: Any, lr: float = 1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["master"] = p.detach().float()
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["step"] = torch.tensor(0.0)
                st["step"] += 1
                st["exp_avg"].mul_(0.9).add_(p.grad.float(), alpha=0.1)
                st["master"].add_(st["exp_avg"], alpha=-g["lr"])
                p.copy_(st["master"])


def _toy(layout: str, ranks: tuple[int, ...], *, dtype: torch.dtype = torch.float64, rows: int = 10,
         extra: bool = False, opt: str = "adamw") -> tuple[Any, Any]:
    """``layout`` is "fsdp" (FSDP2 over ``ranks``) or "plain" (a replica on each of ``ranks``).
    Every process calls it (mesh creation is collective); others get (None, None)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("dp",)) if layout == "fsdp" else None
    if dist.get_rank() not in ranks:
        return None, None
    torch.manual_seed(0)
    model = Toy(rows, extra).to(dtype)
    if layout == "fsdp":
        fully_shard(model, mesh=mesh)
    optimizer = (MasterAdam if opt == "master" else torch.optim.AdamW)(model.parameters())
    return model, optimizer


def _global_values(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A deterministic full value for every key (the same in every process)."""
    out = {}
    for i, (k, t) in enumerate(sorted(state.items())):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        full = torch.randn(tuple(t.shape), generator=g, dtype=torch.float64) if t.dim() else torch.tensor(7.0)
        out[k] = full.to(t.dtype)
    return out


def _expected_local(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    from elastic.torch.regions import local_region
    from elastic.torch.state import _region_index

    return full[_region_index(local_region(t))] if t.dim() else full


def _bits(t: torch.Tensor) -> bytes:
    from elastic.torch.regions import local_tensor

    return local_tensor(t).detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()




#: (layout, ranks) steps of the toy chain: uneven and empty shards, a replicated pair, re-ranked
TOY_CHAIN = [("fsdp", (0, 1, 2, 3)), ("fsdp", (1, 2, 3)), ("plain", (0, 3)), ("fsdp", (3, 1, 0, 2)),
             ("fsdp", (2, 0))]


def toy_job(rank: int, n: int, port: int, dtype_name: str, opt: str) -> dict[str, Any]:
    import torch.distributed as dist

    from elastic.torch import load_training_state, reshard, training_state

    L.init(rank, n, port)
    dtype = getattr(torch, dtype_name)
    try:
        out: dict[str, Any] = {"steps": []}
        model, optimizer = _toy(*TOY_CHAIN[0], dtype=dtype, opt=opt)
        values = None
        src = None
        if model is not None:
            values = _global_values(training_state(model, optimizer, init_optimizer=True), seed=3)
            src = load_training_state(model, optimizer, values)
        for layout, ranks in TOY_CHAIN[1:]:
            src_bits = {k: _bits(t) for k, t in (src or {}).items()}
            new_model, new_opt = _toy(layout, ranks, dtype=dtype, opt=opt)
            dst = training_state(new_model, new_opt, init_optimizer=True) if new_model is not None else None
            if values is None:
                values = _global_values(dst, seed=3)  # a joiner knows the values for checking only
            stats = reshard(src, dst)
            rec: dict[str, Any] = {"to": (layout, ranks), "src_intact": {k: _bits(t) for k, t in (src or {}).items()}
                                   == src_bits, "moved": stats.bytes_moved, "bound": stats.bytes_lower_bound}
            if dst is not None:
                rec["wrong"] = sorted(k for k, t in dst.items() if _bits(t) != _bits(_expected_local(t, values[k])))
                rec["dtypes"] = {k: str(t.dtype) for k, t in dst.items()}
                rec["local_rows"] = {k: tuple(_local_shape(t)) for k, t in dst.items() if t.dim()}
                # torch's own view of the result: the full tensor gathered over the new mesh
                rec["full_wrong"] = sorted(k for k, t in dst.items() if t.dim() and not torch.equal(
                    t.full_tensor() if hasattr(t, "full_tensor") else t, values[k]))
            out["steps"].append(rec)
            src = dst
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _local_shape(t: torch.Tensor) -> torch.Size:
    from elastic.torch.regions import local_tensor

    return local_tensor(t).shape


@pytest.mark.parametrize("dtype_name, opt", [("float64", "adamw"), ("bfloat16", "master")])
def test_uneven_empty_replicated_and_reranked_shards(pool: Pool, dtype_name: str, opt: str) -> None:
    results = pool.run(toy_job, 4, free_port(), dtype_name, opt, timeout=120)
    for i, (layout, ranks) in enumerate(TOY_CHAIN[1:]):
        for r, res in enumerate(results):
            rec = res["steps"][i]
            assert rec["src_intact"], f"-> {layout}{ranks} rank {r}"
            assert rec["moved"] == rec["bound"], f"-> {layout}{ranks}"
            if r not in ranks:
                assert "wrong" not in rec
                continue
            assert rec["wrong"] == [] and rec["full_wrong"] == [], f"-> {layout}{ranks} rank {r}"
            if opt == "master":
                # bfloat16 parameters, float32 master copy and moments, each kept in its dtype
                assert rec["dtypes"]["a.weight"] == "torch.bfloat16"
                assert rec["dtypes"]["a.weight::master"] == rec["dtypes"]["a.weight::exp_avg"] == "torch.float32"
            else:
                assert {v for k, v in rec["dtypes"].items() if not k.endswith("::step")} == {"torch.float64"}
    # FSDP4 -> FSDP3 on ranks 1,2,3: torch.chunk's 4,4,2 rows and 1,1,0 of the 2-row bias
    rows = {r: results[r]["steps"][0]["local_rows"] for r in (1, 2, 3)}
    assert [rows[r]["a.weight"][0] for r in (1, 2, 3)] == [4, 4, 2]
    assert [rows[r]["b.bias"][0] for r in (1, 2, 3)] == [1, 1, 0]
    # on the re-ranked mesh (3, 1, 0, 2) torch shards by sorted group rank: rank 0 holds the first chunk
    rows = {r: results[r]["steps"][2]["local_rows"]["a.weight"][0] for r in range(4)}
    assert rows == {0: 3, 1: 3, 2: 3, 3: 1}


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def _case_states(case: str) -> tuple[dict | None, dict | None]:
    """(src, dst) of this process for one refusal case. src: FSDP2 over ranks 0,1 (float64)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from elastic.torch import load_training_state, training_state

    rank = dist.get_rank()
    model, opt = _toy("fsdp", (0, 1))
    src = None
    if model is not None:
        src = load_training_state(model, opt, _global_values(training_state(model, opt, init_optimizer=True), 5))
    kw: dict[str, Any] = {}
    new_ranks = (0, 1, 2, 3)
    if case == "new_key":
        kw["extra"] = True
    elif case == "shape":
        kw["rows"] = 12
    elif case == "dtype":
        kw["dtype"] = torch.float32
    elif case == "holders_gone":
        new_ranks = (1, 2, 3)
    elif case == "bystanders":
        new_ranks = (0, 1)  # ranks 2 and 3 pass neither side
    new_model, new_opt = _toy("fsdp", new_ranks, **kw)
    dst = None
    if new_model is not None:
        dst = training_state(new_model, new_opt, init_optimizer=case != "no_optimizer_state")
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]))
    if src is not None and case == "partial":
        src["a.weight"] = DTensor.from_local(torch.ones(10, 6, dtype=torch.float64), mesh, [Partial()])
    if src is not None and case == "not_chunk_rule":
        rows = 4 if rank == 0 else 6  # torch.chunk gives 5 and 5
        src["a.weight"] = DTensor.from_local(torch.ones(rows, 6, dtype=torch.float64), mesh, [Shard(0)],
                                             run_check=False, shape=torch.Size((10, 6)), stride=(6, 1))
    if case == "holders_gone" and rank == 1:
        src = None  # rank 1 held rows 5-9 and lost them (it joins the new layout empty-handed)
    return src, dst


REFUSALS = {
    "new_key": "no worker's old state holds, e.g. ['c'",
    "shape": "global shape [10, 6] in the old state but [12, 6]",
    "dtype": "dtype float64 in the old state but float32",
    "partial": "Partial",
    "not_chunk_rule": "torch's sharding rule gives",
    "holders_gone": "no live worker of the old state holds",
    "no_optimizer_state": "init_optimizer=True",
    "bystanders": "ranks [2, 3] of the group pass neither src nor dst",
}


def refusal_job(rank: int, n: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from elastic.reshard.plan import ReshardError
    from elastic.torch import reshard

    L.init(rank, n, port)
    try:
        out: dict[str, Any] = {}
        for case in REFUSALS:
            src, dst = _case_states(case)
            before = {k: _bits(t) for k, t in (src or {}).items()}, {k: _bits(t) for k, t in (dst or {}).items()}
            try:
                reshard(src, dst)
                err = None
            except ReshardError as e:
                err = str(e)
            after = {k: _bits(t) for k, t in (src or {}).items()}, {k: _bits(t) for k, t in (dst or {}).items()}
            out[case] = {"error": err, "unchanged": before == after}
        # the group is still usable and a valid reshard of the same state works
        src, dst = _case_states("valid")
        reshard(src, dst)
        values = _global_values(dst, 5)
        out["valid_wrong"] = sorted(k for k, t in dst.items() if _bits(t) != _bits(_expected_local(t, values[k])))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def test_bad_input_is_refused_on_every_rank_before_any_byte_moves(pool: Pool) -> None:
    results = pool.run(refusal_job, 4, free_port(), timeout=120)
    for case, fragment in REFUSALS.items():
        for r, res in enumerate(results):
            got = res[case]
            assert got["error"] is not None, f"{case}: rank {r} did not refuse"
            assert fragment in got["error"], f"{case}: rank {r}: {got['error']}"
            assert got["unchanged"], f"{case}: rank {r}'s shards changed"
    assert "a.weight" in results[0]["partial"]["error"] and "a.weight" in results[0]["not_chunk_rule"]["error"]
    assert "a.weight" in results[0]["shape"]["error"] and "a.weight" in results[0]["dtype"]["error"]
    for res in results:
        assert res["valid_wrong"] == []

