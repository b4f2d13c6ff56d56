"""Step 1 of a tick, observe: what each workload holds, each job's runtime, each service's metric;
and the backoff of jobs whose start or grow failed.

Each job's runtime is read once a tick (``Observed``), and again only after the tick acted on it:
on Ray and Kubernetes every read is a round trip, and the steps of one tick must not each see a
different state of a job that moves between them.

A job whose start or grow fails backs off exponentially (``start_backoff_seconds`` doubling up to
``start_backoff_max_seconds``): the co-scheduler does not give it more GPUs until the next attempt.
A job that recovered from a lost worker on its own is put on record once. A metric source that
fails or never answers is missing data (never zero), logged when it starts and when it ends.

Never out of memory (``elastic.controller.memory`` decides): a job's layout whose measured step
peaked over the per-GPU budget the planner fitted it in, or whose worker failed out of memory, is
dropped for the rest of the job's life and put on record (a ``MemoryExceeded`` decision naming the
layout, the peak and the budget). The dropped layouts live in the job's status in the store, so a
restarted controller (or the next leader) keeps them; the decide step plans the job without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elastic import store as db
from elastic.backends.base import JobRuntime
from elastic.controller import memory as mem
from elastic.controller.base import Backoff, ControllerState, _call_within, _dt, log
from elastic.metrics.sample import BacklogSource, MetricSample
from elastic.model import GPU, Allocation, Layout, SpecError
from elastic.parallel.memory_report import MeasuredMemory
from elastic.phases import JobPhase
from elastic.reasons import DecisionReason


class Observed:
    """Each job's runtime as one tick sees it. Step 1 reads every job once (``read``: the backend's
    ``job_runtime``, a round trip on Ray and Kubernetes); every later step of the tick asks here, so
    the whole tick works from one view of each job. A job is read again, once, at its next use:

    * after the tick acted on it (a start, rescale, stop, pause or relayout: ``acted``), so nothing
      downstream (the reshard history, the job's status) sees it as it was before the action;
    * after its grow, in flight in its own thread when step 1 read it (``in_flight``), has ended:
      that read caught the job mid-grow; while the grow goes on, the tick holds the GPUs it reserved.

    Used on the tick's thread only: a grow in its own thread reads the backend itself."""

    def __init__(self, read: Callable[[str], JobRuntime | None], jobs: Iterable[str],
                 in_flight: Callable[[str], bool]) -> None:
        self._read = read
        self._in_flight = in_flight
        self._moving: set[str] = set()  # read while a grow of ours was in flight
        self._stale: set[str] = set()
        self._runtimes: dict[str, JobRuntime | None] = {}
        for job in jobs:
            if in_flight(job):  # asked before the read: a grow that ends after it is caught at the next use
                self._moving.add(job)
            self._runtimes[job] = read(job)

    def runtime(self, job: str) -> JobRuntime | None:
        """``job``'s runtime: step 1's read, or one after this tick's last action on it (or after its grow)."""
        if job in self._moving and not self._in_flight(job):
            self._moving.discard(job)
            self._stale.add(job)
        if job in self._stale:
            self._stale.discard(job)
            self._runtimes[job] = self._read(job)
        return self._runtimes[job]

    def acted(self, job: str) -> None:
        """This tick acted on ``job``: read it again at its next use. A name that is not an observed
        job (a service) is ignored."""
        if job in self._runtimes:
            self._stale.add(job)


class Observing(ControllerState):
    """Reads the backend and the metric sources; keeps the backoff of failed starts and the layouts
    each job ran out of memory on."""

    def _observe(self) -> Observed:
        """Step 1's read of every job: one ``job_runtime`` call each."""
        return Observed(self.backend.job_runtime, [j.name for j in self.cfg.jobs], self._grow_in_flight)

    def _observe_jobs(self, obs: Observed, failed: set[str]) -> tuple[Allocation, dict[str, JobRuntime | None]]:
        """What every workload holds, and each job's runtime (None: not running, or failed), from the
        tick's observation ``obs``."""
        runtimes = {j.name: None if j.name in failed else obs.runtime(j.name) for j in self.cfg.jobs}
        for name, rt in runtimes.items():
            if rt is not None and rt.recovery and self._recoveries_seen.get(name) != rt.generation:
                self._record_recovery(rt)
        for name in failed:  # its runtime says what it failed with: out of memory drops its layout
            self._check_memory(name, obs.runtime(name))
        for name, rt in runtimes.items():
            self._check_memory(name, rt)
        self._forgive(runtimes, self.clock())
        return self._observed_allocation(obs, exclude=failed), runtimes

    # ---- never out of memory --------------------------------------------------------------------
    def _budget(self, job: str) -> int:
        """Per-GPU bytes ``job``'s tensors may use: the pool's device less the reserve, at most the job's limit."""
        spec = next((j for j in self.cfg.jobs if j.name == job), None)
        return mem.budget_bytes(self.hardware, memory_limit_bytes=None if spec is None else spec.memory_limit_bytes)

    def _dropped(self, job: str) -> dict[Layout, mem.Dropped]:
        """The layouts ``job`` may not run again, as its status in the store keeps them."""
        if job not in self._mem_dropped:
            self._mem_dropped[job] = self._load_dropped(job)
        return self._mem_dropped[job]

    def _load_dropped(self, job: str) -> dict[Layout, mem.Dropped]:
        rec = db.get_job(self.store, job)
        out: dict[Layout, mem.Dropped] = {}
        for i, doc in enumerate(((rec.status or {}).get("droppedLayouts") or []) if rec else []):
            try:
                d = mem.Dropped.from_json(doc, where=f"job {job}: status.droppedLayouts[{i}]")
            except SpecError as e:  # a status edited by hand: that entry is lost, never the tick
                log.warning("%s; left out", e)
                continue
            out[d.layout] = d
        if out:
            log.info("job %s: layouts dropped for their memory on record: %s", job, ", ".join(map(str, out)))
        return out

    def _check_memory(self, job: str, rt: JobRuntime | None) -> None:
        """Drop the layout ``rt`` reports overrunning its memory budget (``memory.check_*``): once, on
        record as a ``MemoryExceeded`` decision. A user job reports no measurement: nothing happens."""
        if rt is None:
            return
        budget = self._budget(job)
        m: MeasuredMemory | None = None
        if rt.memory:
            try:
                m = MeasuredMemory.from_json(rt.memory, where=f"job {job}: measured memory")
            except SpecError as e:
                log.warning("%s; not checked", e)
        # a failed job, or one whose step ran out of memory and that waits (recovering) for another layout
        found = [mem.check_failure(rt.layout, rt.error, budget, self.clock(), m)
                 if rt.phase in (JobPhase.FAILED, JobPhase.RECOVERING) else None,
                 mem.check_failure(rt.recovered_from, rt.recovery, budget, self.clock())]
        over = mem.check_measured(m, budget, self.clock())
        if over is not None and over.layout not in self._dropped(job):
            # the planner's prediction beside what was measured, in the decision's message
            assert m is not None
            predicted = mem.predicted_stage(self.cfg.models()[job], m, self.hardware,
                                            gpus_per_node=self.cfg.pool.gpus_per_node)
            found.append(mem.check_measured(m, budget, self.clock(), predicted))
        for d in found:
            if d is not None and d.layout not in self._dropped(job):
                self._drop(job, rt, d)

    def _drop(self, job: str, rt: JobRuntime, d: mem.Dropped) -> None:
        self._dropped(job)[d.layout] = d
        to = self._relayout_target(job, rt)
        then = (f"it moves in place to {to}" if to is not None
                else "it is re-planned without it" if rt.phase != JobPhase.FAILED else "it restarts on another layout")
        msg = f"{job}: layout {d.message}; dropped for the rest of the job's life, {then}"
        log.warning("%s", msg)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(self.clock()), reason=DecisionReason.MEMORY_EXCEEDED,
                           message=msg, plan={"steps": [], "notes": [msg], "job": job, "dropped": d.as_json(),
                                              "to": None if to is None else str(to)}, inputs={"memory": rt.memory})

    def dropped_layouts(self, job: str) -> list[dict[str, Any]]:
        """The layouts ``job`` may not run again (``Dropped.as_json()`` each), for a status to show."""
        return [d.as_json() for d in self._dropped(job).values()]

    def _layout_table(self, job: str) -> mem.Table:
        """The job's GPU count -> layout table: its pin if any (unless the pinned layout was dropped for
        its memory: then the planner's), without the layouts dropped for their memory."""
        table = self.pinned.get(job, self._throughput[job])
        dropped = self._dropped(job)
        if not dropped:
            return table
        if job in self.pinned and any(lay in dropped for lay, _ in table.values()):
            table = self._throughput[job]
        return self._memory_table(job, table)

    def _memory_table(self, job: str, table: mem.Table) -> mem.Table:
        """``table`` without the layouts ``job`` dropped (``memory.without_dropped``; the planner is asked
        once per change of the table or of what is dropped)."""
        dropped = frozenset(self._dropped(job))
        cached = self._mem_tables.get(job)
        key = (dropped, tuple(sorted(table.items())))
        if cached is not None and cached[0] == key:
            return cached[1]
        spec = next(j for j in self.cfg.jobs if j.name == job)
        model = self.cfg.models()[job]

        def candidates(n: int) -> list[mem.Candidate]:
            return mem.alternatives(model, self.hardware, n, gpus_per_node=self.cfg.pool.gpus_per_node,
                                    **spec.planner_options())

        out = mem.without_dropped(table, dropped, candidates)
        self._mem_tables[job] = (key, out)
        return out

    def _relayout_target(self, job: str, rt: JobRuntime | None) -> Layout | None:
        """Where ``job`` moves in place, on the GPUs it holds, off a layout dropped for its memory; None:
        it stays (not dropped, not running, or no other layout of that count: it gets fewer GPUs). A job
        whose step ran out of memory waits (recovering) for exactly this move."""
        if rt is None or not (rt.phase == JobPhase.RUNNING or (rt.phase == JobPhase.RECOVERING and _out_of_memory(rt))):
            return None
        return mem.relayout_target(rt.layout, len(rt.gpus), self._dropped(job), self._layout_table(job))

    def _record_recovery(self, rt: JobRuntime) -> None:
        """A job recovered from a lost worker on its own (no action of ours): put it on record as a
        finished reshard and a ``WorkerLost`` decision, once."""
        self._recoveries_seen[rt.name] = rt.generation
        self.recoveries.append((rt.name, rt.generation))
        now = self.clock()
        if not any(ev.generation == rt.generation
                   for ev in db.list_reshards(self.db, job=rt.name, limit=5, newest_first=True)):
            rid = db.start_reshard(self.db, job=rt.name, pool=self.pool, generation=rt.generation,
                                   from_layout=str(rt.recovered_from or ""), to_layout=str(rt.layout or ""),
                                   bytes_planned=rt.last_bytes_moved or 0, bytes_lower_bound=0, now=_dt(now))
            db.finish_reshard(self.db, rid, bytes_moved=rt.last_bytes_moved, pause_seconds=rt.last_pause_seconds,
                              now=_dt(now))
        msg = (f"{rt.name} recovered in place from {rt.recovery}: {rt.recovered_from} -> {rt.layout} on "
               f"{len(rt.gpus)} GPUs, training resumed (pause {rt.last_pause_seconds or 0.0:.2f} s)")
        log.warning("%s", msg)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason=DecisionReason.WORKER_LOST, message=msg,
                           plan={"steps": [], "notes": [msg], "job": rt.name, "generation": rt.generation,
                                 "lost": rt.recovery}, inputs={})

    def _failed_start(self, job: str, reason: str, now: float) -> None:
        """A start or grow of ``job`` failed (or the job failed on its own): wait before the next
        attempt, twice as long after each failure in a row (``start_backoff_*``)."""
        b = self.backoff.get(job)
        n = (b.failures if b else 0) + 1
        wait = self.cfg.controller.backoff_after(n)
        self.backoff[job] = Backoff(n, reason[:500], now + wait, now)
        log.warning("job %s: failure %d in a row (%s); it gets no more GPUs for %g s", job, n, reason[:200], wait)

    def _backing_off(self, job: str, now: float) -> Backoff | None:
        b = self.backoff.get(job)
        return b if b is not None and now < b.next_at else None

    def _forgive(self, runtimes: Mapping[str, JobRuntime | None], now: float) -> None:
        """A job running ``start_backoff_max_seconds`` after its last failure starts afresh."""
        cap = self.cfg.controller.start_backoff_max_seconds
        for job, b in list(self.backoff.items()):
            rt = runtimes.get(job)
            if rt is not None and rt.phase == JobPhase.RUNNING and now - b.last_failure_at >= cap:
                del self.backoff[job]
                log.info("job %s has run %g s since its last failure: its backoff is over", job, cap)

    def _observed_allocation(self, obs: Observed | None = None, exclude: set[str] | None = None) -> Allocation:
        """What every workload holds: each job as ``obs`` (a tick's observation) has it; without one
        (outside a tick: crash recovery, a caller's check), each job read from the backend."""
        runtime = self.backend.job_runtime if obs is None else obs.runtime
        hold: dict[str, tuple[GPU, ...]] = {}
        for s in self.cfg.services:
            g = self.backend.service_gpus(s.name)
            if g:
                hold[s.name] = g
        for j in self.cfg.jobs:
            if exclude and j.name in exclude:
                continue
            if self._grow_in_flight(j.name):
                hold[j.name] = self._growing[j.name][1]  # reserved for the joiners starting now
                continue
            rt = runtime(j.name)
            if rt and rt.gpus:
                hold[j.name] = rt.gpus
        return Allocation(hold)

    def _grow_in_flight(self, job: str) -> bool:
        g = self._growing.get(job)
        if g is None:
            return False
        if g[0].is_alive():
            return True
        del self._growing[job]
        return False

    def _backlog(self, service: str, now: float) -> MetricSample | None:
        """The requests waiting beside a rate metric, from the service's source when it reads them
        (``BacklogSource``: a ``request-rate`` preset's ``vllm-waiting``); None otherwise, when the
        read fails or is stale. It only ever adds replicas to the rate's answer, so a missing one
        is the rate alone."""
        src = self.sources.get(service)
        if not isinstance(src, BacklogSource):
            return None
        s = self._read_within(f"{service} backlog", f"backlog read for {service}", lambda: src.backlog(service, now))
        if s is None or s.stale or now - s.observed_at > self.cfg.controller.metrics_max_age_seconds:
            return None
        return s

    def _sample(self, service: str, now: float) -> MetricSample | None:
        src = self.sources.get(service)
        if src is None:
            return None
        s = self._read_within(service, f"metric source for {service}", lambda: src.sample(service, now))
        if s is not None and now - s.observed_at > self.cfg.controller.metrics_max_age_seconds:
            return MetricSample(s.value, s.observed_at, s.source, stale=True)
        return s

    def _read_within(self, key: str, what: str, read: Callable[[], MetricSample | None]) -> MetricSample | None:
        """``read()`` within the metrics timeout; None when it fails or does not answer in time (a
        failing source is missing data, never zero), logged once per failure, not every tick. A
        source that never answers (a Prometheus accepting connections and nothing more) must not
        hold the tick: its thread goes on, and the next read of ``key`` waits for it to end."""
        try:
            hung = self._hanging.get(key)
            if hung is not None and hung.is_alive():
                raise TimeoutError("its previous read has not answered yet")
            s = _call_within(read, self.cfg.controller.metrics_timeout(), what, TimeoutError,
                             hanging=self._hanging, key=key)
        except Exception as e:  # noqa: BLE001 - a failing read is missing data
            if self._source_errors.get(key) != str(e):
                log.warning("%s failed: %s", what, e)
            self._source_errors[key] = str(e)
            return None
        if self._source_errors.pop(key, None) is not None:
            log.info("%s answers again", what)
        return s

def _out_of_memory(rt: JobRuntime) -> bool:
    """``rt`` waits for another layout because a step ran out of memory (its error says so)."""
    return bool(rt.error) and any(k in str(rt.error).lower() for k in mem.OOM_MARKERS)
