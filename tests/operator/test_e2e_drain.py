"""Drain before a scale-down on Kubernetes (opt-in: the InferenceService's ``elastic.dev/drain``
annotation). The real Kopf operator, real reference replicas run by the node agent, and the load
generator sending only to the pods a Service selecting ``elastic.dev/serving: "true"`` would.

3 replicas under load; the load pushed to the controller falls to 1 replica's worth: the operator
relabels the 2 pods that will go ``elastic.dev/serving=false`` (out of the balancer) with the lowest
``pod-deletion-cost``, waits until they report no request, and only then scales the Deployment: the
ReplicaSet removes exactly those 2, and no request is cut.

Drain ahead (the service's ``drain_ahead_seconds``): the controller takes out of the balancer the
replicas a scale-down its window is about to let through will remove, before the window passes,
and puts them back when the load returns first. ``elastic.crds.InferenceServiceSpec`` has no field
for it yet, so that test runs the controller itself over the Kubernetes backend, against the
emulator and the node agent, as the operator's pool runs it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from . import e2e
from .e2e import NS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_replicas_leave_the_balancer_and_go_idle_before_the_scale_down_removes_exactly_them(tmp_path: Path) -> None:
    from elastic.metrics import InProcessSource

    source = InProcessSource(max_age=3600)
    source.set(f"{NS}/{e2e.SERVICE}", 12.0, time.time())  # target 4: 3 replicas
    dep = e2e.replica_deployment(e2e.free_port(), replicas=3)
    dep["spec"]["template"]["metadata"]["labels"]["elastic.dev/serving"] = "true"
    svc = e2e.service_cr()
    svc["metadata"]["annotations"] = {"elastic.dev/drain": "true", "elastic.dev/drain-seconds": "30"}
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(dep)
        c.apply(e2e.pool_cr())
        c.apply(svc)
        wait_for("3 ready replicas", lambda: c.ready_replicas() == 3, 120)
        serving = {p["metadata"]["name"] for p in c.replica_pods()}
        load = e2e.Load(c, rate=3.0, max_tokens=8, selector={"elastic.dev/serving": "true"})
        with load:
            wait_for("requests answered on every replica", lambda: len({
                r.target for r in load.gen.report.results if r.complete}) == 3, 60)
            mark = len(c.emu.events)
            source.set(f"{NS}/{e2e.SERVICE}", 4.0, time.time())  # 1 replica's worth
            wait_for("scaled to 1", lambda: c.replicas_wanted() == 1, 90)
            wait_for("2 replicas gone", lambda: len(c.replica_pods()) == 1, 60)
            time.sleep(2.0)  # requests keep going to the one left
        report = load.gen.report
        alog = e2e.api_log(c.emu)[mark:]
    drained = sorted({o["metadata"]["name"] for _, r, t, o in alog if r == "pods"
                      and o["metadata"].get("labels", {}).get("elastic.dev/serving") == "false"})
    deleted = sorted({o["metadata"]["name"] for _, r, t, o in alog if r == "pods" and t == "DELETED"})
    assert len(drained) == 2 and drained == deleted, (drained, deleted)
    assert set(drained) <= serving
    first_drain = e2e.first_rv(alog, lambda r, t, o: r == "pods"
                               and o["metadata"].get("labels", {}).get("elastic.dev/serving") == "false")
    scaled = e2e.first_rv(alog, lambda r, t, o: r == "deployments" and o["spec"].get("replicas") == 1)
    assert first_drain is not None and scaled is not None and first_drain < scaled
    pod = next(o for _, r, t, o in alog if r == "pods" and o["metadata"]["name"] == drained[0]
               and o["metadata"].get("labels", {}).get("elastic.dev/serving") == "false")
    assert pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000"
    # nothing cut: every request sent was answered in full
    assert report.results and all(r.status == 200 and r.complete for r in report.results), [
        r for r in report.results if not (r.status == 200 and r.complete)][:3]


def _metric_running(url: str) -> float:
    from elastic.metrics.scrape import scrape_sum

    return scrape_sum(url, ("vllm:num_requests_running",))


def _metric_held(url: str) -> float:
    """Requests a replica runs or has queued (a burst of the load can queue the long one)."""
    from elastic.metrics.scrape import scrape_sum

    return scrape_sum(url, ("vllm:num_requests_running", "vllm:num_requests_waiting")) or 0.0


def _pods(c: e2e.Cluster) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in c.replica_pods() if not p["metadata"].get("deletionTimestamp")}


def _drained(c: e2e.Cluster) -> list[str]:
    """The replica pods out of the balancer: labelled ``elastic.dev/serving=false``, with the lowest
    ``pod-deletion-cost`` (the ReplicaSet removes them first)."""
    out = []
    for name, p in _pods(c).items():
        labels, ann = p["metadata"].get("labels") or {}, p["metadata"].get("annotations") or {}
        if labels.get("elastic.dev/serving") == "false":
            assert ann.get("controller.kubernetes.io/pod-deletion-cost") == "-1000", (name, ann)
            out.append(name)
        else:
            assert labels.get("elastic.dev/serving") == "true" and "controller.kubernetes.io/pod-deletion-cost" \
                not in ann, (name, labels, ann)
    return sorted(out)


def test_replicas_drained_ahead_of_a_scale_down_leave_the_balancer_come_back_with_the_load_and_are_the_ones_removed(
        tmp_path: Path) -> None:
    """3 replicas under load (target 4, load 12), a scale-down window of 8 s, drain ahead 6 s. The load
    falls to 1 replica's worth: 2 s in, the controller drains 2 replicas ahead (out of the Service's
    selection, deletion cost -1000) while each still runs a long request, which it finishes; the
    Deployment keeps 3 and nothing is deleted. The load returns before the window passes: both serve
    again. It falls again and stays down: drained ahead again, and when the window lets the
    scale-down through, the ReplicaSet removes exactly the 2 drained ahead. No request is cut."""
    from elastic import store as db
    from elastic.backends.kubernetes import KubernetesBackend, ServiceTarget
    from elastic.config import load_config
    from elastic.controller import Controller
    from elastic.metrics import InProcessSource
    from elastic.model import GPU
    from elastic.serve.loadgen import LoadGenerator
    from elastic.serve.profiles import ConstantProfile
    from tests.fakes import Clock
    from tests.inference.conftest import BackgroundLoad

    cfg = load_config(data={
        "pool": {"name": e2e.POOL, "nodes": 1, "gpus_per_node": e2e.TOTAL_GPUS, "hardware": "cpu"},
        "services": [{"name": e2e.SERVICE, "min_replicas": 1, "max_replicas": 3,
                      "metric": {"preset": "vllm-requests", "target": 4}, "startup_seconds": 0,
                      "drain_ahead_seconds": 6,
                      "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                                   "scaleDown": {"stabilizationWindowSeconds": 8}}}],
        # cycles 20 s apart: the controller holds a replica out for 3 cycles (60 s) unless asked
        # again, longer than this test takes to bring the load back; it must not wait for that
        "controller": {"tick_seconds": 20, "lease_seconds": 120, "metrics_max_age_seconds": 3600}})
    url = f"sqlite:///{tmp_path / 'state.db'}"
    db.upgrade(url)
    store = db.Store.from_url(url)
    dep = e2e.replica_deployment(e2e.free_port(), replicas=3)
    dep["spec"]["template"]["metadata"]["labels"]["elastic.dev/serving"] = "true"
    source, clock = InProcessSource(max_age=3600), Clock()
    with e2e.cluster(tmp_path / "c") as c:
        backend = KubernetesBackend(node_selector={"pool": e2e.POOL}, gpus_per_node=e2e.TOTAL_GPUS, api_client=c.api,
                                    job_runtime="pods", scale_down_wait_seconds=60, poll_seconds=0.05)
        # the 3 GPUs its replicas hold, as the operator books them from the InferenceService's status
        backend.set_service(e2e.SERVICE, ServiceTarget(NS, e2e.DEPLOYMENT, drain=True, drain_seconds=30),
                            tuple(GPU("n0", i) for i in range(3)))
        ctl = Controller(cfg, backend, store, {e2e.SERVICE: source}, owner="t", clock=clock)

        def tick(load: float, dt: float = 2.0) -> list[str]:
            clock.t += dt
            source.set(e2e.SERVICE, load, clock.t)
            res = ctl.tick()
            assert res.error is None, res.error
            return [a for a in res.applied if a.startswith("drain_ahead")]

        c.apply(dep)
        wait_for("3 ready replicas", lambda: c.ready_replicas() == 3, 120)
        assert tick(12.0) == [] and len(backend.service_gpus(e2e.SERVICE)) == 3
        pods = _pods(c)
        urls = {n: f"http://{p['status']['podIP']}:{p['spec']['containers'][0]['ports'][0]['containerPort']}"
                for n, p in pods.items()}
        load = e2e.Load(c, rate=4.0, max_tokens=4, selector={"elastic.dev/serving": "true"})
        with load:
            wait_for("requests answered on every replica", lambda: {
                r.target for r in load.gen.report.results if r.complete} == set(urls.values()), 60)
            # one long request on every replica (60 tokens at 4 per second), running when the drain comes
            long = {n: BackgroundLoad(LoadGenerator([u], ConstantProfile(20.0), duration=1.0, max_requests=1,
                                                    max_tokens=60, seed=i))
                    for i, (n, u) in enumerate(sorted(urls.items()))}
            # in flight from its generator (a short request of the load also counts as running: the
            # replica's gauge alone would not say the long one started), and running on the replica
            wait_for("a long request running on every replica", lambda: all(
                long[n].gen.in_flight.get(u, 0) >= 1 and (_metric_running(u) or 0) >= 1 for n, u in urls.items()), 30)

            # 1. the load falls to 1 replica's worth: 2 s in, 2 replicas leave the balancer ahead
            actions = tick(4.0)
            assert actions and actions[0].startswith("drain_ahead chat: 2 replica(s) out of the load balancer"), actions
            ahead = _drained(c)
            assert len(ahead) == 2 and c.replicas_wanted() == 3 and sorted(_pods(c)) == sorted(pods), ahead
            drained_at = load.gen.elapsed()
            # they keep their GPUs, stay ready and finish what they run
            assert len(backend.service_gpus(e2e.SERVICE)) == 3 and c.ready_replicas() == 3
            assert all(_metric_held(urls[n]) >= 1 for n in ahead), "a drained replica keeps serving its requests"
            wait_for("the long requests answered", lambda: all(g.gen.report.results for g in long.values()), 60)
            done = {n: g.finish() for n, g in long.items()}
            assert all([(r.status, r.complete, r.tokens) for r in d.results] == [(200, True, 60)]
                       for d in done.values()), {n: d.results for n, d in done.items()}
            # the balancer sends them nothing new
            after = [r for r in load.gen.report.results if r.sent_at > drained_at]
            assert after and not {r.target for r in after} & {urls[n] for n in ahead}, after

            # 2. the load returns before the window passes: both serve again at once (their hold has
            # not run out), nothing removed
            pods_now = _pods(c)
            assert all(float(pods_now[n]["metadata"]["annotations"]["elastic.dev/drained-until"]) > time.time()
                       for n in ahead), "the hold ran out: this would not show the load's return undrains"
            actions = tick(12.0)
            assert actions == ["drain_ahead chat: every replica back in the load balancer"], actions
            assert _drained(c) == [] and sorted(_pods(c)) == sorted(pods) and c.replicas_wanted() == 3
            back_at = load.gen.elapsed()
            wait_for("requests answered by the replicas drained before", lambda: {urls[n] for n in ahead} <= {
                r.target for r in load.gen.report.results if r.sent_at > back_at and r.complete}, 30)

            # 3. it falls again and stays down: drained ahead again, then the scale-down removes them
            mark = len(c.emu.events)
            tick(4.0)
            ahead = _drained(c)
            assert len(ahead) == 2, ahead
            for _ in range(8):
                if c.replicas_wanted() == 1:
                    break
                assert _drained(c) == ahead and len(_pods(c)) == 3, "drained ahead until the window lets go"
                tick(4.0)
            assert c.replicas_wanted() == 1, "the window of 8 s lets the scale-down through"
            wait_for("the Deployment down to 1 pod", lambda: len(c.replica_pods()) == 1, 60)
            assert sorted(_pods(c)) == sorted(set(pods) - set(ahead))
            time.sleep(1.0)  # a few more requests to the one left
        report = load.gen.report
        alog = e2e.api_log(c.emu)[mark:]
    store.dispose()
    deleted = sorted({o["metadata"]["name"] for _, r, t, o in alog if r == "pods" and t == "DELETED"})
    assert deleted == ahead, (deleted, ahead)
    assert report.results and all(r.status == 200 and r.complete for r in report.results), [
        r for r in report.results if not (r.status == 200 and r.complete)][:3]
