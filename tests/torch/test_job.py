"""A user's own loop as an elastic job: real worker processes, the job's coordinator decides the layouts.

The example Llama's loop (``examples/llama/job.py``: FSDP2 x TP from ``examples/llama/parallel.py``,
float64, a byte-token corpus of standard-library files) runs as ``elastic.torch.Manager`` workers
launched by the trainer's process launcher (``ProcessJobHandle`` with a ``UserJobConfig``: the
same launcher and coordinator as the Ray and Kubernetes backends use). The coordinator rescales
it through layouts that change the world size and the mesh (FSDP4 -> FSDP2 x TP2 -> TP2 on two
workers (two leave) -> FSDP2 x TP2 on four (two join) -> FSDP3): every step's loss equals a
never-rescaled single process to 1e-9, on the same samples with the same learning rate, and
every rescale moves exactly the lower bound of bytes.

Faults (``tests/torch/_user_job.py`` injects them into the workers): a worker SIGKILLed mid-step
of a replicated (DDP-style) layout -> the job goes on from the survivors at the step they reached;
one killed inside a rescale's exchange -> the rescale rolls back and the job trains on; a build
that raises, or builds other keys, on the new layout -> the rescale is abandoned with the reason in
the job's status and the job trains on. Bad input: an entrypoint that does not import, a global
batch that a layout does not divide, a Manager argument that disagrees with the job.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.model import Layout, SpecError, load_model
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from elastic.train.rendezvous import RescaleFailed
from elastic.train.userjob import UserJobConfig
from examples.llama import byo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = load_model("examples/llama/model.json")
MAX_STEPS = 200  # every job here finishes by then (the coordinator's max_steps), and the reference runs as far
W4 = ["w0", "w1", "w2", "w3"]


@pytest.fixture(scope="module")
def reference(pool: Any, corpus: str) -> dict[int, dict[str, Any]]:
    """A never-rescaled single process (the local Manager on one rank), as many steps as a job may run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (out,) = pool.run(byo.train, 1, port, corpus, byo.SINGLE, MAX_STEPS, timeout=300)
    return {int(s): {"loss": out["losses"][s], "samples": out["samples"][s], "lr": out["lrs"][s]}
            for s in out["losses"]}


def _job(name: str, corpus: str, tmp_path: Path, *, entry: str = "tests.torch._user_job:main",
         replicas: bool = False, **opts: Any) -> ProcessJobHandle:
    cfg = UserJobConfig(model=MODEL, global_batch=byo.G, seed=3, micro_batch=1, entrypoint=entry,
                        args=("--corpus", corpus, "--log", str(tmp_path / "steps")), dp_replicas=replicas,
                        mesh_dims={"dp": "dp_replicate" if replicas else "dp_shard", "tp": "tp"})
    o = LaunchOptions(**{"pg_timeout_s": 60, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30,
                         "join_timeout_s": 60, "verify_reshard": True, "max_steps": MAX_STEPS, **opts})
    return ProcessJobHandle(name, cfg, options=o, log_dir=str(tmp_path / "workers"))


def _logged(tmp_path: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted((tmp_path / "steps").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], []).append({**r, "worker": f.stem})
    return out


def _check_curve(h: ProcessJobHandle, tmp_path: Path, reference: dict[int, dict[str, Any]]) -> list[int]:
    """Every step on record once and in order, each loss the single process's (1e-9), every worker's
    log of a step on the single process's samples and learning rate."""
    history = h.history()
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))), f"a step was lost or repeated: {steps}"
    for r in history:
        want = reference[r.step]["loss"]
        assert r.loss is not None and abs(r.loss - want) <= 1e-9 * abs(want), \
            f"step {r.step} ({r.layout}): {r.loss!r} vs one process {want!r}"
    logged = _logged(tmp_path)
    for s in steps:
        assert logged.get(s), f"step {s}: no worker logged it"
        for rec in logged[s]:
            assert rec["samples"] == reference[s]["samples"], f"step {s} ({rec['worker']}): other samples"
            assert rec["lr"] == reference[s]["lr"], f"step {s} ({rec['worker']}): the LR scheduler did not travel"
    return steps


