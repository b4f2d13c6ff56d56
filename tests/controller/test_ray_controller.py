"""The controller on real local Ray (8 logical GPUs): training shrinks in place before inference grows,
and inference drains before training grows back. Real replicas, real training workers (gloo), real
SQLite store; only the load is pushed (``InProcessSource``) and the decision clock injected."""

from __future__ import annotations

import time

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.model import Layout
from tests.fakes import Clock, tick

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

CONFIG = {
    "pool": {"name": "ray-local", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10}, "startup_seconds": 0,
                  "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                               "scaleDown": {"stabilizationWindowSeconds": 0}}}],
    # global batch 240: every dp up to the job's 4 GPUs divides it, so every GPU count has a layout, and
    # the planner picks pure DP as at 840 (at 12 it picked pp4); 840 made a dp2 step ~3 s long
    "jobs": [{"name": "tiny-job", "model": "tiny", "min_gpus": 1, "max_gpus": 4, "global_batch": 240,
              "micro_batch": 1}],
    "controller": {"tick_seconds": 1, "metrics_max_age_seconds": 3600},
}



@pytest.fixture(scope="module")
def ray_local():
    from elastic.train.ray_handle import init_local_ray

    ray = init_local_ray(num_gpus=8, num_cpus=2)
    yield ray
    ray.shutdown()


def _spy_backend(pool):
    """The real RayBackend, recording when each actuator call began and ended."""
    from elastic.backends.ray import RayBackend
    from elastic.serve.server import ReplicaConfig
    from elastic.train.launch import LaunchOptions

    class Spy(RayBackend):
        calls: list[tuple[str, int, float, float]] = []

        def set_service_gpus(self, spec, gpus):
            t0 = time.monotonic()
            super().set_service_gpus(spec, gpus)
            self.calls.append(("service", len(gpus), t0, time.monotonic()))

        def set_job_gpus(self, spec, gpus, layout):
            t0 = time.monotonic()
            out = super().set_job_gpus(spec, gpus, layout)
            self.calls.append(("job", len(gpus), t0, time.monotonic()))
            return out

        def pause_job(self, spec):
            t0 = time.monotonic()
            out = super().pause_job(spec)
            self.calls.append(("pause", 0, t0, time.monotonic()))
            return out

    return Spy(pool, replica_config=ReplicaConfig(model="tiny", max_running=4),
               train_options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120),
               drain_seconds=0.5)


def _controller(tmp_path, *, job: dict | None = None, scale_up: list | None = None):
    """The controller on the real Ray backend, a fresh SQLite store, pushed load and an injected clock."""
    import copy

    url = f"sqlite:///{tmp_path}/state.db"
    db.upgrade(url)
    store = db.Store.from_url(url)
    data = copy.deepcopy(CONFIG)
    data["jobs"][0].update(job or {})
    if scale_up is not None:
        data["services"][0]["behavior"]["scaleUp"]["policies"] = scale_up
    cfg = load_config(data=data)
    backend = _spy_backend(cfg.pool)
    source, clock = InProcessSource(max_age=3600), Clock(2_000_000.0)
    ctl = Controller(cfg, backend, store, {"chat": source}, owner="t", clock=clock)
    return ctl, backend, source, clock, store


def _backend_with_spares(n_gpus: int, **spares: int):
    """CONFIG, the spy backend keeping ``spares`` (``spare_workers=``, ``spare_replicas=``), GPUs 0..n-1."""
    from elastic.model import GPU

    cfg = load_config(data=CONFIG)
    backend = _spy_backend(cfg.pool)
    for k, v in spares.items():
        setattr(backend, k, v)
    return cfg, backend, tuple(GPU("local", i) for i in range(n_gpus))


def _gpus_free(expect: float, timeout: float = 10.0) -> float:
    """Ray's free GPU count once it reads ``expect`` (Ray frees a dead actor's resources
    asynchronously), or what it reads at the timeout."""
    import ray

    deadline = time.monotonic() + timeout
    while (n := ray.available_resources().get("GPU", 0.0)) != expect and time.monotonic() < deadline:
        time.sleep(0.05)
    return n



def _tick(ctl, source, clock, load):
    return tick(ctl, source, clock, load, dt=30)


