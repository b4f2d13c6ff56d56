"""A coordinated worker's process groups and its calls to the coordinator.

What it is for: the transient groups of a rescale (the union of old and new members, the new
layout's default group), each after a roll call the coordinator can give up; the meeting and
commit calls; the heartbeat thread; and :class:`_Sockets`, which cuts this generation's gloo
connections so a peer blocked in a collective fails at once. A mixin of
:class:`elastic.torch.coordinated.Session`.

Must not: decide anything about a rescale; that is the coordinator's.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from elastic.train.agent import FAILED_JOB_GRACE_S, _hard_exit
from elastic.train.rendezvous.messages import Directive
from elastic.train.rendezvous.replies import Beat, Decision

if TYPE_CHECKING:  # rescale imports this module
    from elastic.torch.rescale import _Restore

log = logging.getLogger("elastic.torch.coordinated")

_REASK_S = 0.005
_LONG_POLL_S = 2.0
_ASK_ABORT_S = 0.1  # a roll call asks the coordinator whether its rescale was given up at most this often


class GroupsMixin:
    """Groups and coordinator I/O (mixed into :class:`elastic.torch.coordinated.Session`)."""

    # ---- groups ---------------------------------------------------------------------------------
    def _store_for(self, d: Directive | _Restore) -> Any:
        if self._store is None:
            self._store = dist.TCPStore(d.store_host, d.store_port, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.opts.pg_timeout_s))
        return self._store

    def _roll_call(self, d: Directive | _Restore, store: Any, rank: int, world: int, building: int) -> None:
        from elastic.train.abortable import roll_call

        roll_call(store, "roll-call", rank, world, self._aborter(building), self.opts.pg_timeout_s)

    def _raw_group(self, d: Directive, prefix: str, members: list[str], *, nccl: bool = False) -> Any:
        store = dist.PrefixStore(prefix + "/", self._store_for(d))
        me = members.index(self.worker)
        self._roll_call(d, store, me, len(members), d.generation)
        timeout = datetime.timedelta(seconds=self.opts.pg_timeout_s)
        if nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, me, len(members), opts)
        return dist.ProcessGroupGloo(store, me, len(members), timeout)

    def _init_world(self, d: Directive | _Restore, prefix: str, rank: int, n: int) -> None:
        from elastic.torch.caches import clear_dtensor_caches

        self._drop_world()
        store = dist.PrefixStore(prefix + "/", self._store_for(d))
        self._roll_call(d, store, rank, n, self._building if self._building is not None else d.generation)
        dist.init_process_group("gloo" if self.opts.device == "cpu" else "cpu:gloo,cuda:nccl", store=store,
                                rank=rank, world_size=n, timeout=datetime.timedelta(seconds=self.opts.pg_timeout_s))
        clear_dtensor_caches()

    def _drop_world(self) -> None:
        from elastic.torch.caches import clear_dtensor_caches

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean teardown
                pass
        self.world = None
        clear_dtensor_caches()

    def _drop_union(self) -> None:
        for pg in (self._union, self._union_bytes):
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001
                    pass
        self._union = self._union_bytes = None

    def _aborter(self, building: int) -> Callable[[], str | None]:
        """``aborted()`` for a roll call of groups for generation ``building``: the coordinator's reason
        for giving it up (abandoned, rolled back, a peer lost, the job failed), or None."""
        from elastic.train.rendezvous import RendezvousClient, RendezvousError

        asked = [time.monotonic()]
        asker = RendezvousClient(self.client.url, self.worker, timeout_s=5.0, retry_s=0,
                                 secret=self.client.secret)

        def aborted() -> str | None:
            if time.monotonic() - asked[0] < _ASK_ABORT_S:
                return None
            asked[0] = time.monotonic()
            try:
                resp = asker.ask("heartbeat", Beat, generation=self.gen, building=building)
            except RendezvousError:
                return None
            return (resp.abort_reason or "given up") if resp.abort == building else None

        return aborted

    # ---- coordinator I/O --------------------------------------------------------------------------
    def _meet(self, d: Directive, digest: str, plan: dict[str, Any], error: str) -> tuple[str, str]:
        while True:
            resp = self.client.ask("arrive", Decision, generation=d.generation, digest=digest, plan=plan, error=error,
                                   wait_s=_LONG_POLL_S)
            if resp.decision != "wait":
                return resp.decision, resp.reason
            time.sleep(_REASK_S)

    def _exchanged(self, d: Directive) -> tuple[str, str]:
        while True:
            resp = self.client.ask("exchanged", Decision, generation=d.generation, wait_s=_LONG_POLL_S)
            if resp.decision != "wait":
                return resp.decision, resp.reason
            time.sleep(_REASK_S)

    def _exit_notice(self) -> None:
        try:
            self.client.call("exit")
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, reason: str) -> None:
        self.reasons.append(reason)
        try:
            self.client.call("fail", reason=reason)
        except Exception:  # noqa: BLE001
            pass
        self._end("done")

    def report_fail(self, reason: str) -> None:
        """The user's function failed (not a lost peer): the job's failure reason (or a lost worker)."""
        if self.phase in ("done", "left"):
            return
        self._fail(reason)

    def _leave(self) -> None:
        log.info("worker %s: left at generation %d", self.worker, self.gen)
        self._exit_notice()
        self._end("left")
        self._drop_world()
        if self.opts.exit_on_leave:
            from elastic.reshard import execute as ex

            ex.fast_exit(0)

    def _end(self, phase: str) -> None:
        self.phase = phase
        if phase in ("done", "left"):
            self._stop.set()

    def _heartbeat(self, interval: float) -> None:
        """Beat; note a lost peer of our generation (the step gives up at its next micro-batch); exit
        the process if the coordinator is gone or the job failed and we are stuck."""
        from elastic.train.rendezvous import RendezvousClient, RendezvousError

        lost_since: float | None = None
        failed_since: float | None = None
        beat = RendezvousClient(self.client.url, self.worker, timeout_s=interval + 5.0, retry_s=0,
                                secret=self.client.secret)
        pause = interval
        while not self._stop.wait(pause):
            now = time.monotonic()
            try:
                sent_from = self.gen
                resp = beat.ask("heartbeat", Beat, generation=sent_from, wait_s=interval,
                                **({"building": self._building} if self._building is not None else {}))
                lost_since = None
            except RendezvousError as e:
                lost_since = lost_since or now
                if now - lost_since > self.opts.coordinator_timeout_s:
                    _hard_exit(3, f"worker {self.worker}: coordinator unreachable for {now - lost_since:.0f} s "
                                  f"({e}); exiting")
                pause = interval
                continue
            pause = 0.0 if time.monotonic() - now >= 0.5 * interval else interval
            if resp.interrupt is not None and resp.interrupt == sent_from:
                if self._interrupt_gen != sent_from:
                    log.warning("worker %s: a peer of generation %d was lost; the step gives up", self.worker,
                                sent_from)
                    # a collective this process is blocked in waits for a peer that broke out of its
                    # own: gloo has no way to interrupt it but its connections failing
                    self._comm_sockets.cut()
                self._interrupt_gen = sent_from
            if (g := resp.give_up) is not None and g.generation == sent_from:
                self._give_up_req = (sent_from, g.step)  # checked before the next micro-batch
            if resp.failed:
                failed_since = failed_since or now
                if now - failed_since > min(self.opts.pg_timeout_s, FAILED_JOB_GRACE_S):
                    _hard_exit(1, f"worker {self.worker}: job failed ({resp.reason}); exiting")


class _RolledBack(RuntimeError):
    pass


class _Sockets:
    """The TCP connections a generation's gloo groups opened, to cut when a peer is lost.

    A collective blocked on a peer that is alive but broke out of its own collective (its
    neighbour in the ring died) waits for the group's timeout: gloo's ``shutdown()`` and
    ``abort()`` leave the connections open, and destroying the groups does not close them
    while anything still references them (DTensors, FSDP, a traceback). Shutting a socket's
    read side makes gloo's next read on it end (EOF): gloo fails every receive waiting on that
    connection and closes it, and the peer's reads end too. The blocked collectives on both
    ends raise, and each process reports to the coordinator.

    Only the read side: with the write side shut as well, this process's next send on the
    socket fails with EPIPE, which gloo leaves queued without failing it (a send waiting in a
    connection's queue is not failed when the connection breaks), so a collective that sent
    after the cut hung until its timeout. The sockets are told apart by when they were opened
    (while the generation's groups were built) and by their peer (not the coordinator's HTTP
    port nor the store's). Linux only (``/proc/self/fd``); elsewhere nothing is cut and a
    blocked peer waits for its timeout.
    """

    def __init__(self) -> None:
        self._before: dict[int, str] | None = None  # the sockets open at begin(), until end()
        self.fds: dict[int, str] = {}

    @staticmethod
    def _open() -> dict[int, str]:
        out: dict[int, str] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return out
        for name in names:
            try:
                link = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if link.startswith("socket:"):
                out[int(name)] = link
        return out

    def begin(self) -> None:
        self._before = self._open()

    def end(self, exclude_ports: set[int]) -> None:
        if self._before is None:  # no begin(): every socket would look new (Ray's own among them)
            return
        before, self._before = self._before, None
        new = {fd: link for fd, link in self._open().items() if before.get(fd) != link}
        for fd, link in new.items():
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    peer = s.getpeername()
            except OSError:
                continue  # a listener, or closed meanwhile
            if int(peer[1]) not in exclude_ports:
                self.fds[fd] = link

    def cut(self) -> None:
        fds, self.fds = self.fds, {}
        for fd, link in fds.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue  # closed, and the number reused by another socket
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
