"""The Kubernetes backend's scale-down waits for the removed pods to be gone, against the emulator.

A Deployment's ``status.replicas`` stops counting a pod the moment it is marked for deletion,
while the pod still drains its requests and holds its GPU until it is gone; training must not
be handed that GPU before.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from elastic.backends.base import BackendError
from elastic.backends.kubernetes import KubernetesBackend, ServiceTarget
from elastic.model import GPU, InferenceSpec

from .conftest import NS

SPEC = InferenceSpec(name="chat", min_replicas=1, max_replicas=4)


def _deployment_with_pods(api: Any) -> Any:
    """Deployment ``vllm`` (2 replicas) and its pods; ``vllm-1`` is terminating (a finalizer holds it,
    as a pod's grace period would); status already counts 1 replica (the ReplicaSet dropped it)."""
    from kubernetes import client

    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_deployment(NS, {
        "metadata": {"name": "vllm"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm"}},
                 "template": {"metadata": {"labels": {"app": "vllm"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}}})
    apps.patch_namespaced_deployment_status("vllm", NS, {"status": {"replicas": 1}})
    for name, extra in (("vllm-0", {}), ("vllm-1", {"finalizers": ["test/draining"]}),
                        ("other-0", {"finalizers": ["test/draining"]})):
        labels = {"app": "other"} if name.startswith("other") else {"app": "vllm"}
        core.create_namespaced_pod(NS, {"metadata": {"name": name, "labels": labels, **extra},
                                        "spec": {"containers": [{"name": "c", "image": "x"}]}})
    core.delete_namespaced_pod("vllm-1", NS)
    core.delete_namespaced_pod("other-0", NS)  # another workload's terminating pod: not ours to wait for
    return core


def _backend(api: Any, wait: float) -> KubernetesBackend:
    b = KubernetesBackend(api_client=api, scale_down_wait_seconds=wait, poll_seconds=0.05)
    b.set_service("chat", ServiceTarget(NS, "vllm"))
    return b


def test_scale_down_returns_only_once_the_removed_pod_is_gone(emulator) -> None:
    emu, api = emulator
    core = _deployment_with_pods(api)
    b = _backend(api, wait=20.0)
    gone_at: list[float] = []

    def finish_draining() -> None:
        time.sleep(0.6)
        core.patch_namespaced_pod("vllm-1", NS, {"metadata": {"finalizers": None}})
        gone_at.append(time.monotonic())

    threading.Thread(target=finish_draining, daemon=True).start()
    t0 = time.monotonic()
    b.set_service_gpus(SPEC, (GPU("n0", 0),))
    returned = time.monotonic()
    assert gone_at and returned >= gone_at[0], "training would get the GPU of a pod still draining"
    assert returned - t0 < 5.0
    assert int(emu.get("deployments", NS, "vllm")["spec"]["replicas"]) == 1


def test_scale_down_names_the_pod_still_draining_when_it_outlives_the_wait(emulator) -> None:
    _, api = emulator
    _deployment_with_pods(api)
    b = _backend(api, wait=0.3)
    with pytest.raises(BackendError, match=r"vllm-1 still terminating"):
        b.set_service_gpus(SPEC, (GPU("n0", 0),))


def test_drain_ahead_marks_pods_out_of_the_balancer_and_puts_back_at_once_those_no_longer_asked_for(emulator) -> None:
    """``drain_ahead`` chooses as many pods as the GPUs hold (those drained already first), labels them
    ``elastic.dev/serving=false`` with the lowest deletion cost; asked for fewer or none, the others
    serve again at once, whatever their hold. A service without ``drain`` is left alone."""
    from kubernetes import client

    emu, api = emulator
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_deployment(NS, {
        "metadata": {"name": "vllm"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "vllm"}},
                 "template": {"metadata": {"labels": {"app": "vllm"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}}})
    for i in range(3):
        core.create_namespaced_pod(NS, {"metadata": {"name": f"vllm-{i}", "labels": {"app": "vllm",
                                                                                       "elastic.dev/serving": "true"}},
                                        "spec": {"containers": [{"name": "c", "image": "x",
                                                                 "ports": [{"containerPort": 8000}]}]}})
        core.patch_namespaced_pod_status(f"vllm-{i}", NS, {"status": {"podIP": f"127.0.3.{10 + i}"}})

    def drained() -> dict[str, tuple[str | None, float]]:
        out = {}
        for p in emu.objects("pods", NS):
            md = p["metadata"]
            if md["labels"].get("elastic.dev/serving") == "false":
                ann = md.get("annotations") or {}
                out[md["name"]] = (ann.get("controller.kubernetes.io/pod-deletion-cost"),
                                   float(ann["elastic.dev/drained-until"]))
            else:
                assert md["labels"].get("elastic.dev/serving") == "true", md
                assert "controller.kubernetes.io/pod-deletion-cost" not in (md.get("annotations") or {}), md
        return out

    b = KubernetesBackend(api_client=api, poll_seconds=0.05)
    b.set_service("plain", ServiceTarget(NS, "vllm"))
    assert b.drain_ahead("plain", [GPU("n0", 0)], 60.0) == [] and drained() == {}
    b.set_service("chat", ServiceTarget(NS, "vllm", drain=True))
    urls = b.drain_ahead("chat", [GPU("n0", 1), GPU("n0", 2)], 60.0)
    two = drained()
    assert len(two) == 2 and len(urls) == 2 and all(u.endswith(":8000") for u in urls), (two, urls)
    assert all(cost == "-1000" and until > time.time() + 30 for cost, until in two.values()), two
    assert int(emu.get("deployments", NS, "vllm")["spec"]["replicas"]) == 3  # nothing scaled, nothing deleted
    # one fewer: one of the two stays out (no new pod drained), the other serves again at once
    assert len(b.drain_ahead("chat", [GPU("n0", 2)], 60.0)) == 1
    one = drained()
    assert len(one) == 1 and set(one) < set(two), (one, two)
    # none (the load came back): every pod serves again, though their hold has not run out
    assert b.drain_ahead("chat", [], 60.0) == [] and drained() == {}
