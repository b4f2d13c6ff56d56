"""Bad input on the live Kubernetes path (real Kopf operator, coordinator runtime, the node agent
running pods): a job whose command exits at once, a job template asking for GPUs, a Deployment that
never becomes ready and one whose pods ask more GPUs than a node has. Each gets a condition and a
Warning Event naming the reason; nothing is double-booked; the healthy service beside them keeps
its replicas. The load is pushed (``InProcessSource``) so the replica counts are exact."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from . import e2e
from .e2e import NS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SLEEP = ["python", "-c", "import time\nwhile True: time.sleep(0.2)"]


def _deployment(name: str, *, probe_port: int | None = None, gpus: int = 1) -> dict[str, Any]:
    ctr: dict[str, Any] = {"name": "c", "image": "x", "command": SLEEP,
                           "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
    if probe_port:  # nobody listens there: the probe never passes
        ctr["readinessProbe"] = {"httpGet": {"path": "/health", "port": probe_port}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"terminationGracePeriodSeconds": 1, "containers": [ctr]}}}}


def _service(name: str, deployment: str) -> dict[str, Any]:
    body = e2e.service_cr(target=10)
    body["metadata"]["name"] = name
    body["spec"].update(scaleTargetRef={"name": deployment}, startupSeconds=2, maxReplicas=2)
    return body


def _job(name: str, **template: Any) -> dict[str, Any]:
    body = e2e.job_cr(maxGPUs=2, template={"image": "elastic:dev", **template})
    body["metadata"]["name"] = name
    return body


def _warnings(c: e2e.Cluster, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e["note"]) for e in c.events(name) if e["type"] == "Warning"]


def test_bad_input_on_the_live_path_says_why_and_leaves_the_rest_of_the_pool_alone(tmp_path: Path) -> None:
    from elastic.metrics import InProcessSource

    source = InProcessSource(max_age=3600)
    for svc, load in (("chat", 20.0), ("stuck", 5.0), ("big", 5.0)):
        source.set(f"{NS}/{svc}", load, time.time())  # chat: 2 replicas; the others 1
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(_deployment("vllm"))
        c.apply(_deployment("stuck", probe_port=e2e.free_port()))
        c.apply(_deployment("big", gpus=8))
        c.apply(e2e.pool_cr())
        c.apply(_service("chat", "vllm"))
        wait_for("chat at 2 ready", lambda: c.ready_replicas() == 2, 60)
        c.apply(_service("stuck", "stuck"))
        c.apply(_service("big", "big"))
        starts = tmp_path / "crash-starts"  # each crash pod records its start and its start attempt
        starts.mkdir()
        c.apply(_job("crash", command=e2e.RECORDED_CRASH, args=[str(starts)]))
        c.apply(_job("greedy", resources={"limits": {"nvidia.com/gpu": "8"}}))

        # 1. a job template asking for GPUs: refused at once, naming the field; no pod
        cond = wait_for("greedy refused", lambda: c.condition("elastictrainingjobs", "greedy", "Ready"), 30)
        assert (cond["status"], cond["reason"]) == ("False", "InvalidTemplate"), cond
        assert cond["message"].startswith("spec.template.resources.limits") and "nvidia.com/gpu" in cond["message"]
        wait_for("greedy Warning", lambda: [w for w in _warnings(c, "greedy") if w[0] == "InvalidTemplate"], 10)

        # 2. a job whose command exits at once: StartFailed with the exit code, its pods gone, backing off
        cond = wait_for("crash StartFailed", lambda: (c.condition("elastictrainingjobs", "crash", "Ready")
                                                      if c.condition("elastictrainingjobs", "crash", "Ready").get(
                                                          "reason") == "StartFailed" else None), 90)
        assert cond["status"] == "False" and "exit code 3" in cond["message"], cond
        assert "back-off" in cond["message"]
        warn = wait_for("crash Warning", lambda: [w for w in _warnings(c, "crash") if w[0] == "StartFailed"], 10)
        assert "exit code 3" in warn[0][1]
        # the phase is patched right after the condition, in a call of its own: wait for it too
        wait_for("crash phase BackOff", lambda: c.status("elastictrainingjobs", "crash").get("phase") == "BackOff", 10)

        # 3. Deployments that never become ready: ReplicasNotReady naming each pod's trouble
        cond = wait_for("stuck not ready", lambda: (c.condition("inferenceservices", "stuck", "Ready")
                                                    if c.condition("inferenceservices", "stuck", "Ready").get(
                                                        "reason") == "ReplicasNotReady" else None), 60)
        assert cond["status"] == "False" and "readiness probe failing" in cond["message"], cond
        assert "Deployment ml/stuck: 0 of 1 replicas ready" in cond["message"]
        cond = wait_for("big not ready", lambda: (c.condition("inferenceservices", "big", "Ready")
                                                  if c.condition("inferenceservices", "big", "Ready").get(
                                                      "reason") == "ReplicasNotReady" else None), 60)
        assert "Unschedulable" in cond["message"] and "Insufficient nvidia.com/gpu" in cond["message"], cond
        # the Warning is posted right after the condition, in a call of its own: wait for it too
        wait_for("stuck Warning", lambda: [w for w in _warnings(c, "stuck") if w[0] == "ReplicasNotReady"], 10)

        # 4. the crash job's start attempts are spaced by its back-off, not every 0.5 s cycle
        attempts = wait_for("a second attempt", lambda: (a := e2e.start_attempts(starts)) and len(a) >= 2 and a, 60)
        gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
        assert gaps and min(gaps) >= 4.0, gaps  # the first back-off is 5 s
        # 5. the rest of the pool: chat still at 2 ready replicas; nothing held twice
        assert c.ready_replicas() == 2 and c.replicas_wanted() == 2
        assert [n for n in c.agent.started if n.startswith("greedy")] == []
        live_crash = [p["metadata"]["name"] for p in c.emu.objects("pods", NS)
                      if p["metadata"]["labels"].get("elastic.dev/job") == "crash"
                      and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        peak, unsched = e2e.gpu_ledger(c.emu)
        pool = c.status("gpupools", e2e.POOL, None)
    assert peak <= e2e.TOTAL_GPUS, peak
    assert all(n.startswith("big-") for n in unsched), unsched  # only the 8-GPU pod, never a worker
    assert pool["inferenceGPUs"] + pool["trainingGPUs"] <= pool["gpus"]
    assert len(live_crash) <= 2
