"""Reshard any DTensor training state between two device meshes, in memory, collectively.

What it is for: ``DTensor.redistribute`` cannot change meshes and ``torch.distributed.checkpoint``
reshards only through storage. :func:`reshard` moves a model's parameters and optimizer state
from the layout they have (``src``, this worker's state on the old mesh) straight into the
tensors of the new layout (``dst``, already built on the new mesh), sending over the network
only the bytes that no local copy holds.

Steps (every rank of ``group`` calls it; old and new workers together):

1. **describe** this worker's ``src`` and ``dst``: per key the global shape, dtype, mesh and
   placements, and this worker's coordinate in each mesh; 0-d tensors (Adam's ``step``) as values;
2. **exchange** the descriptions once over ``group``: coordinates from everyone, key tables only
   from the first worker of each distinct table (every worker of a pipeline stage has the
   same one), so the exchange stays small at a thousand workers;
3. **plan** (``elastic/reshard/plan_regions.py``, pure): every worker derives every region from
   mesh + placements and computes the same plan; any problem (a key only one side has, a shape
   or dtype mismatch, a ``Partial`` placement, state no live worker holds) is raised here, on
   every worker alike, before a byte moves;
4. **execute** (``elastic/reshard/execute.py``): batched point-to-point sends and receives
   straight into ``dst``'s local shards, local copies for what a worker keeps; scalars are set.

Worker ids are ranks in ``group``: a registered process group, or a raw backend (a
``ProcessGroupGloo`` built on a store, which can join processes of different default groups:
the Manager's union of old and new workers). :func:`prepare_reshard` runs steps 1-3 and
allocates nothing the caller did not build, so a caller can decide whether to go ahead (every
worker agrees on :attr:`PreparedReshard.digest`) before :func:`execute_reshard` moves a byte.
:func:`freeze` describes a ``src`` while its mesh's process groups still exist (a process that
is about to destroy them: the description is what the reshard needs later). Must not: build
meshes or models, or free ``src`` (the caller drops the old model when it is done with it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import SpecError
from elastic.reshard import execute as ex
from elastic.reshard.plan import ReshardError
from elastic.reshard.plan_regions import Placed, RegionPlan, assign_slots, plan_regions
from elastic.reshard.regions import Region, full_region, shard_region
from elastic.torch.regions import (
    is_dtensor,
    local_region,
    local_tensor,
    mesh_coordinate,
    mesh_fingerprint,
    placements_of,
)
from elastic.torch.state import SEP

__all__ = ["NoPeers", "PreparedReshard", "Replicated", "ReshardStats", "describe", "execute_reshard", "freeze",
           "mesh_order", "plan", "prepare_reshard", "replicated", "reshard"]

State = Mapping[str, torch.Tensor]


@dataclass
class ReshardStats:
    """One reshard, as seen by one worker. ``bytes_*`` and ``messages`` cover every worker (the plan);
    ``bytes_sent``/``bytes_received`` and the seconds are this worker's."""

    bytes_moved: int = 0  # what the messages carry, all workers
    bytes_lower_bound: int = 0  # what the new layout needs minus what is already local
    bytes_needed: int = 0
    bytes_local: int = 0
    messages: int = 0
    keys: int = 0
    scalars: int = 0
    templates: int = 0
    rounds: int = 0
    leavers: tuple[int, ...] = ()
    joiners: tuple[int, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # the whole call on this worker
    exchange_seconds: float = 0.0  # describe + the metadata exchange
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0
    executor: ex.ReshardStats = field(default_factory=ex.ReshardStats)


# --------------------------------------------------------------------------------------------
# 1. describe
# --------------------------------------------------------------------------------------------


@dataclass
class _Side:
    """One worker's description of one side (``src`` or ``dst``)."""

    table: dict[str, tuple]  # key -> ("t", shape, dtype, mesh fp | None, placements | None) | ("s", dtype, value)
    coords: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # mesh fp -> (mesh shape, my coordinate)
    locals: dict[str, torch.Tensor]  # key -> this worker's local tensor (not exchanged)
    scalars: dict[str, torch.Tensor]  # key -> the live 0-d tensor (not exchanged)
    errors: list[str]
    device: str | None

    @property
    def digest(self) -> str:
        return hashlib.blake2b(repr(sorted(self.table.items())).encode(), digest_size=16).hexdigest()


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def describe(state: State | _Side | None) -> _Side | None:
    """What this worker holds of each key of ``state``; problems are collected, not raised, so that
    every worker hears of them in the exchange and refuses together. A side already described
    (:func:`freeze`) is returned as it is."""
    if state is None or isinstance(state, _Side):
        return state
    side = _Side({}, {}, {}, {}, [], None)
    devices: set[str] = set()
    # id(mesh) -> (mesh, fingerprint, shape, position): computed once per mesh, not per tensor;
    # the mesh is kept in the value so its id cannot be reused during the loop.
    meshes: dict[int, tuple] = {}
    for key, t in state.items():
        if not isinstance(key, str):
            side.errors.append(f"key {key!r} is a {type(key).__name__}; keys are strings (training_state's names)")
            continue
        if not isinstance(t, torch.Tensor):
            side.errors.append(f"{key}: a {type(t).__name__}, not a tensor")
            continue
        try:
            local = local_tensor(t)
            devices.add(local.device.type)
            if t.dim() == 0:
                value = local.item()
                side.table[key] = ("s", _dtype_name(t.dtype), value)
                side.scalars[key] = t
                continue
            if is_dtensor(t):
                mesh = t.device_mesh
                known = meshes.get(id(mesh))
                if known is None:
                    known = meshes[id(mesh)] = (mesh, mesh_fingerprint(mesh), tuple(mesh.shape), mesh_coordinate(mesh))
                _, fp, mesh_shape, position = known
                side.coords[fp] = (mesh_shape, tuple(position or ()))
                pl = placements_of(t)
                local_region(t, position)  # checks our region against the shard torch holds
                side.table[key] = ("t", tuple(t.shape), _dtype_name(t.dtype), fp, pl)
            else:
                side.table[key] = ("t", tuple(t.shape), _dtype_name(t.dtype), None, None)
            side.locals[key] = local
        except SpecError as e:  # ReshardError, PlacementError
            side.errors.append(f"{key}: {e}")
        except Exception as e:  # noqa: BLE001 - peers wait in the exchange: they must hear of it
            side.errors.append(f"{key}: {type(e).__name__}: {e}")
    if len(devices) > 1:
        side.errors.append(f"the state spans devices {sorted(devices)}; move it to one device type first")
    side.device = next(iter(devices), None)
    return side


def freeze(state: State | None) -> _Side | None:
    """``state`` described now, to be passed as ``src`` later (:func:`reshard`, :func:`prepare_reshard`,
    :func:`mesh_order`). A shard's place on its mesh is read from the default process group
    (:func:`elastic.torch.regions.mesh_coordinate`): a process that destroys that group to build
    another one (a rescale, a recovery after a lost peer) freezes its old state first. The local
    shards are kept, not copied."""
    return describe(state)


# --------------------------------------------------------------------------------------------
# 2. exchange
# --------------------------------------------------------------------------------------------


def _is_raw(group: Any) -> bool:
    return group is not None and not isinstance(group, dist.ProcessGroup)


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (registered or raw)."""
    return group.rank() if _is_raw(group) else dist.get_rank(group)


def group_size(group: Any) -> int:
    return group.size() if _is_raw(group) else dist.get_world_size(group)


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, over a registered group or a raw backend."""
    n = group_size(group)
    if not _is_raw(group):
        got: list[Any] = [None] * n
        dist.all_gather_object(got, obj, group=group)
        return got
    import pickle

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    group.allgather([sizes], [size]).wait()
    longest = max(int(x.item()) for x in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    outs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    group.allgather([outs], [padded]).wait()
    return [pickle.loads(o[: int(k.item())].numpy().tobytes()) for o, k in zip(outs, sizes, strict=True)]


# Key tables are sent in the first round of the description exchange by every worker while all
# of them together (entries per worker x workers) stay under this; larger ones once per distinct
# table, in a second round, so that a thousand workers do not each receive a thousand copies.
_INLINE_TABLE_KEYS = 1 << 16


@dataclass
class _World:
    """Every worker's descriptions, as every worker sees them after the exchange."""

    n: int
    src_hash: list[str | None]
    dst_hash: list[str | None]
    src_coords: list[dict]
    dst_coords: list[dict]
    tables: dict[str, dict[str, tuple]]  # digest -> key table
    errors: list[tuple[int, str]]
    devices: set[str]


def _exchange(src: _Side | None, dst: _Side | None, group: Any) -> _World:
    n = group_size(group)
    first = (src.digest if src else None, src.coords if src else {}, dst.digest if dst else None,
             dst.coords if dst else {}, (src.errors if src else []) + (dst.errors if dst else []),
             [s.device for s in (src, dst) if s is not None and s.device])
    # small tables ride along with the first round: the second (each distinct table from one
    # owner) is needed only for a table too large to send from every worker that holds it
    inline = {side.digest: side.table for side in (src, dst) if side is not None}
    if n * sum(len(t) for t in inline.values()) > _INLINE_TABLE_KEYS:
        inline = {}
    got = all_gather_object((*first, inline), group)
    me = group_rank(group)
    tables: dict[str, dict[str, tuple]] = {}
    for g in got:
        tables.update(g[6])
    owner: dict[str, int] = {}
    for r, (sh, _, dh, _, _, _, _) in enumerate(got):
        for h in (sh, dh):
            if h is not None and h not in owner and h not in tables:
                owner[h] = r
    if owner:  # every worker sees the same first round, so all of them take the second or none
        mine = {}
        for side in (src, dst):
            if side is not None and owner.get(side.digest) == me:
                mine[side.digest] = side.table
        for t in all_gather_object(mine, group):
            tables.update(t)
    return _World(n, [g[0] for g in got], [g[2] for g in got], [g[1] for g in got], [g[3] for g in got],
                  tables, [(r, e) for r, g in enumerate(got) for e in g[4]], {d for g in got for d in g[5]})


# --------------------------------------------------------------------------------------------
# 3. plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replicated:
    """A ``src`` every old worker holds whole (plain data parallelism: no DTensor), known to every
    worker before the reshard: its key table (:func:`replicated` of one old worker's frozen side)
    and which ranks of the group are old and new. With it, :func:`plan` builds the exchange's
    outcome locally instead of exchanging (no collective before the bytes move): each worker
    assumes every new worker builds what it builds. A worker whose ``dst`` differs from the
    running state still raises, naming the keys; two new workers that built different states
    compute different plans, which a caller that compares :attr:`PreparedReshard.digest`
    (a coordinator's meeting) refuses before any byte moves."""

    table: dict[str, tuple]
    device: str | None
    old_members: tuple[int, ...]
    new_members: tuple[int, ...]


def replicated(src: State | _Side, old_members: Sequence[int], new_members: Sequence[int]) -> Replicated:
    """``src`` (one old worker's state, or its :func:`freeze`) as the whole state every old worker
    holds; ReshardError if it holds a DTensor (its shards differ between workers)."""
    side = describe(src)
    assert side is not None
    sharded = sorted(k for k, e in side.table.items() if e[0] == "t" and e[3] is not None)
    if sharded:
        raise ReshardError(f"{sharded[0]} is a DTensor: a replicated source holds plain tensors only "
                           f"({len(sharded)} DTensor key(s))")
    return Replicated(dict(side.table), side.device, tuple(old_members), tuple(new_members))


class NoPeers:
    """The group of a reshard in which no byte crosses processes (replicas shrinking: every member
    keeps its own copy): this worker's ``rank`` among ``size`` members, the order a group of them
    would have, and nothing to communicate over. Only with a known replicated source
    (:func:`prepare_reshard` ``known=``): a plan that would move bytes is refused."""

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"NoPeers(rank={rank}, size={size}): the rank must be in [0, size)")
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _assumed_world(rep: Replicated, s: _Side | None, d: _Side | None, group: Any) -> _World:
    """The exchange's outcome for a replicated source, built from what this worker knows."""
    n, me = group_size(group), group_rank(group)
    errors = list((s.errors if s else []) + (d.errors if d else []))
    src_digest = _Side(rep.table, {}, {}, {}, [], rep.device).digest
    if s is not None and not errors and s.digest != src_digest:
        errors.append("this worker's state is not the replicated source's: the old workers' states differ "
                      "(keys, shapes or dtypes)")
    if (me in rep.new_members) != (d is not None) or (me in rep.old_members) != (s is not None):
        role = {(True, True): "an old and a new member", (True, False): "an old member only",
                (False, True): "a new member only", (False, False): "no member"}[(me in rep.old_members,
                                                                                  me in rep.new_members)]
        passes = " and ".join(x for x, y in (("src", s), ("dst", d)) if y is not None) or "neither side"
        errors.append(f"rank {me} is {role} of the replicated source but passes {passes}: an old member "
                      "passes src, a new member dst")
    if d is not None and d.coords:
        errors.append("the new state holds DTensors: a replicated source's plan assumes plain tensors on both "
                      "sides; reshard without `replicated`")
    # a worker that builds no new state (a leaver) takes the new workers' for the old one's: a
    # replica's new state holds the same tensors, and whatever differs moves no byte of the plan
    dst_digest, dst_table = (d.digest, d.table) if d is not None else (src_digest, rep.table)
    tables = {src_digest: rep.table, dst_digest: dst_table}
    old, new = set(rep.old_members), set(rep.new_members)
    return _World(n, [src_digest if r in old else None for r in range(n)],
                  [dst_digest if r in new else None for r in range(n)],
                  [{} for _ in range(n)], [{} for _ in range(n)], tables, [(me, e) for e in errors],
                  {x for x in (rep.device, d.device if d else None) if x})


def _placed(world: _World, which: str) -> tuple[dict[str, Placed], dict[str, tuple[str, Any]], list[int]]:
    """Every key of one side with every holder's region; scalars apart; the members of that side."""
    hashes = world.src_hash if which == "src" else world.dst_hash
    coords = world.src_coords if which == "src" else world.dst_coords
    by_hash: dict[str, list[int]] = {}
    for r, h in enumerate(hashes):
        if h is not None:
            by_hash.setdefault(h, []).append(r)
    entries: dict[str, tuple] = {}
    holders: dict[str, list[str]] = {}
    for h in by_hash:  # in order of each table's first worker: the same on every worker
        for key, e in world.tables[h].items():
            prev = entries.get(key)
            if prev is None:
                entries[key] = e
                holders[key] = [h]
            elif prev[:-1] != e[:-1] if e[0] == "s" else not _same_tensor(prev, e, coords, by_hash[holders[key][0]][0],
                                                                          by_hash[h][0]):
                raise ReshardError(
                    f"{key}: workers {by_hash[holders[key][0]][0]} and {by_hash[h][0]} describe it differently in "
                    f"the {which} state ({_what(prev)} vs {_what(e)}); every worker must build the same model"
                )
            elif e[0] == "s" and prev[2] != e[2]:
                raise ReshardError(
                    f"{key}: workers {by_hash[holders[key][0]][0]} and {by_hash[h][0]} hold different values "
                    f"({prev[2]!r} vs {e[2]!r}) in the {which} state; replicas must agree"
                )
            else:
                holders[key].append(h)
    placed: dict[str, Placed] = {}
    scalars: dict[str, tuple[str, Any]] = {}
    maps: dict[tuple, dict[int, Region]] = {}
    for key, e in entries.items():
        if e[0] == "s":
            scalars[key] = (e[1], e[2])
            continue
        _, shape, dtype, _, pl = e
        # each holder's own mesh: replicas may hold a key on sibling sub-meshes (DDP x TP: one tp
        # mesh per replica), each worker's region is its place on its mesh
        own = tuple((h, world.tables[h][key][3]) for h in holders[key])
        sig = (shape, pl, own)
        m = maps.get(sig)
        if m is None:
            m = maps[sig] = {}
            for h, fp in own:
                for r in by_hash[h]:
                    if fp is None:
                        m[r] = full_region(shape)
                    else:
                        mesh_shape, coord = coords[r][fp]
                        m[r] = shard_region(shape, mesh_shape, coord, pl)
        placed[key] = Placed(shape, m, dtype, _itemsize(dtype))
    return placed, scalars, sorted(r for rs in by_hash.values() for r in rs)


def _same_tensor(a: tuple, b: tuple, coords: list[dict], ra: int, rb: int) -> bool:
    """Two workers' entries of one key describe the same tensor: equal, or the same shape, dtype and
    placements on meshes of the same shape (sibling sub-meshes, e.g. each replica's tp mesh)."""
    if a == b:
        return True
    if a[0] != "t" or b[0] != "t" or a[1:3] != b[1:3] or a[4] != b[4] or a[3] is None or b[3] is None:
        return False
    return coords[ra][a[3]][0] == coords[rb][b[3]][0]


def _what(e: tuple) -> str:
    if e[0] == "s":
        return f"a {e[1]} scalar"
    return f"{e[2]} {list(e[1])} {'placements ' + str(e[4]) if e[3] else 'plain'}"


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _check_sides(world: _World, old: Mapping[str, Placed], new: Mapping[str, Placed], old_s: Mapping, new_s: Mapping,
                 old_members: Sequence[int], new_members: Sequence[int]) -> None:
    if world.errors:
        lines = "; ".join(f"rank {r}: {e}" for r, e in world.errors[:6])
        more = f" (and {len(world.errors) - 6} more)" if len(world.errors) > 6 else ""
        raise ReshardError(f"the state cannot be resharded: {lines}{more}")
    idle = sorted(set(range(world.n)) - set(old_members) - set(new_members))
    if idle:
        raise ReshardError(
            f"ranks {idle[:8]} of the group pass neither src nor dst; every rank of the group takes part "
            "(old workers pass src, new workers dst): reshard over a group of exactly the old and new workers"
        )
    if len(world.devices) > 1:
        raise ReshardError(f"workers hold their state on different device types {sorted(world.devices)}")
    if not new_members:
        raise ReshardError("no rank passes dst: there is no new layout to reshard into")
    for name, a, b in (("tensor", old, new), ("scalar", old_s, new_s)):
        only_new = [k for k in b if k not in a and k not in (old if name == "scalar" else old_s)]
        if only_new:
            raise ReshardError(
                f"the new state has {len(only_new)} {name} key(s) that no worker's old state holds, e.g. "
                f"{only_new[:3]}: the model or optimizer changed between the meshes; build the new one with the "
                "same parameter names and optimizer"
            )
    lost = [k for k in list(old) + list(old_s) if k not in new and k not in new_s]
    if lost:
        hint = (" (the new optimizer has no state yet: take dst = training_state(model, optimizer, "
                "init_optimizer=True))") if any(SEP in k for k in lost) else ""
        raise ReshardError(
            f"the new state lacks {len(lost)} key(s) of the old one, e.g. {lost[:3]}; they would be lost{hint}"
        )
    for k in old_s:
        if k in new:
            raise ReshardError(f"{k}: a scalar (0-d) in the old state but a tensor in the new one")
    for k in new_s:
        if k in old:
            raise ReshardError(f"{k}: a tensor in the old state but a scalar (0-d) in the new one")


def plan(src: State | None, dst: State | None, *, group: Any = None, staging_cap_bytes: int | None = None,
         errors: Sequence[str] = (), known: Replicated | None = None) -> tuple[RegionPlan, dict[str, tuple[str, Any]],
                                                                              _Side | None, _Side | None, float]:
    """Steps 1-3 of :func:`reshard` (collective): the plan every worker agrees on, the scalar values,
    this worker's two descriptions and the seconds the exchange took. ``errors``: this worker's own
    reasons to refuse (its new model could not be built), heard by every worker in the exchange.
    ``known``: a replicated source every worker knows (:class:`Replicated`): no exchange, and
    ``errors`` raise on this worker only."""
    t0 = time.perf_counter()
    s, d = describe(src), describe(dst)
    if errors:  # on the new side, a copy: a frozen src is described once and used again
        d = _Side({}, {}, {}, {}, list(errors), None) if d is None else replace(d, errors=[*d.errors, *errors])
    world = _exchange(s, d, group) if known is None else _assumed_world(known, s, d, group)
    t_exchange = time.perf_counter() - t0
    old, old_s, old_members = _placed(world, "src")
    new, new_s, new_members = _placed(world, "dst")
    _check_sides(world, old, new, old_s, new_s, old_members, new_members)
    p = plan_regions(old, new, old_members=old_members, new_members=new_members,
                     staging_cap_bytes=staging_cap_bytes)
    return p, old_s, s, d, t_exchange


# --------------------------------------------------------------------------------------------
# 4. execute
# --------------------------------------------------------------------------------------------


@dataclass
class PreparedReshard:
    """A reshard planned and agreed on by every worker, nothing moved yet (:func:`prepare_reshard`).

    ``digest`` is the same on every worker of the group (the plan is computed from the same
    exchanged descriptions): a coordinator can compare it before letting the bytes move."""

    plan: RegionPlan
    prepared: Any  # elastic.reshard.execute.Prepared
    group: Any
    scalars: dict[str, tuple[str, Any]]
    dst: _Side | None
    digest: str
    started: float
    exchange_seconds: float
    plan_seconds: float


def prepare_reshard(src: State | _Side | None, dst: State | None, *, group: Any = None,
                    staging_cap_bytes: int | None = None, transport: Any = None, errors: Sequence[str] = (),
                    agree: bool = True, known: Replicated | None = None) -> PreparedReshard:
    """Steps 1-3 of :func:`reshard` and the executor's preparation (collective over ``group``):
    raises :class:`ReshardError` on every worker alike when the state cannot be moved. Nothing is
    allocated beyond staging buffers: the bytes land in ``dst``'s own tensors, and ``src`` stays
    whole until the caller drops it. ``transport``: the group whose ranks are ``group``'s that
    carries the bytes (a raw NCCL backend for CUDA tensors, with a gloo ``group`` for the
    metadata); default ``group``. ``errors``: this worker's own reasons to refuse, raised on
    every worker. ``agree=False``: a preparation that fails here raises here only, for a caller
    whose workers agree elsewhere before any byte moves (a coordinator's meeting). ``known``: a
    replicated source (:class:`Replicated`): planned without exchanging descriptions, for such a
    caller (``agree=False``)."""
    if known is not None and agree:
        raise ValueError("prepare_reshard(known=...) plans without a collective; pass agree=False and compare "
                         "the digests before executing")
    if isinstance(group, NoPeers) and known is None:
        raise ValueError("prepare_reshard(group=NoPeers(...)) needs known=: without a group the descriptions "
                         "cannot be exchanged")
    t0 = time.perf_counter()
    p, scalars, s, d, t_exchange = plan(src, dst, group=group, staging_cap_bytes=staging_cap_bytes, errors=errors,
                                        known=known)
    t_plan = time.perf_counter() - t0 - t_exchange
    me = group_rank(group)
    if isinstance(group, NoPeers) and p.n_messages:
        raise ReshardError(f"the plan sends {p.n_messages} message(s) between workers ({p.bytes_planned} bytes): "
                           "it needs a group of the old and new workers, not NoPeers")
    device = (s.device if s and s.device else None) or (d.device if d and d.device else None) or "cpu"
    old_state = {(k, p_kind(t)): t for k, t in (s.locals.items() if s else ())}
    into = {(k, p_kind(t)): t for k, t in (d.locals.items() if d else ())}
    dtypes = {kind: getattr(torch, kind) for kind in p.kinds}
    problem = None
    prepared = None
    try:
        prepared = ex.prepare(p, me, old_state, device=device, dtypes=dtypes, into=into)  # type: ignore[arg-type]
    except (ReshardError, ValueError, RuntimeError) as e:
        problem = f"{type(e).__name__}: {e}"
    if not agree:
        if problem:
            raise ReshardError(f"the state cannot be resharded: rank {me}: {problem}")
        bad = []
    else:
        # a worker that cannot prepare must not leave its peers blocked in their first receive:
        # everyone hears of it and refuses together, still before any byte moves
        bad = [(r, x) for r, x in enumerate(all_gather_object(problem, group)) if x]
    if bad:
        raise ReshardError("the state cannot be resharded: " + "; ".join(f"rank {r}: {x}" for r, x in bad[:4]))
    digest = hashlib.blake2b(repr((p.bytes_planned, p.bytes_lower_bound, p.n_messages, p.keys, sorted(p.members),
                                   sorted(scalars.items()))).encode(), digest_size=12).hexdigest()
    return PreparedReshard(p, prepared, group if transport is None else transport, scalars, d, digest, t0,
                           t_exchange, t_plan)


def execute_reshard(r: PreparedReshard, *, verify: bool = False) -> ReshardStats:
    """Step 4: move the bytes of a prepared reshard into ``dst`` and set its scalars (collective)."""
    p = r.plan
    te = time.perf_counter()
    if isinstance(r.group, NoPeers):
        ex.execute_local(r.prepared, verify=verify)
    else:
        ex.execute(r.prepared, r.group, {w: w for w in p.members}, verify=verify)
    if r.dst is not None:
        with torch.no_grad():
            for key, t in r.dst.scalars.items():
                t.fill_(r.scalars[key][1])
    done = time.perf_counter()
    st = r.prepared.stats
    return ReshardStats(
        bytes_moved=p.bytes_planned, bytes_lower_bound=p.bytes_lower_bound, bytes_needed=p.bytes_needed,
        bytes_local=p.bytes_local, messages=p.n_messages, keys=p.keys, scalars=len(r.scalars),
        templates=p.templates, rounds=p.rounds, leavers=tuple(p.leavers), joiners=tuple(p.joiners),  # type: ignore[arg-type]
        bytes_sent=st.bytes_sent, bytes_received=st.bytes_received, seconds=done - r.started,
        exchange_seconds=r.exchange_seconds, plan_seconds=r.plan_seconds, execute_seconds=done - te, executor=st,
    )


def reshard(src: State | _Side | None, dst: State | None, *, group: Any = None, verify: bool = False,
            staging_cap_bytes: int | None = None) -> ReshardStats:
    """Fill ``dst``'s local shards from ``src``'s, across workers; collective over ``group``.

    ``src``: this worker's state on the old mesh (``training_state(model, optimizer)``, or
    :func:`freeze` of it), ``None`` for a joiner. ``dst``: this worker's state already built on
    the new mesh (``training_state(new_model, new_optimizer, init_optimizer=True)``), ``None``
    for a leaver. Every rank of ``group`` (default: the world) calls it, and is an old worker, a
    new worker or both. ``verify=True`` checksums every message and local copy on both ends.
    Raises :class:`ReshardError` on every worker, before any byte moves, when the state cannot
    be moved; ``src`` is never modified.
    """
    return execute_reshard(prepare_reshard(src, dst, group=group, staging_cap_bytes=staging_cap_bytes),
                           verify=verify)


def p_kind(t: torch.Tensor) -> str:
    return _dtype_name(t.dtype)


# --------------------------------------------------------------------------------------------
# Rank assignment for a new mesh
# --------------------------------------------------------------------------------------------


def mesh_order(src: State | None, mesh_shape: Sequence[int], *, new_members: Sequence[int],
               mesh_dim_names: Sequence[str] | None = None, group: Any = None,
               placements: Callable[[str, tuple], Sequence[Any]] | None = None) -> list[int]:
    """Which rank of ``group`` takes each position of a new mesh so that the most bytes stay local.

    Collective over ``group`` (every rank calls it with the same arguments). ``new_members``
    are the group ranks of the new layout (survivors and joiners: ``src is None``); the result
    lists them in the new mesh's row-major order: give rank ``order[i]`` rank ``i`` of the new
    world's process group and build the mesh over ``range(n)``. Within one group the order
    cannot be applied by permuting a ``DeviceMesh`` tensor: torch sorts each mesh dim's group,
    and the data follows the sorted order (see :func:`elastic.torch.regions.mesh_coordinate`).

    The new state's placements are predicted from the old ones: by default each key keeps its
    placement on every mesh dim of the same name (``Replicate`` on new dims; a ``_StridedShard``
    split factor follows the new sizes of the later dims sharding the same tensor dim), which
    is how one parallelize function behaves at another size. ``placements(key, old_entry)`` may
    say otherwise. A wrong prediction costs locality, never correctness: :func:`reshard` plans
    from the real new state.
    """
    s = describe(src)
    world = _exchange(s, None, group)
    if world.errors:
        raise ReshardError(f"the state cannot be resharded: rank {world.errors[0][0]}: {world.errors[0][1]}")
    old, _, old_members = _placed(world, "src")
    shape = tuple(int(x) for x in mesh_shape)
    n_slots = 1
    for x in shape:
        n_slots *= x
    if len(new_members) != n_slots:
        raise ReshardError(f"{len(new_members)} new members for a mesh of shape {list(shape)} ({n_slots} positions)")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    entries = {k: e for h in dict.fromkeys(x for x in world.src_hash if x) for k, e in world.tables[h].items()}
    mesh_names = _old_mesh_names(src)
    coords = [_unravel(i, shape) for i in range(n_slots)]
    slots: dict[str, Placed] = {}
    shared: dict[tuple, dict[int, Region]] = {}
    for key, o in old.items():
        e = entries[key]
        new_pl = tuple(placements(key, e)) if placements else _predict(e, mesh_names.get(e[3]), names, shape)
        sig = (o.shape, new_pl)
        m = shared.get(sig)
        if m is None:
            m = shared[sig] = {i: shard_region(o.shape, shape, c, new_pl) for i, c in enumerate(coords)}
        slots[key] = Placed(o.shape, m, o.kind, o.itemsize)
    survivors = [r for r in new_members if r in set(old_members)]
    joiners = [r for r in new_members if r not in set(old_members)]
    return assign_slots(old, slots, survivors, joiners)


def _old_mesh_names(src: State | None) -> dict[str, tuple[str, ...] | None]:
    out: dict[str, tuple[str, ...] | None] = {}
    seen: dict[int, Any] = {}  # id -> mesh, kept alive so that an id is not reused in the loop
    for t in (src or {}).values():
        if is_dtensor(t) and id(t.device_mesh) not in seen:
            seen[id(t.device_mesh)] = t.device_mesh
            out[mesh_fingerprint(t.device_mesh)] = tuple(t.device_mesh.mesh_dim_names or ()) or None
    return out


def _predict(entry: tuple, old_names: tuple[str, ...] | None, new_names: tuple[str, ...] | None,
             shape: tuple[int, ...]) -> tuple:
    """The placements a key would have on the new mesh under the same parallelize function."""
    if entry[3] is None:  # a plain tensor stays replicated
        return tuple(("replicate",) for _ in shape)
    pl = entry[4]
    if new_names is None or old_names is None:
        if len(pl) != len(shape):
            return tuple(("replicate",) for _ in shape)
        by_pos = list(pl)
    else:
        by_name = dict(zip(old_names, pl, strict=True))
        by_pos = [by_name.get(n, ("replicate",)) for n in new_names]
    out = []
    for i, p in enumerate(by_pos):
        if p[0] == "strided":
            later = [shape[j] for j in range(i + 1, len(by_pos)) if by_pos[j][0] in ("shard", "strided")
                     and by_pos[j][1] == p[1]]
            sf = 1
            for x in later:
                sf *= x
            out.append(("strided", p[1], sf) if sf > 1 else ("shard", p[1]))
        else:
            out.append(p)
    return tuple(out)


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(i % s)
        i //= s
    return tuple(reversed(out))
