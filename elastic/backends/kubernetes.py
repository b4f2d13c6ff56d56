"""Kubernetes backend: inference through a Deployment's ``/scale``, training workers as Pods.

What it is for: the operator drives the controller's ``Backend`` protocol against a cluster.

* **Inventory**: nodes matching the pool's node selector, each giving
  ``min(allocatable nvidia.com/gpu, gpus_per_node)`` GPUs (cordoned nodes give none).
* **Inference**: ``set_service_gpus`` sets the target Deployment's replicas through its
  ``/scale`` subresource (``len(gpus) // gpus_per_replica``) and, on a scale-down, waits
  (bounded) until the Deployment reports no more replicas than that. GPU identities of
  replicas are bookkeeping: the kube-scheduler places vLLM pods on free ``nvidia.com/gpu``;
  the order (training shrinks first) makes the counts work out.
* **Training**: one Pod per worker (``<job>-w<id>``, labels ``elastic.dev/job`` and
  ``elastic.dev/worker``, annotations with the layout generation, layout and GPU), pinned by
  required node affinity to the node the allocation chose and asking ``nvidia.com/gpu: 1``,
  running ``python -m elastic.train.worker`` (or the template's command; for a job with an
  ``entrypoint``, ``ELASTIC_ENTRYPOINT``/``ELASTIC_ARGS`` make it run the user's code); plus a headless
  Service ``<job>-workers`` for peer DNS. Everything the operator owns is written with
  server-side apply under one field manager.

Two job runtimes:

``coordinator`` (production): :class:`KubernetesJobHandle`, a ``JobHandle`` whose workers are
pods and whose rendezvous coordinator is a CPU pod of its own, ``<job>-coordinator`` (the job's
image running ``python -m elastic.train.rendezvous.host``, listening on its pod IP, driven by the
operator over HTTP with the job's secret); start/rescale/stop go through it, so a rescale is the
trainer's in-place, checkpoint-free reshard and returns after the new layout's first step. A
leaver's pod is deleted once it has exited 0 (its bytes landed); a failed pod stays for
``kubectl logs`` until the job stops. Every worker pod of a new layout is re-annotated with its
generation. ``pause_job`` moves a job pushed below its minimum into keeper pods (the template
without GPU requests or node pinning) and ``set_job_gpus`` resumes it from them in place. Because
the coordinator outlives the operator, a restarted operator (or the standby that takes over)
re-attaches to each running job (``adopt``, see :mod:`elastic.backends.kubernetes_coordinator`):
a rescale left in flight is finished by the coordinator and its workers, pods of no current
generation are deleted before their GPUs count as free, and training goes on from the same step.
Worker pods whose coordinator pod is gone are reported ``Failed`` on the GPUs their annotations
name, so the controller stops them before anyone else gets those GPUs, and the job starts again
from its newest checkpoint.

``pods`` (an API server without kubelets: the test emulator, dry runs): the job "runs" once
its pods exist; a rescale deletes the leavers' pods, creates the joiners' and re-annotates the
generation. No reshard happens and no step is ever reported: it exercises exactly the
Kubernetes calls and their order, nothing of the trainer.

Drain (opt-in per service, ``ServiceTarget.drain``): replicas leave the load balancer before a
scale-down removes them, through a pod label the user's Service selects on and the ReplicaSet's
``pod-deletion-cost`` (see ``ServiceTarget``).

What it must not do: decide anything (the controller does) or edit what it does not own
(the user's Deployment is touched only through ``/scale``; its pods only through the labels and
annotations of a drain).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from elastic.backends.base import (
    BackendError,
    BackendUnavailable,
)
from elastic.backends.kubernetes_jobs import _Training
from elastic.backends.kubernetes_names import (
    ANN_DELETION_COST,
    ANN_DRAIN_UNTIL,
    DRAINED_COST,
    FIELD_MANAGER,
    GPU_RESOURCE,
    LABEL_SERVING,
    MERGE,
    JobTarget,
    ServiceTarget,
    _Job,
    parse_gpu,
)
from elastic.model import GPU, InferenceSpec, TrainingSpec

log = logging.getLogger("elastic.backends.kubernetes")

__all__ = ["GPU_RESOURCE", "JobTarget", "KubernetesBackend", "ServiceTarget", "parse_gpu"]

class KubernetesBackend(_Training):
    """``Backend`` over the Kubernetes API (see module docstring)."""

    name = "kubernetes"

    #: set by the controller: raises once its lease is no longer its own (see ``Backend``'s ``fence``)
    fence: Callable[[], None] | None = None

    def _fenced(self) -> None:
        """Before an irreversible change: a leader that lost its lease changes nothing more."""
        if self.fence is not None:
            self.fence()

    def __init__(self, *, node_selector: dict[str, str] | None = None, gpus_per_node: int = 8,
                 api_client: Any = None, field_manager: str = FIELD_MANAGER, job_runtime: str = "coordinator",
                 hardware: str | None = None, launch_options: Any = None,
                 trainer_config: Callable[[TrainingSpec], Any] | None = None,
                 scale_down_wait_seconds: float = 120.0, pod_gone_wait_seconds: float = 120.0,
                 poll_seconds: float = 0.5) -> None:
        from kubernetes import client

        if job_runtime not in ("coordinator", "pods"):
            raise ValueError(f"job_runtime={job_runtime!r}: use 'coordinator' or 'pods'")
        self.api = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.node_selector = dict(node_selector or {})
        self.gpus_per_node = gpus_per_node
        self.field_manager = field_manager
        self.job_runtime_mode = job_runtime
        self.hardware = hardware
        self.launch_options = launch_options
        self.trainer_config = trainer_config
        self.scale_down_wait_seconds = scale_down_wait_seconds
        self.pod_gone_wait_seconds = pod_gone_wait_seconds
        self.poll_seconds = poll_seconds
        if job_runtime == "pods":
            # no coordinator to move a job's state into keepers: the controller must see that it
            # can only preempt a job pushed below its minimum (it looks for a callable pause_job)
            self.pause_job = None  # type: ignore[assignment]
        self.services: dict[str, ServiceTarget] = {}
        self.jobs: dict[str, JobTarget] = {}
        self.booked: dict[str, tuple[GPU, ...]] = {}  # service -> GPUs the controller gave its replicas
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.RLock()
        self.adopted: list[str] = []  # what re-attaching to running jobs found, until ``adopt`` hands it on
        self._adopt_tried: set[str] = set()  # jobs this process re-attached to, tried to, or started itself
        self._adopting = threading.Lock()

    # ---- targets (the operator keeps these in step with the CRs) -----------------------------
    def set_service(self, workload: str, target: ServiceTarget, booked: Sequence[GPU] = ()) -> None:
        with self._lock:
            self.services[workload] = target
            if booked and workload not in self.booked:
                self.booked[workload] = tuple(booked)

    def set_job(self, workload: str, target: JobTarget) -> None:
        with self._lock:
            self.jobs[workload] = target

    def forget(self, workload: str) -> None:
        with self._lock:
            self.services.pop(workload, None)
            self.jobs.pop(workload, None)
            self.booked.pop(workload, None)
            self._jobs.pop(workload, None)

    # ---- errors ---------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run one API call; unreachable -> BackendUnavailable, refused -> BackendError naming ``what``."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kw)
        except ApiException as e:
            hint = " (check the operator's RBAC: manifests/rbac.yaml)" if e.status in (401, 403) else ""
            raise BackendError(f"{what}: HTTP {e.status} {e.reason}{hint}") from e
        except (HTTPError, OSError) as e:
            raise BackendUnavailable(f"Kubernetes API unreachable during {what}: {e}") from e

    def _delete(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> bool:
        """One delete call through :meth:`_call`; an object already gone is not an error (False)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._call(what, fn, *args, **kw)
        except BackendError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
                return False
            raise
        return True

    # ---- protocol: cluster ----------------------------------------------------------------------
    def ping(self) -> None:
        from kubernetes import client

        try:
            self._call("GET /version", client.VersionApi(self.api).get_code)
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                raise
            raise BackendUnavailable(str(e)) from e

    def inventory(self) -> dict[str, int]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.node_selector.items())) or None
        nodes = self._call("list nodes", self.core.list_node, label_selector=selector)
        out: dict[str, int] = {}
        for n in nodes.items:
            if n.spec is not None and n.spec.unschedulable:
                continue  # cordoned: lend nothing new there
            labels = n.metadata.labels or {}
            if any(labels.get(k) != v for k, v in self.node_selector.items()):
                continue  # the API filtered already; an API without selector support must not widen the pool
            alloc = (n.status.allocatable or {}) if n.status else {}
            gpus = min(int(alloc.get(GPU_RESOURCE, 0) or 0), self.gpus_per_node)
            if gpus > 0:
                out[n.metadata.name] = gpus
        return dict(sorted(out.items()))

    # ---- protocol: inference --------------------------------------------------------------------
    def _target(self, service: str) -> ServiceTarget:
        try:
            return self.services[service]
        except KeyError:
            raise BackendError(f"{service}: no InferenceService registered under this name") from None

    def service_gpus(self, service: str) -> tuple[GPU, ...]:
        with self._lock:
            return self.booked.get(service, ())

    def _deployment(self, service: str) -> Any:
        t = self._target(service)
        return self._call(f"get Deployment {t.namespace}/{t.deployment}", self.apps.read_namespaced_deployment,
                          t.deployment, t.namespace)

    def ready_replicas(self, service: str) -> int:
        dep = self._deployment(service)
        return int((dep.status.ready_replicas if dep.status else 0) or 0)

    def service_targets(self, service: str) -> list[str]:
        """``http://<podIP>:<first container port>`` of the Deployment's ready pods (direct scrape)."""
        t = self._target(service)
        urls = []
        for p in self._deployment_pods(t, self._deployment(service)):
            ready = any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])) if p.status else False
            ports = [port.container_port for c in p.spec.containers for port in (c.ports or [])]
            if ready and p.status.pod_ip and ports:
                urls.append(f"http://{p.status.pod_ip}:{ports[0]}")
        return sorted(urls)

    def unready_replicas(self, service: str) -> list[str]:
        """Why each of the Deployment's pods (not being deleted) is not ready, as ``kubectl describe`` would
        say it: ``"<pod>: Unschedulable: 0/2 nodes are available: ..."``, ``"<pod>: CrashLoopBackOff
        (exit code 1, 3 restarts)"``, ``"<pod>: running, not ready (readiness probe failing)"``."""
        t = self._target(service)
        out = []
        for p in self._deployment_pods(t, self._deployment(service)):
            if p.metadata.deletion_timestamp:
                continue
            conds = {c.type: c for c in ((p.status.conditions if p.status else None) or [])}
            if conds.get("Ready") is not None and conds["Ready"].status == "True":
                continue
            sched = conds.get("PodScheduled")
            if sched is not None and sched.status == "False":
                out.append(f"{p.metadata.name}: {sched.reason or 'Pending'}: {sched.message or 'not scheduled'}")
                continue
            why = "not ready (readiness probe failing)"
            for cs in (p.status.container_statuses if p.status else None) or []:
                waiting = cs.state.waiting if cs.state else None
                last = cs.last_state.terminated if cs.last_state else None
                if waiting is not None:
                    code = f"exit code {last.exit_code}, " if last is not None else ""
                    why = f"{waiting.reason or 'Waiting'} ({code}{cs.restart_count} restarts)"
                elif cs.state and cs.state.terminated is not None:
                    why = f"terminated (exit code {cs.state.terminated.exit_code})"
            out.append(f"{p.metadata.name}: {(p.status.phase if p.status else None) or 'Pending'}, {why}")
        return sorted(out)

    # ---- drain (opt-in per service: ServiceTarget.drain) -----------------------------------------
    def drain_ahead(self, service: str, gpus: Sequence[GPU], hold_seconds: float) -> list[str]:
        """Take as many replicas as ``gpus`` hold out of the load balancer ahead of a scale-down the
        policy sees coming (GPU identities of pods are bookkeeping here: the pods chosen are those the
        ReplicaSet would remove, those drained already first). They keep their GPUs and stay ready
        (scraped as before). Every other replica drained ahead serves again at once: asked with
        fewer GPUs or none (the load came back), the scale-down is off. ``hold_seconds`` is written
        on the pod (``elastic.dev/drained-until``) for whoever reads it; a controller that stops
        asking leaves the pods to the next one's first call. Returns the drained pods' URLs; [] for
        a service without ``drain``."""
        t = self._target(service)
        if not t.drain:
            return []
        n = len(gpus) // max(1, t.gpus_per_replica)
        pods = self._live_replica_pods(t)
        chosen = self._drain_victims(pods, n)
        until = time.time() + hold_seconds
        for p in pods:
            if p.metadata.name in chosen:
                self._mark(t, p, until)
            elif _drained(p):
                self._unmark(t, p)
        return sorted(self._pod_url(p) for p in pods if p.metadata.name in chosen and self._pod_url(p))

    def _live_replica_pods(self, t: ServiceTarget) -> list[Any]:
        dep = self._call(f"get Deployment {t.namespace}/{t.deployment}", self.apps.read_namespaced_deployment,
                         t.deployment, t.namespace)
        return [p for p in self._deployment_pods(t, dep) if not p.metadata.deletion_timestamp]

    @staticmethod
    def _drain_victims(pods: list[Any], n: int) -> set[str]:
        """``n`` pods to drain: those drained already, then the newest (the ReplicaSet's own order)."""
        if n <= 0:
            return set()
        order = sorted(pods, key=lambda p: (not _drained(p), -(p.metadata.creation_timestamp.timestamp()
                                                                if p.metadata.creation_timestamp else 0),
                                            p.metadata.name))
        return {p.metadata.name for p in order[:n]}

    def _mark(self, t: ServiceTarget, p: Any, until: float) -> None:
        body = {"metadata": {"labels": {LABEL_SERVING: "false"},
                             "annotations": {ANN_DELETION_COST: DRAINED_COST, ANN_DRAIN_UNTIL: f"{until:.0f}"}}}
        self._call(f"drain pod {t.namespace}/{p.metadata.name}", self.core.patch_namespaced_pod, p.metadata.name,
                   t.namespace, body, _content_type=MERGE)

    def _unmark(self, t: ServiceTarget, p: Any) -> None:
        body = {"metadata": {"labels": {LABEL_SERVING: "true"},
                             "annotations": {ANN_DELETION_COST: None, ANN_DRAIN_UNTIL: None}}}
        self._call(f"undrain pod {t.namespace}/{p.metadata.name}", self.core.patch_namespaced_pod,
                   p.metadata.name, t.namespace, body, _content_type=MERGE)

    @staticmethod
    def _pod_url(p: Any) -> str:
        ports = [port.container_port for c in p.spec.containers for port in (c.ports or [])]
        ip = p.status.pod_ip if p.status else None
        return f"http://{ip}:{ports[0]}" if ip and ports else ""

    def _drain_before_scale_down(self, t: ServiceTarget, replicas: int) -> list[str]:
        """Mark the pods a scale-down to ``replicas`` removes and wait (bounded by ``drain_seconds``)
        until they are idle. Returns the pods still busy at the deadline (they go anyway)."""
        pods = self._live_replica_pods(t)
        victims = self._drain_victims(pods, len(pods) - replicas)
        if not victims:
            return []
        until = time.time() + t.drain_seconds + 60
        for p in pods:
            if p.metadata.name in victims:
                self._mark(t, p, until)
            elif _drained(p):
                self._unmark(t, p)
        urls = {p.metadata.name: self._pod_url(p) for p in pods if p.metadata.name in victims}
        deadline = time.monotonic() + t.drain_seconds
        busy = sorted(urls)
        while busy and time.monotonic() < deadline:
            busy = [n for n in busy if not _idle(urls[n])]
            if busy:
                time.sleep(self.poll_seconds)
        return busy

    def set_service_gpus(self, spec: InferenceSpec, gpus: tuple[GPU, ...]) -> None:
        self._fenced()
        t = self._target(spec.name)
        replicas = len(gpus) // spec.gpus_per_replica
        if t.drain:
            have = len(self._live_replica_pods(t))
            if replicas < have:
                busy = self._drain_before_scale_down(t, replicas)
                if busy:
                    log.warning("%s: replica pod(s) %s still busy %.0f s into their drain; scaling down anyway",
                                spec.name, ", ".join(busy), t.drain_seconds)
            else:  # nobody leaves: every replica drained ahead serves again
                for p in self._live_replica_pods(t):
                    if _drained(p):
                        self._unmark(t, p)
        what = f"scale Deployment {t.namespace}/{t.deployment} to {replicas}"
        self._call(what, self.apps.patch_namespaced_deployment_scale, t.deployment, t.namespace,
                   {"spec": {"replicas": replicas}}, _content_type=MERGE)
        with self._lock:
            self.booked[spec.name] = tuple(gpus)
        self._wait_scaled_down(spec.name, t, replicas)

    def _wait_scaled_down(self, service: str, t: ServiceTarget, replicas: int) -> None:
        """Removed replicas must have released their GPUs before training may take them: wait until
        the Deployment counts no more pods than asked *and* none of its pods is still terminating
        (bounded). The Deployment's status stops counting a pod the moment it is marked for
        deletion, but the pod keeps its GPU while it drains its requests (up to its
        ``terminationGracePeriodSeconds``). A Deployment without status counts as done."""
        deadline = time.monotonic() + self.scale_down_wait_seconds
        while True:
            dep = self._deployment(service)
            have = dep.status.replicas if dep.status and dep.status.replicas is not None else None
            pods = self._deployment_pods(t, dep) if have is None or have <= replicas else []
            leaving = sorted(p.metadata.name for p in pods if p.metadata.deletion_timestamp)
            # the pods themselves, not only the status: the status may already count the new number
            # while the pods over it are not even marked for deletion yet
            if (have is None or have <= replicas) and not leaving and len(pods) <= replicas:
                return
            if time.monotonic() > deadline:
                what = (f"pod(s) {', '.join(leaving)} still terminating (draining their requests)" if leaving
                        else f"still has {have if have is not None and have > replicas else len(pods)} replicas")
                raise BackendError(f"{service}: Deployment {t.namespace}/{t.deployment} {what} "
                                   f"{self.scale_down_wait_seconds:g} s after scaling to {replicas}")
            time.sleep(self.poll_seconds)

    def _deployment_pods(self, t: ServiceTarget, dep: Any) -> list[Any]:
        """The pods the Deployment's selector matches (checked here too: an API server that ignores
        label selectors must not hand us another workload's pods). None without a selector."""
        labels = (dep.spec.selector.match_labels or {}) if dep.spec and dep.spec.selector else {}
        if not labels:
            return []
        pods = self._call(f"list pods of {t.namespace}/{t.deployment}", self.core.list_namespaced_pod, t.namespace,
                          label_selector=",".join(f"{k}={v}" for k, v in sorted(labels.items())))
        return [p for p in pods.items if labels.items() <= (p.metadata.labels or {}).items()]

def _drained(p: Any) -> bool:
    return (p.metadata.labels or {}).get(LABEL_SERVING) == "false"


def _idle(url: str) -> bool:
    """A replica that reports no running or waiting request (vLLM's metric names); unreachable counts
    as idle (it serves nobody)."""
    if not url:
        return True
    import httpx

    from elastic.metrics.scrape import shared_client

    try:
        text = shared_client().get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return True
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total == 0
