"""Warm starts for local worker processes: fork each one from a process that has imported torch.

A training worker spends seconds of CPU importing torch and the trainer before it does anything;
on a host that starts many of them (a single-host job, its joiners, a test suite) that import is
most of what starting one costs. A *warm starter* is one ``python -m elastic.train.warm``
process per launcher that imports the heavy modules once and then forks a child for each worker
the launcher asks for: the child sets the worker's environment, working directory and log file,
starts a session of its own and runs the module as ``python -m`` would.

What a fork cannot change is settled when the starter starts: the variables the C libraries and
the interpreter read at process start (``LD_*``, ``PYTHON*``, ``GLIBC_*``, ``MALLOC_*``,
``OMP_*``, ``MKL_*``, ``KMP_*``, ``THP_*``, ``TORCH_*``). A launcher keeps one starter per
distinct set of those values, so a worker always runs with the environment it was given.

The starter is single-threaded (a fork from a process with threads can inherit a held lock),
reaps its children and reports each exit status to the launcher, so a
:class:`WarmProcess` answers ``poll``/``wait``/``kill`` as a :class:`subprocess.Popen` does.
When the launcher exits, its starters see their input close and exit; their children go on,
as ``start_new_session`` children of the launcher would. A child's command line (``ps -f``) is
its starter's, ``python -m elastic.train.warm ...``; its process name (``ps -o comm``, ``top``)
is its module's last part, e.g. ``worker``.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

WORKER_PRELOAD = ("torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "elastic.train.worker",
                  "elastic.train.engine", "elastic.torch.run")
"""What a worker starter imports before it forks: what every training worker imports, the
reference trainer's and a user job's (``elastic.torch``), and what autograd imports on the first
``backward`` given output gradients (a pipeline stage's): sympy, half a second of CPU."""

START_TIMEOUT_S = 120.0
"""How long a starter may take to import its modules (a cold disk cache can take tens of seconds)."""

_BOUND_AT_START = ("LD_", "PYTHON", "GLIBC_", "MALLOC_", "OMP_", "MKL_", "KMP_", "THP_", "TORCH_")
"""Prefixes of the variables a fork cannot change (read by the loader, libc, OpenMP or torch
when the process starts or imports torch): they key the starter."""

LOST_STATUS = 255
"""A worker's exit status when its starter died before it could report it."""


class WarmStartError(RuntimeError):
    """The starter could not start or fork (the caller may start the process cold instead)."""


def start_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a forked child inherits from its starter instead of setting it."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_BOUND_AT_START)))


class WarmProcess:
    """A child of a starter, driven like a :class:`subprocess.Popen`."""

    def __init__(self, starter: WarmStarter, pid: int, args: list[str]) -> None:
        self._starter = starter
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._starter._check_orphan(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._starter._cond:
            while self.returncode is None:
                self._starter._check_orphan(self)
                if self.returncode is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._starter._cond.wait(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return  # never signal a pid that may have been reused
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """One ``python -m elastic.train.warm`` process, started with ``env``, that has imported ``preload``."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.preload = tuple(preload)
        self.key = start_key(env)
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # one request on the pipe at a time
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits heard before the start reply was handled
        self._next = 0
        self._ready = False
        self.dead = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.train.warm", *self.preload], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=dict(env), start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="warm-starter", daemon=True)
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self.dead, START_TIMEOUT_S):
                self.close()
                raise WarmStartError(f"the warm starter did not import {', '.join(self.preload)} "
                                     f"in {START_TIMEOUT_S:.0f} s")
            if self.dead:
                raise WarmStartError(f"the warm starter exited while importing {', '.join(self.preload)} "
                                     f"(exit code {self.proc.wait()}; its stderr is this process's)")

    def start(self, module: str, args: Sequence[str], *, env: Mapping[str, str], cwd: str | None = None,
              log_path: str | None = None) -> WarmProcess:
        """Fork ``python -m module *args`` with exactly ``env`` in ``cwd``; stdout and stderr appended to
        ``log_path`` (discarded when None)."""
        if start_key(env) != self.key:
            raise WarmStartError("the environment differs from the starter's in variables bound at start")
        req: dict[str, Any] = {"argv": [module, *args], "env": dict(env), "cwd": cwd or os.getcwd(),
                               "log": log_path}
        with self._lock:
            if self.dead:
                raise WarmStartError("the warm starter is gone")
            self._next += 1
            rid = req["id"] = self._next
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError as e:
                raise WarmStartError(f"the warm starter is gone: {e}") from None
            with self._cond:
                if not self._cond.wait_for(lambda: rid in self._replies or self.dead, 30.0):
                    self.dead = True  # wedged: the next start gets a new starter
                    threading.Thread(target=self.close, daemon=True).start()
                    raise WarmStartError("the warm starter did not answer a start in 30 s")
                reply = self._replies.pop(rid, None)
                if reply is None:
                    raise WarmStartError("the warm starter exited during a start")
                if "error" in reply:
                    raise WarmStartError(f"the warm starter could not fork: {reply['error']}")
                p = WarmProcess(self, int(reply["pid"]), ["python", "-m", module, *args])
                self._children[p.pid] = p
                if p.pid in self._early:
                    p.returncode = self._early.pop(p.pid)
        return p

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is not None:
                        child.returncode = code
                    else:
                        self._early[pid] = code
                elif "id" in msg:
                    self._replies[int(msg["id"])] = msg
                self._cond.notify_all()
        with self._cond:
            self.dead = True
            self._cond.notify_all()

    def _check_orphan(self, p: WarmProcess) -> None:
        """A child whose starter is gone: its status is lost; whether it still runs is not."""
        if not self.dead or p.returncode is not None:
            return
        try:
            os.kill(p.pid, 0)
        except ProcessLookupError:
            p.returncode = LOST_STATUS
            return
        except PermissionError:
            return
        try:  # an orphan that exited stays a zombie until whoever adopted it reaps it
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except (OSError, IndexError):
            return
        if zombie:
            p.returncode = LOST_STATUS

    def close(self) -> None:
        """End the starter (its children go on)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_starters: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], WarmStarter] = {}
_starters_lock = threading.Lock()


def start_module(module: str, args: Sequence[str] = (), *, env: Mapping[str, str], cwd: str | None = None,
                 log_path: str | None = None, preload: Sequence[str] = WORKER_PRELOAD) -> WarmProcess:
    """``python -m module *args`` forked from this process's starter for ``env`` (started on first use,
    and again if it died). Raises :class:`WarmStartError` when no starter can start it."""
    key = (tuple(preload), start_key(env))
    with _starters_lock:
        s = _starters.get(key)
        if s is None or s.dead:
            s = WarmStarter(preload, env)
            _starters[key] = s
    return s.start(module, args, env=env, cwd=cwd, log_path=log_path)


@atexit.register
def _close_all() -> None:
    with _starters_lock:
        for s in _starters.values():
            s.close()
        _starters.clear()


# --------------------------------------------------------------------------------------------
# the starter process
# --------------------------------------------------------------------------------------------


def _serve(preload: Sequence[str]) -> int:
    import importlib

    out = os.dup(1)  # replies go here; a stray print must not land in the protocol
    os.dup2(2, 1)
    for m in preload:
        importlib.import_module(m)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)

    def reply(msg: dict[str, Any]) -> None:
        os.write(out, json.dumps(msg).encode() + b"\n")

    reply({"ready": os.getpid()})
    buf = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _reap(reply)
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return 0  # the launcher is gone: its children are on their own
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                try:
                    pid = _fork(req, (out, wake_r, wake_w))
                except OSError as e:
                    reply({"id": req["id"], "error": str(e)})
                else:
                    reply({"id": req["id"], "pid": pid})


