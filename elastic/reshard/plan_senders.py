"""Steps 4 and 5 of the reshard planner: choose each piece's sender, then pack rounds. Pure.

4. **senders**: DP replicas hold identical boxes; pick for each piece the holder that keeps the
   largest per-worker send volume lowest (largest pieces first, big pieces split along dim 0
   across replicas, leavers only when that lowers the makespan);
5. **rounds**: split pieces larger than the staging cap along dim 0 and pack messages into
   rounds so no worker sends + receives more than the cap in one round.

Both work on raw message tuples (``_Raw``), never on layouts: ``plan_regions.py`` reuses them.
This module must not import torch, ray or anything that does I/O, and never reads the clock.
"""

from __future__ import annotations

import heapq

from elastic.reshard.errors import ReshardError
from elastic.reshard.plan_diff import _Demand
from elastic.reshard.spec import Box

# --------------------------------------------------------------------------------------------
# Step 4: senders
# --------------------------------------------------------------------------------------------

_Raw = tuple[int, int, str, str, Box, Box, Box, int, int]  # src, dst, tensor, kind, region, sbox, dbox, numel, row


def _choose_senders(demands: list[_Demand], fixed: list[_Raw], n_workers: int, leaver: list[bool],
                    split_min_numel: int) -> list[_Raw]:
    """Largest pieces first onto the least-loaded holder. A piece is split along dim 0 across
    replicas (water-filling, McNaughton's wrap-around: at most one extra cut per holder) only when
    it is big: at least ``split_min_numel`` elements and more than 1/16 of what each replica of its
    holder group sends in total, so whole-piece placement could leave a replica >6% over the
    others. (GPT-3 175B tp8.pp16.dp16 -> tp8.pp8.dp24: a 302 MB fc1 slice against ~25 GB per
    sender is sent whole.) Leavers send only when that lowers the makespan."""
    load = [0] * n_workers
    for m in fixed:  # forced sends count first
        load[m[0]] += m[7]
    makespan = max(load, default=0)
    out: list[_Raw] = fixed
    group_total: dict[int, int] = {}
    heaps: dict[int, tuple[list, list]] = {}
    for d in demands:
        group_total[id(d.holders)] = group_total.get(id(d.holders), 0) + d.numel * len(d.receivers)
    demands.sort(key=lambda d: -d.numel)
    for d in demands:
        if len(d.holders) == 1:
            h = d.holders[0]
            out += [(h, r, d.tensor, d.kind, d.region, d.src_box, d.dst_box, d.numel, d.row_numel)
                    for r in d.receivers]
            load[h] += d.numel * len(d.receivers)
            makespan = max(makespan, load[h])
        elif (d.numel < split_min_numel or d.numel == d.row_numel
              or 16 * len(d.holders) * d.numel < group_total[id(d.holders)]):
            makespan = _whole_pieces(d, load, leaver, makespan, out, heaps)
        else:
            makespan = _split_pieces(d, load, leaver, makespan, out)
    return out


def _whole_pieces(d: _Demand, load: list[int], leaver: list[bool], makespan: int, out: list[_Raw],
                  heaps: dict[int, tuple[list, list]]) -> int:
    s = d.numel
    hp = heaps.get(id(d.holders))
    if hp is None:
        hp = heaps[id(d.holders)] = (
            [(load[h], h) for h in d.holders if not leaver[h]], [(load[h], h) for h in d.holders if leaver[h]])
        heapq.heapify(hp[0])
        heapq.heapify(hp[1])
    surv, leav = hp
    for r in d.receivers:
        heap = surv if surv else leav
        h = _least_loaded(heap, load)
        if surv and leav and load[h] + s > makespan:
            # a survivor would raise the makespan: a leaver may do better
            v = _least_loaded(leav, load)
            if load[v] < load[h]:
                h, heap = v, leav
        load[h] += s
        heapq.heapreplace(heap, (load[h], h))
        if load[h] > makespan:
            makespan = load[h]
        out.append((h, r, d.tensor, d.kind, d.region, d.src_box, d.dst_box, s, d.row_numel))
    return makespan


def _least_loaded(heap: list[tuple[int, int]], load: list[int]) -> int:
    """The top of a heap of (load, worker) whose entries may be stale: loads only grow (other
    holder groups share workers), so a stale top is refreshed and pushed down until it is true."""
    while True:
        lv, h = heap[0]
        if lv == load[h]:
            return h
        heapq.heapreplace(heap, (load[h], h))


