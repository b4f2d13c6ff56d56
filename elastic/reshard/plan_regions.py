"""The generic reshard planner: from any per-worker regions of any tensors, who sends which bytes to whom. Pure.

What it is for: state that does not come from our ``ModelSpec`` + ``Layout`` (a user's DTensor
model, FSDP2, tensor parallel, pipeline stages, plain replicated tensors). Each side is a
mapping ``key -> Placed(shape, {worker: Region}, kind, itemsize)``: the old side says what
every live worker holds now, the new side what every worker of the new layout must hold.
Output: a :class:`RegionPlan` that ``elastic/reshard/execute.py`` runs unchanged.

Steps (:func:`plan_regions`):

1. validate (every new key exists on the old side with the same shape and dtype, regions
   inside the shape);
2. **templates**: keys with the same (shape, old regions, new regions, element size) diff
   identically up to their name, so each distinct one is planned once (a transformer's 80 layers
   x 9 weights x 3 state kinds share ~10 templates). Region maps are recognised by object
   identity first, then by content;
3. **diff** per template: the distinct old regions (*cells*, with their holders) intersected
   with the distinct new ones; a needer that holds the overlapping cell copies locally, the
   others receive. Old cells must not intersect (an overlap is a contradiction between workers,
   refused, checked blockwise before anything is counted) and must cover every new element (a
   hole is state no live worker holds, refused);
4. **senders**: the back half of ``plan.py`` (largest pieces first onto the least-loaded
   replica, big pieces split along dim 0, leavers only when that lowers the makespan), on
   template-level pieces weighted by their bytes over all keys of the template;
5. **rounds** (with a staging cap): pieces split to the cap along dim 0 and packed so no worker
   sends + receives more than the cap per round (templates are cut into key groups whose rows
   fit the cap).

The plan keeps its messages per template and expands them per worker on demand
(:meth:`RegionPlan.messages_for`), so a 1,024-worker plan never builds millions of objects.

:func:`assign_slots` is the rank assignment: which surviving worker takes which position of
a new mesh so that the most bytes stay local (maximum-weight assignment).

This module must not import torch or anything that does I/O, and never reads the clock.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic.reshard.plan import (
    DEFAULT_SPLIT_MIN_BYTES,
    LazyTuple,
    ReshardError,
    _choose_senders,
    _Demand,
    _lex_max_assignment,
    _pack_rounds,
    _split_to_cap,
)
from elastic.reshard.regions import Region, region_boxes, region_numel, region_shape
from elastic.reshard.types import LocalCopy, Message, NewShard

__all__ = ["Placed", "RegionPlan", "assign_slots", "plan_regions"]

Worker = Hashable
Box = tuple[tuple[int, int], ...]

_BLOCK = 1 << 21
"""Old x new piece pairs intersected per numpy block (bounds the temporaries to tens of MB)."""


@dataclass(frozen=True)
class Placed:
    """One tensor on one side of a reshard: its global shape and every worker's region.

    ``regions`` lists every worker that holds (old side) or must hold (new side) the tensor;
    an empty region means the worker takes part but holds none of it (an uneven FSDP shard).
    Share one ``regions`` object between keys placed alike: they are then planned once.
    ``kind`` names the dtype the executor moves the bytes as; ``itemsize`` is its size.
    """

    shape: tuple[int, ...]
    regions: Mapping[Worker, Region]
    kind: str = "float32"
    itemsize: int = 4


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC off for a block that builds many small tuples and no cycles: it would only
    rescan them, again and again as they pile up. Left on again only if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# Step 1: validation
# --------------------------------------------------------------------------------------------


def _validate(old: Mapping[str, Placed], new: Mapping[str, Placed]) -> None:
    missing = [k for k in new if k not in old]
    if missing:
        raise ReshardError(
            f"the new state has {len(missing)} key(s) no worker of the old state holds, e.g. {missing[:3]}: "
            "the model (or its optimizer) differs between the two meshes; build the new one with the same "
            "parameter names and optimizer"
        )
    for key, n in new.items():
        o = old[key]
        if tuple(o.shape) != tuple(n.shape):
            raise ReshardError(
                f"{key}: global shape {list(o.shape)} in the old state but {list(n.shape)} in the new one; "
                "the model's configuration differs between the meshes"
            )
        if o.kind != n.kind or o.itemsize != n.itemsize:
            raise ReshardError(
                f"{key}: dtype {o.kind} in the old state but {n.kind} in the new one; build the new model "
                f"and optimizer with the same dtypes (or convert the old state to {n.kind} first)"
            )
    # Keys placed alike share one regions object: check each (object, shape) once, at its first key
    # (that key names the error, as a per-key check would).
    for side, state in (("old", old), ("new", new)):
        checked: set[tuple[int, tuple[int, ...]]] = set()
        for key, p in state.items():
            shape = tuple(p.shape)
            ck = (id(p.regions), shape)
            if ck in checked:
                continue
            checked.add(ck)
            for w, region in p.regions.items():
                _check_region(side, key, w, region, shape)


def _check_region(side: str, key: str, w: Worker, region: Region, shape: tuple[int, ...]) -> None:
    if len(region) != len(shape):
        raise ReshardError(f"{key}: worker {w!r}'s {side} region has {len(region)} dims, the tensor {len(shape)}")
    for d, runs in enumerate(region):
        last = 0
        for a, b in runs:
            if not (last <= a < b <= shape[d]):
                raise ReshardError(
                    f"{key}: worker {w!r}'s {side} region {list(map(list, region))} is not sorted disjoint runs "
                    f"inside the global shape {list(shape)} (dim {d})"
                )
            last = b


# --------------------------------------------------------------------------------------------
# Step 2: templates
# --------------------------------------------------------------------------------------------


class _Canon:
    """Region maps -> small ints, by identity first, then by content."""

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}
        self.by_content: dict[tuple, int] = {}
        self.maps: list[Mapping[Worker, Region]] = []

    def __call__(self, m: Mapping[Worker, Region]) -> int:
        c = self.by_id.get(id(m))
        if c is None:
            content = tuple(sorted(m.items(), key=lambda x: _sort_key(x[0])))
            c = self.by_content.get(content)
            if c is None:
                c = self.by_content[content] = len(self.maps)
                self.maps.append(m)
            self.by_id[id(m)] = c
        return c


def _sort_key(w: Worker) -> tuple:
    return (type(w).__name__, w)


@dataclass
class _Template:
    shape: tuple[int, ...]
    kind: str
    itemsize: int
    keys: list[str]
    old_map: int
    new_map: int
    # diff, per key, in worker indices
    needed: int = 0
    local: int = 0
    shards: list[tuple[int, Box, tuple[int, ...]]] = field(default_factory=list)  # (w, bounding box, local shape)
    copies: list[tuple[int, Box, Box, Box]] = field(default_factory=list)  # (w, region, src_box, dst_box)
    # after sender choice: (src, dst, region, src_box, dst_box, numel per key, round)
    raw: list[tuple[int, int, Box, Box, Box, int, int]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Step 3: diff
# --------------------------------------------------------------------------------------------


@dataclass
class _Cells:
    regions: list[Region]
    members: list[list[int]]  # worker indices per cell
    of: dict[int, int]  # worker index -> cell
    # pieces (boxes) of every cell
    lo: np.ndarray
    hi: np.ndarray
    origin: np.ndarray  # local origin of each piece
    cell: np.ndarray  # piece -> cell


def _cells(m: Mapping[Worker, Region], widx: dict[Worker, int], nd: int) -> _Cells:
    index: dict[Region, int] = {}
    regions: list[Region] = []
    members: list[list[int]] = []
    of: dict[int, int] = {}
    for w, r in sorted(m.items(), key=lambda x: widx[x[0]]):
        if region_numel(r) == 0:
            continue
        c = index.get(r)
        if c is None:
            c = index[r] = len(regions)
            regions.append(r)
            members.append([])
        members[c].append(widx[w])
        of[widx[w]] = c
    lo, hi, origin, cell = [], [], [], []
    for c, r in enumerate(regions):
        for box, org in region_boxes(r):
            lo.append([a for a, _ in box])
            hi.append([b for _, b in box])
            origin.append(list(org))
            cell.append(c)
    shape = (len(lo), nd)
    as_arr = lambda x: np.array(x, dtype=np.int64).reshape(shape)  # noqa: E731
    return _Cells(regions, members, of, as_arr(lo), as_arr(hi), as_arr(origin),
                  np.array(cell, dtype=np.int64).reshape(len(cell)))


def _overlaps(old: _Cells, new: _Cells) -> list[tuple[int, int, Box, Box, Box]]:
    """Every (new piece, old piece) overlap as (new cell, old cell, region, src_box, dst_box),
    in new piece order then old piece order."""
    out: list[tuple[int, int, Box, Box, Box]] = []
    n_old = len(old.lo)
    if n_old == 0 or len(new.lo) == 0:
        return out
    step = max(1, _BLOCK // n_old)
    for b0 in range(0, len(new.lo), step):
        nlo, nhi = new.lo[b0:b0 + step, None, :], new.hi[b0:b0 + step, None, :]
        ilo = np.maximum(nlo, old.lo[None, :, :])
        ihi = np.minimum(nhi, old.hi[None, :, :])
        hit = np.all(ihi > ilo, axis=2)
        for pn, po in zip(*np.nonzero(hit), strict=True):
            pn_abs = b0 + int(pn)
            lo_, hi_ = ilo[pn, po].tolist(), ihi[pn, po].tolist()
            so = (old.origin[po] - old.lo[po]).tolist()
            do = (new.origin[pn_abs] - new.lo[pn_abs]).tolist()
            region = tuple(zip(lo_, hi_, strict=True))
            src = tuple((a + s, b + s) for a, b, s in zip(lo_, hi_, so, strict=True))
            dst = tuple((a + s, b + s) for a, b, s in zip(lo_, hi_, do, strict=True))
            out.append((int(new.cell[pn_abs]), int(old.cell[po]), region, src, dst))
    return out


def _box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _bounding(region: Region) -> Box:
    return tuple((runs[0][0], runs[-1][1]) if runs else (0, 0) for runs in region)


def _diff(t: _Template, old_map: Mapping[Worker, Region], new_map: Mapping[Worker, Region],
          widx: dict[Worker, int], workers: list[Worker]) -> tuple[list, list]:
    """Fill ``t``'s shards, copies, needed and local; return (demands, fixed) in per-key numel."""
    nd = len(t.shape)
    oc, nc = _cells(old_map, widx, nd), _cells(new_map, widx, nd)
    _check_disjoint(t.keys[0], oc, workers)
    for w, r in sorted(new_map.items(), key=lambda x: widx[x[0]]):
        t.shards.append((widx[w], _bounding(r), region_shape(r)))
    covered = [0] * len(nc.regions)
    demands: list[tuple[Box, Box, Box, int, int, list[int], list[int]]] = []
    fixed: list[tuple[int, int, Box, Box, Box, int, int]] = []
    for j, i, region, src, dst in _overlaps(oc, nc):
        numel = _box_numel(region)
        covered[j] += numel
        row = numel // max(1, region[0][1] - region[0][0]) if region else 1
        needers = nc.members[j]
        holders = oc.members[i]
        receivers = []
        for w in needers:
            if oc.of.get(w) == i:
                t.local += numel
                t.copies.append((w, region, src, dst))
            else:
                receivers.append(w)
        if not receivers:
            continue
        if len(holders) == 1:
            fixed += [(holders[0], r, region, src, dst, numel, row) for r in receivers]
        else:
            demands.append((region, src, dst, numel, row, holders, receivers))
    for j, r in enumerate(nc.regions):
        want = region_numel(r)
        t.needed += want * len(nc.members[j])
        # Old cells are disjoint (checked above) and a region's runs are, so no element is counted
        # twice: a shortfall is exactly the elements nobody holds.
        if covered[j] < want:
            w = workers[nc.members[j][0]]
            raise ReshardError(
                f"{t.keys[0]}: no live worker of the old state holds part of region {_fmt(r)} that worker "
                f"{w!r} needs ({want - covered[j]} of {want} elements uncovered): every worker that held it "
                "is gone, or the old state was described without it; the new layout cannot be built from "
                "the survivors (restore that state from a checkpoint)"
            )
    return demands, fixed


