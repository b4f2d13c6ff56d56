"""Fidelity (a): every 3D-parallel layout follows the single-process loss curve.

Four gloo processes run each layout for 20 steps on the same model, seed and data; rank 0
also runs the single-process reference (tp1.pp1.dp1). In float64 only the order of
floating-point reductions differs, so the losses agree to 1e-9 relative; in float32 to
1e-4. Every run also ends with all ranks' state gathered and replicas checked bitwise
equal, and with each rank's state bytes equal to the spec's.
"""

from __future__ import annotations

import pytest

from tests.train._mp import assert_matches_reference, assert_state_bytes_equal_spec, run_layouts, run_workers

STEPS = 20
DROP = {"tiny": 0.5, "tiny-gpt2": 0.1}  # nats the loss must fall over the run

RUNS = [
    # (layout, config): tiny = swiglu, RMSNorm, GQA (4 heads, 2 kv heads), untied embeddings
    ("tp2.pp2.dp1", {"dtype": "float64"}),
    ("tp1.pp2.dp2", {"dtype": "float64"}),
    ("tp2.pp1.dp2", {"dtype": "float64"}),
    ("tp1.pp2.dp2.z1", {"dtype": "float64"}),
    ("tp2.pp2.dp1", {"dtype": "float32"}),
    ("tp1.pp2.dp2", {"dtype": "float32"}),
    ("tp2.pp1.dp2.z1", {"dtype": "float32"}),
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
