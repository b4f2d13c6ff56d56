"""Sharded checkpoints (elastic.train.checkpoint): saved under one layout, read back under any other.

No process group: each rank's state is cut out of known global tensors exactly as the
sharding spec says, written as that rank would, and read back for every rank of another
layout, which must get exactly its boxes of the same global tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from elastic.model import Layout, load_model
from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS, sharding_spec
from elastic.train import checkpoint as ck

MODEL = load_model("tiny")
F32 = {k: torch.float32 for k in FP32_KINDS}


def _globals(kinds=FP32_KINDS) -> dict:
    g = torch.Generator().manual_seed(7)
    spec = sharding_spec(MODEL, Layout.parse("tp1.pp1.dp1"), kinds)
    return {(t.name, k): torch.randn(t.shape, generator=g) for t in spec.tensors for k in kinds}


def _cut(glob: dict, spec, rank: int) -> dict:
    return {key: glob[key][tuple(slice(a, b) for a, b in box)].clone()
            for key, box in spec.rank_pieces(rank).items()}


def _save(root, step: int, layout: str, glob: dict, kinds=FP32_KINDS, ranks=None) -> None:
    spec = sharding_spec(MODEL, Layout.parse(layout), kinds)
    for r in range(spec.layout.world_size) if ranks is None else ranks:
        ck.write_rank(root, step, spec, r, ck.snapshot(spec, r, _cut(glob, spec, r)), job="j")


@pytest.mark.parametrize("saved, loaded", [
    ("tp2.pp2.dp2", "tp1.pp1.dp1"),
    ("tp1.pp1.dp1", "tp2.pp2.dp2"),
    ("tp2.pp1.dp2.z1", "tp1.pp2.dp3"),  # ZeRO-1 slices on disk, replicated optimizer back
    ("tp1.pp2.dp2", "tp2.pp1.dp2.z1"),
    ("tp2.pp2.dp1", "tp2.pp2.dp1"),
])
def test_a_checkpoint_saved_under_one_layout_loads_exactly_under_another(tmp_path, saved, loaded) -> None:
    glob = _globals()
    _save(tmp_path, 40, saved, glob)
    ref = ck.latest(tmp_path)
    assert ref is not None and (ref.step, ref.layout) == (40, saved)
    spec = sharding_spec(MODEL, Layout.parse(loaded), FP32_KINDS)
    for r in range(spec.layout.world_size):
        got = ck.load_rank(ref, MODEL, spec.layout, r, F32)
        want = _cut(glob, spec, r)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (r, key)


def test_the_files_hold_one_copy_of_the_state_spread_over_the_replicas(tmp_path) -> None:
    """Replicas, TP-replicated norms and a tied embedding's second copy are not written twice;
    what the replicas all hold is split among them, so each copies and writes 1/dp of it."""
    glob = _globals()
    total = sum(t.numel() * t.element_size() for t in glob.values())
    for layout in ("tp1.pp1.dp4", "tp2.pp2.dp2.z1", "tp2.pp1.dp2"):
        _save(tmp_path / layout, 1, layout, glob)
        ref = ck.latest(tmp_path / layout)
        per_rank = []
        for r in range(Layout.parse(layout).world_size):
            doc = torch.load(ck.rank_file(ref.path, r), weights_only=True)
            per_rank.append(sum(t.numel() * t.element_size() for _, t in doc["pieces"].values()))
        assert sum(per_rank) == total, layout
        if layout == "tp1.pp1.dp4":
            assert max(per_rank) < 1.05 * total / 4, per_rank


def test_buffers_prepared_for_a_layout_are_what_its_snapshot_fills() -> None:
    """After a rescale the agent allocates the next checkpoint's host buffers in the background;
    the snapshot must fill exactly those (no allocation while the step waits) with the same bytes."""
    glob = _globals()
    spec = sharding_spec(MODEL, Layout.parse("tp2.pp2.dp2.z1"), FP32_KINDS)
    for r in range(spec.layout.world_size):
        state = _cut(glob, spec, r)
        bufs = ck.host_buffers(ck.buffer_shapes(spec, r, state))
        got = ck.snapshot(spec, r, state, into=bufs)
        want = ck.snapshot(spec, r, state)
        assert got.keys() == want.keys() == bufs.keys()
        for key in want:
            assert got[key] is bufs[key] and torch.equal(got[key], want[key]), (r, key)


def test_an_incomplete_checkpoint_is_ignored_and_pruned_once_a_newer_one_is_complete(tmp_path) -> None:
    glob = _globals()
    _save(tmp_path, 10, "tp1.pp1.dp2", glob)
    _save(tmp_path, 20, "tp1.pp1.dp2", glob, ranks=[0])  # its rank 1 died while writing
    assert ck.latest(tmp_path).step == 10
    _save(tmp_path, 30, "tp1.pp1.dp2", glob)
    _save(tmp_path, 40, "tp1.pp1.dp2", glob, ranks=[1])  # being written now
    gone = ck.prune(tmp_path, keep=1)
    assert sorted(os.path.basename(p) for p in gone) == ["step-00000010-tp1.pp1.dp2", "step-00000020-tp1.pp1.dp2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030-tp1.pp1.dp2", "step-00000040-tp1.pp1.dp2"]
    assert ck.latest(tmp_path).step == 30
    assert not list(tmp_path.glob("*/*.tmp*")), "a rank file appears under its final name only once written"


def test_nothing_to_resume_from(tmp_path) -> None:
    assert ck.latest(tmp_path / "missing") is None
    (tmp_path / "step-junk").mkdir()
    assert ck.latest(tmp_path) is None and ck.prune(tmp_path, 2) == []


def test_a_checkpoint_of_another_model_or_dtype_is_refused_with_the_reason(tmp_path) -> None:
    _save(tmp_path, 5, "tp1.pp1.dp1", _globals())
    ref = ck.latest(tmp_path)
    other = MODEL.model_copy(update={"name": "tiny-wide", "ffn_hidden": MODEL.ffn_hidden * 2})
    with pytest.raises(ck.CheckpointError, match="saved for model 'tiny'.*not this job's 'tiny-wide'"):
        ck.load_rank(ref, other, Layout.parse("tp1.pp1.dp1"), 0, F32)
    mixed = {k: (torch.bfloat16 if k == "param" else torch.float32) for k in MIXED_KINDS}
    with pytest.raises(ck.CheckpointError, match="no 'master' state saved"):
        ck.load_rank(ref, MODEL, Layout.parse("tp1.pp1.dp1"), 0, mixed)
    victim = ck.rank_file(ref.path, 0)
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match="cannot read rank-00000.pt"):
        ck.load_rank(ref, MODEL, Layout.parse("tp1.pp1.dp1"), 0, F32)


def test_a_checkpoint_dir_that_cannot_be_written_refuses_the_start(tmp_path) -> None:
    from elastic.train.rendezvous import Coordinator, CoordinatorSettings

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    c = Coordinator("j", {"model": "tiny"}, CoordinatorSettings(checkpoint=ck.CheckpointSettings(str(blocker / "ck"))))
    with pytest.raises(ValueError, match="checkpoint dir .*a-file/ck' is not writable here"):
        c.start()
    ok = ck.CheckpointSettings(str(tmp_path / "new" / "ck"))
    ok.check_writable()
    assert (tmp_path / "new" / "ck").is_dir() and not list((tmp_path / "new" / "ck").iterdir())


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="every_steps=0"):
        ck.CheckpointSettings("/x", every_steps=0)
    with pytest.raises(ValueError, match="keep=0"):
        ck.CheckpointSettings("/x", keep=0)
    s = ck.CheckpointSettings("/x", 7, 3)
    assert ck.CheckpointSettings.from_json(s.to_json()) == s and ck.CheckpointSettings.from_json(None) is None


# ---- a real job (worker processes, gloo on loopback) ------------------------------------------

def _cfg():
    from elastic.train.engine import TrainConfig

    return TrainConfig(model=MODEL, global_batch=8, micro_batch=1)


def _wait_phase(h, phases: set[str], timeout: float):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = h.status()
        if st.phase in phases:
            return st
        time.sleep(0.05)
    raise AssertionError(f"job not {phases} within {timeout} s: {h.status()}")


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("coordinator_sees", [True, False], ids=["coordinator-lists", "workers-report"])
def test_a_job_no_replica_can_recover_starts_again_from_its_checkpoint_on_another_layout(
        tmp_path, coordinator_sees) -> None:
    """``tp2.pp1.dp1`` holds one copy of the state: a killed worker fails the job. With checkpoints
    every 3 steps its next start -- on ``tp1.pp2.dp2``, four workers -- begins at the newest complete
    one, and every step's loss, before the loss and after the restart, is a never-interrupted
    single-process run's. ``workers-report``: the coordinator does not look at the directory (as
    the Kubernetes operator, which does not mount the workers' volume): the workers tell it what
    they see when they register."""
    import signal
    import time

    from elastic.train.launch import LaunchOptions, ProcessJobHandle
    from tests.train import _mp

    cfg = _cfg()
    settings = ck.CheckpointSettings(str(tmp_path / "ck"), every_steps=3, keep=2, coordinator_sees=coordinator_sees)
    opts = LaunchOptions(pg_timeout_s=60, heartbeat_timeout_s=30, join_timeout_s=120, checkpoint=settings)
    h = ProcessJobHandle("ck", cfg, options=opts, log_dir=str(tmp_path / "first"))
    try:
        h.start("tp2.pp1.dp1", ["w0", "w1"], timeout=180)
        deadline = time.monotonic() + 120
        while (ref := ck.latest(settings.dir)) is None or ref.step < 6:
            assert time.monotonic() < deadline, f"no complete checkpoint at step 6: {ck.latest(settings.dir)}"
            time.sleep(0.05)
        h.wait_step(ref.step + 1, timeout=60)  # the steps after it are lost with the worker
        # the coordinator knows it from the workers' step reports, and publishes it
        st = h.status()
        assert st.checkpoint_step is not None and st.checkpoint_step >= ref.step and st.checkpoint_step % 3 == 0, st
        gauge = h.coordinator.metrics.registry.get_sample_value("elastic_training_checkpoint_step", {"job": "ck"})
        assert gauge >= ref.step, gauge
        os.kill(h.pid("w1"), signal.SIGKILL)
        failed = _wait_phase(h, {"failed"}, timeout=90)
    finally:
        h.stop()
    first = h.history()
    assert failed.error, "the loss of a dp=1 worker fails the job (nothing holds a copy of its state)"
    ref = ck.latest(settings.dir)
    assert ref is not None and ref.layout == "tp2.pp1.dp1" and ref.step % 3 == 0 and ref.step < len(first)
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert len([n for n in kept if ck.latest(tmp_path / "ck").path.endswith(n)]) == 1 and len(kept) <= 3, kept

    h2 = ProcessJobHandle("ck", cfg, options=opts, log_dir=str(tmp_path / "second"))
    try:
        h2.start("tp1.pp2.dp2", ["v0", "v1", "v2", "v3"], timeout=180)
        h2.wait_step(ref.step + 3, timeout=120)
        assert h2.coordinator.resumed_from == ref
    finally:
        final = h2.stop()
    assert final.error is None, final.error
    second = h2.history()
    assert [r.step for r in second] == list(range(ref.step, ref.step + len(second))), "it goes on at the checkpoint"
    assert {r.layout for r in second} == {Layout.parse("tp1.pp2.dp2")}
    want = _mp.reference_losses(cfg, second[-1].step + 1)
    for r in first + second:
        assert r.loss == pytest.approx(want[r.step], abs=1e-4), f"step {r.step} ({r.layout}): {r.loss} vs {want[r.step]}"
    # the requested stop wrote a last checkpoint where the second run stopped
    last = ck.latest(settings.dir)
    assert (last.step, last.layout) == (second[-1].step + 1, "tp1.pp2.dp2"), last
    print(f"failed at step {len(first)}, started again at {ref.step} from {ref.path}; stopped at {last.step}")


def test_a_start_without_a_checkpoint_begins_at_step_0_and_the_coordinator_names_the_settings(tmp_path) -> None:
    from elastic.train.rendezvous import Coordinator, CoordinatorSettings, parse

    settings = ck.CheckpointSettings(str(tmp_path / "none-yet"), every_steps=5)
    c = Coordinator("j", {"model": "tiny"}, CoordinatorSettings(checkpoint=settings))
    d = c.directive(1, "tp1.pp1.dp1", ["w0"])
    assert d.switch_step == 0 and d.resume is None and c.resumed_from is None
    assert c.receive(parse("register", {"worker": "w0"})).checkpoint == settings.to_json()
    assert c.status().checkpoint_step == -1
    assert Coordinator("k", {"model": "tiny"}).status().checkpoint_step is None  # off

    _save(tmp_path / "none-yet", 15, "tp1.pp1.dp2", _globals())
    c = Coordinator("j", {"model": "tiny"}, CoordinatorSettings(checkpoint=settings))
    d = c.directive(1, "tp1.pp1.dp1", ["w0"])
    assert (d.switch_step, d.resume_layout) == (15, "tp1.pp1.dp2") and d.resume.endswith("step-00000015-tp1.pp1.dp2")
    assert c.status().checkpoint_step == 15
    assert c.metrics.registry.get_sample_value("elastic_training_checkpoint_step", {"job": "j"}) == 15

    # a coordinator that cannot see the directory (the Kubernetes operator) believes its workers
    (tmp_path / "a-file").write_text("")
    blind = ck.CheckpointSettings(str(tmp_path / "a-file" / "not-mounted-here"), coordinator_sees=False)
    c = Coordinator("j", {"model": "tiny"}, CoordinatorSettings(checkpoint=blind))
    c.start()  # no writability check where it cannot look (this path could not be created)
    try:
        ref = ck.CheckpointRef("/ckpt/j/step-00000040-tp1.pp1.dp2", 40, "tp1.pp1.dp2")
        old = ck.CheckpointRef("/ckpt/j/step-00000020-tp1.pp1.dp2", 20, "tp1.pp1.dp2")
        c.receive(parse("register", {"worker": "w0", "checkpoint_latest": old.to_json()}))  # its view lagged
        c.receive(parse("register", {"worker": "w1", "checkpoint_latest": ref.to_json()}))
        c.receive(parse("register", {"worker": "w2"}))  # sees nothing: not a member below anyway
        d = c.directive(1, "tp1.pp1.dp2", ["w0", "w1"])
        assert (d.resume, d.switch_step, d.resume_layout) == (ref.path, 40, "tp1.pp1.dp2")
    finally:
        c.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_reaches_max_steps_leaves_a_checkpoint_of_its_last_state(tmp_path) -> None:
    """The finish writes one at ``max_steps`` even between two periodic ones: the trained model."""
    import time

    from elastic.train.launch import LaunchOptions, ProcessJobHandle

    settings = ck.CheckpointSettings(str(tmp_path / "ck"), every_steps=100)
    h = ProcessJobHandle("fin", _cfg(), options=LaunchOptions(max_steps=5, checkpoint=settings),
                         log_dir=str(tmp_path))
    try:
        h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        deadline = time.monotonic() + 120
        while h.status().phase != "finished":
            assert time.monotonic() < deadline, h.status()
            time.sleep(0.05)
        h._wait_gone(["w0", "w1"], 30, kill=False)  # the workers write it before they exit
    finally:
        h.stop()
    ref = ck.latest(settings.dir)
    assert ref is not None and (ref.step, ref.layout) == (5, "tp1.pp1.dp2"), ref
