"""Megatron-style tensor-parallel building blocks with sequence parallelism (Shoeybi et al. 2019,
section 3; Korthikanti et al. 2022, section 4.2.2).

What it is for: the autograd functions that move activations in and out of a TP region and
the layers built on them. Whenever tp > 1 the hidden states *between* TP regions are split
along the sequence over the TP ranks (sequence parallelism): norms and residual adds run on
this rank's ``seq / tp`` positions, and

* entering a column-parallel region all-gathers the sequence (its backward a reduce-scatter):
  :func:`gather_linears` (the column-parallel linears sharing one input, e.g. q/k/v, gate/up,
  the vocab-parallel head) saves only this rank's shard and gathers it again in backward, as
  Megatron does, so the full-sequence input is never held between forward and backward;
* leaving a row-parallel region reduce-scatters along the sequence (its backward an
  all-gather): :class:`RowParallelLinear`, the vocab-parallel embedding's lookup;
* a parameter applied to the shard (norm weights and biases, a row-parallel layer's bias,
  the MoE router) sees part of the sequence on each rank: :func:`sp_param` sums its gradient
  over TP in backward (identity forward), so every TP rank holds the whole gradient.

Also ``copy_to_tp`` (identity forward, all-reduce backward) and ``reduce_from_tp`` (all-reduce
forward, identity backward) for regions whose input is replicated over TP (the MoE layer's
partial sums), and the vocab-parallel cross-entropy (max, sum of exponentials and target
logit all-reduced; the full-vocab logits are never formed).

Gloo has every collective used here (all-gather and reduce-scatter included). Activations are
``[batch, seq, hidden]``, so the sequence is dim 1: a gather or scatter moves the TP ranks'
blocks to and from a leading dim (one copy each way; Megatron's ``[seq, batch, hidden]``
avoids it, which changes nothing the tests compare).

With a solo communicator (tp=1) every function reduces to its plain single-GPU form, with
the same arithmetic, so a tp=1 run is the reference the tp>1 runs are compared against.

Must not: know layer indices, pipeline stages or optimizer state; own process groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
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
    """Enter a TP region from a replicated input: each rank computes on all of it; input grads are summed."""
    return x if comm.size == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a TP region into a replicated output: partial results are summed on every rank."""
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm)


def sp_param(p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``p`` as used on this rank's sequence shard: its gradient is summed over TP (each rank saw
    part of the sequence). Megatron sums such gradients once per step; here it is once per
    micro-batch, inside autograd, so every path that back-propagates gets whole gradients."""
    return copy_to_tp(p, comm)


# --------------------------------------------------------------------------------------------
# Sequence dim <-> TP ranks
# --------------------------------------------------------------------------------------------


def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``[b, s/tp, ...]`` on each rank -> ``[b, s, ...]``, rank i's shard at positions ``[i*s/tp, (i+1)*s/tp)``."""
    x = x.contiguous()
    parts = comm.all_gather([torch.empty_like(x) for _ in range(comm.size)], x)
    return torch.cat(parts, dim=1)


def _scatter_seq_sum(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``[b, s, ...]`` partial sums on each rank -> this rank's ``[b, s/tp, ...]`` of their sum (reduce-scatter)."""
    parts = [c.contiguous() for c in x.chunk(comm.size, dim=1)]
    out = torch.empty_like(parts[comm.index])
    assert comm.backend is not None
    comm.backend.reduce_scatter([out], [parts], dist.ReduceScatterOptions()).wait()
    return out


class _ScatterToSP(torch.autograd.Function):
    """Leave a row-parallel region: reduce-scatter along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _scatter_seq_sum(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.comm), None


def scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Partial sums over the whole sequence -> this rank's sequence shard of their sum."""
    return x if comm.size == 1 else _ScatterToSP.apply(x, comm)


class _GatherLinears(torch.autograd.Function):
    """``F.linear(gather_seq(x), w_i, b_i)`` for each ``(w_i, b_i)``, saving only the shard ``x``.

    Backward gathers ``x`` again for the weight gradients and reduce-scatters the input gradient
    (the column-parallel weights each give part of it). Korthikanti et al. section 4.2.2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, n: int, *wb: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ctx.comm, ctx.n = comm, n
        ctx.has_bias = [b is not None for b in wb[n:]]
        ctx.save_for_backward(x, *wb[:n])
        full = _gather_seq(x, comm)
        out = []
        for i in range(n):
            w = wb[i]
            assert w is not None
            out.append(F.linear(full, w, wb[n + i]))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        full = _gather_seq(x, ctx.comm)
        flat_in = full.reshape(-1, full.shape[-1])
        dx = None
        dws: list[torch.Tensor | None] = []
        dbs: list[torch.Tensor | None] = []
        for w, g, has_b in zip(weights, grads, ctx.has_bias, strict=True):
            if g is None:  # an output nothing used
                g = torch.zeros(*full.shape[:-1], w.shape[0], dtype=full.dtype, device=full.device)
            g2 = g.reshape(-1, g.shape[-1])
            part = g2 @ w
            dx = part if dx is None else dx + part
            dws.append(g2.t() @ flat_in)
            dbs.append(g2.sum(0) if has_b else None)
        assert dx is not None
        return (_scatter_seq_sum(dx.view_as(full), ctx.comm), None, None, *dws, *dbs)


def gather_linears(x: torch.Tensor, comm: Comm,
                   linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """Enter a column-parallel region: ``F.linear(x_whole_sequence, weight, bias)`` for each of ``linears``
    from this rank's sequence shard ``x`` (tp > 1); at tp = 1 plain ``F.linear``s on ``x``."""
    if comm.size == 1:
        return [F.linear(x, w, b) for w, b in linears]
    out = _GatherLinears.apply(x, comm, len(linears), *[w for w, _ in linears], *[b for _, b in linears])
    return list(out)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> nn.Parameter:
    # Placeholder storage; the engine replaces it with the initialised or adopted tensor.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(nn.Module):
    """``y_local = x W_local^T + b_local``: weight split on the output dim; output stays split. Applied
    through :func:`gather_linears` (one TP-region entry for all the linears sharing an input)."""

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = _param((out_local, in_features), dtype, device)
        self.bias = _param((out_local,), dtype, device) if bias else None

    @property
    def wb(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias


class RowParallelLinear(nn.Module):
    """``y = sum_tp(x_local W_local^T) + b``: weight split on the input dim; bias replicated. The sum is
    a reduce-scatter along the sequence (the output is this rank's shard), the bias added on the shard."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm, dtype: torch.dtype,
                 device: str) -> None:
        super().__init__()
        self.comm = comm
        self.weight = _param((out_features, in_local), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = scatter_to_sp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + sp_param(self.bias, self.comm)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + rows)`` of the embedding; other ids look up zeros. The output is
    this rank's sequence shard (the ranks' lookups reduce-scattered along the sequence)."""

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
        return scatter_to_sp(out, self.comm)


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
