"""The admin REST API: see where every GPU is and why, and intervene without editing the DB.

What it is for: ``create_app(store, controller, tokens=...)`` builds a FastAPI app with

* reads under ``/api/v1``: pools, inference services, training jobs, the controller's state,
  the decision log and a job's reshard history (``limit`` + opaque ``continue`` paging);
* writes under ``/api/v1``: create/replace/delete services and jobs (refused with 409 in
  operator mode, where Kubernetes custom resources own the specs), pin a job's layout
  (validated by the planner), pin a service's replicas until a time, pause/resume;
* ``/healthz`` (the process answers), ``/readyz`` (DB reachable and controller ready),
  ``/metrics`` (Prometheus), ``/openapi.json``.

Every error is ``application/problem+json`` naming the field and the fix. Writes need an
``admin`` bearer token, reads optionally any token; every accepted write is recorded in the
audit log in the same transaction as its effect, and a rejected request changes nothing.

What it must not do: decide. The API records operator intent (store rows, controller
overrides/pins/pause); the controller's next tick acts on it. It never calls a backend.

Here: the app factory and what ``/metrics`` serves. The routes are in ``reads.py``, ``writes.py``,
``interventions.py`` and ``ops.py``, the middleware (authentication, body size, ``Allow``) in
``middleware.py``, what the routes share in ``context.py``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

import elastic
from elastic import store as db
from elastic.api.auth import TokenSet
from elastic.api.context import _Api
from elastic.api.interventions import _routes_interventions
from elastic.api.middleware import DEFAULT_MAX_BODY_BYTES, AllowHeader, AuthGate, BodyLimit
from elastic.api.ops import _routes_ops
from elastic.api.pagination import ContinueCodec
from elastic.api.problems import install
from elastic.api.reads import _routes_reads
from elastic.api.writes import _routes_spec_writes

log = logging.getLogger("elastic.api")


def create_app(store: db.Store, controller: Any | None = None, *, tokens: TokenSet, operator_mode: bool = False,
               registry: CollectorRegistry | None = None, require_auth_for_reads: bool = False,
               clock: Callable[[], float] = time.time, continue_key: bytes | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_dir: str | os.PathLike[str] | None = None
               ) -> FastAPI:
    """The admin API over ``store`` (and ``controller`` for interventions; None: read-only ops).

    ``registry``: what ``/metrics`` serves (the serve loop's ``Exporter.registry``). None: an
    ``Exporter`` of this app refreshed from the store and controller on every scrape.
    ``continue_key``: key of the continue-token tag (default: a random key kept in the database, the
    same for every API server over it; nothing the server shows derives it). ``max_body_bytes``: the
    largest request body taken (413 above it). ``model_dir``: the only directory model files named by
    API-written specs are read from (default ``$ELASTIC_MODEL_DIR``, else ``./models``).
    """
    codec = ContinueCodec(continue_key if continue_key is not None else _continue_key(store))
    api = _Api(store, controller, operator_mode, clock, codec)
    api.tokens = tokens
    api.model_dir = Path(model_dir or os.environ.get("ELASTIC_MODEL_DIR") or "models").resolve()
    app = FastAPI(title="elastic admin API", version=elastic.__version__,
                  description="Where every GPU is and why; pause the controller, pin a service, force a rescale.")
    install(app)
    # the last added runs first: authentication before any body is read, then the body's size
    app.add_middleware(AllowHeader, routes=lambda: app.router.routes)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AuthGate, tokens=tokens, require_auth_for_reads=require_auth_for_reads)
    _routes_reads(app, api, require_auth_for_reads)
    _routes_spec_writes(app, api)
    _routes_interventions(app, api)
    _routes_ops(app, api, _metrics_source(store, controller, registry))
    app.state.api = api
    return app


def _continue_key(store: db.Store) -> bytes:
    """The continue-token key on record in the database (created at random on first use); a
    database that does not answer now gets a key of this process (its tokens die with it)."""
    try:
        return db.signing_key(store, "api-continue-token")
    except db.StoreError as e:
        log.warning("continue tokens signed with a key of this process only: %s", e)
        return secrets.token_bytes(32)


class StoreCollector:
    """``/metrics`` gauges of the state database, read at scrape time: its size, and per history
    table the rows kept and the oldest kept row (what retention bounds). A database that does not
    answer yields none of them (the controller's ``elastic_controller_ready`` says why)."""

    def __init__(self, store: db.Store) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        """The names, without reading the DB (lets the registry refuse a second copy)."""
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(n, "") for n in ("elastic_store_size_bytes", "elastic_store_rows",
                                                   "elastic_store_oldest_row_timestamp_seconds")]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            size, tables = db.database_size(self.store), db.history_stats(self.store)
        except (db.StoreError, OSError) as e:
            log.debug("store metrics skipped: %s", e)
            return
        yield GaugeMetricFamily("elastic_store_size_bytes", "Bytes the state database takes (SQLite: the file's "
                                "pages; PostgreSQL: elastic's tables with indexes)", value=size)
        rows = GaugeMetricFamily("elastic_store_rows", "Rows kept per history table", labels=["table"])
        oldest = GaugeMetricFamily("elastic_store_oldest_row_timestamp_seconds", "Time of the oldest kept row "
                                   "per history table by the time retention judges it by (Unix); absent while no "
                                   "row has ended", labels=["table"])
        for t in tables:
            rows.add_metric([t.table], t.rows)
            if t.oldest is not None:
                oldest.add_metric([t.table], t.oldest.timestamp())
        yield rows
        yield oldest


class BackoffCollector:
    """``/metrics`` gauges of the jobs backing off from failed starts, read at scrape time from the
    controller: failures in a row and when the next attempt may come."""

    NAMES = ("elastic_job_start_failures", "elastic_job_next_start_attempt_timestamp_seconds")

    def __init__(self, controller: Any) -> None:
        self.ctl = controller

    def describe(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(n, "") for n in self.NAMES]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        fails = GaugeMetricFamily(self.NAMES[0], "Failed starts or grows of a job in a row (0: none lately)",
                                  labels=["pool", "job"])
        nxt = GaugeMetricFamily(self.NAMES[1], "Earliest time the controller starts or grows the job again "
                                "after a failure (Unix); absent when it is not backing off", labels=["pool", "job"])
        backoff = dict(getattr(self.ctl, "backoff", {}))
        for j in self.ctl.cfg.jobs:
            b = backoff.get(j.name)
            fails.add_metric([self.ctl.pool, j.name], b.failures if b else 0)
            if b is not None:
                nxt.add_metric([self.ctl.pool, j.name], b.next_at)
        yield fails
        yield nxt


def _register_store_metrics(registry: CollectorRegistry, store: db.Store, controller: Any = None) -> None:
    collectors: list[Any] = [StoreCollector(store)] + ([BackoffCollector(controller)] if controller is not None else [])
    for c in collectors:
        try:
            registry.register(c)
        except ValueError:  # a second app on the same registry: its gauges are already there
            pass


def _metrics_source(store: db.Store, controller: Any | None, registry: CollectorRegistry | None
                    ) -> Callable[[], bytes]:
    if registry is not None:
        _register_store_metrics(registry, store, controller)
        return lambda: generate_latest(registry)
    from elastic.metrics.exporter import Exporter

    exporter = Exporter()
    _register_store_metrics(exporter.registry, store, controller)

    def render() -> bytes:
        exporter.update_from(controller, store)
        return generate_latest(exporter.registry)

    return render
