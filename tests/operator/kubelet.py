"""A test-side node agent for the API emulator: what kubelet, kube-scheduler and the Deployment
controller would do, with real local processes. Test harness only, never shipped.

``NodeAgent`` owns a few fake nodes (allocatable ``nvidia.com/gpu``, the pool's label) and, every
``poll`` seconds, reconciles the emulator's pods and Deployments in one namespace:

1. **Deployments** (a ReplicaSet stand-in): ``spec.replicas`` (``/scale``) becomes pods from the
   template; extra pods are deleted in the ReplicaSet's order: unscheduled, then not ready, then
   lower ``controller.kubernetes.io/pod-deletion-cost``, then newest. ``status`` counts the pods
   not being deleted (``replicas``) and the ready ones.
2. **Scheduling**: a pending pod is bound (``spec.nodeName``) to the first of its nodes (node
   affinity ``metadata.name In``, ``nodeSelector``) whose GPUs not requested by pods bound there
   (terminating ones included: they hold theirs until gone) cover its request; else it stays
   ``Pending`` with ``PodScheduled=False``/``Unschedulable``, as kube-scheduler says it.
3. **Running** (kubelet): a bound pod's container command runs as a local process (``python`` is
   this interpreter; ``python -m module`` forked from a warm starter, :mod:`elastic.train.warm`,
   as an image's interpreter that has torch imported; ``$(VAR)`` expanded, working directory the
   repository) with exactly the pod's env
   (values, and the downward-API ``fieldRef``s ``metadata.name``/``namespace``/``uid``/``labels``/
   ``annotations``, ``spec.nodeName``, ``status.podIP``/``hostIP``), ``GLOO_SOCKET_IFNAME=lo`` and
   ``OMP_NUM_THREADS=1``. The pod IP is a loopback address of its own (``127.0.x.y``). Status:
   ``Running``; ``Ready`` once its ``readinessProbe.httpGet`` answers 200 (at once without one)
   and every ``readinessGates`` condition is True; on exit ``Succeeded``/``Failed`` with the exit
   code in ``containerStatuses`` (``restartPolicy: Always``: restarted after a back-off,
   ``restartCount`` +1).
4. **Deletion**: with ``StrictEmulator.graceful_pods`` a deleted pod is only marked; the agent
   sends SIGTERM to its process group, waits ``deletionGracePeriodSeconds``, sends SIGKILL, and then
   removes the pod (a delete with grace 0). A pod force-deleted from under a process gets SIGKILL.

Reads come straight from the emulator's store (thread-safe); every write goes through the HTTP
API with the real ``kubernetes`` client, so watchers (Kopf, the operator) see it as from a cluster.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from elastic.train.warm import WarmProcess, WarmStartError, start_module

log = logging.getLogger("tests.operator.kubelet")

GPU = "nvidia.com/gpu"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REPO = str(Path(__file__).resolve().parents[2])
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def gpu_request(pod: dict[str, Any]) -> int:
    """``nvidia.com/gpu`` the pod asks for (requests, else limits, summed over containers)."""
    n = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        v = (res.get("requests") or {}).get(GPU, (res.get("limits") or {}).get(GPU, 0))
        n += int(v or 0)
    return n


def _ended(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _nodes_allowed(pod: dict[str, Any]) -> list[str] | None:
    """Node names the pod's required node affinity (``matchFields metadata.name In``) allows; None: any."""
    aff = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    req = aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    names: list[str] = []
    for term in req.get("nodeSelectorTerms") or []:
        for f in term.get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("operator") == "In":
                names += list(f.get("values") or [])
    return names or None


@dataclass
class _Container:
    """One pod's process, as the agent runs it."""

    uid: str
    name: str
    ip: str
    popen: subprocess.Popen[bytes] | WarmProcess | None = None
    started_at: str = ""
    restarts: int = 0
    restart_at: float | None = None  # back-off: when to start it again (restartPolicy Always)
    last_exit: int | None = None
    probe_ok: bool = False
    next_probe: float = 0.0
    term_sent: float | None = None  # SIGTERM sent (monotonic)
    killed: bool = False
    reported: dict[str, Any] = field(default_factory=dict)  # the last status written


