"""The reshard plan: what the pure planner produces and the executor consumes. Pure data.

Coordinates: a message moves one global ``region`` (a box in the tensor's global shape)
of one ``(tensor, kind)``. ``src_box`` is that region in the sender's *old local*
tensor coordinates, ``dst_box`` the same region in the receiver's *new local* tensor
coordinates, so the executor slices ``old_local[src_box]`` and writes it into
``new_local[dst_box]`` without knowing anything about layouts.

A ``LocalCopy`` is the same for bytes a worker already holds: they move (at most) inside
its own memory, never over the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.reshard.spec import Box, Kind, box_numel


@dataclass(frozen=True)
class Message:
    src: str  # worker id of the sender
    dst: str  # worker id of the receiver
    tensor: str
    kind: Kind
    region: Box  # global coordinates
    src_box: Box  # in the sender's old local tensor
    dst_box: Box  # in the receiver's new local tensor
    round: int = 0

    @property
    def numel(self) -> int:
        return box_numel(self.region)


@dataclass(frozen=True)
class LocalCopy:
    worker: str
    tensor: str
    kind: Kind
    region: Box
    src_box: Box  # in the worker's old local tensor
    dst_box: Box  # in the worker's new local tensor

    @property
    def numel(self) -> int:
        return box_numel(self.region)


@dataclass(frozen=True)
class NewShard:
    """A tensor piece a worker must hold after the reshard (to allocate receive buffers)."""

    worker: str
    tensor: str
    kind: Kind
    region: Box  # global box; the local tensor has this box's shape


@dataclass(frozen=True)
class ReshardPlan:
    model: str
    old_layout: str
    new_layout: str
    kinds: tuple[Kind, ...]
    bytes_per_element: int
    old_ranks: dict[str, int]  # worker -> rank under the old layout (old members)
    new_ranks: dict[str, int]  # worker -> rank under the new layout (the rank map; new members)
    leavers: tuple[str, ...]  # old members not in the new layout
    joiners: tuple[str, ...]  # new members that hold nothing yet
    messages: tuple[Message, ...]
    local_copies: tuple[LocalCopy, ...]
    new_shards: tuple[NewShard, ...]
    rounds: int
    bytes_total_state: int  # bytes of one full copy of the state (every tensor, every kind, once)
    bytes_needed: int  # bytes all new ranks hold after the reshard (replicas counted per holder)
    bytes_lower_bound: int  # needed minus already local under the chosen rank map
    bytes_lower_bound_without_remap: int  # the same under the identity map (new ranks in new_workers order)
    bytes_planned: int  # bytes the messages carry
    send_bytes: dict[str, int] = field(default_factory=dict)
    recv_bytes: dict[str, int] = field(default_factory=dict)
    staging_cap_bytes: int | None = None
    plan_seconds: float = 0.0  # measured by the caller, not the pure planner

    @property
    def members(self) -> tuple[str, ...]:
        """Every worker that takes part: old union new, sorted."""
        return tuple(sorted(set(self.old_ranks) | set(self.new_ranks)))

    @property
    def max_send_bytes(self) -> int:
        return max(self.send_bytes.values(), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes.values(), default=0)

    def estimate_seconds(self, bandwidth_bytes_per_s: float) -> float:
        """Lower-bound time if every worker sends and receives at ``bandwidth`` concurrently."""
        worst = max(self.max_send_bytes, self.max_recv_bytes)
        return worst / bandwidth_bytes_per_s if bandwidth_bytes_per_s > 0 else float("inf")

    def messages_for(self, worker: str) -> tuple[list[Message], list[Message]]:
        """(messages ``worker`` sends, messages it receives)."""
        return [m for m in self.messages if m.src == worker], [m for m in self.messages if m.dst == worker]
