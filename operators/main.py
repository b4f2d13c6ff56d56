"""Kopf handlers of the elastic operator: ``kopf run -m operators.main --all-namespaces --standalone``.

What it is for: turning the ``elastic.dev/v1alpha1`` custom resources into controller input.
Create/update/resume handlers register each CR with ``RUNTIME`` (validating it and setting its
``Ready`` condition); a timer per ``GPUPool`` runs that pool's reconcile cycle
(``OperatorRuntime.tick_pool``: the controller tick with the Kubernetes backend); delete
handlers are finalizers: a job's worker pods are deleted (its GPUs released) before the
ElasticTrainingJob goes away.

Only one replica acts: the controller holds a per-pool lease in the database, so a second
operator replica ticks as a standby and writes nothing (Kopf's peering could only *freeze*
operators, not elect one; run with ``--standalone``). Kopf's own progress is kept in
annotations (``elastic.dev/...``): ``status`` belongs to us. Kopf's core/v1 event posting is
off; we post ``events.k8s.io/v1`` Events ourselves.

What it must not do: decide anything or hold state of its own (``operators.runtime`` does).
``RUNTIME`` is module-level so tests can swap its metric sources before Kopf starts.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from elastic.crds import GROUP, VERSION
from operators.runtime import JOBS, POOLS, SERVICES, OperatorRuntime, OperatorSettings

log = logging.getLogger("operators.main")

RUNTIME = OperatorRuntime()
TIMER_SECONDS = OperatorSettings.from_env().timer_seconds
_api_server: Any = None


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    from elastic.logs import setup_from_env
    from elastic.model import SpecError

    try:  # ELASTIC_LOG_LEVEL / ELASTIC_LOG_FORMAT (text|json); replaces Kopf's root handler
        setup_from_env(replace_kopf=True)
    except SpecError as e:
        raise kopf.PermanentError(str(e)) from None
    settings.posting.enabled = False  # events.k8s.io/v1 are posted by operators.status
    settings.persistence.finalizer = "elastic.dev/release-gpus"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="elastic.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="elastic.dev", key="last-handled-configuration")
    settings.watching.server_timeout = 300
    settings.scanning.disabled = True  # our CRDs are installed with the operator: no need to watch CRDs
    settings.execution.max_workers = 8
    RUNTIME.start()
    _start_api()


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    global _api_server
    if _api_server is not None:
        _api_server.should_exit = True
        _api_server = None
    RUNTIME.stop()


@kopf.on.probe(id="db")
def db_probe(**_: Any) -> str:
    """Liveness/readiness detail (``--liveness=http://0.0.0.0:8080/healthz``): the DB answers."""
    if RUNTIME.store is None:
        raise kopf.TemporaryError("not started")
    RUNTIME.store.ping()
    return "ok"


def _start_api() -> None:
    """The admin API (read-only operations over the DB, ``/metrics``) on ``ELASTIC_API_PORT`` (0: off)."""
    global _api_server
    if RUNTIME.settings.api_port <= 0 or RUNTIME.store is None:
        return
    from elastic.api.app import create_app
    from elastic.api.auth import TokenSet
    from elastic.api.server import serve_api

    app = create_app(RUNTIME.store, None, tokens=TokenSet(), operator_mode=True)
    _api_server, _ = serve_api(app, "0.0.0.0", RUNTIME.settings.api_port)


# ---- GPUPool ------------------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, POOLS)
@kopf.on.create(GROUP, VERSION, POOLS)
@kopf.on.update(GROUP, VERSION, POOLS, field="spec")
def pool_changed(name: str, spec: Any, meta: Any, status: Any, **_: Any) -> None:
    RUNTIME.set_pool(name, dict(spec), meta.get("uid"), int(meta.get("generation") or 0), dict(status or {}))


@kopf.on.delete(GROUP, VERSION, POOLS, optional=True)
def pool_deleted(name: str, **_: Any) -> None:
    RUNTIME.remove_pool(name)


@kopf.timer(GROUP, VERSION, POOLS, interval=TIMER_SECONDS, sharp=False)
def pool_tick(name: str, **_: Any) -> None:
    """Due when ``spec.tickSeconds`` has passed since the last cycle (the timer itself runs more often)."""
    RUNTIME.tick_pool(name)


# ---- InferenceService ---------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, SERVICES)
@kopf.on.create(GROUP, VERSION, SERVICES)
@kopf.on.update(GROUP, VERSION, SERVICES, field="spec")
@kopf.on.update(GROUP, VERSION, SERVICES, field="metadata.annotations")
def service_changed(namespace: str, name: str, spec: Any, meta: Any, status: Any, **_: Any) -> None:
    RUNTIME.set_service(namespace, name, dict(spec), meta.get("uid"), int(meta.get("generation") or 0),
                        dict(status or {}), annotations=dict(meta.get("annotations") or {}))


@kopf.on.delete(GROUP, VERSION, SERVICES, optional=True)
def service_deleted(namespace: str, name: str, **_: Any) -> None:
    RUNTIME.remove_service(namespace, name)


# ---- ElasticTrainingJob -------------------------------------------------------------------------


@kopf.on.resume(GROUP, VERSION, JOBS)
@kopf.on.create(GROUP, VERSION, JOBS)
@kopf.on.update(GROUP, VERSION, JOBS, field="spec")
def job_changed(namespace: str, name: str, spec: Any, meta: Any, status: Any, **_: Any) -> None:
    RUNTIME.set_job(namespace, name, dict(spec), meta.get("uid"), int(meta.get("generation") or 0),
                    dict(status or {}))


@kopf.on.delete(GROUP, VERSION, JOBS)
def job_deleted(namespace: str, name: str, logger: Any, **_: Any) -> None:
    """Finalizer: the job's worker pods go (GPUs released) before the resource does."""
    n = RUNTIME.remove_job(namespace, name)
    logger.info("released %d worker pod(s) of %s/%s", n, namespace, name)
