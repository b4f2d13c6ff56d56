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

from elastic.reshard.spec import Box, Kind, box_numel, box_shape


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
    region: Box  # global box; the local tensor has this box's shape unless ``shape`` says otherwise
    shape: tuple[int, ...] | None = None  # local shape when the region is not one box (a strided shard)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else box_shape(self.region)


_WorkerView = tuple[list[Message], list[Message], list[LocalCopy], list[NewShard]]
"""One worker's share of a plan: (sends, receives, local copies, new shards), each in plan order."""


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
    _index: dict[str, _WorkerView] = field(default_factory=dict, compare=False, repr=False)  # per-worker views, filled on first use

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

    # The executor's interface (shared with ``plan_regions.RegionPlan``): per-worker views, built
    # from one pass over the plan on first use instead of one scan per question.

    def describe(self) -> str:
        return f"{self.old_layout} -> {self.new_layout}"

    def is_new(self, worker: str) -> bool:
        return worker in self.new_ranks

    def is_old(self, worker: str) -> bool:
        return worker in self.old_ranks

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_index"] = {}  # rebuilt on first use where the plan lands
        return state

    def _by_worker(self) -> dict[str, _WorkerView]:
        index = self._index
        if not index:
            for w in self.members:
                index[w] = ([], [], [], [])
            for m in self.messages:
                index[m.src][0].append(m)
                index[m.dst][1].append(m)
            for c in self.local_copies:
                index[c.worker][2].append(c)
            for s in self.new_shards:
                index[s.worker][3].append(s)
        return index

    def messages_for(self, worker: str) -> tuple[list[Message], list[Message]]:
        """(messages ``worker`` sends, messages it receives), each in plan order."""
        got = self._by_worker().get(worker)
        return (list(got[0]), list(got[1])) if got else ([], [])

    def local_copies_for(self, worker: str) -> list[LocalCopy]:
        got = self._by_worker().get(worker)
        return list(got[2]) if got else []

    def new_shards_for(self, worker: str) -> list[NewShard]:
        got = self._by_worker().get(worker)
        return list(got[3]) if got else []
