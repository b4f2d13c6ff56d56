"""torchtitan's own llama3 debug model, parallelized by torchtitan's own code, on CPU with gloo.

What it is for: tests that need a *real* third-party training stack (not our ``ModelSpec``
stand-ins) to reshard in place, e.g. FSDP2 x TP2 -> FSDP4 on the same four processes. It
builds the model from torchtitan's ``debugmodel`` flavor (cut to a few layers), gives every
layout the same global weights from one seed, applies ``parallelize_llama`` unchanged
(torchtitan's TP plan through its sharding config, then its ``apply_fsdp_to_decoder``), and
provides a deterministic token stream, a vocab-parallel-aware loss and a small AdamW loop.

What it must not do: re-implement any part of torchtitan's TP plan or FSDP wrapping (the point
is to exercise torchtitan's placements, not our guess at them), reach the network, or change
torchtitan's behaviour beyond the CPU shims, every one of which is listed in
:func:`apply_cpu_shims` with the reason it is needed. It is test support only: nothing under
``elastic/`` may import it.

Needs the packages in ``requirements-torchtitan.txt`` (installed with ``--no-deps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

#: Mesh axis names of the parameters under torchtitan's ``partial_dtensor`` backend: FSDP2
#: shards on "fsdp" (dp_shard folded with cp, which is 1 here), TP on "tp".
FSDP_AXIS, TP_AXIS = "fsdp", "tp"

#: torchtitan's SPMD backend used here (see shim 2).
SPMD_BACKEND = "partial_dtensor"

_shimmed_dtypes: set[torch.dtype] = set()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def apply_cpu_shims(dtype: torch.dtype = torch.float64) -> None:
    """Every change to torchtitan's process-wide behaviour, in one place. Idempotent.

    Each shim is the smallest switch that lets torchtitan's own code run on a CPU-only gloo
    machine; none of them changes what gets sharded or how. Shims 4-6 act on one model or
    config and live where they act; they are listed here so this is the one place to read.

    4. Causal SDPA instead of FlexAttention: :func:`llama_config`.
    5. The llama3 sharding-config setter called directly: :func:`llama_config`.
    6. FSDP2 gradient reduction forced to SUM on gloo: :func:`force_sum_reduction`.
    """
    if dtype in _shimmed_dtypes:
        return
    import torchtitan.config as tt_config
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    # 1. Device type. torchtitan picks its device once, at import
    #    (``_get_available_device_type() or "cuda"``), and ParallelDims.build_mesh passes that
    #    module-level name to ``init_device_mesh``. With no accelerator it is "cuda", which
    #    gloo cannot serve; "cpu" is what build_mesh must see.
    tt_parallel_dims.device_type = "cpu"

    # 2. SPMD backend. torchtitan 0.3.0 defaults to "spmd_types" (parameters stay plain
    #    tensors carrying type annotations); outside its trainer FSDP2 then refuses them
    #    ("all parameters must be DTensors on the full SPMD mesh"). "full_dtensor" builds, but
    #    its forward wants every input already a DTensor on the full mesh (trainer plumbing).
    #    "partial_dtensor" is the classic path our resharder understands: TP parameters are
    #    DTensors on "tp" and FSDP2 adds the "fsdp" axis; plain tensors go in and out.
    #    ParallelDims and ParallelismConfig get the same value (see ``build_titan_llama``);
    #    this sets the process-wide switch that torchtitan's runtime helpers read.
    set_spmd_backend(SPMD_BACKEND)

    # 3. Training dtype. ``parallelize_llama`` looks ``training.mixed_precision_param`` and
    #    ``_reduce`` up in ``TORCH_DTYPE_MAP``, which knows only float16/bfloat16/float32, and
    #    hands them to FSDP2's MixedPrecisionPolicy: every choice it offers would compute and
    #    reduce a float64 model in lower precision, and layouts could no longer be compared to
    #    1e-9. Adding the missing entry keeps ``parallelize_llama`` itself unchanged.
    tt_config.TORCH_DTYPE_MAP.setdefault(_dtype_name(dtype), dtype)
    _shimmed_dtypes.add(dtype)


def llama_config(*, n_layers: int = 2, seq_len: int = 32) -> Any:
    """torchtitan's llama3 ``debugmodel`` config (dim 256, 16 heads, fused QKV, vocab 2048),
    cut to ``n_layers``, RoPE sized to ``seq_len``, with its sharding config filled in."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    # The first layers' configs (their init std is depth-scaled by layer id) are exactly those
    # a debug model with n_layers layers would have.
    cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        # Shim 4: FlexAttention has no CPU backward, and torchtitan's ``get_attention_config``
        # refuses "sdpa" for language models (it wants per-document masks from its loader).
        # Its own ScaledDotProductAttention module, ``is_causal=True`` by default, is plain
        # causal attention: right for a batch of unpacked sequences, and runs on CPU.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # The RoPE cache defaults to 131072 positions; torchtitan's trainer resizes it to the
        # training sequence length (``Decoder.Config.update_from_config``), and so do we.
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    # Shim 5: the trainer fills ``sharding_config`` in ``Llama3Model.Config.update_from_config``,
    # which imports ``torchtitan.trainer`` and with it tensorboard, wandb, datasets... The
    # setter it calls does the whole job. Sequence parallel on: torchtitan's default.
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


