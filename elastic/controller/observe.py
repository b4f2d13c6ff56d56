"""Step 1 of a tick, observe: what each workload holds, each job's runtime, each service's metric;
and the backoff of jobs whose start or grow failed.

A job whose start or grow fails backs off exponentially (``start_backoff_seconds`` doubling up to
``start_backoff_max_seconds``): the co-scheduler does not give it more GPUs until the next attempt.
A job that recovered from a lost worker on its own is put on record once. A metric source that
fails or never answers is missing data (never zero), logged when it starts and when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping

from elastic import store as db
from elastic.backends.base import JobRuntime
from elastic.controller.base import Backoff, ControllerState, _call_within, _dt, log
from elastic.metrics.sample import MetricSample
from elastic.model import GPU, Allocation


class Observing(ControllerState):
    """Reads the backend and the metric sources; keeps the backoff of failed starts."""

    def _observe_jobs(self, failed: set[str]) -> tuple[Allocation, dict[str, JobRuntime | None]]:
        """What every workload holds, and each job's runtime (None: not running, or failed)."""
        runtimes = {j.name: None if j.name in failed else self.backend.job_runtime(j.name) for j in self.cfg.jobs}
        for name, rt in runtimes.items():
            if rt is not None and rt.recovery and self._recoveries_seen.get(name) != rt.generation:
                self._record_recovery(rt)
        self._forgive(runtimes, self.clock())
        return self._observed_allocation(exclude=failed), runtimes

    def _record_recovery(self, rt: JobRuntime) -> None:
        """A job recovered from a lost worker on its own (no action of ours): put it on record as a
        finished reshard and a ``WorkerLost`` decision, once."""
        self._recoveries_seen[rt.name] = rt.generation
        self.recoveries.append((rt.name, rt.generation))
        now = self.clock()
        if not any(ev.generation == rt.generation
                   for ev in db.list_reshards(self.db, job=rt.name, limit=5, newest_first=True)):
            rid = db.start_reshard(self.db, job=rt.name, pool=self.pool, generation=rt.generation,
                                   from_layout=rt.recovered_from or "", to_layout=rt.layout or "",
                                   bytes_planned=rt.last_bytes_moved or 0, bytes_lower_bound=0, now=_dt(now))
            db.finish_reshard(self.db, rid, bytes_moved=rt.last_bytes_moved, pause_seconds=rt.last_pause_seconds,
                              now=_dt(now))
        msg = (f"{rt.name} recovered in place from {rt.recovery}: {rt.recovered_from} -> {rt.layout} on "
               f"{len(rt.gpus)} GPUs, training resumed (pause {rt.last_pause_seconds or 0.0:.2f} s)")
        log.warning("%s", msg)
        db.record_decision(self.db, pool=self.pool, tick_at=_dt(now), reason="WorkerLost", message=msg,
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
            if rt is not None and rt.phase == "Running" and now - b.last_failure_at >= cap:
                del self.backoff[job]
                log.info("job %s has run %g s since its last failure: its backoff is over", job, cap)

    def _observed_allocation(self, exclude: set[str] | None = None) -> Allocation:
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
            rt = self.backend.job_runtime(j.name)
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

    def _sample(self, service: str, now: float) -> MetricSample | None:
        src = self.sources.get(service)
        if src is None:
            return None
        try:
            hung = self._hanging.get(service)
            if hung is not None and hung.is_alive():
                raise TimeoutError("its previous read has not answered yet")
            # a source that never answers (a Prometheus accepting connections and nothing more) must
            # not hold the tick; its thread goes on and the next read waits for it to end
            s = _call_within(lambda: src.sample(service, now), self.cfg.controller.metrics_timeout(),
                             f"metric read for {service}", TimeoutError, hanging=self._hanging, key=service)
        except Exception as e:  # noqa: BLE001 - a failing source is missing data, never zero
            if self._source_errors.get(service) != str(e):  # once per failure, not every tick
                log.warning("metric source for %s failed: %s", service, e)
            self._source_errors[service] = str(e)
            return None
        if self._source_errors.pop(service, None) is not None:
            log.info("metric source for %s answers again", service)
        if s is not None and now - s.observed_at > self.cfg.controller.metrics_max_age_seconds:
            return MetricSample(s.value, s.observed_at, s.source, stale=True)
        return s
