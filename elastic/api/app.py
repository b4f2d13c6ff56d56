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
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import elastic
from elastic import store as db
from elastic.api import schemas as S
from elastic.api.auth import Principal, TokenSet
from elastic.api.pagination import ContinueCodec
from elastic.api.problems import (
    PROBLEM_JSON,
    Problem,
    ProblemDetail,
    install,
    invalid,
    log_refusal,
    problem_response,
)
from elastic.backends.base import BackendError, CheckpointNotSaved
from elastic.config import name_problem
from elastic.model import (
    MODEL_PRESETS,
    InferenceSpec,
    Layout,
    PoolSpec,
    SpecError,
    TrainingSpec,
    check_layout,
    load_hardware,
    load_model,
)

log = logging.getLogger("elastic.api")

API = "/api/v1"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"

Name = Annotated[str, PathParam(pattern=NAME_PATTERN, description="workload or pool name")]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"page size, 1..{MAX_LIMIT}")]
Continue = Annotated[str | None, Query(alias="continue", max_length=2048,
                                       description="token from the previous page's metadata.continue")]
Order = Annotated[Literal["asc", "desc"], Query(description="desc: newest first (default); asc: oldest first")]


# ---- OpenAPI: the error responses each route can give -----------------------------------------------

def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Malformed request (e.g. invalid JSON or continue token)", 401: "Missing or unknown bearer token",
            403: "The token is read-only", 404: "Not found", 409: "Conflict with the current state",
            415: "The body is not JSON (send Content-Type: application/json)",
            422: "Invalid input; 'field' names it", 502: "The workers could not do it (e.g. a failed write)",
            503: "Database or controller unavailable", 504: "Not done within the time asked for"}
    return {c: {"description": text[c], "model": ProblemDetail, "content": {PROBLEM_JSON: {}}} for c in codes}


READ_ERR = (401, 422, 503)
WRITE_ERR = (400, 401, 403, 409, 415, 422, 503)


# ---- authentication gate ------------------------------------------------------------------------------

def _unauthorized(detail: str, error: str | None = None) -> Problem:
    challenge = 'Bearer realm="elastic"' + (f', error="{error}"' if error else "")
    return Problem(401, "unauthorized", detail, headers={"WWW-Authenticate": challenge})


DEFAULT_MAX_BODY_BYTES = 1 << 20


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused (413) before it is read whole.

    A declared ``Content-Length`` over the limit is refused at once; a body without one (chunked)
    is read up to the limit and refused when it goes past. What is accepted is handed on as read
    (at most ``max_bytes`` held in memory)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max = app, int(max_bytes)

    def _too_large(self, size: str) -> Problem:
        return Problem(413, "too-large", f"body: {size} bytes; the admin API takes bodies of at most {self.max} "
                                         "bytes (elastic serve --max-body-bytes)", field="body")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITE_METHODS:
            await self.app(scope, receive, send)
            return
        declared = next((v.decode("latin-1") for k, v in scope.get("headers") or () if k == b"content-length"), None)
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max):
            await problem_response(self._too_large(declared.strip()[:20]))(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max:
                await problem_response(self._too_large(f"more than {self.max}"))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, handed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AllowHeader:
    """ASGI middleware: a 405 names every method the path answers in ``Allow``. The router answers
    with the methods of the first route whose path matches, and a path's methods are spread over
    several routes (``GET`` and ``PUT`` and ``DELETE`` of one job are three), so a client told
    ``Allow: GET`` would never learn it may ``PUT``."""

    def __init__(self, app: ASGIApp, routes: Any) -> None:
        self.app, self.routes = app, routes

    def allowed(self, path: str) -> str:
        methods: set[str] = set()
        for r in self.routes():
            if getattr(r, "methods", None) and r.path_regex.match(path):
                methods |= set(r.methods)
        return ", ".join(sorted(methods))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != b"allow"]
                headers.append((b"allow", self.allowed(scope["path"]).encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_allow)


class AuthGate:
    """ASGI middleware: authenticates ``/api/v1`` requests before routing and body parsing.

    Running first means an unauthenticated client learns nothing about bodies or routes (it
    gets 401 whether its JSON is valid or not). Writes need an ``admin`` token; reads need a
    token only when ``require_auth_for_reads``. The principal goes to ``scope['state']``.
    """

    def __init__(self, app: ASGIApp, tokens: TokenSet, require_auth_for_reads: bool) -> None:
        self.app, self.tokens, self.reads = app, tokens, require_auth_for_reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API + "/") and scope["path"] != API:
            await self.app(scope, receive, send)
            return
        write = scope["method"] in WRITE_METHODS
        principal = self.tokens.authenticate(_bearer(scope))
        problem = self._check(write, principal, _bearer(scope) is not None)
        if problem is not None:
            log_refusal(scope["method"], scope["path"], problem)
            await problem_response(problem)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    def _check(self, write: bool, principal: Principal | None, presented: bool) -> Problem | None:
        if not write and not self.reads:
            return None
        if principal is None:
            if not presented:
                hint = ("no API tokens are configured on the server; start it with --token-file or "
                        "ELASTIC_API_TOKENS" if len(self.tokens) == 0 else
                        "send 'Authorization: Bearer <token>'")
                need = "writes need an 'admin' bearer token" if write else "reads need a bearer token"
                return _unauthorized(f"{need}; {hint}")
            return _unauthorized("unknown bearer token", error="invalid_token")
        if write and not principal.can_write:
            return Problem(403, "forbidden", f"token '{principal.name}' has role 'read'; writes need an "
                                             "'admin' token")
        return None


