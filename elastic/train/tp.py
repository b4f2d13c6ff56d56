"""Megatron-style tensor-parallel building blocks (Shoeybi et al. 2019, section 3).

What it is for: the autograd functions that move activations in and out of a TP region
(``copy_to_tp``: identity forward, all-reduce backward; ``reduce_from_tp``: all-reduce
forward, identity backward), column- and row-parallel linears, the vocab-parallel
embedding (masked lookup + all-reduce) and the vocab-parallel cross-entropy (max, sum of
exponentials and target logit all-reduced; the full-vocab logits are never formed).

With a solo communicator (tp=1) every function reduces to its plain single-GPU form, with
the same arithmetic, so a tp=1 run is the reference the tp>1 runs are compared against.

Must not: know layer indices, pipeline stages or optimizer state; own process groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic.train.groups import Comm


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Enter a TP region: each rank computes on the full input; input grads are summed."""
    return x if comm.size == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a TP region: partial results are summed on every rank."""
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> nn.Parameter:
    # Placeholder storage; the engine replaces it with the initialised or adopted tensor.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(nn.Module):
    """``y_local = x W_local^T + b_local``: weight split on the output dim; output stays split."""

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = _param((out_local, in_features), dtype, device)
        self.bias = _param((out_local,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the caller has already entered the TP region (one copy_to_tp per block input)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_tp(x_local W_local^T) + b``: weight split on the input dim; bias replicated."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm, dtype: torch.dtype,
                 device: str) -> None:
        super().__init__()
        self.comm = comm
        self.weight = _param((out_features, in_local), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + rows)`` of the embedding; other ids look up zeros."""

    def __init__(self, vocab_start: int, rows: int, hidden: int, comm: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.vocab_start = vocab_start
        self.comm = comm
        self.weight = _param((rows, hidden), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``log(sum_v exp(z_v)) - z_target`` over logits split on the vocab dim."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, comm: Comm) -> torch.Tensor:
        ctx.in_dtype = logits.dtype
        if logits.dtype in (torch.bfloat16, torch.float16):  # the softmax sums in fp32
            logits = logits.float()
        rows = logits.shape[-1]
        # 1. subtract the global max for stability (the max is not differentiated: it cancels)
        zmax = comm.all_reduce(logits.max(dim=-1).values.contiguous(), "max")
        shifted = logits - zmax.unsqueeze(-1)
        # 2. the target's logit lives on exactly one rank: others contribute 0
        local = target - vocab_start
        outside = (local < 0) | (local >= rows)
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = comm.all_reduce(picked.contiguous())
        # 3. the partition function
        exp = shifted.exp()
        total = comm.all_reduce(exp.sum(dim=-1))
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 comm: Comm) -> torch.Tensor:
    """Per-token losses (shape of ``target``) from this rank's vocab slice of the logits."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, comm)
