"""Training on Ray: worker actors, warm spares and GPU leases, the trainer config a job spec
names, and the detached mode's coordinator actor and job handle (one job outlives the
controller process that started it)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from elastic.backends.base import default_trainer_config
from elastic.model import GPU, InferenceSpec, TrainingSpec
from elastic.train.launch import JobHandle, coordinator_settings, gpu_workers
from elastic.train.ray_handle import TrainingJobHandle
from elastic.train.rendezvous import CoordinatorSettings
from elastic.train.userjob import is_user_config

log = logging.getLogger("elastic.backends.ray")


def _drop_spare(spec: InferenceSpec, g: GPU, actor: Any, lease: Any, why: BaseException) -> None:
    """A spare that cannot serve on ``g`` (it died, or its lease was refused or late): gone with its lease."""
    import ray

    log.warning("%s: spare replica not usable for %s (%s); starting a new one", spec.name, g, why)
    for a in (actor, lease):
        if a is not None:
            ray.kill(a, no_restart=True)


def _pop_warm(spares: list[tuple[Any, Any]],
              fits: Callable[[Any, Any], bool] | None = None) -> tuple[Any, Any] | None:
    """Take the first spare whose warm-up call (``ref``) has returned from ``spares`` ([(actor, ref)])
    and that ``fits(actor, what the call returned)`` (e.g. it is on the node wanted; None: any):
    ``(actor, what the call returned)``, or None when none is. A spare that died warming up is
    dropped (killed) on the way; one that does not fit stays for a later taker."""
    import ray

    i = 0
    while i < len(spares):
        actor, ref = spares[i]
        if not ray.wait([ref], timeout=0)[0]:
            i += 1
            continue
        try:
            got = ray.get(ref)
            ok = fits is None or fits(actor, got)
        except Exception:  # noqa: BLE001 - it died warming up (or since)
            del spares[i]
            ray.kill(actor, no_restart=True)
            continue
        if not ok:
            i += 1
            continue
        del spares[i]
        return actor, got
    return None


@functools.cache
def _worker_actor(num_gpus: float) -> Any:
    import ray

    return ray.remote(num_gpus=num_gpus, num_cpus=0, max_concurrency=2, max_restarts=0)(_TrainWorker)


class EmbeddedJobHandle(TrainingJobHandle):
    """The trainer's ``TrainingJobHandle`` with our worker actor, spare workers, minus a start-up race.

        Workers run in :class:`_TrainWorker` (a leaver ends the actor cleanly instead of ``os._exit``).

        ``JobHandle._launch`` marks a worker spawned before ``_spawn`` has created its actor; the
        launcher's watcher thread can look in between, get "was never started" from
        ``_exit_reason`` and fail the whole job. A worker that is marked but not yet created is
        starting, not gone.

        Spares (``spares_wanted``, ``RayBackend(spare_workers=...)``): worker actors started ahead
        with no GPU, torch and the trainer imported. A joiner takes one: a :mod:`elastic.ray_gpu_lease`
        lease holds its GPUs in Ray's books (pinned to the spare's node) and the spare starts
        training once the lease is granted, so a grow does not wait for a process to start and
        import torch. A used spare is replaced in the background.

        Every worker with a GPU holds it through a lease, a worker started cold too (its actor asks
        Ray for no GPU; the lease is asked for at the same time, so the start is no slower). When a
        worker leaves, its lease is parked on the backend's :class:`~elastic.ray_gpu_lease.LeaseDesk`
        (``desk``) under the worker's GPU (``gpu_of``, from ``RayBackend._place``) for the next
        holder of that GPU (the replica a scale-up starts there, usually in the same tick); a worker
        starting on a GPU takes the lease parked there, if any, instead of asking Ray for one.
        """

    spares_wanted = 0

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.leases: dict[str, Any] = {}  # worker -> its GPU lease (every worker that holds a GPU)
        self.desk: Any = None  # RayBackend.leases: where leavers' leases wait for the GPU's next holder
        self.gpu_of: dict[str, Any] = {}  # worker -> the pool's GPU it holds (RayBackend._place)
        self.parked_workers: set[str] = set()  # workers whose lease was parked, not given back to Ray
        self.spares: list[tuple[Any, Any]] = []  # (actor, warm() ref -> node id), oldest first
        self.placement: dict[str, str] = {}  # worker -> the Ray node it must run on (RayBackend._place)

    def keep_spares(self) -> None:
        """Start spares up to ``spares_wanted`` (asynchronous: they warm up in the background)."""
        while self.spares_wanted > 0 and self._gpus_per_worker > 0 and len(self.spares) < self.spares_wanted:
            actor = _worker_actor(0).remote()
            self.spares.append((actor, actor.warm.remote()))

    def _spawn(self, worker: str, env: dict[str, str]) -> None:
        # our worker actor: a leaver ends through exit_actor(), not os._exit (no "SYSTEM_ERROR" noise)
        keeper = env.get("ELASTIC_KEEPER") == "1"  # holds a paused job's state: no GPU
        # a warm spare (on the worker's node, if it has one), else a fresh actor (one still warming
        # up is no faster); a keeper goes anywhere
        node = None if keeper else self.placement.get(worker)
        fits = None if node is None else (lambda _a, at: at == node)
        from elastic.ray_gpu_lease import lease_actor, on_node

        if keeper or self._gpus_per_worker <= 0:
            actor = _worker_actor(0).options(**on_node(node)).remote()
            self.actors[worker] = actor
            self._runs[worker] = actor.run.remote(env)
            return
        spare = _pop_warm(self.spares, fits)
        if spare is not None:
            actor, node = spare
        else:  # started cold: its process starts while Ray grants the lease
            actor = _worker_actor(0).options(**on_node(node)).remote()
        # the lease the GPU's last holder parked (a replica of a scale-down, usually this tick), else a new one
        lease = self.desk.take(self.gpu_of.get(worker), self._gpus_per_worker) if self.desk is not None else None
        if lease is None:
            lease = lease_actor(self._gpus_per_worker, node)
        self.leases[worker] = lease
        self.actors[worker] = actor
        self._runs[worker] = actor.run_leased.remote(lease.gpu_ids.remote(), env)
        if spare is not None:
            self.keep_spares()

    def _kill(self, worker: str) -> None:
        import ray

        super()._kill(worker)
        lease = self.leases.pop(worker, None)
        if lease is None:
            return
        gpu = self.gpu_of.get(worker)
        if self.desk is not None and gpu is not None:  # for the next holder of its GPU
            self.desk.park(gpu, lease, self._gpus_per_worker)
            self.parked_workers.add(worker)
        else:
            ray.kill(lease, no_restart=True)

    def _handed_on(self, workers: Sequence[str]) -> float:
        return sum(self._gpus_per_worker for w in workers if w in self.parked_workers)

    def _exit_reason(self, worker: str) -> str | None:
        if worker not in self._runs:
            return None
        return super()._exit_reason(worker)

    def stop(self, timeout: float | None = None) -> Any:
        import ray

        try:
            return super().stop(timeout)
        finally:
            for actor, _ in self.spares:
                ray.kill(actor, no_restart=True)
            self.spares.clear()


def trainer_config_for(reference: Callable[[TrainingSpec], Any] | None) -> Callable[[TrainingSpec], Any]:
    """How a backend picks a job's trainer config: a user job's is always its ``UserJobConfig``;
    ``reference`` (a caller's tuning of the reference trainer) makes the other jobs' configs."""
    if reference is None or reference is default_trainer_config:
        return default_trainer_config

    def choose(spec: TrainingSpec) -> Any:
        return default_trainer_config(spec) if spec.entrypoint is not None else reference(spec)

    return choose


# ---- detached mode: the coordinator actor, the worker actor, the job handle ---------------


class _LeftJob(BaseException):
    """Raised in place of the agent's process exit when a worker leaves (see ``_TrainWorker.run``)."""


def _leave_instead_of_exit(code: int = 0) -> None:
    raise _LeftJob(code)


class _TrainWorker:
    """One training worker as a detached actor: runs the agent, then ends the actor cleanly.

    The agent ends a leaver with ``os._exit`` (``elastic.reshard.execute.fast_exit``) so its
    GPU frees at once; inside a Ray actor that reads as a crash ("worker died ... SYSTEM_ERROR")
    and would take the exit code with it. Here the leave becomes an exception that unwinds to
    ``run``, which then calls ``ray.actor.exit_actor()``: an intended exit that frees the GPU
    with no controller around to kill the actor (it may be dead: that is the point of detached).
    """

    def __init__(self) -> None:
        self.code: int | None = None

    def run(self, env: dict[str, str]) -> int:
        import os

        import ray

        import elastic.reshard.execute as execute

        os.environ.update(env)
        execute.fast_exit = _leave_instead_of_exit  # this actor process only; see the class docstring
        from elastic.train.worker import main

        left = False
        try:
            self.code = main({**os.environ, **env})
        except _LeftJob:
            self.code, left = 0, True
        if left:
            ray.actor.exit_actor()
        return self.code

    def exit_code(self) -> int | None:
        return self.code

    def warm(self) -> str:
        """A spare's start: import torch and the trainer now, before it has a GPU; returns its node."""
        import ray

        import elastic.reshard.execute  # noqa: F401
        import elastic.train.worker  # noqa: F401
        from elastic.torch.coordinated import warm_up

        warm_up()  # a user job's joiner: torch's distributed modules and first calls, before it is needed

        return ray.get_runtime_context().get_node_id()

    def run_leased(self, gpu_ids: list[str], env: dict[str, str]) -> int:
        """A spare's ``run`` once its GPU lease is granted (``gpu_ids``: what Ray assigned the lease)."""
        if gpu_ids:
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)}
        return self.run(env)


