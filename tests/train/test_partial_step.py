"""A shrink that gives up the step in progress keeps its work: the new layout finishes the step from it.

Real multi-process gloo engines: a ``tp1.pp1.dp3`` job gives step 2 up at micro-batch 1 of 2 (every
rank agrees through the give-up check), keeps the work of that micro-batch (``PartialStep``), and a
``tp1.pp1.dp2`` engine built on two of its ranks' states finishes step 2 from it: the remaining six
samples split 3 + 3, in micro-batches of 2 and 1 (uneven), and one of the two ranks adds the kept
work while the other is given only what a grow's joiner knows. Losses and weights then match a
single process that never rescaled, to float64 round-off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.model import Layout, SpecError
from elastic.train.engine import PartialStep, TrainEngine
from elastic.train.groups import StepGivenUp
from tests.train import _mp

pytestmark = pytest.mark.timeout(300)

# dp3: 4 samples a replica in 2 micro-batches of 2; dp2: 6 a replica in 3 of 2
CFG = replace(_mp.make_cfg(global_batch=12), micro_batch_cap=2)
STEPS = 4
GIVE_UP = 2


def _shrink_keeping_work(rank: int, world: int) -> dict[str, Any]:
    old = TrainEngine(CFG, Layout.parse("tp1.pp1.dp3"), rank)
    old.give_up_checks = old.keep_given_up = True
    losses = [old.train_step(s).loss for s in range(GIVE_UP)]
    forward = old._forward_step

    def forward_asking_at_micro_1(step: int, micro: int, x: Any, out: list[Any]) -> Any:
        if rank == 2 and step == GIVE_UP and micro == 1:
            old.give_up(step)  # one rank asks; the check's MAX makes every rank give up here
        return forward(step, micro, x, out)

    old._forward_step = forward_asking_at_micro_1  # type: ignore[method-assign]
    with pytest.raises(StepGivenUp) as given_up:
        old.train_step(GIVE_UP)
    carry = given_up.value.carry
    assert isinstance(carry, PartialStep) and (carry.step, carry.micro) == (GIVE_UP, 1)
    assert len(carry.remaining()) == 6
    state = old.state()
    old.close()
    pair = dist.new_group([0, 1])  # every rank of the default group enters it
    if rank == 2:
        return {"left": True}
    new = TrainEngine(CFG, Layout.parse("tp1.pp1.dp2"), rank, state=state, pg=pair)
    new.give_up_checks = new.keep_given_up = True
    # one rank per TP coordinate adds the kept work (the DP sum hands it on); the other is given only
    # what a joiner knows, which step and where it was given up, and adds nothing
    new.resume_partial(carry if rank == 0 else replace(carry, grads=None, loss_sum=0.0), contribute=rank == 0)
    finished = new.train_step(GIVE_UP)
    losses.append(finished.loss)
    losses += [new.train_step(s).loss for s in range(GIVE_UP + 1, STEPS)]
    out = {"losses": losses, "kept": finished.extra.get("kept_micro_batches"),
           "weights": {n: p.detach().numpy().copy() for n, p in new.params.items()}}
    new.close()
    return out


@pytest.mark.slow
def test_a_dp_shrink_finishes_the_given_up_step_from_its_kept_work_on_the_reference_curve() -> None:
    results = _mp.run_workers(_shrink_keeping_work, 3)
    assert results[2] == {"left": True}
    ref = TrainEngine(CFG, Layout(1, 1, 1), 0)
    want = [ref.train_step(s).loss for s in range(STEPS)]
    for r in results[:2]:
        assert r["kept"] == 1.0
        assert r["losses"] == pytest.approx(want, rel=1e-12, abs=1e-12)
        for name, p in ref.params.items():
            torch.testing.assert_close(torch.from_numpy(r["weights"][name]), p.detach(), rtol=1e-10, atol=1e-12, msg=name)


def test_remaining_samples_are_the_ones_not_computed_replica_major() -> None:
    carry = PartialStep(step=5, micro=1, dp=3, grad_accum=2, micro_batch=2, grads={}, loss_sum=0.0)
    assert carry.remaining() == [2, 3, 6, 7, 10, 11]
    assert PartialStep(5, 0, 2, 2, 1, {}, 0.0).remaining() == [0, 1, 2, 3]


def test_a_carry_that_does_not_fit_the_layout_is_refused_with_the_reason() -> None:
    eng = TrainEngine(CFG, Layout(1, 1, 1), 0)
    grads = {n: torch.zeros_like(p) for n, p in eng.params.items()}
    ok = PartialStep(0, 1, 3, 2, 2, grads, 0.0)
    eng.resume_partial(ok)  # fits: accepted
    name = next(iter(grads))
    with pytest.raises(SpecError, match="missing"):
        eng.resume_partial(replace(ok, grads={n: g for n, g in grads.items() if n != name}))
    with pytest.raises(SpecError, match="shard it differently"):
        eng.resume_partial(replace(ok, grads={**grads, name: torch.zeros(3)}))
    with pytest.raises(SpecError, match="not the global batch"):
        eng.resume_partial(replace(ok, dp=2))
    with pytest.raises(SpecError, match="holds none"):
        eng.resume_partial(replace(ok, grads=None))
    eng.resume_partial(replace(ok, grads=None), contribute=False)  # a joiner: accepted
