"""The 1F1B pipeline schedule (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM's
``forward_backward_pipelining_without_interleaving``).

What it is for: run ``num_micro`` micro-batches through one pipeline stage. Stage ``p`` of
``P`` does ``min(P - p - 1, M)`` warm-up forwards, then alternates one forward and one
backward (steady state), then drains the remaining backwards (cool-down), so at most
``P - p`` micro-batches' activations are alive at once instead of ``M``. Worked example,
P=2, M=4: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 runs F0 B0 F1 B1 F2 B2 F3 B3.

Activations go forward and their gradients backward over point-to-point messages on the
PP communicator; the two directions of a combined step (send this activation, receive
the next gradient) are posted together and then awaited, as Megatron's batched P2P does,
so neighbouring stages never wait on each other in a cycle. Every message has a shape
known up front (``[micro_batch, seq, hidden]``).

Must not: reduce gradients across DP/TP, step the optimizer, or know how a stage computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic.train.groups import Comm

ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor]
"""``forward_step(micro_index, input)``: ``input`` is None on the first stage (it reads its own
tokens); returns the activation to send on, or on the last stage the scalar loss to
back-propagate (already scaled for gradient accumulation)."""


@dataclass(frozen=True)
class P2PShape:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"


class _Links:
    """The point-to-point operations between this stage and its neighbours."""

    def __init__(self, pp: Comm, act: P2PShape) -> None:
        self.pp, self.act = pp, act
        self.first = pp.index == 0
        self.last = pp.index == pp.size - 1

    def _buf(self) -> torch.Tensor:
        return torch.empty(self.act.shape, dtype=self.act.dtype, device=self.act.device)

    def _exchange(self, send: tuple[torch.Tensor, int] | None, recv_from: int | None) -> torch.Tensor | None:
        works, buf = [], None
        if send is not None:
            works.append(self.pp.isend(send[0].detach().contiguous(), send[1]))
        if recv_from is not None:
            buf = self._buf()
            works.append(self.pp.irecv(buf, recv_from))
        for w in works:
            w.wait()
        return buf

    def recv_forward(self) -> torch.Tensor | None:
        if self.first:
            return None
        x = self._exchange(None, self.pp.index - 1)
        assert x is not None
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.last:
            self._exchange((y, self.pp.index + 1), None)

    def recv_backward(self) -> torch.Tensor | None:
        return None if self.last else self._exchange(None, self.pp.index + 1)

    def send_backward(self, dx: torch.Tensor | None) -> None:
        if not self.first:
            assert dx is not None
            self._exchange((dx, self.pp.index - 1), None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        return None if self.last else self._exchange((y, self.pp.index + 1), self.pp.index + 1)

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        if self.first:
            return None
        assert dx is not None
        x = self._exchange((dx, self.pp.index - 1), self.pp.index - 1)
        assert x is not None
        return x.requires_grad_()


def _backward(x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None) -> torch.Tensor | None:
    """Back-propagate one micro-batch; return the gradient of the stage input (None on stage 0)."""
    if dy is None:  # last stage: y is the scalar loss
        torch.autograd.backward(y)
    else:
        torch.autograd.backward(y, dy)
    return None if x is None else x.grad


def one_f_one_b(forward_step: ForwardStep, num_micro: int, pp: Comm, act: P2PShape) -> None:
    """Run forward and backward of ``num_micro`` micro-batches on this stage (1F1B order)."""
    links = _Links(pp, act)
    warmup = min(pp.size - pp.index - 1, num_micro)
    remaining = num_micro - warmup
    inputs: deque[torch.Tensor | None] = deque()
    outputs: deque[torch.Tensor] = deque()
    micro = 0

    # 1. warm-up: forwards only, filling the pipeline
    for _ in range(warmup):
        x = links.recv_forward()
        y = forward_step(micro, x)
        micro += 1
        links.send_forward(y)
        inputs.append(x)
        outputs.append(y)

    # 2. steady state: one forward, one backward
    x = links.recv_forward() if remaining > 0 else None
    for i in range(remaining):
        y = forward_step(micro, x)
        micro += 1
        dy = links.send_forward_recv_backward(y)
        inputs.append(x)
        outputs.append(y)
        dx = _backward(inputs.popleft(), outputs.popleft(), dy)
        if i == remaining - 1:
            links.send_backward(dx)
        else:
            x = links.send_backward_recv_forward(dx)

    # 3. cool-down: the backwards of the warm-up micro-batches
    for _ in range(warmup):
        dy = links.recv_backward()
        dx = _backward(inputs.popleft(), outputs.popleft(), dy)
        links.send_backward(dx)
