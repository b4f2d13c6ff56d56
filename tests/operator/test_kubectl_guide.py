"""The Kubernetes guide (``docs/guides/kubernetes.md``, which includes ``manifests/README.md``)
walked as a new user walks it: the real ``kubectl`` against the API emulator on loopback.

What runs as written: ``kubectl apply -k manifests/``, ``kubectl wait`` for the CRDs,
``kubectl rollout status``, ``kubectl label node``, ``kubectl create namespace ml``,
``kubectl apply -k manifests/samples/``, the guide's ``kubectl get``/``describe``/events commands,
``kubectl scale inferenceservice`` and the ``kubectl patch`` that undoes it. The operator runs as its
Deployment says: the container's command and environment (``envFrom`` the ConfigMap, the
downward-API ``POD_NAME``), read back from the API server, as a local process.

What stands in for a cluster (see ``tests/operator/emulator.py``): the emulator with ``admission``
on (namespaces must exist; custom resources pruned, defaulted and validated against the CRDs'
schemas and CEL rules); one fake node with 8 allocatable ``nvidia.com/gpu``; for the operator's
Deployment only, this test is the ReplicaSet controller and the kubelet (a Pod object, the process,
its readiness probe, the Deployment's status). A pod's private network and volumes become a free
loopback port and a temporary directory. The test-side node agent runs the sample job's
coordinator pod (it needs no GPU and this repository is its image) and nothing else: the vLLM and
worker pods need the images and GPUs, so they stay ``Pending``: the walk checks what the operator
does and says up to there.

``python -m tests.operator.test_kubectl_guide`` walks the guide and prints the transcript.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
OPERATOR_TOKEN = "system:serviceaccount:elastic-system:elastic-operator"
NODE = "gpu-node-0"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the test runs the real one): "
                                                         "install it to walk the Kubernetes guide")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def declare_built_in(emu: Any) -> None:
    """The built-in kinds the guide touches; the elastic.dev kinds come from the CRDs it applies."""
    for group, version, plural, kind, namespaced, subresources in [
        ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False, ("status",)),
        ("", "v1", "namespaces", "Namespace", False, ("status",)),
        ("", "v1", "nodes", "Node", False, ("status",)),
        ("", "v1", "pods", "Pod", True, ("status",)),
        ("", "v1", "services", "Service", True, ("status",)),
        ("", "v1", "secrets", "Secret", True, ()),
        ("", "v1", "configmaps", "ConfigMap", True, ()),
        ("", "v1", "serviceaccounts", "ServiceAccount", True, ()),
        ("", "v1", "events", "Event", True, ()),
        ("apps", "v1", "deployments", "Deployment", True, ("status", "scale")),
        ("events.k8s.io", "v1", "events", "Event", True, ()),
        ("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False, ()),
        ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False, ()),
    ]:
        emu.declare(group, version, plural, kind, namespaced=namespaced, subresources=subresources)


def _kubeconfig(path: Path, url: str, token: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "emu", "user": {"token": token}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}]}))
    return path


@dataclass
class Step:
    command: str
    rc: int
    output: str


@dataclass
class Walk:
    """The user's shell: ``kubectl`` with a kubeconfig at the emulator; every command is recorded."""

    emu: Any
    url: str
    workdir: Path
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kubeconfig = _kubeconfig(self.workdir / "kubeconfig", self.url, "admin")
        self.env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir), "KUBECONFIG": str(self.kubeconfig),
                    "KUBECACHEDIR": str(self.workdir / "kube-cache")}

    def run(self, command: str, *, ok: bool = True, stdin: str | None = None, timeout: float = 30,
            poll: bool = False) -> Step:
        """``command`` as the guide writes it (``kubectl ...``), from the repository's root; ``poll``:
        the same command again replaces its last record instead of adding one."""
        argv = [str(KUBECTL), *_split(command)[1:]]
        p = subprocess.run(argv, cwd=REPO, env=self.env, input=stdin, capture_output=True, text=True,
                           timeout=timeout, check=False)
        step = Step(command, p.returncode, (p.stdout + p.stderr).strip())
        if poll and self.steps and self.steps[-1].command == command:
            self.steps[-1] = step
        else:
            self.steps.append(step)
        if ok and p.returncode != 0:
            raise AssertionError(f"`{command}` failed ({p.returncode}):\n{step.output}")
        return step

    def table(self, command: str, *, poll: bool = False) -> list[dict[str, str]]:
        """``kubectl get`` output as rows of {column: cell}, split at the header's column starts."""
        lines = [ln for ln in self.run(command, poll=poll).output.splitlines() if ln.strip()]
        if not lines or lines[0].startswith("No resources"):
            return []
        starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
        names = [lines[0][a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        return [{n: ln[a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None], strict=True)}
                for ln in lines[1:]]

    def transcript(self) -> str:
        out = []
        for s in self.steps:
            out.append(f"$ {s.command}" + (f"    # exit {s.rc}" if s.rc else ""))
            out += [f"  {ln}" for ln in s.output.splitlines()[:20]]
        return "\n".join(out)


def _split(command: str) -> list[str]:
    import shlex

    return shlex.split(command)


# ---- the operator's Deployment, run here as the ReplicaSet controller and kubelet would ---------------

@contextlib.contextmanager
def operator_deployment(emu: Any, url: str, workdir: Path) -> Iterator[dict[str, Any]]:
    """Run ``deploy/elastic-operator`` from what the API server holds: a Pod object owned by it, its
    container's command with ``envFrom``/``env`` resolved, a Ready condition once its readiness probe
    answers, and the Deployment's status (what ``kubectl rollout status`` waits for). The pod's
    network and volumes are its own in a cluster: here its ports are free loopback ports and its
    ``emptyDir`` volumes temporary directories."""
    from .conftest import api_client

    ns, name = "elastic-system", "elastic-operator"
    dep = emu.get("deployments", ns, name)
    assert dep is not None, "kubectl apply -k manifests/ did not create deploy/elastic-operator"
    pod_spec = dep["spec"]["template"]["spec"]
    ctr = pod_spec["containers"][0]
    volumes = {v["name"]: workdir / "volumes" / v["name"] for v in pod_spec.get("volumes") or []}
    mounts = {m["mountPath"].rstrip("/"): volumes[m["name"]] for m in ctr.get("volumeMounts") or []}
    ports = {p["containerPort"]: _free_port() for p in ctr.get("ports") or []}
    pod_name = f"{name}-{dep['metadata']['uid'][:5]}"
    pod_ip = "127.0.0.1"

    def local(value: str) -> str:
        """A path under a mount, or a port of the pod, as it is on this machine."""
        if mounts:  # one pass: a replaced path is not looked at again
            value = re.sub("(" + "|".join(re.escape(m.rstrip("/")) for m in sorted(mounts, key=len, reverse=True))
                           + ")(?=/|$)", lambda m: str(mounts[m.group(1)]), value)
        return re.sub(r"(0\.0\.0\.0|127\.0\.0\.1|localhost):(\d+)",
                      lambda m: f"127.0.0.1:{ports.get(int(m.group(2)), int(m.group(2)))}", value)

    env: dict[str, str] = {}
    for src in ctr.get("envFrom") or []:
        ref = src.get("configMapRef") or {}
        cm = emu.get("configmaps", ns, ref.get("name"))
        assert cm is not None, f"envFrom: ConfigMap {ns}/{ref.get('name')} does not exist"
        env.update(cm.get("data") or {})
    fields = {"metadata.name": pod_name, "metadata.namespace": ns, "status.podIP": pod_ip}
    for e in ctr.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    env = {k: local(v) for k, v in env.items()}
    if "ELASTIC_API_PORT" in env and int(env["ELASTIC_API_PORT"]) in ports:
        env["ELASTIC_API_PORT"] = str(ports[int(env["ELASTIC_API_PORT"])])
    for d in volumes.values():
        d.mkdir(parents=True, exist_ok=True)
    # in-cluster credentials are the ServiceAccount's token: here a kubeconfig carrying its name
    kubeconfig = _kubeconfig(workdir / "operator-kubeconfig", url, OPERATOR_TOKEN)
    argv = [local(a) for a in [*ctr.get("command", []), *ctr.get("args", [])]]
    argv[0] = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or argv[0]  # the image's PATH
    proc_env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "HOME": str(volumes.get(
        "tmp", workdir)), "PYTHONPATH": str(REPO), "KUBECONFIG": str(kubeconfig), **env}
    api = api_client(url, "kube-controller-manager")
    from kubernetes import client

    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    core.create_namespaced_pod(ns, {
        "metadata": {"name": pod_name, "labels": dep["spec"]["template"]["metadata"]["labels"],
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                          "uid": dep["metadata"]["uid"], "controller": True}]},
        "spec": {**pod_spec, "nodeName": NODE}})
    log = open(workdir / "operator.log", "ab")  # noqa: SIM115 - the child owns it
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=proc_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    probe = ctr["readinessProbe"]["httpGet"]
    probe_port = ports[next(p["containerPort"] for p in ctr["ports"] if p.get("name") == probe["port"])] \
        if isinstance(probe["port"], str) else ports[probe["port"]]
    info = {"pid": proc.pid, "pod": pod_name, "env": env, "argv": argv, "ports": ports,
            "log": workdir / "operator.log", "proc": proc}

    def ready() -> bool:
        import httpx

        if proc.poll() is not None:
            raise AssertionError(f"the operator exited ({proc.returncode}):\n{info['log'].read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{probe_port}{probe['path']}", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("the operator's readiness probe", ready, 45)
        info["ready_after"] = time.monotonic() - started
        core.patch_namespaced_pod_status(pod_name, ns, {"status": {
            "phase": "Running", "podIP": pod_ip, "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": ctr["name"], "ready": True, "restartCount": 0, "image": ctr["image"],
                                   "imageID": "", "state": {"running": {}}}]}})
        apps.patch_namespaced_deployment_status(name, ns, {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
            "readyReplicas": 1, "availableReplicas": 1,
            "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                           {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}})
        yield info
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:  # a start that waits for its worker pods holds Kopf's shutdown: not worth the whole grace
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextlib.contextmanager
def cluster(workdir: Path) -> Iterator[tuple[Any, str]]:
    """The emulator as an API server with admission, and one GPU node that is not labelled yet."""
    from .conftest import api_client
    from .emulator import EmulatorThread, StrictEmulator

    emu = StrictEmulator()
    declare_built_in(emu)
    emu.admission = True
    thread = EmulatorThread(emu).start()
    try:
        from kubernetes import client

        for ns in ("default", "kube-system"):  # every cluster has them (cluster-scoped objects' Events go to default)
            client.CoreV1Api(api_client(thread.url, "kube-apiserver")).create_namespace({"metadata": {"name": ns}})
        client.CoreV1Api(api_client(thread.url, "kubelet")).create_node({
            "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
            "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"},
                       "capacity": {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"},
                       "conditions": [{"type": "Ready", "status": "True"}]}})
        yield emu, thread.url
    finally:
        thread.stop()


# ---- the walk -------------------------------------------------------------------------------------

def _ready(obj: dict[str, Any] | None) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                {})


