"""The admin API's ASGI middleware and the dependencies that read who is asking.

``AuthGate`` authenticates ``/api/v1`` requests before routing and body parsing, ``BodyLimit``
refuses a body over the limit before it is read whole, ``AllowHeader`` makes a 405 name every
method of the path. ``principal`` and ``reader`` document the bearer scheme in OpenAPI and hand
the gate's principal to a write.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elastic.api.auth import Principal, TokenSet
from elastic.api.context import API, WRITE_METHODS
from elastic.api.problems import Problem, log_refusal, problem_response


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
