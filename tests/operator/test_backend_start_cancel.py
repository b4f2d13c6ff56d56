"""The Kubernetes backend (coordinator runtime) calls a job's start off when inference needs its GPUs.

Against the emulator no kubelet runs the worker pods, so the start waits for registrations that
never come: exactly the window in which a start may be called off. Called off, the half-started
job is dropped (its pods deleted, its coordinator stopped) and a later start begins afresh.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from elastic.backends.base import GrowCancelled
from elastic.backends.kubernetes import JobTarget, KubernetesBackend
from elastic.model import GPU, Layout, TrainingSpec

from .conftest import NS

SPEC = TrainingSpec(name="pretrain", model="tiny", min_gpus=1, max_gpus=4, global_batch=8)


def _pods(api: Any) -> list[str]:
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod(NS)
    return sorted(p.metadata.name for p in pods.items if not p.metadata.deletion_timestamp)


def test_a_starting_job_is_called_off_and_its_pods_deleted(emulator) -> None:
    _, api = emulator
    b = KubernetesBackend(api_client=api, job_runtime="coordinator", coordinator_host="127.0.0.1",
                          advertise_host="127.0.0.1", pod_gone_wait_seconds=5.0, poll_seconds=0.05)
    b.set_job("pretrain", JobTarget(NS, "pretrain", {"image": "elastic:dev"}))
    out: dict[str, Any] = {}

    def start() -> None:
        try:
            out["result"] = b.set_job_gpus(SPEC, (GPU("n0", 0), GPU("n0", 1)), Layout.parse("tp1.pp1.dp2"))
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out["error"] = e

    for attempt in (1, 2):  # called off, then started afresh (a new coordinator) and called off again
        out.clear()
        t = threading.Thread(target=start, daemon=True)
        t.start()
        deadline = time.monotonic() + 20
        while len(_pods(api)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pods(api) == ["pretrain-w0", "pretrain-w1"], attempt  # applied, never registering (no kubelet)
        assert b.cancel_grow("pretrain") is True
        t.join(30)
        assert not t.is_alive()
        err = out.get("error")
        assert isinstance(err, GrowCancelled) and "start on tp1.pp1.dp2 called off" in str(err), (attempt, out)
        assert _pods(api) == []  # no pod of the called-off start keeps a GPU
        assert b.job_runtime("pretrain") is None and b.cancel_grow("pretrain") is False
