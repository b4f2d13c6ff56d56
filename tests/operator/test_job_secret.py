"""A job's coordinator secret reaches its pods through a Secret the backend owns, never as a literal
in the pod spec (anyone who may get pods could read it), and goes with the job."""

from __future__ import annotations

import base64
import time
from typing import Any

from elastic.model import TrainingSpec

from .conftest import NS, coordinator_backend, start_in_thread

SPEC = TrainingSpec(name="pretrain", model="tiny", min_gpus=1, max_gpus=4, global_batch=8)


def test_worker_pods_read_the_job_secret_from_a_secret(emulator: Any, coordinator_kubelet: Any) -> None:
    from kubernetes import client

    emu, api = emulator
    core = client.CoreV1Api(api)
    b = coordinator_backend(api, "pretrain", {"image": "elastic:dev"})
    t, out = start_in_thread(b, SPEC, "tp1.pp1.dp2")
    deadline = time.monotonic() + 60
    while len(core.list_namespaced_pod(NS).items) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pods = core.list_namespaced_pod(NS).items
    # the two workers and the job's coordinator pod, which reads the same Secret
    assert sorted(p.metadata.name for p in pods) == ["pretrain-coordinator", "pretrain-w0", "pretrain-w1"]
    secret = b._jobs["pretrain"].handle.coordinator.secret
    stored = emu.get("secrets", NS, "pretrain-rendezvous")
    assert stored is not None and base64.b64decode(stored["data"]["secret"]).decode() == secret
    assert stored["metadata"]["labels"]["elastic.dev/job"] == "pretrain"
    for p in pods:
        env = {e.name: e for e in p.spec.containers[0].env}
        ref = env["ELASTIC_JOB_SECRET"]
        assert ref.value is None and ref.value_from.secret_key_ref.name == "pretrain-rendezvous"
        assert ref.value_from.secret_key_ref.key == "secret"
        assert all(secret not in (e.value or "") for e in env.values()), "the secret is in the pod spec"
    assert b.cancel_grow("pretrain") is True  # the start is called off: the job is dropped, its Secret too
    t.join(30)
    assert not t.is_alive() and "error" in out
    assert emu.get("secrets", NS, "pretrain-rendezvous") is None
