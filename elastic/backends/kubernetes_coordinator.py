"""A training job's coordinator as a pod of its own, and re-attaching to it after an operator restart.

The job's rendezvous coordinator (``python -m elastic.train.rendezvous.host``) runs in a CPU pod
``<job>-coordinator`` made from the job's image, not inside the operator: the operator drives it
over HTTP with the job's secret (:class:`~elastic.train.rendezvous.remote.CoordinatorClient`), and
workers reach it at the pod's IP. An operator that restarts, or a standby that takes over, finds the
pod, reads the secret from the job's Secret and re-attaches (:meth:`_Coordinators._adopt_job`): a
rescale the old operator left in flight is finished by the coordinator and its workers without any
operator, then waited for; pods the current generation does not use (leavers still exiting, joiners
of an abandoned rescale) are deleted; the worker -> GPU map and the next worker id are read back from
what the backend stored with the coordinator. Only when the coordinator pod is gone do the job's
workers count as orphaned (``_orphaned_runtime``: reported failed, stopped, restarted from a
checkpoint).
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from elastic.backends.base import BackendError, BackendUnavailable, default_trainer_config
from elastic.backends.kubernetes_names import (
    APPLY,
    COORDINATOR_PORT,
    LABEL_COORDINATOR,
    LABEL_MANAGED,
    SECRET_KEY,
    _Job,
    parse_gpu,
)
from elastic.model import GPU, TrainingSpec
from elastic.phases import CoordinatorPhase
from elastic.train.launch import coordinator_settings, is_user_config, job_options
from elastic.train.rendezvous import SECRET_ENV, JobFailed

if TYPE_CHECKING:
    from elastic.train.rendezvous.remote import CoordinatorClient

log = logging.getLogger("elastic.backends.kubernetes")

COORDINATOR_COMMAND = ("python", "-m", "elastic.train.rendezvous.host")


class _Coordinators:
    """The coordinator pods of :class:`~elastic.backends.kubernetes.KubernetesBackend` (its client,
    lock and bookkeeping are the backend's)."""

    def coordinator_pod_name(self, job: str) -> str:
        return f"{self._job_target(job).name}-coordinator"

    def coordinator_pod_manifest(self, spec: TrainingSpec, cfg: Any, opts: Any) -> dict[str, Any]:
        """The job's coordinator: the job's image and template env, no GPU, ``restartPolicy: Never``
        (a restarted coordinator would have forgotten the job; the job then fails visibly and starts
        again from a checkpoint), ready once it answers ``/healthz``."""
        from elastic.train.agent import config_json
        from elastic.train.launch import LaunchOptions

        t = self._job_target(spec.name)
        tpl = t.template
        settings = coordinator_settings(opts or LaunchOptions(), user=is_user_config(cfg))
        doc = {"config": config_json(cfg), "settings": settings.to_json()}
        env = [{"name": e["name"], "value": e.get("value", "")} for e in tpl.get("env", [])]
        env += [{"name": "ELASTIC_JOB", "value": spec.name},
                {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": self.secret_name(spec.name),
                                                                      "key": SECRET_KEY}}},
                {"name": "ELASTIC_COORDINATOR_SPEC", "value": json.dumps(doc, sort_keys=True)},
                {"name": "ELASTIC_COORDINATOR_PORT", "value": str(COORDINATOR_PORT)},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        container: dict[str, Any] = {
            "name": "coordinator", "image": tpl["image"],
            "imagePullPolicy": tpl.get("imagePullPolicy", "IfNotPresent"),
            "command": list(COORDINATOR_COMMAND), "env": env,
            "ports": [{"name": "rendezvous", "containerPort": COORDINATOR_PORT}],
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": COORDINATOR_PORT}, "periodSeconds": 2},
        }
        meta: dict[str, Any] = {
            "name": self.coordinator_pod_name(spec.name), "namespace": t.namespace,
            "labels": {LABEL_COORDINATOR: t.name, LABEL_MANAGED: self.field_manager},
        }
        if t.uid:
            meta["ownerReferences"] = [{"apiVersion": t.api_version, "kind": t.kind, "name": t.name, "uid": t.uid,
                                        "controller": True, "blockOwnerDeletion": False}]
        pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}

    def start_coordinator(self, spec: TrainingSpec, cfg: Any, opts: Any) -> CoordinatorClient:
        """Create the job's Secret and coordinator pod; return a client once the coordinator answers.
        Raises BackendError (pod failed or not ready in time, with the pod's own reason)."""
        from elastic.train.launch import LaunchOptions

        self._clear_coordinator(spec.name)
        secret = secrets.token_urlsafe(32)
        # the secret reaches the pods through a Secret, not as a literal in a pod spec (readable by
        # anyone who may get pods)
        self.apply_job_secret(spec.name, secret)
        body = self.coordinator_pod_manifest(spec, cfg, opts)
        name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
        self._call(f"apply pod {ns}/{name}", self.core.patch_namespaced_pod, name, ns, body,
                   field_manager=self.field_manager, force=True, _content_type=APPLY)
        wait = (opts or LaunchOptions()).register_timeout_s
        return self._coordinator_client(spec.name, secret, wait)

    def _coordinator_client(self, job: str, secret: str, wait: float) -> CoordinatorClient:
        """Wait (bounded) until the coordinator pod runs with an IP and answers; its client."""
        from elastic.train.rendezvous.remote import CoordinatorClient

        ns, name = self._job_target(job).namespace, self.coordinator_pod_name(job)
        deadline = time.monotonic() + wait
        while True:
            pod = self._read_coordinator_pod(job)
            why = _not_serving(pod)
            if why is None:
                client = CoordinatorClient(f"http://{pod.status.pod_ip}:{COORDINATOR_PORT}", secret, job)
                client.ready(max(1.0, deadline - time.monotonic()))
                return client
            if pod is not None and pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
                raise BackendError(f"{job}: coordinator pod {ns}/{name} {why}")
            if time.monotonic() > deadline:
                raise BackendError(f"{job}: coordinator pod {ns}/{name} not serving {wait:g} s after it was "
                                   f"created ({why}); check `kubectl describe pod -n {ns} {name}`")
            time.sleep(self.poll_seconds)

    def _coordinator_serving(self, job: str) -> bool:
        return _not_serving(self._read_coordinator_pod(job)) is None

    def _read_coordinator_pod(self, job: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        ns, name = self._job_target(job).namespace, self.coordinator_pod_name(job)
        try:
            return self._call(f"read pod {ns}/{name}", self.core.read_namespaced_pod, name, ns)
        except BackendError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
                return None
            raise

    def _clear_coordinator(self, job: str) -> None:
        """Delete a coordinator pod left from the job's last run (ended, or still terminating) and wait
        until it is gone: an apply onto it would patch a pod that never runs again."""
        deadline = time.monotonic() + self.pod_gone_wait_seconds
        while (pod := self._read_coordinator_pod(job)) is not None:
            if not pod.metadata.deletion_timestamp:
                self.delete_coordinator(job)
            if time.monotonic() > deadline:
                raise BackendError(f"{job}: the job's previous coordinator pod {self.coordinator_pod_name(job)} still "
                                   f"exists {self.pod_gone_wait_seconds:g} s after its deletion")
            time.sleep(self.poll_seconds)

    def delete_coordinator(self, job: str) -> None:
        ns, name = self._job_target(job).namespace, self.coordinator_pod_name(job)
        try:
            self._delete(f"{job}: delete pod {ns}/{name}", self.core.delete_namespaced_pod, name, ns,
                         grace_period_seconds=5)
        except BackendUnavailable as e:  # a stop goes on; a resource's pod goes with its owner reference
            log.warning("%s", e)

    def _job_secret(self, job: str) -> str | None:
        from kubernetes.client.exceptions import ApiException

        ns, name = self._job_target(job).namespace, self.secret_name(job)
        try:
            s = self._call(f"read secret {ns}/{name}", self.core.read_namespaced_secret, name, ns)
        except BackendError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
                return None
            raise
        data = (s.data or {}).get(SECRET_KEY)
        return base64.b64decode(data).decode() if data else None

    def remember_job(self, job: str, j: _Job, gpus: dict[GPU, str] | None = None, next_id: int | None = None, *,
                     spec: TrainingSpec | None = None, keepers: list[str] | None = None) -> None:
        """Store worker -> GPU (``gpus``, default the job's workers), the next worker id (and the spec,
        the keepers) with the job's coordinator: a successor reads them back (``_adopt_job``). Best
        effort: a coordinator that does not answer is one the job has lost anyway."""
        held = j.workers if gpus is None else gpus
        meta: dict[str, Any] = {"gpus": {w: str(g) for g, w in held.items()},
                                "next_id": j.next_id if next_id is None else next_id}
        if spec is not None:
            meta["spec"] = spec.model_dump(mode="json")
        if keepers is not None:
            meta["keepers"] = list(keepers)
        try:
            j.handle.coordinator.update_meta(**meta)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("%s: could not store the worker map with the coordinator: %s", job, e)

    # ---- re-attach after an operator restart ----------------------------------------------------
    def adopt(self) -> list[str]:
        """Re-attach to the coordinator pods of every registered job that has no handle here (the
        ``Adopts`` capability; the controller calls it once, in ``recover``). Returns notes."""
        if self.job_runtime_mode != "coordinator":
            return []
        with self._lock:
            jobs = [job for job in self.jobs if (j := self._jobs.get(job)) is None or j.handle is None]
        for job in jobs:
            self._adopt_job(job)
        with self._lock:
            notes, self.adopted = list(self.adopted), []
        return notes

    def _adopt_job(self, job: str) -> _Job | None:
        """Re-attach to ``job``'s coordinator pod, once per job in this process (its first look at the
        job; a job it starts itself is never adopted): wait for a rescale in flight, delete the pods its
        current generation does not use, rebuild the worker -> GPU map. A second caller waits for the
        first, so nobody reads the job as orphaned meanwhile. None (and the reason noted) when there is
        no coordinator to re-attach to, or it cannot say which GPUs its workers hold (the job is then
        stopped: the only safe bookkeeping)."""
        with self._adopting:
            with self._lock:
                if job in self._adopt_tried:
                    return self._jobs.get(job)
                self._adopt_tried.add(job)
            return self._adopt_now(job)

    def _adopt_now(self, job: str) -> _Job | None:
        from elastic.backends.kubernetes_jobs import KubernetesJobHandle

        pod = self._read_coordinator_pod(job)
        if _not_serving(pod) is not None:
            return None
        secret = self._job_secret(job)
        if secret is None:
            self._note(f"job {job}: coordinator pod runs but the job's Secret is gone; not adopted")
            return None
        try:
            client = self._coordinator_client(job, secret, 10.0)
            meta = client.get_meta()
            spec = TrainingSpec.model_validate(meta["spec"])
        except Exception as e:  # noqa: BLE001 - an unusable coordinator: the orphan path handles the job
            self._note(f"job {job}: coordinator did not answer ({type(e).__name__}: {e}); not adopted")
            return None
        cfg = (self.trainer_config(spec) if self.trainer_config and spec.entrypoint is None
               else default_trainer_config(spec))
        opts = job_options(self.launch_options, spec, coordinator_sees=False)
        handle = KubernetesJobHandle(self, spec, cfg, coordinator=client, options=opts, hardware=self.hardware,
                                     gpus_per_node=self.gpus_per_node)
        try:
            st = handle.settle(opts.rescale_timeout_s if opts else 600.0)
        except JobFailed as e:  # gone meanwhile: the orphan path handles the job
            self._note(f"job {job}: coordinator lost while re-attaching ({e}); not adopted")
            return None
        pods = {p.metadata.name: p for p in self.worker_pods(job)}
        handle.attach([w for w in st.workers if w in pods])
        next_id = int(meta.get("next_id", 0))
        gpus = meta.get("gpus", {})
        paused = st.phase == CoordinatorPhase.PAUSED
        why = None
        # a recovery goes on in the coordinator as it would have under the old operator (an out-of-memory
        # hold waits for the controller's directive): adopted like a running job
        if not paused and st.phase not in (CoordinatorPhase.RUNNING, CoordinatorPhase.RESCALING,
                                           CoordinatorPhase.RECOVERING):
            why = f"it was {st.phase} ({st.error or st.reason})"
        elif not paused and (unknown := [w for w in st.workers if w not in gpus]):
            why = f"no GPU on record for worker(s) {', '.join(unknown)}"
        if why is not None:  # stopping it is the only safe bookkeeping; the job starts again
            self._note(f"job {job}: {why} when re-attached; stopped it")
            handle.stop(timeout=10.0)
            self.delete_coordinator(job)
            return None
        if paused:  # its keepers hold the state and no GPU
            handle.keepers.update(st.workers)
            j = _Job(handle, next_id=next_id)
            note = f"adopted paused job {job}: state held as {st.layout} at step {st.step + 1} by {', '.join(st.workers)}"
        else:
            j = _Job(handle, workers={parse_gpu(gpus[w]): w for w in st.workers}, next_id=next_id)
            held = ", ".join(str(g) for g in sorted(j.workers, key=lambda g: (g.node, g.index)))
            note = f"adopted job {job}: {st.layout} generation {st.generation} at step {st.step} on {held}"
        self._forget_pods_except(job, st.workers)
        with self._lock:
            self._jobs[job] = j
        self._note(note)
        return j

    def _forget_pods_except(self, job: str, workers: list[str]) -> None:
        """Delete the job's pods the current generation does not use (leavers that lingered, joiners of
        a rescale called off), and wait until they are gone: their GPUs are then free."""
        keep = set(workers)
        extra = [p.metadata.name for p in self.worker_pods(job) if p.metadata.name not in keep]
        if extra:
            self._note(f"job {job}: deleted pod(s) {', '.join(extra)}: in no current generation")
            self.delete_pods(job, extra)

    def _note(self, note: str) -> None:
        log.info("%s", note)
        with self._lock:
            self.adopted.append(note)


def _not_serving(pod: Any) -> str | None:
    """None when the coordinator pod runs with an IP; else what it is doing instead."""
    if pod is None:
        return "not found"
    if pod.metadata.deletion_timestamp:
        return "being deleted"
    st = pod.status
    if st is None or st.phase != "Running" or not st.pod_ip:
        phase = st.phase if st is not None else None
        for cs in (st.container_statuses or []) if st is not None else []:
            term = cs.state.terminated if cs.state else None
            if term is not None:
                return f"exited with code {term.exit_code}{', ' + term.reason if term.reason else ''}"
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason:
                return f"waiting: {waiting.reason}"
        return f"phase {phase or 'unknown'}"
    return None