def _check_disjoint(key: str, oc: _Cells, workers: list[Worker]) -> None:
    """Refuse two old cells (distinct regions) that share an element.

    Replicas of one region form one cell, so any overlap between cells is two workers disagreeing
    about who holds what; left in, it would both double-send elements and, in a coverage count,
    hide a hole of the same size elsewhere. Sweep along the dim that leaves the fewest candidate
    pairs (pieces sorted by start, each paired with those that start before it ends), then test
    the candidates blockwise on every dim.
    """
    n, nd = oc.lo.shape
    if len(oc.regions) < 2 or nd == 0:
        return
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for d in range(nd):
        order = np.argsort(oc.lo[:, d], kind="stable")
        end = np.searchsorted(oc.lo[order, d], oc.hi[order, d], side="left")
        cnt = end - np.arange(n) - 1  # pieces after i (in start order) that start before i ends
        pairs = int(cnt.sum())
        if best is None or pairs < best[0]:
            best = (pairs, order, cnt)
    assert best is not None
    _, order, cnt = best
    cum = np.cumsum(cnt)
    a = 0
    while a < n:
        base = int(cum[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(cum, base + _BLOCK, side="right")))
        c = cnt[a:b]
        i = np.repeat(np.arange(a, b), c)
        j = i + 1 + np.arange(len(i)) - np.repeat(np.cumsum(c) - c, c)
        pi, pj = order[i], order[j]
        hit = (oc.cell[pi] != oc.cell[pj]) & np.all(
            np.minimum(oc.hi[pi], oc.hi[pj]) > np.maximum(oc.lo[pi], oc.lo[pj]), axis=1)
        if hit.any():
            k = int(np.argmax(hit))
            ca, cb = sorted((int(oc.cell[pi[k]]), int(oc.cell[pj[k]])))
            wa, wb = workers[oc.members[ca][0]], workers[oc.members[cb][0]]
            raise ReshardError(
                f"{key}: old workers hold overlapping but different regions of it ({wa!r} holds "
                f"{_fmt(oc.regions[ca])}, {wb!r} holds {_fmt(oc.regions[cb])}): the old state is inconsistent "
                "between workers (two sharding layouts of one tensor?)"
            )
        a = b


