"""The real Kopf operator and the real ``kubernetes`` client against the strict API emulator.

What is exercised: CR handlers, the per-pool timer running ``Controller.tick()`` through the
Kubernetes backend, server-side-applied worker pods and headless Service, the Deployment's
``/scale``, status conditions, ``events.k8s.io/v1`` Events, the job finalizer. The job runtime
is ``pods`` (no kubelet here: a job "runs" once its pods exist; no trainer step, no reshard).
The metric is our own fake source (``InProcessSource``) at the controller's boundary.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("ELASTIC_OPERATOR_TIMER_SECONDS", "0.3")

import pytest  # noqa: E402
from kopf.testing import KopfRunner  # noqa: E402

import operators.main as op_main  # noqa: E402
from elastic.metrics import InProcessSource  # noqa: E402
from operators.runtime import OperatorRuntime, OperatorSettings  # noqa: E402

from .conftest import NS, api_client, wait_for  # noqa: E402
from .rbac import assert_rbac_exact  # noqa: E402

pytestmark = pytest.mark.timeout(120)

G, V = "elastic.dev", "v1alpha1"
POOL = {"apiVersion": f"{G}/{V}", "kind": "GPUPool", "metadata": {"name": "a"},
        "spec": {"nodeSelector": {"pool": "a"}, "gpusPerNode": 4, "hardware": "cpu", "tickSeconds": 0.3,
                 "rescaleIntervalSeconds": 0, "gainThreshold": 0.0}}
SERVICE = {"apiVersion": f"{G}/{V}", "kind": "InferenceService", "metadata": {"name": "chat"},
           "spec": {"pool": "a", "scaleTargetRef": {"name": "vllm"},
                    "metric": {"preset": "vllm-requests", "target": 10}, "minReplicas": 1, "maxReplicas": 6,
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}}
JOB = {"apiVersion": f"{G}/{V}", "kind": "ElasticTrainingJob", "metadata": {"name": "train"},
       "spec": {"pool": "a", "model": "tiny", "minGPUs": 1, "maxGPUs": 8, "globalBatch": 8,
                "checkpoint": {"dir": "/ckpt", "everySteps": 50},
                "template": {"image": "elastic:dev",
                             "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "train-ckpt"}}],
                             "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}}}


def _seed(api: Any) -> None:
    from kubernetes import client

    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    for name, labels in (("n0", {"pool": "a"}), ("n1", {"pool": "a"}), ("other", {})):
        core.create_node({"metadata": {"name": name, "labels": labels},
                          "status": {"allocatable": {"nvidia.com/gpu": "4", "cpu": "32"}}})
    apps.create_namespaced_deployment(NS, {
        "metadata": {"name": "vllm"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "vllm"}},
                 "template": {"metadata": {"labels": {"app": "vllm"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}}})


@contextmanager
def running_operator(api: Any, tmp_path: Path, source: InProcessSource):
    settings = OperatorSettings(db_url=f"sqlite:///{tmp_path / 'operator.db'}", instance="operator-0",
                                job_runtime="pods", api_port=0, wait_seconds=5.0)
    op_api = api_client(api.configuration.host, "operator")
    op_main.RUNTIME = OperatorRuntime(settings, api_client=op_api, source_factory=lambda spec, backend: source)
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "operators.main"], timeout=30) as runner:
        yield runner
    assert runner.exception is None, runner.exception


class Cluster:
    def __init__(self, emu: Any, api: Any) -> None:
        from kubernetes import client

        self.emu = emu
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)

    def create(self, plural: str, body: dict[str, Any]) -> None:
        if plural == "gpupools":
            self.custom.create_cluster_custom_object(G, V, plural, body)
        else:
            self.custom.create_namespaced_custom_object(G, V, NS, plural, body)

    def pods(self) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.emu.objects("pods", NS)
                      if p["metadata"].get("labels", {}).get("elastic.dev/job") == "train")

    def replicas(self) -> int:
        return int(self.emu.get("deployments", NS, "vllm")["spec"]["replicas"])

    def status(self, plural: str, name: str, ns: str | None = NS) -> dict[str, Any]:
        obj = self.emu.get(plural, ns, name)
        return (obj or {}).get("status") or {}

    def condition(self, plural: str, name: str, type_: str, ns: str | None = NS) -> dict[str, Any] | None:
        return next((c for c in self.status(plural, name, ns).get("conditions", []) if c["type"] == type_), None)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.emu.objects("events", NS) if e["regarding"]["name"] == name]


def test_apply_rescale_and_delete_through_the_operator(emulator, tmp_path: Path) -> None:
    emu, api = emulator
    _seed(api)
    k = Cluster(emu, api)
    source = InProcessSource(max_age=600)
    source.set("ml/chat", 40.0, time.time())  # 4 replicas at target 10 each
    with running_operator(api, tmp_path, source):
        k.create("gpupools", POOL)
        k.create("inferenceservices", SERVICE)
        k.create("elastictrainingjobs", JOB)

        # 1. 4 replicas; the job takes the other 4 GPUs (tiny has layouts for 1, 2, 4, 8)
        wait_for("4 worker pods", lambda: len(k.pods()) == 4)
        wait_for("4 replicas", lambda: k.replicas() == 4)
        pod = emu.get("pods", NS, k.pods()[0])
        assert pod["metadata"]["labels"]["elastic.dev/worker"] == pod["metadata"]["name"]
        assert pod["metadata"]["annotations"]["elastic.dev/generation"] == "1"
        assert pod["metadata"]["managedFields"][0]["manager"] == "elastic-operator"
        assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "elastic.train.worker"]
        # the template's volumes reach every worker (the checkpoints' shared volume)
        assert pod["spec"]["volumes"] == [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "train-ckpt"}}]
        assert pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "ckpt", "mountPath": "/ckpt"}]
        term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        node = term["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
        assert node in ("n0", "n1") and pod["metadata"]["annotations"]["elastic.dev/gpu"].startswith(node + "/")
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ElasticTrainingJob"
        assert emu.get("services", NS, "train-workers")["spec"]["clusterIP"] == "None"
        wait_for("job status Running", lambda: k.status("elastictrainingjobs", "train").get("worldSize") == 4)
        st = k.status("elastictrainingjobs", "train")
        assert st["layout"] == "tp2.pp1.dp2.z1" and st["phase"] == "Running"
        ready = k.condition("elastictrainingjobs", "train", "Ready")
        assert ready["status"] == "True" and ready["observedGeneration"] == 1 and ready["lastTransitionTime"]
        assert k.condition("elastictrainingjobs", "train", "Scheduled")["status"] == "True"
        wait_for("pool status", lambda: k.status("gpupools", "a", None).get("trainingGPUs") == 4)
        assert k.status("gpupools", "a", None)["gpus"] == 8  # node 'other' is not in the pool

        # 2. load x5: the job shrinks to 2 GPUs first, then the Deployment grows to 5 replicas
        mark = len(emu.calls)
        source.set("ml/chat", 50.0, time.time())
        wait_for("5 replicas", lambda: k.replicas() == 5)
        assert len(k.pods()) == 2
        calls = emu.calls_since(mark)
        first_delete = next(i for i, c in enumerate(calls) if c[0] == "delete" and c[2] == "pods")
        first_scale = next(i for i, c in enumerate(calls) if c[2] == "deployments/scale" and c[0] == "patch")
        assert first_delete < first_scale, calls
        wait_for("service status", lambda: k.status("inferenceservices", "chat").get("replicas") == 5)
        sst = k.status("inferenceservices", "chat")
        assert sst["desiredReplicas"] == 5 and sst["observedValue"] == 50.0 and sst["selector"] == "app=vllm"
        active = k.condition("inferenceservices", "chat", "ScalingActive")
        assert active["status"] == "True" and active["reason"] and active["message"]
        wait_for("job shrink reason", lambda: (k.condition("elastictrainingjobs", "train", "Scheduled") or {}).get(
            "reason") not in (None, "") and k.status("elastictrainingjobs", "train").get("worldSize") == 2)
        job_events = k.events("train")
        svc_events = k.events("chat")
        assert any(e["action"] == "shrink_training" and e["reason"] and e["note"] for e in job_events), job_events
        assert any(e["action"] == "scale_inference_up" for e in svc_events), svc_events
        assert all(e["reportingController"] == "elastic.dev/operator" for e in job_events + svc_events)

        # 3. delete the job: the finalizer removes its pods, then the resource goes
        k.custom.delete_namespaced_custom_object(G, V, NS, "elastictrainingjobs", "train")
        wait_for("pods gone", lambda: k.pods() == [])
        wait_for("job gone", lambda: emu.get("elastictrainingjobs", NS, "train") is None)
        assert emu.get("services", NS, "train-workers") is None
    # 4. RBAC: the ClusterRole grants exactly what the operator called (Kopf + backend + status/events)
    assert_rbac_exact({c[:3] for c in emu.calls if c[4] == "operator"})


def test_bad_input_sets_ready_false_naming_the_field_and_changes_nothing(emulator, tmp_path: Path) -> None:
    emu, api = emulator
    _seed(api)
    k = Cluster(emu, api)
    source = InProcessSource(max_age=600)
    source.set("ml/chat", 10.0, time.time())
    with running_operator(api, tmp_path, source):
        k.create("gpupools", POOL)
        k.create("inferenceservices", SERVICE)
        wait_for("service ready", lambda: (k.condition("inferenceservices", "chat", "Ready") or {}).get(
            "reason") == "Reconciled")
        before_pods, before_replicas = k.pods(), k.replicas()
        cases = [
            ("inferenceservices", {**SERVICE, "metadata": {"name": "ghost"},
                                   "spec": {**SERVICE["spec"], "scaleTargetRef": {"name": "missing"}}},
             "InvalidScaleTargetRef", "spec.scaleTargetRef"),
            ("elastictrainingjobs", {**JOB, "metadata": {"name": "badgpus"},
                                     "spec": {**JOB["spec"], "minGPUs": 8, "maxGPUs": 2}},
             "InvalidMinGPUs", "spec.minGPUs"),
            ("inferenceservices", {**SERVICE, "metadata": {"name": "badpreset"},
                                   "spec": {**SERVICE["spec"], "metric": {"preset": "nope", "target": 1}}},
             "InvalidMetricPreset", "spec.metric.preset"),
            ("elastictrainingjobs", {**JOB, "metadata": {"name": "badmodel"},
                                     "spec": {**JOB["spec"], "model": "no-such-model"}},
             "InvalidModel", "spec.model"),
            # draining ahead needs the drain annotation (and a Service selecting the serving label)
            ("inferenceservices", {**SERVICE, "metadata": {"name": "nodrain"},
                                   "spec": {**SERVICE["spec"], "drainAheadSeconds": 30}},
             "InvalidDrainAhead", "spec.drainAheadSeconds"),
        ]
        for plural, body, _, _ in cases:
            k.create(plural, body)
        for plural, body, reason, field in cases:
            name = body["metadata"]["name"]
            cond = wait_for(f"{name} Ready=False", lambda p=plural, n=name: k.condition(p, n, "Ready"))
            assert cond["status"] == "False" and cond["reason"] == reason, cond
            assert cond["message"].startswith(field), cond
            wait_for(f"{name} Warning event", lambda n=name, r=reason: any(
                e["reason"] == r and e["type"] == "Warning" for e in k.events(n)), timeout=5)
        time.sleep(1.0)  # a few pool cycles
        assert k.pods() == before_pods and k.replicas() == before_replicas
        assert not [p for p in emu.objects("pods", NS) if p["metadata"]["labels"].get("elastic.dev/job")]
        assert k.status("gpupools", "a", None)["trainingGPUs"] == 0


def test_a_pool_waits_for_every_listed_service_and_job_before_its_first_cycle(emulator, tmp_path: Path) -> None:
    """A restarted operator's Kopf resumes each kind from its own watch, in no set order. A pool
    cycle before the InferenceService's resume would plan the pool without it (the job started on
    GPUs the service holds); the pool waits until every service and job the API server lists for
    it is registered, and says so in its Ready condition."""
    emu, api = emulator
    _seed(api)
    k = Cluster(emu, api)
    for plural, body in (("gpupools", POOL), ("inferenceservices", SERVICE), ("elastictrainingjobs", JOB)):
        k.create(plural, body)
    other = {**SERVICE, "metadata": {"name": "elsewhere"}, "spec": {**SERVICE["spec"], "pool": "b"}}
    k.create("inferenceservices", other)  # another pool's: never waited for
    source = InProcessSource(max_age=600)
    source.set("ml/chat", 40.0, time.time())
    settings = OperatorSettings(db_url=f"sqlite:///{tmp_path / 'operator.db'}", instance="operator-0",
                                job_runtime="pods", api_port=0, wait_seconds=5.0)
    rt = OperatorRuntime(settings, api_client=api_client(api.configuration.host, "operator"),
                         source_factory=lambda spec, backend: source)
    rt.start()
    try:
        pool, job, svc = (emu.get("gpupools", None, "a"), emu.get("elastictrainingjobs", NS, "train"),
                          emu.get("inferenceservices", NS, "chat"))
        rt.set_pool("a", pool["spec"], pool["metadata"]["uid"], 1)
        rt.set_job(NS, "train", job["spec"], job["metadata"]["uid"], 1)  # the service's resume has not run
        assert rt.tick_pool("a", force=True) is None
        assert k.pods() == [] and k.replicas() == 1  # nothing planned without the service
        ready = k.condition("gpupools", "a", "Ready", ns=None)
        assert ready is not None and ready["status"] == "False" and ready["reason"] == "WaitingForMembers"
        assert "inferenceservices/ml/chat" in ready["message"] and "elsewhere" not in ready["message"]
        rt.set_service(NS, "chat", svc["spec"], svc["metadata"]["uid"], 1)
        res = rt.tick_pool("a", force=True)
        assert res is not None and res.error is None, res
        # planned with the service (4 replicas' worth kept from training), not without it (8 for the job)
        assert "scale_inference_up ml/chat" in res.applied and "training 4 GPUs" in res.message, res
        wait_for("4 worker pods", lambda: len(k.pods()) == 4)
        assert rt.pools["a"].synced
    finally:
        rt.stop()
