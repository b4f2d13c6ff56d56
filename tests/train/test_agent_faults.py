"""Bad input and faults on a live job of real worker processes: refused layouts change nothing, a joiner
that never arrives leaves the job on its old layout with its state intact, and a worker that dies or
freezes mid-training, with recovery off, surfaces as a failed status with the reason -- within a bounded
time, never a hang.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from elastic.model import HardwareSpec, Layout, SpecError, load_model
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from elastic.train.rendezvous import RescaleFailed
from tests.train import _mp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)
OPTS = LaunchOptions(pg_timeout_s=60, heartbeat_interval_s=0.5, heartbeat_timeout_s=8, join_timeout_s=60)
# the failure path itself: with recovery off, a lost worker fails the job (tests/train/test_recover.py
# covers the job recovering from the same faults)
NO_RECOVER = replace(OPTS, recover=False)


def reference_losses(steps: int) -> list[float]:
    """The never-rescaled run: one process, one rank, one intra-op thread (two threads on a busy
    2-core VM make these tiny matmuls ~10x slower: 20 s instead of 2 s for 50 steps)."""
    return _mp.reference_losses(CFG, steps)


def padded_job(tmp_path, monkeypatch, name: str, factory: str, micro_seconds: float) -> ProcessJobHandle:
    """A live job (not started) whose engines pad each micro-batch (``tests.train._agent_engines.<factory>``)."""
    monkeypatch.setenv("ELASTIC_TEST_MICRO_SECONDS", str(micro_seconds))
    opts = replace(OPTS, engine_factory=f"tests.train._agent_engines:{factory}")
    return ProcessJobHandle(name, CFG, options=opts, log_dir=str(tmp_path))


def assert_one_switch_on_the_reference_curve(h: ProcessJobHandle, switch_step: int) -> None:
    """Every step once (a given-up try left no result), generation 2 from ``switch_step`` on, and the
    losses of a job never rescaled."""
    hist = h.history()
    assert [r.step for r in hist] == list(range(len(hist)))
    assert [r.generation for r in hist] == [1] * switch_step + [2] * (len(hist) - switch_step)
    for r, want in zip(hist, reference_losses(len(hist)), strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    h = ProcessJobHandle("faults", CFG, options=OPTS, log_dir=str(tmp_path_factory.mktemp("logs")))
    h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
    h.wait_step(1, timeout=120)
    yield h
    h.stop()


TOY_GPU = HardwareSpec(name="toy-1mib", memory_bytes=2**20, peak_flops=1e12, intra_node_bandwidth=1e9,
                       inter_node_bandwidth=1e9, gpus_per_node=8)


@pytest.mark.parametrize(
    "layout, workers, hardware, match",
    [
        ("tp3.pp1.dp1", ["w0", "w1", "w2"], None, "does not divide heads"),
        ("tp1.pp8.dp1", [f"w{i}" for i in range(8)], None, "exceed the 4 layers"),
        ("tp1.pp1.dp3", ["w0", "w1", "w2"], None, "global_batch=8 is not divisible"),
        ("tp1.pp1.dp4", ["w0", "w1"], None, "needs 4 workers"),
        ("tp1.pp1.dp2", ["w0", "w1"], TOY_GPU, "does not fit toy-1mib"),
    ],
)
def test_refused_rescale_changes_nothing(job, layout, workers, hardware, match) -> None:
    before = job.status()
    validate = job.validate
    if hardware is not None:  # the planner's verdict on a GPU far too small for the model
        from elastic.train.launch import make_validator

        job.validate = make_validator(CFG, hardware)
    try:
        with pytest.raises(SpecError, match=match):
            job.rescale(layout, workers)
    finally:
        job.validate = validate
    after = job.status()
    assert (after.phase, after.generation, after.layout, after.workers) == (
        before.phase, before.generation, before.layout, before.workers)
    assert sorted(job.procs) == ["w0", "w1"], "a refused rescale must not launch anyone"


def test_joiner_that_never_arrives_times_out_and_the_job_continues_with_its_state(job) -> None:
    # a directive naming a worker that never starts (a pod stuck pending): only the coordinator knows it
    gen = job.status().generation + 1
    job.coordinator.directive(gen, "tp1.pp1.dp4", ["w0", "w1", "ghost-a", "ghost-b"], join_timeout_s=3)
    # abandoned by the directive's own join timeout (3 s, not the job's 60 s: the reason names the
    # one applied); the wait's bound is there only so that a hang fails the test
    with pytest.raises(RescaleFailed, match="ghost-a, ghost-b did not arrive within join_timeout_s=3") as failed:
        job.coordinator.wait_generation(gen, timeout=60)
    rec = failed.value.record
    assert rec is not None and (rec.generation, rec.ok, rec.joiners) == (gen, False, ["ghost-a", "ghost-b"]), rec
    assert "join_timeout_s=3;" in rec.reason and "nothing moved" in rec.reason, rec.reason
    st = job.status()
    assert (st.phase, st.generation, st.layout) == ("running", 1, Layout.parse("tp1.pp1.dp2"))
    assert "abandoned" in st.reason and "ghost-a" in st.reason
    assert st.last_rescale is not None and st.last_rescale.ok is False and st.last_rescale.generation == gen
    # state intact: training goes on and still follows the never-rescaled curve
    at = st.step
    job.wait_step(at + 3, timeout=120)
    hist = job.history()
    ref = reference_losses(len(hist))
    assert [r.step for r in hist] == list(range(len(hist)))
    for r, want in zip(hist, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step}"


def test_member_that_cannot_prepare_abandons_the_rescale_and_the_job_keeps_its_state(tmp_path, monkeypatch) -> None:
    # w0's engine hands the resharder a column-major tensor: prepare() refuses it on w0 only
    monkeypatch.setenv("ELASTIC_TEST_FAULTY_WORKER", "w0")
    reg = CollectorRegistry()
    opts = replace(OPTS, engine_factory="tests.train._agent_engines:mislaid_state_on_one_worker")
    h = ProcessJobHandle("prepare-fails", CFG, options=opts, registry=reg, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp1", ["w0"], timeout=180)
        h.wait_step(1, timeout=120)
        with pytest.raises(RescaleFailed, match=r"worker w0 could not plan or prepare the reshard: ReshardError: "
                                                r".*not contiguous.*nothing moved"):
            h.rescale("tp1.pp1.dp2", ["w0", "w1"], timeout=120)
        st = h.status()
        assert (st.phase, st.generation, st.layout, st.workers) == ("running", 1, Layout.parse("tp1.pp1.dp1"), ["w0"])
        assert "abandoned" in st.reason and "w0 could not plan or prepare" in st.reason, st.reason
        assert st.error is None and st.last_rescale is not None and st.last_rescale.ok is False
        # the joiner was told and left on its own (the launcher did not have to kill it)
        assert h.exit_reasons.get("w1") == "exited with code 0"
        assert reg.get_sample_value("elastic_training_rescale_failures_total", {"job": "prepare-fails"}) == 1
        h.wait_step(st.step + 3, timeout=120)  # training goes on, on the old layout, from intact state
    finally:
        final = h.stop()
    assert final.error is None
    hist = h.history()
    assert [r.step for r in hist] == list(range(len(hist))) and {r.generation for r in hist} == {1}
    for r, want in zip(hist, reference_losses(len(hist)), strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step}"


def test_rescale_near_max_steps_completes_or_is_refused_and_never_hangs(tmp_path, monkeypatch) -> None:
    """Every step takes 0.3 s. A shrink posted right after step 1 switches at step 3 or 4 (after the
    step in progress) and completes before max_steps=14; a grow asked for while the last step (13) is
    in progress would switch at step 14 or later: refused, before any joiner is launched. The job
    then finishes."""
    monkeypatch.setenv("ELASTIC_TEST_STEP_SECONDS", "0.3")
    # step 13 marks and holds until the grow was refused: the job is still running when it is asked
    # for, whatever the machine's load (with no hold it would finish 0.3 s after step 12)
    mark, release = tmp_path / "marks", tmp_path / "release"
    mark.mkdir()
    monkeypatch.setenv("ELASTIC_TEST_SLOW_HOLD_STEP", "13")
    monkeypatch.setenv("ELASTIC_TEST_HOLD_MARK", str(mark))
    monkeypatch.setenv("ELASTIC_TEST_HOLD_RELEASE", str(release))
    opts = replace(OPTS, max_steps=14, engine_factory="tests.train._agent_engines:slow_steps")
    h = ProcessJobHandle("near-end", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(1, timeout=120)
        shrink = h.rescale("tp1.pp1.dp1", ["w0"], timeout=60)
        assert shrink.record.ok and shrink.switch_step < 14
        # w0 (the one member) is in step 13: the coordinator answered go for it, so the earliest
        # switch is 14
        deadline = time.monotonic() + 60
        while not (mark / "w0.held").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (mark / "w0.held").exists(), "step 13 did not begin"
        with pytest.raises(SpecError, match=r"would switch at step 1[4-9] .*max_steps=14"):
            h.rescale("tp1.pp1.dp2", ["w0", "w2"], timeout=60)
        assert sorted(h.procs) == ["w0", "w1"], "a refused rescale must not launch anyone"
        release.touch()
        assert h.coordinator.wait_phase(["finished"], timeout=60) == "finished"
    finally:
        release.touch()  # a test that failed before its release must not leave w0 waiting out its bound
        final = h.stop()
    assert final.phase == "finished" and final.error is None
    hist = h.history()
    assert [r.step for r in hist] == list(range(14))
    assert [r.generation for r in hist] == [1] * shrink.switch_step + [2] * (14 - shrink.switch_step)


def test_a_shrink_that_need_not_wait_its_first_step_returns_with_its_leavers_gone_and_the_next_rescale_waits(
        tmp_path, monkeypatch) -> None:
    """``wait_first_step=False`` (what the backends ask for): every step takes 3 s, and the new
    layout's first step waits for the test's word; the shrink returns once the new layout has begun
    its first step and the leaver exited, before that step ends; the next rescale waits for it, and
    the step counter and loss curve go on as if nothing happened."""
    release = tmp_path / "first-step-release"
    monkeypatch.setenv("ELASTIC_TEST_STEP_SECONDS", "3.0")
    monkeypatch.setenv("ELASTIC_TEST_FIRST_STEP_RELEASE", str(release))
    opts = replace(OPTS, engine_factory="tests.train._agent_engines:slow_steps")
    h = ProcessJobHandle("early", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(0, timeout=120)
        shrink = h.rescale("tp1.pp1.dp1", ["w0"], timeout=120, wait_first_step=False)
        assert shrink.record.ok is None and shrink.pause_seconds is not None and shrink.record.leavers == ["w1"]
        assert h.procs["w1"].poll() == 0  # the leaver is gone: its GPU is free
        assert h.status().step < shrink.switch_step  # the new layout's first step is still running (held)
        release.touch()  # that step may end now
        grow = h.rescale("tp1.pp1.dp2", ["w0", "w2"], timeout=120)  # waits for that step, then goes
        assert grow.record.ok and grow.switch_step > shrink.switch_step
        assert h.coordinator.rescale_record(shrink.generation).ok is True
        h.wait_step(grow.switch_step, timeout=120)
    finally:
        release.touch()  # a failed assertion leaves no step held
        final = h.stop()
    assert final.error is None
    hist = h.history()
    assert [r.step for r in hist] == list(range(len(hist)))
    assert [r.generation for r in hist] == ([1] * shrink.switch_step + [2] * (grow.switch_step - shrink.switch_step)
                                           + [3] * (len(hist) - grow.switch_step))
    for r, want in zip(hist, reference_losses(len(hist)), strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step}"


@pytest.mark.parametrize("layout, workers, after, kept, gives_up, keeps_work", [
    ("tp1.pp1.dp2", ["w0", "w1"], "tp1.pp1.dp1", ["w0"], True, True),
    # tensor parallel: both ranks of a replica meet at every micro-batch's check as well
    ("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"], "tp2.pp1.dp1", ["w0", "w1"], True, True),
    # the TP split changes: no survivor holds its new boxes' gradients, the step is redone whole
    # (asked explicitly: by default that is done only early in a step, where it costs less than
    # waiting for the boundary; test_agent_rendezvous.py tests that choice on a fake clock)
    ("tp2.pp1.dp2", ["w0", "w1", "w2", "w3"], "tp1.pp1.dp2", ["w0", "w2"], True, False),
    # 1F1B stages run their micro-batches at different times: the step is finished, then the switch
    ("tp1.pp2.dp2", ["w0", "w1", "w2", "w3"], "tp1.pp2.dp1", ["w0", "w1"], False, False),
])
def test_a_shrink_gives_up_the_step_in_progress_and_the_new_layout_finishes_it_on_the_same_loss_curve(
        tmp_path, monkeypatch, layout, workers, after, kept, gives_up, keeps_work) -> None:
    """``shrink_gives_up_step`` (the launch default): a step is 4 micro-batches of >= 0.6 s; a shrink
    posted while a step is in progress (step 2 waits at its second micro-batch: for the request with
    one stage, until the shrink is posted with two) switches at that step (given up, not finished)
    on one pipeline stage, after it with two. A DP shrink keeps the work of the micro-batches done
    (the new layout computes only the rest; the pause counts from the boundary); a TP change redoes
    the step whole (the pause counts from the step's begin). Either way the step counter and loss
    curve are those of a job never rescaled."""
    assert OPTS.shrink_gives_up_step
    # step 2 waits at its second micro-batch: the shrink lands inside it
    monkeypatch.setenv("ELASTIC_TEST_HOLD_STEP", "2")
    monkeypatch.setenv("ELASTIC_TEST_HOLD_MARK", str(tmp_path))
    release = tmp_path / "posted"
    if not gives_up:  # no give-up request comes: the step waits for the test's word that the shrink is posted
        monkeypatch.setenv("ELASTIC_TEST_HOLD_RELEASE", str(release))
    h = padded_job(tmp_path, monkeypatch, "giveup", "held_micro_batches", 0.6)
    try:
        h.start(layout, workers, timeout=180)
        h.wait_step(1, timeout=120)  # step 1 done: step 2 is being computed, and ends only once released
        in_progress = h.status().step + 1
        # every member of the first stage holds at micro-batch 1 (with one stage, every member:
        # micro-batch 0's work is there to keep); a later stage waits for the first one's output
        holders = len(workers) // Layout.parse(layout).pp
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.held"))) < holders and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(tmp_path.glob("*.held"))) == holders
        if not gives_up:  # step 2 may end once the shrink is posted: no member has begun step 3 by then
            post = h.coordinator.directive

            def post_then_release(*args, **kwargs):
                d = post(*args, **kwargs)
                release.touch()
                return d

            h.coordinator.directive = post_then_release
        shrink = h.rescale(after, kept, timeout=120, wait_first_step=False,
                           give_up_step=True if gives_up and not keeps_work else None)
        rec = shrink.record
        if gives_up:
            assert (shrink.switch_step, rec.gave_up_step) == (in_progress, in_progress) == (2, 2), rec
            assert rec.gave_up_seconds > 0.0, rec
            if keeps_work:  # given up at micro-batch 1..3 of 4: that many kept, the pause from the boundary
                assert 1 <= rec.kept_micro_batches <= 3 and shrink.pause_seconds < rec.gave_up_seconds, rec
            else:
                assert rec.kept_micro_batches == 0 and shrink.pause_seconds >= rec.gave_up_seconds, rec
        else:
            want = (in_progress + 1, None, 0.0)
            assert (shrink.switch_step, rec.gave_up_step, rec.gave_up_seconds) == want == (3, None, 0.0), rec
        assert all(h.procs[w].poll() == 0 for w in workers if w not in kept)  # the leavers are gone
        h.wait_step(shrink.switch_step + 2, timeout=120)
    finally:
        release.touch()  # a failed assertion leaves no step held
        final = h.stop()
    assert final.error is None
    assert_one_switch_on_the_reference_curve(h, shrink.switch_step)


@pytest.mark.parametrize("layout, workers, after, grown", [
    ("tp1.pp1.dp1", ["w0"], "tp1.pp1.dp2", ["w0", "w1"]),
    # tensor parallel: the joiners are a whole replica; each TP rank's kept work reaches its coordinate
    ("tp2.pp1.dp1", ["w0", "w1"], "tp2.pp1.dp2", ["w0", "w1", "w2", "w3"]),
])
def test_a_grow_gives_up_the_step_in_progress_and_the_joiners_finish_it_from_the_kept_work_on_the_same_curve(
        tmp_path, monkeypatch, layout, workers, after, grown) -> None:
    """``grow_gives_up_step`` (the launch default): a step is 8 micro-batches of >= 0.4 s; a grow posted
    inside one (once its joiners registered) switches at that step: the members give it up at their
    next micro-batch keeping the work done, and the new layout, joiners included, computes only the
    samples left. The pause counts from the boundary, and the step counter and loss curve are those
    of a job never rescaled."""
    assert OPTS.grow_gives_up_step
    # step 2 (begun once step 1 is done) waits at its second micro-batch for the give-up request:
    # the grow, posted once its joiners registered, always lands inside it
    monkeypatch.setenv("ELASTIC_TEST_HOLD_STEP", "2")
    monkeypatch.setenv("ELASTIC_TEST_HOLD_MARK", str(tmp_path))
    h = padded_job(tmp_path, monkeypatch, "growkeep", "held_checked_micro_batches", 0.4)
    try:
        h.start(layout, workers, timeout=180)
        h.wait_step(1, timeout=120)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.held"))) < len(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        grow = h.rescale(after, grown, timeout=120)
        assert grow.switch_step == 2, grow
        rec = grow.record
        assert rec.ok and rec.joiners == [w for w in grown if w not in workers], rec
        assert rec.gave_up_step == grow.switch_step and 1 <= rec.kept_micro_batches <= 7, rec
        assert grow.pause_seconds < rec.gave_up_seconds, rec  # from the boundary: the work done was kept
        assert {s.get("kept_micro_batches") for s in rec.worker_stats.values()} == {rec.kept_micro_batches}, rec
        h.wait_step(grow.switch_step + 1, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None
    assert_one_switch_on_the_reference_curve(h, grow.switch_step)


def test_frozen_worker_fails_the_job_by_heartbeat_loss(tmp_path) -> None:
    job = ProcessJobHandle("frozen", CFG, options=NO_RECOVER, log_dir=str(tmp_path))
    job.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
    job.wait_step(1, timeout=120)
    os.kill(job.pid("w1"), signal.SIGSTOP)  # alive but silent: only the heartbeat can tell
    try:
        assert job.coordinator.wait_phase(["failed"], timeout=60) == "failed"
        st = job.status()
        assert "worker w1 lost: no heartbeat" in (st.error or ""), st.error
        # the survivor sits in a collective with the frozen peer; it must leave on its own
        deadline = time.monotonic() + 40
        while job.procs["w0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.procs["w0"].poll() is not None, "w0 must not outlive a failed job"
    finally:
        os.kill(job.pid("w1"), signal.SIGKILL)
        job.stop()


def test_worker_killed_mid_step_fails_the_job_with_the_reason(tmp_path) -> None:
    h = ProcessJobHandle("killed", CFG, options=NO_RECOVER, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(2, timeout=120)
        os.kill(h.pid("w1"), signal.SIGKILL)
        assert h.coordinator.wait_phase(["failed"], timeout=60) == "failed"
        st = h.status()
        # the first reason is the launcher's or the survivor's (gloo: the socket was closed or reset)
        assert any("w1" in f for f in st.failures) or re.search(r"(closed|reset) by peer", st.error or ""), \
            st.failures
        assert any("worker w1 exited with signal 9" in f or "worker w1 lost" in f for f in _eventually(h)), \
            st.failures
        deadline = time.monotonic() + 40
        while h.procs["w0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert h.procs["w0"].poll() is not None, "the survivor must exit, not hang"
    finally:
        h.stop()


def _eventually(h: ProcessJobHandle, seconds: float = 10.0) -> list[str]:
    """The launcher's own report of the death follows the survivor's within its 0.2 s watch period."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        fs = h.status().failures
        if any("worker w1" in f for f in fs):
            return fs
        time.sleep(0.1)
    return h.status().failures
