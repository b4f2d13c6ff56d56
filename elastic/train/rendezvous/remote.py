"""A job's coordinator driven over HTTP: the admin route it answers, and the client a launcher uses.

What it is for: a coordinator that lives in a process of its own (:mod:`elastic.train.rendezvous.host`,
one pod per job on Kubernetes) outlives the controller that started it; a restarted controller
re-attaches to it by URL. :class:`CoordinatorClient` has the methods, arguments and return types of
the in-process :class:`~elastic.train.rendezvous.Coordinator` that a
:class:`~elastic.train.launch.JobHandle` calls, so a handle given one (``coordinator=``) drives
a remote job exactly as a local one. Each call is ``POST /v1/admin/<method>`` on the coordinator's
own port (workers and the controller share it), carrying the job's secret like every worker
request; :func:`answer_admin` answers it on the coordinator, from a closed list of methods
(:data:`ADMIN_METHODS`).

On the wire: arguments are the method's keyword arguments as a JSON object, a result is
``{"result": ...}`` (records by their ``to_json``), an error is ``{"error": {"type", "message",
"record"}}`` and the client raises the same class for a closed set of them (:data:`_ERRORS`:
what a caller of the coordinator catches); anything else arrives as ``RuntimeError("Type: message")``.

Beside the coordinator the admin route keeps a small JSON dict for the backend (``get_meta`` /
``update_meta``: which GPUs the workers hold, ...), in memory, as Ray's coordinator actor does.

What it must not do: decide anything (the coordinator does) or keep job state of its own beyond
that dict.
"""

from __future__ import annotations

import http.client
import inspect
import json
import logging
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.model import Layout, SpecError
from elastic.train.rendezvous.messages import (
    API,
    CheckpointFailed,
    Directive,
    JobFailed,
    JobStatus,
    RendezvousError,
    RescaleCancelled,
    RescaleFailed,
    RescaleRecord,
    StepRecord,
)

if TYPE_CHECKING:
    from elastic.train.rendezvous.coordinator import Coordinator

log = logging.getLogger(__name__)

ADMIN = f"{API}/admin"
"""The admin route's prefix: ``POST /v1/admin/<method>``."""

ADMIN_METHODS = (
    "check_directive",
    "directive",
    "fail",
    "get_meta",
    "has_left",
    "history",
    "lost_workers",
    "registered",
    "request_checkpoint",
    "request_stop",
    "rescale_record",
    "status",
    "stop",
    "update_meta",
    "wait_checkpoint",
    "wait_generation",
    "wait_phase",
    "wait_resumed",
    "wait_step",
    "worker_left",
    "worker_lost",
)
"""What the admin route answers: the coordinator's controller API, plus the backend's meta."""

# The errors that cross the wire as themselves, most specific first (a subclass of one, e.g. a
# checkpoint's SpecError, arrives as the class its caller catches).
_ERRORS: tuple[type[BaseException], ...] = (
    RescaleCancelled,
    RescaleFailed,
    JobFailed,
    CheckpointFailed,
    SpecError,
    TimeoutError,
    KeyError,
    ValueError,
)
_ERROR_BY_NAME = {e.__name__: e for e in _ERRORS}

# ---------------------------------------------------------------------------------------------
# Server side (on the coordinator's HTTP threads)
# ---------------------------------------------------------------------------------------------


@dataclass
class AdminDesk:
    """What the admin route keeps beside one coordinator."""

    meta: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # set once an admin ``stop`` has been answered (or the host was told to end): its process may exit
    ended: threading.Event = field(default_factory=threading.Event)


_DESKS: weakref.WeakKeyDictionary[Any, AdminDesk] = weakref.WeakKeyDictionary()
_DESKS_LOCK = threading.Lock()


def admin_desk(coord: Coordinator) -> AdminDesk:
    """``coord``'s desk (made on first use)."""
    with _DESKS_LOCK:
        desk = _DESKS.get(coord)
        if desk is None:
            desk = _DESKS[coord] = AdminDesk()
        return desk


@dataclass(frozen=True)
class AdminAnswer:
    """One admin call's HTTP status and JSON body; ``ends``: the coordinator stopped, and its
    host may exit once this answer went out."""

    code: int
    body: dict[str, Any]
    ends: bool = False


