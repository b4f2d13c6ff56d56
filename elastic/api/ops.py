"""The admin API's operations endpoints: ``/healthz``, ``/readyz`` and ``/metrics`` (which serves
what the app factory hands it: see ``_metrics_source`` in ``app.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from elastic import store as db
from elastic.api import schemas as S
from elastic.api.context import _Api, _errors
from elastic.api.middleware import _bearer
from elastic.api.problems import Problem

log = logging.getLogger("elastic.api")


def _routes_ops(app: FastAPI, api: _Api, metrics: Callable[[], bytes]) -> None:
    @app.get("/healthz", response_model=S.Health, tags=["ops"])
    def healthz() -> S.Health:
        return S.Health(status="ok")

    @app.get("/readyz", response_model=S.Health, responses=_errors(503), tags=["ops"])
    def readyz(request: Request) -> S.Health:
        # probes read it without a token: they learn ready or not, and which check failed; the why
        # (which names the database's user, host and name) only for a valid token
        token = _bearer(request.scope)
        detailed = api.tokens is not None and token is not None and api.tokens.authenticate(token) is not None
        checks, failed = {}, []
        try:
            api.store.ping()
            checks["database"] = "ok"
        except db.StoreError as e:
            checks["database"] = str(e) if detailed else "unavailable"
            failed.append(f"database: {checks['database']}")
        if api.ctl is not None:
            ctl = api.ctl
            ok = bool(ctl.ready) and not ctl.last_error
            why = (ctl.last_error or "no successful tick yet") if detailed else "not acting"
            checks["controller"] = "ok" if ok else why
            if not ok:
                failed.append(f"controller: {checks['controller']}")
        if failed:
            raise Problem(503, "not-ready", "not ready: " + "; ".join(failed), headers={"Retry-After": "5"})
        return S.Health(status="ready", checks=checks)

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    def prometheus_metrics() -> Response:
        return Response(metrics(), media_type=CONTENT_TYPE_LATEST)
