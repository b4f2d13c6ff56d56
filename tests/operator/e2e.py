"""Kubernetes end to end with live workers, as a user does it: ``python -m tests.operator.e2e``.

The real Kopf operator (``operators.main``, coordinator runtime: the training coordinator lives in
the operator) and the real ``kubernetes`` client against the API emulator, whose pods the test-side
node agent (``tests.operator.kubelet``) runs as local processes: worker pods train (the reference
trainer, float64, gloo on loopback) and reshard in place; a Deployment's pods are reference
inference replicas that the load generator loads, scraped directly through the vLLM preset.

Scenario (one node of 6 GPUs): 1 replica + a 4-GPU job -> load rises -> the job shrinks in place
to 2 GPUs (its leavers' pods go once their bytes landed) and only then the Deployment grows to 3
-> load falls -> the Deployment shrinks to 1 and only then the job grows back to 4 in place.

``run()`` returns what the test asserts and ``main()`` prints as one JSON line:
``worker_pods_started``, ``reshards_in_place``, ``generations``, ``steps_monotonic``,
``loss_matches``, ``deployment_scaled``, ``events_in_order`` (plus details under ``detail``).
The emulator stands in for the API server (no admission, RBAC or CRD validation); the node agent
for kubelet, kube-scheduler and the ReplicaSet controller (see ``manifests/README.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
NS = "ml"
G, V = "elastic.dev", "v1alpha1"
JOB, SERVICE, DEPLOYMENT, POOL = "train", "chat", "vllm", "a"
TOTAL_GPUS = 6


def log(msg: str) -> None:
    if os.environ.get("E2E_VERBOSE"):
        print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the user's objects -------------------------------------------------------------------------

def pool_cr(gpus_per_node: int = TOTAL_GPUS) -> dict[str, Any]:
    return {"apiVersion": f"{G}/{V}", "kind": "GPUPool", "metadata": {"name": POOL},
            "spec": {"nodeSelector": {"pool": POOL}, "gpusPerNode": gpus_per_node, "hardware": "cpu", "tickSeconds": 0.5,
                     "rescaleIntervalSeconds": 0, "gainThreshold": 0.0}}


def service_cr(target: float = 4.0) -> dict[str, Any]:
    return {"apiVersion": f"{G}/{V}", "kind": "InferenceService", "metadata": {"name": SERVICE},
            "spec": {"pool": POOL, "scaleTargetRef": {"name": DEPLOYMENT},
                     "metric": {"preset": "vllm-requests", "target": target}, "minReplicas": 1, "maxReplicas": 3,
                     "startupSeconds": 5,
                     "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                                  "scaleDown": {"stabilizationWindowSeconds": 0}}}}


def job_cr(**extra: Any) -> dict[str, Any]:
    """The reference trainer on the ``tiny`` preset (``extra``: spec fields to add or replace)."""
    spec: dict[str, Any] = {"pool": POOL, "model": "tiny", "minGPUs": 1, "maxGPUs": 4, "globalBatch": 8,
                            "template": {"image": "elastic:dev"}, **extra}
    spec = {k: v for k, v in spec.items() if v is not None}
    return {"apiVersion": f"{G}/{V}", "kind": "ElasticTrainingJob", "metadata": {"name": JOB}, "spec": spec}


# A worker container (template ``command``; ``args``: a folder) that exits at once with code 3, first
# writing ``<folder>/<attempt>.<pod>`` with its start time (``time.monotonic()``, one clock for every
# process here). ``<attempt>`` is a digest of the job's secret: every start of a job runs a coordinator
# of its own with a secret of its own, while pod names and the generation annotation repeat from one
# start to the next.
RECORDED_CRASH = ["python", "-c", "import hashlib, os, sys, time\n"
                  "attempt = hashlib.sha256(os.environ['ELASTIC_JOB_SECRET'].encode()).hexdigest()[:12]\n"
                  "path = os.path.join(sys.argv[1], attempt + '.' + os.environ['ELASTIC_WORKER_ID'])\n"
                  "with open(path + '.tmp', 'w') as f:\n"
                  "    f.write(repr(time.monotonic()))\n"
                  "os.replace(path + '.tmp', path)\n"
                  "sys.exit(3)"]


def start_attempts(folder: Path) -> list[float]:
    """When each start of a :data:`RECORDED_CRASH` job began (its first pod's start), in order."""
    first: dict[str, float] = {}
    for f in folder.iterdir():
        if f.name.endswith(".tmp"):  # still being written
            continue
        attempt = f.name.split(".", 1)[0]
        first[attempt] = min(first.get(attempt, float("inf")), float(f.read_text()))
    return sorted(first.values())


def replica_deployment(port: int, replicas: int = 1) -> dict[str, Any]:
    """The reference replica (vLLM's metric names) as a user's Deployment: one GPU per pod."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": DEPLOYMENT},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": DEPLOYMENT}},
                     "template": {"metadata": {"labels": {"app": DEPLOYMENT}}, "spec": {
                         "terminationGracePeriodSeconds": 10,
                         "containers": [{
                             "name": "server", "image": "elastic:dev",
                             "command": ["python", "-m", "elastic.serve", "--host", "$(POD_IP)", "--port", str(port),
                                         "--model", "tiny", "--max-running", "4", "--tokens-per-second", "4"],
                             "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                             "ports": [{"name": "http", "containerPort": port}],
                             "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
                             "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


# ---- the cluster: emulator, node agent, operator ------------------------------------------------

@dataclass
class Cluster:
    emu: Any
    api: Any
    agent: Any
    workdir: Path
    url: str
    runtime: Any = None
    custom: Any = None
    apps: Any = None
    core: Any = None
    config: dict[str, str] = field(default_factory=dict)  # the ConfigMap's data (the operator's settings)

    def __post_init__(self) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)

    # kubectl apply
    def apply(self, body: dict[str, Any]) -> None:
        kind = body["kind"]
        if kind == "GPUPool":
            self.custom.create_cluster_custom_object(G, V, "gpupools", body)
        elif kind == "InferenceService":
            self.custom.create_namespaced_custom_object(G, V, NS, "inferenceservices", body)
        elif kind == "ElasticTrainingJob":
            self.custom.create_namespaced_custom_object(G, V, NS, "elastictrainingjobs", body)
        elif kind == "Deployment":
            self.apps.create_namespaced_deployment(NS, body)
        else:
            raise ValueError(kind)

    # kubectl get
    def status(self, plural: str, name: str, ns: str | None = NS) -> dict[str, Any]:
        return (self.emu.get(plural, ns, name) or {}).get("status") or {}

    def condition(self, plural: str, name: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(plural, name).get("conditions", []) if c["type"] == type_), {})

    def refused(self, job: str) -> bool:
        """Fail now, naming why, when the operator refused the job (rather than time out)."""
        cond = self.condition("elastictrainingjobs", job, "Ready")
        if cond.get("status") == "False" and (cond.get("reason", "").startswith("Invalid")
                                              or cond.get("reason") == "Unschedulable"):
            raise AssertionError(f"job {job} refused: {cond.get('reason')}: {cond.get('message')}")
        return False

    def worker_pods(self, *, live: bool = True) -> list[dict[str, Any]]:
        return [p for p in self.emu.objects("pods", NS) if p["metadata"].get("labels", {}).get("elastic.dev/job") == JOB
                and not (live and p["metadata"].get("deletionTimestamp"))
                and not (live and (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"))]

    def replica_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.emu.objects("pods", NS) if p["metadata"].get("labels", {}).get("app") == DEPLOYMENT]

    def ready_replicas(self) -> int:
        return int((self.emu.get("deployments", NS, DEPLOYMENT).get("status") or {}).get("readyReplicas") or 0)

    def replicas_wanted(self) -> int:
        return int(self.emu.get("deployments", NS, DEPLOYMENT)["spec"]["replicas"])

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """``kubectl get events.events.k8s.io`` about ``name``, in the order they were posted."""
        evs = [e for e in self.emu.objects("events", NS) if name is None or e["regarding"]["name"] == name]
        return sorted(evs, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def printer_columns(self, plural: str, name: str) -> dict[str, Any]:
        """What ``kubectl get`` prints for one object: the CRD's additionalPrinterColumns over it."""
        crd = yaml.safe_load((REPO / "manifests" / "crds" / f"elastic.dev_{plural}.yaml").read_text())
        cols = crd["spec"]["versions"][0].get("additionalPrinterColumns") or []
        obj = self.emu.get(plural, NS, name) or {}
        return {c["name"]: json_path(obj, c["jsonPath"]) for c in cols}

    def handle(self) -> Any:
        """The job's handle inside the operator (its coordinator's step history)."""
        pool = self.runtime.pools[POOL]
        j = pool.backend._jobs.get(f"{NS}/{JOB}")
        return j.handle if j is not None else None


def events_through(c: Cluster, first: tuple[str, str], then: tuple[str, str]) -> list[tuple[str, str]] | None:
    """Every Event as ``(object, action)`` in posting order once ``then`` was posted after ``first``;
    None before (for ``wait_for``: an operator posts a background grow's Event a cycle after it landed)."""
    pairs = [(e["regarding"]["name"], e["action"]) for e in c.events()]
    if first not in pairs:
        return None
    return pairs if then in pairs[pairs.index(first) + 1:] else None


def json_path(obj: Any, path: str) -> Any:
    """The subset of kubectl's JSONPath that printer columns use: ``.a.b`` and ``.a[?(@.k=="v")].b``."""
    import re

    cur: Any = obj
    for part in re.findall(r'[^.\[]+|\[\?\(@\.\w+=="[^"]*"\)\]', path):
        if part.startswith("[?"):
            k, v = re.match(r'\[\?\(@\.(\w+)=="([^"]*)"\)\]', part).groups()  # type: ignore[union-attr]
            cur = next((x for x in cur or [] if isinstance(x, dict) and x.get(k) == v), None)
        else:
            cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


@contextlib.contextmanager
def cluster(workdir: Path, nodes: dict[str, int] | None = None) -> Iterator[Cluster]:
    """The emulator (thread), a kubeconfig at it (Kopf logs in through it), the node agent."""
    import kubernetes.config.kube_config as kc

    from .conftest import api_client, declare_all
    from .emulator import EmulatorThread, StrictEmulator
    from .kubelet import NodeAgent

    workdir.mkdir(parents=True, exist_ok=True)
    emu = StrictEmulator()
    declare_all(emu)
    thread = EmulatorThread(emu).start()
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
        f"clusters: [{{name: emu, cluster: {{server: '{thread.url}'}}}}]\n"
        "users: [{name: emu, user: {token: operator}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: emu, namespace: ml}}]\n")
    saved = (os.environ.get("KUBECONFIG"), kc.KUBE_CONFIG_DEFAULT_LOCATION)
    os.environ["KUBECONFIG"] = str(kubeconfig)
    kc.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
    api = api_client(thread.url, "tester")
    agent = NodeAgent(emu, api, nodes or {"n0": TOTAL_GPUS}, namespace=NS, log_dir=workdir / "pods", poll=0.1)
    try:
        agent.start()
        c = Cluster(emu, api, agent, workdir, thread.url)
        c.config = install(c)
        yield c
    finally:
        agent.stop()
        thread.stop()
        if saved[0] is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved[0]
        kc.KUBE_CONFIG_DEFAULT_LOCATION = saved[1]