class _CoordinatorActor:
    """A job's rendezvous coordinator in its own detached actor (it outlives the controller)."""

    def __init__(self, job: str, config: dict[str, Any], settings: CoordinatorSettings, meta: dict[str, Any],
                 host: str | None = None) -> None:
        import ray

        from elastic.train.rendezvous import Coordinator

        self.meta = dict(meta)
        self.coordinator = Coordinator(job, config, settings, host=host or ray.util.get_node_ip_address()).start()

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        return getattr(self.coordinator, method)(*args, **kw)

    def url(self) -> str:
        return self.coordinator.url

    def secret(self) -> str:
        return self.coordinator.secret

    def get_meta(self) -> dict[str, Any]:
        return dict(self.meta)

    def update_meta(self, **kw: Any) -> None:
        self.meta.update(kw)


class _RemoteCoordinator:
    """The part of :class:`~elastic.train.rendezvous.Coordinator` a JobHandle uses, over Ray."""

    def __init__(self, actor: Any, job: str) -> None:
        import ray

        self.actor = actor
        self.job = job
        self.url = ray.get(actor.url.remote(), timeout=60)
        self.secret = ray.get(actor.secret.remote(), timeout=60)

    def _call(self, method: str, *args: Any, timeout: float = 60.0, **kw: Any) -> Any:
        import ray

        from elastic.train.rendezvous import JobFailed

        try:
            return ray.get(self.actor.call.remote(method, *args, **kw), timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, BaseException) else RuntimeError(str(e))) from None
        except ray.exceptions.RayActorError as e:
            raise JobFailed(f"job {self.job}: its coordinator actor is gone ({type(e).__name__})") from None

    def start(self) -> _RemoteCoordinator:
        return self  # the actor started serving when it was created

    def directive(self, generation: int, layout: Any, members: Any, **kw: Any) -> Any:
        return self._call("directive", generation, layout, list(members), **kw)  # a Layout pickles as it is

    def wait_generation(self, generation: int, timeout: float) -> Any:
        return self._call("wait_generation", generation, timeout, timeout=timeout + 30)

    def wait_resumed(self, generation: int, timeout: float) -> Any:
        return self._call("wait_resumed", generation, timeout, timeout=timeout + 30)

    def wait_step(self, step: int, timeout: float) -> Any:
        return self._call("wait_step", step, timeout, timeout=timeout + 30)

    def wait_checkpoint(self, ticket: Any, timeout: float) -> int:
        return self._call("wait_checkpoint", tuple(ticket), timeout, timeout=timeout + 30)

    def status(self) -> Any:
        return self._call("status")

    def history(self) -> Any:
        return self._call("history")

    def registered(self, worker: str) -> bool:
        return self._call("registered", worker)

    def has_left(self, worker: str) -> bool:
        return self._call("has_left", worker)

    def fail(self, reason: str) -> None:
        self._call("fail", reason)

    def request_stop(self, reason: str = "stopped by the controller") -> None:
        self._call("request_stop", reason)

    def stop(self) -> None:
        self._call("stop")

    def __getattr__(self, method: str) -> Any:
        # Any other Coordinator method a JobHandle calls goes to the actor too, so the
        # launcher and this proxy cannot drift apart again.
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kw: self._call(method, *args, **kw)


