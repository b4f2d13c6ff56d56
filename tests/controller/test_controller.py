"""The controller tick against a fake backend (our boundary) and a real store (SQLite + PostgreSQL)."""

from __future__ import annotations

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.model import Layout, SpecError
from tests.fakes import Clock, tick

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10},
                  "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
    "controller": {"tick_seconds": 1},
}



@pytest.fixture
def env(db_url: str):
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()
    backend = FakeBackend({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    cfg = load_config(data=CONFIG)
    ctl = Controller(cfg, backend, store, {"chat": source}, owner="ctl-a", clock=clock)
    yield ctl, backend, source, clock, store
    store.dispose()


_tick = tick


def test_load_rise_shrinks_training_before_inference_grows_and_fall_reverses(env) -> None:
    ctl, backend, source, clock, store = env
    _tick(ctl, source, clock, 10.0)  # 1 replica at target: training takes what a layout can use of 7
    assert len(backend.service_gpus("chat")) == 1
    assert len(backend.jobs["pretrain"].gpus) == 6  # gpt-1.3b has no 7-GPU layout (batch 64): tp1.pp3.dp2
    backend.calls.clear()

    res = _tick(ctl, source, clock, 40.0)  # 4x target per replica -> 4 replicas
    assert len(backend.service_gpus("chat")) == 4
    assert len(backend.jobs["pretrain"].gpus) == 4  # whole node n1
    kinds = [c[0] for c in backend.calls]
    assert kinds.index("job") < kinds.index("service"), backend.calls  # shrink first, then scale up
    assert any(s.startswith("shrink_training") for s in res.applied)

    backend.calls.clear()
    _tick(ctl, source, clock, 10.0)  # load falls back (scale-down window 0): inference drains, training grows
    kinds = [c[0] for c in backend.calls]
    assert kinds.index("service") < kinds.index("job"), backend.calls
    assert len(backend.jobs["pretrain"].gpus) > 4

    decisions = db.list_decisions(store, limit=50, pool="p")
    assert len(decisions) == 3 and all(d.reason and d.message for d in decisions)
    # the decision log holds each job's layout as text, the one the job runs
    assert decisions[-1].plan["jobs"]["pretrain"]["layout"] == str(backend.jobs["pretrain"].layout)
    reshards = db.list_reshards(store, job="pretrain")
    assert len(reshards) >= 2
    assert all(r.status == "done" and r.bytes_moved and r.pause_seconds is not None for r in reshards)
    assert all(r.bytes_planned == r.bytes_moved and r.bytes_lower_bound for r in reshards)
    # no GPU double-booked in the recorded allocation
    alloc = db.current_allocation(store, "p")
    alloc.check_disjoint()


def test_missing_metrics_never_shrink_inference(env) -> None:
    ctl, backend, source, clock, _ = env
    _tick(ctl, source, clock, 10.0)  # activation from zero
    _tick(ctl, source, clock, 50.0)
    before = len(backend.service_gpus("chat"))
    assert before >= 4
    source.clear("chat")
    for _ in range(3):
        clock.t += 30
        res = ctl.tick()
        assert res.replica_decisions["chat"].reason == "MetricsMissing"
    assert len(backend.service_gpus("chat")) == before


def test_unreachable_backend_stops_acting_and_reports_not_ready(env) -> None:
    ctl, backend, source, clock, store = env
    _tick(ctl, source, clock, 10.0)
    n = len(db.list_decisions(store, limit=50))
    backend.set_reachable(False)
    clock.t += 10
    res = ctl.tick()
    assert not res.acted and not ctl.ready and "unreachable" in (ctl.last_error or "")
    assert len(db.list_decisions(store, limit=50)) == n
    backend.set_reachable(True)
    _tick(ctl, source, clock, 10.0)
    assert ctl.ready


def test_only_the_lease_holder_acts(env, db_url) -> None:
    ctl, backend, source, clock, store = env
    _tick(ctl, source, clock, 10.0)
    other = Controller(ctl.cfg, backend, db.Store.from_url(db_url), {"chat": source}, owner="ctl-b", clock=clock)
    clock.t += 1
    res = other.tick()
    assert not res.acted and res.reason == "NotLeader"
    clock.t += ctl.cfg.controller.lease_seconds + 1  # ctl-a died: its lease expires
    source.set("chat", 10.0, clock.t)
    res = other.tick()
    assert res.acted and other.is_leader


def test_failed_step_stops_the_plan_and_is_recorded(env) -> None:
    ctl, backend, source, clock, store = env
    _tick(ctl, source, clock, 10.0)
    backend.fail_next = "chat"
    clock.t += 20
    source.set("chat", 40.0, clock.t)
    res = ctl.tick()
    assert res.error and "injected failure" in res.error
    d = db.list_decisions(store, limit=1, newest_first=True)[0]
    assert d.reason == "ApplyFailed"


@pytest.mark.parametrize("patch, needle", [
    ({"services": [{"name": "chat", "min_replicas": 9, "max_replicas": 9}]}, "exceeds the pool"),
    ({"jobs": [{"name": "j", "model": "tiny", "min_gpus": 8, "max_gpus": 8}]}, "jobs[0].min_gpus=8 cannot fit"),
    ({"jobs": [{"name": "j", "model": "no-such-model"}]}, "jobs[0].model: unknown model 'no-such-model'"),
    ({"pool": {"nodez": 3}}, "unknown field 'pool.nodez'"),
    ({"jobs": [{"name": "j", "model": "tiny", "on_below_minimum": "drop"}]},
     "'jobs.0.on_below_minimum': Input should be 'pause' or 'preempt'"),
    ({"jobs": [{"name": "j", "model": "tiny", "checkpoint": {"dir": "/ck", "every_steps": 0}}]},
     "'jobs.0.checkpoint.every_steps': Input should be greater than 0"),
    ({"jobs": [{"name": "j", "model": "tiny", "checkpoint": {"every_steps": 10}}]},
     "field 'jobs.0.checkpoint.dir' is missing"),
    ({"jobs": [{"name": "j", "model": "tiny", "checkpoint": {"dir": "/ck", "every_steps": None}}]},
     "field 'jobs.0.checkpoint': neither every_steps nor every_seconds is set; give at least one"),
])
def test_bad_config_is_rejected_at_load(patch, needle) -> None:
    data = dict(CONFIG, **patch)
    with pytest.raises(SpecError) as e:
        load_config(data=data)
    assert needle in str(e.value)


def _async_controller_at_4(db_url: str, backend: FakeBackend):
    """A controller with async_grow over ``backend`` (8 GPUs), driven to 4 replicas + the job on 4."""
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()
    source = InProcessSource(max_age=60)
    ctl = Controller(load_config(data=CONFIG), backend, store, {"chat": source}, owner="a", clock=clock,
                     async_grow=True)
    _tick(ctl, source, clock, 10.0)
    ctl.wait_idle(5)
    _tick(ctl, source, clock, 10.0)
    _tick(ctl, source, clock, 40.0)  # 4 replicas: the job shrinks to 4
    assert len(backend.jobs["pretrain"].gpus) == 4
    return ctl, source, clock, store


def test_async_grow_reserves_its_gpus_and_a_later_shrink_waits_for_it(db_url: str) -> None:
    """With async_grow the tick does not wait for joiners; nothing is double-booked meanwhile."""
    import threading

    class SlowGrow(FakeBackend):
        def __init__(self, nodes: dict[str, int]) -> None:
            super().__init__(nodes)
            self.release = threading.Event()

        def set_job_gpus(self, spec, gpus, layout):
            before = self.jobs.get(spec.name)
            if before is not None and len(gpus) > len(before.gpus):
                assert self.release.wait(30), "grow never released"
            return super().set_job_gpus(spec, gpus, layout)

    backend = SlowGrow({"n0": 4, "n1": 4})
    ctl, source, clock, store = _async_controller_at_4(db_url, backend)
    res = _tick(ctl, source, clock, 10.0)  # load falls: inference drains, training grows in the background
    assert any("(started)" in a for a in res.applied), res.applied
    assert len(backend.jobs["pretrain"].gpus) == 4  # joiners not there yet
    # dt under the lease (15 s): a tick past it takes the lease at a new epoch, and the fence then
    # refuses the background grow's writes made with the old one
    res = _tick(ctl, source, clock, 10.0, dt=10.0)  # the next tick sees the job holding its target GPUs
    held = ctl._observed_allocation()
    held.check_disjoint()
    assert len(held.gpus_of("pretrain")) > 4
    assert len(backend.service_gpus("chat")) + len(held.gpus_of("pretrain")) <= 8
    threading.Timer(0.5, backend.release.set).start()
    _tick(ctl, source, clock, 40.0, dt=10.0)  # load rises again: the shrink waits for the grow to land first
    assert ctl.wait_idle(5)
    assert len(backend.jobs["pretrain"].gpus) == 4 and len(backend.service_gpus("chat")) == 4
    store.dispose()


def test_a_grow_still_starting_joiners_is_called_off_when_inference_needs_the_gpus(db_url: str) -> None:
    """Async grow in flight, load rises: the tick calls the grow off instead of waiting for its
    joiners, and the next tick shrinks the job from what it really holds."""
    import threading

    from elastic.backends.base import GrowCancelled

    class CancellableGrow(FakeBackend):
        def __init__(self, nodes: dict[str, int]) -> None:
            super().__init__(nodes)
            self.cancel = threading.Event()
            self.waiting = threading.Event()

        def cancel_grow(self, job: str) -> bool:
            if not self.waiting.is_set():
                return False
            self.cancel.set()
            return True

        def set_job_gpus(self, spec, gpus, layout):
            before = self.jobs.get(spec.name)
            if before is not None and len(gpus) > len(before.gpus):
                self.waiting.set()  # "joiners starting"
                try:
                    if self.cancel.wait(30):
                        raise GrowCancelled(f"{spec.name}: called off before its directive")
                finally:
                    self.waiting.clear()
            return super().set_job_gpus(spec, gpus, layout)

    backend = CancellableGrow({"n0": 4, "n1": 4})
    ctl, source, clock, store = _async_controller_at_4(db_url, backend)
    res = _tick(ctl, source, clock, 10.0)  # load falls: a grow starts in the background
    assert any("(started)" in a for a in res.applied), res.applied
    assert backend.waiting.wait(5)
    res = _tick(ctl, source, clock, 40.0, dt=10.0)  # load is back before the joiners joined (within the lease)
    assert res.applied and res.applied[0].startswith("cancel_grow pretrain"), res.applied
    assert len(backend.jobs["pretrain"].gpus) == 4  # the grow never happened ...
    assert len(backend.service_gpus("chat")) == 4  # ... and the same tick re-planned: 4 replicas back
    ctl._observed_allocation().check_disjoint()
    res = _tick(ctl, source, clock, 40.0, dt=2.0)  # steady
    assert not [a for a in res.applied if "pretrain" in a], res.applied
    ctl._observed_allocation().check_disjoint()
    assert len(backend.jobs["pretrain"].gpus) == 4 and len(backend.service_gpus("chat")) == 4
    rows = db.list_reshards(store, job="pretrain", limit=50)
    cancelled = [r for r in rows if r.status == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].bytes_moved is None and cancelled[0].error
    assert not [r for r in rows if r.status == "failed"]  # called off is not a failure
    store.dispose()


def test_throughput_table_honours_the_jobs_zero_setting() -> None:
    from elastic.controller import throughput_table
    from elastic.model import Layout, load_hardware, load_model

    t = throughput_table(load_model("gpt-1.3b"), load_hardware("h100-80g"), 8, gpus_per_node=8, global_batch=64,
                         zero=1)
    assert t, "no layout at all"
    for n, (L, tps) in t.items():
        assert isinstance(L, Layout)
        assert L.world_size == n and tps > 0 and L.vpp == 1
        assert L.zero == 1 or L.dp == 1, f"{L}: zero=1 asks for ZeRO-1 wherever dp > 1"


def _env_with(db_url: str, backend: FakeBackend, **job):
    import copy

    data = copy.deepcopy(CONFIG)
    data["jobs"][0].update(job)
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock, source = Clock(), InProcessSource(max_age=60)
    ctl = Controller(load_config(data=data), backend, store, {"chat": source}, owner="ctl-a", clock=clock)
    return ctl, source, clock, store


def test_a_job_at_its_minimum_is_paused_with_its_state_kept_and_resumes_at_the_same_step(db_url: str) -> None:
    from dataclasses import replace

    backend = FakeBackend({"n0": 4, "n1": 4})
    ctl, source, clock, store = _env_with(db_url, backend, min_gpus=4)
    try:
        _tick(ctl, source, clock, 10.0)
        running = backend.jobs["pretrain"]
        assert running.phase == "Running" and len(running.gpus) >= 4
        backend.jobs["pretrain"] = running = replace(running, step=123)  # it trained meanwhile
        res = _tick(ctl, source, clock, 60.0)  # 6 replicas: the job cannot keep its minimum of 4
        paused = backend.jobs["pretrain"]
        assert (paused.phase, paused.gpus, paused.step) == ("Paused", (), 123)
        assert len(backend.service_gpus("chat")) > 4  # more than the job's minimum left room for
        kinds = [c[0] for c in backend.calls]
        assert kinds.index("pause") < len(kinds) - 1 - kinds[::-1].index("service")  # GPUs freed before inference
        assert any(s.startswith("pause_training pretrain") for s in res.applied), res.applied
        d = db.list_decisions(store, limit=50, pool="p")[-1]
        step = next(s for s in d.plan["steps"] if s["workload"] == "pretrain")
        assert (step["action"], step["reason"]) == ("pause_training", "BelowMinimum")
        assert "state is kept off-GPU" in step["message"] and "same step" in step["message"]
        job = next(j for j in db.list_jobs(store) if j.name == "pretrain")
        assert (job.status["phase"], job.status["layout"], job.status["worldSize"], job.status["step"]) == (
            "Paused", f"paused:{paused.layout}", 0, 123)
        ev = db.list_reshards(store, job="pretrain")[-1]
        assert (ev.from_layout, ev.to_layout, ev.status, ev.bytes_moved) == (
            str(running.layout), f"paused:{paused.layout}", "done", 500)

        backend.calls.clear()
        _tick(ctl, source, clock, 10.0)  # traffic falls: inference drains, the job resumes where it paused
        resumed = backend.jobs["pretrain"]
        assert resumed.phase == "Running" and len(resumed.gpus) >= 4 and resumed.step == 123
        assert [c[0] for c in backend.calls].count("resume") == 1, backend.calls
        ev = db.list_reshards(store, job="pretrain")[-1]
        assert (ev.from_layout, ev.to_layout, ev.status) == (f"paused:{paused.layout}", str(resumed.layout), "done")
    finally:
        store.dispose()


@pytest.mark.parametrize("can_pause", [True, False])
def test_a_job_that_cannot_be_paused_is_preempted_and_the_decision_says_its_state_is_dropped(
        db_url: str, can_pause: bool) -> None:
    class NoPause(FakeBackend):
        pause_job = None  # a backend that cannot keep state off-GPU

    backend = FakeBackend({"n0": 4, "n1": 4}) if can_pause else NoPause({"n0": 4, "n1": 4})
    # can_pause: the job asks to be preempted; otherwise the backend leaves no choice
    ctl, source, clock, store = _env_with(db_url, backend, min_gpus=4,
                                          **({"on_below_minimum": "preempt"} if can_pause else {}))
    try:
        _tick(ctl, source, clock, 10.0)
        _tick(ctl, source, clock, 60.0)
        assert "pretrain" not in backend.jobs and len(backend.service_gpus("chat")) > 4
        d = db.list_decisions(store, limit=50, pool="p")[-1]
        step = next(s for s in d.plan["steps"] if s["workload"] == "pretrain")
        assert step["action"] == "preempt_training" and "state dropped" in step["message"]
        assert "pause" not in [c[0] for c in backend.calls]
    finally:
        store.dispose()


def test_a_job_that_recovered_from_a_lost_worker_is_put_on_record_once_and_grown_back(db_url: str) -> None:
    from dataclasses import replace

    backend = FakeBackend({"n0": 4, "n1": 4})
    ctl, source, clock, store = _env_with(db_url, backend)
    try:
        _tick(ctl, source, clock, 10.0)
        before = backend.jobs["pretrain"]
        assert len(before.gpus) == 6
        # the trainer lost a worker and resumed on the survivors by itself (no action of ours)
        kept = before.gpus[:3]
        backend.jobs["pretrain"] = replace(before, layout=Layout.parse("tp1.pp3.dp1"), gpus=kept, generation=before.generation + 1,
                                           recovery="lost pretrain-w5 (worker exited with code -9)",
                                           recovered_from=before.layout, last_bytes_moved=0, last_pause_seconds=0.2)
        _tick(ctl, source, clock, 10.0)
        _tick(ctl, source, clock, 10.0)
        lost = [d for d in db.list_decisions(store, limit=50, pool="p") if d.reason == "WorkerLost"]
        assert len(lost) == 1 and "recovered in place from lost pretrain-w5" in lost[0].message
        evs = [e for e in db.list_reshards(store, job="pretrain") if e.from_layout == str(before.layout)
               and e.to_layout == "tp1.pp3.dp1"]
        assert len(evs) == 1 and evs[0].status == "done" and evs[0].pause_seconds == pytest.approx(0.2)
        assert len(backend.jobs["pretrain"].gpus) == 6  # the freed GPUs were lent to it again
    finally:
        store.dispose()


def test_the_scale_down_window_runs_from_when_a_scale_up_landed_not_from_its_decision(db_url) -> None:
    """A scale-up step blocks the tick while the training shrink and the replicas' start happen (6 s
    here). A dip right after must not drain the replicas the ramp needed: the 8 s window counts
    from the moment they could serve."""
    import copy

    data = copy.deepcopy(CONFIG)
    data["services"][0]["behavior"] = {"scaleDown": {"stabilizationWindowSeconds": 8}}
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()

    class Slow(FakeBackend):
        def set_service_gpus(self, spec, gpus):
            if len(gpus) > len(self.services.get(spec.name, ())):
                clock.t += 6.0  # replicas starting
            super().set_service_gpus(spec, gpus)

    backend = Slow({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    ctl = Controller(load_config(data=data), backend, store, {"chat": source}, owner="a", clock=clock)
    try:
        _tick(ctl, source, clock, 10.0)
        assert len(backend.services["chat"]) == 1
        _tick(ctl, source, clock, 40.0, dt=2.0)  # decided at t, landed at t + 6
        assert len(backend.services["chat"]) == 4
        res = _tick(ctl, source, clock, 10.0, dt=2.0)  # 2 s after landing (8 s after the decision): a dip
        assert len(backend.services["chat"]) == 4, res.replica_decisions["chat"].message
        assert "scale-down window 8s" in res.replica_decisions["chat"].message
        _tick(ctl, source, clock, 10.0, dt=7.0)  # 9 s after landing: the window has passed
        assert len(backend.services["chat"]) == 1
    finally:
        store.dispose()


def test_the_replica_a_scale_down_will_remove_is_drained_ahead_and_put_back_when_the_load_returns(db_url) -> None:
    """drain_ahead_seconds=6 with an 8 s window: the replica the scale-down will remove leaves the
    balancer once the lower recommendation has held for 2 s; it is the one removed 6 s later; a
    load rise or a missing metric puts every replica back; the decision says so."""
    import copy

    data = copy.deepcopy(CONFIG)
    data["services"][0]["behavior"] = {"scaleDown": {"stabilizationWindowSeconds": 8}}
    data["services"][0]["drain_ahead_seconds"] = 6
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = Clock()

    class Ahead(FakeBackend):
        def __init__(self, nodes):
            super().__init__(nodes)
            self.ahead: list[tuple] = []  # every drain_ahead call: (service, gpus, hold)

        def drain_ahead(self, service, gpus, hold_seconds):
            self.ahead.append((service, tuple(gpus), hold_seconds))
            return [f"http://{g}" for g in gpus]

    backend = Ahead({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    ctl = Controller(load_config(data=data), backend, store, {"chat": source}, owner="a", clock=clock)
    try:
        _tick(ctl, source, clock, 10.0)
        _tick(ctl, source, clock, 40.0)
        held = backend.services["chat"]
        assert len(held) == 4 and backend.ahead[-1][1] == ()
        # load for 3: one replica leaves the balancer at once (the window shortened by 6 s is 2 s)
        res = _tick(ctl, source, clock, 30.0, dt=2.0)
        d = res.replica_decisions["chat"]
        assert (d.replicas, d.leaving) == (4, 1), d.message
        assert "drain ahead: 1 replica(s)" in d.message
        (_, out, hold), = backend.ahead[-1:]
        assert len(out) == 1 and out[0] in held and hold >= 10.0
        assert any(a.startswith("drain_ahead chat: 1 replica(s) out of the load balancer") for a in res.applied)
        rec = db.list_decisions(store, limit=1, pool="p", newest_first=True)[0]  # on record, with why
        assert rec.inputs["replicas"]["chat"]["leaving"] == 1 and "drain ahead" in rec.inputs["replicas"]["chat"]["message"]
        assert any(a.startswith("drain_ahead chat") for a in rec.plan["applied"])
        # the load comes back: everyone back in the balancer, nothing removed
        res = _tick(ctl, source, clock, 40.0, dt=2.0)
        assert res.replica_decisions["chat"].leaving == 0 and backend.ahead[-1][1] == ()
        assert "drain_ahead chat: every replica back in the load balancer" in res.applied
        assert backend.services["chat"] == held
        # it falls again and stays down: drained ahead 2 s in, removed when the window lets go, and
        # the replica removed is the one that was drained ahead
        for _ in range(5):
            _tick(ctl, source, clock, 30.0, dt=2.0)
        assert backend.ahead[-1][1] == ()  # scaled down: nothing held out any more
        out = [a[1] for a in backend.ahead if a[1]][-1]
        assert len(backend.services["chat"]) == 3
        assert set(held) - set(backend.services["chat"]) == set(out)
        # a missing metric never drains ahead (fail-safe: it never shrinks either)
        _tick(ctl, source, clock, 20.0, dt=2.0)
        assert backend.ahead[-1][1] != ()
        source.clear("chat")
        clock.t += 2.0
        res = ctl.tick()
        assert res.replica_decisions["chat"].reason == "MetricsMissing"
        assert res.replica_decisions["chat"].leaving == 0 and backend.ahead[-1][1] == ()
    finally:
        store.dispose()