def install(c: Cluster) -> dict[str, str]:
    """``kubectl apply -k manifests/``'s equivalent here: the CRDs as objects of the API, and the
    operator's settings from the ConfigMap (the operator itself runs as Kopf in this process)."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(c.api)
    for f in sorted((REPO / "manifests" / "crds").glob("*.yaml")):
        ext.create_custom_resource_definition(yaml.safe_load(f.read_text()))
    cm = yaml.safe_load((REPO / "manifests" / "configmap.yaml").read_text())
    return dict(cm["data"])


def trainer_config(dtype: str = "float64") -> Callable[[Any], Any]:
    def cfg(spec: Any) -> Any:
        import torch

        from elastic.model import load_model
        from elastic.train.engine import TrainConfig

        return TrainConfig(model=load_model(spec.model), global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                           seed=spec.seed, dtype=getattr(torch, dtype))
    return cfg


@contextlib.contextmanager
def operator(c: Cluster, *, instance: str = "operator-0", db: Path | None = None, launch: Any = None,
             dtype: str = "float64", extra_env: dict[str, str] | None = None, source: Any = None) -> Iterator[Any]:
    """The real Kopf operator (``kopf run -m operators.main --standalone --all-namespaces``) with the
    ConfigMap's settings, the coordinator on loopback (the operator's "pod IP" here)."""
    from kopf.testing import KopfRunner

    import operators.main as op_main
    from elastic.train.launch import LaunchOptions
    from operators.runtime import OperatorRuntime, OperatorSettings

    from .conftest import api_client

    env = {**c.config, "ELASTIC_DB_URL": f"sqlite:///{db or c.workdir / 'operator.db'}",
           "POD_NAME": instance,
           "ELASTIC_API_PORT": "0", "ELASTIC_BACKEND_WAIT_SECONDS": "60", **(extra_env or {})}
    settings = OperatorSettings.from_env(env)
    launch = launch or LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120,
                                     register_timeout_s=120)
    extra = {"source_factory": lambda spec, backend: source} if source is not None else {}
    rt = OperatorRuntime(settings, api_client=api_client(c.url, "operator"), **extra,
                         backend_options={"launch_options": launch, "trainer_config": trainer_config(dtype),
                                          "poll_seconds": 0.1})
    op_main.RUNTIME = rt
    c.runtime = rt
    try:
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "operators.main"], timeout=60) as runner:
            yield runner
    finally:
        # a process that ends takes its coordinators with it; here they are threads of the test
        for pool in list(rt.pools.values()):
            for j in list(pool.backend._jobs.values()):
                if j.handle is not None:
                    with contextlib.suppress(Exception):
                        j.handle.stop(timeout=10)
    if runner.exception is not None:
        raise runner.exception


@contextlib.contextmanager
def operator_process(c: Cluster, *, instance: str, db: Path, extra_env: dict[str, str] | None = None
                     ) -> Iterator[Any]:
    """The operator as its own process, as its Deployment runs it (``kopf run -m operators.main
    --standalone --all-namespaces``, settings from the ConfigMap's data), so a test can kill it."""
    import subprocess

    env = {**os.environ, **c.config, "KUBECONFIG": str(c.workdir / "kubeconfig"), "ELASTIC_DB_URL": f"sqlite:///{db}",
           "POD_NAME": instance,
           "ELASTIC_API_PORT": "0", "ELASTIC_OPERATOR_TIMER_SECONDS": "0.3", "ELASTIC_BACKEND_WAIT_SECONDS": "60",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(extra_env or {})}
    kopf = str(Path(sys.executable).parent / "kopf")
    out = open(c.workdir / f"{instance}.log", "ab")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen([kopf, "run", "-m", "operators.main", "--standalone", "--all-namespaces"], env=env,
                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 15)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(10)


class Load:
    """The load generator (open loop, constant rate) against the Deployment's ready pods, in a thread."""

    def __init__(self, c: Cluster, rate: float, *, seconds: float = 240.0, max_tokens: int = 16,
                 selector: dict[str, str] | None = None) -> None:
        from elastic.serve.loadgen import LoadGenerator
        from elastic.serve.profiles import ConstantProfile

        def targets() -> list[str]:
            out = []
            for p in c.replica_pods():
                st = p.get("status") or {}
                ready = any(x["type"] == "Ready" and x["status"] == "True" for x in st.get("conditions") or [])
                labels = p["metadata"].get("labels") or {}
                selected = all(labels.get(k) == v for k, v in (selector or {}).items())  # the Service's selector
                if ready and selected and not p["metadata"].get("deletionTimestamp"):
                    port = p["spec"]["containers"][0]["ports"][0]["containerPort"]
                    out.append(f"http://{st['podIP']}:{port}")
            return out

        self.gen = LoadGenerator(targets, ConstantProfile(rate), duration=seconds, max_requests=100_000,
                                 max_tokens=max_tokens, timeout=60.0)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.gen.run()), name="loadgen", daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.gen.stop()
        self.thread.join(30)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---- checks over what the API server saw ---------------------------------------------------------

