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

:class:`Manager` wraps a user's own training loop and rescales it at step boundaries: under a
job the controller launched (``python -m elastic.torch.run``, the layouts from the job's
coordinator) or on a local schedule of :class:`MeshLayout`; :mod:`elastic.torch.data` gives
every step the same samples at every layout (:func:`prepare_corpus`, :class:`TokenCorpus`,
:func:`micro_batches`).
"""

from elastic.reshard.plan import ReshardError
from elastic.reshard.regions import PlacementError, Region, shard_region
from elastic.torch.caches import clear_dtensor_caches
from elastic.torch.coordinated import StepGivenUp, StepInterrupted
from elastic.torch.data import Batch, CorpusError, TokenCorpus, micro_batches, prepare_corpus, step_samples
from elastic.torch.manager import Manager, MeshLayout, RNGState, World
from elastic.torch.reshard import ReshardStats, mesh_order, reshard
from elastic.torch.state import init_optimizer_state, load_training_state, training_state

__all__ = [
    "Batch",
    "CorpusError",
    "Manager",
    "MeshLayout",
    "PlacementError",
    "Region",
    "ReshardError",
    "ReshardStats",
    "RNGState",
    "StepGivenUp",
    "StepInterrupted",
    "TokenCorpus",
    "World",
    "clear_dtensor_caches",
    "init_optimizer_state",
    "load_training_state",
    "mesh_order",
    "micro_batches",
    "prepare_corpus",
    "reshard",
    "shard_region",
    "step_samples",
    "training_state",
]
