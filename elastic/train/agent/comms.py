"""A worker's communicators and its line to the coordinator: breaks, roll calls, retiring groups, heartbeats."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic.model import Layout
from elastic.train.agent.options import FAILED_JOB_GRACE_S
from elastic.train.agent.support import ROLL_CALL_ASK_S, _hard_exit, _short, _shutdown
from elastic.train.rendezvous import Directive, RendezvousClient, RendezvousError
from elastic.train.rendezvous.replies import Beat

log = logging.getLogger(__name__)

class _Comms:
    """The communicators and heartbeat half of :class:`WorkerAgent` (its state is the agent's)."""

    def _break(self, step: int, error: str) -> None:
        """A peer failed (or the coordinator says one did): shut every communicator down so peers
        blocked on us fail now rather than at their timeout, keep the state (and reduced
        gradients), and report what we hold. The recovery directive comes as a ``switch``."""
        log.warning("worker %s: step %d broke (%s); waiting for the recovery", self.worker, step, error)
        info: dict[str, Any] = {"ready": None, "dirty": False, "local_apply": True}
        if self.engine is not None and self.engine.recoverable:
            info.update(self.engine.recovery_state())
        self._drop_communicators()
        self._broken = True
        self._carry = None  # a given-up step's work is not used by a recovery (a survivor may lack it)
        self.client.call("broken", generation=self.generation, step=step, applied=self._applied, error=error,
                         **info)

    def _out_of_memory(self, step: int, e: BaseException) -> None:
        """Our step ran out of memory (the engine gave it up, its state intact): tell the coordinator
        first, with the layout and what the rank held, then shut the communicators down so peers
        blocked on us break now (their reports come second: the coordinator already knows the
        cause). Every rank then holds the state of the last step it applied, and waits, like after
        a broken step, for the directive that moves the job to a layout that fits."""
        error = f"{type(e).__name__}: {_short(e, 300)}"
        log.warning("worker %s: step %d ran out of memory on %s rank %d (%s); waiting for another layout",
                    self.worker, step, self.layout, self.rank, error)
        info: dict[str, Any] = {"ready": None, "dirty": False, "local_apply": True}
        if self.engine is not None and self.engine.recoverable:
            info.update(self.engine.recovery_state())
        m = self.engine.oom_memory if self.engine is not None else None
        oom = {"layout": str(self.layout), "rank": self.rank, "step": step, "error": error,
               "memory": m.as_json() if m is not None else None}
        self._carry = None
        self.client.call("broken", generation=self.generation, step=step, applied=self._applied, error=error,
                         out_of_memory=oom, **info)
        self._drop_communicators()
        self._broken = True

    def _drop_communicators(self) -> None:
        """Shut every communicator of this worker down and destroy it now, not after the next step
        like a rescale's: ``shutdown()`` alone leaves the connections open, and a peer blocked on
        one of them would wait for its timeout. The engine's state tensors (and gradients) stay."""
        retired: list[Any] = []
        if self.engine is not None:
            retired += self.engine.communicators()
            self.engine.abort()
        if dist.is_initialized():
            retired.append(dist.group.WORLD)
            dist.destroy_process_group()
        for pg in retired:
            _shutdown(pg)

    def _give_up(self, generation: int, step: int) -> None:
        """A shrink is pending: ask our engine to give ``step`` up (all ranks agree at a micro-batch;
        past the last one the step completes and the shrink switches after it). Once per step."""
        with self._engine_lock:
            eng = self.engine
            if (generation != self.generation or self._broken or self._given_up == (generation, step)
                    or eng is None):
                return
            self._given_up = (generation, step)
            eng.give_up(step)

    def _interrupt(self, generation: int) -> None:
        """The coordinator is recovering ``generation`` from a lost worker: stop our running step
        (it would end at a collective with the dead peer; the broken-step path then reports)."""
        with self._engine_lock:
            eng = self.engine
            if generation != self.generation or self._broken or eng is None:
                return
            if self._interrupted_gen != generation:  # the coordinator repeats it until we report
                self._interrupted_gen = generation
                log.warning("worker %s: a peer of generation %d was lost; giving the running step up",
                            self.worker, generation)
            eng.interrupt()

    def _init_default_group(self, d: Directive, layout: Layout, rank: int, *, own_store: bool = False) -> None:
        """The new layout's default group. ``own_store``: on a TCPStore connection of its own (it is
        being built in the background while the main thread's exchange uses the shared one)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if layout.world_size == 1:
            return  # a 1-rank layout needs no process group (the engine uses solo communicators)
        base = self._new_store(d) if own_store else self._store_for(d)
        store = dist.PrefixStore(f"{d.job}/g{d.generation}/train/", base)
        self._roll_call(d, store, rank, layout.world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world_size,
                                timeout=self._timeout())

    def _roll_call(self, d: Directive, store: Any, rank: int, world: int) -> None:
        """Before a group of generation ``d`` is built: wait until every member is at its door, and
        give up as soon as the coordinator says a peer of that generation was lost (its rendezvous
        would wait for the dead peer's key until ``pg_timeout_s``). See ``elastic.train.abortable``."""
        from elastic.train.abortable import roll_call

        roll_call(store, "roll-call", rank, world, self._aborter(d), self.opts.pg_timeout_s)

    def _aborter(self, d: Directive) -> Callable[[], str | None]:
        """``aborted()`` for the roll calls of generation ``d``'s groups: the reason the coordinator
        gave that generation up (a peer lost), or None; it asks at most every ROLL_CALL_ASK_S."""
        asked = [time.monotonic()]

        def aborted() -> str | None:
            # a wait beyond a moment (a roll call of live members takes milliseconds): ask whether the
            # coordinator gave this generation up, at most every ROLL_CALL_ASK_S
            if time.monotonic() - asked[0] < ROLL_CALL_ASK_S:
                return None
            asked[0] = time.monotonic()
            if self._asker is None:
                self._asker = RendezvousClient(self.client.url, self.worker, timeout_s=5.0, retry_s=0,
                                               secret=self.client.secret)
            try:
                resp = self._asker.ask("heartbeat", Beat, generation=self.generation, building=d.generation)
            except RendezvousError:
                return None  # the heartbeat thread decides what a lost coordinator means
            if resp.abort != d.generation:
                return None
            why = resp.abort_reason or "a peer was lost"
            log.warning("worker %s: a peer of generation %d was lost while its groups were built; giving "
                        "their rendezvous up (%s)", self.worker, d.generation, why)
            return why

        return aborted

    def _store_for(self, d: Directive) -> Any:
        if self._store is None:
            self._store = self._new_store(d)
        return self._store

    def _new_store(self, d: Directive) -> Any:
        return dist.TCPStore(d.store_host, d.store_port, is_master=False, timeout=self._timeout(),
                             wait_for_workers=False)

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.opts.pg_timeout_s)

    def _close_engine(self, *, keep_default: bool = False) -> None:
        retired: list[Any] = []
        if self.engine is not None:
            retired += self.engine.communicators()
            self.engine.close()
            self.engine = None
        if dist.is_initialized() and not keep_default:
            retired.append(dist.group.WORLD)
            dist.destroy_process_group()
        self._retire(retired)

    def _retire(self, groups: list[Any]) -> None:
        """Keep shut-down process groups alive until the pause is over (see :meth:`_bury`).

        Destroying a gloo group that has carried traffic takes ~20 ms even after
        ``shutdown()`` (its destructor tears down every pair); a rescale drops 2-5 of them
        (old TP/DP/PP, old default, the reshard group). The destructor runs with the GIL
        held, so even on a background thread it stops the main thread: measured, a grow's
        pause carried 20-40 ms of "close" for a reshard group destroyed on the reaper thread
        while the new engine was being built. Holding a reference is all it takes to defer it.
        """
        self._graveyard.extend(groups)

    def _bury(self) -> None:
        """Destroy the retired groups on the reaper thread, now that training runs again."""
        if self._graveyard:
            dead, self._graveyard = self._graveyard, []
            self._reaper.submit(dead.clear)

    def _leave(self) -> None:
        """A leaver's bytes have landed: free everything at once (the launcher sees the process go)."""
        log.info("worker %s: left at generation %d", self.worker, self.generation)
        self.faults.before_leaving()  # a test's fault: a node slow to let its GPU go
        self._exit_notice()
        if not self.opts.exit_on_leave:
            return None  # the host ends the process (Ray: the handle ray.kill()s the actor)
        from elastic.reshard.execute import fast_exit

        fast_exit(0)
        return None

    # ---- coordinator I/O ------------------------------------------------------------------
    def _report_result(self, d: Directive, stats: dict[str, Any]) -> None:
        # with its last complete checkpoint write: a leaver's last word on the checkpoint in flight
        # (it does not wait for a write still running: its GPU is not held back for it)
        extra = {"checkpoint": list(self._written)} if self._ckpt is not None and self._written[0] >= 0 else {}
        self.client.call("result", generation=d.generation, ok=True, stats=stats, **extra)

    def _report_fail(self, reason: str) -> None:
        try:
            self.client.call("fail", reason=reason)
        except RendezvousError:
            pass

    def _exit_notice(self) -> None:
        try:
            self.client.call("exit")
        except RendezvousError:
            pass

    def _heartbeat(self, interval: float) -> None:
        """Beat; interrupt the running step when a peer was lost; exit the process if the
        coordinator is gone or the job failed and we are stuck.

        Each beat long-polls for ``interval``: the coordinator answers at once when it starts
        recovering this worker's generation, so a survivor deep in a long step gives the step
        up at its next micro-batch instead of computing on to a collective with the dead peer.
        """
        lost_since: float | None = None
        failed_since: float | None = None
        beat = RendezvousClient(self.client.url, self.worker, timeout_s=interval + 5.0, retry_s=0,
                                secret=self.client.secret)
        pause = interval
        while not self._stop.wait(pause):
            now = time.monotonic()
            try:
                building, sent_from = self._building, self.generation
                resp = beat.ask("heartbeat", Beat, generation=sent_from, wait_s=interval, seen=self._seen_post,
                                **({"building": building} if building is not None else {}))
                lost_since = None
            except RendezvousError as e:
                lost_since = lost_since or now
                if now - lost_since > self.opts.coordinator_timeout_s:
                    _hard_exit(3, f"worker {self.worker}: coordinator unreachable for "
                                  f"{now - lost_since:.0f} s ({e}); exiting")
                pause = interval
                continue
            # a coordinator that long-polled has already waited; one that answered at once has not
            pause = 0.0 if time.monotonic() - now >= 0.5 * interval else interval
            if resp.interrupt is not None:
                self._interrupt(resp.interrupt)
            if resp.give_up is not None:
                self._give_up(resp.give_up.generation, resp.give_up.step)
            if resp.pending is not None:  # a rescale of our generation was posted: prepare meanwhile
                self._seen_post = resp.pending_seq if resp.pending_seq is not None else self._seen_post
                try:
                    self._prepare_early(resp.pending, told_on=sent_from)
                except Exception as e:  # noqa: BLE001 - the step loop prepares at the switch instead
                    log.warning("worker %s: could not begin preparing generation %s early: %s", self.worker,
                                resp.pending.generation, e)
            if resp.failed:
                # The main thread may sit in a collective with a dead peer; give it a grace period
                # to notice on its own (and exit with its own reason), then leave so no process
                # outlives its job. The job's reason is already recorded: a few seconds suffice.
                failed_since = failed_since or now
                if now - failed_since > min(self.opts.pg_timeout_s, FAILED_JOB_GRACE_S):
                    _hard_exit(1, f"worker {self.worker}: job failed ({resp.reason}); exiting")
