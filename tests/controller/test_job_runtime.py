"""A backend's ``JobRuntime`` carries ``Layout`` values and a ``JobPhase``: the coordinator's status hands it
values, and a pod annotation's text is parsed once."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from elastic.backends.base import coordinator_runtime
from elastic.backends.kubernetes_jobs import _Training
from elastic.backends.kubernetes_names import ANN_GENERATION, ANN_GPU, ANN_LAYOUT
from elastic.model import GPU, Layout
from elastic.phases import JobPhase
from elastic.train.rendezvous.messages import JobStatus, RescaleRecord


def test_the_coordinator_runtime_carries_layouts_and_a_job_phase() -> None:
    """Ray and the Kubernetes coordinator runtime both build theirs here, from the coordinator's status."""
    rec = RescaleRecord(generation=3, from_layout=Layout(1, 1, 4), to_layout=Layout(1, 1, 3), workers=["w0", "w1", "w2"],
                        joiners=[], leavers=["w3"], switch_step=40, ok=True, pause_seconds=0.2,
                        recovery="lost w3 (worker exited with code -9)")
    st = JobStatus(job="j", phase="running", generation=3, layout=Layout(1, 1, 3), workers=["w0", "w1", "w2"], step=41,
                   loss=2.5, tokens_per_second=100.0, step_seconds=0.1, error=None, last_rescale=rec)
    workers = {GPU("n0", i): f"w{i}" for i in range(3)}
    rt = coordinator_runtime("j", st, workers, None)
    assert rt.phase is JobPhase.RUNNING
    assert isinstance(rt.layout, Layout) and rt.layout == Layout(1, 1, 3)
    assert isinstance(rt.recovered_from, Layout) and rt.recovered_from == Layout(1, 1, 4)
    assert rt.recovery.startswith("lost w3") and rt.gpus == tuple(GPU("n0", i) for i in range(3))
    # before its first directive a job has no layout: None, not an empty string
    idle = coordinator_runtime("j", JobStatus(job="j", phase="starting", generation=0, layout=None, workers=[],
                                              step=-1, loss=None, tokens_per_second=None, step_seconds=None,
                                              error=None, last_rescale=None), {}, None)
    assert (idle.phase, idle.layout, idle.recovered_from) == (JobPhase.PENDING, None, None)


def _pod(name: str, gpu: int, layout: str, generation: int = 2) -> SimpleNamespace:
    ann = {ANN_GPU: f"n0/{gpu}", ANN_GENERATION: str(generation), ANN_LAYOUT: layout}
    return SimpleNamespace(metadata=SimpleNamespace(name=name, annotations=ann, deletion_timestamp=None),
                           status=SimpleNamespace(phase="Running"))


def _pods_backend(pods: list[SimpleNamespace]) -> SimpleNamespace:
    """What the Kubernetes backend's pods runtime reads: its worker pods and its own books."""
    return SimpleNamespace(worker_pods=lambda job: pods, _lock=threading.Lock(), _jobs={})


def test_the_pods_runtime_reads_the_layout_off_the_annotation_once() -> None:
    pods = [_pod("j-w0", 0, "tp2.pp1.dp1"), _pod("j-w1", 1, "tp2.pp1.dp1")]
    rt = _Training._pods_runtime(_pods_backend(pods), "j")  # type: ignore[arg-type]
    assert rt is not None and rt.phase is JobPhase.RUNNING and rt.generation == 2
    assert isinstance(rt.layout, Layout) and rt.layout == Layout(2, 1, 1)
    # an annotation edited out of shape is not a layout: the runtime says it does not know one
    bad = [_pod("j-w0", 0, "tp2.pp1.dp1"), _pod("j-w1", 1, "tp2.banana")]
    rt = _Training._pods_runtime(_pods_backend(bad), "j")  # type: ignore[arg-type]
    assert rt is not None and rt.layout is None and rt.phase is JobPhase.RESCALING
