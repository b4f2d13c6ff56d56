"""In-place rescales of the mixture-of-experts trainer that change ``ep`` follow the never-rescaled curve.

Four gloo processes (workers w0..w3) live throughout; at every change all members of old
union new plan (``elastic.reshard.plan.plan_reshard``) and execute (``elastic.reshard.execute``)
the reshard and build the new engine from the tensors they received, as
test_fidelity_rescale.py does for dense models. The experts move by the sharding spec's own
layout (expert rank ``dp_rank % ep``): a change of ``ep`` or ``dp`` moves experts between dp
ranks, a change of ``pp`` whole MoE layers between stages. Checks: the full state gathered
right after each reshard equals the one gathered before it bit for bit, every step's loss
matches the single-process run (float64, 1e-9 relative), and every reshard moved exactly the
planner's lower bound (bytes the new layout needs minus those already local), more than zero.
Two steps a generation: the first runs on the parameters received, the second on their update by
the optimizer state received; the state itself is compared whole, bit for bit, at every reshard.

* ``tp1.pp1.dp2.ep2 -> tp1.pp1.dp4.ep4 (two join empty-handed) -> tp1.pp2.dp2.ep2 (experts
  and layers change rank) -> tp1.pp1.dp2 (ep1: two leave, the experts gather) -> tp2.pp1.dp2.ep2
  (two join; TP inside the experts)``.
* ZeRO-1 (the experts' optimizer slices shared among their own replicas): ``tp1.pp1.dp4.ep2.z1
  -> tp1.pp1.dp4.ep4.z1 (ranks reversed) -> tp1.pp1.dp2.z1``.
"""

from __future__ import annotations

import math

import pytest

from elastic.model import Layout
from tests.train._mp import (
    FIDELITY_TOL,
    check_rescale_curve,
    make_cfg,
    reference_losses,
    run_rescale_each,
    run_workers,
)

ALL = ["w0", "w1", "w2", "w3"]
EP = [
    ("tp1.pp1.dp2.ep2", ["w0", "w1"]),
    ("tp1.pp1.dp4.ep4", ALL),  # w2, w3 join empty-handed
    ("tp1.pp2.dp2.ep2", ALL),
    ("tp1.pp1.dp2", ["w1", "w2"]),  # w0, w3 leave
    ("tp2.pp1.dp2.ep2", ALL),  # w0, w3 join empty-handed
]
ZERO = [
    ("tp1.pp1.dp4.ep2.z1", ALL),
    ("tp1.pp1.dp4.ep4.z1", ["w3", "w2", "w1", "w0"]),
    ("tp1.pp1.dp2.z1", ["w0", "w2"]),  # w1, w3 leave
]
STEPS_PER_GEN = 2
SCENARIOS = {
    "ep-float64": (EP, {"dtype": "float64", "model": "tiny-moe"}),
    "ep-zero1-float64": (ZERO, {"dtype": "float64", "model": "tiny-moe"}),
}


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return run_workers(run_rescale_each, 4, list(SCENARIOS.values()), STEPS_PER_GEN, timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ep_rescales_follow_the_never_rescaled_curve(runs: list[list[dict]], scenario: str) -> None:
    check_rescale_curve(runs, SCENARIOS, scenario, STEPS_PER_GEN, lower_bound=True)


def test_a_moe_job_rescales_between_ep_layouts_through_its_coordinator(tmp_path) -> None:
    """The same trainer as a job: real worker processes started by the launcher, the coordinator's
    directives; ``ep2 -> ep4 (two join) -> ep1 (two leave)`` on the never-rescaled curve."""
    from elastic.train.launch import LaunchOptions, ProcessJobHandle

    cfg = make_cfg("tiny-moe", "float64", global_batch=8, micro_batch=1)
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, verify_reshard=True)
    h = ProcessJobHandle("moe", cfg, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2.ep2", ["w0", "w1"], timeout=180)
        h.wait_step(1, timeout=120)
        for layout, workers in (("tp1.pp1.dp4.ep4", ALL), ("tp1.pp1.dp2", ["w1", "w2"])):
            res = h.rescale(layout, workers, timeout=240)
            assert res.record.ok and res.bytes_moved == res.lower_bound_bytes > 0, res
            h.wait_step(h.status().step + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    history = h.history()
    assert [r.step for r in history] == list(range(len(history))), "a step was lost or repeated"
    assert {r.layout for r in history} == set(map(Layout.parse, ["tp1.pp1.dp2.ep2", "tp1.pp1.dp4.ep4", "tp1.pp1.dp2"]))
    ref = reference_losses(cfg, len(history))
    for r, want in zip(history, ref, strict=True):
        assert math.isclose(r.loss, want, rel_tol=FIDELITY_TOL["float64"]), f"step {r.step} ({r.layout}): {r.loss} vs {want}"
