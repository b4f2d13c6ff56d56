"""What a live tensor holds of its global tensor: the bridge from DTensor to ``elastic.reshard.regions``.

What it is for: :func:`elastic.torch.reshard` describes each worker's state as (global shape,
mesh, coordinate, placements); the region math itself is pure and lives in
``elastic/reshard/regions.py`` (torch's chunking rule, ``_StridedShard``, uneven and empty
shards). This module reads those facts off DTensors and device meshes, and checks our region
against the local tensor torch really holds, so a torch release that shards differently is
caught as a clear error instead of moving wrong bytes.

Must not: communicate, or touch tensor values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from elastic.reshard.plan import ReshardError
from elastic.reshard.regions import Region, full_region, normalize_placements, region_shape, shard_region

__all__ = ["is_dtensor", "local_region", "local_tensor", "mesh_fingerprint", "placements_of"]


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def mesh_fingerprint(mesh: Any) -> str:
    """The same string on every process for the same mesh: its shape, dim names and global ranks."""
    ranks = mesh.mesh.flatten().tolist()
    text = repr((tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), ranks))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def placements_of(dt: Any) -> tuple:
    """The DTensor's placements as plain tuples (``("shard", d)``, ``("strided", d, sf)``, ...)."""
    spec = dt._spec
    order = getattr(spec, "shard_order", None)
    if order is not None and not getattr(spec, "use_strided_shard_as_shard_order", False):
        default = type(spec).compute_default_shard_order(spec.placements)
        if tuple(order) != tuple(default):
            raise ReshardError(
                f"a DTensor with an explicit shard order {order} (placements {dt.placements}): only the "
                "default left-to-right order and _StridedShard are supported; redistribute it first"
            )
    return normalize_placements(dt.placements, dt.ndim)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The memory a worker holds: the DTensor's local shard (the same storage), or the tensor itself."""
    with torch.no_grad():
        local = t.to_local() if is_dtensor(t) else t
    return local.detach() if local.requires_grad else local


def local_region(t: torch.Tensor) -> Region:
    """The global region ``t`` holds on this process (a plain tensor: all of it), checked against torch."""
    if not is_dtensor(t):
        return full_region(tuple(t.shape))
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        raise ReshardError("a DTensor whose mesh does not contain this process; it holds nothing to move")
    region = shard_region(tuple(t.shape), tuple(t.device_mesh.shape), coord, placements_of(t))
    got = tuple(local_tensor(t).shape)
    if region_shape(region) != got:
        raise ReshardError(
            f"a DTensor of global shape {list(t.shape)} with placements {t.placements} on a mesh of shape "
            f"{list(t.device_mesh.shape)} holds a local shard of shape {list(got)} at coordinate {list(coord)}, "
            f"but torch's sharding rule gives {list(region_shape(region))}: this torch version shards differently "
            "from the rule elastic follows; the state cannot be resharded safely"
        )
    return region