def gpu_ledger(emu: Any) -> tuple[int, list[str]]:
    """Replay every pod event: the most GPUs ever held at once by pods bound to a node and not ended
    (terminating ones included), and every pod ever left unschedulable (a GPU handed out twice)."""
    from .kubelet import gpu_request

    held: dict[str, int] = {}
    peak, unsched = 0, []
    with emu.lock:
        events = list(emu.events)
    for _, key, ev in events:
        if key[2] != "pods":
            continue
        p = ev["object"]
        name = p["metadata"]["name"]
        st = p.get("status") or {}
        if ev["type"] == "DELETED" or st.get("phase") in ("Succeeded", "Failed") or not p["spec"].get("nodeName"):
            held.pop(name, None)
        else:
            held[name] = gpu_request(p)
        if any(x.get("reason") == "Unschedulable" for x in st.get("conditions") or []) and name not in unsched:
            unsched.append(name)
        peak = max(peak, sum(held.values()))
    return peak, unsched


def pool_ticks_balanced(emu: Any) -> tuple[int, list[dict[str, Any]]]:
    """Every GPUPool status the operator wrote: inference + training + free == GPUs, free >= 0."""
    bad, n = [], 0
    with emu.lock:
        events = list(emu.events)
    for _, key, ev in events:
        if key[2] != "gpupools":
            continue
        st = ev["object"].get("status") or {}
        if "gpus" not in st:
            continue
        n += 1
        free = st["gpus"] - st.get("inferenceGPUs", 0) - st.get("trainingGPUs", 0)
        if free < 0:
            bad.append(st)
    return n, bad