def force_sum_reduction(model: nn.Module) -> None:
    """Shim 6: gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for its gradient
    reduce-scatter once a divide factor is set (``apply_fsdp_to_decoder`` sets 1.0, because
    torchtitan scales the loss by the global token count itself). With a factor of 1, plain
    SUM gives the same gradients."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


@dataclass
class TitanLlama:
    """A built model and what a training loop or a resharder needs next to it."""

    model: nn.Module
    dp_shard: int
    tp: int
    vocab_size: int
    seq_len: int
    #: torchtitan's ParallelDims; None on one process without parallelism.
    parallel_dims: Any = None
    #: the mesh the parameters live on: ("fsdp", "tp") of shape (dp_shard, tp) when tp > 1,
    #: else ("fsdp",); None without parallelism.
    mesh: DeviceMesh | None = None
    #: created by :func:`train_steps` on first use.
    optimizer: torch.optim.Optimizer | None = None

    @property
    def dp_rank(self) -> int:
        """Which block of the global batch this process trains on (TP peers share one)."""
        return 0 if self.mesh is None else self.mesh.get_local_rank(FSDP_AXIS)

    def loss_context(self) -> Any:
        """What the loss *and its backward* must run in: torch's ``loss_parallel`` under TP
        (torchtitan's plan leaves the logits a DTensor sharded on the vocab), else nothing."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor, global_tokens: int,
                         backward: bool = True) -> torch.Tensor:
        """Forward, loss and (unless ``backward`` is false) backward; returns this process's
        share of the global mean loss as a detached plain scalar.

        torchtitan's FSDP wrapping sums gradients over the data-parallel ranks (divide factor
        1), so a rank's loss is its summed token losses over the *global* token count, and the
        global mean is the sum of the shares over the data-parallel ranks (:meth:`global_sum`).
        """
        with self.loss_context(), (contextlib.nullcontext() if backward else torch.no_grad()):
            loss = cross_entropy(self.model(tokens), labels) / global_tokens
            if backward:
                loss.backward()
        return (loss.to_local() if isinstance(loss, DTensor) else loss).detach()

    def global_sum(self, share: torch.Tensor) -> float:
        """Sum of a per-rank share over the data-parallel ranks (the same on every rank)."""
        if self.mesh is not None:
            share = share.clone()
            dist.all_reduce(share, group=self.mesh.get_group(FSDP_AXIS))
        return share.item()


def build_titan_llama(*, dp_shard: int = 1, tp: int = 1, dtype: torch.dtype = torch.float64, seed: int = 0,
                      n_layers: int = 2, seq_len: int = 32) -> TitanLlama:
    """torchtitan's llama3 debug model, with the same global weights for every layout.

    ``dp_shard * tp`` must equal the default process group's world size: torchtitan's
    ParallelDims builds its meshes from that group itself, so no mesh is passed in; the one
    the parameters end up on is returned as ``.mesh``. Without a process group (and
    ``dp_shard == tp == 1``) the model comes back unparallelized: the single-process reference.

    The full model is built and initialised on CPU from ``seed`` by torchtitan's own
    ``init_states`` before torchtitan distributes it, so every rank of every layout holds
    slices of the same global tensors. (torchtitan's trainer instead initialises the already
    sharded model, whose random stream depends on the layout.)
    """
    apply_cpu_shims(dtype)
    cfg = llama_config(n_layers=n_layers, seq_len=seq_len)
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
    out = TitanLlama(model=model, dp_shard=dp_shard, tp=tp, vocab_size=cfg.vocab_size, seq_len=seq_len)
    if not dist.is_initialized():
        assert dp_shard == tp == 1, "a parallel layout needs a process group"
        return out
    assert dist.get_world_size() == dp_shard * tp, f"world size {dist.get_world_size()} != {dp_shard} x {tp}"

    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    pd = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, world_size=dp_shard * tp,
                      spmd_backend=SPMD_BACKEND)
    name = _dtype_name(dtype)
    parallelize_llama(
        model,
        parallel_dims=pd,
        training=TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name),
        parallelism=ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                                      spmd_backend=SPMD_BACKEND),
        compile_config=CompileConfig(enable=False),
        ac_config=None,  # no activation checkpointing
        dump_folder="/nonexistent",  # read only by activation checkpointing's debug dumps
    )
    force_sum_reduction(model)
    out.parallel_dims = pd
    out.mesh = pd.get_mesh([FSDP_AXIS, TP_AXIS]) if tp > 1 else pd.get_mesh(FSDP_AXIS)
    return out


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy over the vocab, in the logits' dtype (torchtitan's own loss casts
    to float32, which would hide float64 differences between layouts). Vocab-sharded DTensor
    logits need :meth:`TitanLlama.loss_context`; the result is then a replicated DTensor."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum")


