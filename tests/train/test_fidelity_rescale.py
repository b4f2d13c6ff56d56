"""Fidelity (b): a job rescaled in place follows the never-rescaled loss curve.

Four gloo processes (workers w0..w3) live throughout. The job runs 5 steps on each of
``tp2.pp2.dp1 -> tp1.pp2.dp2 -> tp2.pp1.dp1 -> tp1.pp1.dp4``: the third layout has two
leavers, the fourth two joiners that start with no state. At every change all members of
old union new plan (``elastic.reshard.plan.plan_reshard``) and execute
(``elastic.reshard.execute``) the reshard, then build the new engine from the tensors they
received. Checks: right after each reshard the full state gathered from all ranks equals
the one gathered before it bit for bit, and every step's loss matches the single-process
run (float64: 1e-9 relative; float32: 1e-4).

A second sequence moves ZeRO-1-sharded optimizer state and tied embeddings (held by the
first and the last stage) of the GPT-2-flavoured model:
``tp1.pp2.dp2.z1 -> tp2.pp2.dp1 -> tp1.pp1.dp2.z1 -> tp1.pp1.dp4.z1``.
"""

from __future__ import annotations

import math

import pytest

from tests.train._mp import make_cfg, reference_losses, run_rescale_each, run_workers

GENERATIONS = [
    ("tp2.pp2.dp1", ["w0", "w1", "w2", "w3"]),
    ("tp1.pp2.dp2", ["w0", "w1", "w2", "w3"]),
    ("tp2.pp1.dp1", ["w0", "w1"]),  # w2, w3 leave
    ("tp1.pp1.dp4", ["w0", "w1", "w2", "w3"]),  # w2, w3 join empty-handed
]
STEPS_PER_GEN = 5
ZERO_TIED = [
    ("tp1.pp2.dp2.z1", ["w0", "w1", "w2", "w3"]),
    ("tp2.pp2.dp1", ["w3", "w2", "w1", "w0"]),
    ("tp1.pp1.dp2.z1", ["w1", "w2"]),  # w0, w3 leave
    ("tp1.pp1.dp4.z1", ["w0", "w1", "w2", "w3"]),  # w0, w3 join empty-handed
]
TOL = {"float64": 1e-9, "float32": 1e-4}
SCENARIOS = {
    "tiny-float64": (GENERATIONS, {"dtype": "float64"}),
    "tiny-float32": (GENERATIONS, {"dtype": "float32"}),
    "zero1-tied-float64": (ZERO_TIED, {"dtype": "float64", "model": "tiny-gpt2"}),
}


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    """Per worker, per scenario: the run's losses and reshard checks (one spawn of 4 processes)."""
    return run_workers(run_rescale_each, 4, list(SCENARIOS.values()), STEPS_PER_GEN, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rescaled_run_matches_never_rescaled(runs: list[list[dict]], scenario: str) -> None:
    generations, cfg_kw = SCENARIOS[scenario]
    dtype = cfg_kw["dtype"]
    results = [per_worker[list(SCENARIOS).index(scenario)] for per_worker in runs]
    ref = reference_losses(make_cfg(**cfg_kw), STEPS_PER_GEN * len(generations))
    # 1. each reshard preserved the state bit for bit, as seen from every worker
    for res in results:
        assert [r["bitwise_equal"] for r in res["reshards"]] == [True] * (len(generations) - 1)
    # 2. every member's loss at every step follows the never-rescaled run
    for step, want in enumerate(ref):
        gen = step // STEPS_PER_GEN
        members = {int(w[1:]) for w in generations[gen][1]}
        for rank, res in enumerate(results):
            got = res["losses"][step]
            if rank in members:
                assert math.isclose(got, want, rel_tol=TOL[dtype], abs_tol=0), f"w{rank} step {step}: {got} vs {want}"
            else:
                assert got is None
    # 3. the reshards moved bytes (the plan is not trivially empty)
    assert all(r["bytes_planned"] > 0 for r in results[0]["reshards"])
