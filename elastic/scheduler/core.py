"""The co-scheduler: ``decide(snapshot) -> SchedulePlan``, a pure function.

It splits one GPU pool between inference services and training jobs and orders the
transitions so that a GPU is never promised to two workloads at once:

1. shrink/pause training that must give GPUs back (lowest priority first),
2. scale inference up onto free GPUs,
3. drain inference that needs fewer replicas (then any scale-up that waits for a drain),
4. grow training onto what is free (marginal tokens/s, hysteresis).

Placement rules: inference replicas are packed best-fit into partly used nodes so whole
nodes stay free; training takes whole nodes first and, on a partly used node, a multiple of
its layout's TP degree (a TP group never spans nodes); a shrinking job gives back its
smallest per-node slices first so whole nodes come free. Counts come from ``targets``; GPU
bookkeeping from ``board``. Nothing here reads a clock, a database or a backend.
"""

from __future__ import annotations

from elastic.model import Layout, PlanStep
from elastic.scheduler.board import Board
from elastic.scheduler.targets import JobTarget, forced_shrinks, grow_targets, inference_targets, spare_curve
from elastic.scheduler.types import (
    JobDecision,
    JobState,
    Reason,
    SchedulePlan,
    ServiceDecision,
    ServiceDemand,
    Snapshot,
    StepTarget,
    below_minimum_note,
)


def decide(snap: Snapshot) -> SchedulePlan:
    """One co-scheduling decision (see the module docstring for the order of the steps)."""
    ctx = _Ctx(snap)
    ctx.load_previous()  # 1. board from the previous allocation
    replicas = ctx.inference_targets()  # 2. inference demand first
    ctx.training_targets(replicas)  # 3. training counts: forced shrinks, water-filling, hysteresis
    ctx.shrink_training()  # 4. place the shrinks
    ctx.scale_inference(replicas)  # 5. inference up, down, up-after-drain, evict if still short
    ctx.grow_training()  # 6. grow training onto what is free
    return ctx.plan(replicas)  # 7. allocation + ordered steps


def _tp(layout: Layout | None) -> int:
    return layout.tp if layout is not None else 1


