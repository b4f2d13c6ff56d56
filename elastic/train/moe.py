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
all-to-all over the EP group), the owners compute their experts on what they received and
reduce over TP (the owner's TP ranks received the same tokens: inputs and routing are
replicated across TP), and a second all-to-all returns the outputs, which the sender weights
and sums. The backward runs the two all-to-alls in reverse. With ``ep == 1`` no message is sent
and the arithmetic is the single process's.

Must not: reduce gradients over DP (the engine reduces expert gradients over the ranks holding
the same experts), initialise weights, or depend on another rank's batch beyond the exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic.model import ModelSpec
from elastic.reshard.spec import split_range
from elastic.train.groups import Comm
from elastic.train.tp import copy_to_tp, reduce_from_tp


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
                 sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance term ``sum_i f_i P_i``, averaged over the ``sequences``
    (``scores`` ``[sequences * seq, experts]``, ``chosen`` ``[sequences * seq, top_k]``)."""
    seq = scores.shape[0] // sequences
    picks = F.one_hot(chosen, experts).sum(1).view(sequences, seq, experts).to(scores.dtype)
    f = picks.mean(1) * (experts / top_k)  # [sequences, experts]: no gradient (a count)
    p = (scores / scores.sum(-1, keepdim=True)).view(sequences, seq, experts).mean(1)
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
        """``x``: rows grouped by local expert (``counts[e]`` rows for local expert ``e``); the outputs, same order."""
        pieces = []
        for e, rows in enumerate(x.split(counts)):  # every expert runs, an empty one too (same graph everywhere)
            if self.kind == "swiglu":
                hidden = F.silu(_lin(rows, self.gate, e)) * _lin(rows, self.up, e)
                pieces.append(F.linear(hidden, self.down.weight[e]))
            else:
                pieces.append(F.linear(F.gelu(_lin(rows, self.fc1, e)), self.fc2.weight[e]))
        y = reduce_from_tp(torch.cat(pieces), self.tp)
        out = self.down if self.kind == "swiglu" else self.fc2
        if out.bias is not None:
            ids = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                          torch.tensor(counts, device=x.device))
            y = y + out.bias.index_select(0, ids)
        return y


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
        bsz, seq, h = x.shape
        tokens = x.reshape(bsz * seq, h)
        # 1. routing, on the replicated input (its gradient is whole on every TP rank, not a TP part)
        scores = torch.sigmoid(F.linear(tokens, self.router.weight))
        chosen, weights = route(scores, self.top_k)
        routed = self._dispatch_compute_combine(copy_to_tp(tokens, self.tp), chosen)
        y = (routed.view(bsz * seq, self.top_k, h) * weights.unsqueeze(-1)).sum(1).view(bsz, seq, h)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.loss_scale:
            aux = balance_loss(scores, chosen, self.experts_total, self.top_k, bsz)
            y = _AttachLoss.apply(y, aux, self.loss_scale)
        return y

    def _dispatch_compute_combine(self, tokens: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each (token, choice)'s expert output (TP-reduced), rows in ``chosen.flatten()`` order."""
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
        local_ids = torch.repeat_interleave(src_expert, mine.reshape(-1).to(tokens.device))
        by_expert = torch.sort(local_ids, stable=True).indices
        # 4. the local experts, then back to the received order and to the senders
        out = self.experts(got_x.index_select(0, by_expert), mine.sum(0).tolist())
        out = out.index_select(0, torch.argsort(by_expert))
        back = _all_to_all(out, self.ep, recv, send)
        return back.index_select(0, torch.argsort(order))
