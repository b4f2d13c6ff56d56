"""A step that runs out of memory is not fatal: the engine gives it up with its state intact, the
worker tells the coordinator (layout, rank, what it held) and waits, its peers break and wait too,
and a directive onto a layout that fits redoes the step on the same samples.

First the per-rank limit that stands in for a device's capacity on CPU (``memory_limit_bytes``)
on one engine: a step fails exactly when its measured peak would exceed the limit, and leaves the
state bitwise as it was. Then real worker processes (``python -m elastic.train.worker``, gloo on
loopback, no Ray): ``tp1.pp2.dp1`` under a limit that only its first pipeline stage overruns
(1F1B keeps two micro-batches in flight there), so one member fails while the other waits on it
in a receive, and ``tp1.pp1.dp2`` whose replicas both fail at the same micro-batch; every member
gives the step up, the job is held, and a layout that fits (``tp2.pp1.dp1``; ZeRO-1 of the same
``dp2``) redoes the step and continues on the curve of the never-rescaled run (float64, 1e-9).
Last, the coordinator alone: the hold, the directive out of it, and members whose states are not
at one step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic.model import Layout, SpecError, load_model
from elastic.parallel.memory_report import MeasuredMemory, measured_peak
from elastic.train.engine import TrainConfig, TrainEngine
from tests.train._mp import wait_out_of_memory_hold

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1, seed=3, lr=3e-3, dtype=torch.float64)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a busy 2-core machine two threads spinning against each other make
    these tiny matmuls many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(limit: int | None) -> TrainEngine:
    return TrainEngine(dataclasses.replace(CFG, memory_limit_bytes=limit), Layout(1, 1, 1), 0)


def _reference(steps: int) -> tuple[list[float], int]:
    """The never-rescaled single-process run: its losses and its step's measured peak."""
    eng = _engine(None)
    losses = [eng.train_step(s).loss for s in range(steps)]
    assert eng.memory is not None
    return losses, measured_peak(eng.memory)


def test_the_limit_fails_a_step_exactly_when_its_measured_peak_would_exceed_it() -> None:
    losses, peak = _reference(2)
    # at the peak: the step runs, on the same numbers as without a limit
    at = _engine(peak)
    assert [at.train_step(s).loss for s in range(2)] == losses
    # one byte below: the step fails where the save that goes over is made, and nothing changed
    below = _engine(peak - 1)
    before = {k: v.clone() for k, v in below.state().items()}
    with pytest.raises(torch.OutOfMemoryError, match=r"over its limit of \d+ bytes \(TrainConfig.memory_limit_bytes\)"):
        below.train_step(0)
    assert all(torch.equal(before[k], v) for k, v in below.state().items())  # the optimizer has not stepped
    assert all(p.grad is None for p in below.params.values()) and below.ready_step is None
    m = below.oom_memory
    assert m is not None and (m.step, str(m.layout), m.rank) == (0, "tp1.pp1.dp1", 0)
    assert measured_peak(m) == peak  # what it held with the refused save: the step's whole need
    assert m.gradients == m.weights  # counted whole, as the limit does
    # the state it kept trains on: the step redone from it is the reference's
    again = TrainEngine(CFG, Layout(1, 1, 1), 0, state=below.state())
    assert [again.train_step(s).loss for s in range(2)] == losses


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1GiB"])
def test_a_bad_limit_is_refused_naming_the_field(bad) -> None:
    with pytest.raises(SpecError, match="memory_limit_bytes=.*integer >= 1 .or None for no limit"):
        dataclasses.replace(CFG, memory_limit_bytes=bad)


# --------------------------------------------------------------------------------------------
# real worker processes, no Ray
# --------------------------------------------------------------------------------------------

STEPS = 5


