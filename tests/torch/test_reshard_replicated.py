"""A replicated source (``elastic.torch.reshard.Replicated``): plain data parallelism planned without
the descriptions' exchange.

On four gloo processes, with an AdamW model whose old workers hold identical copies:

- planned from the known source, every worker's plan is the exchanged plan (same digest, same
  bytes) and the bytes land the same, for a grow with a leaver and for a shrink;
- a worker whose new model has another key, or whose old copy differs from the source, raises
  on that worker (naming the key / the difference) while the others plan; the digests then
  differ wherever a plan was made, which a coordinator's meeting refuses;
- replicas that only shrink plan and copy with no group at all (``NoPeers``): the same plan, no
  byte moved; a plan that would move bytes is refused there;
- a DTensor source is refused, and ``agree=True`` with a known source is a usage error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tests.torch._layouts as L
from tests.reshard._mp import Pool, free_port

pytestmark = pytest.mark.slow


def _model(seed: int, extra: bool = False, wider: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 10 if wider else 8), nn.Linear(10 if wider else 8, 3)]
    if extra:
        layers.append(nn.Linear(3, 3))
    model = nn.Sequential(*layers).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _trained(seed: int, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An old worker's copy: one AdamW step on fixed data (every replica the same)."""
    model, opt = _model(seed, **kw)
    x = torch.arange(12, dtype=torch.float64).reshape(2, 6) / 10
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


#: case -> (old ranks, new ranks)
CASES = {"grow_with_leaver": ((0, 1), (1, 2, 3)), "shrink": ((0, 1, 2, 3), (1, 3))}


def replicated_job(rank: int, n: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from elastic.reshard.plan import ReshardError
    from elastic.torch import training_state
    from elastic.torch.reshard import NoPeers, execute_reshard, freeze, prepare_reshard, replicated

    L.init(rank, n, port)
    try:
        out: dict[str, Any] = {}
        for case, (old, new) in CASES.items():
            for how in ("exchange", "known", "solo"):
                src_model = _trained(1) if rank in old else None
                src = freeze(training_state(*src_model)) if src_model else None
                dst_model = _model(7) if rank in new else None
                dst = training_state(*dst_model, init_optimizer=True) if dst_model else None
                # what the publisher shares: the first old worker's copy, described
                known = replicated(freeze(training_state(*_trained(1))), old, new) if how != "exchange" else None
                if how == "solo":  # no group: refused where bytes would cross processes
                    try:
                        prep = prepare_reshard(src, dst, group=NoPeers(rank, n), agree=False, known=known)
                    except ReshardError as e:
                        out[f"{case}/{how}"] = {"error": str(e)}
                        dist.barrier()
                        continue
                else:
                    prep = prepare_reshard(src, dst, agree=how == "exchange", known=known)
                stats = execute_reshard(prep)
                want = training_state(*_trained(1))
                out[f"{case}/{how}"] = {
                    "digest": prep.digest, "moved": stats.bytes_moved, "bound": stats.bytes_lower_bound,
                    "wrong": sorted(k for k, t in (dst or {}).items() if _bits(t) != _bits(want[k])),
                }
                dist.barrier()
        # refusals, each on the worker at fault only (nothing collective happens in the planning)
        old, new = (0, 1), (0, 1, 2, 3)
        src_model = _trained(1, wider=rank == 1) if rank in old else None
        src = freeze(training_state(*src_model)) if src_model else None
        dst = training_state(*_model(7, extra=rank == 3), init_optimizer=True)
        known = replicated(freeze(training_state(*_trained(1))), old, new)
        try:
            out["refusal"] = {"digest": prepare_reshard(src, dst, agree=False, known=known).digest}
        except ReshardError as e:
            out["refusal"] = {"error": str(e)}
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(pool: Pool) -> list[dict[str, Any]]:
    return pool.run(replicated_job, 4, free_port(), timeout=120)


def test_a_known_replicated_source_plans_what_the_exchange_plans(results: list[dict[str, Any]]) -> None:
    for case in CASES:
        exchanged = {res[f"{case}/exchange"]["digest"] for res in results}
        known = {res[f"{case}/known"]["digest"] for res in results}
        assert len(exchanged) == 1 and known == exchanged, f"{case}: {exchanged} vs {known}"
        for r, res in enumerate(results):
            a, b = res[f"{case}/exchange"], res[f"{case}/known"]
            assert (b["moved"], b["bound"]) == (a["moved"], a["bound"]), case
            assert b["wrong"] == [] and a["wrong"] == [], f"{case}: rank {r}: {b['wrong'] or a['wrong']}"
        assert results[0][f"{case}/known"]["moved"] == results[0][f"{case}/known"]["bound"]
    # grow: the two joiners each receive one copy; shrink: nothing crosses a process
    assert results[0]["grow_with_leaver/known"]["moved"] > 0
    assert results[0]["shrink/known"]["moved"] == 0


def test_replicas_that_shrink_need_no_group(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        solo, known = res["shrink/solo"], res["shrink/known"]
        assert solo.get("digest") == known["digest"] and solo["moved"] == 0 and solo["wrong"] == [], (r, solo)
        err = res["grow_with_leaver/solo"].get("error", "")
        assert "needs a group of the old and new workers" in err, (r, res["grow_with_leaver/solo"])


def test_a_worker_at_fault_refuses_on_its_own(results: list[dict[str, Any]]) -> None:
    ref = [res["refusal"] for res in results]
    assert "error" in ref[1] and "not the replicated source" in ref[1]["error"], ref[1]
    assert "error" in ref[3] and "2.weight" in ref[3]["error"] and "no worker's old state holds" in ref[3]["error"], ref[3]
    assert "digest" in ref[0] and "digest" in ref[2], ref


def test_a_dtensor_source_and_an_agreeing_call_are_refused() -> None:
    from elastic.reshard.plan import ReshardError
    from elastic.torch.reshard import NoPeers, Replicated, _Side, prepare_reshard, replicated

    sharded = ({"w": ("t", (4, 2), "float32", "mesh-fp", ("Shard(0)",))}, {}, {}, {}, [], "cpu")
    with pytest.raises(ReshardError, match="w is a DTensor"):
        replicated(_Side(*sharded), [0], [0, 1])
    with pytest.raises(ValueError, match="agree=False"):
        prepare_reshard(None, {}, known=Replicated({}, "cpu", (0,), (0,)))
    with pytest.raises(ValueError, match="needs known="):
        prepare_reshard(None, {}, group=NoPeers(0, 1), agree=False)
    with pytest.raises(ValueError, match="rank must be in"):
        NoPeers(2, 2)
