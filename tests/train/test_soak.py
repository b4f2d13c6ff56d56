"""Soak, CI size: a live job of real worker processes through a seeded random walk of in-place rescales.

The core of ``benchmarks/train_soak.py`` (which runs the long version: 30 rescales, up to four
workers, optional kills) on two fixed seeds of six rescales each, up to three workers, float64:
random layouts with and without ZeRO-1, random worker sets (some stay, fresh ones join, names
never reused), random rank orders, a pause into keepers and a resume onto fresh workers, and a
SIGKILLed worker the job recovers from in place. Every rescale must succeed and every step's
loss must equal the never-rescaled single-process run to 1e-9 (relative).

The seeds are fixed, and so is what they draw (the draws depend only on the seed and on the
job's state, which the coordinator decides deterministically): both kill a worker, pause and
resume. The first tests check the soak's own pure helpers, so that a checker that
cannot fail does not pass for a green soak.
"""

from __future__ import annotations

import random
import time

import pytest

from benchmarks.train_soak import (
    SoakOptions,
    Watchdog,
    compare_losses,
    draw_workers,
    recoverable,
    run_soak,
    train_config,
    valid_layouts,
)
from elastic.model import Layout
from elastic.train.rendezvous import StepRecord

# every state that can recover from a loss (tp1.pp1.dp2 here) gets a worker SIGKILLed
CI = {"rescales": 6, "max_workers": 3, "global_batch": 4, "dtype": "float64", "op_timeout_s": 90.0,
      "kill_prob": 1.0, "pause_prob": 0.1}


def test_valid_layouts_are_what_the_model_and_global_batch_accept() -> None:
    lays = {str(lay) for lay in valid_layouts(train_config(SoakOptions(global_batch=4)), 4)}
    assert {"tp1.pp1.dp4", "tp2.pp2.dp1", "tp1.pp2.dp2.z1", "tp1.pp3.dp1", "tp1.pp1.dp1.z1"} <= lays
    assert "tp4.pp1.dp1" not in lays  # tiny has kv_heads=2
    assert not any(".dp3" in lay for lay in lays)  # global batch 4 does not split over 3 replicas
    assert all(Layout.parse(lay).world_size <= 4 for lay in lays)
    assert "tp1.pp1.dp3" in {str(lay) for lay in valid_layouts(train_config(SoakOptions(global_batch=12)), 4)}
    assert recoverable(Layout(1, 2, 2)) and not recoverable(Layout(1, 2, 2, zero=1))
    assert not recoverable(Layout(2, 2, 1))


def test_drawn_worker_sets_mix_current_and_fresh_names_and_never_repeat_one() -> None:
    rng = random.Random(3)
    counter = iter(range(1000))
    current = ["w0", "w1", "w2"]
    kept_some = fresh_some = False
    for size in (1, 2, 3, 4) * 10:
        got = draw_workers(rng, current, size, lambda: f"n{next(counter)}")
        assert len(got) == len(set(got)) == size
        kept_some |= bool(set(got) & set(current))
        fresh_some |= any(w.startswith("n") for w in got)
    assert kept_some and fresh_some


def _records(losses: list[float]) -> list[StepRecord]:
    return [StepRecord(i, 1, Layout.parse("tp1.pp1.dp1"), x, 128, 0.01) for i, x in enumerate(losses)]


def test_the_loss_comparison_catches_a_perturbed_missing_or_repeated_step() -> None:
    ref = [5.5, 5.4, 5.3, 5.2]
    assert compare_losses(_records(ref), ref, 1e-9) == ([], 0.0)
    bad, worst = compare_losses(_records([5.5, 5.4 * (1 + 1e-8), 5.3, 5.2]), ref, 1e-9)
    assert len(bad) == 1 and "step 1" in bad[0] and worst == pytest.approx(1e-8, rel=1e-3)
    gap = _records(ref)
    del gap[2]
    assert any("missing [2]" in b for b in compare_losses(gap, ref, 1e-9)[0])
    twice = _records(ref)
    twice.insert(2, twice[1])
    assert any("repeated [1]" in b for b in compare_losses(twice, ref + [5.1], 1e-9)[0])
    assert compare_losses(_records([5.5, float("nan")]), ref, 1e-9)[0]


def test_the_watchdog_calls_a_hang_once_its_deadline_passes_and_not_before() -> None:
    hangs: list[str] = []
    dog = Watchdog(hangs.append)
    try:
        dog.arm("quick op", 5.0)
        dog.disarm()  # finished in time
        dog.arm("stuck op", 0.1)
        deadline = time.monotonic() + 5
        while not hangs and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dog.close()
    assert hangs == ["hang: stuck op did not finish in time"] and dog.fired == hangs[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [2, 3])
def test_a_random_walk_of_rescales_follows_the_never_rescaled_loss_curve(tmp_path, seed) -> None:
    report = run_soak(SoakOptions(seed=seed, log_dir=str(tmp_path), **CI))
    sequence = "\n".join(str(a) for a in report.actions)
    assert report.ok, (f"seed {seed}: hang={report.hang!r} failures={report.failures} "
                       f"mismatches={report.mismatches[:5]}\n{report.traceback}\nsequence:\n{sequence}")
    moves = [e for e in report.events if e["op"] in ("rescale", "resume")]
    assert len(moves) == CI["rescales"], sequence
    # what these seeds draw: a kill recovered in place, a pause and a resume, joiners and leavers
    assert {e["op"] for e in report.events} == {"start", "rescale", "kill", "pause", "resume"}, sequence
    assert any(e["joiners"] for e in moves) and any(e["leavers"] for e in moves), sequence
    assert all(e["bytes_moved"] == e["planned_bytes"] for e in moves)
    assert report.steps > CI["rescales"] and report.max_rel_error <= 1e-9
