"""The Manager's cut of its gloo connections (``elastic.torch.coordinated._Sockets``), on loopback sockets.

A peer blocked reading from a connection this process opened while a generation's groups were
built must see it fail at once when the connection is cut; connections opened before, and
those to the coordinator or the store (by port), are never touched; an ``end()`` without a
``begin()`` records nothing (every socket of the process would look new)."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from elastic.torch.coordinated import _Sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    c = socket.create_connection(server.getsockname())
    s, _ = server.accept()
    return c, s


def test_a_cut_fails_the_blocked_peer_and_spares_what_came_before_or_is_excluded() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as control:
        old_c, old_s = _pair(server)
        cut = _Sockets()
        cut.begin()
        new_c, new_s = _pair(server)  # a gloo pair of the new generation (our end: new_c)
        ctl_c, ctl_s = _pair(control)  # the coordinator's HTTP: excluded by port
        cut.end(exclude_ports={control.getsockname()[1]})
        # (both ends of a pair live in this test's process; a worker holds one end of each)
        assert new_c.fileno() in cut.fds and old_c.fileno() not in cut.fds and ctl_c.fileno() not in cut.fds
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(new_s.recv(1)))  # the peer, blocked on us
        reader.start()
        cut.cut()
        reader.join(5)
        assert not reader.is_alive() and got == [b""], "the blocked peer should see the connection end"
        old_c.sendall(b"x")
        assert old_s.recv(1) == b"x"  # untouched
        for s in (old_c, old_s, new_c, new_s, ctl_c, ctl_s):
            s.close()


def test_an_end_without_a_begin_records_nothing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        c, s = _pair(server)
        cut = _Sockets()
        cut.end(exclude_ports=set())
        assert cut.fds == {}
        c.close()
        s.close()
