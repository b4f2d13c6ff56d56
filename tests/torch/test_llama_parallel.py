"""The example Llama computes the same thing in one process and under every parallel form we use.

Float64 training (3 AdamW steps on the same global batches) at 1 process, FSDP4, FSDP2 x TP2,
TP2 on 2 processes, a 2-stage GPipe pipeline and a 2-stage pipeline x TP2: per-step losses,
the first step's full gradients (which catch a gradient that is a sum where it should be a
mean; Adam alone would hide that) and the full parameters after the last step agree to 1e-10.
A float32 FSDP2 x TP2 backward checks the force-sum gradient path on gloo, and a bfloat16
forward checks the low-precision model runs sharded. Multi-process jobs run on one pool of
spawned gloo processes (see ``tests/reshard/_mp.py``).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tests.torch._layouts as L
from examples.llama.model import Llama, LlamaConfig
from examples.llama.parallel import pipeline_stage_module, stage_layers
from tests.reshard._mp import Pool, free_port

SEED, STEPS, BATCH = 7, 3, 4
CFG = LlamaConfig.tiny()


# --------------------------------------------------------------------------------------------
# Jobs (run in the pool's processes)
# --------------------------------------------------------------------------------------------


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of ``step``: the same in every process and every parallel form."""
    return L.batch(step, rows=BATCH, seed=100)


