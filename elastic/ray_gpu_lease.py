"""A Ray actor that only holds GPUs in Ray's books, for a pre-started training worker.

A joining training worker spends seconds starting before it can do anything: a new Ray
worker process, then importing torch and the trainer (3.3 s of a 4.4 s grow on an idle
2-core machine, 3.8-5 s under load; ``benchmarks`` notes). A *spare* worker actor started
ahead without a GPU (``num_gpus=0``) has done all of that; when a grow needs a joiner, the
backend creates a :class:`GpuLease` with the GPUs the joiner needs, pinned to the spare's
node, and the spare starts training once Ray has granted the lease (the lease's
``gpu_ids()`` is the argument of its ``run``). The lease lives exactly as long as the worker:
whoever ends the worker kills its lease, which frees the GPUs in Ray's books.

This module imports nothing but Ray: a lease's process must start in a fraction of a second.
"""

from __future__ import annotations

import functools
from typing import Any

import ray


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