def test_shrink_in_place_before_inference_grows_and_the_reverse(ray_local, tmp_path) -> None:
    ctl, backend, source, clock, store = _controller(tmp_path)
    ray = ray_local
    try:
        # 1. load at target for one replica: training takes its maximum of 4 GPUs
        _tick(ctl, source, clock, 10.0)
        rt0 = backend.job_runtime("tiny-job")
        assert len(backend.service_gpus("chat")) == 1 and rt0 is not None and len(rt0.gpus) == 4
        handle = backend.jobs["tiny-job"].handle
        handle.wait_step(rt0.step + 2, timeout=120)  # it trains
        step_before = backend.job_runtime("tiny-job").step
        backend.calls.clear()

        # 2. load rises to 5 replicas' worth: the job shrinks 4 -> 3 in place, THEN chat grows 1 -> 5
        res = _tick(ctl, source, clock, 50.0)
        assert [c[:2] for c in backend.calls] == [("job", 3), ("service", 5)], backend.calls
        shrink, grow = backend.calls
        assert shrink[3] <= grow[2], "inference started before the training shrink had finished"
        rt1 = backend.job_runtime("tiny-job")
        assert backend.jobs["tiny-job"].handle is handle, "the job was restarted, not resharded in place"
        assert rt1.generation == rt0.generation + 1 and len(rt1.gpus) == 3
        assert rt1.step >= step_before, (rt1.step, step_before)
        assert ray.available_resources().get("GPU", 0) == 0  # 5 replicas + 3 workers, nothing double-booked
        assert any(a.startswith("shrink_training") for a in res.applied)

        # 3. load falls back: chat drains 5 -> 1 first, THEN the job grows 3 -> 4, same job again
        backend.calls.clear()
        _tick(ctl, source, clock, 10.0)
        assert [c[:2] for c in backend.calls] == [("service", 1), ("job", 4)], backend.calls
        assert backend.calls[0][3] <= backend.calls[1][2]
        rt2 = backend.job_runtime("tiny-job")
        assert backend.jobs["tiny-job"].handle is handle
        assert rt2.generation == rt1.generation + 1 and len(rt2.gpus) == 4 and rt2.step >= rt1.step
        steps = [r.step for r in handle.history()]
        assert steps == list(range(steps[0], steps[0] + len(steps))), "a step was lost or repeated"

        # 4. the record: every decision with its reason, every reshard with bytes and seconds
        decisions = db.list_decisions(store, limit=50, pool="ray-local")
        assert len(decisions) == 3 and all(d.reason and d.message for d in decisions)
        reshards = db.list_reshards(store, job="tiny-job")
        sizes = [(Layout.parse(r.from_layout).world_size, Layout.parse(r.to_layout).world_size, r.status)
                 for r in reshards]
        assert sizes == [(4, 3, "done"), (3, 4, "done")], sizes
        assert all(r.bytes_moved and r.bytes_moved > 0 and r.pause_seconds is not None for r in reshards)
        db.current_allocation(store, "ray-local").check_disjoint()
        print("reshards:", [(r.from_layout, r.to_layout, r.bytes_moved, round(r.pause_seconds, 3))
                            for r in reshards])
    finally:
        backend.shutdown()
        store.dispose()


def test_a_job_pushed_below_its_minimum_is_paused_off_gpu_and_resumes_at_the_same_step(ray_local, tmp_path) -> None:
    """min_gpus=3: six replicas leave two GPUs, too few, so the job is paused (state into a keeper
    actor without a GPU), not killed; when traffic falls it resumes on 4 GPUs at the step it paused at."""
    ctl, backend, source, clock, store = _controller(
        tmp_path, job={"min_gpus": 3}, scale_up=[{"type": "Pods", "value": 8, "periodSeconds": 1}])
    try:
        _tick(ctl, source, clock, 10.0)
        rt0 = backend.job_runtime("tiny-job")
        assert rt0 is not None and len(rt0.gpus) == 4
        handle = backend.jobs["tiny-job"].handle
        handle.wait_step(rt0.step + 2, timeout=120)
        backend.calls.clear()

        # 1. six replicas' worth of load: the job cannot keep 3 GPUs; paused first, then chat grows
        res = _tick(ctl, source, clock, 60.0)
        assert [c[:2] for c in backend.calls] == [("pause", 0), ("service", 6)], backend.calls
        assert backend.calls[0][3] <= backend.calls[1][2], "inference started before the pause freed the GPUs"
        assert any(a.startswith("pause_training") for a in res.applied), res.applied
        rt1 = backend.job_runtime("tiny-job")
        assert (rt1.phase, rt1.gpus) == ("Paused", ())
        assert backend.jobs["tiny-job"].handle is handle and handle.status().phase == "paused"
        paused_at = handle.status().step
        assert _gpus_free(2.0) == 2.0  # 6 replicas; the keeper holds no GPU
        time.sleep(1.0)
        assert handle.status().step == paused_at  # nothing trains while paused

        # 2. traffic falls: chat drains to 1, then the job resumes on 4 GPUs, same job, same step counter
        backend.calls.clear()
        _tick(ctl, source, clock, 10.0)
        assert [c[:2] for c in backend.calls] == [("service", 1), ("job", 4)], backend.calls
        rt2 = backend.job_runtime("tiny-job")
        assert rt2.phase == "Running" and len(rt2.gpus) == 4 and backend.jobs["tiny-job"].handle is handle
        handle.wait_step(paused_at + 2, timeout=120)
        steps = [r.step for r in handle.history()]
        assert steps == list(range(steps[0], steps[0] + len(steps))), "a step was lost or repeated"
        assert handle.history()[-1].step > paused_at

        reshards = db.list_reshards(store, job="tiny-job")
        assert [(r.from_layout.startswith("paused:"), r.to_layout.startswith("paused:"), r.status)
                for r in reshards] == [(False, True, "done"), (True, False, "done")], reshards
        assert all(r.bytes_moved and r.bytes_moved > 0 for r in reshards)
        db.current_allocation(store, "ray-local").check_disjoint()
        print("pause/resume:", [(r.from_layout, r.to_layout, r.bytes_moved, round(r.pause_seconds or 0, 3))
                                for r in reshards])
    finally:
        backend.shutdown()
        store.dispose()


