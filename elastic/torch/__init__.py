"""``elastic.torch``: reshard any PyTorch model's training state between device meshes, in memory.

The library call, on every old and new worker of a rescale::

    src = elastic.torch.training_state(model, optimizer)                 # on the old mesh
    new_model, new_optimizer = build(new_mesh)                           # your parallelize code
    dst = elastic.torch.training_state(new_model, new_optimizer, init_optimizer=True)
    stats = elastic.torch.reshard(src, dst)                              # collective: src=None joins, dst=None leaves

Only the bytes no local copy holds cross the network, straight into ``dst``'s shards.
:func:`mesh_order` says which worker should take which position of the new mesh to keep the
most bytes local; :func:`shard_region` is the pure region math (torch's own chunking rule).
A process that destroys its process groups and builds new ones calls
:func:`clear_dtensor_caches` in between (torch's DTensor caches would hand out old meshes).
"""

from elastic.reshard.plan import ReshardError
from elastic.reshard.regions import PlacementError, Region, shard_region
from elastic.torch.caches import clear_dtensor_caches
from elastic.torch.reshard import ReshardStats, mesh_order, reshard
from elastic.torch.state import init_optimizer_state, load_training_state, training_state

__all__ = [
    "PlacementError",
    "Region",
    "ReshardError",
    "ReshardStats",
    "clear_dtensor_caches",
    "init_optimizer_state",
    "load_training_state",
    "mesh_order",
    "reshard",
    "shard_region",
    "training_state",
]
