"""Fixtures: the strict API emulator in its own thread, a kubeconfig pointing at it, the real Kopf operator."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .emulator import EmulatorThread, StrictEmulator

NS = "ml"


def declare_all(emu: StrictEmulator) -> None:
    # discoverable (Kopf's backbone waits for them) but never listed: scanning is off in operators.main
    emu.declare("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                namespaced=False)
    emu.declare("", "v1", "namespaces", "Namespace", namespaced=False)
    emu.declare("", "v1", "nodes", "Node", namespaced=False, subresources=("status",))
    emu.declare("", "v1", "pods", "Pod", namespaced=True, subresources=("status",))
    emu.declare("", "v1", "services", "Service", namespaced=True, subresources=("status",))
    emu.declare("", "v1", "secrets", "Secret", namespaced=True)
    emu.declare("apps", "v1", "deployments", "Deployment", namespaced=True, subresources=("status", "scale"))
    emu.declare("events.k8s.io", "v1", "events", "Event", namespaced=True)
    emu.declare("elastic.dev", "v1alpha1", "gpupools", "GPUPool", namespaced=False, subresources=("status",))
    emu.declare("elastic.dev", "v1alpha1", "inferenceservices", "InferenceService", namespaced=True,
                subresources=("status", "scale"),
                scale=(".spec.replicas", ".status.replicas", ".status.selector"))
    emu.declare("elastic.dev", "v1alpha1", "elastictrainingjobs", "ElasticTrainingJob", namespaced=True,
                subresources=("status",))


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StrictEmulator, Any]]:
    emu = StrictEmulator()
    declare_all(emu)
    thread = EmulatorThread(emu).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
        f"clusters: [{{name: emu, cluster: {{server: '{thread.url}'}}}}]\n"
        "users: [{name: emu, user: {token: operator}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: emu, namespace: ml}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # read once at import by the kubernetes client; Kopf's login goes through it
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    yield emu, api_client(thread.url, "tester")
    thread.stop()


def api_client(url: str, token: str) -> Any:
    """A ``kubernetes`` client for ``url``; the token tells the emulator's call log who called."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = url
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1) -> Any:
    """Poll ``cond`` until truthy; fail naming ``what`` (every wait is bounded)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


def coordinator_backend(api: Any, job: str, template: dict[str, Any]) -> Any:
    """The Kubernetes backend in its coordinator runtime, with ``job``'s target in namespace ``NS``."""
    from elastic.backends.kubernetes import JobTarget, KubernetesBackend

    b = KubernetesBackend(api_client=api, job_runtime="coordinator", pod_gone_wait_seconds=5.0, poll_seconds=0.05)
    b.set_job(job, JobTarget(NS, job, template))
    return b


def start_in_thread(backend: Any, spec: Any, layout: str) -> tuple[Any, dict[str, Any]]:
    """``backend.set_job_gpus`` for a start on ``layout`` (GPUs of node n0) in a thread: it waits for
    worker registrations that never come (no kubelet runs pods here). Returns the thread and where
    its result or error lands."""
    import threading

    from elastic.model import GPU, Layout

    lay = Layout.parse(layout)
    out: dict[str, Any] = {}

    def start() -> None:
        try:
            out["result"] = backend.set_job_gpus(spec, tuple(GPU("n0", i) for i in range(lay.world_size)), lay)
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out["error"] = e

    t = threading.Thread(target=start, daemon=True)
    t.start()
    return t, out


@pytest.fixture
def node_agent(emulator: tuple[StrictEmulator, Any], tmp_path: Path) -> Iterator[Any]:
    """Two fake nodes of 4 GPUs (label ``pool=a``) run by the test-side node agent
    (``tests.operator.kubelet``): pods become local processes, deletions are graceful."""
    from .kubelet import NodeAgent

    emu, api = emulator
    agent = NodeAgent(emu, api, {"n0": 4, "n1": 4}, namespace=NS, log_dir=tmp_path / "pods", poll=0.05).start()
    yield agent
    agent.stop()


def runs_coordinators(pod: dict[str, Any]) -> bool:
    """A ``NodeAgent(runs=...)`` filter: only jobs' coordinator pods."""
    return "elastic.dev/coordinator" in (pod["metadata"].get("labels") or {})


@pytest.fixture
def coordinator_kubelet(emulator: tuple[StrictEmulator, Any], tmp_path: Path) -> Iterator[Any]:
    """The node agent running only jobs' coordinator pods: worker pods are applied and never run, so a
    start waits for registrations that never come (the window a test of a start's beginning needs)."""
    from .kubelet import NodeAgent

    emu, api = emulator
    agent = NodeAgent(emu, api, {"n0": 4, "n1": 4}, namespace=NS, log_dir=tmp_path / "pods", poll=0.05,
                      runs=runs_coordinators).start()
    yield agent
    agent.stop()