def _fmt(r: Region) -> str:
    return "x".join("+".join(f"[{a}:{b})" for a, b in runs) or "[]" for runs in r)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


class RegionPlan:
    """A reshard plan over arbitrary regions; the executor's interface, expanded per worker on demand.

    Message ``tensor`` is the key, ``kind`` the key's dtype kind. ``bytes_*`` figures are real
    bytes (each key's own element size).
    """

    def __init__(self, templates: list[_Template], workers: list[Worker], old_members: Sequence[Worker],
                 new_members: Sequence[Worker], rounds: int, staging_cap_bytes: int | None,
                 dropped: tuple[str, ...], bytes_total_state: int) -> None:
        self._templates = templates
        self._workers = workers
        self._widx = {w: i for i, w in enumerate(workers)}
        self.old_members = frozenset(old_members)
        self.new_members = frozenset(new_members)
        self.members = tuple(workers)
        self.leavers = tuple(w for w in workers if w in self.old_members and w not in self.new_members)
        self.joiners = tuple(w for w in workers if w in self.new_members and w not in self.old_members)
        self.kinds = tuple(sorted({t.kind for t in templates}))
        self.rounds = rounds
        self.staging_cap_bytes = staging_cap_bytes
        self.dropped_keys = dropped
        self.bytes_total_state = bytes_total_state
        self.templates = len(templates)
        self.keys = sum(len(t.keys) for t in templates)
        self.bytes_needed = sum(t.needed * t.itemsize * len(t.keys) for t in templates)
        self.bytes_local = sum(t.local * t.itemsize * len(t.keys) for t in templates)
        self.bytes_lower_bound = self.bytes_needed - self.bytes_local
        send = dict.fromkeys(workers, 0)
        recv = dict.fromkeys(workers, 0)
        for t in templates:
            k = t.itemsize * len(t.keys)
            for s, d, *_, n, _r in t.raw:
                send[workers[s]] += n * k
                recv[workers[d]] += n * k
        self.send_bytes, self.recv_bytes = send, recv
        self.bytes_planned = sum(send.values())
        self.n_messages = sum(len(t.raw) * len(t.keys) for t in templates)
        self._index: list[dict[int, tuple[list[int], list[int], list[int], list[int]]]] | None = None

    # -- the executor's interface ------------------------------------------------------------

    def describe(self) -> str:
        return f"{len(self.old_members)} -> {len(self.new_members)} workers, {self.keys} tensors"

    def is_new(self, w: Worker) -> bool:
        return w in self.new_members

    def is_old(self, w: Worker) -> bool:
        return w in self.old_members

    def _per_worker(self) -> list[dict[int, tuple[list[int], list[int], list[int], list[int]]]]:
        if self._index is None:
            with _gc_paused():
                self._index = self._build_index()
        return self._index

    def _build_index(self) -> list[dict[int, tuple[list[int], list[int], list[int], list[int]]]]:
        index = []
        for t in self._templates:
            by: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}

            def slot(w: int, by=by) -> tuple[list[int], list[int], list[int], list[int]]:
                s = by.get(w)
                if s is None:
                    s = by[w] = ([], [], [], [])
                return s

            for n, m in enumerate(t.raw):
                slot(m[0])[0].append(n)
                slot(m[1])[1].append(n)
            for n, c in enumerate(t.copies):
                slot(c[0])[2].append(n)
            for n, s in enumerate(t.shards):
                slot(s[0])[3].append(n)
            index.append(by)
        return index

    def _mine(self, w: Worker, which: int) -> list[tuple[_Template, list[int]]]:
        i = self._widx.get(w)
        if i is None:
            return []
        out = []
        for t, by in zip(self._templates, self._per_worker(), strict=True):
            s = by.get(i)
            if s is not None and s[which]:
                out.append((t, s[which]))
        return out

    def messages_for(self, worker: Worker) -> tuple[list[Message], list[Message]]:
        """(messages ``worker`` sends, messages it receives), each in plan order."""
        ws = self._workers
        out: tuple[list[Message], list[Message]] = ([], [])
        with _gc_paused():
            for which in (0, 1):
                lst = out[which]
                for t, idx in self._mine(worker, which):
                    raws = [t.raw[n] for n in idx]
                    for key in t.keys:
                        lst += [Message(ws[s], ws[d], key, t.kind, reg, sb, db, rnd)  # type: ignore[arg-type]
                                for s, d, reg, sb, db, _n, rnd in raws]
        return out

    def local_copies_for(self, worker: Worker) -> list[LocalCopy]:
        out: list[LocalCopy] = []
        with _gc_paused():
            for t, idx in self._mine(worker, 2):
                cs = [t.copies[n] for n in idx]
                for key in t.keys:
                    out += [LocalCopy(worker, key, t.kind, reg, sb, db)  # type: ignore[arg-type]
                            for _w, reg, sb, db in cs]
        return out

    def new_shards_for(self, worker: Worker) -> list[NewShard]:
        out: list[NewShard] = []
        with _gc_paused():
            for t, idx in self._mine(worker, 3):
                ss = [t.shards[n] for n in idx]
                for key in t.keys:
                    out += [NewShard(worker, key, t.kind, box, shape) for _w, box, shape in ss]  # type: ignore[arg-type]
        return out

    @property
    def messages(self) -> LazyTuple:
        """Every message (expanded on first use: meant for small plans and tests)."""
        def build():
            ws = self._workers
            for t in self._templates:
                for key in t.keys:
                    for s, d, reg, sb, db, _n, rnd in t.raw:
                        yield Message(ws[s], ws[d], key, t.kind, reg, sb, db, rnd)  # type: ignore[arg-type]
        return LazyTuple(self.n_messages, build)

    @property
    def local_copies(self) -> list[LocalCopy]:
        return [c for w in self._workers for c in self.local_copies_for(w)]

    @property
    def new_shards(self) -> list[NewShard]:
        return [s for w in self._workers for s in self.new_shards_for(w)]

    @property
    def max_send_bytes(self) -> int:
        return max(self.send_bytes.values(), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes.values(), default=0)

    def summary(self) -> dict[str, Any]:
        return {
            "workers_old": len(self.old_members), "workers_new": len(self.new_members),
            "leavers": len(self.leavers), "joiners": len(self.joiners), "keys": self.keys,
            "templates": self.templates, "messages": self.n_messages, "rounds": self.rounds,
            "bytes_total_state": self.bytes_total_state, "bytes_needed": self.bytes_needed,
            "bytes_lower_bound": self.bytes_lower_bound, "bytes_planned": self.bytes_planned,
            "max_send_bytes": self.max_send_bytes, "max_recv_bytes": self.max_recv_bytes,
        }


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def plan_regions(
    old: Mapping[str, Placed],
    new: Mapping[str, Placed],
    *,
    old_members: Sequence[Worker] | None = None,
    new_members: Sequence[Worker] | None = None,
    staging_cap_bytes: int | None = None,
    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES,
) -> RegionPlan:
    """Plan moving every key of ``new`` from the workers that hold it in ``old``.

    ``old_members`` / ``new_members`` default to the workers named in the regions of each side
    (add a worker that takes part but holds nothing, e.g. a joiner of an empty pipeline stage).
    Old members not in ``new_members`` are leavers: they send what they must, then may exit.
    Keys of ``old`` absent from ``new`` are dropped (listed in ``plan.dropped_keys``).
    Raises :class:`ReshardError` before anything moves when the plan is impossible.
    """
    with _gc_paused():
        return _plan(old, new, old_members, new_members, staging_cap_bytes, split_min_bytes)