def _wait(pred: Any, h: ProcessJobHandle, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = h.status()
        if pred(st):
            return st
        assert st.phase in ("running", "recovering", "rescaling", "paused"), (st.phase, st.error)
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s: {h.status()}")


def _gate(tmp_path: Path, limit: int | None) -> None:
    """Hold the workers (``ELASTIC_TEST_STEP_GATE``) before asking for step ``limit``; None: let them go."""
    f = tmp_path / "gate"
    tmp = f.with_suffix(".tmp")
    tmp.write_text("" if limit is None else str(limit))
    tmp.replace(f)


def _rescale_held(h: ProcessJobHandle, tmp_path: Path, layout: str, workers: list[str], *,
                  pause: bool = False) -> Any:
    """``h.rescale`` (or ``h.pause()``) with the job held at a step boundary until the directive is
    posted: a grow's joiners (and keepers) take seconds to start, in which the tiny model could
    otherwise run to ``max_steps``."""
    _gate(tmp_path, h.status().step + 2)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = h.pause(timeout=180) if pause else h.rescale(layout, workers, timeout=180)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        _wait(lambda st: st.phase == "rescaling" or not t.is_alive(), h, 240, f"the directive for {layout}")
    finally:
        _gate(tmp_path, None)
        t.join(240)
    assert not t.is_alive(), f"rescale to {layout} did not return"
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_a_user_job_rescaled_by_its_coordinator_through_four_layouts_follows_one_process(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_STEP_GATE", str(tmp_path / "gate"))
    h = _job("byo-chain", corpus, tmp_path)
    chain = [("tp2.pp1.dp2", W4, [], []), ("tp2.pp1.dp1", ["w1", "w3"], [], ["w0", "w2"]),
             ("tp2.pp1.dp2", ["w1", "w3", "w4", "w5"], ["w4", "w5"], []),
             ("tp1.pp1.dp3", ["w4", "w1", "w5"], [], ["w3"])]
    try:
        h.start("tp1.pp1.dp4", W4, timeout=180)
        h.wait_step(1, timeout=120)
        for layout, workers, joiners, leavers in chain:
            res = _rescale_held(h, tmp_path, layout, workers)
            rec = res.record
            assert rec.ok and rec.to_layout == Layout.parse(layout), rec
            assert sorted(rec.joiners) == joiners and sorted(rec.leavers) == leavers
            # exactly what the new layout needs beyond what its workers already hold
            assert res.bytes_moved == res.lower_bound_bytes == res.planned_bytes > 0, res
            assert sorted(rec.new_ranks) == sorted(workers) and sorted(rec.new_ranks.values()) == list(range(len(workers)))
            for w in leavers:
                assert h.procs[w].wait(30) == 0, f"leaver {w} should exit cleanly"
            h.wait_step(h.status().step + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    steps = _check_curve(h, tmp_path, reference)
    layouts = [r.layout for r in h.history()]
    assert set(layouts) == set(map(Layout.parse, ["tp1.pp1.dp4", "tp2.pp1.dp2", "tp2.pp1.dp1", "tp1.pp1.dp3"]))
    assert len(steps) >= 10


@pytest.mark.parametrize(("start", "keepers", "resume", "replicas"), [
    ("tp2.pp1.dp2", 2, "tp1.pp1.dp3", False),  # FSDP2 x TP2 -> two keepers -> FSDP3
    ("tp1.pp1.dp3", 1, "tp2.pp1.dp1", True),  # DDP replicas -> one keeper -> TP2
], ids=["fsdp-tp", "ddp"])
def test_a_paused_user_job_keeps_its_state_in_keepers_and_resumes_on_another_mesh_on_the_same_curve(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: str, keepers: int,
        resume: str, replicas: bool) -> None:
    """Every GPU freed, nothing lost: the state moves into keepers (no GPU, none of the user's code),
    every training worker exits, and the resume moves it onto new workers of another mesh."""
    monkeypatch.setenv("ELASTIC_TEST_STEP_GATE", str(tmp_path / "gate"))
    h = _job(f"byo-keep-{keepers}", corpus, tmp_path, replicas=replicas)
    first = W4[:Layout.parse(start).world_size]
    fresh = [f"w{4 + i}" for i in range(Layout.parse(resume).world_size)]
    try:
        h.start(start, first, timeout=180)
        h.wait_step(1, timeout=120)
        paused = _rescale_held(h, tmp_path, "", [], pause=True)
        rec = paused.record
        st = h.status()
        assert rec.ok and st.phase == "paused" and len(st.workers) == keepers == len(h.keepers), (rec, st)
        assert set(st.workers) == h.keepers and not set(st.workers) & set(first)
        # the whole state crossed to the keepers, each byte once (they held nothing before)
        assert paused.bytes_moved == paused.lower_bound_bytes == paused.planned_bytes > 0, paused
        for w in first:
            assert h.procs[w].wait(30) == 0, f"training worker {w} should exit cleanly once its state is kept"
        for k in st.workers:
            assert h.procs[k].poll() is None, f"keeper {k} should hold the state"
            assert "keeping" in (tmp_path / "workers" / f"{k}.log").read_text()
        res = _rescale_held(h, tmp_path, resume, fresh)
        # training goes on at the step it paused at
        assert res.record.ok and res.record.switch_step == rec.switch_step, (res.record, rec)
        # exactly what the new layout needs (at least the whole state: the keepers leave)
        assert res.bytes_moved == res.lower_bound_bytes >= paused.bytes_moved, (res, paused)
        for k in st.workers:
            assert h.procs[k].wait(30) == 0, f"keeper {k} should exit once the state is back on GPU workers"
        h.wait_step(h.status().step + 2, timeout=120)
        assert h.status().layout == Layout.parse(resume)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)
    layouts = [r.layout for r in h.history()]
    assert layouts[0] == Layout.parse(start) and layouts[-1] == Layout.parse(resume)
    assert "paused" not in "".join(map(str, layouts))


def test_a_shrink_gives_the_step_in_progress_up_and_the_new_layout_redoes_it_on_the_same_curve(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_HOLD_FOR_GIVE_UP", "3")
    h = _job("byo-giveup", corpus, tmp_path, replicas=True)
    try:
        h.start("tp1.pp1.dp3", W4[:3], timeout=180)
        # step 2 complete: every worker asked for step 3, where each now waits for the coordinator's word
        _wait(lambda st: st.step >= 2, h, 120, "step 2")
        # asked explicitly: by default a user job gives a step up only early in it (see the coordinator)
        res = h.rescale("tp1.pp1.dp2", ["w0", "w2"], timeout=180, give_up_step=True)
        rec = res.record
        assert rec.ok and rec.leavers == ["w1"] and rec.gave_up_step == 3 and rec.switch_step == 3, rec
        assert h.procs["w1"].wait(30) == 0, "the leaver should exit cleanly"
        h.wait_step(6, timeout=120)
        assert h.status().layout == Layout.parse("tp1.pp1.dp2")
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)
    # step 3 was logged only by the new layout: the given-up step left the user's loop before its end
    assert {r["layout"]["dp_replicate"] for r in _logged(tmp_path)[3]} == {2}
    assert {r["layout"]["dp_replicate"] for r in _logged(tmp_path)[2]} == {3}


def test_a_build_that_raises_or_builds_other_keys_abandons_the_rescale_and_the_job_trains_on(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_BUILD_FAULT", "dp_shard2.tp2:raise")
    h = _job("byo-build", corpus, tmp_path)
    try:
        h.start("tp1.pp1.dp4", W4, timeout=180)
        h.wait_step(1, timeout=120)
        with pytest.raises(RescaleFailed, match="build raised RuntimeError: out of memory on dp_shard2.tp2"):
            h.rescale("tp2.pp1.dp2", W4, timeout=180)
        st = h.status()
        assert st.phase == "running" and st.layout == Layout.parse("tp1.pp1.dp4") and "out of memory" in st.reason, st
        h.wait_step(st.step + 2, timeout=120)
        # the same workers rescale fine once the build works (it failed only the first time)
        res = h.rescale("tp2.pp1.dp2", W4, timeout=180)
        assert res.record.ok
        h.wait_step(h.status().step + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)


@pytest.mark.parametrize("replicas", [False, True], ids=["fsdp", "ddp"])
def test_a_build_with_other_keys_is_refused_before_a_byte_moves(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replicas: bool) -> None:
    """FSDP: found in the descriptions' exchange; DDP replicas: each member plans from the state the
    first old member published, and those whose new model differs refuse at the meeting."""
    monkeypatch.setenv("ELASTIC_TEST_BUILD_FAULT", f"{'dp_replicate' if replicas else 'dp_shard'}3.tp1:keys")
    h = _job("byo-keys", corpus, tmp_path, replicas=replicas)
    try:
        h.start("tp1.pp1.dp4", W4, timeout=180)
        h.wait_step(1, timeout=120)
        with pytest.raises(RescaleFailed, match="key\\(s\\) that no worker's old state holds"):
            h.rescale("tp1.pp1.dp3", W4[:3], timeout=180)
        st = h.status()
        assert st.phase == "running" and st.layout == Layout.parse("tp1.pp1.dp4"), st
        h.wait_step(st.step + 2, timeout=120)
        assert h.procs["w3"].poll() is None, "a leaver of an abandoned rescale stays"
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)


def test_a_worker_killed_mid_step_is_recovered_from_its_replicas_on_the_same_curve(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_DIE", "w2:3")
    h = _job("byo-die", corpus, tmp_path, replicas=True)
    try:
        h.start("tp1.pp1.dp4", W4, timeout=180)
        st = _wait(lambda st: st.generation >= 2 and st.phase == "running", h, 180, "recovery")
        assert st.layout == Layout.parse("tp1.pp1.dp3") and "w2" not in st.workers, st
        rec = h.coordinator.rescale_record(2)
        assert rec is not None and rec.ok and "lost w2" in rec.recovery, rec
        assert rec.switch_step == 3, "the step in flight is redone, no other"
        assert rec.bytes_moved == rec.planned_bytes
        h.wait_step(rec.switch_step + 3, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    steps = _check_curve(h, tmp_path, reference)
    assert steps[-1] >= 6


def test_ddp_replicas_with_tensor_parallel_rescale_and_recover_a_lost_worker_on_the_same_curve(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP x TP: every replica holds its parameters on a tp mesh of its own (sibling sub-meshes)."""
    monkeypatch.setenv("ELASTIC_TEST_STEP_GATE", str(tmp_path / "gate"))
    h = _job("byo-ddptp", corpus, tmp_path, replicas=True)
    try:
        h.start("tp2.pp1.dp2", W4, timeout=180)
        h.wait_step(1, timeout=120)
        assert h.rescale("tp1.pp1.dp3", W4[:3], timeout=180).record.ok
        h.wait_step(h.status().step + 2, timeout=120)
        monkeypatch.setenv("ELASTIC_TEST_DIE", "w4:+3")  # armed in the joiner launched next: its 4th step
        res = _rescale_held(h, tmp_path, "tp2.pp1.dp2", ["w0", "w1", "w2", "w4"])
        assert res.record.ok and res.bytes_moved == res.lower_bound_bytes > 0
        st = _wait(lambda st: st.generation >= 4 and st.phase == "running", h, 180, "recovery")
        assert st.layout == Layout.parse("tp2.pp1.dp1") and "w4" not in st.workers, st
        rec = h.coordinator.rescale_record(4)
        died = int(re.search(r"dying \(in step (\d+)", (tmp_path / "workers" / "w4.log").read_text()).group(1))
        assert rec is not None and rec.ok and "lost w4" in rec.recovery, rec
        assert rec.switch_step == died == res.switch_step + 3, "the step in flight is redone, no other"
        h.wait_step(died + 2, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)


def test_a_worker_killed_inside_a_rescales_exchange_rolls_the_rescale_back(
        corpus: str, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_DIE_EXCHANGE", "w1:2")
    h = _job("byo-rollback", corpus, tmp_path, replicas=True)
    try:
        h.start("tp1.pp1.dp4", W4, timeout=180)
        h.wait_step(1, timeout=120)
        with pytest.raises(RescaleFailed, match="rolled back"):
            h.rescale("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
        st = _wait(lambda st: st.phase == "running" and "w1" not in st.workers, h, 180, "recovery after rollback")
        assert st.layout == Layout.parse("tp1.pp1.dp3"), st
        h.wait_step(st.step + 3, timeout=120)
    finally:
        final = h.stop()
    assert final.error is None, final.error
    _check_curve(h, tmp_path, reference)


def test_an_entrypoint_that_does_not_import_is_refused_at_the_start_naming_it(corpus: str, tmp_path: Path) -> None:
    h = _job("byo-noimport", corpus, tmp_path, entry="no_such_package.train:main")
    with pytest.raises(RescaleFailed, match="entrypoint: 'no_such_package.train:main' does not import"):
        h.start("tp1.pp1.dp2", W4[:2], timeout=120)
    assert h.status().phase == "failed"
    h.stop()


def test_a_layout_the_global_batch_does_not_split_into_is_refused_before_anything_changes(
        corpus: str, tmp_path: Path) -> None:
    h = _job("byo-batch", corpus, tmp_path)
    try:
        h.start("tp1.pp1.dp2", W4[:2], timeout=180)
        h.wait_step(0, timeout=120)
        with pytest.raises(SpecError, match="global_batch=12 does not split over dp=5 under layout tp1.pp1.dp5"):
            h.rescale("tp1.pp1.dp5", [f"w{i}" for i in range(5)])
        with pytest.raises(SpecError, match="pp=2 but mesh_dims .* names no pp dim"):
            h.rescale("tp1.pp2.dp1", W4[:2])
        st = h.status()
        assert st.layout == Layout.parse("tp1.pp1.dp2") and st.generation == 1 and sorted(h.procs) == W4[:2]
    finally:
        h.stop()


def test_a_manager_argument_that_disagrees_with_the_job_is_refused_naming_it(
        corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TEST_MANAGER_GLOBAL_BATCH", "24")
    h = _job("byo-mismatch", corpus, tmp_path)
    with pytest.raises(RescaleFailed, match="Manager\\(global_batch=24\\) but job byo-mismatch trains with global_batch=12"):
        h.start("tp1.pp1.dp2", W4[:2], timeout=120)
    h.stop()
