"""torchtitan's llama3 debug model on the Manager's mesh: the user's ``build(world)`` for it.

What it is for: :mod:`examples.titan.job` trains torchtitan's own llama3 (its ``debugmodel``
flavor cut to two layers, a byte vocabulary, sequence length 32) with torchtitan's own
parallelize code (``parallelize_llama``: its TP plan with sequence parallel, then FSDP2 over
the data-parallel dim) on whatever mesh :class:`elastic.torch.Manager` hands ``build``. Every
layout starts from the same global weights (built and initialised whole from one seed by
torchtitan's ``init_states``, then distributed), so a rescaled run and a single process train
the same model.

torchtitan builds its device meshes itself, from the default process group
(``ParallelDims.build_mesh``). Under the Manager the mesh is given (a layout may hold only some
of the processes, and only its members call ``build``), so :class:`MeshParallelDims` is
torchtitan's ``ParallelDims`` whose ``build_mesh`` takes the mesh's dims instead of creating any.

Running torchtitan on CPU with gloo takes the shims in :func:`apply_cpu_shims`,
:func:`llama_config` and :func:`force_sum_reduction`, each with its reason; none changes what
gets sharded or how. (torchtitan's device-type fallback to "cuda" only matters to its own
``build_mesh``, which is not used here.)

Must not: import anything from ``tests/``, re-implement torchtitan's TP plan or FSDP wrapping,
or create process groups (``build`` runs on the new layout's members only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torchtitan.distributed import ParallelDims

__all__ = ["SEQ", "VOCAB", "MeshParallelDims", "apply_cpu_shims", "build_model", "llama_config"]

SEQ = 32  # training sequence length
VOCAB = 258  # 256 bytes + end-of-document (TokenCorpus's byte tokens), padded so that tp=2 divides it
N_LAYERS = 2
SPMD_BACKEND = "partial_dtensor"


def apply_cpu_shims(dtype: torch.dtype) -> None:
    """The process-wide switches torchtitan's model code needs outside its trainer, on CPU/gloo. Idempotent."""
    import torchtitan.config as tt_config
    from torchtitan.distributed.utils import set_spmd_backend

    # torchtitan 0.3.0 defaults to the "spmd_types" backend, whose parameters are plain tensors
    # with type annotations that FSDP2 refuses outside torchtitan's trainer; "partial_dtensor"
    # keeps TP parameters DTensors on "tp" with FSDP2 on top. ParallelDims gets the same value;
    # this is the switch torchtitan's runtime helpers read.
    set_spmd_backend(SPMD_BACKEND)
    # parallelize_llama looks the training dtype up in TORCH_DTYPE_MAP (float16/bfloat16/float32
    # only) for FSDP2's mixed-precision policy; without float64 there, a float64 model would be
    # computed and reduced in lower precision and layouts could not be compared closely.
    tt_config.TORCH_DTYPE_MAP.setdefault(str(dtype).removeprefix("torch."), dtype)


def llama_config() -> Any:
    """torchtitan's llama3 ``debugmodel`` (dim 256, 16 heads, fused QKV), two layers, vocabulary
    :data:`VOCAB`, RoPE sized to :data:`SEQ`, causal SDPA, its sharding config filled in."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:N_LAYERS]  # the first layers' configs are those of a 2-layer model
    cfg.vocab_size = VOCAB
    cfg.tok_embeddings = dataclasses.replace(cfg.tok_embeddings, num_embeddings=VOCAB)
    cfg.lm_head = dataclasses.replace(cfg.lm_head, out_features=VOCAB)
    for layer in cfg.layers:
        # FlexAttention has no CPU backward, and torchtitan refuses "sdpa" by name for language
        # models (it wants its loader's document masks); its SDPA module is causal by default,
        # right for a batch of unpacked sequences
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # the RoPE cache defaults to 131072 positions; torchtitan's trainer resizes it to the
        # training sequence length, and so do we
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    # the trainer fills sharding_config in update_from_config, which imports torchtitan.trainer
    # (tensorboard, wandb, datasets...); the setter it calls does the whole job
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


@dataclasses.dataclass
class MeshParallelDims(ParallelDims):
    """torchtitan's ParallelDims over a mesh made elsewhere: ``mesh`` with a data-parallel dim
    ``dp_dim`` (FSDP2 shards on it) and a ``tp`` dim. Only the meshes the ``partial_dtensor``
    backend asks for exist ("fsdp", "tp", "batch", "loss"); ``pp``, ``cp``, ``ep`` stay 1."""

    mesh: Any = None
    dp_dim: str = "dp_shard"

    @classmethod
    def of(cls, mesh: Any, dp_dim: str) -> MeshParallelDims:
        names = tuple(mesh.mesh_dim_names or ())
        if dp_dim not in names or "tp" not in names:
            raise ValueError(f"mesh dims {names}: need the data-parallel dim {dp_dim!r} and 'tp' (size 1 is fine)")
        dp, tp = mesh.size(names.index(dp_dim)), mesh.size(names.index("tp"))
        return cls(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=dp * tp,
                   spmd_backend=SPMD_BACKEND, mesh=mesh, dp_dim=dp_dim)

    def build_mesh(self) -> Any:
        # slicing a mesh by dim name reuses its groups: no collective, unlike torchtitan's own
        # build_mesh (init_device_mesh over the whole default group)
        dp = self.mesh[self.dp_dim]
        self._single_axis_meshes = {"fsdp": dp, "batch": dp, "loss": dp, "tp": self.mesh["tp"]}
        self._global_meshes = {"dense": self.mesh}
        self._world_mesh = self.mesh
        return self.mesh


def force_sum_reduction(model: nn.Module) -> None:
    """gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for its gradient reduce-scatter once a
    divide factor is set (torchtitan sets 1.0: its loss is already a share of the global mean);
    with a factor of 1, plain SUM gives the same gradients."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def build_model(world: Any, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """torchtitan's llama3 on ``world.mesh`` (dims: the data-parallel one and "tp"), parallelized by
    torchtitan's ``parallelize_llama``. The whole model is built and initialised on CPU from
    ``seed`` first, so every layout holds slices of the same global tensors."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    dp_dim = world.dp_dim or "dp_shard"
    if dp_dim == "dp_replicate":
        # FSDP2 would shard over it, and a job that declares replicas expects a full copy per rank
        raise ValueError("this example shards parameters over the data-parallel dim (FSDP2): name it dp_shard, "
                         "not dp_replicate")
    apply_cpu_shims(dtype)
    cfg = llama_config()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created and initialised in ``dtype``
    try:
        with torch.device("cpu"):
            torch.manual_seed(seed)
            model = cfg.build()
            torch.manual_seed(seed)  # torchtitan's init functions draw from the global generator
            model.init_states()
    finally:
        torch.set_default_dtype(prev)
    pd = MeshParallelDims.of(world.mesh, dp_dim)
    name = str(dtype).removeprefix("torch.")
    parallelize_llama(
        model,
        parallel_dims=pd,
        training=TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name),
        parallelism=ParallelismConfig(data_parallel_shard_degree=pd.dp_shard, tensor_parallel_degree=pd.tp,
                                      spmd_backend=SPMD_BACKEND),
        compile_config=CompileConfig(enable=False),
        ac_config=None,  # no activation checkpointing
        dump_folder="/nonexistent",  # read only by activation checkpointing's debug dumps
    )
    force_sum_reduction(model)
    return model
