"""The mixture-of-experts layer of the reference trainer (DeepSeek-V3 shaped), with expert parallelism.

What it is for: :class:`MoE` replaces the dense MLP of layers ``>= moe.dense_layers``. It holds
the spec's tensors of that layer (:mod:`elastic.reshard.spec`): ``moe.router.weight``
``[experts, hidden]`` (replicated), the stacked routed experts ``moe.experts.{gate,up,down}``
``[experts, ...]`` of which this rank holds the spec's box (experts ``split_range(experts, ep,
dp_rank % ep)``, each TP-split like a dense MLP), and the always-active shared experts
``moe.shared.*`` (one MLP of width ``shared_experts * expert_ffn_hidden``, TP-split).

Routing (DeepSeek-V3): scores ``s = sigmoid(x W_router^T)``; each token picks the ``top_k``
experts of highest score, ties broken by the lower expert index (a stable descending sort, so
the choice is a function of the scores alone, the same on every layout); its output is
``shared(x) + sum_k g_k expert_k(x)`` with ``g`` the chosen scores normalised to sum to 1.

Load balance: DeepSeek-V3's complementary *sequence-wise* balance loss ``alpha * sum_i f_i P_i``
per sequence (``f_i``: the fraction of the sequence's token choices that picked expert ``i``,
times ``experts / top_k``; ``P_i``: the mean over the sequence of the scores normalised over all
experts), averaged over the sequences like the LM loss. Chosen over V3's auxiliary-loss-free
bias because it holds no state: the bias is a per-expert tensor updated outside the optimizer,
which the sharding spec has no tensor for, so the resharder could not carry it; a per-sequence
loss is also independent of how a layout splits the batch, which keeps every layout on the
single process's curve. It is added to the objective through its gradient only (Megatron's
``MoEAuxLossAutoScaler``): the MoE output carries it, and the step's reported loss stays the LM
loss.

Expert parallelism: the ``ep`` ranks of an EP group (consecutive dp ranks, same tp and pp rank)
hold disjoint experts and run the same schedule. Each rank routes its own tokens, sends each
(token, choice) to the rank holding the expert (an all-gather of per-expert counts, then one
all-to-all over the EP group), the owners compute their experts on what they received, and a
second all-to-all returns the outputs, which the sender weights and sums. The backward runs the
two all-to-alls in reverse. With ``ep == 1`` no message is sent and the arithmetic is the single
process's.

Tensor and sequence parallelism (Megatron's all-to-all dispatcher): at tp > 1 a rank's tokens
are its sequence shard (:mod:`elastic.train.model`), so each TP rank routes and dispatches its
own positions over its EP group (the ranks of the same tp index). An expert is TP-split like a
dense MLP, so the owner's TP ranks first all-gather what each of them received (sizes differ:
the counts are gathered first), each computes its part of every expert on all of it, and a
reduce-scatter over TP sums the parts and hands each TP rank back the rows it received (its
backward an all-gather; both pad to the largest rank's rows, gloo's collectives taking equal
sizes). The router weight and the down-projection's bias see only this rank's rows, so their
gradients are summed over TP; the balance loss's per-sequence counts and mean scores are summed
over the TP ranks' shards. The shared experts are a dense MLP on the shard.

Must not: reduce gradients over DP (the engine reduces expert gradients over the ranks holding
the same experts), initialise weights, or depend on another rank's batch beyond the exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic.model import ModelSpec
from elastic.reshard.spec import split_range
from elastic.train.groups import Comm
from elastic.train.tp import reduce_from_tp, sp_param


class _AllToAll(torch.autograd.Function):
    """Rows to the EP members (``send`` rows each, in member order); the backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return comm.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.comm.all_to_all(grad.contiguous(), ctx.recv, ctx.send), None, None, None


def _all_to_all(x: torch.Tensor, comm: Comm, send: list[int], recv: list[int]) -> torch.Tensor:
    return x if comm.size == 1 else _AllToAll.apply(x, comm, send, recv)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; the backward also gives ``loss`` the gradient ``scale``, as if
    ``scale * loss`` were added to the objective (how a mid-pipeline loss joins the backward)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def route(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts, weights)`` ``[tokens, top_k]`` from ``scores`` ``[tokens, experts]``: the ``top_k``
    highest scores, ties to the lower expert index, weights normalised to sum to 1 per token."""
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = scores.gather(-1, chosen)
    return chosen, top / top.sum(-1, keepdim=True)


def balance_loss(scores: torch.Tensor, chosen: torch.Tensor, experts: int, top_k: int,
                 sequences: int, tp: Comm | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance term ``sum_i f_i P_i``, averaged over the ``sequences``
    (``scores`` ``[sequences * seq, experts]``, ``chosen`` ``[sequences * seq, top_k]``). With ``tp``,
    the rows are this rank's shard of each sequence: the counts and score sums add up over TP (every
    TP rank then has the same loss, and its backward reaches this rank's scores alone)."""
    tp = tp if tp is not None else Comm.solo(0)
    shard = scores.shape[0] // sequences
    seq = shard * tp.size
    picks = F.one_hot(chosen, experts).sum(1).view(sequences, shard, experts).sum(1).to(scores.dtype)
    picks = tp.all_reduce(picks.detach().contiguous())  # a count: no gradient
    f = picks / seq * (experts / top_k)  # [sequences, experts]
    p = reduce_from_tp((scores / scores.sum(-1, keepdim=True)).view(sequences, shard, experts).sum(1), tp) / seq
    return (f * p).sum(-1).mean()


