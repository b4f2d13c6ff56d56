"""Never out of memory: a layout whose step overran its per-GPU budget (or whose worker ran out of
memory) is dropped for the job's life, and the job moves in place to another layout.

The decision (``elastic.controller.memory``) table-driven; then the controller against the fake
backend (our boundary) and a real store (SQLite + PostgreSQL): the fake job reports a measured
peak over budget for the layout it runs, the next tick moves it in place (same GPUs, same step,
next generation), the decision log names the layout, the peak and the budget, and no later tick,
nor a restarted controller, puts it back on that layout.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.controller import memory as mem
from elastic.metrics import InProcessSource
from elastic.model import GPU, Layout, SpecError, TrainingSpec, load_hardware, load_model
from elastic.parallel.memory_report import MeasuredMemory
from elastic.phases import JobPhase
from tests.fakes import Clock, tick

from .fake_backend import FakeBackend

GiB = 1024**3
H100 = load_hardware("h100-80g")
GPT = load_model("gpt-1.3b")
BUDGET = mem.budget_bytes(H100)  # 80 GiB less the planner's reserve (2 GiB + 5%): 74 GiB


def measured(layout: str, *, peak: int | None = None, each: int = GiB, rank: int = 0, step: int = 3) -> MeasuredMemory:
    """A rank's record: ``each`` bytes per component (4 components), ``peak`` as the GPU allocator's."""
    return MeasuredMemory(model="gpt-1.3b", layout=Layout.parse(layout), rank=rank, pp_rank=0, step=step,
                          dtype="bfloat16", micro_batch=1, grad_accum=32, weights=each, gradients=each,
                          optimizer=each, activations=each, weight_elements=1, gradient_elements=1,
                          optimizer_elements=1, optimizer_kinds=2, device_peak=peak)


# --------------------------------------------------------------------------------------------
# The decision, pure
# --------------------------------------------------------------------------------------------


def test_budget_is_device_memory_less_the_planners_reserve() -> None:
    assert BUDGET == 80 * GiB - (2 * GiB + int(0.05 * 80 * GiB)) == 74 * GiB


@pytest.mark.parametrize(("record", "dropped"), [
    (measured("tp1.pp3.dp2.z1", peak=75 * GiB), True),        # GPU allocator peak over the budget
    (measured("tp1.pp3.dp2.z1", peak=74 * GiB), False),       # at the budget: fits
    (measured("tp1.pp3.dp2.z1", each=19 * GiB), True),        # CPU: the components' sum (76 GiB) over it
    (measured("tp1.pp3.dp2.z1", each=18 * GiB), False),       # 72 GiB: fits
    (measured("tp1.pp3.dp2.z1", peak=10 * GiB, each=19 * GiB), False),  # the allocator's peak decides on a GPU
    (None, False),                                            # no measurement: nothing changes
])
def test_a_measured_peak_over_budget_drops_its_layout_and_nothing_else_does(record, dropped) -> None:
    d = mem.check_measured(record, BUDGET, now=5.0)
    assert (d is not None) == dropped
    if d is not None:
        assert (d.layout, d.reason, d.budget_bytes, d.at) == (Layout.parse("tp1.pp3.dp2.z1"), "MemoryExceeded",
                                                            BUDGET, 5.0)
        assert d.peak_bytes == mem.measured_peak(record) > BUDGET
        assert "tp1.pp3.dp2.z1" in d.message and "74.00 GiB" in d.message and "per-GPU budget" in d.message


def test_the_message_sets_the_planners_prediction_beside_what_was_measured() -> None:
    m = measured("tp1.pp3.dp2.z1", peak=90 * GiB)
    predicted = mem.predicted_stage(GPT, m, H100, gpus_per_node=4)
    assert predicted is not None and predicted.weights > 0 and predicted.activations > 0
    d = mem.check_measured(m, BUDGET, 0.0, predicted)
    assert d is not None and "90.00 GiB" in d.message
    assert f"the planner predicted weights {predicted.weights / GiB:.2f} GiB" in d.message
    assert "measured weights 1.00 GiB" in d.message


@pytest.mark.parametrize(("error", "dropped"), [
    ("worker w1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("worker w0: RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory", True),
    ("worker w1: RuntimeError: Connection reset by peer", False),
    (None, False),
    ("", False),
])
def test_a_worker_out_of_memory_drops_its_layout(error, dropped) -> None:
    d = mem.check_failure(Layout.parse("tp2.pp1.dp2"), error, BUDGET, now=1.0)
    assert (d is not None) == dropped
    if d is not None:
        assert (d.layout, d.reason, d.peak_bytes) == (Layout.parse("tp2.pp1.dp2"), "OutOfMemory", None)
    assert mem.check_failure(None, error, BUDGET, 1.0) is None  # no layout known: nothing to drop


def test_an_out_of_memory_failure_names_what_the_rank_held_when_it_failed() -> None:
    error = "OutOfMemory: OutOfMemoryError: out of memory: saving 45056 bytes for backward would hold 4397584 bytes"
    small = replace(measured("tp1.pp2.dp1", each=1024**2), activations=3 * 1024**2)  # 6 MiB in all, on CPU
    d = mem.check_failure(Layout.parse("tp1.pp2.dp1"), error, BUDGET, 2.0, small)
    assert d is not None and (d.reason, d.peak_bytes) == ("OutOfMemory", 6 * 1024**2)
    assert d.message.startswith("tp1.pp2.dp1: step 3 ran out of memory on rank 0 (stage 0) at 6.00 MiB")
    assert "activations 3.00 MiB" in d.message and "74.00 GiB" in d.message and "45056 bytes" in d.message
    # a measurement of another layout (an older one) is not this failure's: no peak is claimed
    other = mem.check_failure(Layout.parse("tp2.pp1.dp1"), error, BUDGET, 2.0, small)
    assert other is not None and other.peak_bytes is None and "a worker ran out of memory" in other.message


L = Layout.parse


def C(layout: str, tps: float, gib: float) -> mem.Candidate:
    return mem.Candidate(L(layout), tps, int(gib * GiB))


CANDIDATES = {4: [C("tp1.pp1.dp4", 300, 39), C("tp1.pp2.dp2", 280, 28), C("tp1.pp1.dp4.z1", 250, 28),
                  C("tp2.pp1.dp2", 240, 22)],
              2: [C("tp1.pp1.dp2", 120, 60), C("tp2.pp1.dp1", 100, 45)]}
TABLE = {1: (L("tp1.pp1.dp1"), 60.0), 2: (L("tp1.pp1.dp2"), 120.0), 4: (L("tp1.pp1.dp4"), 300.0)}


@pytest.mark.parametrize(("dropped", "want"), [
    ((), TABLE),  # nothing dropped: the table as it was
    # the same layout with ZeRO-1 first (headroom, same maths), though another is faster
    (("tp1.pp1.dp4",), {**TABLE, 4: (L("tp1.pp1.dp4.z1"), 250.0)}),
    # ZeRO-1 dropped too: the fastest predicted to need less than the dropped one
    (("tp1.pp1.dp4", "tp1.pp1.dp4.z1"), {**TABLE, 4: (L("tp1.pp2.dp2"), 280.0)}),
    # no ZeRO-1 variant to take (dp2's is not offered): the next that needs less memory
    (("tp1.pp1.dp2",), {**TABLE, 2: (L("tp2.pp1.dp1"), 100.0)}),
    # nothing left that needs less: the count leaves the table (the job gets fewer GPUs)
    (("tp1.pp1.dp2", "tp2.pp1.dp1"), {1: TABLE[1], 4: TABLE[4]}),
])
def test_a_dropped_layout_is_replanned_with_more_headroom(dropped, want) -> None:
    got = mem.without_dropped(TABLE, {Layout.parse(t) for t in dropped}, lambda n: CANDIDATES[n])
    assert got == want


def test_a_replacement_needing_more_memory_than_the_dropped_layout_is_never_taken() -> None:
    # tp1.pp2.dp2 is dropped; the only other candidate (dp4, 39 GiB) needs more than it (28 GiB)
    table = {4: (L("tp1.pp2.dp2"), 280.0)}
    assert mem.without_dropped(table, {Layout.parse("tp1.pp2.dp2")}, lambda n: CANDIDATES[4][:2]) == {}


def test_relayout_target_moves_only_a_job_on_a_dropped_layout_with_another_of_its_count() -> None:
    dropped = {Layout.parse("tp1.pp1.dp4")}
    table = {4: (L("tp1.pp2.dp2"), 280.0)}
    assert mem.relayout_target(Layout.parse("tp1.pp1.dp4"), 4, dropped, table) == Layout.parse("tp1.pp2.dp2")
    assert mem.relayout_target(Layout.parse("tp1.pp2.dp2"), 4, dropped, table) is None  # not dropped
    assert mem.relayout_target(Layout.parse("tp1.pp1.dp4"), 4, dropped, {}) is None  # none of its count: fewer GPUs
    assert mem.relayout_target(None, 0, dropped, table) is None


def test_a_dropped_layout_round_trips_through_the_status_and_a_bad_one_is_named() -> None:
    d = mem.check_measured(measured("tp2.pp1.dp2", peak=80 * GiB), BUDGET, 7.0)
    assert d is not None and mem.Dropped.from_json(d.as_json()) == d
    with pytest.raises(SpecError, match=r"droppedLayouts\[0\]: field 'budgetBytes' is missing"):
        mem.Dropped.from_json({"layout": "tp1.pp1.dp1", "reason": "OutOfMemory"}, where="droppedLayouts[0]")
    with pytest.raises(SpecError, match="reason must be MemoryExceeded or OutOfMemory"):
        mem.Dropped.from_json({**d.as_json(), "reason": "Tired"})


def test_alternatives_follow_the_jobs_options() -> None:
    every = mem.alternatives(GPT, H100, 4, gpus_per_node=4, global_batch=64)
    assert every and all(c.layout.world_size == 4 for c in every)
    assert [c.tokens_per_second for c in every] == sorted((c.tokens_per_second for c in every), reverse=True)
    tp2 = mem.alternatives(GPT, H100, 4, gpus_per_node=4, global_batch=64, allowed_tp=[2])
    assert tp2 and {c.layout.tp for c in tp2} == {2}
    replicated = mem.alternatives(GPT, H100, 4, gpus_per_node=4, global_batch=64, replicate_optimizer=True)
    assert replicated and not any(c.layout.zero for c in replicated)


# --------------------------------------------------------------------------------------------
# The controller, against the fake backend
# --------------------------------------------------------------------------------------------

CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10},
                  "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
    "controller": {"tick_seconds": 1},
}


class LayoutLog(FakeBackend):
    """The fake backend, noting every layout a job is put on."""

    def __init__(self, nodes: dict[str, int]) -> None:
        super().__init__(nodes)
        self.layouts: list[str] = []

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None):
        if layout is not None:
            self.layouts.append(str(layout))
        return super().set_job_gpus(spec, gpus, layout)


@pytest.fixture
def env(db_url: str):
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()
    backend = LayoutLog({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    cfg = load_config(data=CONFIG)
    ctl = Controller(cfg, backend, store, {"chat": source}, owner="ctl-a", clock=clock)
    yield ctl, backend, source, clock, store, cfg
    store.dispose()


_tick = tick


def test_a_layout_over_budget_is_left_in_place_and_never_picked_again(env) -> None:
    ctl, backend, source, clock, store, cfg = env
    # 1. one replica at its target: the job runs the planner's 6-GPU layout
    _tick(ctl, source, clock, 10.0)
    rt = backend.jobs["pretrain"]
    assert (str(rt.layout), len(rt.gpus)) == ("tp1.pp3.dp2.z1", 6)
    # 2. its worst rank's measured step peaked at 76 GiB, over the 74 GiB budget
    over = measured("tp1.pp3.dp2.z1", peak=76 * GiB, step=rt.step)
    backend.jobs["pretrain"] = replace(rt, step=rt.step + 5, memory=over.as_json())
    res = _tick(ctl, source, clock, 10.0)
    # 3. in place: the same GPUs, the same step, the next generation, on a layout the planner
    # predicts to need less memory (not tp1.pp3.dp2: without ZeRO-1 it needs more)
    after = backend.jobs["pretrain"]
    assert str(after.layout) == "tp2.pp3.dp1", res.applied
    assert (after.gpus, after.step, after.generation) == (rt.gpus, rt.step + 5, rt.generation + 1)
    assert any(a.startswith("relayout_training pretrain: tp1.pp3.dp2.z1 -> tp2.pp3.dp1") for a in res.applied)
    # 4. on record: the decision names the layout, the peak and the budget; the reshard; the status
    [d] = [d for d in db.list_decisions(store, limit=50, pool="p") if d.reason == "MemoryExceeded"]
    assert "tp1.pp3.dp2.z1" in d.message and "76.00 GiB" in d.message and "74.00 GiB" in d.message
    assert "moves in place to tp2.pp3.dp1" in d.message and "the planner predicted" in d.message
    reshard = db.list_reshards(store, job="pretrain", limit=1, newest_first=True)[0]
    assert (reshard.from_layout, reshard.to_layout, reshard.status) == ("tp1.pp3.dp2.z1", "tp2.pp3.dp1", "done")
    status = db.get_job(store, "pretrain").status
    assert [x["layout"] for x in status["droppedLayouts"]] == ["tp1.pp3.dp2.z1"]
    assert status["droppedLayouts"][0]["peakBytes"] == 76 * GiB and status["droppedLayouts"][0]["budgetBytes"] == BUDGET
    # an operator cannot pin it either: the admin API refuses, naming the dropped entry
    from elastic.api.interventions import _feasible
    from elastic.api.problems import Problem

    with pytest.raises(Problem) as refused:
        _feasible(None, db.get_job(store, "pretrain"), "tp1.pp3.dp2.z1")  # type: ignore[arg-type]
    assert refused.value.status == 422 and "layout: tp1.pp3.dp2.z1 was dropped for job 'pretrain'" in \
        refused.value.detail and "MemoryExceeded" in refused.value.detail
    # 5. load rises and falls: the job shrinks to 4 and grows back to 6, never onto the dropped layout
    _tick(ctl, source, clock, 40.0)
    assert len(backend.jobs["pretrain"].gpus) == 4
    _tick(ctl, source, clock, 10.0)
    assert str(backend.jobs["pretrain"].layout) == "tp2.pp3.dp1"
    assert backend.layouts.count("tp1.pp3.dp2.z1") == 1  # its first start, never again
    # 6. a restarted controller reads the dropped layout back from the job's status
    again = Controller(cfg, backend, store, {"chat": source}, owner="ctl-a", clock=clock)
    assert set(again._dropped("pretrain")) == {Layout.parse("tp1.pp3.dp2.z1")}
    assert again._layout_table("pretrain")[6][0] == L("tp2.pp3.dp1")
    backend.set_job_gpus(cfg.jobs[0], (), None)  # the job is gone; the new controller starts it afresh
    backend.layouts.clear()
    clock.t += 20.0
    source.set("chat", 10.0, clock.t)
    assert again.tick().error is None
    assert backend.layouts == ["tp2.pp3.dp1"]


def test_a_measurement_within_budget_changes_nothing(env) -> None:
    ctl, backend, source, clock, store, _ = env
    _tick(ctl, source, clock, 10.0)
    rt = backend.jobs["pretrain"]
    backend.jobs["pretrain"] = replace(rt, memory=measured(str(rt.layout), peak=70 * GiB).as_json())
    res = _tick(ctl, source, clock, 10.0)
    assert backend.jobs["pretrain"].generation == rt.generation and not res.applied
    assert not [d for d in db.list_decisions(store, limit=50, pool="p") if d.reason == "MemoryExceeded"]
    status = db.get_job(store, "pretrain").status
    assert status["droppedLayouts"] == [] and status["memory"]["device_peak"] == 70 * GiB


def test_a_job_that_failed_out_of_memory_restarts_on_another_layout(env) -> None:
    ctl, backend, source, clock, store, _ = env
    _tick(ctl, source, clock, 10.0)
    rt = backend.jobs["pretrain"]
    backend.jobs["pretrain"] = replace(rt, phase=JobPhase.FAILED,
                                       error="worker w3: OutOfMemoryError: CUDA out of memory. Tried to allocate 4 GiB")
    backend.layouts.clear()
    # reaped (its GPUs return) and, as the plan already counted it as not running, started afresh
    # in the same tick: on the re-planned layout of its count
    res = _tick(ctl, source, clock, 10.0)
    assert any(a.startswith("stop_failed_training pretrain") for a in res.applied), res.applied
    assert backend.layouts == ["tp2.pp3.dp1"] and str(backend.jobs["pretrain"].layout) == "tp2.pp3.dp1"
    [d] = [d for d in db.list_decisions(store, limit=50, pool="p") if d.reason == "MemoryExceeded"]
    assert "tp1.pp3.dp2.z1: a worker ran out of memory" in d.message and "OutOfMemoryError" in d.message
    assert [x["reason"] for x in db.get_job(store, "pretrain").status["droppedLayouts"]] == ["OutOfMemory"]


def test_a_jobs_memory_limit_is_its_budget_and_the_planner_fits_it_under_it(db_url: str) -> None:
    """``memory_limit_bytes`` below the device's budget: the planner offers only layouts under it (the
    6-GPU layout of the unlimited job, tp1.pp3.dp2.z1, holds 8.9 GiB; at 7 GPUs pp7 fits), and a measured peak over the
    limit, though far under the device's 74 GiB, drops its layout with the limit as the budget."""
    limit = 8 * GiB
    job = {**CONFIG["jobs"][0], "memory_limit_bytes": limit, "recompute": "selective", "offload": False}
    cfg = load_config(data={**CONFIG, "jobs": [job]})
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    try:
        clock, backend, source = Clock(), LayoutLog({"n0": 4, "n1": 4}), InProcessSource(max_age=60)
        ctl = Controller(cfg, backend, store, {"chat": source}, owner="ctl-a", clock=clock)
        _tick(ctl, source, clock, 10.0)
        rt = backend.jobs["pretrain"]
        assert (str(rt.layout), len(rt.gpus)) == ("tp1.pp7.dp1", 7)  # the limit leaves a 7-GPU layout
        planned = mem.alternatives(GPT, H100, 6, gpus_per_node=4, **cfg.jobs[0].planner_options())
        reserve = H100.memory_bytes - BUDGET
        assert planned and all(c.memory_bytes - reserve <= limit for c in planned)
        assert Layout.parse("tp1.pp3.dp2.z1") not in {c.layout for c in planned}
        assert ctl._budget("pretrain") == limit
        over = replace(rt, step=rt.step + 1, memory=measured(str(rt.layout), peak=9 * GiB).as_json())
        assert ctl.memory_status("pretrain", over)["budgetBytes"] == limit  # what the job's status shows
        backend.jobs["pretrain"] = over
        _tick(ctl, source, clock, 10.0)
        status = db.get_job(store, "pretrain").status
        assert [x["layout"] for x in status["droppedLayouts"]] == [str(rt.layout)]
        assert status["droppedLayouts"][0]["budgetBytes"] == limit
    finally:
        store.dispose()
