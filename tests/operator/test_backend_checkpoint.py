"""The Kubernetes backend (coordinator runtime) runs a checkpointing job: its worker pods mount the
template's volumes and are told the job's checkpoint directory; the coordinator, inside the operator
and without that volume, takes the newest checkpoint from what the workers report at register."""

from __future__ import annotations

import time

import pytest

from elastic.backends.base import BackendError
from elastic.model import CheckpointSpec, TrainingSpec

from .conftest import NS, coordinator_backend, start_in_thread

SPEC = TrainingSpec(name="pretrain", model="tiny", min_gpus=1, max_gpus=4, global_batch=8,
                    checkpoint=CheckpointSpec(dir="/ckpt", every_steps=50))
TEMPLATE = {"image": "elastic:dev",
            "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "pretrain-ckpt"}}],
            "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}


def test_worker_pods_get_the_volume_and_the_checkpoint_dir_and_the_coordinator_trusts_them(emulator, coordinator_kubelet) -> None:
    from kubernetes import client

    _, api = emulator
    b = coordinator_backend(api, "pretrain", TEMPLATE)
    t, out = start_in_thread(b, SPEC, "tp1.pp1.dp2")
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + 60
    workers = "elastic.dev/job=pretrain"
    while len(core.list_namespaced_pod(NS, label_selector=workers).items) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pods = core.list_namespaced_pod(NS, label_selector=workers).items
    assert len(pods) == 2  # applied; nothing runs them (only the coordinator pod runs), so they never register
    for p in pods:
        env = {e.name: e.value for e in p.spec.containers[0].env}
        assert env["ELASTIC_CHECKPOINT_DIR"] == "/ckpt/pretrain", env  # <dir>/<job name>, as the pod sees it
        assert [v.name for v in p.spec.volumes] == ["ckpt"]
        assert p.spec.volumes[0].persistent_volume_claim.claim_name == "pretrain-ckpt"
        assert [(m.name, m.mount_path) for m in p.spec.containers[0].volume_mounts] == [("ckpt", "/ckpt")]
    handle = b._jobs["pretrain"].handle
    assert handle.opts.checkpoint.dir == "/ckpt/pretrain" and handle.opts.checkpoint.coordinator_sees is False
    # a checkpoint on demand reaches the job's coordinator pod; nobody steps yet, so it waits
    asked = b.checkpoint_job("pretrain", 0)
    assert (asked.previous_step, asked.step) == (-1, None)
    with pytest.raises(TimeoutError, match="the workers have not reached a step boundary"):
        b.checkpoint_job("pretrain", 0.2)
    with pytest.raises(BackendError, match="training job nope is not running here"):
        b.checkpoint_job("nope", 0)
    b.job_runtime_mode = "pods"
    with pytest.raises(BackendError, match="need the coordinator runtime"):
        b.checkpoint_job("pretrain", 0)
    b.job_runtime_mode = "coordinator"
    assert b.cancel_grow("pretrain") is True
    t.join(30)
    assert not t.is_alive() and "error" in out