def answer_admin(coord: Coordinator, method: str, raw: bytes) -> AdminAnswer:
    """The answer to ``POST /v1/admin/<method>`` with body ``raw`` (the keyword arguments as JSON).

    404 for a method not in :data:`ADMIN_METHODS`, 400 for a body or arguments that do not fit
    the method, 409 for an error the caller handles (:data:`_ERRORS`: refused, failed, timed out),
    500 for anything else. ``stop`` stops the coordinator and answers its final status and
    history (its host exits after; a caller reads them from the answer)."""
    if method not in ADMIN_METHODS:
        return _error(
            404, "KeyError", f"no admin method {method!r}; the allowed ones: {', '.join(ADMIN_METHODS)}"
        )
    try:
        kw = json.loads(raw or b"{}")
    except ValueError as e:  # not JSON, or not UTF-8
        return _error(400, "ValueError", f"admin {method}: the body is not JSON ({e})")
    if not isinstance(kw, dict):
        return _error(
            400, "ValueError", f"admin {method}: the body must be a JSON object of keyword arguments"
        )
    desk = admin_desk(coord)
    try:
        if method == "get_meta":
            with desk.lock:
                return AdminAnswer(200, {"result": json.loads(json.dumps(desk.meta))})
        if method == "update_meta":
            with desk.lock:
                desk.meta.update(kw)
            return AdminAnswer(200, {"result": None})
        fn: Callable[..., Any] = getattr(coord, method)
        try:
            inspect.signature(fn).bind(**kw)
        except TypeError as e:
            return _error(400, "ValueError", f"admin {method}{inspect.signature(fn)}: {e}")
        if method == "stop":
            fn()
            final = {"status": coord.status().to_json(), "history": [r.to_json() for r in coord.history()]}
            return AdminAnswer(200, {"result": final}, ends=True)
        return AdminAnswer(200, {"result": _encode(fn(**kw))})
    except _ERRORS as e:
        return AdminAnswer(409, {"error": _error_doc(e)})
    except Exception as e:  # noqa: BLE001 - a bug: the caller gets its type and message
        log.exception("job %s: admin %s", coord.job, method)
        return AdminAnswer(500, {"error": _error_doc(e)})


def _error(code: int, kind: str, message: str) -> AdminAnswer:
    return AdminAnswer(code, {"error": {"type": kind, "message": message, "record": None}})


def _error_doc(e: BaseException) -> dict[str, Any]:
    kind = next((k.__name__ for k in _ERRORS if isinstance(e, k)), type(e).__name__)
    # a KeyError's str() is its key quoted; its argument is the message
    message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    record = getattr(e, "record", None)
    return {
        "type": kind,
        "message": message,
        "record": record.to_json() if isinstance(record, RescaleRecord) else None,
    }


def _encode(x: Any) -> Any:
    if hasattr(x, "to_json"):
        return x.to_json()
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode_error(doc: Any, code: int) -> BaseException:
    """The exception an error answer stands for (the same class for the closed set)."""
    if not isinstance(doc, Mapping):
        return RendezvousError(f"HTTP {code}: {doc!r:.300}")
    kind, message = str(doc.get("type", "")), str(doc.get("message", ""))
    cls = _ERROR_BY_NAME.get(kind)
    if cls is None:
        return RuntimeError(f"{kind}: {message}")
    if issubclass(cls, RescaleFailed):
        rec = doc.get("record")
        return cls(message, RescaleRecord.from_json(rec) if rec is not None else None)
    return cls(message)


# ---------------------------------------------------------------------------------------------
# Client side (the launcher's)
# ---------------------------------------------------------------------------------------------

LONG_WAIT_SLACK_S = 30.0
"""A long wait's HTTP read timeout is the wait's own timeout plus this."""


