"""A Ray actor that only holds GPUs in Ray's books, for a pre-started training worker.

A joining training worker spends seconds starting before it can do anything: a new Ray
worker process, then importing torch and the trainer (3.3 s of a 4.4 s grow on an idle
2-core machine, 3.8-5 s under load; ``benchmarks`` notes). A *spare* worker actor started
ahead without a GPU (``num_gpus=0``) has done all of that; when a grow needs a joiner, the
backend creates a :class:`GpuLease` with the GPUs the joiner needs, pinned to the spare's
node, and the spare starts training once Ray has granted the lease (the lease's
``gpu_ids()`` is the argument of its ``run``). The lease lives exactly as long as the worker:
whoever ends the worker kills its lease, which frees the GPUs in Ray's books.

A lease also outlives its holder when the GPU changes hands (:class:`LeaseDesk`): a leaving
replica's lease goes straight to the training worker that joins on that GPU, and a leaving
worker's to the replica a scale-up starts there, with no new lease asked of Ray.

This module imports nothing but Ray: a lease's process must start in a fraction of a second.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import ray

log = logging.getLogger(__name__)


class GpuLease:
    """Holds its GPUs in Ray's books while it lives; does nothing else."""

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray assigned (what ``CUDA_VISIBLE_DEVICES`` is for the worker holding this lease)."""
        return [str(i) for i in ray.get_gpu_ids()]


def on_node(node_id: str | None) -> dict[str, Any]:
    """Actor options pinning it to Ray node ``node_id`` (hard affinity); none for None (Ray places it)."""
    if node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


@functools.cache
def _lease_class() -> Any:
    return ray.remote(GpuLease)  # wrapped once, not for every lease


def lease_actor(num_gpus: float, node_id: str | None) -> Any:
    """Create a lease of ``num_gpus`` on ``node_id`` (hard affinity: the worker runs there)."""
    return _lease_class().options(num_gpus=num_gpus, num_cpus=0, max_restarts=0, **on_node(node_id)).remote()


class LeaseDesk:
    """Leases whose holder has left, kept for the next holder of the same GPUs: a *handover*.

    Without it a GPU passing between serving and training is given back to Ray when one holder
    leaves and asked for again when the next one starts: a new lease actor, that is a Ray
    scheduling round and a process start (0.2-1 s on an idle 2-core machine, ~1 s in the demo,
    most of a spare joiner's start), while the GPU idles. A lease *parked* here under the pool's
    name of its GPU (``key``) keeps the GPU booked in Ray; the next holder of that GPU *takes*
    it and runs at once.

    The books stay exact: what Ray counts used is what the pool's workloads hold plus what is
    parked, and nothing is parked for long. A lease not taken within ``hold_seconds`` is killed
    (:meth:`expire`, called by every :meth:`park` and :meth:`take` and by the backend each tick),
    and before a holder is started the usual way on a parked GPU (a new actor asking Ray for a
    GPU) the lease parked there is released (:meth:`release`), so Ray has that GPU to give.
    Thread-safe.

    The previous holder has been told to stop (a replica) or has left (a worker) when its lease
    is parked; as with a lease killed at once, the next holder does not wait for its process
    to be reaped.
    """

    def __init__(self, hold_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_seconds <= 0:
            raise ValueError(f"hold_seconds must be > 0 (got {hold_seconds})")
        self.hold_seconds = hold_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._parked: dict[Hashable, tuple[Any, float, float]] = {}  # key -> (lease, num_gpus, until)
        self.handed_over = 0  # leases taken by a next holder (each one a lease Ray did not have to start)
        self.given_back = 0  # leases killed unused (expired or released)

    def park(self, key: Hashable, lease: Any, num_gpus: float) -> None:
        """Keep ``lease`` (``num_gpus`` GPUs; its holder has left) for the next holder of ``key``.
        A lease already parked under ``key`` is given back (it cannot be the same GPU twice)."""
        with self._lock:
            old = self._parked.pop(key, None)
            self._parked[key] = (lease, num_gpus, self._clock() + self.hold_seconds)
        if old is not None:
            self._kill(old[0], key, "a newer lease was parked for it")
        self.expire()

    def take(self, key: Hashable | None, num_gpus: float) -> Any | None:
        """The lease parked under ``key`` if it holds ``num_gpus`` GPUs (it is no longer parked);
        None when there is none (ask Ray for a new one). One of another size is given back."""
        self.expire()
        if key is None:
            return None
        with self._lock:
            got = self._parked.pop(key, None)
            if got is not None and got[1] == num_gpus:
                self.handed_over += 1
                return got[0]
        if got is not None:
            self._kill(got[0], key, f"it holds {got[1]:g} GPUs, the next holder needs {num_gpus:g}")
        return None

    def release(self, keys: Iterable[Hashable] | None = None) -> int:
        """Give the leases parked under ``keys`` (all when None) back to Ray; returns how many."""
        with self._lock:
            if keys is None:
                keys = list(self._parked)
            out = [(k, self._parked.pop(k)) for k in list(keys) if k in self._parked]
        for k, (lease, _, _) in out:
            self._kill(lease, k, "released")
        return len(out)

    def expire(self) -> int:
        """Give back the leases parked longer than ``hold_seconds``; returns how many."""
        now = self._clock()
        with self._lock:
            late = [k for k, (_, _, until) in self._parked.items() if until <= now]
            out = [(k, self._parked.pop(k)) for k in late]
        for k, (lease, _, _) in out:
            self._kill(lease, k, f"not taken within {self.hold_seconds:g} s")
        return len(out)

    def parked(self) -> set[Hashable]:
        """The keys (GPUs) whose lease is parked now."""
        with self._lock:
            return set(self._parked)

    def gpus_parked(self, keys: Iterable[Hashable] | None = None) -> float:
        """How many GPUs the leases parked under ``keys`` (all when None) hold in Ray's books."""
        with self._lock:
            chosen = self._parked if keys is None else {k: self._parked[k] for k in keys if k in self._parked}
            return float(sum(n for _, n, _ in chosen.values()))

    def _kill(self, lease: Any, key: Hashable, why: str) -> None:
        self.given_back += 1
        log.debug("GPU lease for %s given back to Ray: %s", key, why)
        try:
            ray.kill(lease, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead: its GPU is free anyway
            pass