def test_a_killed_training_worker_is_recovered_in_place_recorded_and_grown_back(ray_local, tmp_path) -> None:
    """A worker actor is killed: the trainer resumes on the three survivors by itself (no restart,
    same step counter), the controller puts the loss on record and lends the freed GPU back."""
    # every replica a full copy (no ZeRO-1): recoverable
    ctl, backend, source, clock, store = _controller(tmp_path, job={"replicate_optimizer": True})
    ray = ray_local
    try:
        _tick(ctl, source, clock, 10.0)
        rt0 = backend.job_runtime("tiny-job")
        assert str(rt0.layout) == "tp1.pp1.dp4" and len(rt0.gpus) == 4
        handle = backend.jobs["tiny-job"].handle
        handle.wait_step(rt0.step + 3, timeout=120)
        victim = sorted(handle.actors)[1]
        ray.kill(handle.actors[victim], no_restart=True)
        deadline = time.monotonic() + 120
        while not ((st := handle.status()).phase == "running" and st.generation > rt0.generation):
            assert st.phase in ("running", "recovering") and time.monotonic() < deadline, (st.phase, st.error)
            time.sleep(0.05)
        assert st.layout == Layout.parse("tp1.pp1.dp3") and victim not in st.workers
        rt1 = backend.job_runtime("tiny-job")
        assert len(rt1.gpus) == 3 and rt1.recovery.startswith(f"lost {victim}")

        backend.calls.clear()
        _tick(ctl, source, clock, 10.0)  # the loss goes on record; the free GPU goes back to the job
        assert [c[:2] for c in backend.calls] == [("job", 4)], backend.calls
        assert backend.jobs["tiny-job"].handle is handle, "the job was restarted, not recovered in place"
        rt2 = backend.job_runtime("tiny-job")
        assert len(rt2.gpus) == 4 and _gpus_free(3.0) == 3.0  # 1 replica + 4 workers
        handle.wait_step(rt2.step + 2, timeout=120)
        steps = [r.step for r in handle.history()]
        assert steps == list(range(steps[0], steps[0] + len(steps))), "a step was lost or repeated"
        lost = [d for d in db.list_decisions(store, limit=50, pool="ray-local") if d.reason == "WorkerLost"]
        assert len(lost) == 1 and victim in lost[0].message
        reshards = [(r.from_layout, r.to_layout, r.status) for r in db.list_reshards(store, job="tiny-job")]
        assert reshards == [("tp1.pp1.dp4", "tp1.pp1.dp3", "done"), ("tp1.pp1.dp3", "tp1.pp1.dp4", "done")], reshards
        db.current_allocation(store, "ray-local").check_disjoint()
        print("recovery:", lost[0].message)
    finally:
        backend.shutdown()
        store.dispose()


