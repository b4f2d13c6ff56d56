"""Kueue-style builders for co-scheduler tests: ``pool(4)``, ``job("a").prio(1).linear(8, 64)``."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.model import GPU, Allocation, Layout
from elastic.scheduler import JobState, Knobs, ServiceDemand, Snapshot


def pool(nodes: int, gpus_per_node: int = 8) -> dict[str, int]:
    return {f"n{i}": gpus_per_node for i in range(nodes)}


def table(step: int, max_gpus: int, per_gpu: float = 100.0, decay: float = 0.0, tp: int | None = None,
          ) -> dict[int, tuple[Layout, float]]:
    """Counts step, 2*step, ...; tokens/s = n * per_gpu * (1 - decay)^(n/step - 1) (concave for decay > 0)."""
    tp = tp or min(step, 8)
    out = {}
    for n in range(step, max_gpus + 1, step):
        out[n] = (Layout(tp, 1, n // tp), n * per_gpu * (1 - decay) ** (n // step - 1))
    return out


@dataclass
class JobB:
    name: str
    tbl: dict = field(default_factory=lambda: table(8, 64))
    lo: int = 8
    hi: int = 1 << 20
    priority: int = 0
    last: float | None = None
    status: str = "running"
    below: str = "pause"

    def prio(self, p: int) -> JobB:
        self.priority = p
        return self

    def tab(self, t: dict) -> JobB:
        self.tbl = t
        return self

    def bounds(self, lo: int, hi: int = 1 << 20) -> JobB:
        self.lo, self.hi = lo, hi
        return self

    def rescaled_at(self, t: float) -> JobB:
        self.last = t
        return self

    def preempt(self) -> JobB:
        self.below = "preempt"
        return self

    def obj(self) -> JobState:
        return JobState(self.name, self.tbl, self.lo, self.hi, self.priority, None, self.last, self.status,  # type: ignore[arg-type]
                        self.below)  # type: ignore[arg-type]


def job(name: str) -> JobB:
    return JobB(name)


def svc(name: str, replicas: int, gpus: int = 1, priority: int = 100, min_replicas: int = 0) -> ServiceDemand:
    return ServiceDemand(name, replicas, gpus, priority, min_replicas)


def holding(**spec: list[tuple[str, int]] | str) -> Allocation:
    """``holding(a=[("n0", 8), ("n1", 4)])``: the first k indices of each node, in order given.
    Later workloads on the same node take the next indices."""
    used: dict[str, int] = {}
    out: dict[str, tuple[GPU, ...]] = {}
    for wl, parts in spec.items():
        gpus = []
        for node, k in parts:  # type: ignore[misc]
            start = used.get(node, 0)
            gpus += [GPU(node, i) for i in range(start, start + k)]
            used[node] = start + k
        out[wl] = tuple(gpus)
    return Allocation(out)


def snap(nodes: dict[str, int], services=(), jobs=(), previous: Allocation | None = None, now: float = 1000.0,
         knobs: Knobs | None = None) -> Snapshot:
    return Snapshot(now, nodes, tuple(services), tuple(j.obj() if isinstance(j, JobB) else j for j in jobs),
                    previous or Allocation({}), knobs or Knobs(60.0, 0.05, 0))


def per_node(plan, wl: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in plan.allocation.gpus_of(wl):
        out[g.node] = out.get(g.node, 0) + 1
    return out