# measured peaks per rank (float64, this batch): tp1.pp2.dp1 stage 0 4.59 MB, stage 1 4.13 MB;
# tp2.pp1.dp1 4.11 MB; tp1.pp1.dp2 8.17 MB, with ZeRO-1 6.43 MB. Each limit lies halfway (the
# activations measured vary by a few percent between processes: the margins are 5% and more).
SCENARIOS = {
    # one stage runs out of memory while the next waits on it in a receive
    "stage": ("tp1.pp2.dp1", 4_360_000, ("w0",), "tp2.pp1.dp1"),
    # both replicas at once, at the same micro-batch; ZeRO-1 of the same layout fits
    "replicas": ("tp1.pp1.dp2", 7_300_000, ("w0", "w1"), "tp1.pp1.dp2.z1"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_step_out_of_memory_holds_the_job_and_a_layout_that_fits_continues_the_curve(tmp_path, scenario) -> None:
    from elastic.train.launch import LaunchOptions, ProcessJobHandle

    first, limit, failing, fits = SCENARIOS[scenario]
    losses, _ = _reference(STEPS)
    cfg = dataclasses.replace(CFG, memory_limit_bytes=limit)
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, max_steps=STEPS)
    h = ProcessJobHandle(f"oom-{scenario}", cfg, options=opts, log_dir=str(tmp_path))
    try:
        h.start(first, ["w0", "w1"], timeout=180)  # returns: its first step ran out of memory
        st = wait_out_of_memory_hold(h, 120)
        assert (st.phase, st.layout, st.generation, st.step) == ("recovering", Layout.parse(first), 1, -1)
        oom = st.out_of_memory
        assert (oom["layout"], oom["step"]) == (first, 0) and oom["worker"] in failing
        assert oom["rank"] == int(oom["worker"][1:])  # w0 holds rank 0, w1 rank 1
        assert "OutOfMemoryError" in oom["error"] and st.error.startswith("OutOfMemory: ")
        m = MeasuredMemory.from_json(oom["memory"], "out_of_memory.memory")
        assert (m.rank, str(m.layout)) == (oom["rank"], first) and measured_peak(m) > limit
        assert st.memory == oom["memory"]  # the generation's worst rank, as the controller reads it
        # a pause is refused (the job must move to a layout that fits), nothing changes
        with pytest.raises(SpecError, match=r"is recovering \(OutOfMemory: "):
            h.pause(timeout=30)
        # the move: every member's kept state, the failed step redone on the new layout
        res = h.rescale(fits, ["w0", "w1"], timeout=180)
        assert (res.generation, res.from_layout, res.to_layout, res.switch_step) == (2, Layout.parse(first),
                                                                                    Layout.parse(fits), 0)
        assert f"out of memory on {first}" in res.record.reason
        h.wait_step(STEPS - 1, timeout=120)
        hist = h.history()
        assert [r.step for r in hist] == list(range(STEPS)) and {r.layout for r in hist} == {Layout.parse(fits)}
        for r, want in zip(hist, losses, strict=True):
            assert r.loss == pytest.approx(want, rel=1e-9, abs=0), f"step {r.step}"
        st = h.status()
        assert st.out_of_memory is None and st.error is None
        assert measured_peak(MeasuredMemory.from_json(st.memory, "status.memory")) <= limit
    finally:
        h.stop()


# --------------------------------------------------------------------------------------------
# the coordinator alone: the hold, the directive out of it, and a state that cannot go on
# --------------------------------------------------------------------------------------------

W2 = ("w0", "w1")  # tp1.pp2.dp1: w0 stage 0, w1 stage 1


def _oom_report(step: int, rank: int = 0, layout: str = "tp1.pp2.dp1") -> dict:
    m = MeasuredMemory(model="tiny", layout=Layout.parse(layout), rank=rank, pp_rank=rank, step=step,
                       dtype="float64", micro_batch=1, grad_accum=8, weights=100, gradients=100, optimizer=200,
                       activations=700, weight_elements=12, gradient_elements=12, optimizer_elements=12,
                       optimizer_kinds=2)
    return {"layout": layout, "rank": rank, "step": step, "memory": m.as_json(),
            "error": "OutOfMemoryError: out of memory: saving 64 bytes for backward would hold 1100 bytes"}


def test_the_coordinator_holds_the_job_until_every_member_reported_then_moves_it_at_the_failed_step() -> None:
    from tests.train.test_agent_rendezvous import call, metric, run_step, started

    c, clock, reg = started(workers=W2, layout="tp1.pp2.dp1", recover=True)
    run_step(c, W2, 1, 2)
    run_step(c, W2, 1, 3)  # steps 0..2 on record; both inside step 3
    # stage 0 runs out of memory and says so before it breaks stage 1's receive
    call(c, "broken", "w0", generation=1, step=3, applied=2, ready=None, dirty=False, local_apply=True,
         error="OutOfMemoryError: out of memory", out_of_memory=_oom_report(3))
    st = c.status()
    assert st.phase == "recovering" and st.out_of_memory is None and st.error is None  # w1 not back yet
    assert st.memory["rank"] == 0 and st.memory["activations"] == 700  # what it held, as the controller reads it
    with pytest.raises(SpecError, match="ran out of memory and not every worker has reported back"):
        c.directive(2, "tp2.pp1.dp1", list(W2))
    assert call(c, "step", "w1", generation=1, step=3)["action"] == "break"  # between two micro-batches
    call(c, "broken", "w1", generation=1, step=3, applied=2, ready=None, dirty=False, local_apply=True,
         error="RuntimeError: Connection closed by peer")
    st = c.status()
    assert (st.phase, st.out_of_memory["worker"], st.out_of_memory["layout"]) == ("recovering", "w0", "tp1.pp2.dp1")
    assert st.error.startswith("OutOfMemory: OutOfMemoryError") and "waiting for a directive" in st.reason
    # held: no retry on the same layout, however long it waits; the members hold
    for _ in range(5):  # well past the recovery timeout; both members keep beating
        clock.t += 3
        for w in W2:
            call(c, "heartbeat", w)
        c.tick()
    assert c.status().phase == "recovering" and c.status().last_rescale.generation == 1
    assert call(c, "step", "w0", generation=1, step=3)["action"] == "hold"
    with pytest.raises(SpecError, match="move it to a layout that fits"):
        c.directive(2, "tp1.pp1.dp1", ["w0"], hold=True)
    # the move: both members switch at step 3, the step that failed, from the states they kept
    d = c.directive(2, "tp2.pp1.dp1", list(W2))
    assert (d.switch_step, d.commit_step, d.old_ranks, str(d.old_layout)) == (3, 2, {"w0": 0, "w1": 1}, "tp1.pp2.dp1")
    assert c.status().out_of_memory is None
    for w in W2:
        assert call(c, "step", w, generation=1, step=3)["action"] == "switch"
    for w in W2:
        call(c, "arrive", w, generation=2, digest="r", plan={"new_ranks": {"w0": 0, "w1": 1}})
    for w in W2:
        call(c, "result", w, generation=2, ok=True, stats={})
    for w in W2:  # the first step of a generation carries no result
        assert call(c, "step", w, generation=2, step=3)["action"] == "go"
    run_step(c, W2, 2, 4)
    rec = c.wait_generation(2, timeout=1)
    assert rec.ok and "out of memory on tp1.pp2.dp1" in rec.reason and not rec.recovery
    st = c.status()
    assert (st.phase, st.layout, st.error) == ("running", Layout.parse("tp2.pp1.dp1"), None)
    assert [h.step for h in c.history()] == [0, 1, 2, 3]  # step 3 redone once, on the new layout
    assert metric(reg, "elastic_training_recoveries_total") in (None, 0)  # nobody was lost


def test_a_member_that_ran_out_of_memory_inside_its_optimizer_update_fails_the_job() -> None:
    from tests.train.test_agent_rendezvous import call, run_step, started

    c, _, _ = started(workers=W2, layout="tp1.pp2.dp1", recover=True)
    run_step(c, W2, 1, 2)
    call(c, "broken", "w0", generation=1, step=2, applied=1, ready=2, dirty=True, local_apply=True,
         error="OutOfMemoryError: CUDA out of memory", out_of_memory=_oom_report(2))
    call(c, "broken", "w1", generation=1, step=3, applied=2, ready=None, dirty=False, local_apply=True,
         error="RuntimeError: Connection closed by peer")
    st = c.status()
    assert st.phase == "failed" and "inside an optimizer update" in st.error and "ran out of memory" in st.error
