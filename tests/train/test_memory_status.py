"""A reference-trainer job's measured memory reaches its status: worker -> coordinator -> JobRuntime.

The coordinator keeps, per generation, its worst rank's measured step (largest GPU allocator peak,
else most bytes); the job's status shows the current generation's. First the choice on the
coordinator alone, then real worker processes (``python -m elastic.train.worker``, gloo on
loopback): two ranks of ``tp1.pp2.dp1``, rescaled in place to ``tp1.pp1.dp2``.
"""

from __future__ import annotations

import pytest

from elastic.backends.base import coordinator_runtime
from elastic.model import Layout, load_model
from elastic.parallel.memory_report import MeasuredMemory
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle
from elastic.train.rendezvous import Coordinator
from elastic.train.rendezvous.state import MEMORY_GENERATIONS_KEPT

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)


def _record(rank: int, *, activations: int, peak: int | None = None, layout: str = "tp1.pp2.dp1") -> MeasuredMemory:
    return MeasuredMemory(model="tiny", layout=Layout.parse(layout), rank=rank, pp_rank=rank % 2, step=0,
                          dtype="float32", micro_batch=1, grad_accum=8, weights=100, gradients=100, optimizer=200,
                          activations=activations, weight_elements=25, gradient_elements=25, optimizer_elements=25,
                          optimizer_kinds=2, device_peak=peak)


def test_the_coordinator_keeps_each_generations_worst_rank() -> None:
    c = Coordinator("mem")
    with c._cv:
        c._note_memory_locked("w0", 1, _record(0, activations=50).as_json())
        c._note_memory_locked("w1", 1, _record(1, activations=70).as_json())  # more bytes: worse
        c._note_memory_locked("w0", 1, _record(0, activations=60).as_json())  # a later step, still less
        assert c._memory[1].rank == 1 and c._memory[1].activations == 70
        # on a GPU the allocator's peak decides, whatever the components say
        c._note_memory_locked("w0", 2, _record(0, activations=10, peak=900).as_json())
        c._note_memory_locked("w1", 2, _record(1, activations=70, peak=800).as_json())
        assert c._memory[2].rank == 0
        c._note_memory_locked("w1", 3, {"layout": "tp1.pp2.dp1"})  # malformed: left out, never fatal
        assert 3 not in c._memory
        for g in range(3, 3 + MEMORY_GENERATIONS_KEPT):
            c._note_memory_locked("w0", g, _record(0, activations=g).as_json())
        assert sorted(c._memory) == list(range(3, 3 + MEMORY_GENERATIONS_KEPT))  # bounded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reference_jobs_measured_memory_reaches_its_status(tmp_path) -> None:
    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120)
    h = ProcessJobHandle("mem-status", CFG, options=opts, log_dir=str(tmp_path))
    try:
        h.start("tp1.pp2.dp1", ["w0", "w1"], timeout=180)
        h.wait_step(1, timeout=120)  # step 0's measurement came with the step-1 request
        st = h.status()
        m = MeasuredMemory.from_json(st.memory, "status.memory")
        assert (str(m.layout), m.model, m.dtype, m.device_peak) == ("tp1.pp2.dp1", "tiny", "float32", None)
        assert m.rank in (0, 1) and m.step in (0, 1)
        assert m.weights > 0 and m.gradients > 0 and m.optimizer > 0 and m.activations > 0
        # what the controller reads, through the backends' JobRuntime
        rt = coordinator_runtime("mem-status", st, {}, None)
        assert rt.memory == st.memory
        # rescaled in place: the status shows the new generation's measurement, not the old one's
        res = h.rescale("tp1.pp1.dp2", ["w0", "w1"], timeout=240)
        h.wait_step(res.switch_step + 1, timeout=120)
        m2 = MeasuredMemory.from_json(h.status().memory, "status.memory")
        assert str(m2.layout) == "tp1.pp1.dp2" and m2.step >= res.switch_step
        # one stage holds every layer: more weights per rank than either stage of tp1.pp2
        assert m2.weight_elements > m.weight_elements
    finally:
        h.stop()