def _describe(model: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    from torch.distributed.tensor import DTensor

    return [(name, str(tuple(p.placements)) if isinstance(p, DTensor) else "plain",
             tuple((p.to_local() if isinstance(p, DTensor) else p).shape))
            for name, p in model.named_parameters()]


def train_job(rank: int, n: int, form: str, port: int, dtype_name: str = "float64") -> dict[str, Any]:
    """Train ``STEPS`` steps under ``form``; return losses, first-step grads, final params (full)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from examples.llama import parallel as par

    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = Llama(CFG).to(dtype).init_weights(SEED)
        pp = form.startswith("pp")
        dims = {"single": (1, 1), "fsdp4": (4, 1), "fsdp2tp2": (2, 2), "tp2": (1, 2),
                "pp2": (2, 1), "pp2tp2": (2, 2)}
        mesh = init_device_mesh("cpu", dims[form], mesh_dim_names=("pp", "tp") if pp else ("dp_shard", "tp"))
        stage = mesh["pp"].get_local_rank() if pp else 0
        if pp:
            pipeline_stage_module(model, stage, 2)
        par.parallelize(model, mesh, loss_parallel=not pp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        run = _pipeline_step(model, mesh, stage) if pp else _dp_step(model, mesh)
        losses, grads = [], {}
        for step in range(STEPS):
            opt.zero_grad()
            loss = run(*batch(step))
            if step == 0:
                grads = {name: L.full(p.grad) for name, p in model.named_parameters()}
            opt.step()
            losses.append(loss)
        params = {name: L.full(p) for name, p in model.named_parameters()}
        tp_rank = mesh["tp"].get_local_rank()
        keep = tp_rank == 0 and (pp or mesh["dp_shard"].get_local_rank() == 0)
        return {"losses": losses if keep and losses[0] is not None else None,
                "grads": grads if keep else {}, "params": params if keep else {},
                "placements": _describe(model) if rank == 0 else None}
    finally:
        dist.destroy_process_group()


def _dp_step(model: Llama, mesh: Any):
    import torch.distributed as dist

    from examples.llama import parallel as par

    dp = mesh["dp_shard"]
    rows = BATCH // dp.size()

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        lo = dp.get_local_rank() * rows
        x, y = x[lo:lo + rows], y[lo:lo + rows]
        logits = model(x)
        with par.loss_context(logits):
            loss = par.loss_fn(logits, y)
            loss.backward()
        # each dp rank's loss is the mean over its rows; the global batch's is their mean
        value = par.unwrap_loss(loss).detach().clone()
        dist.all_reduce(value, group=dp.get_group())
        return value.item() / dp.size()

    return step


def _pipeline_step(model: Llama, mesh: Any, stage: int):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from examples.llama import parallel as par

    pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    # 2 microbatches of 2 rows; the schedule divides the summed microbatch gradients by 2
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=par.loss_fn)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        if stage == 0:
            schedule.step(x)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean().item()

    return step


def precision_job(rank: int, n: int, port: int) -> dict[str, float]:
    """FSDP2 x TP2 in float32 (one backward) and bfloat16 (one forward) against one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from examples.llama import parallel as par

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        x, y = batch(0)
        ref = Llama(CFG).init_weights(SEED)
        ref_logits = ref(x)
        F.cross_entropy(ref_logits.flatten(0, 1), y.flatten(0, 1)).backward()

        model = par.parallelize(Llama(CFG).init_weights(SEED), mesh)
        rows = BATCH // 2
        lo = mesh["dp_shard"].get_local_rank() * rows
        logits = model(x[lo:lo + rows])
        with par.loss_context(logits):
            par.loss_fn(logits, y[lo:lo + rows]).backward()
        grad_err = max(((L.full(p.grad) - q.grad).abs().max() / q.grad.abs().max()).item()
                       for p, q in zip(model.parameters(), ref.parameters(), strict=True))

        bf16 = par.parallelize(Llama(CFG).to(torch.bfloat16).init_weights(SEED), mesh)
        with torch.no_grad():
            out = L.full(bf16(x[lo:lo + rows])).float()
        want = ref_logits.detach()[lo:lo + rows]
        return {"grad_err": grad_err, "bf16_dtype": str(bf16.output.weight.dtype),
                "bf16_finite": bool(out.isfinite().all()),
                "bf16_err": ((out - want).abs().max() / want.abs().max()).item()}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Multi-process tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(pool: Pool) -> dict[str, Any]:
    # through parallelize on a (1, 1) mesh, which must leave the plain model untouched
    (out,) = pool.run(train_job, 1, "single", free_port(), timeout=60)
    assert all(where == "plain" for _, where, _ in out["placements"])
    return out


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One view of a run: the losses from whoever has them, params/grads from every stage."""
    losses = [r["losses"] for r in results if r["losses"] is not None]
    assert len(losses) == 1, f"{len(losses)} ranks reported losses"
    grads, params = {}, {}
    for r in results:
        assert not set(r["params"]) & set(params), "two ranks reported the same parameter"
        grads.update(r["grads"])
        params.update(r["params"])
    return {"losses": losses[0], "grads": grads, "params": params, "placements": results[0]["placements"]}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


FORMS = [("fsdp4", 4), ("fsdp2tp2", 4), ("tp2", 2), ("pp2", 2), ("pp2tp2", 4)]


@pytest.mark.slow
@pytest.mark.parametrize(("form", "n"), FORMS, ids=[f for f, _ in FORMS])
def test_parallel_training_matches_one_process(pool: Pool, reference: dict[str, Any], form: str,
                                               n: int) -> None:
    got = _merge(pool.run(train_job, n, form, free_port(), timeout=90))
    want = reference
    assert sorted(got["params"]) == sorted(want["params"]), "parameter names differ from the plain model"
    # gradients before losses: a summed gradient shows up here by name, in the losses only
    # through Adam's eps
    for name, ref in want["grads"].items():
        err = _rel(got["grads"][name], ref)
        assert err <= 1e-10, f"first-step grad of {name}: rel err {err:.3g}"
    assert len(got["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= 1e-10 * abs(b), f"step {step}: loss {a!r} != {b!r}"
    for name, ref in want["params"].items():
        assert (got["params"][name] - ref).abs().max().item() <= 1e-10, f"{name} after {STEPS} steps"
    # the parameters really are distributed (not silently replicated); pp2 alone keeps plain ones
    assert all((where != "plain") == (form != "pp2") for _, where, _ in got["placements"])


@pytest.mark.slow
def test_fsdp2_tp2_placements(pool: Pool) -> None:
    """What FSDP2 x TP2 makes of each parameter at rank 0: the layout the resharding reads."""
    out = pool.run(train_job, 4, "fsdp2tp2", free_port(), timeout=90)[0]["placements"]
    by_name = {name: (where, shape) for name, where, shape in out}
    col = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert by_name["layers.0.attention.wq.weight"] == (col, (16, 64))
    assert by_name["layers.0.attention.wk.weight"] == (col, (8, 64))
    assert by_name["layers.0.feed_forward.w1.weight"] == (col, (32, 64))
    assert by_name["layers.0.attention.wo.weight"] == ("(Shard(dim=0), Shard(dim=1))", (32, 32))
    assert by_name["layers.0.attention_norm.weight"] == ("(Shard(dim=0), Replicate())", (32,))
    assert by_name["tok_embeddings.weight"] == (col, (64, 64))
    assert by_name["output.weight"] == (col, (64, 64))


@pytest.mark.slow
def test_float32_gradients_and_bfloat16_forward(pool: Pool) -> None:
    r = pool.run(precision_job, 4, free_port(), timeout=90)[0]
    # float32 through SUM-then-divide: the mean, to float32 rounding (a sum would be off by 2x)
    assert r["grad_err"] < 1e-4, r
    assert r["bf16_dtype"] == "torch.bfloat16" and r["bf16_finite"], r
    assert r["bf16_err"] < 5e-2, r


# --------------------------------------------------------------------------------------------
# One process: the model and the stage cutting
# --------------------------------------------------------------------------------------------


def test_stages_keep_the_full_models_names_and_values() -> None:
    cfg = LlamaConfig(n_layers=5)
    full = dict(Llama(cfg).init_weights(3).named_parameters())
    seen: list[str] = []
    for stage in range(2):
        part = dict(pipeline_stage_module(Llama(cfg), stage, 2).init_weights(3).named_parameters())
        seen += part
        for name, p in part.items():
            assert torch.equal(p, full[name]), name
    assert sorted(seen) == sorted(full), "stages must split the names exactly"
    assert [stage_layers(5, s, 2) for s in range(2)] == [[0, 1, 2], [3, 4]]


def test_config_presets_and_validation() -> None:
    assert CFG.num_params() == sum(p.numel() for p in Llama(CFG).parameters())
    big = LlamaConfig.bench_1g()
    assert big.num_params() * 4 * 3 >= 2**30, "params + 2 Adam moments in fp32 must reach 1 GiB"
    with torch.device("meta"):
        assert sum(p.numel() for p in Llama(big).parameters()) == big.num_params()
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)


def test_tied_embeddings_share_one_parameter() -> None:
    model = Llama(LlamaConfig(tie_embeddings=True)).init_weights(0)
    assert model.output.weight is model.tok_embeddings.weight
    x, _ = batch(0)
    assert model(x).shape == (BATCH, CFG.max_seq_len, CFG.vocab)
    with pytest.raises(ValueError, match="tie_embeddings"):
        pipeline_stage_module(model, 0, 2)
