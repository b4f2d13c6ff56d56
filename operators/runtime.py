"""The operator's state: registered custom resources, one controller per GPUPool, status publishing.

What it is for: Kopf handlers (``operators.main``) call in here. ``set_pool`` / ``set_service`` /
``set_job`` validate a CR (``elastic.crds``), register its spec and say so in its ``Ready``
condition; ``tick_pool`` is one reconcile cycle of a pool:

1. observe   the pool's nodes (``KubernetesBackend.inventory``) and its registered members;
2. build     the ``ControllerConfig`` (rebuilt only when a spec or the node count changed,
             carrying the policy state over) and the backend's targets;
3. tick      ``Controller.tick()``: decide and apply (the DB lease makes one replica act);
4. publish   status fields, conditions and Events carrying the controller's reasons.

A job's start and grow run in the background (``Controller(async_grow=True)``): waiting for its
pods to start and register (up to the launcher's ``register_timeout_s``, two minutes by default)
must not hold the pool's cycle, so its services go on scaling, status goes on being published and
a finalizer does not wait for it (it calls a start still starting its pods off). The GPUs of a grow in flight stay reserved for it; its outcome is read on a later
cycle: a landed grow posts its Normal Event then, a failed first start backs off as a synchronous
one would (below). A rebuilt controller (a spec or membership change) takes over the grows in
flight and the pool's lease from the one it replaces.

A refused spec never reaches the controller: a new bad CR is not registered; a bad update
keeps the last good spec running. ``remove_job`` (the finalizer) deletes the job's pods. A job
whose start fails (its pods exit at once, say) sits out the pool's cycles on a doubling back-off
(``Ready=False``/``StartFailed``); a Deployment with fewer ready replicas than the pool gives it
for longer than ``startupSeconds`` shows ``Ready=False``/``ReplicasNotReady`` naming each pod's
trouble. An InferenceService opts in to draining replicas before a scale-down with the
annotation ``elastic.dev/drain`` (see ``drain_options``).

What it must not do: talk Kopf (handlers do), or decide anything itself (the controller does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from elastic import store as db
from elastic.backends.base import BackendError
from elastic.backends.kubernetes import GPU_RESOURCE, JobTarget, KubernetesBackend, ServiceTarget, parse_gpu
from elastic.config import ControllerConfig, ControllerSettings
from elastic.controller import Controller, TickResult, throughput_table
from elastic.crds import (
    GROUP,
    VERSION,
    CRError,
    ElasticTrainingJobSpec,
    GPUPoolSpec,
    InferenceServiceSpec,
    parse_spec,
    to_inference_spec,
    to_pool_spec,
    to_training_spec,
)
from elastic.metrics import build_source
from elastic.metrics.sample import MetricSource
from elastic.model import InferenceSpec, SpecError, load_hardware, load_model
from elastic.phases import JobPhase
from elastic.reasons import ResourceReason, TickReason
from operators.members import JOBS, POOLS, SERVICES, Grow, Member, Pool
from operators.publish import Publishing
from operators.status import StatusWriter

log = logging.getLogger("operators.runtime")



@dataclass(frozen=True)
class OperatorSettings:
    """Read from the environment (the ConfigMap ``elastic-operator`` in ``manifests/``)."""

    db_url: str = "sqlite:///./elastic-operator.db"
    instance: str = "elastic-operator"  # POD_NAME: lease owner and Event reportingInstance
    job_runtime: str = "coordinator"
    field_manager: str = "elastic-operator"
    timer_seconds: float = 1.0
    api_port: int = 8000
    metrics_max_age_seconds: float = 30.0
    lease_seconds: float = 15.0
    wait_seconds: float = 120.0
    model_dir: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        e = dict(os.environ if env is None else env)
        return cls(
            db_url=e.get("ELASTIC_DB_URL") or cls.db_url, instance=e.get("POD_NAME") or cls.instance,
            job_runtime=e.get("ELASTIC_JOB_RUNTIME") or cls.job_runtime,
            field_manager=e.get("ELASTIC_FIELD_MANAGER") or cls.field_manager,
            timer_seconds=float(e.get("ELASTIC_OPERATOR_TIMER_SECONDS") or cls.timer_seconds),
            api_port=int(e.get("ELASTIC_API_PORT") or cls.api_port),
            metrics_max_age_seconds=float(e.get("ELASTIC_METRICS_MAX_AGE_SECONDS") or cls.metrics_max_age_seconds),
            lease_seconds=float(e.get("ELASTIC_LEASE_SECONDS") or cls.lease_seconds),
            wait_seconds=float(e.get("ELASTIC_BACKEND_WAIT_SECONDS") or cls.wait_seconds),
            model_dir=e.get("ELASTIC_MODEL_DIR") or None,
        )



SourceFactory = Callable[[InferenceSpec, KubernetesBackend], MetricSource]


def default_source(spec: InferenceSpec, backend: KubernetesBackend) -> MetricSource:
    """Prometheus when the metric names one, else a direct scrape of the Deployment's ready pods."""
    assert spec.metric is not None
    return build_source(spec.metric, targets=lambda svc: backend.service_targets(svc))


