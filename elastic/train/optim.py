"""Adam over exactly the spec's optimizer boxes, with optional ZeRO-1 sharding across DP.

What it is for: the optimizer state a worker holds must be *exactly* the
``exp_avg``/``exp_avg_sq`` (and, in mixed precision, ``master``) pieces of
:func:`elastic.reshard.spec.sharding_spec`, so the resharder can move it and the engine can
adopt it. ``torch.optim.Adam`` owns its state tensors and allocates them lazily; this module
applies the same update (``torch.optim.Adam``'s single-tensor arithmetic, L2 weight decay,
bias correction with step count ``t = step + 1``) to tensors it is handed.

ZeRO-1 (``layout.zero == 1``): each DP replica updates only the dim-0 slice of every local
parameter box that the spec gives it (rows ``split_range(rows, dp, dp_rank)``), then the
replicas exchange the updated slices (one padded all-gather per step: gloo needs equal
sizes, so with 10 rows over 4 replicas the slices are 2, 3, 2, 3 rows and every one is
sent as 3).

Must not: allocate state of its own (beyond the per-step all-gather buffers), decide the
learning-rate schedule, or touch gradients' reduction (the engine all-reduces them first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elastic.reshard.spec import ShardingSpec, split_range
from elastic.train.groups import Comm


@dataclass(frozen=True)
class AdamHyper:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


@torch.no_grad()
def adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, t: int,
          hp: AdamHyper) -> None:
    """One in-place Adam update at step count ``t`` (>= 1): torch.optim.Adam's arithmetic."""
    beta1, beta2 = hp.betas
    if hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = hp.lr / (1 - beta1**t)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**t) ** 0.5).add_(hp.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    rows: tuple[int, int]  # this rank's local dim-0 rows of the param box (all rows without ZeRO)
    replica_rows: list[tuple[int, int]]  # rows of every DP replica (ZeRO-1 only)
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    master: torch.Tensor | None


class ShardedAdam:
    """Adam over one rank's parameters with the spec's optimizer pieces as state."""

    def __init__(self, spec: ShardingSpec, rank: int, params: dict[str, nn.Parameter],
                 state: dict[tuple[str, str], torch.Tensor], dp: Comm, hp: AdamHyper) -> None:
        self.hp = hp
        self.dp = dp
        self.zero = bool(spec.layout.zero) and dp.size > 1
        self.slots: list[_Slot] = []
        _, dp_rank, _ = spec.layout.coords(rank)
        for name, p in params.items():
            rows = p.shape[0]
            idx, count = spec.replica_group(spec.tensor(name), dp_rank)
            replica_rows = [split_range(rows, count, j) for j in range(count)] if self.zero else [(0, rows)]
            mine = replica_rows[idx] if self.zero else (0, rows)
            self.slots.append(_Slot(name, p, mine, replica_rows, state.get((name, "exp_avg")),
                                    state.get((name, "exp_avg_sq")), state.get((name, "master"))))

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Update every owned slice at step count ``step + 1``; with ZeRO-1 then share the slices."""
        t = step + 1
        for s in self.slots:
            if s.exp_avg is None:  # an empty ZeRO slice: the spec omits it, nothing to update
                continue
            if s.param.grad is None:
                raise RuntimeError(f"parameter {s.name} has no gradient at step {step}")
            lo, hi = s.rows
            grad = s.param.grad[lo:hi]
            if s.master is not None:  # mixed precision: update the fp32 master, then round once
                adam_(s.master, grad.float(), s.exp_avg, s.exp_avg_sq, t, self.hp)
                s.param.data[lo:hi].copy_(s.master)
            else:
                adam_(s.param.data[lo:hi], grad, s.exp_avg, s.exp_avg_sq, t, self.hp)
        if self.zero:
            self._gather_slices()

    def _gather_slices(self) -> None:
        """Every replica gets every replica's updated rows (one padded all-gather)."""
        me = self.dp.index

        def flat_size(j: int) -> int:
            return sum((s.replica_rows[j][1] - s.replica_rows[j][0]) * _row_numel(s.param) for s in self.slots)

        sizes = [flat_size(j) for j in range(self.dp.size)]
        width = max(sizes)
        dtype, device = self.slots[0].param.dtype, self.slots[0].param.device
        send = torch.zeros(width, dtype=dtype, device=device)
        off = 0
        for s in self.slots:
            lo, hi = s.replica_rows[me]
            n = (hi - lo) * _row_numel(s.param)
            send[off:off + n].copy_(s.param.data[lo:hi].reshape(-1))
            off += n
        recv = [torch.empty(width, dtype=dtype, device=device) for _ in range(self.dp.size)]
        self.dp.all_gather(recv, send)
        for j, buf in enumerate(recv):
            if j == me:
                continue
            off = 0
            for s in self.slots:
                lo, hi = s.replica_rows[j]
                n = (hi - lo) * _row_numel(s.param)
                s.param.data[lo:hi].copy_(buf[off:off + n].view_as(s.param.data[lo:hi]))
                off += n


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n