def test_a_job_no_replica_can_recover_is_restarted_by_the_controller_from_its_checkpoint(ray_local, tmp_path) -> None:
    """ZeRO-1 (each optimizer slice exists once): a killed worker fails the job. The controller reaps
    it and starts it again, and the start begins at the job's newest complete checkpoint instead of
    step 0 (the steps since then are redone)."""
    from elastic.train import checkpoint as ck

    ctl, backend, source, clock, store = _controller(
        tmp_path, job={"zero": 1, "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 2}})
    ray = ray_local
    root = tmp_path / "ck" / "tiny-job"  # <dir>/<job name>
    try:
        _tick(ctl, source, clock, 10.0)
        rt0 = backend.job_runtime("tiny-job")
        assert str(rt0.layout) == "tp1.pp1.dp4.z1", rt0.layout
        handle = backend.jobs["tiny-job"].handle
        deadline = time.monotonic() + 120
        while (ref := ck.latest(root)) is None or ref.step < 4:
            assert time.monotonic() < deadline, f"no complete checkpoint at step 4 in {root}"
            time.sleep(0.05)
        handle.wait_step(ref.step + 1, timeout=120)
        ray.kill(handle.actors[sorted(handle.actors)[1]], no_restart=True)
        deadline = time.monotonic() + 120
        while handle.status().phase != "failed":
            assert time.monotonic() < deadline, handle.status()
            time.sleep(0.05)
        ref = ck.latest(root)
        lost_at = max(r.step for r in handle.history())

        applied = []
        for _ in range(3):  # reap the failed job, then start it again on what is free
            applied += _tick(ctl, source, clock, 10.0).applied
            j = backend.jobs.get("tiny-job")
            if j is not None and j.handle is not handle:
                break
        assert any(a.startswith("stop_failed_training tiny-job") for a in applied), applied
        new = backend.jobs["tiny-job"].handle
        assert new is not handle, "the failed job was not started again"
        new.wait_step(ref.step + 2, timeout=120)
        steps = [r.step for r in new.history()]
        # at the newest complete checkpoint (the steps after it are redone; none when one completed
        # after the last step on record)
        assert steps[0] == ref.step <= lost_at + 1, (steps, ref, lost_at)
        assert steps == list(range(ref.step, ref.step + len(steps))), steps
        assert backend.job_runtime("tiny-job").checkpoint_step >= ref.step  # the operator sees it
        # and one on demand (the admin API's POST /jobs/<name>/checkpoint): complete on every rank
        out = ctl.checkpoint_job("tiny-job", wait_seconds=120)
        assert out.step is not None and out.step > out.previous_step >= ref.step, out
        assert backend.job_runtime("tiny-job").checkpoint_step >= out.step
        db.current_allocation(store, "ray-local").check_disjoint()
        print(f"failed after step {lost_at}, started again at step {ref.step} from {ref.path}")
    finally:
        backend.shutdown()
        store.dispose()


def test_a_replica_drained_ahead_leaves_the_balancer_keeps_its_gpu_and_then_leaves_at_once(ray_local) -> None:
    """``drain_ahead``: the replica a coming scale-down will remove takes no new request but finishes
    its own, keeps its GPU and still counts in the service's metric; the scale-down then finds it
    drained. A hold that is not renewed puts a replica back into the balancer."""
    from elastic.backends.ray import wait_drained
    from elastic.metrics.scrape import scrape_sum
    from elastic.model import GPU
    from elastic.serve.loadgen import LoadGenerator
    from elastic.serve.profiles import ConstantProfile
    from tests.inference.conftest import BackgroundLoad

    cfg = load_config(data=CONFIG)
    spec = cfg.services[0]
    backend = _spy_backend(cfg.pool)
    backend.drain_seconds = 30.0  # a scale-down that had to wait for a busy replica would take seconds
    gpus = tuple(GPU("local", i) for i in range(3))
    try:
        backend.set_service_gpus(spec, gpus)
        urls = backend.service_targets("chat")
        assert len(urls) == 3
        # in GPU order, whatever order they came up in (they start in parallel)
        assert [r.gpu for r in backend.replicas["chat"]] == list(gpus)
        leaving = backend.replicas["chat"][2]
        # one request of ~2 s (100 tokens at 50 tokens/s) running on the replica about to leave
        load = BackgroundLoad(LoadGenerator([leaving.url], ConstantProfile(20.0), duration=1.0, max_requests=1,
                                            max_tokens=100, seed=1))
        deadline = time.monotonic() + 10
        while not scrape_sum(leaving.url, ("vllm:num_requests_running",)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.drain_ahead("chat", [leaving.gpu], 30.0) == [leaving.url]
        assert leaving.url not in backend.service_targets("chat") and len(backend.service_targets("chat")) == 2
        assert backend.ready_replicas("chat") == 2
        assert backend.draining_targets("chat") == [leaving.url]
        assert leaving.url in backend.metric_targets("chat")  # its running request is still the service's load
        assert len(backend.service_gpus("chat")) == 3  # it holds its GPU until the scale-down
        assert wait_drained([leaving.url], timeout=10.0) == []
        # the client reads the last tokens after the server counted the request done; finish() drops
        # what is still in flight: wait (bounded) for its result first
        deadline = time.monotonic() + 30
        while not load.gen.report.results and time.monotonic() < deadline:
            time.sleep(0.05)
        report = load.finish()
        assert [(x.complete, x.tokens) for x in report.results] == [(True, 100)]  # finished, not cut
        drains: list[float] = []  # how long the scale-down's drain took (not the actors' stop)
        real_drain = backend._drain

        def timed_drain(leave):
            t0 = time.monotonic()
            real_drain(leave)
            drains.append(time.monotonic() - t0)

        backend._drain = timed_drain
        backend.set_service_gpus(spec, gpus[:2])
        # nothing left to drain: it returns on its idle reads, far from its 30 s drain_seconds
        assert len(drains) == 1 and drains[0] < backend.drain_seconds / 3, drains
        assert sorted(backend.service_targets("chat")) == sorted(urls[:2])
        assert backend.draining_targets("chat") == []
        # not renewed: back into the balancer by itself. Held out for an hour first (out whatever the
        # machine's load), then asked again for 0.3 s: the new hold replaces it, and the replica is
        # back within the wait's bound only because that one ran out
        kept = backend.replicas["chat"][1]
        assert backend.drain_ahead("chat", [kept.gpu], 3600.0) == [kept.url]
        assert kept.url not in backend.service_targets("chat")
        assert backend.draining_targets("chat") == [kept.url]
        assert backend.drain_ahead("chat", [kept.gpu], 0.3) == [kept.url]
        deadline = time.monotonic() + 30
        while sorted(backend.service_targets("chat")) != sorted(urls[:2]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(backend.service_targets("chat")) == sorted(urls[:2])
        assert backend.draining_targets("chat") == []
        # asked with no GPU: every replica back at once
        backend.drain_ahead("chat", [kept.gpu], 30.0)
        backend.drain_ahead("chat", [], 30.0)
        assert sorted(backend.service_targets("chat")) == sorted(urls[:2])
    finally:
        backend.shutdown()


def test_a_scale_down_with_handoff_frees_the_gpu_at_once_and_the_balancer_resumes_every_request(
        ray_local, monkeypatch) -> None:
    """``handoff: true``: the leaving replica gives its running requests back, the balancer (the load
    generator, following the backend's targets) resumes each on a replica that stays, and the
    scale-down returns without waiting for them; every request ends complete, with all its tokens."""
    import threading

    import elastic.backends.ray as ray_backend
    from elastic.metrics.scrape import scrape_sum
    from elastic.model import GPU
    from elastic.serve.loadgen import LoadGenerator
    from elastic.serve.profiles import ConstantProfile
    from elastic.serve.server import ReplicaConfig
    from tests.inference.conftest import BackgroundLoad

    hand_off = ray_backend.hand_off
    handed: list[dict[str, int | None]] = []  # what each hand-off call's replicas answered: url -> requests

    def recorded_hand_off(urls, timeout=2.0):
        handed.append(out := hand_off(urls, timeout))
        return out

    monkeypatch.setattr(ray_backend, "hand_off", recorded_hand_off)
    scaling, scaled = threading.Event(), threading.Event()
    held: list[bool] = []  # per pick of a target during the scale-down: released by its return (not the bound)

    def targets() -> list[str]:
        # a request handed off during the scale-down resumes (and so ends) only once it returned: a
        # scale-down that waited for its requests would find them waiting for it
        if scaling.is_set() and not scaled.is_set():
            held.append(scaled.wait(60))
        return backend.service_targets("chat")

    data = {**CONFIG, "services": [{**CONFIG["services"][0], "handoff": True}]}
    spec = load_config(data=data).services[0]
    backend = _spy_backend(load_config(data=data).pool)
    backend.drain_seconds = 30.0  # a scale-down that waited for its requests would take ~5 s
    backend.replica_config = ReplicaConfig(model="tiny", max_running=4, tokens_per_second=20.0)
    gpus = tuple(GPU("local", i) for i in range(2))
    try:
        backend.set_service_gpus(spec, gpus)
        leaving = backend.replicas["chat"][1]
        urls = backend.service_targets("chat")
        # four requests of ~6 s (120 tokens at 20 tokens/s), two on each replica
        load = BackgroundLoad(LoadGenerator(targets, ConstantProfile(40.0), duration=0.5, max_requests=4,
                                            max_tokens=120, seed=2))

        def running() -> float:
            return sum(scrape_sum(u, ("vllm:num_requests_running",)) or 0 for u in urls)

        deadline = time.monotonic() + 10
        while running() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() == 4 and scrape_sum(leaving.url, ("vllm:num_requests_running",)), "all four running"
        scaling.set()
        try:
            backend.set_service_gpus(spec, gpus[:1])
        finally:
            scaled.set()
        # the leaving replica handed its requests off (it says how many), and the scale-down returned
        # while every one of them still waited to resume
        assert [list(h) for h in handed] == [[leaving.url]] and (handed[0][leaving.url] or 0) >= 1, handed
        assert all(held), held
        assert backend.service_gpus("chat") == gpus[:1] and backend.draining_targets("chat") == []
        # every request ends (~6 s in all, hand-off included); finish() drops what is still in flight
        deadline = time.monotonic() + 60
        while len(load.gen.report.results) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        report = load.finish()
        assert len(report.results) == 4
        assert all(x.complete and x.tokens == 120 for x in report.results), report.results
        # every request the leaving replica handed off moved once, and none ended there
        assert sum(x.handoffs for x in report.results) == handed[0][leaving.url], (handed, report.results)
        assert all(x.target == backend.service_targets("chat")[0] for x in report.results if x.handoffs)
        assert all(x.target != leaving.url for x in report.results), report.results
    finally:
        backend.shutdown()


def test_a_joiner_taken_from_a_spare_holds_its_gpu_through_a_lease_that_ends_with_it(ray_local) -> None:
    """``spare_workers=1``: the job keeps one worker actor started without a GPU (torch imported); a
    grow's joiner is that actor, its GPU held in Ray's books by a lease granted before it trains,
    and the spare is replaced. When the joiner leaves (shrink) or dies, its lease is parked for the
    next holder of its GPU (a joiner there takes it: no new lease) and goes back to Ray when
    released: Ray counts exactly the GPUs the job holds plus those parked."""
    import ray

    cfg, backend, gpus = _backend_with_spares(4, spare_workers=1)
    spec = cfg.jobs[0]

    try:
        backend.set_job_gpus(spec, gpus[:2], Layout.parse("tp1.pp1.dp2"))
        h = backend.jobs[spec.name].handle
        assert len(h.spares) == 1
        spare = h.spares[0][0]
        ray.get(h.spares[0][1], timeout=120)  # warm: torch and the trainer imported, no GPU held
        assert _gpus_free(6.0) == 6.0
        step0 = h.status().step
        out = backend.set_job_gpus(spec, gpus[:3], Layout.parse("tp1.pp1.dp3"))
        assert str(out.to_layout) == "tp1.pp1.dp3" and out.step >= step0
        joiner = backend.jobs[spec.name].workers[gpus[2]]
        assert h.actors[joiner] == spare and joiner in h.leases  # the spare became the joiner
        assert ray.get(h.leases[joiner].gpu_ids.remote(), timeout=30)  # the lease holds a GPU
        assert len(h.spares) == 1 and h.spares[0][0] != spare  # replaced
        assert _gpus_free(5.0) == 5.0  # three workers' GPUs: the joiner's through its lease
        # a shrink: the joiner leaves, its lease waits for the next holder of its GPU
        lease = h.leases[joiner]
        backend.set_job_gpus(spec, gpus[:2], Layout.parse("tp1.pp1.dp2"))
        assert joiner not in h.leases and backend.leases.parked() == {gpus[2]} and _gpus_free(5.0) == 5.0
        # grow again from the new spare onto that GPU: the joiner takes the parked lease
        ray.get(h.spares[0][1], timeout=120)
        backend.set_job_gpus(spec, gpus[:3], Layout.parse("tp1.pp1.dp3"))
        joiner = backend.jobs[spec.name].workers[gpus[2]]
        assert h.leases[joiner] is lease and backend.leases.handed_over == 1 and backend.leases.parked() == set()
        assert _gpus_free(5.0) == 5.0
        # that joiner dies: recovered on dp2, its lease reaped (parked), then given back to Ray
        ray.kill(h.actors[joiner], no_restart=True)
        deadline = time.monotonic() + 60
        while joiner in h.leases and time.monotonic() < deadline:
            time.sleep(0.2)
        assert joiner not in h.leases and backend.leases.parked() == {gpus[2]}
        assert backend.leases.release() == 1 and _gpus_free(6.0) == 6.0
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0  # spares hold no GPU and are gone too


def test_a_scale_up_takes_a_spare_replica_whose_lease_holds_the_gpu_until_it_leaves(ray_local) -> None:
    """``spare_replicas=1``: a replica started ahead without a GPU (model loaded, server up, out of the
    balancer) serves on a scale-up once a lease holds its GPU in Ray's books; it is replaced in the
    background; on a scale-down its lease is parked for its GPU's next holder, then given back."""
    import httpx
    import ray

    cfg, backend, gpus = _backend_with_spares(3, spare_replicas=1)
    spec = cfg.services[0]

    try:
        backend.set_service_gpus(spec, gpus[:2])
        spares = backend._spare_reps["chat"]
        assert len(spares) == 1 and _gpus_free(6.0) == 6.0  # a spare holds no GPU
        spare, spare_url = spares[0][0], ray.get(spares[0][1], timeout=60)
        assert spare_url not in backend.service_targets("chat")  # not in the balancer yet
        backend.set_service_gpus(spec, gpus)
        new = [r for r in backend.replicas["chat"] if r.gpu == gpus[2]][0]
        assert new.actor == spare and new.url == spare_url and new.lease is not None
        assert spare_url in backend.service_targets("chat") and _gpus_free(5.0) == 5.0
        r = httpx.post(f"{spare_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert len(backend._spare_reps["chat"]) == 1 and backend._spare_reps["chat"][0][0] != spare  # replaced
        backend.set_service_gpus(spec, gpus[:2])  # it leaves; its lease waits for the GPU's next holder
        assert spare_url not in backend.service_targets("chat") and backend.leases.parked() == {gpus[2]}
        assert _gpus_free(5.0) == 5.0
        assert backend.leases.release() == 1 and _gpus_free(6.0) == 6.0
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0


def test_a_gpu_changes_hands_between_a_replica_and_a_training_worker_on_the_same_lease(ray_local) -> None:
    """The handover: a scale-down's replica parks its lease and the grow's joiner on that GPU takes
    it (no new lease actor, no Ray scheduling round); a shrink's leaver parks its lease and the
    scale-up's replica on that GPU takes it. Ray's books never count a GPU twice or lose one, and
    the job trains on through both (same step counter)."""
    import ray

    cfg, backend, gpus = _backend_with_spares(8, spare_workers=1, spare_replicas=1)
    svc, job = cfg.services[0], cfg.jobs[0]
    try:
        backend.set_service_gpus(svc, gpus[:1])
        ray.get(backend._spare_reps["chat"][0][1], timeout=60)
        backend.set_service_gpus(svc, gpus[:2])  # the replica on GPU 1 is the spare, holding a lease
        replica = [r for r in backend.replicas["chat"] if r.gpu == gpus[1]][0]
        assert replica.lease is not None
        backend.set_job_gpus(job, gpus[2:4], Layout.parse("tp1.pp1.dp2"))
        h = backend.jobs[job.name].handle
        ray.get(h.spares[0][1], timeout=120)
        assert _gpus_free(4.0) == 4.0
        step0 = h.status().step
        # 1. replica -> joiner
        backend.set_service_gpus(svc, gpus[:1])
        assert backend.leases.parked() == {gpus[1]} and _gpus_free(4.0) == 4.0  # booked, for the joiner
        out = backend.set_job_gpus(job, gpus[1:4], Layout.parse("tp1.pp1.dp3"))
        joiner = backend.jobs[job.name].workers[gpus[1]]
        assert str(out.to_layout) == "tp1.pp1.dp3" and out.step >= step0
        assert h.leases[joiner] is replica.lease and backend.leases.handed_over == 1
        assert backend.leases.parked() == set() and _gpus_free(4.0) == 4.0
        # 2. leaver -> replica: the shrink gives GPU 1 back, the scale-up's spare replica takes its lease
        ray.get(backend._spare_reps["chat"][0][1], timeout=60)
        backend.set_job_gpus(job, gpus[2:4], Layout.parse("tp1.pp1.dp2"))
        assert backend.leases.parked() == {gpus[1]} and _gpus_free(4.0) == 4.0
        backend.set_service_gpus(svc, gpus[:2])
        again = [r for r in backend.replicas["chat"] if r.gpu == gpus[1]][0]
        assert again.lease is replica.lease and backend.leases.handed_over == 2
        assert backend.leases.parked() == set() and _gpus_free(4.0) == 4.0
        assert h.status().step > step0 and h.status().layout == Layout.parse("tp1.pp1.dp2")
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0


def test_a_replica_started_cold_on_a_gpu_whose_lease_is_parked_gets_that_gpu_back_from_ray(ray_local) -> None:
    """No spare replica: the scale-up starts an actor that asks Ray for a GPU, so the lease a leaver
    parked on that GPU goes back to Ray first (else, on a full node, the actor would wait for the
    lease to expire)."""
    cfg, backend, gpus = _backend_with_spares(8)
    svc, job = cfg.services[0], cfg.jobs[0]
    try:
        backend.set_service_gpus(svc, gpus[:4])
        backend.set_job_gpus(job, gpus[4:8], Layout.parse("tp1.pp1.dp4"))  # every GPU of the node in use
        assert _gpus_free(0.0) == 0.0
        backend.set_job_gpus(job, gpus[5:8], Layout.parse("tp1.pp1.dp3"))
        assert backend.leases.parked() == {gpus[4]} and _gpus_free(0.0) == 0.0
        t0 = time.monotonic()
        backend.set_service_gpus(svc, gpus[:5])
        assert time.monotonic() - t0 < backend.leases.hold_seconds  # did not wait for the lease to expire
        assert backend.leases.parked() == set() and backend.leases.handed_over == 0
        assert backend.leases.given_back == 1
        assert len(backend.service_targets("chat")) == 5 and _gpus_free(0.0) == 0.0
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0


def test_a_scale_up_by_two_with_one_spare_serves_on_the_spare_while_the_other_replica_starts(ray_local) -> None:
    """Each new replica joins the balancer as soon as it is up: the spare at once, the replica started
    cold (a process importing torch and loading its model: seconds) when it is ready; the call returns
    once both serve."""
    import threading

    import ray

    cfg, backend, gpus = _backend_with_spares(4, spare_replicas=1)
    spec = cfg.services[0]
    try:
        backend.set_service_gpus(spec, gpus[:1])
        spare_url = ray.get(backend._spare_reps["chat"][0][1], timeout=60)
        seen: list[tuple[str, ...]] = []
        call = threading.Thread(target=backend.set_service_gpus, args=(spec, gpus[:3]))
        call.start()
        while call.is_alive():
            now = tuple(backend.service_targets("chat"))
            if not seen or seen[-1] != now:
                seen.append(now)
            time.sleep(0.02)
        call.join()
        if seen[-1] != (now := tuple(backend.service_targets("chat"))):
            seen.append(now)  # the last change can land after the loop's last look
        assert [len(t) for t in seen] == [1, 2, 3], seen  # one at a time, the spare first
        assert seen[1][1] == spare_url
        assert len(backend.service_targets("chat")) == 3 and _gpus_free(5.0) == 5.0
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0


def test_a_scale_up_by_two_with_two_spares_serves_on_both_their_leases_asked_for_together(ray_local) -> None:
    """``spare_replicas=2``: both new replicas are the spares (no cold start), each holding its GPU through
    its own lease; the leases are asked for before either is awaited (``_claim_spare_replica`` for every
    missing GPU, then ``_await_spare_replicas``), so the second does not wait for the first's process."""
    import ray

    cfg, backend, gpus = _backend_with_spares(4, spare_replicas=2)
    spec = cfg.services[0]
    claimed: list[int] = []
    awaited: list[int] = []
    claim, await_ = backend._claim_spare_replica, backend._await_spare_replicas
    backend._claim_spare_replica = lambda s, g: (claimed.append(len(awaited)), claim(s, g))[1]  # type: ignore[method-assign]
    backend._await_spare_replicas = lambda s, c: (awaited.append(len(c)), await_(s, c))[1]  # type: ignore[method-assign]
    try:
        backend.set_service_gpus(spec, gpus[:1])
        urls = {ray.get(ref, timeout=60) for _, ref in backend._spare_reps["chat"]}
        assert len(urls) == 2
        claimed.clear(), awaited.clear()
        backend.set_service_gpus(spec, gpus[:3])
        assert claimed == [0, 0] and awaited == [2]  # both asked for, then awaited together
        new = [r for r in backend.replicas["chat"] if r.gpu in gpus[1:3]]
        assert {r.url for r in new} == urls and all(r.lease is not None for r in new)
        assert set(backend.service_targets("chat")) >= urls and _gpus_free(5.0) == 5.0
    finally:
        backend.shutdown()
    assert _gpus_free(8.0) == 8.0


def test_replicas_that_fail_to_start_are_reported_by_gpu_and_the_others_serve(ray_local) -> None:
    """``_await_replicas``: of replicas started together, each one up serves; one whose start fails and
    one not up in time are named with their GPU and why, and their actors are gone."""
    import ray

    from elastic.model import GPU

    @ray.remote(num_cpus=0)
    class Fake:
        def __init__(self, how: str) -> None:
            self.how = how

        def start(self) -> str:
            if self.how == "fail":
                raise RuntimeError("model weights not found")
            if self.how == "slow":
                time.sleep(30)
            return f"http://127.0.0.1:1/{self.how}"

    cfg, backend, _ = _backend_with_spares(0)
    actors = {h: Fake.remote(h) for h in ("ok", "fail", "slow")}
    starting = [(GPU("local", i), a, a.start.remote()) for i, a in enumerate(actors.values())]
    failed = backend._await_replicas("chat", starting, timeout=5.0)
    assert backend.service_targets("chat") == ["http://127.0.0.1:1/ok"]
    assert [(str(g), "model weights not found" in why or why) for g, why in failed] == [
        (str(GPU("local", 1)), True), (str(GPU("local", 2)), "not up within 5 s")]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors["slow"].start.remote(), timeout=10)


def test_a_job_still_starting_can_be_called_off_and_gives_every_gpu_back(ray_local) -> None:
    """A start is a grow from nothing: until its workers have all registered it can be called off
    (inference needs a GPU it was lent), nothing exists to lose, and the job starts again later."""
    import threading

    from elastic.backends.base import GrowCancelled
    from elastic.model import GPU

    cfg = load_config(data=CONFIG)
    spec = cfg.jobs[0]
    backend = _spy_backend(cfg.pool)
    out: dict[str, object] = {}

    def start() -> None:
        try:
            out["result"] = backend.set_job_gpus(spec, tuple(GPU("local", i) for i in range(4)),
                                                 Layout.parse("tp1.pp1.dp4"))
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out["error"] = e

    try:
        t = threading.Thread(target=start)
        t.start()
        deadline = time.monotonic() + 30
        while "tiny-job" not in backend._starting and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # its workers are starting
        assert backend.cancel_grow("tiny-job") is True
        t.join(60)
        assert not t.is_alive()
        assert isinstance(out.get("error"), GrowCancelled), out
        assert "called off" in str(out["error"])
        assert backend.job_runtime("tiny-job") is None and "tiny-job" not in backend._starting
        # every GPU back: its workers' leases wait for the GPUs' next holders, nothing else holds one
        gpus = {GPU("local", i) for i in range(4)}
        assert backend.leases.parked() == gpus and _gpus_free(4.0) == 4.0
        assert backend.cancel_grow("tiny-job") is False  # nothing in flight any more
        # it starts again on fewer GPUs, from step 0: nothing had been trained
        parked = backend.leases.parked()
        res = backend.set_job_gpus(spec, (GPU("local", 0), GPU("local", 1)), Layout.parse("tp1.pp1.dp2"))
        assert str(res.to_layout) == "tp1.pp1.dp2"
        rt = backend.job_runtime("tiny-job")
        assert rt is not None and len(rt.gpus) == 2 and rt.phase in ("Running", "Rescaling")
        assert backend.leases.handed_over == len(parked & {GPU("local", 0), GPU("local", 1)})
        assert backend.leases.release() == len(parked - {GPU("local", 0), GPU("local", 1)})
        assert _gpus_free(6.0) == 6.0  # the two workers'; nothing else booked
    finally:
        backend.shutdown()


def test_a_detached_jobs_coordinator_is_asked_for_a_checkpoint_through_its_actor(ray_local, tmp_path) -> None:
    """Detached mode reaches the coordinator through an actor: the ask, the wait and its errors cross it."""
    from elastic.backends.ray_jobs import _CoordinatorActor, _RemoteCoordinator
    from elastic.train.checkpoint import CheckpointSettings
    from elastic.train.rendezvous import CoordinatorSettings

    ray = ray_local
    cls = ray.remote(num_cpus=0, max_concurrency=4)(_CoordinatorActor)
    actor = cls.remote("cp", {"model": "tiny"}, CoordinatorSettings(checkpoint=CheckpointSettings(str(tmp_path / "ck"))),
                       {}, host="127.0.0.1")
    try:
        rc = _RemoteCoordinator(actor, "cp")
        ticket = rc.request_checkpoint()
        assert tuple(ticket) == (-1, 0)
        with pytest.raises(TimeoutError, match="no checkpoint after step -1 within 0.2 s .the workers have not"):
            rc.wait_checkpoint(ticket, 0.2)
    finally:
        ray.kill(actor)
