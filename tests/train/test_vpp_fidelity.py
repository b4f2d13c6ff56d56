"""Fidelity of the interleaved pipeline (``vpp > 1``): every layout follows the single process.

gloo processes run each layout for ``STEPS`` steps on the same model, seed and data; rank 0
also runs the single-process reference (tp1.pp1.dp1) and compares both the losses and the
full training state after the last step (weights and Adam moments, gathered from every
rank with replicas checked bitwise equal). In float64 only the order of floating-point
reductions differs: losses agree to 1e-9 relative and every state tensor to 1e-9 in norm;
with tp1.dp1 nothing is reduced differently and the state is bitwise the reference's.

Models: 7 layers (8 slots at pp2.vpp2: one virtual padding layer in the last chunk) and
8 layers (no padding at pp2.vpp2; pp4.vpp2 puts one layer per chunk).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from elastic.model import Layout, ModelSpec
from elastic.train.engine import TrainEngine
from tests.train._mp import FIDELITY_TOL, MODELS, gather_full_state, make_cfg, run_workers

VPP_MODELS = {
    "tiny7": ModelSpec(name="tiny7", layers=7, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16),
    "tiny8": ModelSpec(name="tiny8", layers=8, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16),
}
for _name, _m in VPP_MODELS.items():  # make_cfg(model=...) names them; spawned workers import this module
    MODELS.setdefault(_name, _m)

STEPS = 10
TWO = [  # (layout, config)
    ("tp1.pp2.dp1.vpp2", {"model": "tiny7", "dtype": "float64"}),
    ("tp1.pp2.dp1.vpp2", {"model": "tiny8", "dtype": "float64"}),
    ("tp1.pp2.dp1.vpp2", {"model": "tiny7", "dtype": "float32"}),
]
FOUR = [
    ("tp2.pp2.dp1.vpp2", {"model": "tiny7", "dtype": "float64"}),
    # grad_accum 2 = pp: every rank's order is all warm-up, then all cool-down
    ("tp1.pp2.dp2.vpp2.z1", {"model": "tiny7", "dtype": "float64"}),
    ("tp1.pp4.dp1.vpp2", {"model": "tiny8", "dtype": "float64", "global_batch": 8}),
]


def _key(layout: str, kw: dict[str, Any]) -> str:
    return f"{layout}/{sorted(kw.items())}"


def run_and_compare(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]], steps: int) -> dict[str, Any]:
    """Per run: this rank's losses; on rank 0 also the reference's losses and the state comparison."""
    out: dict[str, Any] = {}
    for layout_text, kw in runs:
        cfg = make_cfg(**kw)
        eng = TrainEngine(cfg, Layout.parse(layout_text), rank)
        res: dict[str, Any] = {"losses": [eng.train_step(s).loss for s in range(steps)]}
        full = gather_full_state(eng.state(), eng.spec, rank)  # asserts replicas stayed bitwise equal
        eng.close()
        if rank == 0:
            ref = TrainEngine(cfg, Layout(1, 1, 1), 0)
            res["reference"] = [ref.train_step(s).loss for s in range(steps)]
            want = ref.state()
            assert set(want) == set(full)
            res["state_rel"] = max(((full[k] - want[k]).norm() / want[k].norm().clamp_min(1e-300)).item()
                                   for k in want)
            res["state_bitwise"] = all(torch.equal(full[k], want[k]) for k in want)
        out[_key(layout_text, kw)] = res
    return out


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_workers(run_and_compare, 2, TWO, STEPS, timeout=240)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_workers(run_and_compare, 4, FOUR, STEPS, timeout=300)


def _check(results: list[dict], layout: str, kw: dict[str, Any]) -> None:
    key = _key(layout, kw)
    head = results[0][key]
    ref, tol = head["reference"], FIDELITY_TOL[kw["dtype"]]
    for rank, res in enumerate(results):
        for step, (a, b) in enumerate(zip(res[key]["losses"], ref, strict=True)):
            assert math.isclose(a, b, rel_tol=tol, abs_tol=0), f"rank {rank} step {step}: {a!r} vs {b!r}"
    assert ref[-1] < ref[0] - 0.3, f"loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"
    assert head["state_rel"] <= tol, f"state differs from the single process by {head['state_rel']:.3g}"
    lay = Layout.parse(layout)
    if lay.tp == 1 and lay.dp == 1 and kw["dtype"] == "float64":
        assert head["state_bitwise"], "a pipeline alone changes no reduction: state must be bitwise the reference's"


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw['model']}-{kw['dtype']}" for lay, kw in TWO])
def test_pp2_vpp2_matches_single_process(two: list[dict], layout: str, kw: dict[str, Any]) -> None:
    _check(two, layout, kw)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw['model']}" for lay, kw in FOUR])
def test_vpp2_with_tp_dp_or_pp4_matches_single_process(four: list[dict], layout: str, kw: dict[str, Any]) -> None:
    _check(four, layout, kw)