def leavers_ended_before_deleted(emu: Any, pods: list[str]) -> dict[str, str]:
    """For each leaver pod: how it went ("ended 0 then deleted" when it exited 0 before any deletion)."""
    out: dict[str, str] = {}
    with emu.lock:
        events = list(emu.events)
    for name in pods:
        seq = [ev for _, key, ev in events if key[2] == "pods" and ev["object"]["metadata"]["name"] == name]
        ended = next((i for i, ev in enumerate(seq) if (ev["object"].get("status") or {}).get("phase") == "Succeeded"),
                     None)
        marked = next((i for i, ev in enumerate(seq) if ev["object"]["metadata"].get("deletionTimestamp")
                       or ev["type"] == "DELETED"), None)
        out[name] = ("ended 0 then deleted" if ended is not None and marked is not None and ended < marked
                     else f"ended={ended} deleted={marked}")
    return out


def api_log(emu: Any) -> list[tuple[int, str, str, dict[str, Any]]]:
    """Every change the API server made: (resourceVersion, resource, event type, object)."""
    with emu.lock:
        return [(rv, key[2], ev["type"], ev["object"]) for rv, key, ev in emu.events]


def first_rv(log_: list[tuple[int, str, str, dict[str, Any]]], pred: Callable[[str, str, dict[str, Any]], bool]
             ) -> int | None:
    return next((rv for rv, res, typ, obj in log_ if pred(res, typ, obj)), None)


