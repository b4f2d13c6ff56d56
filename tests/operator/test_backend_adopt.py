"""A second Kubernetes backend (a restarted operator, or the standby taking over) re-attaches to a
job the first one started: its coordinator pod, its worker pods and their GPUs, at the same step.

The node agent runs every pod as a local process (the job's coordinator pod and its two worker pods
train the tiny reference model); the first backend lets go of the job without stopping anything, as
a killed operator would. The operator-process version, killed in the middle of a shrink, is
``test_e2e_restart.py``."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from elastic.model import GPU, Layout, TrainingSpec
from elastic.phases import JobPhase

from .conftest import NS, coordinator_backend, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEC = TrainingSpec(name="pretrain", model="tiny", min_gpus=1, max_gpus=4, global_batch=8)
GPUS = (GPU("n0", 0), GPU("n0", 1))


def _uids(api: Any) -> dict[str, str]:
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod(NS)
    return {p.metadata.name: p.metadata.uid for p in pods.items if not p.metadata.deletion_timestamp}


def test_a_new_backend_adopts_a_running_job_and_rescales_it_in_place(emulator: Any, node_agent: Any) -> None:
    _, api = emulator
    first = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    out = first.set_job_gpus(SPEC, GPUS, Layout.parse("tp1.pp1.dp2"))
    assert out.generation == 1
    handle = first._jobs["pretrain"].handle
    handle.wait_step(3, timeout=120)
    handle._watching.set()  # the first operator is gone: nothing of it watches or acts any more
    before = _uids(api)
    assert sorted(before) == ["pretrain-coordinator", "pretrain-w0", "pretrain-w1"]

    second = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    notes = second.adopt()
    assert len(notes) == 1 and notes[0].startswith("adopted job pretrain: tp1.pp1.dp2 generation 1"), notes
    assert second.adopt() == []  # once: a second call finds nothing new
    rt = second.job_runtime("pretrain")
    assert rt is not None and rt.phase == JobPhase.RUNNING and rt.layout == Layout.parse("tp1.pp1.dp2")
    assert set(rt.gpus) == set(GPUS) and rt.generation == 1
    step = rt.step
    adopted = second._jobs["pretrain"].handle
    adopted.wait_step(step + 2, timeout=120)  # the same workers train on, under the new backend
    assert _uids(api) == before  # no pod was replaced

    # the adopted job rescales in place: a shrink onto one of its GPUs, the leaver's pod deleted
    out = second.set_job_gpus(SPEC, GPUS[:1], Layout.parse("tp1.pp1.dp1"))
    assert (out.generation, out.from_layout, out.to_layout) == (2, Layout.parse("tp1.pp1.dp2"),
                                                                Layout.parse("tp1.pp1.dp1"))
    rec = adopted.coordinator.wait_generation(2, 120)  # a shrink returns before the new layout's first step
    assert rec.ok and rec.switch_step > step and rec.leavers == ["pretrain-w1"]
    wait_for("the leaver's pod gone", lambda: sorted(_uids(api)) == ["pretrain-coordinator", "pretrain-w0"], 60)
    assert _uids(api)["pretrain-w0"] == before["pretrain-w0"]
    rt = second.job_runtime("pretrain")
    assert rt is not None and rt.gpus == GPUS[:1] and rt.generation == 2
    # the stored worker map follows the rescale: a third backend would adopt exactly this
    meta = adopted.coordinator.get_meta()
    assert meta["gpus"] == {"pretrain-w0": "n0/0"} and meta["next_id"] == 2

    second.set_job_gpus(SPEC, (), None)  # stop: every pod of the job goes, its coordinator too
    wait_for("every pod gone", lambda: _uids(api) == {}, 60)


def test_a_job_adopted_in_the_middle_of_a_grow_keeps_the_joiner_and_its_gpu(emulator: Any, node_agent: Any) -> None:
    """The first backend is stopped dead right after it posted a grow's directive (it never hears the
    result): the workers finish the grow on their own, and the second backend re-attaches to the new
    layout with the joiner on the GPU the first one placed it on (stored before anything moved)."""
    _, api = emulator
    first = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    first.set_job_gpus(SPEC, GPUS[:1], Layout.parse("tp1.pp1.dp1"))
    h = first._jobs["pretrain"].handle
    h.wait_step(2, timeout=120)
    posted, never = threading.Event(), threading.Event()
    post = h.coordinator.directive

    def directive(*args: Any, **kw: Any) -> Any:
        d = post(*args, **kw)
        posted.set()
        never.wait(300)  # the operator is gone: it neither waits for the result nor records it
        return d

    h.coordinator.directive = directive
    def grow_then_die() -> None:
        with contextlib.suppress(Exception):  # its calls after "death" meet a stopped coordinator
            first.set_job_gpus(SPEC, GPUS, Layout.parse("tp1.pp1.dp2"))

    grow = threading.Thread(target=grow_then_die, daemon=True)
    grow.start()
    assert posted.wait(120)
    h._watching.set()

    second = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    notes = second.adopt()  # waits for the grow in flight to end
    assert len(notes) == 1 and notes[0].startswith("adopted job pretrain: tp1.pp1.dp2 generation 2"), notes
    rt = second.job_runtime("pretrain")
    assert rt is not None and rt.phase == JobPhase.RUNNING and set(rt.gpus) == set(GPUS) and rt.generation == 2
    second._jobs["pretrain"].handle.wait_step(rt.step + 1, timeout=120)
    second.set_job_gpus(SPEC, (), None)
    wait_for("every pod gone", lambda: _uids(api) == {}, 60)
    never.set()
    grow.join(60)


def test_a_paused_job_is_adopted_with_its_keepers_and_resumed_in_place(emulator: Any, node_agent: Any) -> None:
    """Keepers (no GPU) hold a paused job's state; a new backend re-attaches to them and resumes the job
    onto GPUs at the step it paused at."""
    _, api = emulator
    first = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    first.set_job_gpus(SPEC, GPUS, Layout.parse("tp1.pp1.dp2"))
    first._jobs["pretrain"].handle.wait_step(2, timeout=120)
    out = first.pause_job(SPEC)
    assert out.to_layout == Layout.parse("tp1.pp1.dp1")  # one copy of the state, in one keeper
    held = first._jobs["pretrain"].handle.status()
    assert held.phase == "paused" and held.workers == ["pretrain-k2"]
    first._jobs["pretrain"].handle._watching.set()  # the first operator is gone
    wait_for("the workers' pods gone", lambda: sorted(_uids(api)) == ["pretrain-coordinator", "pretrain-k2"], 60)
    keeper = _uids(api)["pretrain-k2"]

    second = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    notes = second.adopt()
    assert len(notes) == 1 and notes[0].startswith("adopted paused job pretrain: state held as tp1.pp1.dp1 at step "
                                                   f"{held.step + 1} by pretrain-k2"), notes
    rt = second.job_runtime("pretrain")
    assert rt is not None and rt.phase == JobPhase.PAUSED and rt.gpus == ()
    assert _uids(api)["pretrain-k2"] == keeper  # the same keeper holds the state
    # resumed in place onto a GPU: the keeper hands the state over and leaves; the step goes on
    out = second.set_job_gpus(SPEC, GPUS[:1], Layout.parse("tp1.pp1.dp1"))
    assert out.generation == held.generation + 1
    handle = second._jobs["pretrain"].handle
    rec = handle.coordinator.wait_generation(out.generation, 120)
    assert rec.ok and rec.switch_step == held.step + 1 and rec.leavers == ["pretrain-k2"]
    handle.wait_step(held.step + 2, timeout=120)
    wait_for("the keeper's pod gone", lambda: "pretrain-k2" not in _uids(api), 60)
    assert second.job_runtime("pretrain").gpus == GPUS[:1]
    second.set_job_gpus(SPEC, (), None)
    wait_for("every pod gone", lambda: _uids(api) == {}, 60)


def test_a_backend_without_a_coordinator_pod_to_adopt_reports_nothing(emulator: Any) -> None:
    _, api = emulator
    b = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    assert b.adopt() == [] and b.job_runtime("pretrain") is None
