"""Single-process tests of the trainer core: optimizer, data, config, model shapes, state adoption.

Multi-rank behaviour (TP/PP/DP/ZeRO-1 and resharding) is tested in test_fidelity*.py with
real gloo processes; everything here runs in the test process without torch.distributed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from elastic.model import MODEL_PRESETS, Layout, MLASpec, ModelSpec, SpecError
from elastic.reshard.spec import MIXED_KINDS, box_shape, sharding_spec
from elastic.train import TrainConfig, TrainEngine
from elastic.train.data import SyntheticData
from elastic.train.engine import init_global_tensor
from elastic.train.groups import Comm
from elastic.train.model import GPTStage
from elastic.train.optim import AdamHyper, adam_
from elastic.train.tp import vocab_parallel_cross_entropy
from tests.train._mp import MODELS

TINY = MODEL_PRESETS["tiny"]
ONE = Layout(1, 1, 1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: one intra-op thread is fastest, and on a busy 2-core box far faster than
    two threads spinning against each other (a 30-step run went from 2 s to 70 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- optimizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_is_bitwise_torch_adam(weight_decay: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    ref = torch.nn.Parameter(torch.randn(7, 5, generator=g, dtype=dtype))
    ours = ref.detach().clone()
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    hp = AdamHyper(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = torch.optim.Adam([ref], lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=weight_decay, foreach=False)
    for step in range(6):
        grad = torch.randn(7, 5, generator=g, dtype=dtype)
        ref.grad = grad.clone()
        opt.step()
        adam_(ours, grad, m, v, step + 1, hp)
        assert torch.equal(ours, ref.detach()), f"step {step}"
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])


# ---- data -------------------------------------------------------------------------------------


def test_data_is_a_pure_function_of_step_and_sample() -> None:
    a, b = SyntheticData(256, 32, seed=3), SyntheticData(256, 32, seed=3)
    x, y = a.batch(step=4, start=6, count=3)
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.long
    # the same sample however it is batched, in any instance
    assert torch.equal(x[1], b.batch(4, 7, 1)[0][0])
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert not torch.equal(a.sample(4, 6), a.sample(5, 6))
    assert not torch.equal(a.sample(4, 6), SyntheticData(256, 32, seed=4).sample(4, 6))


def test_data_follows_its_rule_with_the_given_noise() -> None:
    d = SyntheticData(256, 32, seed=0, noise=0.1)
    seqs = torch.stack([d.sample(0, i) for i in range(200)])
    follows = (d.perm[seqs[:, :-1]] == seqs[:, 1:]).float().mean().item()
    assert 0.87 < follows < 0.93  # 0.9 + 0.1/256 expected
    assert 0.8 < d.entropy_floor() < 0.9 < math.log(256)


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "global_batch,micro_batch,layout,expect",
    [
        (8, 1, "tp1.pp1.dp1", 8),
        (8, 1, "tp2.pp2.dp2", 4),
        (8, 2, "tp1.pp1.dp4", 1),
        (6, 2, "tp1.pp1.dp2", "dp*micro_batch=2*2=4"),
        (8, 1, "tp1.pp1.dp3", "dp*micro_batch=3*1=3"),
    ],
)
def test_grad_accum_keeps_the_global_batch(global_batch: int, micro_batch: int, layout: str, expect: int | str) -> None:
    cfg = TrainConfig(TINY, global_batch=global_batch, micro_batch=micro_batch)
    if isinstance(expect, int):
        assert cfg.grad_accum(Layout.parse(layout)) == expect
    else:
        with pytest.raises(SpecError, match=expect.replace("*", r"\*")):
            cfg.grad_accum(Layout.parse(layout))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: TrainConfig(TINY.model_copy(update={"name": "mla", "mla": MLASpec(
            q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)}),
                             global_batch=4), "multi-head latent attention"),
        (lambda: TrainConfig(TINY, global_batch=4, moe_balance=-1.0), "moe_balance"),
        (lambda: TrainConfig(TINY, global_batch=0), "global_batch=0"),
        (lambda: TrainConfig(TINY, global_batch=4, dtype=torch.float16), "dtype"),
        (lambda: TrainEngine(TrainConfig(TINY, global_batch=3), Layout(1, 2, 1, vpp=2), 0), "multiple of pp=2"),
        (lambda: TrainEngine(TrainConfig(TINY, global_batch=4), Layout(1, 1, 2, ep=2), 0), "has no experts"),
        (lambda: TrainEngine(TrainConfig(TINY, global_batch=4), Layout(1, 2, 1), 0), "not initialised"),
        (lambda: TrainEngine(TrainConfig(TINY, global_batch=4), Layout(4, 1, 1), 0), "kv_heads=2"),
    ],
)
def test_bad_input_is_refused_with_the_fix(make, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        make()


# ---- model shapes against the spec, every rank of several layouts ---------------------------------


class _NoNetwork:
    """Stands in for a process group where only shapes are built (GPTStage never calls it here)."""


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2"])
@pytest.mark.parametrize("layout", ["tp2.pp2.dp2", "tp2.pp4.dp1.z1", "tp1.pp3.dp1", "tp2.pp1.dp1"])
def test_stage_parameters_are_the_spec_pieces(model: str, layout: str) -> None:
    spec = sharding_spec(MODELS[model], Layout.parse(layout))
    for rank in range(spec.layout.world_size):
        tp_rank = spec.layout.coords(rank)[0]
        tp = Comm(tuple(range(spec.layout.tp)), tp_rank, _NoNetwork() if spec.layout.tp > 1 else None)
        stage = GPTStage(spec, rank, tp, torch.float32, "cpu")  # raises if names or shapes differ
        params = dict(stage.named_parameters())
        assert {n for (n, k) in spec.rank_pieces(rank) if k == "param"} == set(params)


# ---- initialisation and state --------------------------------------------------------------------


def test_initial_weights_are_global_and_layout_independent() -> None:
    cfg = TrainConfig(TINY, global_batch=4)
    a = init_global_tensor("layers.1.attn.q.weight", "param", (64, 64), cfg)
    assert torch.equal(a, init_global_tensor("layers.1.attn.q.weight", "param", (64, 64), cfg))
    assert not torch.equal(a, init_global_tensor("layers.2.attn.q.weight", "param", (64, 64), cfg))
    assert 0.015 < a.std().item() < 0.025
    assert torch.equal(init_global_tensor("final_norm.weight", "param", (64,), cfg), torch.ones(64))
    assert torch.equal(init_global_tensor("embed.weight", "exp_avg", (4, 4), cfg), torch.zeros(4, 4))


def test_state_is_the_spec_and_its_bytes() -> None:
    cfg = TrainConfig(TINY, global_batch=2)
    eng = TrainEngine(cfg, ONE, 0)
    pieces = eng.spec.rank_pieces(0)
    state = eng.state()
    assert list(state) == list(pieces)
    assert all(tuple(state[k].shape) == box_shape(b) for k, b in pieces.items())
    assert eng.state_bytes() == eng.spec.bytes_per_rank(0, 4) == 4 * 3 * TINY.total_params()
    # live tensors: what the optimizer changes shows up in the dict already handed out
    before = state[("layers.0.attn.q.weight", "param")].clone()
    eng.train_step(0)
    assert not torch.equal(before, state[("layers.0.attn.q.weight", "param")])
    assert state[("layers.0.attn.q.weight", "exp_avg")].abs().sum() > 0


def test_adopted_state_is_used_in_place_and_continues_the_run() -> None:
    cfg = TrainConfig(TINY, global_batch=2, dtype=torch.float64, lr=3e-3)
    a = TrainEngine(cfg, ONE, 0)
    for s in range(3):
        a.train_step(s)
    given = {k: t.clone() for k, t in a.state().items()}
    b = TrainEngine(cfg, ONE, 0, state=given)
    assert all(b.state()[k].data_ptr() == t.data_ptr() for k, t in given.items())
    assert a.train_step(3).loss == b.train_step(3).loss
    assert all(torch.equal(a.state()[k], b.state()[k]) for k in given)


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda st: st.pop(("layers.0.attn.q.weight", "exp_avg")), "missing"),
        (lambda st: st.__setitem__(("bogus.weight", "param"), torch.zeros(1)), "unexpected"),
        (lambda st: st.__setitem__(("final_norm.weight", "param"), torch.ones(63)), "shape"),
        (lambda st: st.__setitem__(("final_norm.weight", "param"), torch.ones(64, dtype=torch.float64)), "dtype"),
    ],
)
def test_mismatched_state_is_refused(corrupt, match: str) -> None:
    cfg = TrainConfig(TINY, global_batch=2)
    st = TrainEngine(cfg, ONE, 0).state()
    corrupt(st)
    with pytest.raises(SpecError, match=match):
        TrainEngine(cfg, ONE, 0, state=st)


# ---- learning ----------------------------------------------------------------------------------


def test_loss_falls_on_tiny() -> None:
    eng = TrainEngine(TrainConfig(TINY, global_batch=8, lr=3e-3), ONE, 0)
    losses = [eng.train_step(s).loss for s in range(30)]
    assert abs(losses[0] - math.log(TINY.vocab)) < 0.1  # starts at chance
    assert losses[-1] < 0.7 * losses[0], losses


def test_bf16_keeps_an_fp32_master() -> None:
    cfg = TrainConfig(TINY, global_batch=4, lr=3e-3, dtype=torch.bfloat16)
    eng = TrainEngine(cfg, ONE, 0)
    assert cfg.kinds == MIXED_KINDS
    st = eng.state()
    assert st[("embed.weight", "param")].dtype == torch.bfloat16
    assert st[("embed.weight", "master")].dtype == torch.float32
    losses = [eng.train_step(s).loss for s in range(8)]
    assert losses[-1] < losses[0]
    assert torch.equal(st[("embed.weight", "param")], st[("embed.weight", "master")].to(torch.bfloat16))
    assert eng.state_bytes() == sum(t.numel() * t.element_size() for t in st.values())


# ---- tensor-parallel pieces at tp=1 reduce to the plain functions ----------------------------------


def test_vocab_parallel_cross_entropy_is_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(11, (6,), generator=g)
    ours = vocab_parallel_cross_entropy(logits, target, 0, Comm.solo(0))
    ref = F.cross_entropy(logits, target, reduction="none")
    assert torch.allclose(ours, ref, rtol=1e-12, atol=0)
    (g1,) = torch.autograd.grad(ours.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(g1, g2, rtol=1e-12, atol=1e-15)


def test_models_module_exposes_a_gelu_tied_variant() -> None:
    m: ModelSpec = MODELS["tiny-gpt2"]
    assert m.mlp == "gelu" and m.tie_embeddings and m.has_bias


def test_micro_batch_cap_changes_speed_not_the_maths() -> None:
    """A per-layout micro-batch (fewer, larger micro-batches) keeps the samples and the loss."""
    import torch.distributed as dist

    from elastic.model import MODEL_PRESETS, Layout
    from elastic.train.engine import TrainConfig, TrainEngine

    base = TrainConfig(model=MODEL_PRESETS["tiny"], global_batch=12, micro_batch=1, dtype=torch.float64)
    capped = TrainConfig(model=MODEL_PRESETS["tiny"], global_batch=12, micro_batch=1, dtype=torch.float64,
                         micro_batch_cap=8)
    L = Layout(1, 1, 1)
    assert capped.micro_batch_for(L) == 6 and capped.grad_accum(L) == 2
    assert capped.micro_batch_for(Layout(1, 2, 3)) == 2  # 4 samples per replica, >= pp=2 micro-batches
    assert capped.micro_batch_for(Layout(1, 1, 5)) == 1  # 12 % 5: falls back, grad_accum then refuses
    losses = {}
    for name, cfg in (("base", base), ("capped", capped)):
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            eng = TrainEngine(cfg, L, 0)
            losses[name] = [eng.train_step(s).loss for s in range(4)]
            eng.close()
        finally:
            dist.destroy_process_group()
    for a, b in zip(losses["base"], losses["capped"], strict=True):
        assert abs(a - b) <= 1e-9 * abs(a)