def _plan(old: Mapping[str, Placed], new: Mapping[str, Placed], old_members: Sequence[Worker] | None,
          new_members: Sequence[Worker] | None, staging_cap_bytes: int | None, split_min_bytes: int) -> RegionPlan:
    # 1. validate
    _validate(old, new)
    canon = _Canon()
    olds: set = set(old_members or ())
    news: set = set(new_members or ())
    # Members are gathered per side: one regions object may serve both sides (a key that keeps its
    # layout), and its workers are then members of both.
    for members, state in ((olds, old), (news, new)):
        seen: set[int] = set()
        for p in state.values():
            if id(p.regions) not in seen:
                seen.add(id(p.regions))
                members.update(p.regions)
            canon(p.regions)
    workers = sorted(olds | news, key=_sort_key)
    widx = {w: i for i, w in enumerate(workers)}
    # 2. templates, in first-key order
    templates: dict[tuple, _Template] = {}
    for key, n in new.items():
        o = old[key]
        tk = (tuple(n.shape), canon(o.regions), canon(n.regions), n.kind, n.itemsize)
        t = templates.get(tk)
        if t is None:
            t = templates[tk] = _Template(tuple(n.shape), n.kind, n.itemsize, [], tk[1], tk[2])
        t.keys.append(key)
    tlist = list(templates.values())
    if staging_cap_bytes is not None:
        tlist = _cut_for_cap(tlist, staging_cap_bytes)
    # 3. diff (once per distinct template content)
    diffs: dict[tuple, tuple[_Template, list, list]] = {}
    per_t: list[tuple[list, list]] = []
    for t in tlist:
        dk = (t.shape, t.old_map, t.new_map)
        d = diffs.get(dk)
        if d is None:
            dem, fix = _diff(t, canon.maps[t.old_map], canon.maps[t.new_map], widx, workers)
            diffs[dk] = (t, dem, fix)
        else:
            src = d[0]
            t.needed, t.local, t.shards, t.copies = src.needed, src.local, src.shards, src.copies
            dem, fix = d[1], d[2]
        per_t.append((dem, fix))
    # 4. senders, over every template at once, in bytes (a template's piece weighs all its keys)
    leaver = [w in olds and w not in news for w in workers]
    demands: list[_Demand] = []
    fixed: list[tuple] = []
    for ti, (t, (dem, fix)) in enumerate(zip(tlist, per_t, strict=True)):
        k = t.itemsize * len(t.keys)
        for h, r, reg, sb, db, n, row in fix:
            fixed.append((h, r, ti, "", reg, sb, db, n * k, row * k))
        for reg, sb, db, n, row, holders, receivers in dem:
            demands.append(_Demand(n * k, row * k, ti, "", reg, sb, db, holders, receivers))  # type: ignore[arg-type]
    raw = _choose_senders(demands, fixed, len(workers), leaver, max(1, split_min_bytes))
    # 5. rounds
    if staging_cap_bytes is not None:
        raw = _split_to_cap(raw, staging_cap_bytes)
    rounds = _pack_rounds(raw, len(workers), staging_cap_bytes)
    for m, rnd in sorted(zip(raw, rounds, strict=True), key=lambda x: x[1]):
        t = tlist[m[2]]
        k = t.itemsize * len(t.keys)
        t.raw.append((m[0], m[1], m[4], m[5], m[6], m[7] // k, rnd))
    dropped = tuple(k for k in old if k not in new)
    total = sum(math.prod(p.shape) * p.itemsize for p in new.values())
    return RegionPlan(tlist, workers, sorted(olds, key=_sort_key), sorted(news, key=_sort_key),
                      (max(rounds) + 1) if rounds else 0, staging_cap_bytes, dropped, total)


def _cut_for_cap(tlist: list[_Template], cap: int) -> list[_Template]:
    """Split templates into key groups whose largest row (over all their keys) fits the staging cap."""
    out: list[_Template] = []
    for t in tlist:
        row = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
        # Before the one-group shortcut: a lone key whose row exceeds the cap is otherwise left
        # to the row split, which then has zero rows per piece.
        if row * t.itemsize > cap:
            raise ReshardError(
                f"staging cap {cap} bytes is smaller than one row of {t.keys[0]} ({row} elements x {t.itemsize} "
                f"bytes = {row * t.itemsize} bytes), the smallest piece that can move; raise the staging cap to "
                f"at least {row * t.itemsize} bytes"
            )
        per = max(1, cap // max(1, row * t.itemsize))
        if per >= len(t.keys):
            out.append(t)
            continue
        for a in range(0, len(t.keys), per):
            out.append(_Template(t.shape, t.kind, t.itemsize, t.keys[a:a + per], t.old_map, t.new_map))
    return out


# --------------------------------------------------------------------------------------------
# Rank assignment
# --------------------------------------------------------------------------------------------


def assign_slots(
    old: Mapping[str, Placed],
    slots: Mapping[str, Placed],
    survivors: Sequence[Worker],
    joiners: Sequence[Worker] = (),
) -> list[Worker]:
    """Which worker takes each slot (position) of a new layout: the most bytes kept local.

    ``slots`` is the new side with regions keyed by slot index ``0..n-1`` (a flattened mesh
    coordinate). Returns ``order`` with ``order[slot] = worker``: a maximum-weight assignment
    of ``survivors`` (weight = bytes of the old state the worker already holds of the slot's new
    state), ties broken toward ``survivors``' given order; ``joiners`` fill the remaining slots
    in order. ``len(survivors) + len(joiners)`` must equal the number of slots.
    """
    n = 1 + max((s for p in slots.values() for s in p.regions), default=-1)
    if len(survivors) + len(joiners) != n:
        raise ReshardError(
            f"{len(survivors)} survivors + {len(joiners)} joiners for a new layout of {n} slots; they must be equal"
        )
    if len(set(survivors) | set(joiners)) != n:
        raise ReshardError("survivors and joiners name a worker twice; worker ids must be unique")
    if not survivors:
        return list(joiners)
    sidx = {w: i for i, w in enumerate(survivors)}
    W = np.zeros((len(survivors), n), dtype=np.float64)
    canon = _Canon()
    # Keys placed alike weigh the same matrix: sum their element sizes per template, then add
    # each template's matrix once.
    weight: dict[tuple, int] = {}
    maps: dict[tuple, tuple[Mapping[Worker, Region], Mapping[Worker, Region], int]] = {}
    for key, s in slots.items():
        o = old.get(key)
        if o is None:
            continue
        tk = (tuple(s.shape), canon(o.regions), canon(s.regions))
        if tk not in weight:
            weight[tk] = 0
            maps[tk] = (o.regions, s.regions, len(s.shape))
        weight[tk] += s.itemsize
    for tk, k in weight.items():
        om, sm, nd = maps[tk]
        W += _overlap_matrix(om, sm, sidx, n, nd) * k
    # Lexicographic: local bytes first, then keeping survivor i on slot i (a byte kept local
    # outweighs any number of survivors kept on their index).
    diag = min(len(survivors), n)
    bonus = np.zeros_like(W)
    bonus[np.arange(diag), np.arange(diag)] = 1.0
    r, c = _lex_max_assignment(W, bonus, diag)
    order: list[Worker | None] = [None] * n
    for i, j in zip(r.tolist(), c.tolist(), strict=True):
        order[j] = survivors[i]
    it = iter(joiners)
    return [w if w is not None else next(it) for w in order]


def _overlap_matrix(old_map: Mapping[Worker, Region], slot_map: Mapping[Worker, Region], sidx: dict[Worker, int],
                    n: int, nd: int) -> np.ndarray:
    """Elements of each slot's region that each survivor holds (its old region intersected)."""
    out = np.zeros((len(sidx), n), dtype=np.float64)
    so: list[tuple[int, Box]] = [(sidx[w], b) for w, r in old_map.items() if w in sidx for b, _ in region_boxes(r)]
    sn: list[tuple[int, Box]] = [(int(s), b) for s, r in slot_map.items() for b, _ in region_boxes(r)]
    if not so or not sn:
        return out
    olo = np.array([[a for a, _ in b] for _, b in so], dtype=np.int64).reshape(len(so), nd)
    ohi = np.array([[e for _, e in b] for _, b in so], dtype=np.int64).reshape(len(so), nd)
    nlo = np.array([[a for a, _ in b] for _, b in sn], dtype=np.int64).reshape(len(sn), nd)
    nhi = np.array([[e for _, e in b] for _, b in sn], dtype=np.int64).reshape(len(sn), nd)
    rows = np.array([i for i, _ in so])
    cols = np.array([j for j, _ in sn])
    step = max(1, _BLOCK // len(sn))
    for a in range(0, len(so), step):
        ext = np.minimum(ohi[a:a + step, None, :], nhi[None]) - np.maximum(olo[a:a + step, None, :], nlo[None])
        vol = np.prod(np.clip(ext, 0, None), axis=2).astype(np.float64)
        np.add.at(out, (rows[a:a + step, None], cols[None, :]), vol)
    return out
