"""The operator's pool cycle does not wait for a job's pods to start (real Kopf operator, coordinator
runtime, the node agent running pods).

A job's first start waits until its worker pods registered at the coordinator; the pool's
controller runs it in the background, so meanwhile the same pool goes on scaling its
InferenceService and publishing status, and the job's outcome is read on a later cycle: a start
that lands posts its Event, one that fails backs off with its Warning, as before, and a job deleted
while it starts is released at once (its start called off). The worker pods
here are held back deterministically: their container waits for a file the test creates, then
runs the worker. The load is pushed (``InProcessSource``), so replica counts are exact.

Also: a member registered before its GPUPool exists loses ``PoolNotFound`` once the pool is
created, even when that pool has no node to reconcile on yet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from . import e2e
from .e2e import NS, wait_for
from .test_e2e_restart import _sleepers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SERVICE = f"{NS}/{e2e.SERVICE}"
# a worker pod's container: wait for the gate file (argv[1]), then run the worker as the image would
GATED = ["python", "-c", "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
         "os.execv(sys.executable, [sys.executable, '-m', 'elastic.train.worker'])"]


def _service(target: float = 10.0) -> dict[str, Any]:
    body = e2e.service_cr(target=target)
    body["spec"]["startupSeconds"] = 60
    return body


def _job(name: str, max_gpus: int = 2, **template: Any) -> dict[str, Any]:
    body = e2e.job_cr(maxGPUs=max_gpus, template={"image": "elastic:dev", **template})
    body["metadata"]["name"] = name
    return body


def _events(c: e2e.Cluster, name: str, type_: str) -> list[tuple[str, str, str]]:
    return [(e["action"], e["reason"], e["note"]) for e in c.events(name) if e["type"] == type_]


def _pool_events(c: e2e.Cluster, type_: str) -> list[tuple[str, str]]:
    """Events about the GPUPool (cluster-scoped: posted in ``default``)."""
    evs = sorted(c.emu.objects("events", "default"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["reason"], e["note"]) for e in evs if e["regarding"]["name"] == e2e.POOL and e["type"] == type_]


def _running(c: e2e.Cluster, job: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in c.emu.objects("pods", NS)
                  if p["metadata"].get("labels", {}).get("elastic.dev/job") == job
                  and (p.get("status") or {}).get("phase") == "Running")


def test_the_pool_scales_its_service_and_publishes_while_a_jobs_first_pods_start(tmp_path: Path) -> None:
    from elastic.metrics import InProcessSource

    gate = tmp_path / "gate"
    source = InProcessSource(max_age=3600)
    source.set(SERVICE, 5.0, time.time())  # 1 replica (target 10)
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(_service())
        wait_for("the pool publishing 1 inference GPU",
                 lambda: c.status("gpupools", e2e.POOL, None).get("inferenceGPUs") == 1, 60)
        c.apply(_job(e2e.JOB, command=GATED, args=[str(gate)]))

        # the job's start is in flight: both pods run (waiting for the gate), none registered
        workers = wait_for("the job's 2 worker pods running, held at the gate",
                           lambda: (r := _running(c, e2e.JOB)) and len(r) == 2 and r, 60)
        assert c.handle() is not None and c.handle().status().phase == "starting"
        assert not gate.exists()

        # load rises: the same pool scales the service and publishes, while the job still starts
        source.set(SERVICE, 25.0, time.time())
        wait_for("the Deployment scaled to 3 while the job's pods start", lambda: c.replicas_wanted() == 3, 60)
        wait_for("the pool status published with 3 inference GPUs",
                 lambda: c.status("gpupools", e2e.POOL, None).get("inferenceGPUs") == 3, 30)
        svc = wait_for("the service status published at 3 replicas", lambda: (
            st := c.status("inferenceservices", e2e.SERVICE)) and st.get("desiredReplicas") == 3 and st, 30)
        assert svc["replicas"] == 3, svc
        job = c.status("elastictrainingjobs", e2e.JOB)
        assert job.get("phase") == "Pending" and job.get("worldSize") == 0, job
        # still the first attempt: its pods were neither replaced nor registered
        assert c.handle().status().phase == "starting" and _running(c, e2e.JOB) == workers
        assert not _events(c, e2e.JOB, "Warning"), c.events(e2e.JOB)

        # a second job, held at a gate that never opens, is deleted while it starts: its finalizer
        # calls the start off and deletes its pods, without waiting for the start (two minutes)
        c.apply(_job("held", command=GATED, args=[str(tmp_path / "never")], max_gpus=1))
        held = wait_for("held's worker pod running at its gate", lambda: _running(c, "held"), 60)
        c.custom.delete_namespaced_custom_object(e2e.G, e2e.V, NS, "elastictrainingjobs", "held")
        wait_for("held gone (its finalizer done)", lambda: c.emu.get("elastictrainingjobs", NS, "held") is None, 30)
        wait_for("held's pods gone", lambda: all(c.emu.get("pods", NS, n) is None for n in held), 30)
        assert not (tmp_path / "never").exists()
        assert c.handle().status().phase == "starting" and _running(c, e2e.JOB) == workers

        # the gate opens: the pods register, the start lands and the next cycle says so
        gate.write_text("go")
        st = wait_for("the job running on 2 GPUs", lambda: (s := c.status("elastictrainingjobs", e2e.JOB))
                      and s.get("phase") == "Running" and s.get("worldSize") == 2 and s, 120)
        assert st["generation"] == 1 and sorted(st["workers"]) == workers, st
        c.handle().wait_step(1, timeout=60)
        started = wait_for("the job's Normal Event for its start", lambda: [
            e for e in _events(c, e2e.JOB, "Normal") if e[0] == "grow_training"], 30)
        assert len(started) == 1, started
        wait_for("the pool publishing 2 training GPUs",
                 lambda: c.status("gpupools", e2e.POOL, None).get("trainingGPUs") == 2, 30)
        assert c.replicas_wanted() == 3
        peak, unsched = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS and unsched == [], (peak, unsched)


def test_a_first_start_failing_in_the_background_still_backs_off_with_its_warning(tmp_path: Path) -> None:
    from elastic.metrics import InProcessSource

    source = InProcessSource(max_age=3600)
    source.set(SERVICE, 5.0, time.time())
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(_service())
        starts = tmp_path / "crash-starts"  # each crash pod records its start and its start attempt
        starts.mkdir()
        c.apply(_job("crash", command=e2e.RECORDED_CRASH, args=[str(starts)]))

        def start_failed() -> dict[str, Any] | None:
            cond = c.condition("elastictrainingjobs", "crash", "Ready")
            return cond if cond.get("reason") == "StartFailed" else None

        cond = wait_for("crash Ready=False/StartFailed", start_failed, 90)
        assert cond["status"] == "False" and "exit code 3" in cond["message"], cond
        assert "next try after a back-off of 5 s" in cond["message"], cond
        warn = wait_for("crash's StartFailed Warning", lambda: [
            e for e in _events(c, "crash", "Warning") if e[1] == "StartFailed"], 10)
        assert "exit code 3" in warn[0][2], warn
        wait_for("crash phase BackOff", lambda: c.status("elastictrainingjobs", "crash").get("phase") == "BackOff",
                 10)
        # the pool says the start failed, as for a synchronous one (ApplyFailed, naming the job)
        applied = wait_for("the pool's ApplyFailed Warning", lambda: [
            n for r, n in _pool_events(c, "Warning") if r == "ApplyFailed"], 10)
        assert f"grow_training {NS}/crash: " in applied[0] and "exit code 3" in applied[0], applied
        # the next attempt only once the back-off (5 s) is over, not on the next cycle
        attempts = wait_for("a second attempt", lambda: (a := e2e.start_attempts(starts)) and len(a) >= 2 and a, 60)
        assert attempts[1] - attempts[0] >= 4.0, attempts
        # the second failure doubles the back-off
        wait_for("the back-off doubled to 10 s", lambda: (cond := start_failed())
                 and "back-off of 10 s" in cond["message"], 60)
        assert c.replicas_wanted() == 1 and c.ready_replicas() == 1  # the service beside it is untouched
        peak, _ = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS, peak


def test_pool_not_found_clears_when_the_pool_is_created_after_its_members(tmp_path: Path) -> None:
    """Pool ``b`` matches no node: its cycle never reaches the controller (``NoNodes``), so only its
    creation can tell the service and the job that registered before it that it now exists."""
    from elastic.metrics import InProcessSource

    source = InProcessSource(max_age=3600)
    source.set(SERVICE, 5.0, time.time())
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(_sleepers())
        svc, job = _service(), _job("waiting")
        svc["spec"]["pool"] = job["spec"]["pool"] = "b"
        c.apply(svc)
        c.apply(job)
        for plural, name in (("inferenceservices", e2e.SERVICE), ("elastictrainingjobs", "waiting")):
            cond = wait_for(f"{name} PoolNotFound", lambda p=plural, n=name: (
                x := c.condition(p, n, "Ready")) and x.get("reason") == "PoolNotFound" and x, 30)
            assert cond["status"] == "False" and "GPUPool 'b' does not exist" in cond["message"], cond
        pool = e2e.pool_cr()
        pool["metadata"]["name"] = "b"
        pool["spec"]["nodeSelector"] = {"pool": "b"}
        c.apply(pool)
        wait_for("pool b NoNodes", lambda: (
            x := next((k for k in (c.status("gpupools", "b", None).get("conditions") or []) if k["type"] == "Ready"),
                      {})) and x.get("reason") == "NoNodes", 30)
        for plural, name in (("inferenceservices", e2e.SERVICE), ("elastictrainingjobs", "waiting")):
            cond = wait_for(f"{name} accepted by pool b", lambda p=plural, n=name: (
                x := c.condition(p, n, "Ready")) and x.get("reason") == "Accepted" and x, 30)
            assert cond["status"] == "True" and cond["message"] == "spec accepted by pool b", cond
        assert not [p for p in c.emu.objects("pods", NS)
                    if p["metadata"].get("labels", {}).get("elastic.dev/job") == "waiting"], "pool b has no node"


def test_a_rebuilt_controller_keeps_the_lease_and_the_start_in_flight(db_url: str) -> None:
    """A spec or membership change rebuilds the pool's controller (``Controller.take_over``): the new one acts
    on its first tick (it holds the lease at the same epoch) rather than standing by until the old
    lease runs out, keeps the GPUs of the start still in flight reserved, and that start, run by the
    old controller, finishes on record through the lease the new one renews. Fake backend (our
    boundary), real store."""
    import threading

    from elastic import store as db
    from elastic.config import load_config
    from elastic.controller import Controller
    from elastic.metrics import InProcessSource
    from tests.controller.fake_backend import FakeBackend
    from tests.controller.test_controller import CONFIG
    from tests.fakes import Clock

    class HeldStart(FakeBackend):
        def __init__(self, nodes: dict[str, int]) -> None:
            super().__init__(nodes)
            self.release, self.waiting = threading.Event(), threading.Event()

        def set_job_gpus(self, spec: Any, gpus: Any, layout: Any) -> Any:
            if gpus and spec.name not in self.jobs:  # a first start: its pods start until released
                self.waiting.set()
                assert self.release.wait(30), "start never released"
            return super().set_job_gpus(spec, gpus, layout)

    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    backend = HeldStart({"n0": 4, "n1": 4})
    clock, source = Clock(), InProcessSource(max_age=60)
    cfg = load_config(data=CONFIG)

    def build() -> Controller:
        return Controller(cfg, backend, store, {"chat": source}, owner="operator-0", clock=clock, async_grow=True)

    def tick(ctl: Controller) -> Any:
        clock.t += 1.0  # well within the lease (15 s)
        source.set("chat", 10.0, clock.t)
        res = ctl.tick()
        assert res.error is None, res.error
        return res

    try:
        old = build()
        res = tick(old)
        assert "grow_training pretrain (started)" in res.applied, res.applied
        assert backend.waiting.wait(10)
        # the premise: a controller built afresh under the same name stands by while the lease lives
        assert tick(build()).reason == "NotLeader"
        new = build()
        new.take_over(old)
        res = tick(new)
        assert res.acted and res.reason != "NotLeader", (res.reason, res.message)
        held = new._observed_allocation()
        held.check_disjoint()
        assert len(held.gpus_of("pretrain")) == 6, held  # reserved for the start in flight (tp1.pp3.dp2)
        assert "pretrain" not in backend.jobs and len(backend.service_gpus("chat")) == 1
        backend.release.set()
        assert new.wait_idle(10), "the start did not land"
        assert len(backend.jobs["pretrain"].gpus) == 6
        tick(new)
        # its action closed on record: the old controller's write passed the fence the new one keeps
        assert db.open_actions(store, "p") == [], db.open_actions(store, "p")
        assert old.backoff == {} and new.backoff == {}
    finally:
        backend.release.set()
        store.dispose()
