"""GPU bookkeeping for one decision: who holds which GPU index on which node.

A mutable scratch board the co-scheduler fills while it plans; it never outlives a
``decide`` call. Nodes are bucketed by their free-GPU count so that "a node with at least k
free GPUs, fullest first" is O(GPUs per node), not O(nodes) (10,000 GPUs in < 100 ms).
It knows nothing about priorities or layouts; those live in ``core``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache

from elastic.model import GPU, Allocation

# Memo of "GPUs grouped by node" per holdings tuple. Keyed by id() with the tuple kept in the
# value, so an id cannot be reused while its entry lives. Allocations are immutable, and the
# simulator/controller hand back the tuple the last decision produced, so most ticks hit.
_GROUPED: OrderedDict[int, tuple[tuple[GPU, ...], list[tuple[str, list[int], bool]]]] = OrderedDict()
_GROUPED_MAX = 4096


def _by_node(gpus: tuple[GPU, ...]) -> list[tuple[str, list[int], bool]]:
    """[(node, indices, indices == 0..k-1)] for one holdings tuple (memoised)."""
    hit = _GROUPED.get(id(gpus))
    if hit is not None and hit[0] is gpus:
        return hit[1]
    by: dict[str, list[int]] = {}
    for g in gpus:
        by.setdefault(g.node, []).append(g.index)
    out = [(n, ix, ix == list(range(len(ix)))) for n, ix in by.items()]
    _GROUPED[id(gpus)] = (gpus, out)
    if len(_GROUPED) > _GROUPED_MAX:
        _GROUPED.popitem(last=False)
    return out


@lru_cache(maxsize=1 << 17)
def _gpu(node: str, index: int) -> GPU:
    return GPU(node, index)


class Board:
    def __init__(self, nodes: Mapping[str, int]) -> None:
        self.cap: dict[str, int] = dict(nodes)
        self.free: dict[str, list[int]] = {n: list(range(c)) for n, c in nodes.items()}
        self.held: dict[str, dict[str, list[int]]] = {}  # workload -> node -> indices
        self.max_cap = max(self.cap.values())
        # bucket[f] = nodes with exactly f free GPUs (dict as an insertion-ordered set)
        self.bucket: list[dict[str, None]] = [{} for _ in range(self.max_cap + 1)]
        for n, c in self.cap.items():
            self.bucket[c][n] = None
        self._journal: list[tuple[str, str, str, list[int]]] = []
        self.n: dict[str, int] = {}  # workload -> GPUs held
        self.added: dict[str, list[GPU]] = {}
        self.removed: dict[str, list[GPU]] = {}

    # ---- seeding from the previous allocation -------------------------------------------------
    def seed(self, previous: Allocation) -> list[str]:
        """Load ``previous``; returns problems (GPUs outside the pool, double bookings) dropped."""
        problems: list[str] = []
        for wl, gpus in previous.holdings.items():
            for node, ix, is_range in _by_node(gpus):
                if node not in self.cap:
                    problems.append(f"{wl}: {len(ix)} GPU(s) on node {node}, which is not in the pool, were dropped")
                    continue
                free = self.free[node]
                cap = self.cap[node]
                if is_range and len(ix) == cap == len(free):  # fast path: a whole free node
                    self.free[node] = []
                    self.held.setdefault(wl, {})[node] = list(range(cap))
                    self.n[wl] = self.n.get(wl, 0) + cap
                    self._rebucket(node, cap)
                    continue
                ok = sorted(set(ix).intersection(free))
                if len(ok) != len(ix):
                    bad = sorted(set(ix) - set(ok)) or sorted(ix)
                    problems.append(f"{wl}: GPU(s) {node}/{bad} are outside the node or double-booked; dropped")
                if not ok:
                    continue
                old = len(free)
                keep = set(ok)
                self.free[node] = [i for i in free if i not in keep]
                held = self.held.setdefault(wl, {}).setdefault(node, [])
                held.extend(ok)
                held.sort()
                self.n[wl] = self.n.get(wl, 0) + len(ok)
                self._rebucket(node, old)
        return problems

    # ---- queries --------------------------------------------------------------------------------
    def count(self, wl: str) -> int:
        return self.n.get(wl, 0)

    def on_nodes(self, wl: str) -> dict[str, int]:
        return {n: len(ix) for n, ix in self.held.get(wl, {}).items() if ix}

    def on(self, wl: str, node: str) -> int:
        """GPUs ``wl`` holds on ``node``."""
        return len(self.held.get(wl, {}).get(node, ()))

    def nfree(self, node: str) -> int:
        return len(self.free[node])

    def total_free(self) -> int:
        return sum(len(f) for f in self.free.values())

    def nodes_with_free(self, at_least: int, fullest_first: bool = True) -> Iterator[str]:
        """Nodes with >= ``at_least`` free GPUs; best-fit (fewest free) first by default."""
        rng = range(max(at_least, 1), self.max_cap + 1)
        for f in (rng if fullest_first else reversed(rng)):
            # copy: callers mutate the board while iterating
            yield from list(self.bucket[f])

    def empty_nodes(self) -> Iterator[str]:
        for f in range(self.max_cap, 0, -1):
            for n in list(self.bucket[f]):
                if f == self.cap[n]:
                    yield n

    def others_on(self, node: str, wl: str) -> int:
        """GPUs on ``node`` held by workloads other than ``wl``."""
        return self.cap[node] - len(self.free[node]) - len(self.held.get(wl, {}).get(node, ()))

    # ---- mutation -----------------------------------------------------------------------------
    def take(self, wl: str, node: str, n: int) -> None:
        """Give ``wl`` the ``n`` lowest free indices of ``node``."""
        assert 0 < n <= len(self.free[node]), (wl, node, n)
        self._move_in(wl, node, self.free[node][:n])

    def release(self, wl: str, node: str, n: int) -> None:
        """Take back ``n`` of ``wl``'s GPUs on ``node`` (the highest indices, keeping the rest packed)."""
        have = self.held[wl][node]
        assert 0 < n <= len(have), (wl, node, n)
        self._move_out(wl, node, have[-n:])

    def release_all(self, wl: str) -> None:
        for node, ix in list(self.held.get(wl, {}).items()):
            if ix:
                self._move_out(wl, node, list(ix))

    def mark(self) -> int:
        return len(self._journal)

    def rollback(self, mark: int) -> None:
        while len(self._journal) > mark:
            op, wl, node, ix = self._journal.pop()
            if op == "in":
                self._move_out(wl, node, ix, log=False)
            else:
                self._move_in(wl, node, ix, log=False)

    def _move_in(self, wl: str, node: str, ix: Iterable[int], log: bool = True, track: bool = True) -> None:
        # GPUs given to ``wl``; ``track=False`` only while seeding
        ix = list(ix)
        free = self.free[node]
        old = len(free)
        if len(ix) == old:
            free.clear()
        else:
            for i in ix:
                free.remove(i)
        held = self.held.setdefault(wl, {}).setdefault(node, [])
        held.extend(ix)
        held.sort()
        self.n[wl] = self.n.get(wl, 0) + len(ix)
        self._rebucket(node, old)
        if track:
            self._track(self.added, self.removed, wl, node, ix)
        if log:
            self._journal.append(("in", wl, node, ix))

    def _move_out(self, wl: str, node: str, ix: Iterable[int], log: bool = True) -> None:
        ix = list(ix)
        held = self.held[wl][node]
        for i in ix:
            held.remove(i)
        if not held:
            del self.held[wl][node]
        self.n[wl] -= len(ix)
        free = self.free[node]
        old = len(free)
        free.extend(ix)
        free.sort()
        self._rebucket(node, old)
        self._track(self.removed, self.added, wl, node, ix)
        if log:
            self._journal.append(("out", wl, node, ix))

    @staticmethod
    def _track(into: dict[str, list[GPU]], undo: dict[str, list[GPU]], wl: str, node: str, ix: list[int]) -> None:
        # A GPU taken then given back within one decision is no change at all.
        gone = undo.get(wl)
        for i in ix:
            g = _gpu(node, i)
            if gone and g in gone:
                gone.remove(g)
            else:
                into.setdefault(wl, []).append(g)

    def _rebucket(self, node: str, old_free: int) -> None:
        new_free = len(self.free[node])
        if new_free != old_free:
            del self.bucket[old_free][node]
            self.bucket[new_free][node] = None

    # ---- output -------------------------------------------------------------------------------
    def allocation(self, order: Iterable[str], previous: Allocation | None = None) -> Allocation:
        """The board as an Allocation; a workload with no change keeps its previous tuple as is."""
        holdings: dict[str, tuple[GPU, ...]] = {}
        for wl in order:
            if previous is not None and not self.added.get(wl) and not self.removed.get(wl):
                same = previous.holdings.get(wl, ())
                if len(same) == self.count(wl):
                    if same:
                        holdings[wl] = same
                    continue
            nodes = self.held.get(wl, {})
            gpus = tuple(_gpu(n, i) for n in sorted(nodes) for i in nodes[n])
            if gpus:
                holdings[wl] = gpus
        return Allocation(holdings)
