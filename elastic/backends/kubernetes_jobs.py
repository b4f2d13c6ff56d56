"""The training half of the Kubernetes backend: a job's worker pods, their Secret and Service,
keepers, and the in-place rescale through the job's coordinator (a pod of its own, see
:mod:`elastic.backends.kubernetes_coordinator`) with workers as pods."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.backends.base import (
    BackendError,
    BackendUnavailable,
    CheckpointOutcome,
    GrowCancelled,
    JobRuntime,
    RescaleOutcome,
    checkpoint_through,
    coordinator_runtime,
    default_trainer_config,
    layout_of,
    still_held,
)
from elastic.backends.kubernetes_coordinator import _Coordinators
from elastic.backends.kubernetes_names import (
    ANN_GENERATION,
    ANN_GPU,
    ANN_LAYOUT,
    APPLY,
    GPU_RESOURCE,
    LABEL_JOB,
    LABEL_KEEPER,
    LABEL_MANAGED,
    LABEL_WORKER,
    MERGE,
    SECRET_KEY,
    JobTarget,
    _Job,
    parse_gpu,
)
from elastic.model import GPU, Layout, SpecError, TrainingSpec
from elastic.phases import CoordinatorPhase, JobPhase
from elastic.train.launch import JobHandle, job_options
from elastic.train.rendezvous import SECRET_ENV, JobFailed, RescaleCancelled

if TYPE_CHECKING:
    from elastic.backends.kubernetes import KubernetesBackend

log = logging.getLogger("elastic.backends.kubernetes")


class _Training(_Coordinators):
    """The training half of :class:`~elastic.backends.kubernetes.KubernetesBackend` (its client, lock
    and bookkeeping are the backend's)."""

    # ---- protocol: training ---------------------------------------------------------------------
    def _job_target(self, job: str) -> JobTarget:
        try:
            return self.jobs[job]
        except KeyError:
            raise BackendError(f"{job}: no ElasticTrainingJob registered under this name") from None

    def worker_pods(self, job: str) -> list[Any]:
        """The job's live worker pods (not being deleted), sorted by name."""
        t = self._job_target(job)
        pods = self._call(f"list pods of job {job}", self.core.list_namespaced_pod, t.namespace,
                          label_selector=f"{LABEL_JOB}={t.name}")
        live = [p for p in pods.items if not p.metadata.deletion_timestamp
                and (p.metadata.labels or {}).get(LABEL_JOB) == t.name]
        return sorted(live, key=lambda p: p.metadata.name)

    def job_runtime(self, job: str) -> JobRuntime | None:
        if job not in self.jobs:
            return None
        if self.job_runtime_mode == "coordinator":
            return self._coordinator_runtime(job)
        return self._pods_runtime(job)

    def _pods_runtime(self, job: str) -> JobRuntime | None:
        pods = self.worker_pods(job)
        if not pods:
            return None
        ann = [p.metadata.annotations or {} for p in pods]
        gens = [int(a.get(ANN_GENERATION, 0)) for a in ann]
        gen = max(gens)
        layouts = {_annotated_layout(p, a) for p, a, g in zip(pods, ann, gens, strict=True) if g == gen}
        gpus = tuple(sorted((parse_gpu(a[ANN_GPU]) for a in ann if ANN_GPU in a), key=lambda g: (g.node, g.index)))
        failed = [p.metadata.name for p in pods if p.status is not None and p.status.phase == "Failed"]
        phase = (JobPhase.FAILED if failed
                 else JobPhase.RESCALING if len(layouts) > 1 or len(set(gens)) > 1 else JobPhase.RUNNING)
        with self._lock:
            last = self._jobs.get(job, _Job()).last
        return JobRuntime(job, phase, layouts.pop() if len(layouts) == 1 else None, gpus, gen,
                          error=f"worker pod(s) failed: {', '.join(failed)}" if failed else None,
                          last_pause_seconds=last.pause_seconds if last else None,
                          last_bytes_moved=last.bytes_moved if last else None)

    def _coordinator_runtime(self, job: str) -> JobRuntime | None:
        with self._lock:
            j = self._jobs.get(job)
        if j is None:  # never seen by this process: a previous operator's job, if its coordinator runs
            j = self._adopt_job(job)
        if j is None or j.handle is None:
            return self._orphaned_runtime(job)
        try:
            st = j.handle.status()
        except JobFailed as e:
            if self._coordinator_serving(job):  # slow, not gone: the last reading stands
                log.warning("%s: %s; its coordinator pod still runs, the job's last status stands", job, e)
                return j.seen
            # its coordinator pod is gone: nothing can gather the workers' state again
            log.warning("%s: %s; its worker pods are stopped", job, e)
            with self._lock:  # the next start makes a new coordinator pod
                if self._jobs.get(job) is j:
                    self._jobs.pop(job)
            return self._orphaned_runtime(job)
        if st.phase == CoordinatorPhase.RUNNING:
            j.workers = still_held(j.workers, st.workers)  # after a recovery on its own: fewer
        j.seen = coordinator_runtime(job, st, j.workers, j.last)
        return j.seen

    def _orphaned_runtime(self, job: str) -> JobRuntime | None:
        """Worker pods that run with no coordinator this process can reach: their coordinator pod is
        gone (deleted, or it failed). Their state lives only in their memory, which no coordinator can
        gather again, so they are reported ``Failed`` on the GPUs their annotations name: the controller
        then stops them (their GPUs are on record until their pods are gone, so none is handed out
        twice) and starts the job again, from its newest checkpoint if it keeps any. None when no such
        pod runs."""
        pods = [p for p in self.worker_pods(job)
                if not (p.status is not None and p.status.phase in ("Succeeded", "Failed"))]
        if not pods:
            return None
        ann = [p.metadata.annotations or {} for p in pods]
        gpus = tuple(sorted({parse_gpu(a[ANN_GPU]) for a in ann if ANN_GPU in a}, key=lambda g: (g.node, g.index)))
        gen = max(int(a.get(ANN_GENERATION, 0)) for a in ann)
        layouts = {_annotated_layout(p, a) for p, a in zip(pods, ann, strict=True)
                   if int(a.get(ANN_GENERATION, 0)) == gen}
        names = ", ".join(p.metadata.name for p in pods)
        return JobRuntime(job, JobPhase.FAILED, layouts.pop() if len(layouts) == 1 else None, gpus, gen,
                          error=f"worker pod(s) {names} run without their coordinator: its pod "
                                f"{self.coordinator_pod_name(job)} is gone or not serving, and their in-memory "
                                "state cannot be gathered again; they are stopped and the job starts again, from "
                                "its newest checkpoint if it keeps any")

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> CheckpointOutcome:
        """Coordinator runtime: save ``job``'s state at its next step boundary (``checkpoint_through``)."""
        if self.job_runtime_mode != "coordinator":
            raise BackendError(f"training job {job}: on-demand checkpoints need the coordinator runtime "
                               "(job_runtime_mode='coordinator'); the pods runtime has no coordinator to ask")
        with self._lock:
            j = self._jobs.get(job)
        return checkpoint_through(j.handle if j is not None else None, job, wait_seconds)

    def pause_job(self, spec: TrainingSpec) -> RescaleOutcome:
        """Coordinator runtime: free every GPU of the job and keep its state in keeper pods (the job's
        template without GPU requests or node pinning: CPU and host memory), which hold it at its step
        until ``set_job_gpus`` resumes it in place (see ``JobHandle.pause``)."""
        self._fenced()
        with self._lock:
            j = self._jobs.get(spec.name)
        if j is None or j.handle is None:
            return RescaleOutcome.not_running(spec.name)
        before = j.handle.status()
        if before.phase == CoordinatorPhase.PAUSED:
            return RescaleOutcome.still_paused(spec.name, before.layout, before.generation,
                                               before.step)
        running = before.layout
        if running is None:
            raise BackendError(f"{spec.name}: cannot pause a job that is {before.phase}")
        n = running.held().world_size
        base = self._job_target(spec.name).name
        keepers = [f"{base}-k{j.next_id + i}" for i in range(n)]  # the workers' counter: no name reused
        try:
            res = j.handle.pause(keepers)
        except Exception as e:  # noqa: BLE001 - refused/abandoned: the job trains on, on its GPUs
            raise BackendError(f"{spec.name}: pause of {before.layout} failed: {e}") from e
        with self._lock:
            j.workers, j.next_id = {}, j.next_id + n
        self.remember_job(spec.name, j, keepers=keepers)
        kept = res.to_layout
        self._stamp_generation(spec.name, keepers, res.generation, kept)
        out = RescaleOutcome.from_result(spec.name, running, res, to_layout=kept)
        j.last = out
        return out

    def cancel_grow(self, job: str) -> bool:
        """Coordinator runtime: call off a rescale whose joiner pods have not joined yet.
        The pods runtime creates joiners and returns; there is nothing to call off."""
        if self.job_runtime_mode != "coordinator":
            return False
        with self._lock:
            j = self._jobs.get(job)
        return j is not None and j.handle is not None and j.handle.cancel_pending()

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        self._fenced()
        if gpus and (layout is None or layout.world_size != len(gpus)):
            raise BackendError(f"{spec.name}: layout {layout} does not match {len(gpus)} GPUs")
        if self.job_runtime_mode == "coordinator":
            return self._set_job_coordinator(spec, gpus, layout)
        return self._set_job_pods(spec, gpus, layout)

    # ---- pods runtime ---------------------------------------------------------------------------
    def _set_job_pods(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        """1. delete the leavers and wait until they are gone, 2. apply the headless Service,
        3. create the joiners, 4. stamp the new generation on every worker."""
        before = self._pods_runtime(spec.name)
        pods = self.worker_pods(spec.name)
        by_gpu = {parse_gpu(p.metadata.annotations[ANN_GPU]): p.metadata.name
                  for p in pods if ANN_GPU in (p.metadata.annotations or {})}
        t0 = time.perf_counter()
        # 1. leavers first: their GPUs must be free before anyone else is handed them
        leavers = [name for g, name in by_gpu.items() if g not in gpus]
        leavers += [p.metadata.name for p in pods if ANN_GPU not in (p.metadata.annotations or {})]
        self.delete_pods(spec.name, leavers)
        if not gpus:
            self.delete_worker_service(spec.name)
            with self._lock:
                self._jobs.pop(spec.name, None)
            return RescaleOutcome.stopped(spec.name, before.layout if before else None,
                                          before.generation if before else 0,
                                          total_seconds=time.perf_counter() - t0)
        assert layout is not None
        gen = (before.generation + 1) if before else 1
        # 2. peer DNS
        self.apply_worker_service(spec.name)
        # 3 + 4. joiners get fresh ids; everyone carries the new generation
        next_id = 1 + max([_worker_index(n) for n in by_gpu.values()] + [-1])
        for g in gpus:
            name = by_gpu.get(g)
            if name is None:
                name = f"{self._job_target(spec.name).name}-w{next_id}"
                next_id += 1
            self.apply_worker_pod(spec, name, g, layout, gen, env={})
        out = RescaleOutcome(spec.name, (before.layout if before else None), layout, gen,
                             total_seconds=time.perf_counter() - t0)
        with self._lock:
            self._jobs.setdefault(spec.name, _Job()).last = out
        return out

    # ---- coordinator runtime --------------------------------------------------------------------
    def _set_job_coordinator(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None
                             ) -> RescaleOutcome:
        with self._lock:
            j = self._jobs.get(spec.name)
        if not gpus:
            return self._stop_coordinated(spec, j)
        assert layout is not None
        if j is None or j.handle is None:
            j = j or _Job()
            with self._lock:  # a handle on its way: no adoption of the coordinator pod it creates
                self._jobs[spec.name] = j
                self._adopt_tried.add(spec.name)
            # pods of an earlier run whose coordinator is gone (ended, kept for `kubectl logs`): their
            # names are given out again from 0
            self.delete_pods(spec.name, [p.metadata.name for p in self.worker_pods(spec.name)])
            try:
                j.handle = self._new_handle(spec)
            except Exception:
                with self._lock:
                    self._jobs.pop(spec.name, None)
                self.delete_coordinator(spec.name)
                raise
            self.remember_job(spec.name, j, spec=spec)
        new_workers: dict[GPU, str] = {}
        nxt = j.next_id
        base = self._job_target(spec.name).name
        for g in gpus:
            if g in j.workers:
                new_workers[g] = j.workers[g]
            else:
                new_workers[g] = f"{base}-w{nxt}"
                nxt += 1
        j.handle.placement = {w: (g, layout) for g, w in new_workers.items()}
        # every worker's GPU on record with the coordinator before anything moves: a successor that
        # re-attaches in the middle of this rescale knows where its joiners run
        self.remember_job(spec.name, j, {**j.workers, **new_workers}, nxt, spec=spec)
        st = j.handle.status()
        starting = st.phase == CoordinatorPhase.STARTING and st.generation == 0
        self.apply_worker_service(spec.name)
        try:
            if starting:
                res = j.handle.start(layout, [new_workers[g] for g in gpus])
            else:
                # a shrink returns once the new layout trains and its leavers are gone (see JobHandle.rescale)
                res = j.handle.rescale(layout, [new_workers[g] for g in gpus], wait_first_step=False)
        except RescaleCancelled as e:
            if starting:  # nothing was trained: drop the half-started job (its pods, its handle)
                self._stop_coordinated(spec, j)
            raise GrowCancelled(f"{spec.name}: {'start' if starting else 'rescale'} on {layout} called off: {e}") from e
        except Exception as e:  # noqa: BLE001 - refused/abandoned: surfaced as a failed step
            if starting:
                self._stop_coordinated(spec, j)
            raise BackendError(f"{spec.name}: {'start' if starting else 'rescale'} on {layout} failed: {e}") from e
        with self._lock:
            j.workers, j.next_id = new_workers, nxt
        self.remember_job(spec.name, j, keepers=[])
        self._stamp_generation(spec.name, list(new_workers.values()), res.generation, layout)
        out = RescaleOutcome.from_result(spec.name, st.layout, res, to_layout=layout)
        j.last = out
        return out

    def _stamp_generation(self, job: str, pods: Sequence[str], generation: int, layout: Layout) -> None:
        """Every worker pod of the new layout carries its generation and layout: survivors were created
        under an older one. Best effort: the coordinator, not the annotation, is what the job runs by."""
        ns = self._job_target(job).namespace
        body = {"metadata": {"annotations": {ANN_GENERATION: str(generation), ANN_LAYOUT: str(layout)}}}
        for pod in pods:
            try:
                self._call(f"annotate pod {ns}/{pod}", self.core.patch_namespaced_pod, pod, ns, body,
                           _content_type=MERGE)
            except BackendError as e:
                log.warning("%s: %s", job, e)

    def _new_handle(self, spec: TrainingSpec) -> KubernetesJobHandle:
        # the user's code: its config whatever tunes the reference trainer
        cfg = (self.trainer_config(spec) if self.trainer_config and spec.entrypoint is None
               else default_trainer_config(spec))
        # the coordinator pod mounts no volume of the workers: it starts a job at the newest checkpoint
        # its workers report when they register
        opts = job_options(self.launch_options, spec, coordinator_sees=False)
        client = self.start_coordinator(spec, cfg, opts)
        return KubernetesJobHandle(self, spec, cfg, coordinator=client, options=opts, hardware=self.hardware,
                                   gpus_per_node=self.gpus_per_node)

    def _stop_coordinated(self, spec: TrainingSpec, j: _Job | None) -> RescaleOutcome:
        try:
            st = j.handle.status() if j and j.handle else None
        except JobFailed:  # its coordinator pod is gone: the pods go all the same
            st, j = None, None
        if j is not None and j.handle is not None:
            try:
                j.handle.stop()
            except Exception as e:  # noqa: BLE001 - pods are deleted below regardless
                log.warning("%s: coordinator stop failed: %s", spec.name, e)
        # whatever the coordinator did, no pod of the job may keep its GPU
        self.delete_pods(spec.name, [p.metadata.name for p in self.worker_pods(spec.name)])
        self.delete_coordinator(spec.name)
        self.delete_worker_service(spec.name)
        self.delete_job_secret(spec.name)
        with self._lock:
            self._jobs.pop(spec.name, None)
        if st is None:
            return RescaleOutcome.not_running(spec.name)
        return RescaleOutcome.stopped(spec.name, st.layout, st.generation, st.step)

    # ---- objects we own -------------------------------------------------------------------------
    def worker_pod_manifest(self, spec: TrainingSpec, pod: str, gpu: GPU, layout: Layout, generation: int,
                            env: dict[str, str]) -> dict[str, Any]:
        t = self._job_target(spec.name)
        tpl = t.template
        worker_env = {"ELASTIC_JOB": spec.name, "ELASTIC_WORKER_ID": pod, "ELASTIC_MODEL": spec.model
                      if "/" not in spec.model else "", "ELASTIC_GLOBAL_BATCH": str(spec.global_batch),
                      "ELASTIC_MICRO_BATCH": str(spec.micro_batch), **user_code_env(spec), **env}
        env_list = [{"name": e["name"], "value": e.get("value", "")} for e in tpl.get("env", [])]
        env_list += [{"name": k, "valueFrom": {"secretKeyRef": {"name": self.secret_name(spec.name), "key": SECRET_KEY}}}
                     if k == SECRET_ENV else {"name": k, "value": v} for k, v in worker_env.items() if v]
        resources = {k: dict(v) for k, v in (tpl.get("resources") or {}).items()}
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[GPU_RESOURCE] = "1"
        container: dict[str, Any] = {
            "name": "worker", "image": tpl["image"], "imagePullPolicy": tpl.get("imagePullPolicy", "IfNotPresent"),
            "command": list(tpl.get("command") or ["python", "-m", "elastic.train.worker"]),
            "args": list(tpl.get("args") or []), "env": env_list, "resources": resources,
        }
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",  # a dead worker is the coordinator's business, not the kubelet's
            "subdomain": f"{t.name}-workers", "hostname": pod,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [gpu.node]}]}]}}},
            "containers": [container],
        }
        if tpl.get("serviceAccountName"):
            pod_spec["serviceAccountName"] = tpl["serviceAccountName"]
        if tpl.get("volumes"):  # e.g. the shared volume of the job's checkpoints
            pod_spec["volumes"] = [dict(v) for v in tpl["volumes"]]
        if tpl.get("volumeMounts"):
            container["volumeMounts"] = [dict(m) for m in tpl["volumeMounts"]]
        meta: dict[str, Any] = {
            "name": pod, "namespace": t.namespace,
            "labels": {LABEL_JOB: t.name, LABEL_WORKER: pod, LABEL_MANAGED: self.field_manager},
            "annotations": {ANN_GENERATION: str(generation), ANN_LAYOUT: str(layout), ANN_GPU: str(gpu)},
        }
        if t.uid:
            meta["ownerReferences"] = [{"apiVersion": t.api_version, "kind": t.kind, "name": t.name, "uid": t.uid,
                                        "controller": True, "blockOwnerDeletion": False}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}

    def keeper_pod_manifest(self, spec: TrainingSpec, pod: str, layout: Layout, generation: int,
                            env: dict[str, str]) -> dict[str, Any]:
        """A keeper: the worker pod of the job's template holding a paused job's state in host memory,
        without a GPU (no ``nvidia.com/gpu`` request, no node pinning: any node with the memory will do)."""
        body = self.worker_pod_manifest(spec, pod, GPU("-", 0), layout, generation, env)
        ctr = body["spec"]["containers"][0]
        for kind in ("requests", "limits"):
            ctr["resources"].get(kind, {}).pop(GPU_RESOURCE, None)
        ctr["resources"] = {k: v for k, v in ctr["resources"].items() if v}
        del body["spec"]["affinity"]
        del body["metadata"]["annotations"][ANN_GPU]
        body["metadata"]["labels"][LABEL_KEEPER] = "true"
        return body

    def apply_worker_pod(self, spec: TrainingSpec, pod: str, gpu: GPU | None, layout: Layout, generation: int,
                         env: dict[str, str]) -> None:
        body = (self.keeper_pod_manifest(spec, pod, layout, generation, env) if gpu is None
                else self.worker_pod_manifest(spec, pod, gpu, layout, generation, env))
        self._call(f"apply pod {body['metadata']['namespace']}/{pod}", self.core.patch_namespaced_pod, pod,
                   body["metadata"]["namespace"], body, field_manager=self.field_manager, force=True,
                   _content_type=APPLY)

    def delete_pods(self, job: str, names: Sequence[str]) -> None:
        """Delete ``names`` and wait (bounded) until the API no longer lists them: their GPUs are free."""
        from kubernetes.client.exceptions import ApiException

        if not names:
            return
        ns = self._job_target(job).namespace
        for n in names:
            try:
                self.core.delete_namespaced_pod(n, ns, grace_period_seconds=30)
            except ApiException as e:
                if e.status != 404:
                    raise BackendError(f"{job}: delete pod {ns}/{n}: HTTP {e.status} {e.reason}") from e
            except OSError as e:
                raise BackendUnavailable(f"Kubernetes API unreachable deleting pod {ns}/{n}: {e}") from e
        deadline = time.monotonic() + self.pod_gone_wait_seconds
        pending = set(names)
        while pending:
            pending &= {p.metadata.name for p in self.worker_pods_including_deleting(job)}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise BackendError(f"{job}: pods {sorted(pending)} still exist {self.pod_gone_wait_seconds:g} s "
                                   "after deletion; their GPUs are not free yet")
            time.sleep(self.poll_seconds)

    def worker_pods_including_deleting(self, job: str) -> list[Any]:
        t = self._job_target(job)
        pods = self._call(f"list pods of job {job}", self.core.list_namespaced_pod, t.namespace,
                          label_selector=f"{LABEL_JOB}={t.name}")
        return [p for p in pods.items if (p.metadata.labels or {}).get(LABEL_JOB) == t.name]

    def worker_service_manifest(self, job: str) -> dict[str, Any]:
        t = self._job_target(job)
        meta: dict[str, Any] = {"name": f"{t.name}-workers", "namespace": t.namespace,
                                "labels": {LABEL_JOB: t.name, LABEL_MANAGED: self.field_manager}}
        if t.uid:
            meta["ownerReferences"] = [{"apiVersion": t.api_version, "kind": t.kind, "name": t.name, "uid": t.uid,
                                        "controller": True, "blockOwnerDeletion": False}]
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LABEL_JOB: t.name},
                         "ports": [{"name": "rendezvous", "port": 29500, "targetPort": 29500}]}}

    def apply_worker_service(self, job: str) -> None:
        body = self.worker_service_manifest(job)
        m = body["metadata"]
        self._call(f"apply service {m['namespace']}/{m['name']}", self.core.patch_namespaced_service, m["name"],
                   m["namespace"], body, field_manager=self.field_manager, force=True, _content_type=APPLY)

    def secret_name(self, job: str) -> str:
        return f"{self._job_target(job).name}-rendezvous"

    def apply_job_secret(self, job: str, secret: str) -> None:
        """The Secret holding the job's coordinator secret (``ELASTIC_JOB_SECRET`` of its pods), owned
        by the job's resource so that it goes with it."""
        t = self._job_target(job)
        meta: dict[str, Any] = {"name": self.secret_name(job), "namespace": t.namespace,
                                "labels": {LABEL_JOB: t.name, LABEL_MANAGED: self.field_manager}}
        if t.uid:
            meta["ownerReferences"] = [{"apiVersion": t.api_version, "kind": t.kind, "name": t.name, "uid": t.uid,
                                        "controller": True, "blockOwnerDeletion": False}]
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
                "data": {SECRET_KEY: base64.b64encode(secret.encode()).decode()}}
        self._call(f"apply secret {t.namespace}/{meta['name']}", self.core.patch_namespaced_secret, meta["name"],
                   t.namespace, body, field_manager=self.field_manager, force=True, _content_type=APPLY)

    def delete_job_secret(self, job: str) -> None:
        t = self._job_target(job)
        self._delete(f"{job}: delete secret {t.namespace}/{self.secret_name(job)}", self.core.delete_namespaced_secret,
                     self.secret_name(job), t.namespace)

    def delete_worker_service(self, job: str) -> None:
        t = self._job_target(job)
        self._delete(f"{job}: delete service {t.namespace}/{t.name}-workers", self.core.delete_namespaced_service,
                     f"{t.name}-workers", t.namespace)

    def release_job(self, job: str) -> int:
        """Finalizer path: stop the job and delete every worker pod and its Service. Returns pods deleted."""
        if job not in self.jobs:
            return 0
        pods = [p.metadata.name for p in self.worker_pods(job)]
        with self._lock:
            j = self._jobs.get(job)
        if j is not None and j.handle is not None:
            try:
                j.handle.stop()
            except Exception as e:  # noqa: BLE001 - the pods go regardless
                log.warning("%s: coordinator stop failed: %s", job, e)
        self.delete_pods(job, pods)
        self.delete_coordinator(job)
        self.delete_worker_service(job)
        self.delete_job_secret(job)
        with self._lock:
            self._jobs.pop(job, None)
        return len(pods)