def _all_workers(emu: Any, rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """``rows`` once there is one per GPU of the layout the pods are annotated with (they are applied
    one at a time)."""
    import math

    layouts = {(emu.get("pods", "ml", r["NAME"]) or {}).get("metadata", {}).get("annotations", {}).get(
        "elastic.dev/layout") for r in rows}
    if len(layouts) != 1 or None in layouts:
        return []
    size = math.prod(int(x) for x in re.findall(r"\d+", str(next(iter(layouts)))))
    return rows if len(rows) == size else []


BAD_JOB = ('{"apiVersion":"elastic.dev/v1alpha1","kind":"ElasticTrainingJob","metadata":{"name":"x","namespace":"ml"},'
           '"spec":{"pool":"h100","model":"tiny","minGPUs":4,"maxGPUs":2,"template":{"image":"i"}}}')


REFUSED_JOB = ('{"apiVersion":"elastic.dev/v1alpha1","kind":"ElasticTrainingJob","metadata":{"name":"y",'
               '"namespace":"ml"},"spec":{"pool":"h100","model":"tiny","minGPUs":1,"maxGPUs":2,'
               '"template":{"image":"elastic:0.1.0","resources":{"limits":{"nvidia.com/gpu":8}}}}}')


def walk(workdir: Path, out: dict[str, Any], *, settle: float = 0.0) -> dict[str, Any]:
    """Walk the guide, filling ``out`` with what the tests assert (``walk``: the transcript so far).
    ``settle``: seconds to keep watching the sample job's phase at the end (0: do not wait)."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    from .conftest import api_client, runs_coordinators
    from .kubelet import NodeAgent

    with cluster(workdir) as (emu, url), contextlib.ExitStack() as agents:
        w = Walk(emu, url, workdir)
        out["walk"], out["emu"] = w, emu
        # Install, step 2 (step 1 builds and loads the image: this repository is the image here)
        out["install"] = w.run("kubectl apply -k manifests/").output
        w.run("kubectl wait --for condition=established --timeout=30s crd/gpupools.elastic.dev "
              "crd/inferenceservices.elastic.dev crd/elastictrainingjobs.elastic.dev")
        with operator_deployment(emu, url, workdir) as op:
            out["operator"] = op
            out["rollout"] = w.run("kubectl -n elastic-system rollout status deploy/elastic-operator "
                                   "--timeout=30s").output
            # steps 3 and 4
            w.run(f"kubectl label node {NODE} elastic.dev/pool=h100")
            w.run("kubectl create namespace ml")
            out["samples"] = w.run("kubectl apply -k manifests/samples/").output
            # the job's coordinator pod needs no image of its own beyond this repository: a node agent
            # runs it (and nothing else) as a local process, so the operator goes on to the worker pods
            agents.callback(NodeAgent(emu, api_client(url, "kubelet"), {NODE: 8}, namespace="ml",
                                      log_dir=workdir / "pods", runs=runs_coordinators, create_nodes=False
                                      ).start().stop)
            # Watch: the operator has taken the samples (their Ready conditions) and starts the job
            out["pools"] = wait_for("kubectl get gpupools: READY", lambda: [
                r for r in w.table("kubectl get gpupools", poll=True) if r.get("READY") == "True"], 30)
            out["services"] = wait_for("kubectl get inferenceservices: READY", lambda: [
                r for r in w.table("kubectl get inferenceservices -n ml", poll=True) if r.get("READY")], 30)
            out["pods"] = wait_for("the job's worker pods, one per GPU of its layout", lambda: _all_workers(
                emu, w.table("kubectl get pods -n ml -l elastic.dev/job=gpt-pretrain -L elastic.dev/worker",
                             poll=True)), 40)
            out["jobs"] = w.table("kubectl get elastictrainingjobs -n ml")
            out["describe"] = w.run("kubectl describe elastictrainingjob gpt-pretrain -n ml").output
            out["events"] = w.table("kubectl get events.events.k8s.io -n ml --field-selector "
                                    "reportingController=elastic.dev/operator")
            # pin the service through /scale, then give it back to its metric
            w.run("kubectl scale inferenceservice llama-chat -n ml --replicas=3")
            out["pinned"] = w.run("kubectl get inferenceservice llama-chat -n ml -o jsonpath={.spec.replicas}").output
            w.run("""kubectl patch inferenceservice llama-chat -n ml --type=merge -p '{"spec":{"replicas":null}}'""")
            out["unpinned"] = w.run("kubectl get inferenceservice llama-chat -n ml -o "
                                    "jsonpath={.spec.replicas}").output
            # "Check on a real cluster", 1: the API server refuses minGPUs > maxGPUs (CEL)
            out["refused"] = w.run("kubectl apply -f -", ok=False, stdin=BAD_JOB)
            # a spec the API accepts and the operator refuses: Ready=False naming the field, a Warning event
            w.run("kubectl apply -f -", stdin=REFUSED_JOB)
            out["refused_events"] = wait_for("the operator's Warning event", lambda: [
                r for r in w.table("kubectl get events.events.k8s.io -n ml --field-selector "
                                   "reportingController=elastic.dev/operator", poll=True)
                if r.get("REASON") == "InvalidTemplate"], 30)
            out["refused_describe"] = w.run("kubectl describe elastictrainingjob y -n ml").output
            if settle:
                deadline = time.monotonic() + settle
                while time.monotonic() < deadline and not any(
                        r.get("PHASE") for r in w.table("kubectl get elastictrainingjobs -n ml", poll=True)):
                    time.sleep(1)
                w.table("kubectl get gpupools")
                w.run("kubectl describe elastictrainingjob gpt-pretrain -n ml")
                w.table("kubectl get events.events.k8s.io -n ml --field-selector "
                        "reportingController=elastic.dev/operator")
            out["job_status"] = (emu.get("elastictrainingjobs", "ml", "gpt-pretrain") or {}).get("status") or {}
            out["timings"] = {"walked": time.monotonic() - t0}
        out["timings"]["operator_stopped"] = time.monotonic() - t0
        out["operator_calls"] = {c[:3] for c in emu.calls if c[4] == OPERATOR_TOKEN}
    return out


def test_the_kubernetes_guide_as_written_with_the_real_kubectl(tmp_path: Path) -> None:
    from .rbac import APPLY_CREATES, granted

    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        walk(tmp_path / "walk", out)
    except BaseException:
        if "walk" in out:
            print(out["walk"].transcript())
        log = tmp_path / "walk" / "operator.log"
        if log.exists():
            print(log.read_text()[-4000:])
        raise
    # Install: every object of the kustomization, the CRDs established, the operator rolled out
    for made in ("namespace/elastic-system", "serviceaccount/elastic-operator", "configmap/elastic-operator",
                 "service/elastic-operator", "deployment.apps/elastic-operator",
                 "clusterrole.rbac.authorization.k8s.io/elastic-operator",
                 "clusterrolebinding.rbac.authorization.k8s.io/elastic-operator",
                 *(f"customresourcedefinition.apiextensions.k8s.io/{p}.elastic.dev" for p in
                   ("gpupools", "inferenceservices", "elastictrainingjobs"))):
        assert f"{made} created" in out["install"], out["install"]
    assert 'deployment "elastic-operator" successfully rolled out' in out["rollout"]
    # the operator runs its Deployment's own command, with the ConfigMap's settings
    op = out["operator"]
    assert Path(op["argv"][0]).name == "kopf" and op["argv"][1:6] == [
        "run", "-m", "operators.main", "--all-namespaces", "--standalone"], op["argv"]
    assert op["env"]["ELASTIC_JOB_RUNTIME"] == "coordinator" and op["env"]["POD_NAME"] == op["pod"]
    # Samples: accepted by the API server (schemas and CEL rules) and by the operator
    for made in ("deployment.apps/vllm-llama", "gpupool.elastic.dev/h100", "inferenceservice.elastic.dev/llama-chat",
                 "elastictrainingjob.elastic.dev/gpt-pretrain"):
        assert f"{made} created" in out["samples"], out["samples"]
    assert [(r["NAME"], r["READY"]) for r in out["pools"]] == [("h100", "True")]
    svc = out["services"][0]
    assert (svc["NAME"], svc["POOL"], svc["TARGET"], svc["READY"]) == ("llama-chat", "h100", "16", "True")
    assert [(r["NAME"], r["POOL"]) for r in out["jobs"]] == [("gpt-pretrain", "h100")]
    # the job starts on the node's GPUs (beside the vLLM replica once the service is registered):
    # one worker pod per GPU, each asking for one GPU of the labelled node; no kubelet runs them
    # here, so they stay Pending
    pods = out["pods"]
    assert 2 <= len(pods) <= 8 and all(r["STATUS"] == "Pending" and r["WORKER"] == r["NAME"] for r in pods), pods
    for r in pods:
        spec = out["emu"].get("pods", "ml", r["NAME"])["spec"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in ("1", 1)
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert NODE in json.dumps(terms)
    # the pool's cycle publishes while the job's pods start: its Ready condition says Accepted
    # (registered) or Reconciled (scheduled by the pool), whichever cycle the describe follows
    assert "Name:         gpt-pretrain" in out["describe"]
    assert re.search(r"Reason:\s+(Accepted|Reconciled)\s", out["describe"]), out["describe"]
    # kubectl scale pins the service through /scale; the merge patch gives it back to the metric
    assert (out["pinned"], out["unpinned"]) == ("3", "")
    # the API server refuses minGPUs > maxGPUs; the operator refuses a template asking for GPUs,
    # with a Warning event that kubectl get events and kubectl describe show
    assert out["refused"].rc != 0 and "minGPUs must be <= maxGPUs" in out["refused"].output
    ev = out["refused_events"][0]
    assert (ev["TYPE"], ev["OBJECT"]) == ("Warning", "elastictrainingjob/y") and "nvidia.com/gpu" in ev["MESSAGE"]
    assert "InvalidTemplate" in out["refused_describe"].split("Events:")[-1]
    # the operator's ServiceAccount is granted every call it made
    calls = out["operator_calls"] | {APPLY_CREATES[c] for c in out["operator_calls"] if c in APPLY_CREATES}
    assert not sorted(calls - granted()), f"manifests/rbac.yaml lacks {sorted(calls - granted())}"
    assert time.monotonic() - t0 < 90, out["timings"]


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="elastic-kubectl-guide-") as tmp:
        out: dict[str, Any] = {}
        try:
            walk(Path(tmp), out, settle=float(os.environ.get("GUIDE_SETTLE_SECONDS", "0")))
        finally:
            if "walk" in out:
                print(out["walk"].transcript())
            if os.environ.get("GUIDE_VERBOSE") and (Path(tmp) / "operator.log").exists():
                print((Path(tmp) / "operator.log").read_text()[-6000:], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
