"""Forget torch's DTensor caches that outlive a process group.

What it is for: a process that destroys its process groups and builds new ones (an in-place
rescale, a test pool that reuses its processes) builds new device meshes that compare *equal*
to old ones: ``DeviceMesh.__eq__`` looks at ranks, layout, dim names and thread, not at the
process groups. torch caches DTensor sharding propagation and redistribute planning by mesh,
so a new mesh equal to an old one that is still referenced (a cached output spec keeps it)
gets back the old mesh, and the first collective on it fails with "Could not resolve the
process group registered under the name ..." (or talks to a group that no longer exists).
Call :func:`clear_dtensor_caches` after ``destroy_process_group`` and before building the new
meshes.

Must not: touch process groups or tensors.
"""

from __future__ import annotations

__all__ = ["clear_dtensor_caches"]


def clear_dtensor_caches() -> None:
    """Drop torch's per-mesh DTensor caches (C++ and Python sharding propagation, tensor meta,
    redistribute plans)."""
    import torch
    from torch.distributed.tensor import DTensor

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's own cache of output specs
        native()
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache = getattr(prop, name, None)
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # a torch without the planner cache
        return
    clear_redistribute_planner_cache()