class _ExpertWeights(nn.Module):
    """One projection of the stacked local experts: ``weight`` ``[local experts, out, in]``, ``bias`` ``[local, out]``."""

    def __init__(self, experts: int, out: int, inp: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inp, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(experts, out, dtype=dtype, device=device)) if bias else None


class Experts(nn.Module):
    """This rank's routed experts ``[lo, hi)`` of the layer, TP-split like a dense MLP (column-parallel
    gate/up or fc1, row-parallel down or fc2 whose bias is added after the TP reduction)."""

    def __init__(self, model: ModelSpec, lo: int, hi: int, tp: Comm, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        assert model.moe is not None
        h, b = model.hidden, model.has_bias
        a, z = split_range(model.moe.expert_ffn_hidden, tp.size, tp.index)
        w, n = z - a, hi - lo
        self.lo, self.hi, self.tp, self.kind = lo, hi, tp, model.mlp
        if model.mlp == "swiglu":
            self.gate = _ExpertWeights(n, w, h, b, dtype, device)
            self.up = _ExpertWeights(n, w, h, b, dtype, device)
            self.down = _ExpertWeights(n, h, w, b, dtype, device)
        else:
            self.fc1 = _ExpertWeights(n, w, h, b, dtype, device)
            self.fc2 = _ExpertWeights(n, h, w, b, dtype, device)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: rows grouped by local expert (``counts[e]`` rows for local expert ``e``); this TP rank's
        part of their outputs (to be summed over TP), same order, without the down-projection's bias."""
        pieces = []
        for e, rows in enumerate(x.split(counts)):  # every expert runs, an empty one too (same graph everywhere)
            if self.kind == "swiglu":
                hidden = F.silu(_lin(rows, self.gate, e)) * _lin(rows, self.up, e)
                pieces.append(F.linear(hidden, self.down.weight[e]))
            else:
                pieces.append(F.linear(F.gelu(_lin(rows, self.fc1, e)), self.fc2.weight[e]))
        return torch.cat(pieces)

    def out_bias(self) -> torch.Tensor | None:
        """The down-projection's bias ``[local experts, hidden]`` (added once, after the TP sum)."""
        return (self.down if self.kind == "swiglu" else self.fc2).bias


def _lin(x: torch.Tensor, proj: _ExpertWeights, e: int) -> torch.Tensor:
    return F.linear(x, proj.weight[e], None if proj.bias is None else proj.bias[e])


class MoE(nn.Module):
    """The MoE block of one layer on one rank (see the module docstring). ``ep``: this rank's EP group."""

    def __init__(self, model: ModelSpec, tp: Comm, ep: Comm, dtype: torch.dtype, device: str,
                 shared: nn.Module | None) -> None:
        super().__init__()
        assert model.moe is not None
        m = model.moe
        self.experts_total, self.top_k = m.experts, m.top_k
        self.tp, self.ep = tp, ep
        lo, hi = split_range(m.experts, ep.size, ep.index)  # the spec's box: experts % ep == 0
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(m.experts, model.hidden, dtype=dtype, device=device))
        self.experts = Experts(model, lo, hi, tp, dtype, device)
        self.shared = shared
        self.loss_scale = 0.0  # the balance loss's weight in this micro-batch's objective (set by the engine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's sequence shard ``[b, s/tp, h]``; returns the same shard of the output."""
        bsz, seq, h = x.shape
        tokens = x.reshape(bsz * seq, h)
        # 1. routing of this rank's tokens (the router's gradient is summed over the TP ranks' shards)
        router = self.router.weight
        assert isinstance(router, torch.Tensor)
        scores = torch.sigmoid(F.linear(tokens, sp_param(router, self.tp)))
        chosen, weights = route(scores, self.top_k)
        routed = self._dispatch_compute_combine(tokens, chosen)
        y = (routed.view(bsz * seq, self.top_k, h) * weights.unsqueeze(-1)).sum(1).view(bsz, seq, h)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.loss_scale:
            aux = balance_loss(scores, chosen, self.experts_total, self.top_k, bsz, self.tp)
            y = _AttachLoss.apply(y, aux, self.loss_scale)
        return y

    def _dispatch_compute_combine(self, tokens: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each (token, choice)'s expert output, rows in ``chosen.flatten()`` order."""
        E, P = self.experts_total, self.ep.size
        per_rank = E // P
        flat = chosen.reshape(-1)
        # 1. group the choices by expert (so by owning rank), keeping token order within an expert
        order = torch.sort(flat, stable=True).indices
        send_x = tokens.index_select(0, torch.div(order, self.top_k, rounding_mode="floor"))
        counts = torch.bincount(flat, minlength=E)
        # 2. who sends what: every member's per-expert counts (one small all-gather over EP)
        if P == 1:
            table = counts.view(1, E)
        else:
            got = [torch.empty_like(counts) for _ in range(P)]
            table = torch.stack(self.ep.all_gather(got, counts))  # [member, expert]
        send = table[self.ep.index].view(P, per_rank).sum(1).tolist()
        mine = table[:, self.experts.lo:self.experts.hi]  # [member, local expert]: rows each member sends me
        recv = mine.sum(1).tolist()
        # 3. dispatch; received rows are member by member, each member's by local expert
        got_x = _all_to_all(send_x, self.ep, send, recv)
        src_expert = torch.arange(per_rank, device=tokens.device).repeat(P)
        # 4. the TP ranks of this owner received different rows (their own shards'): gather them all,
        #    [TP rank, member, local expert] order, since each computes its part of every expert
        if self.tp.size == 1:
            tp_mine = mine.view(1, P, per_rank)
        else:
            parts = [torch.empty_like(mine) for _ in range(self.tp.size)]
            tp_mine = torch.stack(self.tp.all_gather(parts, mine.contiguous()))  # [tp rank, member, local expert]
        sizes = tp_mine.sum((1, 2)).tolist()
        all_x = _gather_rows(got_x, self.tp, sizes)
        local_ids = torch.repeat_interleave(src_expert.repeat(self.tp.size), tp_mine.reshape(-1).to(tokens.device))
        by_expert = torch.sort(local_ids, stable=True).indices
        # 5. the local experts (this TP rank's part), back to the gathered order, summed over TP
        #    into the rows this rank received, then the bias (once, after the sum) and back to the senders
        out = self.experts(all_x.index_select(0, by_expert), tp_mine.sum((0, 1)).tolist())
        out = _scatter_rows(out.index_select(0, torch.argsort(by_expert)), self.tp, sizes)
        bias = self.experts.out_bias()
        if bias is not None:
            ids = torch.repeat_interleave(src_expert, mine.reshape(-1).to(tokens.device))
            out = out + sp_param(bias, self.tp).index_select(0, ids)
        back = _all_to_all(out, self.ep, recv, send)
        return back.index_select(0, torch.argsort(order))


# --------------------------------------------------------------------------------------------
# Rows of different counts over TP (gloo's all-gather and reduce-scatter take equal sizes: pad)
# --------------------------------------------------------------------------------------------


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _all_gather_rows(x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
    most = max(sizes)
    parts = tp.all_gather([x.new_empty((most, *x.shape[1:])) for _ in sizes], _padded(x.contiguous(), most))
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def _reduce_scatter_rows(x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
    most = max(sizes)
    blocks = [_padded(b, most).contiguous() for b in x.split(sizes)]
    out = x.new_empty((most, *x.shape[1:]))
    assert tp.backend is not None
    tp.backend.reduce_scatter([out], [blocks], dist.ReduceScatterOptions()).wait()
    return out[:sizes[tp.index]]


class _GatherRows(torch.autograd.Function):
    """Every TP rank's rows (``sizes[i]`` from rank i), concatenated; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
        ctx.tp, ctx.sizes = tp, sizes
        return _all_gather_rows(x, tp, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_rows(grad, ctx.tp, ctx.sizes), None, None


class _ScatterRows(torch.autograd.Function):
    """The sum over TP of every rank's rows, this rank's block of them; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
        ctx.tp, ctx.sizes = tp, sizes
        return _reduce_scatter_rows(x, tp, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_rows(grad.contiguous(), ctx.tp, ctx.sizes), None, None


def _gather_rows(x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
    return x if tp.size == 1 else _GatherRows.apply(x, tp, sizes)


def _scatter_rows(x: torch.Tensor, tp: Comm, sizes: list[int]) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterRows.apply(x, tp, sizes)