def _bearer(scope: Scope) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return token.strip() or None if scheme.lower() == "bearer" else None
    return None


_bearer_doc = HTTPBearer(auto_error=False, description="token from --token-file / ELASTIC_API_TOKENS")


def principal(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer_doc)) -> Principal:
    """The authenticated writer (the gate already refused anyone else)."""
    p = getattr(request.state, "principal", None)
    if p is None:  # only reachable if the gate is bypassed: refuse rather than write anonymously
        raise _unauthorized("writes need an 'admin' bearer token")
    return p


def reader(_: HTTPAuthorizationCredentials | None = Depends(_bearer_doc)) -> None:
    """Documents the optional bearer token on reads (the gate enforces it when configured)."""


Writer = Annotated[Principal, Depends(principal)]


# ---- record -> response ---------------------------------------------------------------------------------

def _workload(r: db.WorkloadRecord) -> S.Workload:
    return S.Workload(name=r.name, pool=r.pool, spec=r.spec, status=r.status, created_at=r.created_at,
                      updated_at=r.updated_at)


def _decision(r: db.DecisionRecord) -> S.Decision:
    return S.Decision(id=r.id, tick_at=r.tick_at, pool=r.pool, reason=r.reason, message=r.message,
                      inputs=r.inputs, plan=r.plan, hold=r.hold is not None, count=r.count, first_at=r.tick_at,
                      last_at=r.last_at or r.tick_at)


def _reshard(r: db.ReshardRecord) -> S.Reshard:
    return S.Reshard(**{f: getattr(r, f) for f in S.Reshard.model_fields})


