"""The 1F1B pipeline schedules: plain (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM's
``forward_backward_pipelining_without_interleaving``) and interleaved (Megatron-LM's
``forward_backward_pipelining_with_interleaving``).

What it is for: run ``num_micro`` micro-batches through one pipeline stage. Stage ``p`` of
``P`` does ``min(P - p - 1, M)`` warm-up forwards, then alternates one forward and one
backward (steady state), then drains the remaining backwards (cool-down), so at most
``P - p`` micro-batches' activations are alive at once instead of ``M``. Worked example,
P=2, M=4: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 runs F0 B0 F1 B1 F2 B2 F3 B3.

Activations go forward and their gradients backward over point-to-point messages on the
PP communicator; the two directions of a combined step (send this activation, receive
the next gradient) are posted together and then awaited, as Megatron's batched P2P does,
so neighbouring stages never wait on each other in a cycle. Every message has a shape
known up front (``act``: a micro-batch's hidden states as a stage passes them on, with
sequence parallelism this rank's shard ``[micro_batch, seq / tp, hidden]``,
``GPTStage.boundary_shape``).

Interleaved (``vpp`` model chunks per rank): chunk ``c`` of rank ``r`` is virtual stage
``c*P + r``, so a micro-batch visits every rank ``vpp`` times and the fill/drain bubble
shrinks by ``vpp`` (Megatron's model: ``(P-1)/(vpp*M)`` of the ideal time). Each rank runs
the order :func:`interleaved_order` gives (Megatron's: forwards cycle through the chunks in
groups of ``P`` micro-batches; ``2(P-r-1) + (vpp-1)P`` warm-up forwards, then 1F1B, then the
cool-down backwards), which needs ``M`` to be a multiple of ``P``. Its messages are sent
without waiting (the sends complete while the rank computes on) and received when an
operation needs them, each tagged with the receiving chunk and direction, so a rank that
talks to the same neighbour for two chunks never takes one chunk's tensor for another's.
:func:`simulate` runs any such order on a model of time (no torch.distributed), which is
how the tests show the order cannot deadlock and the benchmark measures its bubble.

Must not: reduce gradients across DP/TP, step the optimizer, or know how a stage computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from elastic.model import SpecError
from elastic.train.groups import Comm

ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor]
"""``forward_step(micro_index, input)``: ``input`` is None on the first stage (it reads its own
tokens); returns the activation to send on, or on the last stage the scalar loss to
back-propagate (already scaled for gradient accumulation)."""

ChunkForwardStep = Callable[[int, int, torch.Tensor | None], torch.Tensor]
"""``forward_step(chunk, micro_index, input)``: as :data:`ForwardStep` for this rank's model
chunk ``chunk`` (0 <= chunk < vpp); ``input`` is None on the first virtual stage only."""

Op = tuple[Literal["F", "B"], int, int]
"""One operation of a rank's order: ``(kind, chunk, micro)``, kind F (forward) or B (backward)."""


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


# --------------------------------------------------------------------------------------------
# Orders (pure)
# --------------------------------------------------------------------------------------------


def one_f_one_b_order(pp: int, rank: int, num_micro: int) -> list[Op]:
    """The operations :func:`one_f_one_b` runs on pipeline rank ``rank``, in its order."""
    warmup = min(pp - rank - 1, num_micro)
    ops: list[Op] = [("F", 0, m) for m in range(warmup)]
    for i in range(num_micro - warmup):
        ops += [("F", 0, warmup + i), ("B", 0, i)]
    ops += [("B", 0, m) for m in range(num_micro - warmup, num_micro)]
    return ops


def interleaved_warmup(pp: int, vpp: int, rank: int, num_micro: int) -> int:
    """Megatron's warm-up forwards of rank ``rank``: ``2(pp-rank-1) + (vpp-1)*pp``, at most all
    ``num_micro * vpp`` of them. The second term lets every rank run its first chunk on a
    whole group of ``pp`` micro-batches before its first backward arrives."""
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, num_micro * vpp)


def check_interleavable(pp: int, vpp: int, num_micro: int) -> None:
    """Megatron's condition for the interleaved order: micro-batches go round in groups of ``pp``."""
    if vpp > 1 and num_micro % pp:
        raise SpecError(f"the interleaved schedule (vpp={vpp}) needs the micro-batches per step and replica "
                        f"(grad_accum={num_micro}) to be a multiple of pp={pp}; change global_batch, "
                        "micro_batch or dp so that grad_accum = global_batch / (dp * micro_batch) is one")