class RayJobHandle(JobHandle):
    """A training job whose coordinator and workers are detached, named Ray actors.

    Same contract as :class:`~elastic.train.launch.JobHandle` (``start``/``rescale``/``status``/
    ``stop``); in addition ``adopt`` re-attaches to a running job by name after a controller
    restart, ``settle`` waits for a rescale the previous controller left in flight, and
    ``detach`` lets go without stopping anything.
    """

    def __init__(self, job: str, cfg: Any, *, namespace: str, spec_doc: dict[str, Any] | None = None,
                 actor: Any = None, **kw: Any) -> None:
        import ray

        super().__init__(job, cfg, **kw)  # builds an unstarted in-process Coordinator, replaced below
        self.namespace = namespace
        self.meta: dict[str, Any] = {"spec": spec_doc or {}, "gpus": {}, "next_id": 0}
        if actor is None:
            from elastic.train.agent import config_json

            cls = ray.remote(num_cpus=0, max_concurrency=32, max_restarts=0)(_CoordinatorActor)
            actor = cls.options(name=f"coordinator:{job}", namespace=namespace, lifetime="detached").remote(
                job, config_json(cfg), coordinator_settings(self.opts, user=is_user_config(cfg)), self.meta)
        self.coordinator = _RemoteCoordinator(actor, job)  # type: ignore[assignment]
        self._actor = actor
        self._wcls = _worker_actor(1)
        self.placement: dict[str, str] = {}  # worker -> the Ray node it must run on (RayBackend._place)
        self.actors: dict[str, Any] = {}
        self._runs: dict[str, Any] = {}
        self._gpus_free_before = 0.0

    @classmethod
    def adopt(cls, job: str, namespace: str, trainer_config: Callable[[TrainingSpec], Any], **kw: Any
              ) -> RayJobHandle:
        """Re-attach to ``coordinator:<job>`` and its ``worker:<job>:*`` actors."""
        import ray

        actor = ray.get_actor(f"coordinator:{job}", namespace=namespace)
        meta = ray.get(actor.get_meta.remote(), timeout=60)
        spec = TrainingSpec.model_validate(meta["spec"])
        h = cls(job, trainer_config(spec), namespace=namespace, spec_doc=meta["spec"], actor=actor, **kw)
        h.meta = meta
        for w in [*meta.get("gpus", {}), *meta.get("keepers", [])]:
            try:
                h.actors[w] = ray.get_actor(f"worker:{job}:{w}", namespace=namespace)
            except ValueError:
                continue  # gone (a leaver that exited)
        h.attach(list(h.actors))
        return h

    def remember(self, gpus: dict[str, list[Any]], next_id: int, *, keepers: list[str] | None = None) -> None:
        import ray

        self.meta["gpus"] = {**self.meta.get("gpus", {}), **gpus}
        self.meta["next_id"] = next_id
        if keepers is not None:
            self.meta["keepers"] = list(keepers)
        ray.get(self._actor.update_meta.remote(gpus=self.meta["gpus"], next_id=next_id,
                                               keepers=self.meta.get("keepers", [])), timeout=60)

    def forget_except(self, workers: list[str]) -> None:
        """Kill the job's actors that the current generation does not use (leavers that lingered)."""
        for w in [w for w in self.actors if w not in workers]:
            self._kill(w)
            self.actors.pop(w, None)
            with self._lock:
                self._gone.add(w)

    def detach(self) -> None:
        self._watching.set()

    # ---- JobHandle launcher hooks -------------------------------------------------------------
    def _spawn(self, worker: str, env: dict[str, str]) -> None:
        from elastic.ray_gpu_lease import on_node

        keeper = env.get("ELASTIC_KEEPER") == "1"
        cls = _worker_actor(0) if keeper else self._wcls  # a keeper holds no GPU, anywhere
        actor = cls.options(name=f"worker:{self.job}:{worker}", namespace=self.namespace, lifetime="detached",
                            **on_node(None if keeper else self.placement.get(worker))).remote()
        self.actors[worker] = actor
        self._runs[worker] = actor.run.remote(env)

    def _exit_reason(self, worker: str) -> str | None:
        import ray

        ref = self._runs.get(worker)
        actor = self.actors.get(worker)
        if ref is None and actor is None:
            return None  # marked spawned by JobHandle._launch, actor not created yet: starting, not gone
        try:
            if ref is not None:  # we started it: its run() result is ours to wait on
                ready, _ = ray.wait([ref], timeout=0)
                return f"exited with code {ray.get(ref)}" if ready else None
            code = ray.get(actor.exit_code.remote(), timeout=30)  # adopted: ask the actor
            return None if code is None else f"exited with code {code}"
        except ray.exceptions.RayActorError as e:
            return f"actor ended ({_first_line(e)})"
        except ray.exceptions.GetTimeoutError:
            return None
        except Exception as e:  # noqa: BLE001 - any other task error ends the worker too
            return f"failed ({type(e).__name__}: {_first_line(e)})"

    def _kill(self, worker: str) -> None:
        import ray

        actor = self.actors.get(worker)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _before_directive(self) -> None:
        import ray

        self._gpus_free_before = ray.available_resources().get("GPU", 0.0)

    def _after_gone(self, workers: Sequence[str], timeout: float) -> None:
        """Leavers' actors dead and Ray counting their GPUs free before inference may take them."""
        import ray

        workers = [w for w in workers if w in self.actors]
        if not workers:
            return
        for w in workers:
            self._kill(w)
            self.actors.pop(w, None)
            self._runs.pop(w, None)
        target = self._gpus_free_before + len(gpu_workers(workers, self.keepers))
        deadline = time.monotonic() + timeout
        while ray.available_resources().get("GPU", 0.0) < target - 1e-9:
            if time.monotonic() > deadline:
                log.warning("job %s: Ray shows %.1f GPUs free, expected >= %.1f after %d workers left", self.job,
                            ray.available_resources().get("GPU", 0.0), target, len(workers))
                return
            time.sleep(0.02)

    def stop(self, timeout: float | None = None) -> Any:
        """Stop the workers at a step boundary, then remove every actor of the job, coordinator included."""
        self._before_directive()
        gone = set(self.exit_reasons)  # already gone (a lost worker): its GPU is free in the snapshot
        try:
            st = super().stop(timeout)
        finally:
            self._after_gone([w for w in self.actors if w not in gone], 10.0)
            try:
                import ray

                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        return st


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else type(e).__name__
