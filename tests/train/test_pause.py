"""Pausing a live job without losing it: real worker processes, gloo on loopback.

A job at its minimum that must give every GPU back is *paused*, not killed: its state moves
peer to peer into keepers (processes without a GPU that hold it in host memory, laid out as
``tp.pp.dp1``), every training worker exits, nothing steps; a later rescale moves the state
back onto new GPU workers, possibly on another layout, and training goes on at the same step
on the never-paused loss curve.
"""

from __future__ import annotations

import time

import pytest

from elastic.model import Layout, SpecError, load_model
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from tests.train import _mp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)


def test_hold_layout_keeps_the_model_parallel_split_and_one_copy() -> None:
    assert Layout.parse("tp2.pp2.dp4").held() == Layout(2, 2, 1)
    assert Layout(1, 2, 4, zero=1).held() == Layout(1, 2, 1)  # ZeRO-1 shards gather into one copy


def test_pause_frees_every_worker_keeps_the_state_and_resume_continues_the_loss_curve(tmp_path) -> None:
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, verify_reshard=True)
    h = ProcessJobHandle("pause", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"], timeout=180)
        h.wait_step(2, timeout=120)
        with pytest.raises(SpecError, match="on 2 keeper"):
            h.pause(["only-one"])  # tp2 needs two keepers
        # 1. pause: the state goes into two keepers (tp2.pp1.dp1); all four workers exit cleanly
        paused = h.pause(["k0", "k1"], timeout=240)
        assert paused.record.hold and paused.to_layout == Layout.parse("tp2.pp1.dp1")
        assert paused.bytes_moved == paused.planned_bytes > 0
        assert sorted(paused.record.leavers) == ["w0", "w1", "w2", "w3"]
        for w in ("w0", "w1", "w2", "w3"):
            assert h.procs[w].poll() == 0, f"worker {w} should have exited cleanly at the pause"
        assert h.keepers == {"k0", "k1"}
        st = h.status()
        assert (st.phase, st.workers, st.layout) == ("paused", ["k0", "k1"], Layout.parse("tp2.pp1.dp1"))
        held_at = st.step
        assert held_at == paused.switch_step - 1
        time.sleep(1.5)  # nothing steps while paused, the keepers stay up
        assert h.status().step == held_at and h.status().phase == "paused"
        assert all(h.procs[k].poll() is None for k in ("k0", "k1"))
        with pytest.raises(SpecError, match="only a running job can be paused"):
            h.pause(["k2", "k3"])
        with pytest.raises(SpecError, match="keepers k0, k1 hold no GPU"):
            h.rescale("tp2.pp1.dp1", ["k0", "k1"])
        # 2. resume on another layout and other workers: the step counter goes on from the pause
        resumed = h.rescale("tp1.pp2.dp1", ["w4", "w5"], timeout=240)
        assert resumed.switch_step == held_at + 1 and not resumed.record.hold
        assert resumed.bytes_moved == resumed.planned_bytes > 0
        for k in ("k0", "k1"):
            assert h.procs[k].poll() == 0, f"keeper {k} should have exited after handing the state back"
        h.wait_step(resumed.switch_step + 2, timeout=120)
        assert h.status().phase == "running"
    finally:
        final = h.stop()
    assert final.error is None
    history = h.history()
    assert [r.step for r in history] == list(range(len(history))), "no step lost or repeated across the pause"
    assert {r.layout for r in history} == set(map(Layout.parse, ["tp2.pp1.dp2", "tp1.pp2.dp1"]))
    ref = _mp.reference_losses(CFG, len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def test_a_paused_job_stops_cleanly_and_its_keepers_exit(tmp_path) -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120)
    h = ProcessJobHandle("pause-stop", CFG, options=opts, registry=reg, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(1, timeout=120)
        paused = h.pause(timeout=240)  # default keeper names
        assert paused.record.workers == ["pause-stop-keep2-0"] and h.status().phase == "paused"
        assert reg.get_sample_value("elastic_training_paused", {"job": "pause-stop"}) == 1
    finally:
        final = h.stop(timeout=30)
    assert final.phase == "stopped" and final.error is None
    assert h.procs["pause-stop-keep2-0"].poll() == 0