class _Ctx:
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.board = Board(snap.nodes)
        self.jobs = list(snap.jobs)
        self.job_by = {j.name: j for j in self.jobs}
        self.svc_by = {s.name: s for s in snap.services}
        self.before: dict[str, int] = {}
        self.targets: dict[str, JobTarget] = {}
        self.problems: list[str] = []
        self.drained: set = set()
        self.evicted: set[str] = set()
        self.unplaced: dict[str, int] = {}
        # job -> (its target before inference evicted it from a node, the first such node): what
        # it may take back on free GPUs elsewhere once inference is placed
        self.moving: dict[str, tuple[JobTarget, str]] = {}
        self._inf_nodes: set[str] | None = None

    # ---- 1 ------------------------------------------------------------------------------------
    def load_previous(self) -> None:
        b = self.board
        self.problems = b.seed(self.snap.previous)
        for wl in [w for w in b.held if w not in self.job_by and w not in self.svc_by]:
            self.problems.append(f"{wl}: not in the snapshot any more; its {b.count(wl)} GPUs were released")
            b.release_all(wl)
        self.before = {w: b.count(w) for w in list(self.job_by) + list(self.svc_by)}
        # A job holding a count its table has no layout for is brought down to one that has.
        for j in self.jobs:
            have = b.count(j.name)
            if have and have not in j.feasible_counts():
                fits = [k for k in j.feasible_counts() if k < have]
                self._shrink_job(j, fits[-1] if fits else 0)
                self.problems.append(f"{j.name}: held {have} GPUs, a count with no feasible layout; "
                                     f"brought to {b.count(j.name)}")

    # ---- 2 ------------------------------------------------------------------------------------
    def inference_targets(self) -> dict[str, int]:
        cur = {s.name: self.board.count(s.name) // s.gpus_per_replica for s in self.snap.services}
        return inference_targets(self.snap.services, self.snap.total_gpus, cur)

    # ---- 3 ------------------------------------------------------------------------------------
    def training_targets(self, replicas: dict[str, int]) -> None:
        snap, b = self.snap, self.board
        inf = sum(replicas[s.name] * s.gpus_per_replica for s in snap.services)
        budget = snap.total_gpus - inf - snap.knobs.headroom_gpus
        current = {j.name: b.count(j.name) for j in self.jobs}
        fixed = forced_shrinks(self.jobs, current, budget)
        held = sum(fixed[n].gpus if n in fixed else c for n, c in current.items())
        spare = budget - held
        curve = (spare_curve(snap.services, budget, snap.knobs.headroom_gpus, snap.total_gpus, held)
                 if any(s.outlook for s in snap.services) else ())
        self.targets = {**grow_targets(self.jobs, current, fixed, max(spare, 0), snap.now, snap.knobs, curve), **fixed}

    # ---- 4 ------------------------------------------------------------------------------------
    def shrink_training(self) -> None:
        for j in sorted(self.jobs, key=lambda j: (j.priority, j.name)):
            t = self.targets[j.name]
            if t.gpus < self.board.count(j.name):
                self._shrink_job(j, t.gpus)

    def _shrink_job(self, j: JobState, n: int) -> None:
        b = self.board
        if n == 0:
            b.release_all(j.name)
            return
        tp = _tp(j.layout_at(n))
        for node, c in b.on_nodes(j.name).items():  # the new layout's TP groups must fit per node
            if c % tp:
                b.release(j.name, node, c % tp)
        excess = b.count(j.name) - n

        def order(kv: tuple[str, int]) -> tuple[int, int, str]:
            # 1. nodes the job holds alone that it can give up entirely (a whole node comes free),
            # largest first; 2. then its smallest slices (it stays packed on few nodes).
            node, c = kv
            whole = b.others_on(node, j.name) == 0 and c <= excess
            return (0, -c, node) if whole else (1, c, node)

        for node, c in sorted(b.on_nodes(j.name).items(), key=order):
            if excess <= 0:
                break
            r = min(c, excess) // tp * tp
            if r:
                b.release(j.name, node, r)
                excess -= r
        if b.count(j.name) < n:  # realignment gave back too much: take the difference back
            self._grow_job(j, n)

    # ---- 5 ------------------------------------------------------------------------------------
    def scale_inference(self, replicas: dict[str, int]) -> None:
        b = self.board
        ups = [s for s in self.snap.services if replicas[s.name] * s.gpus_per_replica > b.count(s.name)]
        downs = [s for s in self.snap.services if replicas[s.name] * s.gpus_per_replica < b.count(s.name)]
        ups.sort(key=lambda s: (-s.priority, s.name))
        for s in ups:  # 5a. onto GPUs that are free or freed by training shrinks
            self._place_replicas(s, replicas[s.name])
        for s in downs:  # 5b. drain
            self._remove_replicas(s, replicas[s.name])
        for s in ups:  # 5c. onto drained GPUs, else 5d. evict more training
            self._place_replicas(s, replicas[s.name], drained_ok=True)
            while self._replicas(s) < replicas[s.name] and self._evict_for(s):
                self._place_replicas(s, replicas[s.name], drained_ok=True)
            short = replicas[s.name] - self._replicas(s)
            if short > 0:
                self.unplaced[s.name] = short

    def _inference_nodes(self) -> set[str]:
        """Nodes where a service holds GPUs (built once per decision, grown as replicas are placed)."""
        if self._inf_nodes is None:
            self._inf_nodes = {n for s in self.snap.services for n in self.board.on_nodes(s.name)}
        return self._inf_nodes

    def _replicas(self, s: ServiceDemand) -> int:
        return self.board.count(s.name) // s.gpus_per_replica

    def _place_replicas(self, s: ServiceDemand, want: int, drained_ok: bool = False) -> None:
        b, g = self.board, s.gpus_per_replica
        while self._replicas(s) < want:
            node = None
            if g <= b.max_cap:
                # best fit among nodes that already serve inference, then among the rest: the fullest
                # node that still has room keeps whole nodes free, and replicas smaller than a node
                # kept together leave training's nodes whole for a whole-node replica to take back
                fits = [n for n in b.nodes_with_free(g) if b.cap[n] >= g]
                if not fits:
                    return
                inf = self._inference_nodes()
                node = next((n for n in fits if n in inf), fits[0])
                b.take(s.name, node, g)
                inf.add(node)
            else:
                empty = [n for n in b.empty_nodes()]
                picked, got = [], 0
                for n in empty:
                    if got >= g:
                        break
                    picked.append(n)
                    got += b.cap[n]
                if got != g:
                    return
                for n in picked:
                    b.take(s.name, n, b.cap[n])

    def _remove_replicas(self, s: ServiceDemand, want: int) -> None:
        b, g = self.board, s.gpus_per_replica
        on = b.on_nodes(s.name)
        for node, c in on.items():  # a partial replica (odd previous allocation) is dropped first
            if g <= b.cap[node] and c % g:
                self._drain(s.name, node, c % g)
        # nodes with the least use overall first: removing replicas there frees whole nodes
        order = sorted(b.on_nodes(s.name), key=lambda n: (b.cap[n] - b.nfree(n), n))
        for node in order:
            while b.count(s.name) > want * g and b.on(s.name, node) > 0:
                self._drain(s.name, node, min(g, b.on(s.name, node)))

    def _drain(self, wl: str, node: str, n: int) -> None:
        held = self.board.held[wl][node]
        self.drained.update((node, i) for i in held[-n:])
        self.board.release(wl, node, n)

    def _evict_for(self, s: ServiceDemand) -> bool:
        """Free room for one more replica of ``s`` by shrinking training on the cheapest node(s)."""
        b, g = self.board, s.gpus_per_replica
        train_on: dict[str, list[JobState]] = {}
        for j in self.jobs:
            for node in b.on_nodes(j.name):
                train_on.setdefault(node, []).append(j)
        if g <= b.max_cap:
            cands = [n for n, js in train_on.items()
                     if b.cap[n] >= g and b.nfree(n) + sum(b.on(j.name, n) for j in js) >= g]
            if not cands:
                return False
            node = max(cands, key=lambda n: (b.nfree(n), -min(j.priority for j in train_on[n]), n))
            for j in sorted(train_on[node], key=lambda j: (j.priority, j.name)):
                if b.nfree(node) >= g:
                    break
                self._evict_job_from(j, node)
            return True
        # A replica of whole nodes needs that many empty nodes at once. Clear the nodes that hold
        # only training (and free GPUs) whose training costs least; the jobs move what they gave
        # up onto free GPUs elsewhere (``grow_training``), so this is a move, not a loss. Nothing
        # is cleared unless enough nodes come free for the whole replica: clearing one node of two
        # would cost training and place nothing.
        nodes = -(-g // b.max_cap)
        empty = sum(1 for _ in b.empty_nodes())
        cands = [n for n, js in train_on.items()
                 if b.nfree(n) + sum(b.on(j.name, n) for j in js) == b.cap[n]]
        if not cands or empty + len(cands) < nodes:
            return False

        def cost(n: str) -> tuple[float, int, str]:
            # tokens/s the node's training GPUs carry (each job's tokens/s per GPU), then GPUs
            lost = sum(b.on(j.name, n) * j.tps(b.count(j.name)) / max(b.count(j.name), 1) for j in train_on[n])
            return (lost, b.cap[n] - b.nfree(n), n)

        for node in sorted(cands, key=cost)[:nodes - empty]:
            for j in sorted(train_on[node], key=lambda j: (j.priority, j.name)):
                if b.on(j.name, node):
                    self._evict_job_from(j, node)
        return True

    def _evict_job_from(self, j: JobState, node: str) -> None:
        b = self.board
        self.moving.setdefault(j.name, (self.targets[j.name], node))
        b.release(j.name, node, b.on(j.name, node))
        left = b.count(j.name)
        fits = [k for k in j.feasible_counts() if k <= left]
        to = fits[-1] if fits else 0
        self._shrink_job(j, to)
        before = self.before[j.name]
        if to == 0:
            status = "paused" if j.on_below_minimum == "pause" else "preempted"
            self.targets[j.name] = JobTarget(0, Reason.BELOW_MINIMUM,
                                             f"inference replicas need node {node}; below min_gpus={j.min_gpus}, "
                                             f"{status} with {before} GPUs released" + below_minimum_note(status),
                                             forced=True, status=status)
        else:
            self.targets[j.name] = JobTarget(to, Reason.INFERENCE_DEMAND,
                                             f"gives back node {node} to inference ({before} -> {to} GPUs), losing "
                                             f"{j.tps(before) - j.tps(to):.0f} tokens/s", forced=True)
        self.evicted.add(j.name)

    # ---- 6 ------------------------------------------------------------------------------------
    def grow_training(self) -> None:
        b = self.board
        for j in sorted(self.jobs, key=lambda j: (-j.priority, j.name)):  # 6a. evicted jobs move
            if j.name in self.moving:
                self._move_back(j)
        for j in sorted(self.jobs, key=lambda j: (-j.priority, j.name)):
            t = self.targets[j.name]
            have = b.count(j.name)
            if j.name in self.evicted or t.gpus <= have:
                continue
            options = [k for k in j.feasible_counts() if have < k <= t.gpus]
            got = next((k for k in reversed(options) if self._grow_job(j, k)), None)
            if got is None:
                self.targets[j.name] = JobTarget(have, Reason.NO_FEASIBLE_LAYOUT,
                                                 f"wanted {t.gpus} GPUs but the {b.total_free()} free GPUs are split "
                                                 f"into slices no layout of {j.name} can use", status=_status_of(j, have))
            elif got < t.gpus:
                self.targets[j.name] = JobTarget(got, t.reason, t.message.replace(f"-> {t.gpus}", f"-> {got}")
                                                 + f" (wanted {t.gpus}; free GPUs are fragmented)", status="running")

    def _move_back(self, j: JobState) -> None:
        """A job evicted from a node for inference takes back, on GPUs still free once every
        replica is placed, up to the count it would have held: it moves off the node instead
        of shrinking by it (one rescale now rather than a shrink and a grow a tick later)."""
        b = self.board
        was, node = self.moving[j.name]
        have = b.count(j.name)
        options = [k for k in j.feasible_counts() if have < k <= was.gpus]
        got = next((k for k in reversed(options) if self._grow_job(j, k)), None)
        if got is None:
            return
        before = self.before[j.name]
        self.targets[j.name] = JobTarget(
            got, Reason.INFERENCE_DEMAND,
            f"moves off node {node} to inference ({before} -> {got} GPUs)"
            + (f", losing {j.tps(before) - j.tps(got):.0f} tokens/s" if got < before else ""),
            forced=True)

    def _grow_job(self, j: JobState, n: int) -> bool:
        b, name = self.board, j.name
        tp = _tp(j.layout_at(n))
        mark = b.mark()
        need = n - b.count(name)
        for node, c in b.on_nodes(name).items():  # 1. realign per-node slices to the new TP
            r = c % tp
            if r and b.nfree(node) >= tp - r and need >= tp - r:
                b.take(name, node, tp - r)
                need -= tp - r
            elif r:
                b.release(name, node, r)
                need += r
        for node, _c in sorted(b.on_nodes(name).items(), key=lambda kv: (-kv[1], kv[0])):  # 2. top up
            k = min(b.nfree(node), need) // tp * tp
            if k > 0:
                b.take(name, node, k)
                need -= k
        for node in b.empty_nodes():  # 3. whole nodes
            if need < b.cap[node]:
                break
            k = b.cap[node] // tp * tp
            if k:
                b.take(name, node, k)
                need -= k
        if need > 0:  # 4. the rest on one node if one fits (best fit), else the roomiest first
            node = next((x for x in b.nodes_with_free(need) if b.nfree(x) >= need), None)
            if node is not None:
                b.take(name, node, need)
                need = 0
        for node in (b.nodes_with_free(tp, fullest_first=False) if need > 0 else ()):
            k = min(b.nfree(node), need) // tp * tp
            if k > 0:
                b.take(name, node, k)
                need -= k
            if need <= 0:
                break
        if need != 0:
            b.rollback(mark)
            return False
        return True

    # ---- 7 ------------------------------------------------------------------------------------
    def plan(self, replicas: dict[str, int]) -> SchedulePlan:
        b, snap = self.board, self.snap
        order = [s.name for s in snap.services] + [j.name for j in self.jobs]
        steps_shrink, steps_up, steps_down, steps_up_late, steps_grow, notes = [], [], [], [], [], []
        services: dict[str, ServiceDecision] = {}
        for s in snap.services:
            dec, step = self._service_step(s, replicas[s.name])
            services[s.name] = dec
            if step is None:
                continue
            if step.action == "scale_inference_down":
                steps_down.append(step)
            elif step.target.after_drain:
                steps_up_late.append(step)
            else:
                steps_up.append(step)
        jobs: dict[str, JobDecision] = {}
        for j in sorted(self.jobs, key=lambda j: (j.priority, j.name)):
            dec, step = self._job_step(j)
            jobs[j.name] = dec
            if step is None:
                if dec.reason in (Reason.HYSTERESIS, Reason.NO_FEASIBLE_LAYOUT) and b.total_free() > snap.knobs.headroom_gpus:
                    notes.append(PlanStep("noop", j.name, dec.reason, dec.message))
                continue
            (steps_grow if step.action == "grow_training" else steps_shrink).append(step)
        steps_grow.reverse()  # highest priority grows first
        idle = b.total_free()
        for s, short in self.unplaced.items():
            notes.append(PlanStep("noop", s, Reason.POOL_EXHAUSTED,
                                  f"{short} replica(s) of {self.svc_by[s].gpus_per_replica} GPUs found no room "
                                  f"({idle} GPUs free in slices too small)"))
        steps = tuple(steps_shrink + steps_up + steps_down + steps_up_late + steps_grow + notes)
        inf = sum(b.count(s.name) for s in snap.services)
        trn = sum(b.count(j.name) for j in self.jobs)
        acting = [s for s in steps if s.action != "noop"]
        reason = acting[0].reason if acting else (notes[0].reason if notes else Reason.STEADY)
        message = (f"inference {inf} GPUs ({_delta(inf, sum(self.before[s.name] for s in snap.services))}), "
                   f"training {trn} GPUs ({_delta(trn, sum(self.before[j.name] for j in self.jobs))}), "
                   f"idle {idle} of {snap.total_gpus}; {len(acting)} step(s)")
        if self.problems:
            message += "; previous allocation: " + "; ".join(self.problems[:5])
        return SchedulePlan(snap.now, b.allocation(order, snap.previous), steps, services, jobs, idle, reason, message)

    def _service_step(self, s: ServiceDemand, target: int) -> tuple[ServiceDecision, PlanStep | None]:
        b, g = self.board, s.gpus_per_replica
        before, after = self.before[s.name], b.count(s.name)
        r0, r1 = before // g, after // g
        if s.name in self.unplaced or target < s.wanted:
            reason = Reason.POOL_EXHAUSTED
            msg = f"wants {s.wanted} replicas, the pool places {r1} ({after} GPUs)"
        elif r1 > r0:
            reason, msg = Reason.INFERENCE_DEMAND, f"scale up {r0} -> {r1} replicas ({g} GPUs each)"
        elif r1 < r0:
            reason, msg = Reason.LOAD_FALL, f"drain {r0 - r1} replica(s): {r0} -> {r1} ({r0 * g - r1 * g} GPUs freed)"
        else:
            reason, msg = Reason.STEADY, f"holds {r1} replicas"
        dec = ServiceDecision(s.name, s.wanted, r1, after, reason, msg)
        added = tuple(b.added.get(s.name, ()))
        removed = tuple(b.removed.get(s.name, ()))
        if not added and not removed:
            return dec, None
        late = any((gpu.node, gpu.index) in self.drained for gpu in added)
        action = "scale_inference_up" if after > before else "scale_inference_down"
        if after == before:  # replaced in place (odd previous allocation): treat as an up
            action = "scale_inference_up"
        step_reason = reason if reason != Reason.STEADY else Reason.INFERENCE_DEMAND
        tgt = StepTarget(before, after, added, removed, replicas_before=r0, replicas_after=r1, after_drain=late)
        return dec, PlanStep(action, s.name, step_reason, msg, tgt)

    def _job_step(self, j: JobState) -> tuple[JobDecision, PlanStep | None]:
        b = self.board
        t = self.targets[j.name]
        before, after = self.before[j.name], b.count(j.name)
        layout_before = j.layout if j.layout is not None else j.layout_at(before)
        layout = layout_before if after == before else j.layout_at(after)
        status = t.status if after == 0 else "running"
        dec = JobDecision(j.name, before, after, layout, j.tps(after), status, t.reason, t.message)  # type: ignore[arg-type]
        added = tuple(b.added.get(j.name, ()))
        removed = tuple(b.removed.get(j.name, ()))
        if not added and not removed:
            return dec, None
        if after == 0:
            action = "preempt_training" if status == "preempted" else "pause_training"
        elif after < before:
            action = "shrink_training"
        elif after > before:
            action = "grow_training"
        else:
            action = "shrink_training"  # moved in place (realignment): frees GPUs first
        tgt = StepTarget(before, after, added, removed, layout_before, layout)
        return dec, PlanStep(action, j.name, t.reason, t.message, tgt)


def _status_of(j: JobState, gpus: int) -> str:
    if gpus:
        return "running"
    return j.status if j.status in ("paused", "preempted") else "pending"


def _delta(now: int, before: int) -> str:
    return f"{now - before:+d}"
