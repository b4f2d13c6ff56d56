"""The test-side node agent (``tests.operator.kubelet``) against the strict API emulator: it is the
kubelet, scheduler and ReplicaSet of the end-to-end tests, so it is tested on its own first.
Real processes; every wait is bounded and waits for what the agent reports."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import NS, wait_for

pytestmark = pytest.mark.timeout(90)

SLEEPER = "import time\nwhile True: time.sleep(0.05)\n"
# writes its env to $(OUT) then sleeps; ignores SIGTERM when asked to (then only SIGKILL ends it)
ENV_DUMP = ("import json, os, signal, sys, time\n"
            "if os.environ.get('IGNORE_TERM'): signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "else: signal.signal(signal.SIGTERM, lambda *a: (open(os.environ['OUT'] + '.term', 'w').close(), "
            "sys.exit(0)))\n"
            "json.dump(dict(os.environ), open(os.environ['OUT'], 'w'))\n"
            "while True: time.sleep(0.05)\n")


def _pod(name: str, code: str, *, env: list[dict] | None = None, gpus: int = 1, grace: int = 30,
         node: str | None = None, policy: str = "Never", extra: dict | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"restartPolicy": policy, "terminationGracePeriodSeconds": grace, "containers": [{
        "name": "c", "image": "test", "command": ["python", "-c", code], "env": env or [],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    spec.update(extra or {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "t"}}, "spec": spec}


def _core(api: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(api)


def _phase(emu: Any, name: str) -> str | None:
    p = emu.get("pods", NS, name)
    return (p or {}).get("status", {}).get("phase")


def _cond(emu: Any, name: str, type_: str) -> dict | None:
    p = emu.get("pods", NS, name) or {}
    return next((c for c in (p.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def test_a_pod_runs_as_a_process_with_its_env_and_reports_running_and_ready(emulator, node_agent, tmp_path) -> None:
    emu, api = emulator
    out = tmp_path / "env.json"
    env = [{"name": "OUT", "value": str(out)}, {"name": "GREETING", "value": "hi-$(MY_POD)"},
           {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "MY_APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}}]
    _core(api).create_namespaced_pod(NS, _pod("p1", ENV_DUMP, env=env, node="n1"))
    wait_for("p1 Running and Ready", lambda: _phase(emu, "p1") == "Running"
             and (_cond(emu, "p1", "Ready") or {}).get("status") == "True")
    pod = emu.get("pods", NS, "p1")
    assert pod["spec"]["nodeName"] == "n1"  # its required node affinity
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    got = json.loads(wait_for("env written", lambda: out.exists() and out.read_text()))
    assert (got["MY_POD"], got["MY_IP"], got["MY_NODE"], got["MY_APP"]) == ("p1", ip, "n1", "t")
    assert got["GLOO_SOCKET_IFNAME"] == "lo" and got["OMP_NUM_THREADS"] == "1"
    assert node_agent.started == ["p1"] and node_agent.live() == ["p1"]
    cs = pod["status"]["containerStatuses"][0]
    assert cs["ready"] is True and "running" in cs["state"]


@pytest.mark.parametrize(("code", "phase", "reason"), [("0", "Succeeded", "Completed"), ("7", "Failed", "Error")])
def test_an_exit_is_reported_with_its_code(emulator, node_agent, code, phase, reason) -> None:
    emu, api = emulator
    _core(api).create_namespaced_pod(NS, _pod("p", f"import sys; sys.exit({code})"))
    wait_for(f"p {phase}", lambda: _phase(emu, "p") == phase)
    term = emu.get("pods", NS, "p")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == int(code) and term["reason"] == reason
    assert (_cond(emu, "p", "Ready") or {}).get("status") == "False"


def test_a_crashing_deployment_pod_is_restarted(emulator, node_agent) -> None:
    emu, api = emulator
    _core(api).create_namespaced_pod(NS, _pod("crash", "import sys; sys.exit(3)", policy="Always"))
    wait_for("restarted twice", lambda: ((emu.get("pods", NS, "crash") or {}).get("status", {}).get(
        "containerStatuses") or [{}])[0].get("restartCount", 0) >= 2, timeout=30)
    st = emu.get("pods", NS, "crash")["status"]
    assert st["phase"] == "Running" and st["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 3
    assert node_agent.started.count("crash") >= 3


def test_deletion_sends_sigterm_and_the_pod_goes_once_the_process_ended(emulator, node_agent, tmp_path) -> None:
    emu, api = emulator
    out = tmp_path / "env.json"
    _core(api).create_namespaced_pod(NS, _pod("polite", ENV_DUMP, env=[{"name": "OUT", "value": str(out)}]))
    wait_for("started", lambda: out.exists())
    pid = node_agent.pid("polite")
    _core(api).delete_namespaced_pod("polite", NS)
    wait_for("pod gone", lambda: emu.get("pods", NS, "polite") is None)
    assert Path(str(out) + ".term").exists()  # it saw SIGTERM and ended on its own
    assert node_agent.signals == [("polite", "TERM")] and node_agent.exits["polite"] == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(emulator, node_agent, tmp_path) -> None:
    emu, api = emulator
    out = tmp_path / "env.json"
    _core(api).create_namespaced_pod(NS, _pod("stubborn", ENV_DUMP, grace=2, env=[
        {"name": "OUT", "value": str(out)}, {"name": "IGNORE_TERM", "value": "1"}]))
    wait_for("started", lambda: out.exists())
    _core(api).delete_namespaced_pod("stubborn", NS)
    # marked, not gone: the process still runs through its grace period
    marked = wait_for("deletionTimestamp", lambda: (emu.get("pods", NS, "stubborn") or {}).get("metadata", {}).get(
        "deletionTimestamp"))
    assert marked and emu.get("pods", NS, "stubborn")["metadata"]["deletionGracePeriodSeconds"] == 2
    wait_for("SIGTERM sent", lambda: ("stubborn", "TERM") in node_agent.signals)
    assert node_agent.live() == ["stubborn"] and emu.get("pods", NS, "stubborn") is not None
    wait_for("pod gone", lambda: emu.get("pods", NS, "stubborn") is None, timeout=15)
    assert node_agent.signals == [("stubborn", "TERM"), ("stubborn", "KILL")]
    assert node_agent.exits["stubborn"] == -signal.SIGKILL


def test_a_force_deleted_pod_is_gone_at_once_and_its_process_killed(emulator, node_agent) -> None:
    emu, api = emulator
    _core(api).create_namespaced_pod(NS, _pod("forced", SLEEPER))
    wait_for("running", lambda: node_agent.live() == ["forced"])
    _core(api).delete_namespaced_pod("forced", NS, grace_period_seconds=0)
    assert emu.get("pods", NS, "forced") is None
    wait_for("process killed", lambda: node_agent.live() == [])
    assert node_agent.exits["forced"] == -signal.SIGKILL


def test_a_pod_asking_more_gpus_than_a_node_has_stays_pending_unschedulable(emulator, node_agent) -> None:
    emu, api = emulator
    _core(api).create_namespaced_pod(NS, _pod("big", SLEEPER, gpus=8))
    _core(api).create_namespaced_pod(NS, _pod("fits", SLEEPER, gpus=4))
    wait_for("fits runs", lambda: _phase(emu, "fits") == "Running")
    cond = wait_for("big unschedulable", lambda: _cond(emu, "big", "PodScheduled"))
    assert cond["status"] == "False" and cond["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    assert _phase(emu, "big") == "Pending" and "spec" in emu.get("pods", NS, "big")
    assert not emu.get("pods", NS, "big")["spec"].get("nodeName") and "big" not in node_agent.started
    # GPUs are counted per node: a third 4-GPU pod takes the other node, a fourth waits
    _core(api).create_namespaced_pod(NS, _pod("fits2", SLEEPER, gpus=4))
    _core(api).create_namespaced_pod(NS, _pod("waits", SLEEPER, gpus=1))
    wait_for("fits2 runs", lambda: _phase(emu, "fits2") == "Running")
    assert {emu.get("pods", NS, n)["spec"]["nodeName"] for n in ("fits", "fits2")} == {"n0", "n1"}
    wait_for("waits unschedulable", lambda: (_cond(emu, "waits", "PodScheduled") or {}).get("reason") == "Unschedulable")
    # a terminating pod holds its GPUs until gone; then the waiting one is scheduled
    _core(api).delete_namespaced_pod("fits", NS)
    wait_for("waits runs", lambda: _phase(emu, "waits") == "Running")


def _deployment(apps: Any, replicas: int, probe_port: int | None = None) -> None:
    ctr: dict[str, Any] = {"name": "srv", "image": "test", "command": ["python", "-c", SLEEPER],
                           "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    if probe_port:  # a readiness probe on a port nobody serves: never ready
        ctr["readinessProbe"] = {"httpGet": {"path": "/health", "port": probe_port}}
    apps.create_namespaced_deployment(NS, {"metadata": {"name": "web"}, "spec": {
        "replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
        "template": {"metadata": {"labels": {"app": "web"}},
                     "spec": {"terminationGracePeriodSeconds": 5, "containers": [ctr]}}}})


def _web_pods(emu: Any, *, live: bool = True) -> list[dict]:
    return [p for p in emu.objects("pods", NS) if p["metadata"]["labels"].get("app") == "web"
            and not (live and p["metadata"].get("deletionTimestamp"))]


def test_scale_makes_pods_and_a_scale_down_deletes_by_deletion_cost_then_newest(emulator, node_agent) -> None:
    from kubernetes import client

    emu, api = emulator
    apps = client.AppsV1Api(api)
    _deployment(apps, 1)
    wait_for("1 ready replica", lambda: (emu.get("deployments", NS, "web").get("status") or {}).get(
        "readyReplicas") == 1)
    apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 4}})
    wait_for("4 ready replicas", lambda: (emu.get("deployments", NS, "web").get("status") or {}).get(
        "readyReplicas") == 4)
    order = list(node_agent.created)
    assert len(order) == 4 and sorted(node_agent.live()) == sorted(order)
    # the oldest gets a negative cost: it goes first; then the newest
    _core(api).patch_namespaced_pod(order[0], NS, {"metadata": {"annotations": {
        "controller.kubernetes.io/pod-deletion-cost": "-100"}}})
    apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 2}})
    wait_for("2 replicas", lambda: len(_web_pods(emu)) == 2)
    assert sorted(p["metadata"]["name"] for p in _web_pods(emu)) == sorted(order[1:3])
    dep = wait_for("status 2", lambda: (emu.get("deployments", NS, "web").get("status") or {}).get("replicas") == 2
                   and emu.get("deployments", NS, "web"))
    assert dep["status"]["observedGeneration"] == dep["metadata"]["generation"]
    wait_for("leavers gone", lambda: len(_web_pods(emu, live=False)) == 2)
    assert {n for n, s in node_agent.signals} == {order[0], order[3]}


def test_a_replica_whose_probe_never_passes_is_running_but_never_ready(emulator, node_agent) -> None:
    import socket

    from kubernetes import client

    emu, api = emulator
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _deployment(client.AppsV1Api(api), 1, probe_port=port)
    wait_for("running", lambda: [p for p in _web_pods(emu) if (p.get("status") or {}).get("phase") == "Running"])
    name = _web_pods(emu)[0]["metadata"]["name"]
    wait_for("two probe rounds", lambda: node_agent.procs and all(
        c.next_probe > 0 for c in node_agent.procs.values()), timeout=5)
    dep = emu.get("deployments", NS, "web")
    assert dep["status"]["replicas"] == 1 and dep["status"]["readyReplicas"] == 0
    assert (_cond(emu, name, "Ready") or {}).get("status") == "False"
    assert sys.executable  # the probe looked at the pod IP, not at loopback's 127.0.0.1