def _epoch(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


class _Api:
    """The route handlers' shared state: store, controller, clock, paging codec."""

    def __init__(self, store: db.Store, controller: Any | None, operator_mode: bool,
                 clock: Callable[[], float], codec: ContinueCodec) -> None:
        self.store, self.ctl, self.operator_mode, self.codec = store, controller, operator_mode, codec
        self.clock = clock
        self.tokens: TokenSet | None = None  # set by create_app: who may read the details of /readyz
        self.model_dir: Path | None = None  # set by create_app: model files of API-written specs come from here
        # interventions one at a time: the controller's live state and the audit log's last entry
        # must be the same write (two overrides racing could leave the other one live)
        self.serial = threading.Lock()

    # ---- helpers -------------------------------------------------------------------------------------
    def now(self) -> float:
        """The controller's clock when there is one (overrides are compared against it)."""
        return float(self.ctl.clock()) if self.ctl is not None else self.clock()

    def controller(self) -> Any:
        if self.ctl is None:
            raise Problem(503, "no-controller", "no controller runs in this process; this request needs "
                                                "'elastic serve' (or the operator) with the admin API enabled")
        return self.ctl

    def specs_writable(self, kind: str, name: str) -> None:
        if self.operator_mode:
            crd = "InferenceService" if kind == "service" else "TrainingJob"
            raise Problem(409, "owned-by-kubernetes",
                          f"{kind} specs are owned by Kubernetes custom resources in operator mode; use "
                          f"'kubectl apply -f <{crd}.yaml>' or 'kubectl delete {crd.lower()} {name}' instead")

    def from_config(self, kind: str, name: str, verb: str) -> None:
        """A workload the running controller manages from its config file is neither replaced nor deleted
        here: the file wins (the controller runs its spec, and every start writes it back to the store),
        so such a write would be reverted without a word. 409, naming the file; the header
        ``Elastic-Spec-Source: config`` says which source wins."""
        ctl = self.ctl
        if ctl is None:
            return
        declared = ctl.cfg.services if kind == "service" else ctl.cfg.jobs
        if any(w.name == name for w in declared):
            where = getattr(ctl, "config_source", None) or "the config file given to the controller"
            fix = ("remove it from that file and restart the controller to delete it" if verb == "delete" else
                   "change it in that file and restart the controller")
            raise Problem(409, "declared-in-config",
                          f"{kind} '{name}' is declared in {where} and the running controller manages it from "
                          f"there: the config file wins over the API (every start writes its spec back); {fix}",
                          headers={"Elastic-Spec-Source": "config"})

    def pool_spec(self, name: str, field: str = "pool") -> PoolSpec:
        rec = db.get_pool(self.store, name)
        if rec is None:
            known = ", ".join(p.name for p in db.list_pools(self.store)) or "none yet"
            raise invalid(field, f"unknown pool '{name}'; known pools: {known}")
        return PoolSpec.model_validate(rec.spec)

    def page(self, rows: list[Any], limit: int, query: dict[str, Any]) -> S.ListMeta:
        more = len(rows) > limit
        token = self.codec.encode(rows[limit - 1].id, query) if more else None
        return S.ListMeta(continue_=token)

    @contextmanager
    def audited(self, who: Principal, action: str, target: str, detail: Any) -> Iterator[Any]:
        """One transaction holding the write and its audit entry: both or neither."""
        with self.store.session() as s:
            yield s
            db.record_audit(s, actor=who.name, action=action, target=target, detail={"request": detail})
        log.info("%s %s by %s", action, target, who.name)


def _check_names(body: Any) -> None:
    """Names become URL path segments, pod names and keys: DNS-1123 labels only (as the config file's)."""
    for field, name in (("spec.name", body.spec.name), ("pool", body.pool)):
        if (why := name_problem(name)) is not None:
            raise invalid(field, why)


def _check_service(api: _Api, body: S.ServiceWrite) -> None:
    _check_names(body)
    pool = api.pool_spec(body.pool)
    s, gpn = body.spec, pool.gpus_per_node
    if s.gpus_per_replica > gpn and s.gpus_per_replica % gpn:
        raise invalid("spec.gpus_per_replica", f"{s.gpus_per_replica} GPUs per replica is more than a node ({gpn}) "
                                               "and not a multiple of it; a larger replica takes whole nodes")
    need = s.min_replicas * s.gpus_per_replica
    if need > pool.total_gpus:
        raise invalid("spec.min_replicas", f"{s.min_replicas} x {s.gpus_per_replica} = {need} GPUs exceeds pool "
                                           f"'{pool.name}' ({pool.total_gpus} GPUs); lower min_replicas")


def _check_job(api: _Api, body: S.JobWrite) -> None:
    _check_names(body)
    pool = api.pool_spec(body.pool)
    try:  # a user job too: the planner sizes it from the declared model; files only from the model directory
        _api_model(api, body.spec.model)
    except SpecError as e:
        raise invalid("spec.model", str(e)) from None
    if body.spec.entrypoint is not None:
        from elastic.train.userjob import check_entrypoint

        try:  # the controller's workers run where this process does: its path, its directory
            check_entrypoint(body.spec.entrypoint, "entrypoint", cwd=os.getcwd())
        except SpecError as e:
            raise invalid("spec.entrypoint", str(e).removeprefix("entrypoint: ")) from None
    if body.spec.min_gpus > pool.total_gpus:
        raise invalid("spec.min_gpus", f"{body.spec.min_gpus} exceeds pool '{pool.name}' ({pool.total_gpus} GPUs)")


def _name_free(api: _Api, s: Any, name: str, kind: str) -> None:
    other = db.get_job(s, name) if kind == "service" else db.get_service(s, name)
    if other is not None:
        raise Problem(409, "name-taken", f"'{name}' is already a {'training job' if kind == 'service' else 'service'}"
                                         "; names are unique across services and jobs")


# ---- routes ---------------------------------------------------------------------------------------------

def _routes_reads(app: FastAPI, api: _Api, require_auth: bool) -> None:
    deps = [Depends(reader)] if require_auth else []  # documents the bearer scheme only where it is needed

    @app.get(f"{API}/pools", response_model=S.PoolList, responses=_errors(*READ_ERR), dependencies=deps,
             tags=["pools"])
    def list_pools() -> S.PoolList:
        return S.PoolList(items=[_pool(api, p) for p in db.list_pools(api.store)])

    @app.get(f"{API}/pools/{{name}}", response_model=S.Pool, responses=_errors(404, *READ_ERR), dependencies=deps,
             tags=["pools"])
    def get_pool(name: Name) -> S.Pool:
        rec = db.get_pool(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"pool '{name}' not found; GET {API}/pools lists them")
        return _pool(api, rec)

    for kind, lister, getter in (("services", db.list_services, db.get_service), ("jobs", db.list_jobs, db.get_job)):
        _workload_reads(app, api, kind, lister, getter, deps)

    @app.get(f"{API}/decisions", response_model=S.DecisionList, response_model_by_alias=True,
             responses=_errors(400, *READ_ERR), dependencies=deps, tags=["history"])
    def list_decisions(limit: Limit = DEFAULT_LIMIT, cont: Continue = None, pool: str | None = None,
                       order: Order = "desc",
                       changes: Annotated[bool, Query(description="true: only changes (decisions that acted, "
                                                                  "failed or recovered), no holds")] = False,
                       ) -> S.DecisionList:
        query: dict[str, Any] = {"pool": pool, "order": order}
        if changes:  # only then: tokens minted before this parameter existed stay valid
            query["changes"] = True
        after = api.codec.decode(cont, query) if cont else None
        rows = db.list_decisions(api.store, limit + 1, after, pool=pool, newest_first=order == "desc",
                                 changes_only=changes)
        return S.DecisionList(items=[_decision(r) for r in rows[:limit]], metadata=api.page(rows, limit, query))

    @app.get(f"{API}/database", response_model=S.Database, responses=_errors(*READ_ERR), dependencies=deps,
             tags=["ops"])
    def database() -> S.Database:
        """The state database: its size and, per history table, rows, oldest kept row and retention."""
        days = api.ctl.cfg.controller.retention.days() if api.ctl is not None else {}
        return S.Database(dialect=api.store.dialect, url=api.store.url, size_bytes=db.database_size(api.store),
                          tables=[S.TableInfo(table=t.table, rows=t.rows, oldest=t.oldest,
                                              retention_days=days.get(t.table))
                                  for t in db.history_stats(api.store)])

    @app.get(f"{API}/jobs/{{name}}/reshards", response_model=S.ReshardList, response_model_by_alias=True,
             responses=_errors(400, 404, *READ_ERR), dependencies=deps, tags=["history"])
    def list_reshards(name: Name, limit: Limit = DEFAULT_LIMIT, cont: Continue = None,
                      order: Order = "desc") -> S.ReshardList:
        if db.get_job(api.store, name) is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        query = {"job": name, "order": order}
        after = api.codec.decode(cont, query) if cont else None
        rows = db.list_reshards(api.store, name, limit + 1, after, newest_first=order == "desc")
        return S.ReshardList(items=[_reshard(r) for r in rows[:limit]], metadata=api.page(rows, limit, query))

    @app.get(f"{API}/controller", response_model=S.ControllerStatus, responses=_errors(*READ_ERR),
             dependencies=deps, tags=["controller"])
    def controller_status() -> S.ControllerStatus:
        return _controller_status(api.controller())


def _pool(api: _Api, rec: db.PoolRecord) -> S.Pool:
    alloc = db.current_allocations(api.store, rec.name)
    lease = db.lease_holder(api.store, rec.name, now=_epoch(api.now()))
    try:
        total: int | None = PoolSpec.model_validate(rec.spec).total_gpus
    except ValueError:  # a spec written by a newer version: still list the pool
        total = None
    return S.Pool(name=rec.name, spec=rec.spec, total_gpus=total,
                  allocated_gpus={w: len(a.gpus) for w, a in alloc.items()},
                  leader=lease.owner if lease else None, created_at=rec.created_at, updated_at=rec.updated_at)


def _workload_reads(app: FastAPI, api: _Api, kind: str, lister: Any, getter: Any, deps: list[Any]) -> None:
    what = "inference service" if kind == "services" else "training job"

    @app.get(f"{API}/{kind}", response_model=S.WorkloadList, responses=_errors(*READ_ERR), dependencies=deps,
             tags=[kind], name=f"list_{kind}")
    def list_all(pool: str | None = None) -> S.WorkloadList:
        return S.WorkloadList(items=[_workload(r) for r in lister(api.store, pool)])

    @app.get(f"{API}/{kind}/{{name}}", response_model=S.Workload, responses=_errors(404, *READ_ERR),
             dependencies=deps, tags=[kind], name=f"get_{kind}")
    def get_one(name: Name) -> S.Workload:
        rec = getter(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"{what} '{name}' not found; GET {API}/{kind} lists them")
        return _workload(rec)


def _controller_status(ctl: Any) -> S.ControllerStatus:
    t = ctl.last_tick
    last = None if t is None else S.LastTick(at=_epoch(t.at), acted=t.acted, reason=t.reason, message=t.message,
                                              seconds=t.seconds, error=t.error)
    on_record = dict(getattr(ctl, "intervened", {}))
    overrides = {}
    for s, (r, u) in dict(ctl.overrides).items():
        rec = on_record.get(("override", s))
        overrides[s] = {"replicas": r, "until": _epoch(u).isoformat() if math.isfinite(u) else None,
                        "by": rec.actor if rec else None, "at": rec.at.isoformat() if rec else None}
    pinned = {j: next(iter(tbl.values()))[0] for j, tbl in dict(ctl.pinned).items() if tbl}
    interventions = [S.Intervention(kind=r.kind, target=r.target, value=r.value, by=r.actor, at=r.at, until=r.until)
                     for _, r in sorted(on_record.items())]
    backoff = {j: S.JobBackoff(failures=b.failures, reason=b.reason, next_attempt_at=_epoch(b.next_at))
               for j, b in dict(getattr(ctl, "backoff", {})).items()}
    return S.ControllerStatus(pool=ctl.pool, owner=ctl.owner, leader=bool(ctl.is_leader), paused=bool(ctl.paused),
                              ready=bool(ctl.ready), last_error=ctl.last_error, last_tick=last, overrides=overrides,
                              pinned=pinned, interventions=interventions, backoff=backoff)


def _routes_spec_writes(app: FastAPI, api: _Api) -> None:
    """POST/PUT/DELETE of services and jobs: validate, then write + audit in one transaction."""
    for kind, body_t, checker, upsert, getter, deleter in (
        ("service", S.ServiceWrite, _check_service, db.upsert_service, db.get_service, db.delete_service),
        ("job", S.JobWrite, _check_job, db.upsert_job, db.get_job, db.delete_job),
    ):
        _spec_writes(app, api, kind, body_t, checker, upsert, getter, deleter)


def _spec_writes(app: FastAPI, api: _Api, kind: str, body_t: Any, checker: Any, upsert: Any, getter: Any,
                 deleter: Any) -> None:
    plural = kind + "s"
    what = "inference service" if kind == "service" else "training job"

    def _spec_doc(body: Any) -> dict[str, Any]:
        return body.spec.model_dump(mode="json", by_alias=True)

    def create(body: Any, who: Writer) -> S.Workload:
        name = body.spec.name
        api.specs_writable(kind, name)
        checker(api, body)
        with api.audited(who, f"{kind}.create", f"{kind}/{name}", body.model_dump(mode="json", by_alias=True)) as s:
            if getter(s, name) is not None:
                raise Problem(409, "exists", f"{what} '{name}' already exists; PUT {API}/{plural}/{name} replaces it")
            _name_free(api, s, name, kind)
            rec = upsert(s, name, body.pool, _spec_doc(body))
        return _workload(rec)

    def replace(name: Name, body: Any, who: Writer) -> S.Workload:
        api.specs_writable(kind, name)
        if body.spec.name != name:
            raise invalid("spec.name", f"'{body.spec.name}' differs from the path's '{name}'; renaming is not "
                                       "supported (create the new name, delete the old)")
        api.from_config(kind, name, "replace")
        checker(api, body)
        with api.audited(who, f"{kind}.replace", f"{kind}/{name}", body.model_dump(mode="json", by_alias=True)) as s:
            if getter(s, name) is None:
                raise Problem(404, "not-found", f"{what} '{name}' not found; POST {API}/{plural} creates it")
            rec = upsert(s, name, body.pool, _spec_doc(body))
        return _workload(rec)

    # FastAPI reads the body type from the annotation, which must be the concrete model here
    create.__annotations__["body"] = replace.__annotations__["body"] = body_t
    app.post(f"{API}/{plural}", status_code=201, response_model=S.Workload, responses=_errors(*WRITE_ERR),
             tags=[plural], name=f"create_{kind}")(create)
    app.put(f"{API}/{plural}/{{name}}", response_model=S.Workload, responses=_errors(404, *WRITE_ERR),
            tags=[plural], name=f"replace_{kind}")(replace)

    @app.delete(f"{API}/{plural}/{{name}}", status_code=204, responses=_errors(404, *WRITE_ERR), tags=[plural],
                name=f"delete_{kind}")
    def delete(name: Name, who: Writer) -> Response:
        api.specs_writable(kind, name)
        api.from_config(kind, name, "delete")
        with api.audited(who, f"{kind}.delete", f"{kind}/{name}", {}) as s:
            if not deleter(s, name):
                raise Problem(404, "not-found", f"{what} '{name}' not found")
        return Response(status_code=204)


def _routes_interventions(app: FastAPI, api: _Api) -> None:
    @app.post(f"{API}/jobs/{{name}}/rescale", status_code=202, response_model=S.RescaleResult,
              responses=_errors(404, *WRITE_ERR), tags=["jobs"])
    def rescale(name: Name, body: S.RescaleRequest, who: Writer) -> S.RescaleResult:
        ctl = api.controller()
        rec = db.get_job(api.store, name)
        if rec is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        planned = None if body.layout is None else _feasible(api, rec, body.layout)
        layout = None if planned is None else planned.layout
        with api.serial, _restoring(ctl.pinned, name), _restoring(ctl.intervened, ("pin", name)), \
                api.audited(who, "job.rescale", f"job/{name}", body.model_dump()) as s:
            try:
                ctl.pin_layout(name, layout, actor=who.name, store=s)
            except KeyError:
                raise Problem(409, "not-managed", f"training job '{name}' is not managed by the running controller "
                                                  "(it was added after the controller started); restart it") from None
        if layout is None:
            return S.RescaleResult(job=name, layout=None, world_size=None, tokens_per_second=None,
                                   gpu_memory_bytes=None, message="unpinned; the co-scheduler chooses the layout")
        return S.RescaleResult(job=name, layout=str(layout), world_size=layout.world_size,
                               tokens_per_second=planned.tokens_per_second,
                               gpu_memory_bytes=planned.memory.total,
                               message=f"pinned to {layout}; the controller rescales at its next tick when "
                                       f"{layout.world_size} GPUs are free for it")

    @app.post(f"{API}/jobs/{{name}}/checkpoint", response_model=S.CheckpointResult,
              responses={**_errors(404, *WRITE_ERR, 502, 504), 202: {"model": S.CheckpointResult,
                                                                   "description": "Asked for, not waited for"}},
              tags=["jobs"])
    def checkpoint(name: Name, body: S.CheckpointRequest, who: Writer, response: Response) -> S.CheckpointResult:
        """Save the job's state at its next step boundary (before maintenance, a risky change):
        a sharded checkpoint in its checkpoint directory, as the periodic ones."""
        ctl = api.controller()
        if db.get_job(api.store, name) is None:
            raise Problem(404, "not-found", f"training job '{name}' not found")
        with api.audited(who, "job.checkpoint", f"job/{name}", body.model_dump()):
            pass  # on record before it is asked for; nothing to undo if the audit cannot be written
        try:
            out = ctl.checkpoint_job(name, body.wait_seconds)
        except KeyError:
            raise Problem(409, "not-managed", f"training job '{name}' is not managed by the running controller "
                                              "(it was added after the controller started); restart it") from None
        except SpecError as e:
            raise Problem(409, "no-checkpoint", f"{e}") from None
        except CheckpointNotSaved as e:
            raise Problem(502, "checkpoint-failed", f"{e}") from None
        except BackendError as e:
            raise Problem(409, "not-running", f"{e}") from None
        except TimeoutError as e:
            raise Problem(504, "checkpoint-timeout", f"{e}; it is still taken once allowed: watch the job's "
                                                     "checkpointStep") from None
        if out.step is None:
            response.status_code = 202
            msg = (f"asked for; the next step boundary that allows it saves it (newest complete now: "
                   f"{'step ' + str(out.previous_step) if out.previous_step >= 0 else 'none'})")
        else:
            msg = f"saved at step {out.step} on every rank"
        return S.CheckpointResult(job=name, previous_step=out.previous_step, step=out.step, message=msg)

    @app.put(f"{API}/services/{{name}}/override", response_model=S.Override, responses=_errors(404, *WRITE_ERR),
             tags=["services"])
    def set_override(name: Name, body: S.OverrideRequest, who: Writer) -> S.Override:
        ctl = api.controller()
        spec = _managed_service(api, ctl, name)
        until, now = body.until.timestamp(), api.now()
        if until <= now:
            raise invalid("until", f"{body.until.isoformat()} is not in the future (now {_epoch(now).isoformat()}); "
                                   "give a later RFC 3339 time")
        if not spec.min_replicas <= body.replicas <= spec.max_replicas:
            raise invalid("replicas", f"{body.replicas} is outside [{spec.min_replicas}, {spec.max_replicas}] "
                                      f"(min_replicas, max_replicas) of '{name}'")
        with api.serial, _restoring(ctl.overrides, name), _restoring(ctl.intervened, ("override", name)), \
                api.audited(who, "service.override", f"service/{name}", body.model_dump(mode="json")) as s:
            try:
                ctl.set_override(name, body.replicas, until, actor=who.name, store=s)
            except ValueError as e:
                raise invalid("replicas", str(e)) from None
        return S.Override(service=name, replicas=body.replicas, until=body.until,
                          message=f"'{name}' pinned to {body.replicas} replicas until {body.until.isoformat()}")

    @app.delete(f"{API}/services/{{name}}/override", response_model=S.Override, responses=_errors(404, *WRITE_ERR),
                tags=["services"])
    def clear_override(name: Name, who: Writer) -> S.Override:
        ctl = api.controller()
        _managed_service(api, ctl, name)
        with api.serial, _restoring(ctl.overrides, name), _restoring(ctl.intervened, ("override", name)), \
                api.audited(who, "service.override.clear", f"service/{name}", {}) as s:
            ctl.clear_override(name, store=s)
        return S.Override(service=name, replicas=None, until=None, message="override cleared; the policy decides")

    for verb in ("pause", "resume"):
        _pause_route(app, api, verb)


def _pause_route(app: FastAPI, api: _Api, verb: str) -> None:
    @app.post(f"{API}/controller/{verb}", response_model=S.ControllerStatus, responses=_errors(*WRITE_ERR),
              tags=["controller"], name=f"controller_{verb}")
    def act(who: Writer) -> S.ControllerStatus:
        ctl = api.controller()
        before = ctl.paused
        try:
            with api.serial, _restoring(ctl.intervened, ("pause", ctl.pool)), \
                    api.audited(who, f"controller.{verb}", f"pool/{ctl.pool}", {}) as s:
                ctl.pause(actor=who.name, store=s) if verb == "pause" else ctl.resume(store=s)
        except BaseException:
            ctl.paused = before  # the audit write failed: undo, so the DB and the controller agree
            raise
        return _controller_status(ctl)


@contextmanager
def _restoring(mapping: dict[Any, Any], key: Any) -> Iterator[None]:
    """Put ``mapping[key]`` back as it was if the block fails (e.g. the audit commit)."""
    had, old = key in mapping, mapping.get(key)
    try:
        yield
    except BaseException:
        if had:
            mapping[key] = old
        else:
            mapping.pop(key, None)
        raise


def _managed_service(api: _Api, ctl: Any, name: str) -> InferenceSpec:
    if db.get_service(api.store, name) is None:
        raise Problem(404, "not-found", f"inference service '{name}' not found")
    for s in ctl.cfg.services:
        if s.name == name:
            return s
    raise Problem(409, "not-managed", f"inference service '{name}' is not managed by the running controller "
                                      "(it was added after the controller started); restart it")


def _feasible(api: _Api, rec: db.JobRecord, text: str) -> Any:
    """Validate ``text`` for the job with the planner; 422 naming ``layout`` and the reason otherwise.

    Steps: 1. parse; 2. the job's bounds and allowed degrees; 3. the pool's size; 4. the model's
    structure (``check_layout``) and, for a user job, its mesh (``check_axes``); 5. memory and batch
    (``evaluate``).
    """
    from elastic.parallel.planner import evaluate  # the planner is pure but heavy: import on use

    try:
        layout = Layout.parse(text)
    except SpecError as e:
        raise invalid("layout", str(e)) from None
    job = TrainingSpec.model_validate(rec.spec)
    pool = api.pool_spec(rec.pool, field="pool")
    n = layout.world_size
    if not job.min_gpus <= n <= job.max_gpus:
        raise invalid("layout", f"{layout} uses {n} GPUs, outside the job's [{job.min_gpus}, {job.max_gpus}] "
                                "(min_gpus, max_gpus)")
    if n > pool.total_gpus:
        raise invalid("layout", f"{layout} needs {n} GPUs; pool '{pool.name}' has {pool.total_gpus}")
    for axis, allowed in (("tp", job.allowed_tp), ("pp", job.allowed_pp)):
        if allowed and getattr(layout, axis) not in allowed:
            raise invalid("layout", f"{axis}={getattr(layout, axis)} is not in the job's allowed_{axis} {allowed}")
    try:
        model = _job_model(api, job)
        check_layout(model, layout, pool.gpus_per_node)
        if job.entrypoint is not None:  # the user's mesh: tp, pp, dp only, each axis above 1 named
            from elastic.train.userjob import from_spec

            from_spec(job, model).check_axes(layout)
        planned = evaluate(model, layout, load_hardware(pool.hardware), gpus_per_node=pool.gpus_per_node,
                           global_batch=job.global_batch)
    except SpecError as e:
        raise invalid("layout", str(e)) from None
    if not planned.fits:
        raise invalid("layout", f"{layout} is infeasible on {pool.hardware}: {planned.reason}")
    return planned


def _job_model(api: _Api, job: TrainingSpec) -> Any:
    """The job's model: a preset, a file the controller's config named (trusted, as the controller
    reads it), or else a file inside the model directory."""
    ctl = api.ctl
    if ctl is not None and any(j.name == job.name and j.model == job.model for j in ctl.cfg.jobs):
        return load_model(job.model)
    return _api_model(api, job.model)


def _api_model(api: _Api, name: str) -> Any:
    """A preset, or a .yaml/.json file inside the model directory; nothing else is looked up."""
    if name not in MODEL_PRESETS and Path(name).suffix not in (".yaml", ".yml", ".json"):
        shown = name[:80] + ("..." if len(name) > 80 else "")
        raise SpecError(f"unknown model {shown!r}: use a preset ({', '.join(MODEL_PRESETS)}) or a .yaml/.json "
                        f"file in {api.model_dir}")
    return load_model(name, base_dir=api.model_dir)


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


# ---- factory ----------------------------------------------------------------------------------------------

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
