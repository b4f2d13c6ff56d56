"""Operators' interventions (admin API): a pause, a service's replica override, a job's layout
pin, and a checkpoint on demand.

Each intervention is written to the DB (``store``: the caller's transaction, e.g. with its audit
entry) before it changes the live state, so what the controller acts on is always on record, with
who set it and when. A controller loads them when it starts and again when it takes the lease, so
a restart or a failover keeps them (an override that ran out is dropped).
"""

from __future__ import annotations

import json
from typing import Any, cast

from elastic import store as db
from elastic.backends.base import BackendError, Checkpoints
from elastic.controller.base import ControllerState, _dt, log
from elastic.model import Layout, SpecError


class Interventions(ControllerState):
    """Sets, clears and reloads the interventions on record, and mirrors them in the live state."""

    def pause(self, *, actor: str = "controller", store: Any = None) -> None:
        """Stop acting (ticks still observe nothing and record nothing) until ``resume``; kept across restarts."""
        rec = db.set_intervention(store or self.store, pool=self.pool, kind="pause", target=self.pool, actor=actor,
                                  now=_dt(self.clock()))
        self.paused = True
        self.intervened[("pause", self.pool)] = rec

    def resume(self, *, store: Any = None) -> None:
        db.clear_intervention(store or self.store, pool=self.pool, kind="pause", target=self.pool)
        self.paused = False
        self.intervened.pop(("pause", self.pool), None)

    def set_override(self, service: str, replicas: int, until: float, *, actor: str = "controller",
                     store: Any = None) -> None:
        """Pin a service's replica count until ``until`` (epoch seconds); the policy still runs."""
        spec = self._service_spec(service)
        if not spec.min_replicas <= replicas <= spec.max_replicas:
            raise ValueError(f"replicas={replicas} outside [{spec.min_replicas}, {spec.max_replicas}] of '{service}'")
        rec = db.set_intervention(store or self.store, pool=self.pool, kind="override", target=service, actor=actor,
                                  value={"replicas": replicas}, until=_dt(until), now=_dt(self.clock()))
        self.overrides[service] = (replicas, until)
        self.intervened[("override", service)] = rec

    def clear_override(self, service: str, *, store: Any = None) -> None:
        db.clear_intervention(store or self.store, pool=self.pool, kind="override", target=service)
        self.overrides.pop(service, None)
        self.intervened.pop(("override", service), None)

    def pin_layout(self, job: str, layout: Layout | None, *, actor: str = "controller", store: Any = None) -> None:
        """Force ``job`` onto ``layout`` (validated by the caller with the planner); None unpins."""
        if job not in self._throughput:
            raise KeyError(job)
        if layout is None:
            db.clear_intervention(store or self.store, pool=self.pool, kind="pin", target=job)
            self.pinned.pop(job, None)
            self.intervened.pop(("pin", job), None)
        else:
            rec = db.set_intervention(store or self.store, pool=self.pool, kind="pin", target=job, actor=actor,
                                      value={"layout": str(layout)}, now=_dt(self.clock()))
            self._pin(job, layout)
            self.intervened[("pin", job)] = rec

    def _pin(self, job: str, layout: Layout) -> None:
        tps = self._throughput[job].get(layout.world_size, (layout, 1.0))[1]
        self.pinned[job] = {layout.world_size: (layout, max(tps, 1.0))}

    def _load_interventions(self) -> None:
        """The interventions on record become the live ones (at start and whenever this controller
        takes the lease: a predecessor's pause or pins hold). An override that ran out, or one for a
        workload this controller does not manage (or with a count its spec no longer allows), is left
        out; overrides set in memory only (the operator's ``spec.replicas``) stay as they are."""
        now = self.clock()
        for kind, target in list(self.intervened):
            if kind == "override":
                self.overrides.pop(target, None)
            elif kind == "pin":
                self.pinned.pop(target, None)
        self.intervened, self.paused = {}, False
        services = {s.name: s for s in self.cfg.services}
        for r in db.list_interventions(self.store, self.pool):
            if r.kind == "pause":
                self.paused = True
            elif r.kind == "override":
                spec, replicas = services.get(r.target), r.value.get("replicas")
                if r.until is None or r.until.timestamp() <= now:
                    self._expired_overrides = True
                    continue
                if spec is None or not isinstance(replicas, int) or \
                        not spec.min_replicas <= replicas <= spec.max_replicas:
                    log.warning("override of %s on record (%s by %s) ignored: not a service of this controller or "
                                "outside its replica bounds", r.target, r.value, r.actor)
                    continue
                self.overrides[r.target] = (replicas, r.until.timestamp())
            elif r.kind == "pin":
                try:
                    layout = Layout.parse(str(r.value.get("layout")))
                except SpecError:
                    layout = None
                if r.target not in self._throughput or layout is None:
                    log.warning("layout pin of %s on record (%s by %s) ignored: not a job of this controller or "
                                "not a layout", r.target, r.value, r.actor)
                    continue
                self._pin(r.target, layout)
            self.intervened[(r.kind, r.target)] = r
        if self.intervened:
            log.info("interventions on record: %s", "; ".join(
                f"{k} {t}{'' if k == 'pause' else ' ' + json.dumps(r.value)} by {r.actor}"
                for (k, t), r in sorted(self.intervened.items())))

    def checkpoint_job(self, job: str, wait_seconds: float = 0.0) -> Any:
        """Save ``job``'s state at its next step boundary and, with ``wait_seconds``, wait until
        every rank wrote it (``CheckpointOutcome``). Not under the tick's lock: a tick goes on
        meanwhile. KeyError: not a job of this controller; BackendError: not running or the
        backend cannot; SpecError (no checkpoint settings), CheckpointFailed, TimeoutError."""
        if job not in self._throughput:
            raise KeyError(job)
        spec = next((j for j in self.cfg.jobs if j.name == job), None)
        if spec is not None and spec.checkpoint is None:  # the spec says it all, running or not
            raise SpecError(f"job {job} has no checkpoint settings; give it checkpoint.dir to save one")
        if not self.caps.checkpoints:
            raise BackendError(f"the {self.backend.name} backend cannot save a checkpoint on demand")
        out = cast(Checkpoints, self.backend).checkpoint_job(job, wait_seconds)
        log.info("checkpoint of %s asked for%s", job, f": step {out.step}" if out.step is not None else "")
        return out

    def _service_spec(self, service: str) -> Any:
        for s in self.cfg.services:
            if s.name == service:
                return s
        raise KeyError(service)
