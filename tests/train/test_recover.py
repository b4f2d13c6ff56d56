"""A worker killed mid-training does not cost the job its progress: real worker processes, gloo on loopback.

``tp1.pp2.dp2`` on four processes; one is SIGKILLed at an arbitrary point of a step. Its peers'
collectives break (gloo sees the closed connection at once), every survivor shuts its
communicators down and reports what it holds, and the coordinator resumes the job on the
intact replica (``tp1.pp2.dp1``) at the step they all reach: the state moves from survivors
as in a rescale, no checkpoint, no restart. The step counter goes on and every step's loss
equals a never-interrupted single-process run (1e-4, fp32).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from elastic.model import Layout, load_model
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from elastic.train.rendezvous import RescaleFailed
from tests.train import _mp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)
W4 = ["w0", "w1", "w2", "w3"]


def _assert_one_loss_curve(h) -> None:
    """Every step on record once, in order, each loss the never-rescaled run's."""
    history = h.history()
    assert [r.step for r in history] == list(range(len(history))), "a step was lost or repeated"
    ref = _mp.reference_losses(CFG, len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def _faulty_job(tmp_path, monkeypatch, fault: str, name: str, **opts) -> ProcessJobHandle:
    """A job whose workers die at ``fault`` (``ELASTIC_FAULT_EXCHANGE``), with verified reshards."""
    monkeypatch.setenv("ELASTIC_FAULT_EXCHANGE", fault)
    o = LaunchOptions(**{"pg_timeout_s": 90, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30,
                         "join_timeout_s": 120, "verify_reshard": True, **opts})
    return ProcessJobHandle(name, CFG, options=o, log_dir=str(tmp_path))


def _wait_recovered(h: ProcessJobHandle, generation: int, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = h.status()
        if st.phase == "running" and st.generation >= generation:
            return st
        assert st.phase in ("running", "recovering"), (st.phase, st.error)
        time.sleep(0.05)
    raise AssertionError(f"not recovered within {timeout} s: {h.status()}")


@pytest.mark.parametrize("layout, victim, after", [
    ("tp1.pp2.dp2", "w3", "tp1.pp2.dp1"),  # a last-stage rank of replica 1
    ("tp1.pp2.dp2", "w0", "tp1.pp2.dp1"),  # the first rank of replica 0
    ("tp2.pp1.dp2", "w1", "tp2.pp1.dp1"),  # a TP peer: its replica is gone, the other TP pair goes on
    ("tp1.pp1.dp4", "w2", "tp1.pp1.dp2"),  # 3 survivors: as many replicas as the global batch splits into
    ("tp1.pp2.dp2", "w1+w2", "tp1.pp2.dp1"),  # one stage of each replica at once: the halves still make one
])
def test_a_killed_worker_is_recovered_from_the_surviving_replica_on_the_same_loss_curve(
        tmp_path, layout, victim, after) -> None:
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, verify_reshard=True)
    h = ProcessJobHandle(f"recover-{victim}", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start(layout, W4, timeout=180)
        h.wait_step(3, timeout=120)
        t0 = time.monotonic()
        victims = victim.split("+")
        for v in victims:
            os.kill(h.pid(v), signal.SIGKILL)  # somewhere inside a step
        st = _wait_recovered(h, 2)
        took = time.monotonic() - t0
        assert st.layout == Layout.parse(after) and not set(victims) & set(st.workers)
        rec = h.coordinator.rescale_record(2)
        assert rec is not None and rec.ok and f"lost {', '.join(victims)}" in rec.recovery, rec
        assert rec.bytes_moved == rec.planned_bytes  # the state moved from survivors, nothing from disk
        h.wait_step(rec.switch_step + 3, timeout=120)
        leavers = [w for w in W4 if w not in st.workers and w not in victims]
        for w in leavers:
            assert h.procs[w].poll() == 0, f"survivor {w} should have left cleanly"
        print(f"recovered from the loss of {victim} in {took:.2f} s at step {rec.switch_step} "
              f"({rec.bytes_moved} bytes moved, pause {rec.pause_seconds:.3f} s)")
    finally:
        final = h.stop()
    assert final.error is None, final.error
    history = h.history()
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))), f"a step was lost or repeated: {steps}"
    assert {r.layout for r in history} == {Layout.parse(layout), Layout.parse(after)}
    ref = _mp.reference_losses(CFG, len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def test_a_frozen_worker_is_given_up_by_its_heartbeat_killed_and_the_job_recovers_without_it(tmp_path) -> None:
    """SIGSTOP: the process lives and holds its sockets, so its peers' collectives do not break on
    their own. The heartbeat gives it up, the launcher kills it, the survivors' collectives break
    and they recover on the intact replica."""
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_interval_s=0.5, heartbeat_timeout_s=4, join_timeout_s=60)
    h = ProcessJobHandle("recover-frozen", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp2.dp2", W4, timeout=180)
        h.wait_step(2, timeout=120)
        os.kill(h.pid("w1"), signal.SIGSTOP)
        st = _wait_recovered(h, 2, timeout=60)
        assert st.layout == Layout.parse("tp1.pp2.dp1") and "w1" not in st.workers
        rec = h.coordinator.rescale_record(2)
        assert "lost w1" in rec.recovery and "no heartbeat" in rec.recovery, rec.recovery
        assert h.procs["w1"].poll() is not None, "the frozen worker must have been killed"
        h.wait_step(rec.switch_step + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    history = h.history()
    assert [r.step for r in history] == list(range(len(history)))
    ref = _mp.reference_losses(CFG, len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def history_seconds(h: ProcessJobHandle) -> float:
    """Median seconds of the steps on record."""
    secs = sorted(r.seconds for r in h.history())
    return secs[len(secs) // 2]


@pytest.mark.parametrize("layout, workers, after", [
    ("tp1.pp1.dp2", ["w0", "w1"], "tp1.pp1.dp1"),  # no collective before the gradient all-reduce
    # 1F1B: a stage gives up between micro-batches; its pipeline peer then breaks in a send/recv with it
    ("tp1.pp2.dp2", W4, "tp1.pp2.dp1"),
])
def test_a_survivor_gives_a_long_step_up_as_soon_as_its_peer_is_lost_instead_of_computing_it_to_the_end(
        tmp_path, layout, workers, after) -> None:
    """A survivor of the intact replica runs no collective with the lost worker until the step's
    gradient all-reduce, so it would compute every micro-batch of the step before noticing. The
    coordinator tells it through its heartbeat (a long poll answered when the recovery starts):
    it gives the step up at its next micro-batch, nothing of its state changed, and the step is
    redone on the recovered layout. (With a shrink's give-up checks on, the default, a one-stage
    survivor meets its peers in a collective before every micro-batch and breaks there at once;
    they are off here, as on a layout with pipeline stages, which never has them.)"""
    cfg = TrainConfig(model=load_model("tiny"), global_batch=240, micro_batch=1)  # 120 micro-batches a replica
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120, shrink_gives_up_step=False)
    h = ProcessJobHandle("recover-long", cfg, options=opts, log_dir=str(tmp_path))
    try:
        h.start(layout, workers, timeout=180)
        h.wait_step(1, timeout=120)
        time.sleep(0.05)  # inside step 2 (or 3), early in its micro-batches
        t0 = time.monotonic()
        os.kill(h.pid("w1"), signal.SIGKILL)  # replica 1 (pp1: its only rank; pp2: its first stage)
        st = _wait_recovered(h, 2)
        took = time.monotonic() - t0
        assert (st.layout, st.workers) == (Layout.parse(after), ["w0"] if after.startswith("tp1.pp1") else ["w0", "w2"])
        rec = h.coordinator.rescale_record(2)
        assert rec is not None and rec.ok and "lost w1" in rec.recovery
        h.wait_step(rec.switch_step + 1, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    # Every survivor is told; on pp2 the first stage to reach a micro-batch boundary gives up and
    # drops its communicators, so its pipeline peer breaks in a send/recv with it a few ms later
    # (lockstep 1F1B: within pp micro-batches of the other's). Which of the two it is, is a race.
    survivors = st.workers
    logs = {w: (tmp_path / f"{w}.log").read_text() for w in survivors}
    gave_up = {w: re.search(r"step (\d+) given up at micro-batch (\d+) of (\d+)", text) for w, text in logs.items()}
    first = next((w for w in survivors if gave_up[w]), None)
    assert first is not None, "no survivor gave its step up:\n" + "\n".join(
        f"--- {w}\n{text[-2000:]}" for w, text in logs.items())
    step, micro, of = (int(x) for x in gave_up[first].groups())
    assert of == 120 and micro < of and step == rec.switch_step, (step, micro, of, rec.switch_step)
    for w in survivors:
        assert gave_up[w] or re.search(rf"worker {w}: step {step} broke", logs[w]), \
            f"{w} neither gave step {step} up nor broke in it:\n{logs[w][-2000:]}"
    print(f"{layout}: {first}'s step {step} given up at micro-batch {micro} of {of}; recovery pause {rec.pause_seconds:.3f} s, "
          f"first step on {st.layout} done {took:.2f} s after the kill (a step takes {history_seconds(h):.2f} s)")
    history = h.history()
    assert [r.step for r in history] == list(range(len(history)))
    ref = _mp.reference_losses(cfg, len(history), one_micro_batch=True)
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


@pytest.mark.parametrize("start, grow_to, fault, after, survivors", [
    # a joiner dies inside the exchange: the old members still hold everything, the job goes on as it was
    ("tp1.pp1.dp2", ("tp1.pp1.dp4", W4), "w2:2:exchange", "tp1.pp1.dp2", ["w0", "w1"]),
    # a joiner dies before it joins the exchange's group: the others give that rendezvous up at once
    # (AbortableStore) instead of waiting for its key until pg_timeout_s
    ("tp1.pp1.dp2", ("tp1.pp1.dp4", W4), "w2:2:group", "tp1.pp1.dp2", ["w0", "w1"]),
    # so does an old member: the job recovers on its other replica
    ("tp1.pp1.dp2", ("tp1.pp1.dp4", W4), "w1:2:group", "tp1.pp1.dp1", ["w0"]),
    # an old member dies inside an exchange with joiners (a transient group carries it)
    ("tp1.pp1.dp2", ("tp1.pp1.dp4", W4), "w1:2:exchange", "tp1.pp1.dp1", ["w0"]),
    # an old member dies inside the exchange (the old default group carries it: no joiner)
    ("tp1.pp1.dp4", ("tp2.pp1.dp2", W4), "w1:2:exchange", "tp1.pp1.dp2", None),
    # a leaver dies after its part, before the commit: the others wait at the commit and roll back
    ("tp1.pp1.dp4", ("tp1.pp1.dp2", ["w0", "w1"]), "w3:2:commit", "tp1.pp1.dp2", None),
])
def test_a_worker_lost_inside_a_rescale_rolls_the_job_back_and_it_recovers_on_the_same_loss_curve(
        tmp_path, monkeypatch, start, grow_to, fault, after, survivors) -> None:
    """A rescale of a job whose state is replicated is transactional: every member keeps its old
    state whole (no recycling of dropped shards) until all have exchanged their part. A member
    lost before that commit rolls the job back to the old generation, which recovers from its
    survivors as from a loss in training: no step lost, the same loss curve."""
    monkeypatch.setenv("ELASTIC_FAULT_EXCHANGE", fault)
    victim = fault.split(":")[0]
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_interval_s=0.5, heartbeat_timeout_s=30, join_timeout_s=120,
                         verify_reshard=True)
    h = ProcessJobHandle(f"rollback-{victim}", CFG, options=opts, log_dir=str(tmp_path))
    workers = W4 if start.endswith("dp4") else ["w0", "w1"]
    try:
        h.start(start, workers, timeout=180)
        h.wait_step(2, timeout=120)
        t0 = time.monotonic()
        with pytest.raises(RescaleFailed, match="rolled back to generation 1"):
            h.rescale(grow_to[0], grow_to[1], timeout=120)
        st = _wait_recovered(h, 3)
        took = time.monotonic() - t0
        # a wait on the dead peer until a group's timeout would take pg_timeout_s at least: the
        # bound is that wait itself, not a guess at how fast this machine recovers
        assert took < opts.pg_timeout_s, f"{took:.1f} s: someone waited on the dead peer until a timeout"
        assert st.layout == Layout.parse(after) and victim not in st.workers, st
        if survivors is not None:
            assert st.workers == survivors
        failed = h.coordinator.rescale_record(2)
        assert failed is not None and failed.ok is False and "rolled back" in failed.reason, failed
        rec = h.coordinator.rescale_record(3)
        assert rec is not None and rec.ok and "rescale to generation 2 broke" in rec.recovery, rec
        assert f"lost {victim}" in rec.recovery or victim in grow_to[1] and victim not in workers, rec.recovery
        assert rec.from_layout == Layout.parse(start)  # recovered from the old generation's state
        h.wait_step(rec.switch_step + 2, timeout=120)
        print(f"{start} -> {grow_to[0]} with {fault}: rolled back, recovered on {st.layout} at step "
              f"{rec.switch_step} ({rec.bytes_moved} bytes moved, pause {rec.pause_seconds:.3f} s) "
              f"{took:.2f} s after the rescale began")
    finally:
        final = h.stop()
    assert final.error is None, final.error
    history = h.history()
    assert [r.step for r in history] == list(range(len(history))), "a step was lost or repeated"
    assert {r.layout for r in history} == {Layout.parse(start), Layout.parse(after)}
    ref = _mp.reference_losses(CFG, len(history))
    for r, want in zip(history, ref, strict=True):
        assert r.loss == pytest.approx(want, abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want}"


def test_a_joiner_lost_inside_gloos_rendezvous_costs_its_peers_pg_timeout_not_the_job(tmp_path, monkeypatch) -> None:
    """A member lost after the reshard group's roll call, before its own part of gloo's C++
    rendezvous, leaves the others blocked there until pg_timeout_s (nothing in Python can give
    it up). They still beat, saying they build groups: the coordinator waits for them beyond
    recovery_timeout_s (here 3 s < pg_timeout_s = 8 s) instead of giving them up, which left no
    survivor and failed the job (seen by the soak, 2 of 73 mid-rescale kills). Once their
    rendezvous times out they report, the rescale is rolled back, the job goes on."""
    h = _faulty_job(tmp_path, monkeypatch, "w2:2:rendezvous", "rdv", pg_timeout_s=8, heartbeat_timeout_s=3)
    opts = h.opts
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(2, timeout=120)
        t0 = time.monotonic()
        with pytest.raises(RescaleFailed, match="rolled back to generation 1"):
            h.rescale("tp1.pp1.dp4", W4, timeout=120)
        st = _wait_recovered(h, 3)
        took = time.monotonic() - t0
        assert (st.layout, st.workers) == (Layout.parse("tp1.pp1.dp2"), ["w0", "w1"]), st
        assert took >= opts.pg_timeout_s * 0.8, f"{took:.1f} s: the rendezvous should have held them pg_timeout_s"
        rec = h.coordinator.rescale_record(3)
        h.wait_step(rec.switch_step + 2, timeout=120)
        print(f"rolled back and recovered on {st.layout} {took:.1f} s after the rescale began (pg_timeout_s "
              f"{opts.pg_timeout_s:g}, recovery timeout {h.coordinator.settings.recovery_timeout:g})")
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _assert_one_loss_curve(h)


@pytest.mark.parametrize("fault", [
    "w3:2:engine",  # once its engine is built: its peers are in their first step with it
    "w3:2:init_pg",  # before it joins the new default group: its peers give that rendezvous up at once
    # after the default group, before the engine's own (DP) group: its peers give that up at once too
    # (each group a new engine builds holds a roll call; seen by the soak as a 120 s wait for a dead joiner)
    "w3:2:groups",
])
def test_a_worker_lost_in_the_first_step_after_a_committed_rescale_is_recovered_from_the_new_generation(
        tmp_path, monkeypatch, fault) -> None:
    """Past the commit the new generation's state is whole on its members: a joiner lost before
    the new layout's first step (while the groups are built, or in the step) is recovered from
    the new generation, within seconds (nobody waits on it until pg_timeout_s); the rescale
    itself counts as done."""
    h = _faulty_job(tmp_path, monkeypatch, fault, "first-step-loss")
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        h.wait_step(2, timeout=120)
        t0 = time.monotonic()
        h.rescale("tp1.pp1.dp4", W4, timeout=120)
        st = _wait_recovered(h, 3)
        took = time.monotonic() - t0
        # (a wait until a group's timeout would take pg_timeout_s at least)
        assert took < h.opts.pg_timeout_s, f"{took:.1f} s: someone waited on the dead peer until a timeout"
        assert st.layout == Layout.parse("tp1.pp1.dp2") and "w3" not in st.workers, st
        done = h.coordinator.rescale_record(2)
        assert done.ok and "lost before its first step finished" in done.reason, done
        rec = h.coordinator.rescale_record(3)
        # only w3: peers still building their groups with it hold the new state and report, not fail
        assert rec.ok and rec.recovery.startswith("lost w3 (") and rec.from_layout == Layout.parse("tp1.pp1.dp4"), rec.recovery
        h.wait_step(rec.switch_step + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _assert_one_loss_curve(h)