def batch(step: int, global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (tokens, labels), both ``(global_batch, seq_len)`` int64,
    labels being the next token. Uniform random tokens from a generator seeded by
    ``(seed, step)``: the same on every process for the same arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def local_batch(m: TitanLlama, step: int, global_batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's rows of :func:`batch`: contiguous blocks by data-parallel rank."""
    assert global_batch % m.dp_shard == 0, f"global batch {global_batch} over {m.dp_shard} ranks"
    tokens, labels = batch(step, global_batch, m.seq_len, m.vocab_size, seed)
    per = global_batch // m.dp_shard
    return tokens[m.dp_rank * per:(m.dp_rank + 1) * per], labels[m.dp_rank * per:(m.dp_rank + 1) * per]


def train_steps(m: TitanLlama, steps: int, *, global_batch: int = 4, lr: float = 1e-3, seed: int = 0,
                first_step: int = 0) -> list[float]:
    """AdamW steps ``first_step .. first_step + steps - 1`` on :func:`local_batch`; returns the
    global mean loss of each (the same on every rank). The optimizer lives on ``m.optimizer``,
    so a later call (e.g. after a reshard has replaced its state) continues the same run.
    No gradient clipping (torchtitan's trainer clips at norm 1; it adds nothing here)."""
    if m.optimizer is None:
        m.optimizer = torch.optim.AdamW(m.model.parameters(), lr=lr)
    out = []
    for step in range(first_step, first_step + steps):
        tokens, labels = local_batch(m, step, global_batch, seed)
        share = m.forward_backward(tokens, labels, global_batch * m.seq_len)
        m.optimizer.step()
        m.optimizer.zero_grad()
        out.append(m.global_sum(share))
    return out


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state.

    ``apply_fsdp_to_decoder`` wraps the last unit (``norm`` + ``lm_head``) with
    ``reshard_after_forward=False``, so after a forward without backward those parameters stay
    registered as their unsharded (TP-only) tensors until the next backward. Anything that
    reads or replaces the sharded parameters (a resharder) must call this after an eval."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


def evaluate(m: TitanLlama, step: int, *, global_batch: int = 4, seed: int = 0) -> float:
    """The global mean loss on :func:`batch` ``step`` without updating anything; leaves the
    parameters sharded (see :func:`reshard_all`)."""
    tokens, labels = local_batch(m, step, global_batch, seed)
    share = m.forward_backward(tokens, labels, global_batch * m.seq_len, backward=False)
    reshard_all(m.model)
    return m.global_sum(share)


def full_tensors(m: TitanLlama) -> dict[str, torch.Tensor]:
    """Every parameter as its full global tensor (a collective: call on all ranks)."""
    return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for name, p in m.model.named_parameters()}


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """A bitwise fingerprint of each tensor, for comparing processes and layouts."""
    # reshape(-1): a 0-d tensor (Adam's step) has no byte view
    return {k: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for k, t in tensors.items()}


def describe(m: TitanLlama) -> list[tuple[str, str, tuple | None, tuple, tuple | None]]:
    """(name, type, placements, local shape, mesh dim names) of every parameter."""
    return [(name, type(p).__name__, tuple(p.placements) if isinstance(p, DTensor) else None,
             tuple((p.to_local() if isinstance(p, DTensor) else p).shape),
             tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else None)
            for name, p in m.model.named_parameters()]


def train_job(rank: int, n: int, port: int, dp_shard: int, tp: int, steps: int, seed: int = 0,
              global_batch: int = 4) -> dict[str, Any]:
    """One process of a training run, in the worker pool's ``fn(rank, n, *args)`` form: its
    own gloo group on loopback (none when ``n == 1``), build, train, re-evaluate step 0's
    batch, tear down. Returns the losses, the initial weights' digest and :func:`describe`."""
    if n > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=60))
    try:
        m = build_titan_llama(dp_shard=dp_shard, tp=tp, seed=seed)
        initial = digest(full_tensors(m))
        losses = train_steps(m, steps, global_batch=global_batch, seed=seed)
        return {"losses": losses, "step0_after": evaluate(m, 0, global_batch=global_batch, seed=seed),
                "initial": initial, "params": describe(m)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
