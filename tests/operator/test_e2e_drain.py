"""Drain before a scale-down on Kubernetes (opt-in: the InferenceService's ``elastic.dev/drain``
annotation). The real Kopf operator, real reference replicas run by the node agent, and the load
generator sending only to the pods a Service selecting ``elastic.dev/serving: "true"`` would.

3 replicas under load; the load pushed to the controller falls to 1 replica's worth: the operator
relabels the 2 pods that will go ``elastic.dev/serving=false`` (out of the balancer) with the lowest
``pod-deletion-cost``, waits until they report no request, and only then scales the Deployment: the
ReplicaSet removes exactly those 2, and no request is cut."""

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