def _interleaved_op(kind: Literal["F", "B"], k: int, pp: int, vpp: int) -> Op:
    # the k-th forward (backward) of a rank: groups of pp micro-batches, chunk by chunk
    # (backwards visit the chunks in reverse); e.g. pp=2, vpp=2: F (c0,m0) (c0,m1) (c1,m0) (c1,m1) (c0,m2)...
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if kind == "B":
        chunk = vpp - 1 - chunk
    return (kind, chunk, group * pp + within % pp)


def interleaved_order(pp: int, vpp: int, rank: int, num_micro: int) -> list[Op]:
    """The operations of pipeline rank ``rank`` under Megatron's interleaved 1F1B, in order."""
    check_interleavable(pp, vpp, num_micro)
    total = num_micro * vpp
    warmup = interleaved_warmup(pp, vpp, rank, num_micro)
    ops = [_interleaved_op("F", k, pp, vpp) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [_interleaved_op("F", warmup + i, pp, vpp), _interleaved_op("B", i, pp, vpp)]
    ops += [_interleaved_op("B", k, pp, vpp) for k in range(total - warmup, total)]
    return ops


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: when each rank finished, and how long it computed."""

    makespan: float
    busy: tuple[float, ...]  # compute time per rank
    peak_in_flight: tuple[int, ...]  # most chunk-micro-batches whose activations a rank held at once

    @property
    def bubble(self) -> float:
        """Idle time over compute time, averaged over the ranks (Megatron's bubble fraction)."""
        return sum(self.makespan - b for b in self.busy) / sum(self.busy)


def simulate(orders: list[list[Op]], vpp: int, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Run each rank's order on a model of time: every op of a chunk takes ``t_forward`` (``t_backward``),
    messages take no time and never block the sender (as :func:`interleaved_one_f_one_b` sends);
    an op starts when its rank is free and its input has arrived. Raises if the orders deadlock."""
    pp = len(orders)
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    held = [0] * pp
    peak = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, c, m = orders[r][pos[r]]
                v = c * pp + r
                if kind == "F":
                    dep = ("F", v - 1, m) if v > 0 else None
                else:
                    dep = ("B", v + 1, m) if v < last else ("F", v, m)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + (t_forward if kind == "F" else t_backward)
                done[(kind, v, m)] = clock[r]
                held[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], held[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise RuntimeError(f"pipeline orders deadlock: ranks wait on {stuck}")
    busy = tuple(sum(t_forward if k == "F" else t_backward for k, _, _ in o) for o in orders)
    return Timeline(max(clock), busy, tuple(peak))


# --------------------------------------------------------------------------------------------
# Interleaved execution
# --------------------------------------------------------------------------------------------


def _tag(chunk: int, backward: bool) -> int:
    """The message tag of what chunk ``chunk`` of the receiver gets (its input or its output's gradient)."""
    return 2 * chunk + int(backward)


def interleaved_one_f_one_b(forward_step: ChunkForwardStep, num_micro: int, vpp: int, pp: Comm,
                            act: P2PShape) -> None:
    """Run forward and backward of ``num_micro`` micro-batches through this rank's ``vpp`` chunks
    in Megatron's interleaved order (:func:`interleaved_order`)."""
    P, r = pp.size, pp.index
    last = P * vpp - 1
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []  # in flight, each with its tensor

    def send(t: torch.Tensor, v: int, backward: bool) -> None:  # to virtual stage v
        # forget the sends already delivered, so their gradients' memory goes while the step runs
        sends[:] = [s for s in sends if not s[0].is_completed()]
        buf = t.detach().contiguous()
        sends.append((pp.isend(buf, v % P, _tag(v // P, backward)), buf))

    def recv(v: int, chunk: int, backward: bool) -> torch.Tensor:  # from virtual stage v, for my chunk
        buf = torch.empty(act.shape, dtype=act.dtype, device=act.device)
        pp.irecv(buf, v % P, _tag(chunk, backward)).wait()
        return buf

    for kind, c, m in interleaved_order(P, vpp, r, num_micro):
        v = c * P + r
        if kind == "F":
            x = None if v == 0 else recv(v - 1, c, False).requires_grad_()
            y = forward_step(c, m, x)
            held[(c, m)] = (x, y)
            if v < last:
                send(y, v + 1, False)
        else:
            x, y = held.pop((c, m))
            dy = None if v == last else recv(v + 1, c, True)
            dx = _backward(x, y, dy)
            if v > 0:
                assert dx is not None
                send(dx, v - 1, True)
    for work, _ in sends:
        work.wait()