def user_code_env(spec: TrainingSpec) -> dict[str, str]:
    """What makes ``python -m elastic.train.worker`` run a user job's own code: ``ELASTIC_ENTRYPOINT``
    and ``ELASTIC_ARGS`` (a JSON list); empty for the reference trainer."""
    if spec.entrypoint is None:
        return {}
    return {"ELASTIC_ENTRYPOINT": spec.entrypoint, "ELASTIC_ARGS": json.dumps(list(spec.args))}


def _annotated_layout(pod: Any, ann: dict[str, str]) -> Layout | None:
    """The layout a worker pod's annotation names; None without one, or with one edited out of shape (the
    annotation is best effort: the coordinator, not the pod, is what the job runs by)."""
    try:
        return layout_of(ann.get(ANN_LAYOUT))
    except SpecError as e:
        log.warning("pod %s: annotation %s: %s; its layout is not known", pod.metadata.name, ANN_LAYOUT, e)
        return None


def _worker_index(pod: str) -> int:
    tail = pod.rsplit("-w", 1)[-1]
    return int(tail) if tail.isdigit() else -1


# --------------------------------------------------------------------------------------------
# In-place rescale through the trainer's coordinator, workers as pods
# --------------------------------------------------------------------------------------------


class KubernetesJobHandle(JobHandle):
    """A ``JobHandle`` whose workers are pods and whose coordinator is the job's coordinator pod
    (``coordinator``: its client): ``_spawn`` applies the pod (on the node the allocation chose, with
    the worker's env pointing at the coordinator pod), ``_exit_reason`` reads the pod's phase,
    ``_kill`` deletes it. ``placement`` (worker -> (GPU, layout)) is set by the backend before each
    start/rescale."""

    def __init__(self, backend: KubernetesBackend, spec: TrainingSpec, cfg: Any, *, coordinator: Any,
                 **kw: Any) -> None:
        super().__init__(spec.name, cfg, coordinator=coordinator, **kw)
        self.backend = backend
        self.spec = spec
        self.placement: dict[str, tuple[GPU, Layout]] = {}

    def _spawn(self, worker: str, env: dict[str, str]) -> None:
        gen = self.coordinator.status().generation + 1
        env = {k: v for k, v in env.items() if k not in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}
        if env.get("ELASTIC_KEEPER") == "1":  # holds a paused job's state: no GPU, on any node
            st = self.coordinator.status()
            held = st.layout.held() if st.layout is not None else Layout(1, 1, 1)
            self.backend.apply_worker_pod(self.spec, worker, None, held, gen, env)
            return
        gpu, layout = self.placement[worker]
        self.backend.apply_worker_pod(self.spec, worker, gpu, layout, gen, env)

    def _exit_reason(self, worker: str) -> str | None:
        from kubernetes.client.exceptions import ApiException

        t = self.backend._job_target(self.spec.name)
        try:
            pod = self.backend.core.read_namespaced_pod(worker, t.namespace)
        except ApiException as e:
            if e.status == 404:
                return "pod was deleted"
            return None  # cannot tell now: treat as running, the heartbeat timeout catches a real loss
        except OSError:
            return None
        return _pod_exit_reason(pod)

    def _exit_reasons(self, workers: Sequence[str]) -> dict[str, str | None]:
        """Several workers: one list of the job's pods (the watcher and a rescale's wait for its
        leavers poll every few ms; a read per pod would be that many requests to the API server)."""
        if len(workers) < 2:
            return super()._exit_reasons(workers)
        try:  # the workers were all created before this list: one missing from it is gone
            pods = {p.metadata.name: p for p in self.backend.worker_pods_including_deleting(self.spec.name)}
        except BackendError:
            return dict.fromkeys(workers)  # cannot tell now, as for one pod
        return {w: "pod was deleted" if w not in pods else _pod_exit_reason(pods[w]) for w in workers}

    def _kill(self, worker: str) -> None:
        from kubernetes.client.exceptions import ApiException

        t = self.backend._job_target(self.spec.name)
        try:
            self.backend.core.delete_namespaced_pod(worker, t.namespace, grace_period_seconds=0)
        except (ApiException, OSError):
            pass

    def _reap(self, worker: str) -> None:
        """A worker that ended with exit code 0 (a leaver once its bytes landed, a stopped worker) has its
        pod deleted: it is done. A failed pod stays for ``kubectl logs``/``describe`` until the job
        stops; a terminated pod holds no GPU either way."""
        from kubernetes.client.exceptions import ApiException

        t = self.backend._job_target(self.spec.name)
        try:
            pod = self.backend.core.read_namespaced_pod(worker, t.namespace)
            if pod.status is not None and pod.status.phase == "Succeeded":
                self.backend.core.delete_namespaced_pod(worker, t.namespace)
        except (ApiException, OSError):
            pass

    def _after_gone(self, workers: Sequence[str], timeout: float) -> None:
        """Wait (bounded) until no pod of ``workers`` still runs (gone, or ended): the kube-scheduler
        may then give their GPUs to someone else."""
        deadline = time.monotonic() + timeout
        pending = set(workers)
        while pending:
            pods = {p.metadata.name: p for p in self.backend.worker_pods_including_deleting(self.spec.name)}
            pending = {w for w in pending if w in pods and not (
                pods[w].status is not None and pods[w].status.phase in ("Succeeded", "Failed"))}
            if not pending:
                return
            if time.monotonic() > deadline:
                log.warning("job %s: pod(s) %s still running %.0f s after leaving", self.job, sorted(pending), timeout)
                return
            time.sleep(self.backend.poll_seconds)


def _pod_exit_reason(pod: Any) -> str | None:
    """Why a worker pod's container ended; None while it runs."""
    phase = pod.status.phase if pod.status else None
    if phase not in ("Succeeded", "Failed"):
        return None
    for cs in (pod.status.container_statuses or []):
        term = cs.state.terminated if cs.state else None
        if term is not None:
            return f"pod {phase.lower()} (exit code {term.exit_code}{', ' + term.reason if term.reason else ''})"
    return f"pod {phase.lower()}"
