"""The reshard executor's wire protocol: which messages travel together, at which byte offsets.

Wire protocol (both sides derive it from the plan and the per-kind dtypes alone, so
they always agree): per round and per ordered pair (sender, receiver), the plan's
messages in plan order; messages smaller than ``PACK_BELOW_BYTES`` travel together in
one flat buffer (the first wire), every larger message travels alone (the next wires,
tags counting up), each as the row-major bytes of its region in its kind's dtype. Each
side independently decides whether its end can use the tensor view directly
(contiguous) or needs a staging slice.

Both ends build the same schedule (:func:`_schedule`) from the plan and the per-kind dtypes;
see ``execute.py`` for why the wire is bytes in mixed precision. Nothing here moves a byte.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from elastic.reshard.spec import Box
from elastic.reshard.types import Message, ReshardPlan

State = dict[tuple[str, str], torch.Tensor]
"""``(tensor name, kind) -> local tensor`` with this rank's box shape (see elastic.reshard.spec): what a
reshard moves, and what the trainer's engine and agent hand it."""
Key = tuple[str, str]

PACK_BELOW_BYTES = 256 * 1024
"""Messages below this size share one flat buffer per (round, pair). A gloo op costs
tens of microseconds of fixed overhead; copying 256 KiB costs about as much, so packing
pays below it and a message above it is better sent alone (no copy at all when both
views are contiguous)."""

WIRE_ALIGN = 16
"""Byte alignment of every wire inside the staging pool, so a slice of it can be viewed
as any dtype (``Tensor.view(dtype)`` needs the offset to be a multiple of the element size)."""


@dataclass(frozen=True)
class _Wire:
    """One isend or irecv of ``nbytes`` bytes: ``msgs`` at byte ``offsets`` (see the module docstring)."""

    peer: str
    tag: int
    nbytes: int
    msgs: tuple[Message, ...]
    offsets: tuple[int, ...]  # byte offset of each message inside the wire, a multiple of its element size
    dtype: torch.dtype  # the dtype every message shares, or torch.uint8 when they mix
    direct: bool  # my end is one contiguous tensor view: no staging, no copy
    stage_offset: int  # byte offset into the (uint8) staging pool when not direct


@dataclass(frozen=True)
class _Round:
    sends: tuple[_Wire, ...]
    recvs: tuple[_Wire, ...]


def _bytes_of(dtypes: Mapping[str, torch.dtype]) -> Callable[[Key, int], int]:
    """``nbytes(key, numel)``: the bytes of ``numel`` elements of ``key``'s kind."""
    sizes = {kind: _elsize(dt) for kind, dt in dtypes.items()}
    return lambda key, numel: numel * sizes[key[1]]


def wire_bytes(plan: ReshardPlan, dtypes: Mapping[str, torch.dtype]) -> int:
    """Bytes the plan's messages really carry when each kind moves as ``dtypes[kind]``.

    ``plan.bytes_planned`` is elements times one ``bytes_per_element``; with mixed kinds
    (bf16 param, fp32 master/moments) this is the true figure the stats add up to.
    """
    return sum(m.numel * _elsize(dtypes[m.kind]) for m in plan.messages)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _schedule(
    plan: ReshardPlan, sends: Sequence[Message], recvs: Sequence[Message],
    old_shapes: dict[Key, tuple[int, ...]], new_shapes: dict[Key, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype], pack_below_bytes: int, strided: set[Key] = frozenset(),  # type: ignore[assignment]
) -> tuple[tuple[_Round, ...], int]:
    """Wires per round (same grouping and byte layout on both ends) and the staging bytes the biggest round needs.

    ``strided``: this worker's tensors that are not row-major; their ends of a wire always stage.
    """
    n_rounds = max(1, plan.rounds, 1 + max((m.round for m in (*sends, *recvs)), default=0))
    nbytes = _bytes_of(dtypes)

    def size(m: Message) -> int:
        return nbytes((m.tensor, m.kind), m.numel)

    rounds: list[_Round] = []
    staging = 0
    for r in range(n_rounds):
        offset = 0
        round_wires: dict[str, list[_Wire]] = {}
        for side, msgs, shapes in (("send", sends, old_shapes), ("recv", recvs, new_shapes)):
            wires: list[_Wire] = []
            for peer, group in _by_peer([m for m in msgs if m.round == r], side).items():
                for tag, part in enumerate(_split_wire(group, pack_below_bytes, size)):
                    part, offsets, total = _layout(part, dtypes)
                    box = part[0].src_box if side == "send" else part[0].dst_box
                    key = (part[0].tensor, part[0].kind)
                    direct = len(part) == 1 and key not in strided and _contiguous(shapes[key], box)
                    kinds = {dtypes[m.kind] for m in part}
                    dt = kinds.pop() if len(kinds) == 1 else torch.uint8
                    wires.append(_Wire(peer, tag, total, part, offsets, dt, direct, -1 if direct else offset))
                    offset += 0 if direct else _round_up(total, WIRE_ALIGN)
            round_wires[side] = wires
        staging = max(staging, offset)
        rounds.append(_Round(tuple(round_wires["send"]), tuple(round_wires["recv"])))
    return tuple(rounds), staging


def _layout(part: Sequence[Message], dtypes: Mapping[str, torch.dtype]) -> tuple[tuple[Message, ...], tuple[int, ...], int]:
    """Messages of one wire in wire order (largest element first, then plan order), their byte offsets, total.

    Element sizes are powers of two, so with the largest first every offset is already a
    multiple of its element size (fp32 ×3 then bf16 ×5: offsets 0, 12; 22 bytes); the
    rounding up only guards exotic mixes.
    """
    ordered = tuple(sorted(part, key=lambda m: -_elsize(dtypes[m.kind])))  # stable: plan order within a size
    offsets, off = [], 0
    for m in ordered:
        el = _elsize(dtypes[m.kind])
        off = _round_up(off, el)
        offsets.append(off)
        off += m.numel * el
    return ordered, tuple(offsets), off


def _by_peer(msgs: Iterable[Message], side: str) -> dict[str, list[Message]]:
    out: dict[str, list[Message]] = defaultdict(list)
    for m in msgs:  # plan order: the sender and the receiver see the same order
        out[m.dst if side == "send" else m.src].append(m)
    return dict(sorted(out.items()))


def _split_wire(group: list[Message], pack_below: int,
                size: Callable[[Message], int] | None = None) -> list[list[Message]]:
    """First wire: every small message packed together; then each big message alone.

    ``size(m)`` is compared with ``pack_below``: bytes in the executor, elements by default.
    """
    size = size or (lambda m: m.numel)
    small = [m for m in group if size(m) < pack_below]
    big = [[m] for m in group if size(m) >= pack_below]
    return ([small] if small else []) + big


def _contiguous(shape: tuple[int, ...], box: Box) -> bool:
    """Is ``t[box]`` one contiguous run of a row-major tensor of ``shape``?

    True iff, after leading dims of extent 1, the first wider dim may be partial and every
    later dim is full: rows 8..16 of a [64, 32] tensor are, columns 8..16 are not.
    """
    i = 0
    while i < len(box) and box[i][1] - box[i][0] == 1:
        i += 1
    return all(box[j] == (0, shape[j]) for j in range(i + 1, len(box)))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The flat ``uint8`` view of a contiguous tensor (no copy): what goes on the wire."""
    return t.reshape(-1).view(torch.uint8)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
