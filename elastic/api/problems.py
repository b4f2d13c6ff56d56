"""RFC 9457 problem details (``application/problem+json``) for every error the API returns.

What it is for: one exception type (``Problem``) that handlers raise, and the exception
handlers that turn it, FastAPI's request validation errors, Starlette's HTTP errors,
store failures and unexpected crashes into the same JSON shape::

    {"type": "urn:elastic:problem:validation", "title": "Invalid request", "status": 422,
     "detail": "spec.min_replicas: Input should be greater than or equal to 0",
     "field": "spec.min_replicas", "errors": [{"field": ..., "message": ...}]}

What it must not do: leak internals. An unexpected exception becomes a 500 whose detail
says to read the server log; the traceback goes to the log only.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elastic.store import NotFound, StoreError, StoreUnavailable
from elastic.store.engine import first_line

log = logging.getLogger("elastic.api")

PROBLEM_JSON = "application/problem+json"
_PREFIX = "urn:elastic:problem:"

_TITLES = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found",
           405: "Method not allowed", 409: "Conflict", 413: "Content too large", 415: "Unsupported media type",
           422: "Invalid request",
           500: "Internal server error", 502: "Bad gateway", 503: "Service unavailable", 504: "Gateway timeout"}


class FieldError(BaseModel):
    field: str = Field(description="dotted path of the offending field, e.g. 'spec.min_replicas' or 'query.limit'")
    message: str


class ProblemDetail(BaseModel):
    """The body of every error response (RFC 9457)."""

    type: str = Field(description="URI naming the kind of problem, e.g. urn:elastic:problem:validation")
    title: str
    status: int
    detail: str = Field(description="what went wrong and how to fix it, in one line")
    field: str | None = Field(default=None, description="the first offending field, for validation errors")
    errors: list[FieldError] | None = None


MAX_DETAIL = 1000  # characters of a problem's detail (a message quoting a bad value stops here)


class Problem(Exception):  # noqa: N818 - the RFC's name for it
    """Raise to answer with a problem+json response."""

    def __init__(self, status: int, slug: str, detail: str, *, field: str | None = None,
                 title: str | None = None, headers: dict[str, str] | None = None,
                 errors: list[FieldError] | None = None) -> None:
        if len(detail) > MAX_DETAIL:  # a huge bad value is never echoed back whole
            detail = f"{detail[:MAX_DETAIL]}... ({len(detail) - MAX_DETAIL} more characters)"
        super().__init__(detail)
        self.status, self.slug, self.detail, self.field = status, slug, detail, field
        self.errors = errors
        self.title = title or _TITLES.get(status, "Error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": _PREFIX + self.slug, "title": self.title, "status": self.status,
                               "detail": self.detail}
        if self.field is not None:
            out["field"] = self.field
            errors = self.errors or [FieldError(field=self.field, message=self.detail)]
            out["errors"] = [e.model_dump() for e in errors]
        return out


def invalid(field: str, message: str, status: int = 422) -> Problem:
    """A validation problem naming ``field`` (the message is prefixed with it)."""
    return Problem(status, "validation", f"{field}: {message}", field=field)


def problem_response(p: Problem) -> JSONResponse:
    return JSONResponse(p.body(), status_code=p.status, media_type=PROBLEM_JSON, headers=p.headers)


# ---- validation errors -----------------------------------------------------------------------

def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``('body', 'spec', 'min_replicas')`` -> ``spec.min_replicas``; ``('query', 'limit')`` stays
    ``query.limit``; list indices become ``[i]``."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "body"


def _message(err: dict[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field; remove it (see /openapi.json for the accepted fields)"
    if kind == "missing":
        return "field required"
    msg = str(err.get("msg", "invalid value"))
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


def _field_error(err: dict[str, Any]) -> FieldError:
    """A check across a spec's fields that names its field in ``ctx["field"]`` (``TrainingSpec``'s
    user-job rules) is reported at that field, ``spec.checkpoint``, not at ``spec``."""
    path, message = _field_path(err.get("loc", ())), _message(err)
    named = (err.get("ctx") or {}).get("field")
    if isinstance(named, str) and named:
        path = named if path == "body" else f"{path}.{named}"
        message = message.removeprefix(f"{named}: ")
    return FieldError(field=path, message=message)


def validation_problem(errors: list[dict[str, Any]]) -> Problem:
    """One problem for pydantic/FastAPI errors; malformed JSON is a 400, the rest 422."""
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        where = e.get("loc", ("body", 0))
        pos = where[1] if len(where) > 1 else 0
        reason = (e.get("ctx") or {}).get("error", "invalid JSON")
        return Problem(400, "malformed-json", f"body: malformed JSON at character {pos}: {reason}", field="body")
    items = [_field_error(e) for e in errors]
    detail = "; ".join(f"{i.field}: {i.message}" for i in items[:5])
    if len(items) > 5:
        detail += f"; and {len(items) - 5} more"
    return Problem(422, "validation", detail, field=items[0].field if items else "body", errors=items)


def log_refusal(method: str, path: str, p: Problem) -> None:
    """One INFO line for a refused write (what was asked and why not); reads at DEBUG."""
    if 400 <= p.status < 500:
        write = method in ("POST", "PUT", "PATCH", "DELETE")
        (log.info if write else log.debug)("refused %s %s: %d %s", method, path, p.status, p.detail)


# ---- handlers ----------------------------------------------------------------------------------

def install(app: FastAPI) -> None:
    """Register the handlers that make every error problem+json."""

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        log_refusal(request.method, request.url.path, exc)
        return problem_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        ctype = request.headers.get("content-type", "")
        body_error = any(tuple(e.get("loc", ()))[:1] == ("body",) for e in errors)
        if body_error and "json" not in ctype.lower():
            p = Problem(415, "unsupported-media-type", "body: send a JSON body with "
                        f"'Content-Type: application/json' (got '{ctype or 'none'}')", field="body")
        else:
            p = validation_problem(errors)
        log_refusal(request.method, request.url.path, p)
        return problem_response(p)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http")
        return problem_response(Problem(exc.status_code, slug, detail, headers=dict(exc.headers or {})))

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return problem_response(Problem(503, "store-unavailable", f"the state database is unavailable: {exc}",
                                        headers={"Retry-After": "5"}))

    @app.exception_handler(NotFound)
    async def _missing(_: Request, exc: NotFound) -> JSONResponse:
        return problem_response(Problem(404, "not-found", str(exc)))

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        return problem_response(Problem(409, "store-conflict", str(exc)))

    @app.exception_handler(SQLAlchemyError)
    async def _db(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        # e.g. a table missing because migrations were not run: the DB is not usable as is
        log.error("database error on %s %s: %s", request.method, request.url.path, first_line(exc))
        return problem_response(Problem(503, "store-unavailable", f"the state database refused the request "
                                        f"({first_line(exc)}); check that 'elastic db upgrade' ran",
                                        headers={"Retry-After": "5"}))

    app.add_middleware(CatchAll)


class CatchAll:
    """Innermost ASGI middleware: an unexpected exception becomes a 500 problem (traceback to the log).

    Starlette's own ``Exception`` handler answers and then re-raises, and uvicorn drops the
    keep-alive connection; catching here keeps the connection and the response shape.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: answer, log, keep serving
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            p = Problem(500, "internal", f"internal error ({type(exc).__name__}); see the server log")
            await problem_response(p)(scope, receive, send)