def _split_pieces(d: _Demand, load: list[int], leaver: list[bool], makespan: int, out: list[_Raw]) -> int:
    rows = d.numel // d.row_numel
    total_rows = rows * len(d.receivers)
    rb = d.row_numel
    # Phase A: survivors below the current makespan absorb rows for free (no makespan increase).
    cap: dict[int, int] = {}
    left = total_rows
    for h in sorted((h for h in d.holders if not leaver[h]), key=lambda h: load[h]):
        room = min(left, (makespan - load[h]) // rb)
        if room > 0:
            cap[h] = room
            left -= room
    # Phase B: water-fill the rest over every holder (survivors and leavers).
    if left:
        cur = {h: load[h] + cap.get(h, 0) * rb for h in d.holders}
        for h, extra in _water_fill(cur, left, rb, leaver).items():
            cap[h] = cap.get(h, 0) + extra
    # McNaughton wrap: stream receivers' rows across holders in order of capacity given.
    holders = [h for h in sorted(cap, key=lambda h: (leaver[h], load[h])) if cap[h] > 0]
    hi, used = 0, 0
    for r in d.receivers:
        start = 0
        while start < rows:
            h = holders[hi]
            n = min(rows - start, cap[h] - used)
            out.append(_cut(h, r, d, start, start + n))
            load[h] += n * rb
            makespan = max(makespan, load[h])
            start += n
            used += n
            if used == cap[h]:
                hi, used = hi + 1, 0
    return makespan


def _water_fill(cur: dict[int, int], rows: int, rb: int, leaver: list[bool]) -> dict[int, int]:
    """Give ``rows`` rows of ``rb`` elements to the least-loaded holders so their loads rise to a
    common level (ties go to survivors)."""
    order = sorted(cur, key=lambda h: (cur[h], leaver[h]))
    total = rows * rb
    level, n = 0.0, 0
    acc = 0
    for n_ in range(1, len(order) + 1):
        acc += cur[order[n_ - 1]]
        lvl = (total + acc) / n_
        if n_ == len(order) or lvl <= cur[order[n_]]:
            level, n = lvl, n_
            break
    give = {h: int((level - cur[h]) // rb) for h in order[:n]}
    short = rows - sum(give.values())
    for h in order[:n]:  # rounding leftovers, one row each, least loaded first
        if short <= 0:
            break
        give[h] += 1
        short -= 1
    give[order[0]] += max(0, short)
    return give


def _cut(src: int, dst: int, d: _Demand, a: int, b: int) -> _Raw:
    """Rows ``[a, b)`` of the piece (along dim 0)."""
    (r0, r1), rest = d.region[0], d.region[1:]
    if a == 0 and b == r1 - r0:
        return (src, dst, d.tensor, d.kind, d.region, d.src_box, d.dst_box, d.numel, d.row_numel)
    s0, d0 = d.src_box[0][0], d.dst_box[0][0]
    return (src, dst, d.tensor, d.kind, ((r0 + a, r0 + b),) + rest, ((s0 + a, s0 + b),) + d.src_box[1:],
            ((d0 + a, d0 + b),) + d.dst_box[1:], (b - a) * d.row_numel, d.row_numel)


# --------------------------------------------------------------------------------------------
# Step 5: rounds
# --------------------------------------------------------------------------------------------


def _split_to_cap(raw: list[_Raw], cap_numel: int) -> list[_Raw]:
    out: list[_Raw] = []
    for m in raw:
        numel, rown = m[7], m[8]
        if numel <= cap_numel:
            out.append(m)
            continue
        rows_per = cap_numel // rown
        (r0, r1), (s0, _), (d0, _) = m[4][0], m[5][0], m[6][0]
        for a in range(0, r1 - r0, rows_per):
            b = min(a + rows_per, r1 - r0)
            out.append((m[0], m[1], m[2], m[3], ((r0 + a, r0 + b),) + m[4][1:], ((s0 + a, s0 + b),) + m[5][1:],
                        ((d0 + a, d0 + b),) + m[6][1:], (b - a) * rown, rown))
    return out


def _pack_rounds(raw: list[_Raw], n_workers: int, cap_numel: int | None) -> list[int]:
    """First-fit decreasing: each message goes to the first round where neither its sender nor
    its receiver would exceed the cap (a worker's send + receive volume in one round)."""
    if cap_numel is None:
        return [0] * len(raw)
    used: list[list[int]] = [[] for _ in range(n_workers)]
    rounds = [0] * len(raw)
    for idx in sorted(range(len(raw)), key=lambda i: -raw[i][7]):
        s, d, n = raw[idx][0], raw[idx][1], raw[idx][7]
        us, ud = used[s], used[d]
        r = 0
        while True:
            a = us[r] if r < len(us) else 0
            b = ud[r] if r < len(ud) else 0
            if a + n <= cap_numel and b + n <= cap_numel:
                break
            r += 1
        for u in (us, ud):
            while len(u) <= r:
                u.append(0)
            u[r] += n
        rounds[idx] = r
    return rounds


def _check_cap(demands: list[_Demand], fixed: list[_Raw], cap_numel: int, bpe: int) -> None:
    rows = [(d.row_numel, d.tensor, d.kind) for d in demands] + [(m[8], m[2], m[3]) for m in fixed]
    if not rows:
        return
    row, tensor, kind = max(rows)
    if row > cap_numel:
        raise ReshardError(
            f"staging cap {cap_numel * bpe} bytes is smaller than one row of {tensor} ({kind}): "
            f"{row} elements x {bpe} bytes = {row * bpe} bytes, the smallest piece that can "
            f"move; raise the staging cap to at least {row * bpe} bytes"
        )
