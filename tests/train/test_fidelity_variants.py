"""Fidelity (a), variants: other model shapes and batch splits follow the single-process curve.

Same checks as test_fidelity.py, 12 steps each, for: a GPT-2-flavoured model (gelu MLP,
biases, LayerNorm, tied embeddings across the first and last stage, vocab and ffn split
unevenly over tp2, a virtual padding slot at pp2), a micro-batch of 2 (one micro-batch
per replica: the pipeline never fills), 8 micro-batches through 4 stages, and ZeRO-1 with
weight decay. All in float64 (1e-9 relative).
"""

from __future__ import annotations

import pytest

from tests.train._mp import assert_matches_reference, assert_state_bytes_equal_spec, run_layouts, run_workers

STEPS = 12
DROP = {"tiny": 0.3, "tiny-gpt2": 0.05}  # nats the loss must fall over the run

RUNS = [
    ("tp2.pp2.dp1", {"dtype": "float64", "model": "tiny-gpt2"}),
    ("tp1.pp2.dp2.z1", {"dtype": "float64", "model": "tiny-gpt2"}),
    ("tp1.pp2.dp2", {"dtype": "float64", "micro_batch": 2}),
    ("tp1.pp4.dp1", {"dtype": "float64", "global_batch": 8}),
    ("tp2.pp1.dp2.z1", {"dtype": "float64", "weight_decay": 0.1}),
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(run_layouts, 4, RUNS, STEPS, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", RUNS, ids=[f"{lay}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for lay, kw in RUNS])
def test_layout_matches_single_process(results: list[dict], layout: str, kw: dict) -> None:
    assert_matches_reference(results, layout, kw, STEPS, DROP)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kw", RUNS, ids=[f"{lay}-{kw['dtype']}" for lay, kw in RUNS])
def test_state_bytes_equal_spec(results: list[dict], layout: str, kw: dict) -> None:
    assert_state_bytes_equal_spec(results, layout, kw)
