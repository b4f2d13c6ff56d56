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
from elastic.reshard.regions import (
    Region,
    full_region,
    normalize_placements,
    region_numel,
    region_shape,
    shard_region,
)

__all__ = ["is_dtensor", "local_region", "local_tensor", "mesh_coordinate", "mesh_fingerprint", "placements_of"]


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def mesh_fingerprint(mesh: Any) -> str:
    """The same string on every process for the same mesh: its shape, dim names and global ranks."""
    ranks = mesh.mesh.flatten().tolist()
    text = repr((tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), ranks))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def mesh_coordinate(mesh: Any) -> tuple[int, ...] | None:
    """This process's position on each mesh dim, as torch's collectives and FSDP2 order the dim.

    ``DeviceMesh`` builds each dim's process group with ``new_group``, which sorts its ranks,
    and the data follows the group's order: ``distribute_tensor`` scatters chunk ``i`` to group
    rank ``i``, ``full_tensor`` gathers in group order, FSDP2 shards by group rank. So on a mesh
    whose ranks do not increase along a dim (``DeviceMesh("cpu", torch.tensor([0, 2, 1]))``)
    rank 1 holds the second chunk and rank 2 the third, whatever ``get_coordinate()`` says.
    The position is the rank's index among its sorted dim peers; on a mesh whose ranks
    increase along every dim it is the coordinate.
    """
    import torch.distributed as dist

    coord = mesh.get_coordinate()
    if coord is None:
        return None
    rank = dist.get_rank()
    grid = mesh.mesh
    out = []
    for d in range(grid.ndim):
        idx: list[Any] = list(coord)
        idx[d] = slice(None)
        out.append(sorted(grid[tuple(idx)].tolist()).index(rank))
    return tuple(out)


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


def local_region(t: torch.Tensor, position: tuple[int, ...] | None = None) -> Region:
    """The global region ``t`` holds on this process (a plain tensor: all of it), checked against torch.

    ``position`` is :func:`mesh_coordinate` of ``t``'s mesh when the caller already has it (a
    model's thousand tensors share a few meshes, and ``DeviceMesh.mesh`` rebuilds its tensor on
    every access)."""
    if not is_dtensor(t):
        return full_region(tuple(t.shape))
    coord = position if position is not None else mesh_coordinate(t.device_mesh)
    if coord is None:
        raise ReshardError("a DTensor whose mesh does not contain this process; it holds nothing to move")
    region = shard_region(tuple(t.shape), tuple(t.device_mesh.shape), coord, placements_of(t))
    got = tuple(local_tensor(t).shape)
    # an empty region is () on every dim, while torch keeps the other dims of an empty shard
    # ((0, 10) for a trailing chunk of rows): both hold nothing
    empty = region_numel(region) == 0 and 0 in got
    if not empty and region_shape(region) != got:
        raise ReshardError(
            f"a DTensor of global shape {list(t.shape)} with placements {t.placements} on a mesh of shape "
            f"{list(t.device_mesh.shape)} holds a local shard of shape {list(got)} at position {list(coord)}, "
            f"but torch's sharding rule gives {list(region_shape(region))}: this torch version shards differently "
            "from the rule elastic follows; the state cannot be resharded safely"
        )
    return region