class OperatorRuntime(Publishing):
    """See module docstring. Thread-safe: Kopf runs sync handlers in worker threads."""

    def __init__(self, settings: OperatorSettings | None = None, *, api_client: Any = None,
                 source_factory: SourceFactory = default_source, clock: Callable[[], float] = time.time,
                 backend_options: dict[str, Any] | None = None) -> None:
        self.settings = settings or OperatorSettings.from_env()
        # extra ``KubernetesBackend`` keywords (launch options, trainer config): embedding and tests
        self.backend_options = dict(backend_options or {})
        self.api_client = api_client
        self.source_factory = source_factory
        self.clock = clock
        self.pools: dict[str, Pool] = {}
        self.members: dict[tuple[str, str, str], Member] = {}
        self.rejected: dict[tuple[str, str, str], tuple[CRError, dict[str, Any], int, str | None]] = {}
        self.store: db.Store | None = None
        self.status: StatusWriter | None = None
        self._throughput: dict[str, Any] = {}
        self._annotations: dict[tuple[str, str, str], dict[str, str]] = {}
        self._lock = threading.RLock()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to the API and the DB (migrating it): called from Kopf's startup handler."""
        from kubernetes import client, config

        if self.api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.api_client = client.ApiClient()
        db.upgrade(self.settings.db_url)
        self.store = db.Store.from_url(self.settings.db_url)
        self.status = StatusWriter(self.api_client, instance=self.settings.instance)

    def stop(self) -> None:
        with self._lock:
            for p in self.pools.values():
                if p.controller is not None and p.controller.is_leader and self.store is not None:
                    db.release_lease(self.store, p.name, self.settings.instance)
        if self.store is not None:
            self.store.dispose()

    def _backend(self, cr: GPUPoolSpec) -> KubernetesBackend:
        s = self.settings
        return KubernetesBackend(node_selector=cr.node_selector, gpus_per_node=cr.gpus_per_node,
                                 api_client=self.api_client, field_manager=s.field_manager, job_runtime=s.job_runtime,
                                 hardware=cr.hardware,
                                 scale_down_wait_seconds=s.wait_seconds, pod_gone_wait_seconds=s.wait_seconds,
                                 **self.backend_options)

    # ---- registration (Kopf create/update/resume handlers) -------------------------------------
    def set_pool(self, name: str, spec: dict[str, Any], uid: str | None, generation: int,
                 status: dict[str, Any] | None = None) -> None:
        assert self.status is not None
        self.status.seed(POOLS, None, name, status)
        try:
            cr = parse_spec(GPUPoolSpec, spec)
            to_pool_spec(name, cr, 1)
        except CRError as e:
            self._refuse(POOLS, None, name, uid, generation, e)
            return
        with self._lock:
            old = self.pools.get(name)
            if old is not None and old.cr == cr:
                old.generation = generation
                return
            pool = Pool(name, uid, generation, cr, self._backend(cr))
            if old is not None:  # a changed selector or GPU count: a fresh backend, same registrations
                pool.backend.booked = dict(old.backend.booked)
                pool.backend._jobs = old.backend._jobs
                # one cycle at a time across the swap; the next cycle rebuilds the controller from
                # the old one (its lease, its grows in flight); a back-off runs on
                pool.lock, pool.controller, pool.backoff, pool.growing = old.lock, old.controller, old.backoff, \
                    old.growing
            self.pools[name] = pool
            waiting = [m for m in self.members.values() if m.pool == name] if old is None else []
        self.status.set_condition(POOLS, None, name, "Ready", True, ResourceReason.ACCEPTED,
                                  "spec accepted; reconciling", generation)
        for m in waiting:  # registered before their pool existed: Ready=False/PoolNotFound until now
            self._pool_found(pool, m)

    def _pool_found(self, pool: Pool, m: Member) -> None:
        """A member registered before its pool: its GPUs on record (a service's ``status.gpus``, after
        an operator restart) are booked now, and its ``PoolNotFound`` condition goes."""
        assert self.status is not None
        if m.plural == SERVICES:
            booked = tuple(parse_gpu(g) for g in self.status.known(SERVICES, m.namespace, m.name).get("gpus", [])
                           if "/" in g)
            if booked:
                with pool.lock:
                    pool.backend.set_service(m.workload, ServiceTarget(m.namespace, m.cr.scale_target_ref.name),
                                             booked)
        was = next((c for c in self.status.conditions(m.plural, m.namespace, m.name) if c.get("type") == "Ready"), {})
        if was.get("reason") == ResourceReason.POOL_NOT_FOUND:
            self.status.set_condition(m.plural, m.namespace, m.name, "Ready", True, ResourceReason.ACCEPTED,
                                      f"spec accepted by pool {m.pool}", m.generation)

    def remove_pool(self, name: str) -> None:
        with self._lock:
            pool = self.pools.pop(name, None)
        if pool is not None and pool.controller is not None and self.store is not None:
            db.release_lease(self.store, name, self.settings.instance)
        if self.status is not None:
            self.status.forget(POOLS, None, name)

    def set_service(self, namespace: str, name: str, spec: dict[str, Any], uid: str | None, generation: int,
                    status: dict[str, Any] | None = None, *, annotations: dict[str, str] | None = None) -> None:
        assert self.status is not None
        self.status.seed(SERVICES, namespace, name, status)
        try:
            cr = parse_spec(InferenceServiceSpec, spec)
            isvc = to_inference_spec(f"{namespace}/{name}", cr)
            self._check_scale_target(namespace, cr)
            if annotations is not None:  # a retry of a refused spec keeps the annotations it was given
                self._annotations[(SERVICES, namespace, name)] = dict(annotations)
            options = drain_options(self._annotations.get((SERVICES, namespace, name), {}))
            if cr.drain_ahead_seconds > 0 and not options["drain"]:
                raise CRError("spec.drainAheadSeconds", "InvalidDrainAhead",
                              f"drainAheadSeconds={cr.drain_ahead_seconds:g} needs the annotation {ANN_DRAIN}: \"true\" "
                              "(and a Service selecting elastic.dev/serving: \"true\"); add it or set 0")
        except CRError as e:
            self._refuse(SERVICES, namespace, name, uid, generation, e, spec=spec)
            return
        booked = tuple(parse_gpu(g) for g in (status or {}).get("gpus", []) if "/" in g)
        self._register(Member(SERVICES, namespace, name, uid, generation, cr.pool, cr, isvc, options), booked)

    def set_job(self, namespace: str, name: str, spec: dict[str, Any], uid: str | None, generation: int,
                status: dict[str, Any] | None = None) -> None:
        assert self.status is not None
        self.status.seed(JOBS, namespace, name, status)
        try:
            cr = parse_spec(ElasticTrainingJobSpec, spec)
            tspec = to_training_spec(f"{namespace}/{name}", cr, self.settings.model_dir)
            load_model(tspec.model)
            _check_template_gpus(cr)
        except CRError as e:
            self._refuse(JOBS, namespace, name, uid, generation, e, spec=spec)
            return
        except SpecError as e:
            self._refuse(JOBS, namespace, name, uid, generation, CRError("spec.model", "InvalidModel", str(e)))
            return
        self._register(Member(JOBS, namespace, name, uid, generation, cr.pool, cr, tspec))

    def _check_scale_target(self, namespace: str, cr: InferenceServiceSpec) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        ref = cr.scale_target_ref
        if ref.api_version != "apps/v1":
            raise CRError("spec.scaleTargetRef.apiVersion", "InvalidScaleTargetRef",
                          f"apiVersion '{ref.api_version}' is not supported; use apps/v1 (a Deployment)")
        try:
            client.AppsV1Api(self.api_client).read_namespaced_deployment(ref.name, namespace)
        except ApiException as e:
            if e.status == 404:
                raise CRError("spec.scaleTargetRef", "InvalidScaleTargetRef",
                              f"Deployment {namespace}/{ref.name} not found; create it or fix scaleTargetRef.name"
                              ) from None
            raise CRError("spec.scaleTargetRef", ResourceReason.SCALE_TARGET_UNREADABLE,
                          f"cannot read Deployment {namespace}/{ref.name}: HTTP {e.status} {e.reason}") from None

    def _register(self, m: Member, booked: tuple[Any, ...] = ()) -> None:
        assert self.status is not None
        key = (m.plural, m.namespace, m.name)
        with self._lock:
            self.rejected.pop(key, None)
            self.members[key] = m
            pool = self.pools.get(m.pool)
            if pool is not None and booked and m.plural == SERVICES:
                pool.backend.set_service(m.workload, ServiceTarget(m.namespace, m.cr.scale_target_ref.name), booked)
        if pool is None:
            self.status.set_condition(m.plural, m.namespace, m.name, "Ready", False, ResourceReason.POOL_NOT_FOUND,
                                      f"spec.pool: GPUPool '{m.pool}' does not exist (yet)", m.generation)
        else:
            self.status.set_condition(m.plural, m.namespace, m.name, "Ready", True, ResourceReason.ACCEPTED,
                                      f"spec accepted by pool {m.pool}", m.generation)

    def _refuse(self, plural: str, namespace: str | None, name: str, uid: str | None, generation: int, e: CRError,
                spec: dict[str, Any] | None = None) -> None:
        """Ready=False naming the field; an earlier good spec (if any) keeps running unchanged."""
        assert self.status is not None
        key = (plural, namespace or "", name)
        with self._lock:
            self.rejected[key] = (e, dict(spec or {}), generation, uid)
            kept = key in self.members
        note = str(e) + ("; the previous spec keeps running" if kept else "")
        flipped = self.status.set_condition(plural, namespace, name, "Ready", False, e.reason, note, generation)
        if flipped:
            self.status.event(plural, namespace, name, uid, type_="Warning", reason=e.reason, note=note,
                              action="Validate")
        log.warning("%s %s/%s refused: %s", plural, namespace, name, note)

    def remove_service(self, namespace: str, name: str) -> None:
        """The Deployment is the user's: it keeps its replicas; the pool stops booking GPUs for it."""
        key = (SERVICES, namespace, name)
        with self._lock:
            m = self.members.pop(key, None)
            self.rejected.pop(key, None)
            pool = self.pools.get(m.pool) if m else None
        if m is not None and pool is not None:
            with pool.lock:
                pool.backend.forget(m.workload)
                pool.config_key = None
        if self.status is not None:
            self.status.forget(SERVICES, namespace, name)

    def remove_job(self, namespace: str, name: str) -> int:
        """Finalizer: delete the job's worker pods and Service (its GPUs are free after). Returns pods deleted."""
        key = (JOBS, namespace, name)
        with self._lock:
            m = self.members.get(key)
            self.rejected.pop(key, None)
            pool = self.pools.get(m.pool) if m else None
        deleted = 0
        workload = f"{namespace}/{name}"
        backend = pool.backend if pool is not None else self._backend(GPUPoolSpec())
        lock = pool.lock if pool is not None else threading.RLock()
        with lock:  # never in the middle of a tick of this pool
            if pool is not None:
                self._call_off_grow(pool, workload)
            if workload not in backend.jobs:
                backend.set_job(workload, JobTarget(namespace, name, {"image": "-"}, None))
            deleted = backend.release_job(workload)
            backend.forget(workload)
            with self._lock:  # before the next cycle: it must not start the job again
                self.members.pop(key, None)
            if pool is not None:
                pool.config_key = None
        if self.status is not None:
            self.status.forget(JOBS, namespace, name)
        return deleted

    def _call_off_grow(self, pool: Pool, workload: str) -> None:
        """A start or grow of the job still starting its pods is called off and waited for (bounded),
        so that no pod of it is created after the finalizer listed the job's pods. One past its
        directive is not waited for: its pods all exist, and stopping the job ends it."""
        g = pool.growing.get(workload)
        if g is None or not g.running:
            return
        try:
            called_off = pool.backend.cancel_grow(workload)
        except BackendError as e:
            log.warning("%s: could not call its start off: %s", workload, e)
            return
        if called_off:
            g.thread.join(self.settings.wait_seconds)
            if g.running:
                log.warning("%s: its start was called off and has not ended within %g s; deleting its pods anyway",
                            workload, self.settings.wait_seconds)

    # ---- one reconcile cycle of a pool (Kopf timer) ---------------------------------------------
    def tick_pool(self, name: str, *, force: bool = False) -> TickResult | None:
        with self._lock:
            pool = self.pools.get(name)
        if pool is None or self.store is None:
            return None
        with pool.lock:
            now = self.clock()
            if not force and now - pool.last_tick < pool.cr.tick_seconds:
                return None
            pool.last_tick = now
            self._retry_rejected(name)
            # 1. observe
            try:
                nodes = pool.backend.inventory()
            except BackendError as e:
                self._pool_not_ready(pool, TickReason.UNAVAILABLE, str(e))
                return None
            if not nodes:
                sel = ",".join(f"{k}={v}" for k, v in pool.cr.node_selector.items()) or "<none>"
                self._pool_not_ready(pool, ResourceReason.NO_NODES,
                                     f"spec.nodeSelector: no schedulable node matches {sel} with allocatable "
                                     "nvidia.com/gpu")
                return None
            if not pool.synced and not self._synced(pool):
                return None
            # 2. build (a job backing off after a failed start sits this cycle out, one whose start
            #    failed in the background since the last cycle included)
            members = self._members_of(name)
            landed = self._landed(pool, members, now)
            waiting = {w for w, (at, _, _) in pool.backoff.items() if now < at}
            ctl = self._controller(pool, len(nodes), [m for m in members if m.workload not in waiting])
            # 3. tick
            res = ctl.tick()
            self._track_grows(pool, ctl, res)
            # 4. publish
            self._back_off(pool, res, members, now)
            res = _with_landed(res, landed)
            self._publish(pool, ctl, res, nodes, members, landed)
            ctl.housekeep()  # retention: the lease holder only, between ticks, in bounded batches
            return res

    def _back_off(self, pool: Pool, res: TickResult, members: list[Member], now: float) -> None:
        """A failed start of a job (``"<action> <workload>: <why>"`` while it holds no GPU) puts it on
        back-off: 5 s, doubling up to 5 min; a later cycle that applies a step to it clears it. A
        start that runs in the background reports here through ``_landed``, a cycle later."""
        for m in members:
            if m.plural != JOBS:
                continue
            prefix = f" {m.workload}: "
            failed = res.error and prefix in res.error and res.error.split(prefix, 1)[0].endswith("_training")
            if failed:
                self._failed_start(pool, m, str(res.error).split(prefix, 1)[1], now)
            elif m.workload in pool.backoff and now >= pool.backoff[m.workload][0] and (
                    any(a.endswith(f" {m.workload}") for a in res.applied)):
                pool.backoff.pop(m.workload, None)

    @staticmethod
    def _failed_start(pool: Pool, m: Member, why: str, now: float) -> None:
        # only a job that holds no GPU: one that runs stays the controller's to shrink or stop
        if pool.backend.job_runtime(m.workload) is not None:
            return
        last = pool.backoff.get(m.workload)
        wait = min(last[1] * 2, 300.0) if last else 5.0
        pool.backoff[m.workload] = (now + wait, wait, why)

    def _track_grows(self, pool: Pool, ctl: Controller, res: TickResult) -> None:
        """Remember each start or grow this tick left running in the background, with its plan step."""
        steps = {st.workload: st for st in (res.plan.steps if res.plan else ()) if st.action == "grow_training"}
        started = {a.split(" ")[1] for a in res.applied if a.startswith("grow_training ") and a.endswith(" (started)")}
        for job, (thread, errors) in ctl.grows_in_flight().items():
            g = pool.growing.get(job)
            if g is not None and g.thread is thread:
                continue
            # one started this tick may have ended already (pods that exit at once); an older one that
            # ended was read by ``_landed`` (the controller forgets it only when it next observes the job)
            if thread.is_alive() or job in started:
                pool.growing[job] = Grow(thread, errors, steps.get(job))

    def _landed(self, pool: Pool, members: list[Member], now: float) -> dict[str, tuple[Grow, str | None]]:
        """The starts and grows that ended since the last cycle: job -> (grow, why it failed or None).
        A failed one of a job left holding no GPU (a first start) backs off as a synchronous failure
        does; one that left the job running clears its back-off. One called off, or of a job no
        longer registered, is only forgotten."""
        jobs = {m.workload: m for m in members if m.plural == JOBS}
        out: dict[str, tuple[Grow, str | None]] = {}
        for job, g in list(pool.growing.items()):
            if g.running:
                continue
            del pool.growing[job]
            m = jobs.get(job)
            if m is None:
                continue
            if g.errors:
                self._failed_start(pool, m, g.errors[-1], now)
                out[job] = (g, g.errors[-1])
                continue
            try:
                rt = pool.backend.job_runtime(job)
            except BackendError:
                rt = None
            if rt is not None and rt.gpus and rt.phase != JobPhase.FAILED:
                pool.backoff.pop(job, None)
                out[job] = (g, None)
        return out

    def _synced(self, pool: Pool) -> bool:
        """Whether every InferenceService and ElasticTrainingJob of ``pool`` that the API server
        lists is registered or refused here; once it is, the pool is synced for good (a resource
        created later is registered by its create handler). A restarted operator's first cycle
        could otherwise plan without a service whose resume handler has not run yet, and start or
        grow a job onto GPUs that service holds."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(self.api_client)
        missing = []
        try:
            for plural in (SERVICES, JOBS):
                for obj in api.list_cluster_custom_object(GROUP, VERSION, plural).get("items", []):
                    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
                    if spec.get("pool") != pool.name or meta.get("deletionTimestamp"):
                        continue
                    key = (plural, meta.get("namespace"), meta.get("name"))
                    with self._lock:
                        known = key in self.members or key in self.rejected
                    if not known:
                        missing.append(f"{plural}/{key[1]}/{key[2]}")
        except ApiException as e:
            self._pool_not_ready(pool, TickReason.UNAVAILABLE,
                                 f"cannot list the pool's services and jobs: HTTP {e.status} {e.reason}")
            return False
        if missing:
            self._pool_not_ready(pool, ResourceReason.WAITING_FOR_MEMBERS,
                                 f"waiting for {len(missing)} resource(s) of the pool to be registered: "
                                 + ", ".join(sorted(missing)[:5]))
            return False
        pool.synced = True
        return True

    def _members_of(self, pool: str) -> list[Member]:
        with self._lock:
            return sorted((m for m in self.members.values() if m.pool == pool), key=lambda m: (m.plural, m.workload))

    def _retry_rejected(self, pool: str) -> None:
        """A missing Deployment may appear later: re-check those services each cycle."""
        with self._lock:
            waiting = [(k, v) for k, v in self.rejected.items()
                       if k[0] == SERVICES and v[0].reason == "InvalidScaleTargetRef"]
        for (_, ns, name), (_, spec, gen, uid) in waiting:
            if spec.get("pool") == pool:
                self.set_service(ns, name, spec, uid, gen)

    def _controller(self, pool: Pool, n_nodes: int, members: list[Member]) -> Controller:
        """Build (or reuse) the pool's controller for these members; refuse what cannot fit."""
        assert self.store is not None
        pool_spec = to_pool_spec(pool.name, pool.cr, n_nodes)
        services = [m for m in members if m.plural == SERVICES]
        jobs = [m for m in members if m.plural == JOBS]
        cfg, pool.unschedulable = self._fit(pool_spec, services, jobs)
        # the worker template and the Deployment name are not in the controller's config: key on them too
        targets = [(m.workload, m.cr.model_dump(mode="json", by_alias=True), m.options) for m in members]
        key = json.dumps([cfg.model_dump(mode="json"), targets], sort_keys=True)
        old = pool.controller
        if old is not None and key == pool.config_key:
            self._sync_overrides(old, services)
            return old
        # targets first: the controller's constructor and its first tick read the backend
        live = {m.workload for m in members if m.workload not in pool.unschedulable}
        for m in members:
            if m.workload not in live:
                continue
            if m.plural == SERVICES:
                pool.backend.set_service(m.workload, ServiceTarget(
                    m.namespace, m.cr.scale_target_ref.name, gpus_per_replica=m.spec.gpus_per_replica, **m.options))
            else:
                pool.backend.set_job(m.workload, JobTarget(m.namespace, m.name, m.cr.template.model_dump(
                    by_alias=True, exclude_none=True), m.uid))
        hw = load_hardware(pool_spec.hardware)
        throughput = {}
        for j in cfg.jobs:
            tkey = json.dumps([pool_spec.model_dump(mode="json"), j.model_dump(mode="json")], sort_keys=True)
            if tkey not in self._throughput:
                self._throughput[tkey] = throughput_table(
                    load_model(j.model), hw, min(j.max_gpus, pool_spec.total_gpus),
                    gpus_per_node=pool_spec.gpus_per_node, **j.planner_options())
            throughput[j.name] = self._throughput[tkey]
        sources = {s.name: self.source_factory(s, pool.backend) for s in cfg.services}
        # a start or grow waits for pods to start (up to wait_seconds): in the background, not in the
        # pool's cycle (see the module docstring)
        ctl = Controller(cfg, pool.backend, self.store, sources, owner=self.settings.instance, clock=self.clock,
                         throughput=throughput, async_grow=True)
        if old is not None:
            ctl.take_over(old)
        self._sync_overrides(ctl, services)
        pool.controller, pool.config_key = ctl, key
        return ctl

    def _fit(self, pool_spec: Any, services: list[Member], jobs: list[Member]
             ) -> tuple[ControllerConfig, dict[str, str]]:
        """The controller's config; a member the pool cannot hold (``services[i]``/``jobs[i]`` in the
        validator's message) is left out and reported, the others still run."""
        refused: dict[str, str] = {}
        settings = ControllerSettings(tick_seconds=pool_spec_tick(self, pool_spec),
                                      lease_seconds=self.settings.lease_seconds,
                                      metrics_max_age_seconds=self.settings.metrics_max_age_seconds)
        while True:
            svc = [m for m in services if m.workload not in refused]
            jb = [m for m in jobs if m.workload not in refused]
            try:
                cfg = ControllerConfig(pool=pool_spec, services=tuple(m.spec for m in svc),
                                       jobs=tuple(m.spec for m in jb), controller=settings)
                return cfg, refused
            except ValueError as e:
                msg = str(e)
                m = re.search(r"(services|jobs)\[(\d+)\]", msg)
                if m is None:
                    raise
                culprit = (svc if m.group(1) == "services" else jb)[int(m.group(2))]
                refused[culprit.workload] = msg.split("\n")[-1] if "\n" in msg else msg

    def _sync_overrides(self, ctl: Controller, services: list[Member]) -> None:
        """``spec.replicas`` (``kubectl scale``) pins a service; unset returns it to the metric."""
        for m in services:
            if m.workload not in {s.name for s in ctl.cfg.services}:
                continue
            if m.cr.replicas is not None:
                ctl.overrides[m.workload] = (m.cr.replicas, math.inf)
            else:
                ctl.overrides.pop(m.workload, None)