def last_rv(log_: list[tuple[int, str, str, dict[str, Any]]], pred: Callable[[str, str, dict[str, Any]], bool]
            ) -> int | None:
    return next((rv for rv, res, typ, obj in reversed(log_) if pred(res, typ, obj)), None)


def reference_losses(cfg: Any, steps: int) -> list[float]:
    """The never-rescaled run: one process, tp1.pp1.dp1, the same config (the trainer tests' own)."""
    from tests.train._mp import reference_losses as single_process

    return single_process(cfg, steps)


# ---- the scenario ----------------------------------------------------------------------------------

def user_job(workdir: Path, *, step_log: Path | None = None) -> dict[str, Any]:
    """The example Llama's own loop (``examples.llama.job:main``, float64, FSDP x TP under
    ``elastic.torch.Manager``) as an ElasticTrainingJob, on a small corpus of stdlib sources
    (``step_log``: the directory its workers write one JSON line per step to, ``--log``)."""
    import sysconfig

    from elastic.torch.data import prepare_corpus

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = workdir / "corpus"
    if not corpus.exists():
        prepare_corpus(str(corpus), [stdlib / "dataclasses.py", stdlib / "functools.py", stdlib / "textwrap.py"])
    model = json.loads((REPO / "examples" / "llama" / "model.json").read_text())
    spec = {k: v for k, v in model.items() if k != "name"}
    args = ["--corpus", str(corpus)] + (["--log", str(step_log)] if step_log is not None else [])
    return job_cr(model=None, modelSpec=spec, entrypoint="examples.llama.job:main",
                  args=args, globalBatch=12, seed=3, allowedTP=[1, 2])


