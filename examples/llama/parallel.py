"""Parallelize the example Llama with FSDP2 x tensor parallel, and cut it into pipeline stages.

This is the part of a training script that knows about device meshes: torchtitan's llama3
plan (column-wise q/k/v and w1/w3, row-wise wo/w2, sequence-parallel norms, a vocab-parallel
embedding and output head, ``fully_shard`` per block and on the root), written against the
public ``torch.distributed`` APIs so it reads like a user's own code. The resharding
machinery is tested against the modules this produces.

It must not import from ``elastic`` and must not move state between meshes: it only shards
a freshly built (or freshly loaded) model onto one mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from examples.llama.model import Llama


def parallelize(model: Llama, mesh: DeviceMesh, *, tp_dim: str = "tp", dp_dim: str = "dp_shard",
                loss_parallel: bool = True, gloo: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> Llama:
    """Shard ``model`` in place over ``mesh`` and return it: tensor parallel first, then FSDP2.

    ``mesh`` names its dims; ``tp_dim`` and ``dp_dim`` pick the tensor-parallel and the
    FSDP dims, and a dim that is absent or of size 1 is skipped (a (1, 1) mesh leaves the
    model untouched). Other dims (a pipeline dim, say) are ignored. With ``loss_parallel``
    the logits come out as a DTensor sharded over the vocabulary: compute the loss with
    :func:`loss_fn` and call ``backward`` under :func:`loss_context`.

    ``gloo``: force FSDP2 to reduce gradients with SUM and divide afterwards (gloo has neither
    ``AVG`` nor ``PREMUL_SUM``); gradients stay the mean over the FSDP ranks either way.
    """
    names = mesh.mesh_dim_names or ()
    if tp_dim not in names and dp_dim not in names:
        raise ValueError(f"mesh dims {names} name neither the tp dim {tp_dim!r} nor the dp dim {dp_dim!r}")
    tp_mesh = mesh[tp_dim] if tp_dim in names else None
    dp_mesh = mesh[dp_dim] if dp_dim in names else None
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh, loss_parallel=loss_parallel)
    if dp_mesh is not None and dp_mesh.size() > 1:
        apply_fsdp(model, dp_mesh, gloo=gloo, mp_policy=mp_policy)
    return model


def apply_tp(model: Llama, tp_mesh: DeviceMesh, *, loss_parallel: bool = True) -> None:
    """torchtitan's llama plan; between blocks the activations are sharded over the sequence."""
    cfg, tp = model.cfg, tp_mesh.size()
    if cfg.n_kv_heads % tp or cfg.n_heads % tp or cfg.ffn_hidden % tp or cfg.vocab % tp:
        raise ValueError(f"tp {tp} does not divide n_kv_heads {cfg.n_kv_heads}, n_heads {cfg.n_heads}, "
                         f"ffn_hidden {cfg.ffn_hidden} and vocab {cfg.vocab} (largest: {cfg.max_tp()})")
    # a pipeline stage may lack the embedding or the head: plan only what is there
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    tied = cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None
    parallelize_module(model, tp_mesh, top)
    if tied:
        # both styles shard the (vocab, dim) weight as Shard(0); distributing it twice made two
        # parameters, so point the head back at the embedding's
        model.output.weight = model.tok_embeddings.weight

    block_plan = {
        "attention_norm": SequenceParallel(),
        # freqs_cis travels as a plain tensor: every rank holds the whole table
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                        desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def apply_fsdp(model: Llama, dp_mesh: DeviceMesh, *, gloo: bool = True,
               mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """``fully_shard`` each block, then the root (embedding, final norm, head)."""
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, **kw)
    fully_shard(model, mesh=dp_mesh, **kw)
    if gloo:
        for m in model.modules():
            # SUM, then divide by the FSDP group size after the reduce-scatter: still the mean.
            # Without it fp32/bf16 gradients use ReduceOp.AVG (and PREMUL_SUM once a divide
            # factor is set), which gloo lacks
            if isinstance(m, FSDPModule) and hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def _vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(p.is_shard(logits.ndim - 1) for p in logits.placements)


@contextlib.contextmanager
def loss_context(logits: torch.Tensor) -> Iterator[None]:
    """``loss_parallel()`` for vocab-sharded logits, nothing otherwise; wrap the loss's backward in it.

    torch needs its loss-parallel ops enabled for the backward too, and the context manager
    neither nests nor cleans up after an exception, so :func:`loss_fn` detects an enclosing
    context and does not enter it a second time.
    """
    if not _vocab_sharded(logits) or _loss_parallel_on():
        yield
        return
    cm = torch_loss_parallel()
    cm.__enter__()
    try:
        yield
    finally:
        cm.__exit__(None, None, None)


def _loss_parallel_on() -> bool:
    # private: whether loss_parallel()'s custom op handlers are installed right now
    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of (bs, seq, vocab) logits against (bs, seq) labels.

    Vocab-sharded DTensor logits (the head under ``loss_parallel=True``) never gather the full
    vocabulary; the result is then a replicated DTensor. Call ``backward`` under
    :func:`loss_context`.
    """
    with loss_context(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


# --------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------


def stage_layers(n_layers: int, stage: int, n_stages: int) -> list[int]:
    """The blocks of ``stage``: contiguous, earlier stages get the extra ones (5 over 2 -> 3, 2)."""
    if not 0 <= stage < n_stages <= n_layers:
        raise ValueError(f"stage {stage} of {n_stages} over {n_layers} layers: "
                         "need 0 <= stage < n_stages <= n_layers")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


def pipeline_stage_module(model: Llama, stage: int, n_stages: int) -> Llama:
    """Delete from ``model`` (in place) what ``stage`` does not run, keep every remaining name.

    The embedding stays on the first stage only, the final norm and the head on the last;
    blocks stay under their global keys ("3" on the second of two 6-layer stages), so
    ``named_parameters()`` of every stage is a subset of the full model's.
    """
    if model.cfg.tie_embeddings and n_stages > 1:
        raise ValueError("tie_embeddings across pipeline stages would need a gradient all-reduce between the "
                         "first and last stage; untie the embedding for pipeline parallel")
    keep = {str(i) for i in stage_layers(len(model.layers), stage, n_stages)}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def unwrap_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (a loss-parallel loss is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


__all__ = ["apply_fsdp", "apply_tp", "loss_context", "loss_fn", "parallelize", "pipeline_stage_module",
           "stage_layers", "unwrap_loss"]