def _reap(reply: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


class _Child(BaseException):
    """Raised in a freshly forked child: unwinds the starter's loop, so the child runs its module
    from the top of the stack and ends as an interpreter does (non-daemon threads joined, atexit
    handlers run, an uncaught exception printed with exit code 1)."""

    def __init__(self, req: dict[str, Any]) -> None:
        super().__init__()
        self.req = req


def _fork(req: dict[str, Any], close: tuple[int, ...]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        logfd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if req["log"] else null
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
    except BaseException:  # noqa: BLE001 - a child that cannot be set up must not return into the loop
        import traceback

        traceback.print_exc()
        os._exit(1)
    raise _Child(req)


def _become(req: dict[str, Any]) -> None:
    """Run the child's module as ``python -m`` in its working directory would."""
    import random
    import runpy

    random.seed()  # a fork copies the starter's generator: every child would draw the same numbers
    _name(req["argv"][0])
    if sys.path and sys.path[0] != req["cwd"]:
        sys.path[0] = req["cwd"]
    sys.argv = list(req["argv"])
    runpy.run_module(req["argv"][0], run_name="__main__", alter_sys=True)


def _name(module: str) -> None:
    """Name the child after its module (``ps -o comm``, ``top``): its command line stays its starter's."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, module.rsplit(".", 1)[-1][:15].encode(), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    child: dict[str, Any] | None = None
    try:
        sys.exit(_serve(sys.argv[1:]))
    except _Child as c:
        child = c.req
    except KeyboardInterrupt:
        sys.exit(0)
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        sys.exit(0)
    assert child is not None
    _become(child)
