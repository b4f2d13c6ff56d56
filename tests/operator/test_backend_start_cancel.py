"""The Kubernetes backend (coordinator runtime) calls a job's start off when inference needs its GPUs.

Against the emulator the node agent runs only the job's coordinator pod, not its worker pods, so the
start waits for registrations that never come: exactly the window in which a start may be called off.
Called off, the half-started job is dropped (its pods deleted, its coordinator pod too) and a later
start begins afresh with a new coordinator.
"""

from __future__ import annotations

import time
from typing import Any

from elastic.backends.base import GrowCancelled
from elastic.model import TrainingSpec

from .conftest import NS, coordinator_backend, start_in_thread

SPEC = TrainingSpec(name="pretrain", model="tiny", min_gpus=1, max_gpus=4, global_batch=8)


def _pods(api: Any) -> list[str]:
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod(NS)
    return sorted(p.metadata.name for p in pods.items if not p.metadata.deletion_timestamp)


def test_a_starting_job_is_called_off_and_its_pods_deleted(emulator, coordinator_kubelet) -> None:
    _, api = emulator
    b = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    for attempt in (1, 2):  # called off, then started afresh (a new coordinator) and called off again
        t, out = start_in_thread(b, SPEC, "tp1.pp1.dp2")
        deadline = time.monotonic() + 60
        while len(_pods(api)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        # the coordinator pod serves; the workers are applied and never register (nothing runs them)
        assert _pods(api) == ["pretrain-coordinator", "pretrain-w0", "pretrain-w1"], attempt
        assert b.cancel_grow("pretrain") is True
        t.join(30)
        assert not t.is_alive()
        err = out.get("error")
        assert isinstance(err, GrowCancelled) and "start on tp1.pp1.dp2 called off" in str(err), (attempt, out)
        assert _pods(api) == []  # no pod of the called-off start keeps a GPU, and its coordinator is gone
        assert b.job_runtime("pretrain") is None and b.cancel_grow("pretrain") is False
