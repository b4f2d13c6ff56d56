"""In-place rescales to, from and between interleaved pipelines follow the never-rescaled curve.

Four gloo processes (workers w0..w3) live throughout; at every change all members of old
union new plan (``elastic.reshard.plan.plan_reshard``) and execute (``elastic.reshard.execute``)
the reshard and build the new engine from the tensors they received, as
test_fidelity_rescale.py does for tp/pp/dp. A change of ``vpp`` alone moves layers between
pipeline ranks (at pp2 with 7 layers, rank 0 holds layers 0-3 at vpp1 but 0, 1, 4, 5 at
vpp2). Checks: the full state gathered right after each reshard equals the one gathered
before it bit for bit, and every step's loss matches the single-process run (float64,
1e-9 relative).

* 7 layers (a virtual padding layer at vpp2): ``tp1.pp2.dp2.vpp2 -> tp1.pp2.dp2 (vpp1) ->
  tp1.pp2.dp2.vpp2 (ranks reversed) -> tp1.pp1.dp2 (two leave) -> tp2.pp2.dp1.vpp2 (two join
  empty-handed)``.
* 8 layers: ``tp1.pp2.dp1.vpp2 -> tp1.pp2.dp1.vpp4 (on the other two workers) -> tp1.pp1.dp2 ->
  tp1.pp4.dp1.vpp2``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.train._mp import (
    check_rescale_curve,
    run_rescale_each,
    run_workers,
)
from tests.train.test_vpp_fidelity import VPP_MODELS

assert VPP_MODELS  # registered with make_cfg on import, here and in the spawned workers

ALL = ["w0", "w1", "w2", "w3"]
SEVEN = [
    ("tp1.pp2.dp2.vpp2", ALL),
    ("tp1.pp2.dp2", ALL),
    ("tp1.pp2.dp2.vpp2", ["w3", "w2", "w1", "w0"]),
    ("tp1.pp1.dp2", ["w1", "w2"]),  # w0, w3 leave
    ("tp2.pp2.dp1.vpp2", ALL),  # w0, w3 join empty-handed
]
EIGHT = [
    ("tp1.pp2.dp1.vpp2", ["w0", "w1"]),
    ("tp1.pp2.dp1.vpp4", ["w2", "w3"]),  # every tensor moves to workers that held nothing
    ("tp1.pp1.dp2", ["w0", "w1"]),  # every change's old and new members together are all four workers
    ("tp1.pp4.dp1.vpp2", ALL),
]
STEPS_PER_GEN = 4
SCENARIOS = {
    "tiny7-float64": (SEVEN, {"dtype": "float64", "model": "tiny7"}),
    "tiny8-float64": (EIGHT, {"dtype": "float64", "model": "tiny8"}),
}


def rescale_all(rank: int, world: int, scenarios: list[Any], steps_per_gen: int) -> list[dict[str, Any]]:
    # a function of this module, so the spawned workers import it (and register the models)
    return run_rescale_each(rank, world, scenarios, steps_per_gen)


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return run_workers(rescale_all, 4, list(SCENARIOS.values()), STEPS_PER_GEN, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_vpp_rescales_follow_the_never_rescaled_curve(runs: list[list[dict]], scenario: str) -> None:
    check_rescale_curve(runs, SCENARIOS, scenario, STEPS_PER_GEN, lower_bound=False)