class NodeAgent:
    """See module docstring. ``start()`` creates the nodes and the loop; ``stop()`` ends every process."""

    def __init__(self, emu: Any, api: Any, nodes: dict[str, int], *, namespace: str = "ml",
                 labels: dict[str, str] | None = None, log_dir: str | Path, poll: float = 0.1,
                 ip_base: str = "127.0.3.", env: dict[str, str] | None = None,
                 runs: Callable[[dict[str, Any]], bool] | None = None, create_nodes: bool = True) -> None:
        from kubernetes import client

        self.emu = emu
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.nodes = dict(nodes)
        self.namespace = namespace
        self.labels = dict(labels if labels is not None else {"pool": "a"})
        self.log_dir = Path(log_dir)
        self.poll = poll
        self.ip_base = ip_base
        self.env = dict(env or {})
        # which pods this agent schedules and runs (None: all); a test that wants the others applied
        # but never running (a start that waits for workers) runs only some
        self.runs = runs
        self.create_nodes = create_nodes  # False: the nodes exist already (the test made them)
        self.procs: dict[str, _Container] = {}  # pod uid -> its container
        self.started: list[str] = []  # pod names, in the order their processes started
        self.start_times: list[tuple[str, float]] = []  # (pod, time.monotonic()) of every process start
        self.created: list[str] = []  # replica pods, in the order the ReplicaSet stand-in created them
        self.signals: list[tuple[str, str]] = []  # (pod, "TERM" | "KILL") in the order sent
        self.exits: dict[str, int] = {}  # pod -> exit code of its (last) process
        self._ips = (f"{ip_base}{i}" for i in itertools.count(10))
        self._seq = itertools.count()
        self._created: dict[str, int] = {}  # pod uid -> creation order (ReplicaSet: newest deleted first)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self._lock = threading.RLock()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self.emu.graceful_pods = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, gpus in self.nodes.items() if self.create_nodes else ():
            self.core.create_node({"metadata": {"name": name, "labels": dict(self.labels)},
                                   "status": {"allocatable": {GPU: str(gpus), "cpu": "8", "memory": "64Gi"},
                                              "capacity": {GPU: str(gpus), "cpu": "8", "memory": "64Gi"},
                                              "conditions": [{"type": "Ready", "status": "True"}]}})
        self._thread = threading.Thread(target=self._run, name="node-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for c in self.procs.values():
                self._signal(c, signal.SIGKILL, record=False)
            for c in self.procs.values():
                if c.popen is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.popen.wait(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as e:  # noqa: BLE001 - a hiccup (a 409, a pod gone meanwhile): next round
                self.errors.append(repr(e))
                log.debug("node agent round failed: %r", e)
            self._stop.wait(self.poll)

    # ---- one round ------------------------------------------------------------------------------
    def reconcile(self) -> None:
        with self._lock:
            self._deployments()
            self._schedule(self._pods())
            self._kubelet(self._pods())

    def _pods(self) -> list[dict[str, Any]]:
        pods = self.emu.objects("pods", self.namespace)
        return pods if self.runs is None else [p for p in pods if self.runs(p)]

    # 1. Deployments
    def _deployments(self) -> None:
        pods = self.emu.objects("pods", self.namespace)
        for dep in self.emu.objects("deployments", self.namespace):
            uid = dep["metadata"]["uid"]
            owned = [p for p in pods if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]
            active = [p for p in owned if not p["metadata"].get("deletionTimestamp") and not _ended(p)]
            want = int((dep.get("spec") or {}).get("replicas", 1) or 0)
            if len(active) < want:
                for _ in range(want - len(active)):
                    self._create_replica(dep)
            elif len(active) > want:
                for p in sorted(active, key=self._deletion_rank)[:len(active) - want]:
                    with contextlib.suppress(Exception):
                        self.core.delete_namespaced_pod(p["metadata"]["name"], self.namespace)
            pods = self.emu.objects("pods", self.namespace)
            owned = [p for p in pods if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]
            active = [p for p in owned if not p["metadata"].get("deletionTimestamp") and not _ended(p)]
            ready = sum(1 for p in active if _ready(p))
            status = {"observedGeneration": dep["metadata"].get("generation", 1), "replicas": len(active),
                      "updatedReplicas": len(active), "readyReplicas": ready, "availableReplicas": ready,
                      "unavailableReplicas": max(0, want - ready)}
            if {k: (dep.get("status") or {}).get(k) for k in status} != status:
                self.apps.patch_namespaced_deployment_status(dep["metadata"]["name"], self.namespace,
                                                             {"status": status})

    def _create_replica(self, dep: dict[str, Any]) -> None:
        tpl = (dep.get("spec") or {}).get("template") or {}
        meta = dict(tpl.get("metadata") or {})
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": f"{dep['metadata']['name']}-", "labels": dict(meta.get("labels") or {}),
                             "annotations": dict(meta.get("annotations") or {}),
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                  "name": dep["metadata"]["name"], "uid": dep["metadata"]["uid"],
                                                  "controller": True}]},
                "spec": dict(tpl.get("spec") or {})}
        body["spec"].setdefault("restartPolicy", "Always")
        pod = self.core.create_namespaced_pod(self.namespace, body)
        self._created[pod.metadata.uid] = next(self._seq)
        self.created.append(pod.metadata.name)

    def _deletion_rank(self, p: dict[str, Any]) -> tuple[int, int, int, int]:
        """The ReplicaSet's order of who goes first on a scale-down (smallest first)."""
        bound = 1 if (p.get("spec") or {}).get("nodeName") else 0
        cost = int(((p["metadata"].get("annotations") or {}).get(DELETION_COST)) or 0)
        return (bound, 1 if _ready(p) else 0, cost, -self._created.get(p["metadata"]["uid"], -1))

    # 2. scheduling
    def _schedule(self, pods: list[dict[str, Any]]) -> None:
        used = {n: 0 for n in self.nodes}
        for p in pods:
            node = (p.get("spec") or {}).get("nodeName")
            if node in used and not _ended(p):
                used[node] += gpu_request(p)
        for p in pods:
            spec = p.get("spec") or {}
            if spec.get("nodeName") or p["metadata"].get("deletionTimestamp"):
                continue
            need = gpu_request(p)
            allowed = _nodes_allowed(p)
            sel = spec.get("nodeSelector") or {}
            cands = [n for n in self.nodes if (allowed is None or n in allowed)
                     and all(self.labels.get(k) == v for k, v in sel.items())]
            fit = next((n for n in cands if self.nodes[n] - used[n] >= need), None)
            if fit is None:
                msg = (f"0/{len(self.nodes)} nodes are available: {len(self.nodes) - len(cands)} node(s) didn't "
                       f"match Pod's node affinity/selector, {len(cands)} Insufficient {GPU}.")
                cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}
                st = p.get("status") or {}
                if cond not in [{k: c.get(k) for k in cond} for c in st.get("conditions") or []]:
                    self.core.patch_namespaced_pod_status(p["metadata"]["name"], self.namespace, {"status": {
                        "phase": "Pending", "conditions": [dict(cond, lastTransitionTime=_now())]}})
                continue
            used[fit] += need
            self.core.patch_namespaced_pod(p["metadata"]["name"], self.namespace, {"spec": {"nodeName": fit}})

    # 3 + 4. kubelet
    def _kubelet(self, pods: list[dict[str, Any]]) -> None:
        seen = set()
        for p in pods:
            if (p.get("spec") or {}).get("nodeName") not in self.nodes:
                continue
            uid = p["metadata"]["uid"]
            seen.add(uid)
            c = self.procs.get(uid)
            if p["metadata"].get("deletionTimestamp"):
                self._terminate(p, c)
                continue
            if c is None and not _ended(p):
                c = self.procs[uid] = _Container(uid, p["metadata"]["name"], next(self._ips))
                self._launch(p, c)
            if c is not None:
                self._observe(p, c)
        for uid, c in list(self.procs.items()):
            if uid not in seen:  # force-deleted (grace 0) from under its process
                if c.popen is not None and c.popen.poll() is None:
                    self._signal(c, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.popen.wait(10)
                self._note_exit(c)
                del self.procs[uid]

    def _launch(self, p: dict[str, Any], c: _Container) -> None:
        ctr = p["spec"]["containers"][0]
        env = self._env(p, ctr, c.ip)
        argv = [_expand(a, env) for a in list(ctr.get("command") or []) + list(ctr.get("args") or [])]
        if not argv:
            raise ValueError(f"pod {c.name}: container {ctr.get('name')} has no command (no image entrypoint here)")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
            if len(argv) > 2 and argv[1] == "-m":  # forked warm: the image's python with torch imported
                try:
                    c.popen = start_module(argv[2], argv[3:], env=env, cwd=REPO,
                                           log_path=str(self.log_dir / f"{c.name}.log"))
                except WarmStartError:
                    pass
                else:
                    self._started(c)
                    return
        out = open(self.log_dir / f"{c.name}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            c.popen = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as e:  # e.g. no such executable: the container fails as kubelet says it
            out.write(f"node agent: cannot start {argv[0]!r}: {e}\n".encode())
            c.popen = None
            c.last_exit = 128
        finally:
            out.close()
        self._started(c)

    def _started(self, c: _Container) -> None:
        c.started_at, c.probe_ok, c.next_probe, c.restart_at = _now(), False, 0.0, None
        self.started.append(c.name)
        self.start_times.append((c.name, time.monotonic()))

    def _env(self, p: dict[str, Any], ctr: dict[str, Any], ip: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(PYTHONPATH=REPO, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HOSTNAME=p["metadata"]["name"],
                   **self.env)
        for e in ctr.get("env") or []:
            if "value" in e:
                env[e["name"]] = _expand(str(e["value"]), env)
            elif (ref := ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")) is not None:
                env[e["name"]] = _field(p, ref, ip)
            elif (key := (e.get("valueFrom") or {}).get("secretKeyRef")) is not None:
                env[e["name"]] = self._secret(p["metadata"].get("namespace") or self.namespace, key)
        return env

    def _secret(self, namespace: str, ref: dict[str, Any]) -> str:
        """A ``secretKeyRef``'s value, as kubelet reads it (a missing Secret or key fails the container
        start, as it would with CreateContainerConfigError)."""
        import base64

        sec = self.emu.get("secrets", namespace, ref["name"])
        data = (sec or {}).get("data") or {}
        if ref["key"] not in data:
            raise RuntimeError(f"secret {namespace}/{ref['name']} has no key {ref['key']!r}")
        return base64.b64decode(data[ref["key"]]).decode()

    def _observe(self, p: dict[str, Any], c: _Container) -> None:
        """Restart a crashed container when its policy says so; report the pod's status when it changed."""
        code = c.popen.poll() if c.popen is not None else c.last_exit
        policy = p["spec"].get("restartPolicy", "Always")
        if code is not None and c.popen is not None:
            self._note_exit(c)
            c.last_exit = code
        if code is not None and (policy == "Always" or (policy == "OnFailure" and code != 0)):
            if c.restart_at is None:
                c.restart_at = time.monotonic() + min(5.0, 0.5 * 2 ** c.restarts)
                c.popen = None
            elif time.monotonic() >= c.restart_at:
                c.restarts += 1
                self._launch(p, c)
                code = None
        ready = code is None and c.popen is not None and self._probe(p, c)
        gates = [g.get("conditionType") for g in p["spec"].get("readinessGates") or []]
        others = [x for x in (p.get("status") or {}).get("conditions") or []
                  if x.get("type") not in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        gated = all(any(x.get("type") == g and x.get("status") == "True" for x in others) for g in gates)
        if code is None or c.restart_at is not None:
            phase = "Running"
        else:
            phase = "Succeeded" if code == 0 else "Failed"
        if code is None and c.popen is not None:
            state = {"running": {"startedAt": c.started_at}}
        elif phase == "Running":
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"exit code {c.last_exit}; restarting"}}
        else:
            state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                    "startedAt": c.started_at, "finishedAt": _now()}}
        tf = {True: "True", False: "False"}
        conds = [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                 {"type": "ContainersReady", "status": tf[ready]}, {"type": "Ready", "status": tf[ready and gated]}]
        cs = {"name": p["spec"]["containers"][0].get("name", "c"), "ready": ready, "restartCount": c.restarts,
              "state": state, "image": p["spec"]["containers"][0].get("image", ""), "imageID": "",
              "containerID": f"local://{c.popen.pid if c.popen is not None else 0}"}
        if c.restarts and c.last_exit is not None:
            cs["lastState"] = {"terminated": {"exitCode": c.last_exit}}
        status = {"phase": phase, "podIP": c.ip, "podIPs": [{"ip": c.ip}], "hostIP": "10.0.0.1",
                  "conditions": [*conds, *others], "containerStatuses": [cs]}
        if status != c.reported:
            if status["phase"] in ("Succeeded", "Failed") and "finishedAt" in state.get("terminated", {}) and \
                    c.reported.get("phase") == status["phase"]:
                return  # ended and said so: finishedAt would rewrite the same story every round
            with contextlib.suppress(Exception):
                self.core.patch_namespaced_pod_status(c.name, self.namespace, {"status": {
                    **status, "conditions": [dict(x, lastTransitionTime=x.get("lastTransitionTime") or _now())
                                             for x in status["conditions"]]}})
                c.reported = status

    def _probe(self, p: dict[str, Any], c: _Container) -> bool:
        probe = (p["spec"]["containers"][0].get("readinessProbe") or {}).get("httpGet")
        if probe is None:
            return True
        if time.monotonic() < c.next_probe:
            return c.probe_ok
        import httpx

        from elastic.metrics.scrape import shared_client

        c.next_probe = time.monotonic() + 0.5
        port = probe.get("port")
        if isinstance(port, str):  # a named port
            port = next((x["containerPort"] for x in p["spec"]["containers"][0].get("ports") or []
                         if x.get("name") == port), None)
        try:
            r = shared_client().get(f"http://{c.ip}:{port}{probe.get('path', '/')}", timeout=0.5)
            c.probe_ok = r.status_code == 200
        except httpx.HTTPError:
            c.probe_ok = False
        return c.probe_ok

    def _terminate(self, p: dict[str, Any], c: _Container | None) -> None:
        """SIGTERM, ``deletionGracePeriodSeconds``, SIGKILL; then the pod goes (a delete with grace 0)."""
        running = c is not None and c.popen is not None and c.popen.poll() is None
        if running and c is not None:
            grace = float(p["metadata"].get("deletionGracePeriodSeconds", 30))
            if c.term_sent is None:
                self._signal(c, signal.SIGTERM)
                c.term_sent = time.monotonic()
                return
            if time.monotonic() - c.term_sent < grace:
                return
            self._signal(c, signal.SIGKILL)
            assert c.popen is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.popen.wait(10)
        if c is not None:
            self._note_exit(c)
        with contextlib.suppress(Exception):
            self.core.delete_namespaced_pod(p["metadata"]["name"], self.namespace, grace_period_seconds=0)

    def _signal(self, c: _Container, sig: int, *, record: bool = True) -> None:
        if c.popen is None or c.popen.poll() is not None:
            return
        if record:
            self.signals.append((c.name, "TERM" if sig == signal.SIGTERM else "KILL"))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.popen.pid, sig)

    def _note_exit(self, c: _Container) -> None:
        if c.popen is not None and c.popen.poll() is not None:
            self.exits[c.name] = c.popen.returncode

    # ---- for tests ------------------------------------------------------------------------------
    def pid(self, pod: str) -> int | None:
        with self._lock:
            for c in self.procs.values():
                if c.name == pod and c.popen is not None:
                    return c.popen.pid
        return None

    def ip(self, pod: str) -> str | None:
        with self._lock:
            return next((c.ip for c in self.procs.values() if c.name == pod), None)

    def live(self) -> list[str]:
        """Pods whose process runs now."""
        with self._lock:
            return sorted(c.name for c in self.procs.values() if c.popen is not None and c.popen.poll() is None)


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values (``$$`` escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _field(p: dict[str, Any], path: str, ip: str) -> str:
    meta = p["metadata"]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    return {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", ""),
            "metadata.uid": meta.get("uid", ""), "spec.nodeName": (p.get("spec") or {}).get("nodeName", ""),
            "status.podIP": ip, "status.hostIP": "10.0.0.1", "spec.serviceAccountName":
            (p.get("spec") or {}).get("serviceAccountName", "default")}.get(path, "")
