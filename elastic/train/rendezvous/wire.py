"""HTTP server and client of the coordinator protocol, the job's store, and signing of store entries.

The server also answers the controller's admin route (``/v1/admin/<method>``, see
:mod:`elastic.train.rendezvous.remote`) on the same port, behind the same secret."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import generate_latest

from elastic.model import SpecError
from elastic.train.rendezvous.messages import API, SECRET_ENV, RendezvousError
from elastic.train.rendezvous.remote import ADMIN, admin_desk, answer_admin
from elastic.train.rendezvous.replies import REPLIES, Reply
from elastic.train.rendezvous.requests import BadRequest

if TYPE_CHECKING:
    from elastic.train.rendezvous.coordinator import Coordinator

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Reply)

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a worker killed in the middle of a request resets its connection: the launcher and the
        # heartbeat report the loss; a traceback on stderr would only alarm
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


def _make_handler(coord: Coordinator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The reply goes out as two writes (headers, body); with Nagle on, the body waits for the
        # client's delayed ACK: +40 ms on every request (every training step, every meeting).
        disable_nagle_algorithm = True
        timeout = 300  # an idle kept-alive connection is dropped after this (its client reconnects)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            return

        def _reply(self, code: int, payload: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _authorized(self) -> bool:
            """The job's secret as a bearer token; else 401, and the connection is closed (an unread body)."""
            if hmac.compare_digest(self.headers.get("Authorization", "").encode(), coord._auth):
                return True
            self.close_connection = True
            self._reply(401, b'{"error": "unauthorized: requests to a job\'s coordinator carry its secret as '
                             b'Authorization: Bearer (workers get it as ELASTIC_JOB_SECRET)"}')
            return False

        def _gone(self) -> bool:
            """After ``stop()``: answer nothing on a kept-alive connection, as a closed port would."""
            if coord._closing.is_set():
                self.close_connection = True
                return True
            return False

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self._gone():
                return
            if self.path == "/healthz":  # liveness only: nothing about the job
                self._reply(200, b'{"ok": true}')
                return
            if not self._authorized():
                return
            if self.path == "/metrics":
                self._reply(200, generate_latest(coord.metrics.registry), "text/plain; version=0.0.4")
            elif self.path == f"{API}/status":
                self._reply(200, json.dumps(coord.handle(f"{API}/status", {})).encode())
            else:
                self._reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self._gone() or not self._authorized():
                return
            if self.path.startswith(f"{ADMIN}/"):
                self._admin(self.path.removeprefix(f"{ADMIN}/"))
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError as e:  # not JSON (or not UTF-8): the client's fault, like a bad field
                    raise BadRequest(self.path, None, f"the body is not JSON ({e})") from None
                out = coord.handle(self.path, body)
            except BadRequest as e:  # read at the edge (requests.py): names the route and the field
                self._reply(400, json.dumps({"error": f"bad request: {e}"}).encode())
                return
            except KeyError as e:
                if e.args != (self.path,):  # a handler's bug, not an unknown route
                    log.exception("rendezvous handler %s", self.path)
                    self._reply(500, json.dumps({"error": f"KeyError: {e}"}).encode())
                    return
                self._reply(404, json.dumps({"error": f"no route {self.path}"}).encode())
                return
            except Exception as e:  # noqa: BLE001 - any handler bug is a 500 with its message
                log.exception("rendezvous handler %s", self.path)
                self._reply(500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                return
            self._reply(200, json.dumps(out).encode())

        def _admin(self, method: str) -> None:
            """The controller's call of a coordinator method (``remote.answer_admin``); a long wait
            holds this thread only, and a stop's answer goes out before its host may exit."""
            try:
                n = int(self.headers.get("Content-Length", "0"))
            except ValueError:  # unread body: the connection cannot be reused
                self.close_connection = True
                self._reply(400, b'{"error": {"type": "ValueError", "message": "bad Content-Length", "record": null}}')
                return
            ans = answer_admin(coord, method, self.rfile.read(n))
            self._reply(ans.code, json.dumps(ans.body).encode())
            if ans.ends:
                self.close_connection = True
                admin_desk(coord).ended.set()

    return Handler


# --------------------------------------------------------------------------------------------
# Client (used by the worker agent)
# --------------------------------------------------------------------------------------------


class RendezvousClient:
    """JSON calls to a :class:`Coordinator`. Retries connection errors for up to ``retry_s``.

    Keeps one HTTP/1.1 connection open across calls (a worker asks before every step: a new
    TCP connection, and a new server thread, per step costs more than the answer), and
    reconnects transparently when the coordinator closed it. Thread-safe (one call at a time).
    """

    def __init__(self, url: str, worker: str, *, timeout_s: float = 10.0, retry_s: float = 30.0,
                 secret: str | None = None) -> None:
        self.url = url.rstrip("/")
        # None: the job's secret from the environment, as the launcher hands it to workers
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
        self._headers = {"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {self.secret}"} if self.secret else {})}
        self.worker = worker
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise SpecError(f"rendezvous URL {url!r}: expected http://HOST:PORT")
        self._host, self._port = parts.hostname, parts.port or 80
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def call(self, route: str, **body: Any) -> dict[str, Any]:
        """POST ``body`` (plus this worker's id) to ``route``; a long poll (``wait_s``) extends the read timeout."""
        data = json.dumps({"worker": self.worker, **body}).encode()
        timeout = self.timeout_s + float(body.get("wait_s") or 0.0)
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        with self._lock:
            while True:
                try:
                    status, payload = self._post(f"{API}/{route}", data, timeout)
                except (ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
                    self._close()
                    if time.monotonic() + delay > deadline:
                        raise RendezvousError(f"coordinator {self.url} unreachable for {self.retry_s:g} s "
                                              f"({route}): {e}") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                if status != 200:
                    raise RendezvousError(f"coordinator {self.url} {route}: HTTP {status} {payload[:300]!r}")
                return json.loads(payload or b"{}")

    def ask(self, route: str, kind: type[R], **body: Any) -> R:
        """:meth:`call`, with the answer read as ``kind``, the type ``route`` answers with
        (:data:`~elastic.train.rendezvous.replies.REPLIES`); BadReply (naming the field) when it
        does not read."""
        if REPLIES.get(route) is not kind:
            raise TypeError(f"{route} answers with {REPLIES.get(route)}, not {kind.__name__}")
        return kind.from_wire(self.call(route, **body), route)

    def _post(self, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        fresh = self._conn is None
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            try:
                self._conn.request("POST", path, body=data, headers=self._headers)
                r = self._conn.getresponse()
                return r.status, r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # a kept-alive connection the server closed meanwhile: one retry on a new one
                self._close()
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def status(self) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{API}/status", headers=self._headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())


def _bound_store(host: str) -> Any:
    """The job's TCPStore master listening on ``host`` only: torch's own would listen on every
    interface whatever host it is given, so it gets a socket bound here (and owns it from then)."""
    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


def sign(secret: str | None, payload: bytes) -> bytes:
    """``payload`` with an HMAC-SHA256 of it under the job's secret in front (for the store)."""
    if not secret:
        raise RendezvousError(f"no job secret to sign with: {SECRET_ENV} is not set")
    return hmac.new(secret.encode(), payload, hashlib.sha256).digest() + payload


def verify(secret: str | None, signed: bytes, what: str) -> bytes:
    """The payload of :func:`sign`'s output; RendezvousError when the signature does not match
    (written by someone without the secret: never unpickled)."""
    if not secret:
        raise RendezvousError(f"no job secret to check {what} with: {SECRET_ENV} is not set")
    mac, payload = signed[:32], signed[32:]
    if len(signed) < 32 or not hmac.compare_digest(mac, hmac.new(secret.encode(), payload, hashlib.sha256).digest()):
        raise RendezvousError(f"{what} in the job's store fails its signature check: not written by a member "
                              "of this job; refusing to read it")
    return payload