class CoordinatorClient:
    """A remote job's coordinator, with the methods a :class:`~elastic.train.launch.JobHandle`
    calls on an in-process one (same arguments, same return types, same exceptions).

    An unreachable coordinator (connection refused or reset) is retried for ``retry_s``, then
    raises :class:`JobFailed` naming it. Thread-safe: each thread keeps a connection of its own
    (the launcher's watcher polls while a rescale waits). After :meth:`stop` the host is gone:
    ``status()`` and ``history()`` answer what it answered last, at its stop; any other call
    raises :class:`JobFailed` at once.
    """

    def __init__(
        self, url: str, secret: str, job: str, *, timeout_s: float = 30.0, retry_s: float = 5.0
    ) -> None:
        self.url = url.rstrip("/")
        self.secret = secret
        self.job = job
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise SpecError(f"coordinator URL {url!r}: expected http://HOST:PORT")
        self._host, self._port = parts.hostname, parts.port or 80
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
        self._local = threading.local()
        self._final: tuple[JobStatus, list[StepRecord]] | None = None

    def __repr__(self) -> str:  # never the secret
        return f"CoordinatorClient({self.url!r}, job={self.job!r})"

    # ---- plumbing ------------------------------------------------------------------------------
    def call(
        self, method: str, args: Mapping[str, Any] | None = None, *, read_timeout: float | None = None
    ) -> Any:
        """POST ``args`` (keyword arguments) to the admin ``method``; its ``result`` as JSON, or its error raised."""
        if self._final is not None:  # the host has exited: no retrying a port nobody will open again
            raise JobFailed(
                f"job {self.job}: its coordinator at {self.url} was stopped ({method} after stop)"
            )
        data = json.dumps(dict(args or {})).encode()
        timeout = read_timeout if read_timeout is not None else self.timeout_s
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                code, payload = self._post(f"{ADMIN}/{method}", data, timeout)
                break
            except TimeoutError as e:  # connected, but no answer in time: the host hangs
                self._close()
                raise JobFailed(
                    f"job {self.job}: its coordinator at {self.url} is unreachable (no answer to "
                    f"{method} within {timeout:g} s: {e})"
                ) from None
            except (OSError, http.client.HTTPException) as e:
                self._close()
                if time.monotonic() + delay > deadline:
                    raise JobFailed(
                        f"job {self.job}: its coordinator at {self.url} is unreachable ({method}: "
                        f"{type(e).__name__}: {e}; retried for {self.retry_s:g} s)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        if code == 401:
            raise RendezvousError(
                f"job {self.job}: its coordinator at {self.url} refused the secret (HTTP 401); "
                "give the client the job's secret"
            )
        try:
            doc = json.loads(payload or b"{}")
        except ValueError:
            raise RendezvousError(
                f"job {self.job}: coordinator {self.url} {method}: HTTP {code} {payload[:300]!r}"
            ) from None
        if code == 200 and isinstance(doc, dict) and "result" in doc:
            return doc["result"]
        raise _decode_error(doc.get("error") if isinstance(doc, dict) else doc, code)

    def _post(self, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        fresh = conn is None
        for attempt in (0, 1):
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request("POST", path, body=data, headers=self._headers)
                r = conn.getresponse()
                return r.status, r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # a kept-alive connection the server closed meanwhile (idle): one retry on a new one
                self._close()
                conn = None
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    def _close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def ready(self, timeout: float) -> None:
        """Wait until the coordinator answers ``/healthz``; TimeoutError naming its URL after ``timeout``."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=max(0.1, min(2.0, timeout)))
            try:
                conn.request("GET", "/healthz")
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            finally:
                conn.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {self.job}: its coordinator at {self.url} did not answer /healthz within "
                    f"{timeout:g} s ({last})"
                )
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _wait(self, method: str, timeout: float, **kw: Any) -> Any:
        return self.call(method, {**kw, "timeout": timeout}, read_timeout=timeout + LONG_WAIT_SLACK_S)

    # ---- the Coordinator's controller API -----------------------------------------------------
    def start(self) -> CoordinatorClient:
        return self  # the host started serving when it started

    def directive(
        self, generation: int, layout: Layout | str, members: Sequence[str], **kw: Any
    ) -> Directive:
        return Directive.from_json(
            self.call(
                "directive",
                {"generation": generation, "layout": str(layout), "members": [str(m) for m in members], **kw},
            )
        )

    def check_directive(self, generation: int) -> None:
        self.call("check_directive", {"generation": generation})

    def wait_generation(self, generation: int, timeout: float) -> RescaleRecord:
        return RescaleRecord.from_json(self._wait("wait_generation", timeout, generation=generation))

    def wait_resumed(self, generation: int, timeout: float) -> RescaleRecord:
        return RescaleRecord.from_json(self._wait("wait_resumed", timeout, generation=generation))

    def wait_step(self, step: int, timeout: float) -> StepRecord:
        return StepRecord.from_json(self._wait("wait_step", timeout, step=step))

    def wait_checkpoint(self, ticket: tuple[int, int], timeout: float) -> int:
        return int(self._wait("wait_checkpoint", timeout, ticket=list(ticket)))

    def wait_phase(self, phases: Sequence[str], timeout: float) -> str:
        return str(self._wait("wait_phase", timeout, phases=list(phases)))

    def request_checkpoint(self) -> tuple[int, int]:
        after, failures = self.call("request_checkpoint")
        return int(after), int(failures)

    def status(self) -> JobStatus:
        if self._final is not None:
            return self._final[0]
        return JobStatus.from_json(self.call("status"))

    def history(self) -> list[StepRecord]:
        if self._final is not None:
            return list(self._final[1])
        return [StepRecord.from_json(r) for r in self.call("history")]

    def rescale_record(self, generation: int) -> RescaleRecord | None:
        rec = self.call("rescale_record", {"generation": generation})
        return RescaleRecord.from_json(rec) if rec is not None else None

    def registered(self, worker: str) -> bool:
        return bool(self.call("registered", {"worker": worker}))

    def has_left(self, worker: str) -> bool:
        return bool(self.call("has_left", {"worker": worker}))

    def lost_workers(self) -> list[str]:
        return [str(w) for w in self.call("lost_workers")]

    def worker_lost(self, worker: str, reason: str) -> None:
        self.call("worker_lost", {"worker": worker, "reason": reason})

    def worker_left(self, worker: str) -> None:
        self.call("worker_left", {"worker": worker})

    def fail(self, reason: str) -> None:
        self.call("fail", {"reason": reason})

    def request_stop(self, reason: str = "stopped by the controller") -> None:
        self.call("request_stop", {"reason": reason})

    def stop(self) -> None:
        """Stop the remote coordinator (its host then exits 0); its final status and history stay
        readable here. Again: nothing."""
        if self._final is not None:
            return
        final = self.call("stop")
        self._final = (
            JobStatus.from_json(final["status"]),
            [StepRecord.from_json(r) for r in final["history"]],
        )
        self._close()

    # ---- the backend's meta ----------------------------------------------------------------------
    def get_meta(self) -> dict[str, Any]:
        return dict(self.call("get_meta"))

    def update_meta(self, **kw: Any) -> None:
        self.call("update_meta", kw)
