"""Ray backend: inference replicas and training workers as Ray actors with ``num_gpus=1``.

The embedded default (``make demo``) starts a local Ray with logical GPUs; on a real Ray
cluster the same code places actors on the nodes the allocation chose (node affinity).
Ray enforces the GPU counts: a replica started before the training shrink that frees its
GPU would simply wait, which is why the controller applies steps in order and this
backend returns from a shrink only once Ray reports the leavers' GPUs free again.

GPU identities (``GPU(node, index)``) are the controller's bookkeeping; with logical GPUs
Ray decides which device id an actor sees. Node names are ``node-<i>`` in the order of
Ray's node ids (``local`` for a single-node embedded Ray).

Two modes:

* **embedded** (``detached=False``, the demo): actors belong to this process's Ray driver
  and die with it; training jobs run through the trainer's ``TrainingJobHandle`` with the
  coordinator in this process.
* **detached** (``detached=True``, ``elastic serve`` against a Ray cluster): every actor is
  ``lifetime="detached"`` and named in the pool's namespace (``replica:<service>:<node>:<i>``,
  ``worker:<job>:<worker>``, ``coordinator:<job>``) and each job's rendezvous coordinator
  runs in its own detached actor (:class:`RayJobHandle`). A controller process that dies
  (even mid-rescale) takes none of them with it: the workers finish the directive they were
  given, and a restarted controller re-attaches by name (``_adopt``), waits for an in-flight
  rescale to settle, kills actors no generation uses, and carries on from the backend's truth.

What it must not do: decide placements or layouts (the controller does), or leave an actor
holding a GPU that no workload's bookkeeping accounts for.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.backends.base import (
    BackendError,
    BackendUnavailable,
    CheckpointOutcome,
    GrowCancelled,
    JobRuntime,
    RescaleOutcome,
    checkpoint_through,
    coordinator_runtime,
    still_held,
)
from elastic.backends.ray_jobs import (
    EmbeddedJobHandle,
    RayJobHandle,
    _drop_spare,
    _pop_warm,
    trainer_config_for,
)
from elastic.backends.replica_drain import hand_off, wait_drained
from elastic.model import GPU, InferenceSpec, Layout, PoolSpec, SpecError, TrainingSpec
from elastic.phases import CoordinatorPhase, JobPhase
from elastic.train.launch import job_options
from elastic.train.rendezvous import RescaleCancelled

log = logging.getLogger("elastic.backends.ray")

# a replica process loads its model before it serves; one not up by then has failed to start
REPLICA_START_TIMEOUT_S = 120.0


@dataclass
class _Replica:
    gpu: GPU
    actor: Any
    url: str
    started_at: float
    lease: Any = None  # a replica started as a spare holds its GPU through this lease (elastic.ray_gpu_lease)


@dataclass
class _Job:
    handle: Any
    workers: dict[GPU, str] = field(default_factory=dict)  # GPU -> worker id
    next_id: int = 0
    phase: JobPhase = JobPhase.RUNNING
    error: str | None = None
    last: RescaleOutcome | None = None
    keepers: list[str] = field(default_factory=list)  # paused: who holds the state (no GPU)


class RayBackend:
    """``Backend`` over a Ray cluster (see module docstring)."""

    name = "ray"

    #: set by the controller: raises once its lease is no longer its own (see ``Backend``'s ``fence``)
    fence: Callable[[], None] | None = None

    def _fenced(self) -> None:
        """Before an irreversible change: a leader that lost its lease changes nothing more."""
        if self.fence is not None:
            self.fence()

    def __init__(self, pool: PoolSpec, *, replica_config: Any = None, train_options: Any = None,
                 trainer_config: Callable[[TrainingSpec], Any] | None = None, local: bool = True,
                 drain_seconds: float = 30.0, detached: bool = False, namespace: str | None = None,
                 spare_workers: int = 0, spare_replicas: int = 0, lease_hold_seconds: float = 30.0) -> None:
        import ray

        from elastic.ray_gpu_lease import LeaseDesk

        self.pool = pool
        self.detached = detached
        self.replica_config = replica_config
        self.train_options = train_options
        self.trainer_config = trainer_config_for(trainer_config)
        self.drain_seconds = drain_seconds
        # per job, worker actors kept started without a GPU, torch imported, for the next joiner
        # (see _embedded_handle_class); single-node pools; detached mode does not use them
        self.spare_workers = spare_workers
        # per service, replica actors kept started without a GPU (model loaded, server up, out of the
        # balancer) for the next scale-up: a GPU lease and it serves (see _claim_spare_replica)
        self.spare_replicas = spare_replicas
        self._spare_reps: dict[str, list[tuple[Any, Any]]] = {}  # service -> [(actor, start() ref)]
        # GPU leases between two holders: a leaving replica's or worker's lease waits here (at most
        # lease_hold_seconds) for whoever starts next on its GPU (elastic.ray_gpu_lease.LeaseDesk)
        self.leases = LeaseDesk(hold_seconds=lease_hold_seconds)
        if not ray.is_initialized():
            if not local:
                raise BackendUnavailable("Ray is not initialised; call ray.init(address=...) first")
            from elastic.train.ray_handle import init_local_ray

            init_local_ray(num_gpus=pool.total_gpus)
        self.namespace = namespace or ray.get_runtime_context().namespace
        self._nodes = self._discover_nodes()
        self.replicas: dict[str, list[_Replica]] = {}
        # out of the load balancer's targets, finishing their requests (until stopped)
        self.draining: dict[str, list[_Replica]] = {}
        # drained ahead of a scale-down (``drain_ahead``): service -> GPU -> until (monotonic). Out of
        # the load balancer, still the service's (they hold their GPU and finish their requests)
        self.ahead: dict[str, dict[GPU, float]] = {}
        self.jobs: dict[str, _Job] = {}
        self._starting: dict[str, Any] = {}  # job -> handle of a start in progress (see cancel_grow)
        self._lock = threading.RLock()
        self.adopted: list[str] = []  # what _adopt found (for the controller's recovery notes)
        if detached:
            self.adopted = self._adopt()

    # ---- inventory ------------------------------------------------------------------------------
    def _discover_nodes(self) -> dict[str, tuple[str, int]]:
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
        alive.sort(key=lambda n: n["NodeID"])
        if len(alive) == 1:
            return {"local": (alive[0]["NodeID"], int(alive[0]["Resources"]["GPU"]))}
        return {f"node-{i}": (n["NodeID"], int(n["Resources"]["GPU"])) for i, n in enumerate(alive)}

    def ping(self) -> None:
        import ray

        if not ray.is_initialized():
            raise BackendUnavailable("Ray is not running")
        try:
            ray.cluster_resources()
        except Exception as e:  # noqa: BLE001 - any failure to reach the GCS
            raise BackendUnavailable(f"Ray unreachable: {e}") from e

    def inventory(self) -> dict[str, int]:
        self.leases.expire()  # asked every tick: no lease stays parked much past its time
        return {name: gpus for name, (_, gpus) in self._nodes.items()}

    def _ray_node(self, node: str) -> str | None:
        """The Ray node id of pool node ``node``; None in a single-node pool (Ray places freely)."""
        return None if len(self._nodes) == 1 else self._nodes[node][0]

    def _place(self, handle: Any, workers: dict[GPU, str]) -> None:
        """Pin each worker the handle starts to its GPU's node (a pool of several nodes). The
        co-scheduler keeps TP groups within a node and the controller books GPUs by node: a worker
        Ray put elsewhere would split its TP group and take the GPU a replica pinned to that node
        is later given."""
        if len(self._nodes) > 1:
            handle.placement = {w: self._nodes[g.node][0] for g, w in workers.items()}
        if hasattr(handle, "gpu_of"):  # which GPU's lease a worker takes and, when it leaves, parks
            handle.gpu_of.update({w: g for g, w in workers.items()})

    # ---- inference ------------------------------------------------------------------------------
    def service_gpus(self, service: str) -> tuple[GPU, ...]:
        with self._lock:
            return tuple(r.gpu for r in self.replicas.get(service, []))

    def ready_replicas(self, service: str) -> int:
        return len(self.service_targets(service))

    def service_targets(self, service: str) -> list[str]:
        """The load balancer's targets: ready replicas that take new requests."""
        with self._lock:
            out = self._ahead_of(service)
            return [r.url for r in self.replicas.get(service, []) if r.gpu not in out]

    def metric_targets(self, service: str) -> list[str]:
        """Every replica whose load is the service's: the balancer's targets and the replicas drained
        ahead of a scale-down (their requests still run; leaving them out of the metric would
        shrink the service a second time on load it still carries)."""
        with self._lock:
            return [r.url for r in self.replicas.get(service, [])]

    def draining_targets(self, service: str) -> list[str]:
        """Replicas out of ``service_targets`` that are still finishing their requests: those leaving
        (a scale-down) and those drained ahead of one."""
        with self._lock:
            out = self._ahead_of(service)
            return ([r.url for r in self.replicas.get(service, []) if r.gpu in out]
                    + [r.url for r in self.draining.get(service, [])])

    def drain_ahead(self, service: str, gpus: Sequence[GPU], hold_seconds: float) -> list[str]:
        """Take the service's replicas on ``gpus`` out of the load balancer ahead of a scale-down that
        will remove them: they keep their GPU and finish their requests, so the scale-down finds
        them drained. Every other replica drained ahead goes back into the balancer at once. Held
        out for ``hold_seconds`` unless asked again: a controller that stops asking (paused, lost its
        lease, died) cannot leave a replica out. Returns the URLs now held out."""
        with self._lock:
            mine = {r.gpu: r for r in self.replicas.get(service, [])}
            until = time.monotonic() + hold_seconds
            self.ahead[service] = {g: until for g in gpus if g in mine}
            return [mine[g].url for g in self.ahead[service]]

    def _ahead_of(self, service: str) -> set[GPU]:
        now = time.monotonic()
        return {g for g, until in self.ahead.get(service, {}).items() if until > now}

    def set_service_gpus(self, spec: InferenceSpec, gpus: tuple[GPU, ...]) -> None:
        self._fenced()
        import ray

        want = set(gpus[:: spec.gpus_per_replica]) if spec.gpus_per_replica > 1 else set(gpus)
        with self._lock:
            current = list(self.replicas.get(spec.name, []))
            keep = [r for r in current if r.gpu in want]
            leave = [r for r in current if r.gpu not in want]
            self.ahead.pop(spec.name, None)  # kept ones serve again; leaving ones drained ahead drain at once
            # 1. drain: out of the load balancer's targets first, then stop once their requests are done
            self.replicas[spec.name] = keep
            self.draining[spec.name] = self.draining.get(spec.name, []) + leave
        if spec.handoff and leave:
            # their requests resume on the replicas that stay; what could not hand off drains below
            moved = hand_off([r.url for r in leave])
            log.info("%s: leaving replicas handed off %s", spec.name, moved)
        self._drain(leave)
        given_back = 0
        for r in leave:
            try:
                ray.get(r.actor.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor is killed below anyway
                pass
            ray.kill(r.actor, no_restart=True)
            if r.lease is not None:  # for the next holder of this GPU (a joiner, usually this tick)
                self.leases.park(r.gpu, r.lease, spec.gpus_per_replica)
            else:  # the actor held the GPU itself: Ray frees it when the process is gone
                given_back += spec.gpus_per_replica
            with self._lock:
                self.draining[spec.name] = [d for d in self.draining.get(spec.name, []) if d is not r]
        if given_back:
            self._wait_gpus_free(given_back)
        # 2. start the missing replicas: warm spares serve once their GPU leases are granted (asked
        #    for all at once); the others start in parallel (each loads its model) and each joins the
        #    balancer's targets as soon as it is up, so a scale-up by two with one spare serves on
        #    the spare while the second one still starts
        have = {r.gpu for r in keep}
        missing = sorted(want - have, key=str)
        claims = [c for g in missing if (c := self._claim_spare_replica(spec, g)) is not None]
        claimed = {c[0] for c in claims}
        cold = [g for g in missing if g not in claimed]
        cold += self._await_spare_replicas(spec, claims)  # a spare that could not serve: start one cold
        self.leases.release(cold)  # a cold replica asks Ray for its GPU: one parked there goes back first
        starting: list[tuple[GPU, Any, Any]] = []  # (gpu, actor, start() ref -> url)
        for g in cold:
            opts: dict[str, Any] = {"num_gpus": spec.gpus_per_replica, "num_cpus": 0}
            if self.detached:
                opts.update(name=replica_name(spec.name, g), lifetime="detached", namespace=self.namespace)
            from elastic.ray_gpu_lease import on_node

            opts.update(on_node(self._ray_node(g.node)))
            try:
                actor = self._create_replica(opts)
            except Exception as e:  # noqa: BLE001 - surfaced as a failed step with the reason
                self._abandon(starting)
                raise BackendError(f"{spec.name}: replica on {g} failed to start: {e}") from e
            starting.append((g, actor, actor.start.remote()))
        failed = self._await_replicas(spec.name, starting, REPLICA_START_TIMEOUT_S)
        self._keep_spare_replicas(spec)
        if failed:
            raise BackendError(f"{spec.name}: " + "; ".join(f"replica on {g} failed to start: {e}" for g, e in failed))

    def _serve(self, service: str, replica: _Replica) -> None:
        """``replica`` joins the balancer's targets; a service's replicas stay in GPU order whatever
        order they came up in (targets, metrics and listings read the same from run to run)."""
        with self._lock:
            both = [*self.replicas.get(service, []), replica]
            self.replicas[service] = sorted(both, key=lambda r: (r.gpu.node, r.gpu.index))

    def _await_replicas(self, service: str, starting: list[tuple[GPU, Any, Any]],
                        timeout: float) -> list[tuple[GPU, str]]:
        """Wait for replicas being started (``(gpu, actor, start() ref)``); each one serves as soon as
        its ``start()`` returns its URL. Returns ``(gpu, why)`` for those that failed or did not start
        within ``timeout`` seconds (their actors are killed: their GPUs stay free)."""
        import ray

        pending = {ref: (g, actor) for g, actor, ref in starting}
        failed: list[tuple[GPU, str]] = []
        deadline = time.monotonic() + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for g, actor in pending.values():
                    failed.append((g, f"not up within {timeout:g} s"))
                    ray.kill(actor, no_restart=True)
                break
            for ref in ready:
                g, actor = pending.pop(ref)
                try:
                    url = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - reported with the GPU
                    failed.append((g, str(e)))
                    ray.kill(actor, no_restart=True)
                    continue
                self._serve(service, _Replica(g, actor, url, time.time()))
        return failed

    @staticmethod
    def _abandon(starting: list[tuple[GPU, Any, Any]]) -> None:
        import ray

        for _, actor, _ in starting:
            ray.kill(actor, no_restart=True)

    def _keep_spare_replicas(self, spec: InferenceSpec) -> None:
        """Start spares for ``spec`` up to ``spare_replicas`` (asynchronous: each loads its model in
        the background). Embedded (non-detached) mode only; a detached replica is named by its GPU."""
        from dataclasses import asdict

        from elastic.serve.ray_replica import ReplicaActor
        from elastic.serve.server import ReplicaConfig

        if self.detached or self.spare_replicas <= 0:
            return
        spares = self._spare_reps.setdefault(spec.name, [])
        while len(spares) < self.spare_replicas:
            actor = ReplicaActor.options(num_gpus=0, num_cpus=0).remote(asdict(self.replica_config or ReplicaConfig()))
            spares.append((actor, actor.start.remote()))

    def _claim_spare_replica(self, spec: InferenceSpec, g: GPU) -> tuple[GPU, Any, str, Any, Any] | None:
        """A started spare for GPU ``g`` with its GPU lease asked for (pinned to its node), not yet
        granted: ``(g, actor, url, lease, lease.gpu_ids() ref)``. None when no spare is up yet or
        the lease cannot be asked for (start one as usual). :meth:`_await_spare_replicas` waits.

        A spare is what vLLM's sleep mode is to a real engine: the process, the server and the weights
        in host memory are ready, only the GPU is missing. The reference replica computes on CPU, so
        here the lease is all it needs."""
        import ray

        from elastic.ray_gpu_lease import lease_actor

        node = self._ray_node(g.node)
        fits = None if node is None else (lambda a, _url: ray.get(a.node_id.remote(), timeout=10) == node)
        if (spare := _pop_warm(self._spare_reps.get(spec.name, []), fits)) is None:
            return None
        (actor, url), lease = spare, None
        try:
            # the lease of whoever left this GPU (a worker of a shrink, usually this tick), else a new one:
            # several nodes: `fits` has just checked the spare is on `node`; one node: ask where it is
            lease = self.leases.take(g, spec.gpus_per_replica)
            if lease is None:
                where = node if node is not None else ray.get(actor.node_id.remote(), timeout=10)
                lease = lease_actor(spec.gpus_per_replica, where)
            return g, actor, url, lease, lease.gpu_ids.remote()
        except Exception as e:  # noqa: BLE001 - a spare that died or no lease: start one the usual way
            _drop_spare(spec, g, actor, lease, e)
            return None

    def _await_spare_replicas(self, spec: InferenceSpec, claims: list[tuple[GPU, Any, str, Any, Any]],
                              timeout: float = 30.0) -> list[GPU]:
        """Wait for the leases of claimed spares together; each spare serves as soon as Ray has granted
        its GPUs (they are ours). Returns the GPUs whose spare could not serve (lease refused or not
        granted within ``timeout``: spare and lease are killed, the GPU is started cold)."""
        import ray

        pending = {c[4]: c for c in claims}
        failed: list[GPU] = []
        deadline = time.monotonic() + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            done = ready or list(pending)  # none ready by the deadline: give the rest up
            for ref in done:
                g, actor, url, lease, _ = pending.pop(ref)
                try:
                    if not ready:
                        raise TimeoutError(f"lease not granted within {timeout:g} s")
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the GPU is started the usual way
                    _drop_spare(spec, g, actor, lease, e)
                    failed.append(g)
                    continue
                self._serve(spec.name, _Replica(g, actor, url, time.time(), lease))
        return failed

    def _create_replica(self, opts: dict[str, Any]) -> Any:
        """Create one replica actor (its ``start()`` not called yet). A detached name is released only
        once Ray has buried the previous actor of that GPU (``ray.kill`` is asynchronous): retry a
        taken name for a few seconds."""
        from dataclasses import asdict

        from elastic.serve.ray_replica import ReplicaActor
        from elastic.serve.server import ReplicaConfig

        deadline = time.monotonic() + 15.0
        while True:
            try:
                return ReplicaActor.options(**opts).remote(asdict(self.replica_config or ReplicaConfig()))
            except ValueError as e:
                if "name" not in opts or "already" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _drain(self, leave: Sequence[_Replica]) -> None:
        if not leave:
            return
        if busy := wait_drained([r.url for r in leave], self.drain_seconds):
            log.warning("replicas %s still busy after a %.0f s drain; stopping them cuts their requests",
                        busy, self.drain_seconds)

    def _wait_gpus_free(self, n: float, timeout: float = 10.0) -> None:
        import ray

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ray.available_resources().get("GPU", 0.0) >= n - 1e-9:
                return
            time.sleep(0.02)
        log.warning("Ray still shows fewer than %g GPUs free after stopping actors", n)

    # ---- training -------------------------------------------------------------------------------
    def job_runtime(self, job: str) -> JobRuntime | None:
        with self._lock:
            j = self.jobs.get(job)
            if j is None:
                return None
            st = j.handle.status()
            if st.phase == CoordinatorPhase.RUNNING and (held := still_held(j.workers, st.workers)) != j.workers:
                j.workers = held  # recovered from a lost worker on its own
                _remember_gpus(j.handle, j)
            return coordinator_runtime(job, st, j.workers, j.last)

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        self._fenced()
        with self._lock:
            j = self.jobs.get(spec.name)
        if not gpus:
            return self._stop_job(spec, j)
        assert layout is not None
        if layout.world_size != len(gpus):
            raise BackendError(f"{spec.name}: layout {layout} needs {layout.world_size} GPUs, got {len(gpus)}")
        if j is None:
            return self._start_job(spec, gpus, layout)
        return self._rescale_job(spec, j, gpus, layout)

    def pause_job(self, spec: TrainingSpec) -> RescaleOutcome:
        """Free every GPU of the job and keep its state: it moves into keeper actors (no GPU) and
        waits there, at its step, until ``set_job_gpus`` resumes it (see ``JobHandle.pause``)."""
        self._fenced()
        with self._lock:
            j = self.jobs.get(spec.name)
        if j is None:
            return RescaleOutcome.not_running(spec.name)
        before = j.handle.status()
        if before.phase == CoordinatorPhase.PAUSED:
            return RescaleOutcome.still_paused(spec.name, before.layout, before.generation,
                                               before.step)
        running = before.layout
        if running is None:
            raise BackendError(f"{spec.name}: cannot pause a job that is {before.phase}")
        n = running.held().world_size
        keepers = [f"{spec.name}-k{j.next_id + i}" for i in range(n)]
        # keepers take ids from the same counter: a name is never reused within the job. Recorded
        # before the directive: a controller that dies mid-pause leaves them on record for its successor
        _remember_gpus(j.handle, _Job(j.handle, dict(j.workers), j.next_id + n), keepers=keepers)
        try:
            res = j.handle.pause(keepers)
        except Exception as e:  # noqa: BLE001 - refused/abandoned: the job trains on, on its GPUs
            _remember_gpus(j.handle, j, keepers=[])
            raise BackendError(f"{spec.name}: pause of {before.layout} failed: {e}") from e
        with self._lock:
            j.workers, j.keepers, j.next_id = {}, keepers, j.next_id + n
        out = RescaleOutcome.from_result(spec.name, running, res)
        j.last = out
        return out

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> CheckpointOutcome:
        """Save ``job``'s state at its next step boundary (``checkpoint_through``)."""
        with self._lock:
            j = self.jobs.get(job)
        return checkpoint_through(j.handle if j is not None else None, job, wait_seconds)

    def cancel_grow(self, job: str) -> bool:
        """Call off a grow or a *start* of ``job`` whose workers have not all registered yet: a start
        called off has created no state (its workers are dismissed, the job is not running), so
        inference never waits for a job's cold start to end before it gets a GPU back."""
        with self._lock:
            j = self.jobs.get(job)
            handle = j.handle if j is not None else self._starting.get(job)
        return handle is not None and handle.cancel_pending()

    def _new_handle(self, spec: TrainingSpec) -> Any:
        kw = {"options": job_options(self.train_options, spec), "hardware": self.pool.hardware,
              "gpus_per_node": self.pool.gpus_per_node}
        if self.detached:
            return RayJobHandle(spec.name, self.trainer_config(spec), namespace=self.namespace,
                                spec_doc=spec.model_dump(mode="json"), **kw)
        # the coordinator runs in this process: workers on other nodes reach it at this node's address
        # (127.0.0.1 for the embedded local Ray, which binds loopback)
        import ray

        handle = EmbeddedJobHandle(spec.name, self.trainer_config(spec), host=ray.util.get_node_ip_address(), **kw)
        handle.spares_wanted = self.spare_workers
        handle.desk = self.leases
        return handle

    def _start_job(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout) -> RescaleOutcome:
        try:
            handle = self._new_handle(spec)
        except Exception as e:  # noqa: BLE001 - e.g. a coordinator actor that cannot be placed
            raise BackendError(f"{spec.name}: cannot create the job's handle: {e}") from e
        j = _Job(handle)
        for g in gpus:
            j.workers[g] = f"{spec.name}-w{j.next_id}"
            j.next_id += 1
        _remember_gpus(handle, j)
        self._place(handle, j.workers)
        with self._lock:
            self._starting[spec.name] = handle  # cancel_grow can call the start off until its directive
        try:
            res = handle.start(layout, [j.workers[g] for g in gpus])
        except (SpecError, Exception) as e:  # noqa: BLE001 - surfaced as a failed step
            try:
                handle.stop()
            except Exception:  # noqa: BLE001
                pass
            if isinstance(e, RescaleCancelled):
                raise GrowCancelled(f"{spec.name}: start on {layout} called off before its first step: {e}") from e
            raise BackendError(f"{spec.name}: start on {layout} failed: {e}") from e
        finally:
            with self._lock:
                self._starting.pop(spec.name, None)
        if (keep_spares := getattr(handle, "keep_spares", None)) is not None:
            keep_spares()  # warm up in the background for the job's first grow
        with self._lock:
            self.jobs[spec.name] = j
        out = RescaleOutcome.started(spec.name, layout, res)
        j.last = out
        return out

    def _rescale_job(self, spec: TrainingSpec, j: _Job, gpus: tuple[GPU, ...], layout: Layout) -> RescaleOutcome:
        before = j.handle.status()
        new_workers: dict[GPU, str] = {}
        nxt = j.next_id
        for g in gpus:
            if g in j.workers:
                new_workers[g] = j.workers[g]
            else:
                new_workers[g] = f"{spec.name}-w{nxt}"
                nxt += 1
        # Before the directive: a controller that dies mid-rescale leaves this map behind, so its
        # successor knows which GPU each worker of either generation holds.
        _remember_gpus(j.handle, _Job(j.handle, {**j.workers, **new_workers}, nxt))
        self._place(j.handle, new_workers)
        try:
            # a shrink returns once the new layout trains and its leavers are gone: inference waits for
            # those GPUs, not for the new layout's first step
            res = j.handle.rescale(layout, [new_workers[g] for g in gpus], wait_first_step=False)
        except RescaleCancelled as e:
            _remember_gpus(j.handle, j)  # the job keeps the workers and GPUs it had
            raise GrowCancelled(f"{spec.name}: rescale {before.layout} -> {layout} called off: {e}") from e
        except Exception as e:  # noqa: BLE001 - refused/abandoned/rolled back: the job goes on on its old layout
            try:
                _remember_gpus(j.handle, j)  # the old generation's map again (a rollback recovers from it)
            except Exception:  # noqa: BLE001 - the job may have failed too; the error below says why
                pass
            raise BackendError(f"{spec.name}: rescale {before.layout} -> {layout} failed: {e}") from e
        with self._lock:
            j.workers, j.next_id, j.keepers = new_workers, nxt, []
        if before.phase == CoordinatorPhase.PAUSED:
            _remember_gpus(j.handle, j, keepers=[])
        out = RescaleOutcome.from_result(spec.name, before.layout, res, to_layout=layout)
        j.last = out
        return out

    def _stop_job(self, spec: TrainingSpec, j: _Job | None) -> RescaleOutcome:
        if j is None:
            return RescaleOutcome.not_running(spec.name)
        st = j.handle.status()
        try:
            j.handle.stop()
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"{spec.name}: stop failed: {e}") from e
        with self._lock:
            self.jobs.pop(spec.name, None)
        return RescaleOutcome.stopped(spec.name, st.layout, st.generation, st.step)

    def shutdown(self) -> None:
        import ray

        for name in list(self.jobs):
            try:
                self.jobs[name].handle.stop()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        for reps in self.replicas.values():
            for r in reps:
                for a in (r.actor, r.lease):
                    try:
                        if a is not None:
                            ray.kill(a, no_restart=True)
                    except Exception:  # noqa: BLE001
                        pass
        for spares in self._spare_reps.values():
            for actor, _ in spares:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
        self._spare_reps.clear()
        self.replicas.clear()
        self.jobs.clear()
        self.leases.release()  # the stopped workers' leases, parked on their way out

    def detach(self) -> None:
        """Forget the actors without stopping them (detached mode): a successor adopts them."""
        for j in self.jobs.values():
            j.handle.detach()
        self.replicas.clear()
        self.jobs.clear()

    # ---- re-attach after a controller restart (detached mode) ---------------------------------
    def adopt(self) -> list[str]:
        """What ``_adopt`` found: in detached mode this backend re-attaches as it starts, so the
        replicas and jobs it found are its own before any controller reads it."""
        return list(self.adopted)

    def _adopt(self) -> list[str]:
        """Find this pool's named actors and rebuild the bookkeeping from them. Returns notes.

        1. replicas: each ``replica:<service>:<node>:<i>`` that still answers is kept;
        2. jobs: each ``coordinator:<job>`` is asked for its status; an in-flight rescale is
           waited for (its workers finish it without us); a failed/stopped job is cleaned up;
        3. strays: any worker actor the job's current generation does not list is killed, so
           no GPU is held by something nobody accounts for.
        """
        import ray

        notes: list[str] = []
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == self.namespace)
        workers = [n for n in names if n.startswith("worker:")]
        for name in names:
            kind, _, rest = name.partition(":")
            if kind == "replica":
                notes.append(self._adopt_replica(name, rest))
            elif kind == "coordinator":
                notes.append(self._adopt_job(rest, [w for w in workers if w.startswith(f"worker:{rest}:")]))
        owned = {f"worker:{job}:{w}" for job, j in self.jobs.items() for w in [*j.workers.values(), *j.keepers]}
        strays = [name for name in workers if name not in owned]
        free_before = ray.available_resources().get("GPU", 0.0)
        for name in strays:
            _kill_named(name, self.namespace)
            notes.append(f"removed worker actor {name}: in no job's current generation "
                         "(a leaver still exiting, or a joiner of an abandoned rescale)")
        # a killed actor's GPU is free only once Ray says so: until then the controller's first tick
        # would count it free while Ray still books it (keepers hold none)
        holding = [n for n in strays if not re.fullmatch(r".*-k\d+", n)]
        if holding:
            self._wait_gpus_free(free_before + len(holding))
        return notes

    def _adopt_replica(self, name: str, rest: str) -> str:
        import ray

        service, node, index = rest.rsplit(":", 2)
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
            url = ray.get(actor.url.remote(), timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead or wedged replica is not adopted
            _kill_named(name, self.namespace)
            return f"replica {name} did not answer ({type(e).__name__}); killed"
        if url is None:
            _kill_named(name, self.namespace)
            return f"replica {name} had no server; killed"
        self._serve(service, _Replica(GPU(node, int(index)), actor, url, time.time()))
        return f"adopted replica {service} on {node}:{index}"

    def _adopt_job(self, job: str, worker_names: list[str]) -> str:
        try:
            handle = RayJobHandle.adopt(job, self.namespace, self.trainer_config, options=self.train_options,
                                        hardware=self.pool.hardware, gpus_per_node=self.pool.gpus_per_node)
        except Exception as e:  # noqa: BLE001 - an unreadable coordinator: clean the job up
            for n in [f"coordinator:{job}", *worker_names]:
                _kill_named(n, self.namespace)
            return f"job {job}: coordinator unusable ({type(e).__name__}: {e}); its actors were killed"
        st = handle.settle(self.train_options.rescale_timeout_s if self.train_options else 120.0)
        if st.phase == CoordinatorPhase.PAUSED:  # its keepers hold the state and no GPU: adopt them as they are
            j = _Job(handle, next_id=int(handle.meta.get("next_id", 0)), keepers=list(st.workers))
            handle.keepers.update(st.workers)
            handle.forget_except(st.workers)
            with self._lock:
                self.jobs[job] = j
            return f"adopted paused job {job}: state held as {st.layout} at step {st.step + 1} by {', '.join(st.workers)}"
        if st.phase not in (CoordinatorPhase.RUNNING, CoordinatorPhase.RESCALING):
            handle.stop(timeout=10.0)
            return f"job {job} was {st.phase} ({st.error or st.reason}); stopped and cleaned up"
        gpus = handle.meta.get("gpus", {})
        unknown = [w for w in st.workers if w not in gpus]
        if unknown:  # cannot say which GPUs it holds: stopping it is the only safe bookkeeping
            handle.stop(timeout=10.0)
            return f"job {job}: no GPU on record for worker(s) {', '.join(unknown)}; stopped it (it restarts fresh)"
        j = _Job(handle, next_id=int(handle.meta.get("next_id", 0)))
        for w in st.workers:
            node, index = gpus[w]
            j.workers[GPU(node, int(index))] = w
        handle.forget_except(st.workers)
        with self._lock:
            self.jobs[job] = j
        return f"adopted job {job}: {st.layout} generation {st.generation} at step {st.step}"


# ---- detached mode: names, the coordinator actor, the worker actor, the job handle ------------


def replica_name(service: str, gpu: GPU) -> str:
    return f"replica:{service}:{gpu.node}:{gpu.index}"


def _kill_named(name: str, namespace: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _remember_gpus(handle: Any, j: _Job, *, keepers: list[str] | None = None) -> None:
    """Store worker -> GPU (and, when it changes, the keepers of a paused job) with the job
    (detached mode: in its coordinator actor)."""
    remember = getattr(handle, "remember", None)
    if remember is not None:
        remember({w: [g.node, g.index] for g, w in j.workers.items()}, j.next_id, keepers=keepers)