ANN_DRAIN, ANN_DRAIN_SECONDS = "elastic.dev/drain", "elastic.dev/drain-seconds"


def drain_options(annotations: dict[str, str]) -> dict[str, Any]:
    """An InferenceService opts in to draining its replicas before a scale-down with the annotation
    ``elastic.dev/drain: "true"`` (and ``elastic.dev/drain-seconds``, default 30: how long to wait for
    a leaving replica to go idle)."""
    flag = annotations.get(ANN_DRAIN, "false").strip().lower()
    if flag not in ("true", "false"):
        raise CRError(f"metadata.annotations['{ANN_DRAIN}']", "InvalidAnnotation",
                      f"{flag!r}: use \"true\" or \"false\"")
    raw = annotations.get(ANN_DRAIN_SECONDS, "30")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise CRError(f"metadata.annotations['{ANN_DRAIN_SECONDS}']", "InvalidAnnotation",
                      f"{raw!r}: seconds between 0 and 3600")
    return {"drain": flag == "true", "drain_seconds": seconds}


def _check_template_gpus(cr: ElasticTrainingJobSpec) -> None:
    """Every worker pod holds exactly one GPU, which the operator asks for: a template asking for its
    own (``nvidia.com/gpu: 8``, say, more than a node may have) would be overridden silently."""
    for kind in ("requests", "limits"):
        v = (cr.template.resources.get(kind) or {}).get(GPU_RESOURCE)
        if v is not None and str(v) != "1":
            raise CRError(f"spec.template.resources.{kind}", "InvalidTemplate",
                          f"{GPU_RESOURCE}: {v}: every worker pod holds one GPU and the operator asks for it; "
                          f"remove {GPU_RESOURCE} from the template (the job's GPU count is minGPUs..maxGPUs)")


def _with_landed(res: TickResult, landed: dict[str, tuple[Grow, str | None]]) -> TickResult:
    """The cycle's result with the failures of the starts and grows that ran in the background
    (``"grow_training <job>: <why>"``, as a synchronous failure reads), for the pool's status."""
    failed = [f"grow_training {job}: {why}" for job, (_, why) in landed.items() if why is not None]
    if not failed or not res.acted:
        return res
    return replace(res, error="; ".join([res.error, *failed] if res.error else failed))


def pool_spec_tick(rt: OperatorRuntime, pool_spec: Any) -> float:
    with rt._lock:
        p = rt.pools.get(pool_spec.name)
    return p.cr.tick_seconds if p is not None else 5.0




__all__ = ["Member", "OperatorRuntime", "OperatorSettings", "Pool"]
