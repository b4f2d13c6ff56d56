"""A live job of real worker processes (``python -m elastic.train.worker``, gloo on loopback) rescaled in place.

Grows ``tp1.pp1.dp2`` (2 workers) to ``tp2.pp1.dp2`` (4: two joiners) and shrinks it to
``tp1.pp1.dp1`` (1: a former joiner stays, three leave). The step counter continues and
every step's loss equals a never-rescaled single-process run of the same config within
1e-4 (fp32; only reduction order differs), and the leavers exit on their own.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from elastic.model import Layout, load_model
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from tests.train import _mp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)


def reference_losses(steps: int) -> list[float]:
    """The never-rescaled run: one process, one rank, one intra-op thread (two threads on a busy
    2-core VM make these tiny matmuls ~10x slower: 20 s instead of 2 s for 50 steps)."""
    return _mp.reference_losses(CFG, steps)


def test_grow_then_shrink_in_place_follows_the_never_rescaled_loss_curve(tmp_path) -> None:
    reg = CollectorRegistry()
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, verify_reshard=True)
    h = ProcessJobHandle("grow-shrink", CFG, options=opts, registry=reg, log_dir=str(tmp_path))
    try:
        # 1. generation 1 on two workers
        first = h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        assert first.generation == 1 and h.status().phase == "running"
        h.wait_step(1, timeout=120)
        # 2. grow to four: w2, w3 join with no state and receive theirs
        grow = h.rescale("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"], timeout=240)
        assert (grow.generation, grow.from_layout, grow.to_layout) == (2, Layout.parse("tp1.pp1.dp2"), Layout.parse("tp2.pp1.dp2"))
        assert grow.bytes_moved == grow.planned_bytes > 0 and grow.lower_bound_bytes <= grow.planned_bytes
        assert grow.pause_seconds is not None and grow.pause_seconds > 0
        h.wait_step(grow.switch_step + 1, timeout=120)
        # 3. shrink to one: a former joiner stays, the two original workers and w3 leave
        shrink = h.rescale("tp1.pp1.dp1", ["w2"], remap=False, timeout=240)
        assert shrink.record.leavers == ["w0", "w1", "w3"] and shrink.record.new_ranks == {"w2": 0}
        for w in ("w0", "w1", "w3"):
            assert h.procs[w].poll() == 0, f"leaver {w} should have exited cleanly"
        h.wait_step(shrink.switch_step + 2, timeout=120)
        st = h.status()
        assert (st.phase, st.generation, st.layout, st.workers) == ("running", 3, Layout.parse("tp1.pp1.dp1"), ["w2"])
    finally:
        final = h.stop()
    history = h.history()
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))), "the step counter must continue across rescales, no gap, no repeat"
    gens = [r.generation for r in history]
    assert gens == sorted(gens) and set(gens) == {1, 2, 3}
    assert history[grow.switch_step].generation == 2 and history[shrink.switch_step].generation == 3
    ref = reference_losses(len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"
    assert ref[-1] < ref[0]  # it learns
    assert final.phase == "stopped" and final.error is None
    assert reg.get_sample_value("elastic_training_rescales_total", {"job": "grow-shrink"}) == 2
    assert reg.get_sample_value("elastic_training_steps_total", {"job": "grow-shrink"}) == len(history)


def test_bf16_job_grows_in_place_with_a_joiner_told_each_kinds_dtype(tmp_path) -> None:
    """Mixed precision: bf16 ``param``, fp32 ``master`` and moments. A joiner holds no tensor to infer
    the dtypes from; the agent passes the job's per-kind dtypes to ``prepare``, so the grow goes ahead
    (without them ``prepare`` refuses and the rescale would be abandoned)."""
    cfg = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1, dtype=torch.bfloat16)
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, verify_reshard=True)
    h = ProcessJobHandle("bf16-grow", cfg, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp1", ["w0"], timeout=180)
        h.wait_step(1, timeout=120)
        grow = h.rescale("tp2.pp1.dp1", ["w0", "w1"], timeout=240)
        assert grow.record.ok and grow.bytes_moved > 0
        assert grow.record.worker_stats["w1"]["bytes_received"] > 0
        h.wait_step(grow.switch_step + 1, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None
    history = h.history()
    assert [r.step for r in history] == list(range(len(history)))
    ref = _mp.reference_losses(cfg, len(history))
    for r, want in zip(history, ref, strict=True):  # bf16 matmuls: TP splits round differently
        assert r.loss == pytest.approx(want, abs=0.05), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def test_a_grow_called_off_before_its_directive_changes_nothing(tmp_path) -> None:
    """Inference wants the GPUs back while the joiners are still starting: the grow is called
    off, the joiners are dismissed, the job keeps stepping on its layout and generation."""
    import threading
    import time

    from elastic.train.rendezvous import RescaleCancelled

    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120)
    h = ProcessJobHandle("cancel-grow", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp1", ["w0"], timeout=180)
        h.wait_step(1, timeout=120)
        assert h.cancel_pending() is False  # nothing in progress: nothing to call off
        out: dict = {}

        def grow() -> None:
            try:
                out["result"] = h.rescale("tp1.pp1.dp2", ["w0", "w1"], timeout=240)
            except Exception as e:  # noqa: BLE001 - inspected below
                out["error"] = e

        t = threading.Thread(target=grow)
        t.start()
        deadline = time.monotonic() + 30
        while "w1" not in h.procs and time.monotonic() < deadline:  # the joiner's process exists
            time.sleep(0.01)
        assert "w1" in h.procs and not h.coordinator.registered("w1"), "joiner registered before the test could cancel"
        t0 = time.monotonic()
        assert h.cancel_pending() is True
        t.join(30)
        assert not t.is_alive() and time.monotonic() - t0 < 10, "calling off must not wait for the joiner"
        assert isinstance(out.get("error"), RescaleCancelled), out
        assert h.procs["w1"].poll() is not None, "the dismissed joiner must be gone"
        st = h.status()
        assert (st.phase, st.generation, st.layout, st.workers) == ("running", 1, Layout.parse("tp1.pp1.dp1"), ["w0"])
        h.wait_step(st.step + 2, timeout=120)  # still training
        # the same grow, not called off, goes through afterwards
        res = h.rescale("tp1.pp1.dp2", ["w0", "w2"], timeout=240)
        assert (res.generation, res.to_layout) == (2, Layout.parse("tp1.pp1.dp2"))
        assert h.cancel_pending() is False  # finished: nothing to call off
    finally:
        h.stop()
    steps = [r.step for r in h.history()]
    assert steps == list(range(len(steps)))


def test_only_a_broken_collective_is_recoverable_and_a_keeper_steps_nothing() -> None:
    from elastic.train.agent import HeldState, _is_comm_error

    assert _is_comm_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert _is_comm_error(RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer"))
    assert not _is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not _is_comm_error(ValueError("gloo"))  # only runtime errors of the transport
    state = {("w", "param"): torch.ones(2, 3)}
    held = HeldState(state)
    assert held.state() is state and held.state_bytes() == 24
    with pytest.raises(RuntimeError, match="runs no step"):
        held.train_step(5)


def test_members_prepare_a_rescale_beside_the_step_in_progress_not_in_the_pause(tmp_path) -> None:
    """No lookahead (the launcher's default): a rescale switches at the next step boundary, so the
    step loop hears of it only there. The members' heartbeats are told the moment it is posted and
    plan and allocate their receive buffers beside the step in progress; at the switch the step
    loop takes them ready. Steps of ~1-2 s on two workers (60 micro-batches of 2 a replica) leave no
    doubt which it was. On four (TP 2) every micro-batch meets its TP peer many times on shared cores
    and a step takes several times longer, so the test runs the fewest of them: the grow's first, then
    the one the shrink waits for. Micro-batches of 2 rather than 1 halve those meetings and leave the
    2-worker steps about as long (there a step's time is mostly per-micro-batch overhead).
    The shrink waits for the step's end (``give_up_step=False``): given up, it would switch at the
    next micro-batch, which a member can reach before its own heartbeat's answer is read (all give
    the step up together once any one asks)."""
    cfg = TrainConfig(model=load_model("tiny"), global_batch=240, micro_batch=2)
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120)
    assert opts.lookahead_steps == 0 and opts.shrink_lookahead_steps == 0
    h = ProcessJobHandle("prepare-ahead", cfg, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(1, timeout=120)
        grow = h.rescale("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"], timeout=240)  # posted once w2, w3 are up
        # the grow returned after the new layout's first step: the shrink is posted beside its second
        shrink = h.rescale("tp1.pp1.dp1", ["w0"], timeout=240, give_up_step=False)
        h.wait_step(shrink.switch_step + 1, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    for res, members in ((grow, ("w0", "w1")), (shrink, ("w0", "w1", "w2", "w3"))):
        stats = res.record.worker_stats
        for w in members:
            # > 0 only when the switch took the preparation begun beside the step (one redone at
            # the switch, stale or deferred, reports 0); how long the switch still waited for it
            # depends on where in the step the post landed, and is printed
            assert stats[w]["prepare_ahead_seconds"] > 0, \
                f"{res.from_layout} -> {res.to_layout}: {w} prepared at the switch, not beside the step"
        print(f"{res.from_layout} -> {res.to_layout}: prepared "
              + ", ".join(f"{w} {stats[w]['prepare_ahead_seconds']:.2f} s ahead (waited "
                          f"{stats[w]['prepare_wait_seconds'] * 1e3:.1f} ms)" for w in members)
              + f"; pause {res.pause_seconds:.3f} s")
    history = h.history()
    assert [r.step for r in history] == list(range(len(history)))
    assert {r.layout for r in history} == set(map(Layout.parse, ["tp1.pp1.dp2", "tp2.pp1.dp2", "tp1.pp1.dp1"]))
    ref = _mp.reference_losses(cfg, len(history), one_micro_batch=True)
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"
