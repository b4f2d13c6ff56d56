"""Training jobs whose workers are Ray actors holding one GPU each: :class:`TrainingJobHandle`.

What it is for: the Ray backend (embedded local Ray with logical GPUs, or a real cluster)
starts, rescales and stops elastic training jobs through this handle. Each worker is an
actor with ``num_gpus=1`` (Ray assigns and isolates the device) and ``num_cpus=0`` by
default (so 8 workers fit a 2-CPU local Ray; give real CPUs on a cluster). The actor runs
the worker agent (:mod:`elastic.train.agent`) in its own process, exactly as a Kubernetes
pod runs ``python -m elastic.train.worker``, except for how it ends: ``os._exit`` inside an
actor reads to Ray as a crash ("A worker died or was killed while executing a task by an
unexpected system error", once per leaver), so the agent runs with ``exit_on_leave`` off and
``run()`` simply returns its exit code. The handle then ``ray.kill``s the finished actor
(:meth:`TrainingJobHandle._reap`, from the rescale and from the watcher thread): the process
ends without an interpreter teardown, Ray records an intended kill, and the GPU is free.

What it must not do: choose layouts or placements (the controller does), or start Ray
behind the caller's back (call :func:`init_local_ray` or ``ray.init`` first).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from elastic.train.launch import JobHandle, gpu_workers

log = logging.getLogger(__name__)

LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                 "RAY_USAGE_STATS_ENABLED": "0"}


def init_local_ray(num_gpus: int = 8, num_cpus: int = 2, object_store_bytes: int = 200 * 2**20) -> Any:
    """Start an embedded single-node Ray on loopback with ``num_gpus`` logical GPUs (idempotent).

    The cluster's processes start with the worker memory settings
    (:func:`elastic.train.procenv.worker_memory_env`): Ray's worker processes, the training
    workers' actors among them, inherit the raylet's environment, and those variables only
    act when set at a process's start (a per-actor ``runtime_env`` would set them too, but
    costs ~0.5 s per actor start). The caller's own environment is left as it was.
    """
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    from elastic.train.procenv import worker_memory_env

    if ray.is_initialized():
        return ray
    mem = worker_memory_env(os.environ)
    saved = {k: os.environ.get(k) for k in mem}
    os.environ.update(mem)
    try:
        # Ray's own start-up lines at WARNING, as elastic.logs keeps every library (DEBUG: all)
        quiet = logging.getLogger().getEffectiveLevel() > logging.DEBUG
        # address="local": a Ray of this process's own, never a cluster some other program
        # started on this machine (plain ray.init() would join the last one `ray start` made)
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 object_store_memory=object_store_bytes, _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level=logging.WARNING if quiet else logging.DEBUG)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ray


def _worker_actor_class(num_gpus: float, num_cpus: float) -> Any:
    import ray

    class ElasticTrainWorker:
        """One training worker: runs the agent until the job stops or this worker leaves."""

        def run(self, env: dict[str, str]) -> int:
            """Train until the job stops or this worker leaves; returns the exit code (the handle kills us then)."""
            env = {**env, "ELASTIC_EXIT_ON_LEAVE": "0"}
            os.environ.update(env)
            from elastic.train.worker import main

            code = main({**os.environ, **env})
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            return code

        def pid(self) -> int:
            return os.getpid()

    # max_concurrency=2: pid() answers while run() occupies the actor
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=0, max_concurrency=2)(ElasticTrainWorker)


class TrainingJobHandle(JobHandle):
    """An elastic training job on Ray: ``start``, ``rescale``, ``status``, ``stop`` (see :class:`JobHandle`)."""

    def __init__(self, job: str, cfg: Any, *, num_gpus_per_worker: float = 1, num_cpus_per_worker: float = 0,
                 **kw: Any) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call elastic.train.ray_handle.init_local_ray() or ray.init()")
        super().__init__(job, cfg, **kw)
        self._cls = _worker_actor_class(num_gpus_per_worker, num_cpus_per_worker)
        self._keeper_cls = _worker_actor_class(0, num_cpus_per_worker)  # holds a paused job's state: no GPU
        self.actors: dict[str, Any] = {}
        self._runs: dict[str, Any] = {}
        self._gpus_free_before = 0.0
        self._gpus_per_worker = num_gpus_per_worker

    def _spawn(self, worker: str, env: dict[str, str]) -> None:
        actor = (self._keeper_cls if env.get("ELASTIC_KEEPER") == "1" else self._cls).remote()
        self.actors[worker] = actor
        self._runs[worker] = actor.run.remote(env)

    def _exit_reason(self, worker: str) -> str | None:
        import ray

        ref = self._runs.get(worker)
        if ref is None:
            return "was never started"
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            return f"exited with code {ray.get(ref)}"
        except ray.exceptions.RayActorError as e:
            return f"actor died ({_first_line(e)})"
        except Exception as e:  # noqa: BLE001 - any other task error ends the worker too
            return f"failed ({type(e).__name__}: {_first_line(e)})"

    def _kill(self, worker: str) -> None:
        import ray

        actor = self.actors.get(worker)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def _reap(self, worker: str) -> None:
        """``run()`` returned: the actor only holds its GPU now; end it (an intended kill, not a crash)."""
        self._kill(worker)

    def _handed_on(self, workers: Sequence[str]) -> float:
        """GPUs of ``workers`` (gone) that stay booked in Ray for their next holder instead of being
        freed (a subclass that hands GPU leases over, see ``elastic.backends.ray``); none here."""
        return 0.0

    def _before_directive(self) -> None:
        import ray

        self._gpus_free_before = ray.available_resources().get("GPU", 0.0)

    def _after_gone(self, workers: Sequence[str], timeout: float) -> None:
        """Make sure the leavers' actors are dead and Ray counts their GPUs free again, then forget them.

        Ray releases a dead actor's resources asynchronously (tens of ms after the process is
        gone); the controller must not hand those GPUs to inference before Ray agrees, so wait
        until the free count has grown by the leavers' GPUs (best effort: another tenant
        allocating meanwhile shows up as a warning after ``timeout``).
        """
        import ray

        workers = [w for w in workers if w in self.actors]
        if not workers:
            return
        for w in workers:
            self._kill(w)
        deadline = time.monotonic() + timeout
        for w in workers:
            ray.wait([self._runs[w]], timeout=max(0.0, deadline - time.monotonic()))
            self._observe_exit(w)
            self.actors.pop(w, None)
            self._runs.pop(w, None)
        # (a leaver whose GPU lease is kept for the GPU's next holder leaves it booked: _handed_on)
        target = (self._gpus_free_before + len(gpu_workers(workers, self.keepers)) * self._gpus_per_worker
                  - self._handed_on(workers))
        while ray.available_resources().get("GPU", 0.0) < target - 1e-9:
            if time.monotonic() > deadline:
                log.warning("job %s: Ray shows %.1f GPUs free, expected >= %.1f after %d workers left",
                            self.job, ray.available_resources().get("GPU", 0.0), target, len(workers))
                return
            time.sleep(0.005)

    def stop(self, timeout: float | None = None) -> Any:
        self._before_directive()
        gone = set(self.exit_reasons)  # already gone (a lost worker): its GPU is free in the snapshot
        st = super().stop(timeout)
        self._after_gone([w for w in self.actors if w not in gone], 10.0)
        return st


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else type(e).__name__