def user_reference_steps(job: dict[str, Any], steps: int, out: Path) -> dict[int, dict[str, Any]]:
    """The never-rescaled run of the example (one process, its local Manager), as the Ray test runs
    it: step -> ``{"loss", "samples", "lr"}``."""
    from tests.controller.test_ray_user_job import _reference

    return _reference(job["spec"]["args"][1], steps, out)


def user_reference(job: dict[str, Any], steps: int, out: Path) -> list[float]:
    ref = user_reference_steps(job, steps, out)
    return [ref[s]["loss"] for s in range(steps)]


def step_log(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """What the example's workers wrote with ``--log``: step -> one record per worker."""
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(directory.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(int(rec["step"]), []).append({**rec, "worker": f.stem})
    return out


def run(workdir: Path, *, high_rate: float = 6.0, user: bool = False, nodes: dict[str, int] | None = None
        ) -> dict[str, Any]:
    """See module docstring (``user``: the job is the example Llama's own loop instead of the
    reference trainer). Raises AssertionError naming what did not happen in time."""
    t0 = time.monotonic()
    detail: dict[str, Any] = {}
    workdir.mkdir(parents=True, exist_ok=True)
    job = user_job(workdir) if user else job_cr()
    with cluster(workdir, nodes) as c, operator(c):
        port = free_port()
        c.apply(replica_deployment(port))
        c.apply(pool_cr(max((nodes or {"n0": TOTAL_GPUS}).values())))
        c.apply(service_cr())
        c.apply(job)

        # 1. quiet: one replica, the job on 4 GPUs trains
        wait_for("1 ready replica", lambda: c.ready_replicas() == 1, 90)
        wait_for("job on 4 GPUs", lambda: c.refused(JOB) or (c.status("elastictrainingjobs", JOB).get(
            "worldSize") == 4 and c.status("elastictrainingjobs", JOB).get("phase") == "Running"), 150)
        h = c.handle()
        h.wait_step(h.status().step + 2, timeout=60)
        first_workers = sorted(p["metadata"]["name"] for p in c.worker_pods())
        detail["start"] = {"layout": str(h.status().layout), "workers": first_workers, "seconds": time.monotonic() - t0}
        log(f"started {detail['start']}")
        replicas_seen = [c.replicas_wanted()]

        # 2. load rises: the job shrinks in place, then the Deployment grows
        with Load(c, high_rate):
            # 6 GPUs - 3 replicas: the reference job's batch of 8 takes 2 of the 3 left, the example's of 12 all 3
            wait_for("job shrunk", lambda: 0 < c.status("elastictrainingjobs", JOB).get("worldSize", 0) < 4, 120)
            wait_for("Deployment at 3 ready", lambda: c.ready_replicas() == 3, 120)
            # kubectl get inferenceservice: the operator's next cycle reports them ready
            wait_for("READY True with 3 replicas", lambda: c.printer_columns("inferenceservices", SERVICE).get(
                "READY") == "True" and c.printer_columns("inferenceservices", SERVICE).get("REPLICAS") == 3, 30)
            replicas_seen.append(c.replicas_wanted())
            st = h.status()
            h.wait_step(st.step + 2, timeout=60)
            survivors = sorted(p["metadata"]["name"] for p in c.worker_pods())
            detail["shrink"] = {"layout": str(st.layout), "generation": st.generation, "workers": survivors,
                                "columns": c.printer_columns("elastictrainingjobs", JOB),
                                "service_columns": c.printer_columns("inferenceservices", SERVICE),
                                "seconds": time.monotonic() - t0}
            log(f"shrunk {detail['shrink']}")
        # 3. load falls: the Deployment shrinks, then the job grows back in place
        wait_for("Deployment back to 1", lambda: c.replicas_wanted() == 1, 120)
        replicas_seen.append(c.replicas_wanted())
        wait_for("job grown to 4", lambda: c.status("elastictrainingjobs", JOB).get("worldSize") == 4
                 and c.status("elastictrainingjobs", JOB).get("generation", 0) >= 3, 150)
        st = h.status()
        h.wait_step(st.step + 2, timeout=60)
        grown = sorted(p["metadata"]["name"] for p in c.worker_pods())
        detail["grow"] = {"layout": str(st.layout), "generation": st.generation, "workers": grown,
                          "columns": c.printer_columns("elastictrainingjobs", JOB), "seconds": time.monotonic() - t0}
        log(f"grown {detail['grow']}")

        # 4. the user deletes the job: the finalizer stops it and removes its pods
        history = h.history()
        detail["printed"] = {"job": c.printer_columns("elastictrainingjobs", JOB),
                             "service": c.printer_columns("inferenceservices", SERVICE)}
        # a background grow's Event is posted by the operator's next cycle after it landed
        all_events = wait_for("the grow's Event", lambda: events_through(
            c, (SERVICE, "scale_inference_down"), (JOB, "grow_training")), 60)
        # only then: the grow stamps its generation on the pods after the job's status already
        # counts its GPUs, and its thread (whose end the Event waits for) ends after the stamps
        annotations = {p["metadata"]["name"]: p["metadata"]["annotations"].get("elastic.dev/generation")
                       for p in c.worker_pods()}
        job_events = [(e["action"], e["reason"]) for e in c.events(JOB)]
        svc_events = [(e["action"], e["reason"]) for e in c.events(SERVICE)]
        leavers = sorted(set(first_workers) - set(survivors))
        how_left = leavers_ended_before_deleted(c.emu, leavers)
        worker_signals = [s for s in c.agent.signals if s[0].startswith(f"{JOB}-w")]
        started_workers = sorted({n for n in c.agent.started if n.startswith(f"{JOB}-w")})
        cfg = h.cfg
        replicas_gone = sorted(set(c.agent.created) - {p["metadata"]["name"] for p in c.replica_pods()
                                                        if not p["metadata"].get("deletionTimestamp")})
        c.custom.delete_namespaced_custom_object(G, V, NS, "elastictrainingjobs", JOB)
        wait_for("worker pods gone", lambda: not c.worker_pods(live=False), 60)
        wait_for("job gone", lambda: c.emu.get("elastictrainingjobs", NS, JOB) is None, 30)
    peak, unsched = gpu_ledger(c.emu)
    ticks, unbalanced = pool_ticks_balanced(c.emu)

    # losses: every step up to the last rescale's first steps against the never-rescaled run
    steps = [r.step for r in history]
    gens = sorted({r.generation for r in history})
    ref = (user_reference(job, len(history), workdir / "reference.json") if user
           else reference_losses(cfg, len(history)))
    worst = max(abs(r.loss - w) / max(abs(w), 1e-12) for r, w in zip(history, ref, strict=True))

    # Events: the shrink is posted before the scale-up that follows it, the scale-down before the grow
    def after(pairs: list[tuple[str, str]], start: int, name: str, action: str) -> int:
        return next((i for i in range(start + 1, len(pairs)) if pairs[i] == (name, action)), -1)

    shrink_i = after(all_events, -1, JOB, "shrink_training")
    up_i = after(all_events, shrink_i, SERVICE, "scale_inference_up") if shrink_i >= 0 else -1
    down_i = after(all_events, up_i, SERVICE, "scale_inference_down") if up_i >= 0 else -1
    grow_i = after(all_events, down_i, JOB, "grow_training") if down_i >= 0 else -1
    # the API's own record: the Deployment asked for 3 only after the leavers' pods were gone, and the
    # joiners' pods were created only after a removed replica's pod was gone (the load may fall in
    # two steps, 3 -> 2 -> 1, and the first one's GPU with the idle one already grows the job; that
    # no GPU is ever held twice is the GPU ledger's check below)
    alog = api_log(c.emu)
    leavers_gone = last_rv(alog, lambda r, t, o: r == "pods" and t == "DELETED" and o["metadata"]["name"] in leavers)
    scaled_to_3 = first_rv(alog, lambda r, t, o: r == "deployments" and o["spec"].get("replicas") == 3)
    replicas_gone_rv = first_rv(alog, lambda r, t, o: r == "pods" and t == "DELETED"
                                and o["metadata"]["name"] in replicas_gone)
    joiners = sorted(set(grown) - set(survivors))
    joiners_made = first_rv(alog, lambda r, t, o: r == "pods" and t == "ADDED" and o["metadata"]["name"] in joiners)
    api_order = (None not in (leavers_gone, scaled_to_3, replicas_gone_rv, joiners_made)
                 and leavers_gone < scaled_to_3 and replicas_gone_rv < joiners_made)  # type: ignore[operator]
    in_order = 0 <= shrink_i < up_i < down_i < grow_i and api_order
    detail.update(history_steps=len(history), max_rel_loss_diff=worst, gpu_peak=peak, unschedulable=unsched,
                  pool_ticks=ticks, unbalanced_ticks=unbalanced, generation_annotations=annotations,
                  job_events=job_events, service_events=svc_events, leavers=how_left, worker_signals=worker_signals,
                  api_order={"leavers_gone": leavers_gone, "deployment_to_3": scaled_to_3,
                             "replicas_gone": replicas_gone_rv, "joiners_created": joiners_made},
                  replicas_removed=replicas_gone, joiners=joiners,
                  layouts=sorted({str(r.layout) for r in history}), seconds=time.monotonic() - t0)
    return {
        "worker_pods_started": len(started_workers),
        "reshards_in_place": len(gens) - 1,
        "generations": gens,
        "steps_monotonic": steps == list(range(len(steps))),
        "loss_matches": worst <= 1e-9,
        "deployment_scaled": replicas_seen,
        "events_in_order": in_order,
        "detail": detail,
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="elastic-e2e-k8s-") as tmp:
        out = run(Path(tmp))
    detail = out.pop("detail")
    print(json.dumps(out), flush=True)
    if os.environ.get("E2E_VERBOSE"):
        print(json.dumps(detail, default=str, indent=1), file=sys.stderr)
    ok = (out["steps_monotonic"] and out["loss_matches"] and out["events_in_order"] and out["reshards_in_place"] >= 2
          and detail["gpu_peak"] <= TOTAL_GPUS and not detail["unschedulable"])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
