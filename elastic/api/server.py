"""Run the admin API with uvicorn in a background thread (for ``elastic serve``, the demo, tests).

What it is for: ``serve_api(app, host, port)`` binds the socket *before* returning (so a
port in use fails in the caller with a clear error, and ``port=0`` yields the real port),
starts uvicorn on it in a daemon thread, waits until it accepts requests, and hands back
``(server, thread)``; ``server.stop()`` shuts it down gracefully.

What it must not do: install signal handlers (uvicorn skips them outside the main thread)
or own the process's lifetime; the caller decides when to stop.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from elastic.model import SpecError

START_TIMEOUT_S = 15.0


class ApiServer(uvicorn.Server):
    """A uvicorn server that knows its bound address and can be stopped from another thread."""

    sock: socket.socket
    thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.sock.getsockname()[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Finish in-flight requests (up to ``timeout``) and stop; idempotent."""
        self.should_exit = True
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
            if self.thread.is_alive():
                self.force_exit = True
                self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only for sockets
    # that say so, and without it Nagle + delayed ACKs add ~40 ms to every keep-alive response
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecError(f"admin API: cannot listen on {host}:{port} ({e.strerror}); pick another --api-port "
                        "or stop what holds it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_api(app: object, host: str = "127.0.0.1", port: int = 8080, *, log_level: str = "warning",
              access_log: bool = False) -> tuple[ApiServer, threading.Thread]:
    """Start ``app`` on ``host:port`` in a daemon thread; returns once it serves.

    Steps: 1. bind (errors here, in the caller); 2. run uvicorn on that socket in a
    thread; 3. wait for ``started`` (or the thread's death, reported with its reason).
    """
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                            timeout_graceful_shutdown=5, server_header=False)
    server = ApiServer(config)
    server.sock = sock
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"elastic-api:{server.port}",
                              daemon=True)
    server.thread = thread
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError(f"admin API on {host}:{port} exited during start-up; see the log above")
        if time.monotonic() > deadline:
            server.stop(1.0)
            raise RuntimeError(f"admin API on {host}:{port} did not start within {START_TIMEOUT_S:.0f}s")
        time.sleep(0.01)
    return server, thread
