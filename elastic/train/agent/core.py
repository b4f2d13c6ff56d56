"""The worker agent's step loop: wait for a directive, train step by step, write checkpoints."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from elastic.model import Layout, SpecError
from elastic.train import checkpoint
from elastic.train.agent.comms import _Comms
from elastic.train.agent.faults import NO_FAULTS, Faults
from elastic.train.agent.options import (
    _REASK_S,
    AgentOptions,
    Engine,
    EngineFactory,
    State,
    _Prep,
    config_kind_dtypes,
    config_kinds,
    config_model,
    default_engine_factory,
)
from elastic.train.agent.support import HeldState, _is_comm_error, _preload, _result_json, _short
from elastic.train.agent.transition import _Transition
from elastic.train.groups import StepGivenUp
from elastic.train.rendezvous import Directive, RendezvousClient, RendezvousError
from elastic.train.rendezvous.replies import Answer, Registered

log = logging.getLogger(__name__)

class WorkerAgent(_Transition, _Comms):
    """Runs one worker until the job stops, this worker leaves, or something fails."""

    def __init__(self, worker: str, url: str, *, engine_factory: EngineFactory | None = None,
                 options: AgentOptions | None = None, faults: Faults = NO_FAULTS) -> None:
        self.worker = worker
        self.opts = options or AgentOptions()
        self.faults = faults  # tests' and chaos drills' faults (elastic.train.agent.faults); none by default
        self.client = RendezvousClient(url, worker, retry_s=self.opts.coordinator_timeout_s)
        self.factory = engine_factory or functools.partial(default_engine_factory, timeout_s=self.opts.pg_timeout_s)
        self.config: dict[str, Any] = {}
        self.engine: Engine | None = None
        self.generation = 0
        self.layout: Layout | None = None
        self.rank = -1  # in self.layout
        self._store: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prepare-{worker}")
        self._reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reaper-{worker}")
        # periodic checkpoints (elastic.train.checkpoint), settings from the coordinator at register
        self._ckpt: checkpoint.CheckpointSettings | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"checkpoint-{worker}")
        self._writing: Future[Any] | None = None
        self._writing_step = -1
        self._written = (-1, -1)  # (step, generation) of this worker's last checkpoint write that completed
        self._write_error = ""  # why the last write failed, until reported with a step result
        self._snap: dict[Any, Any] | None = None  # host buffers of the last snapshot, refilled by the next
        self._snap_ready: Future[dict[Any, Any]] | None = None  # buffers for a new layout, being allocated
        self._job = ""
        self._graveyard: list[Any] = []  # shut-down groups, destroyed after the next step (_bury)
        self._prep: Future[_Prep] | None = None
        self._prep_d: Directive | None = None  # the directive the early preparation is for
        self._prep_at = 0.0  # when it was begun (monotonic)
        # the step loop and the heartbeat thread (told of a directive mid-step) both begin one;
        # _taken: the directive whose transition took its preparation (none is begun for it after)
        self._prep_lock = threading.Lock()
        self._taken: Directive | None = None
        self._seen_post = 0  # the last posted directive a heartbeat told us of (Coordinator ``pending_seq``)
        # the generation whose groups this worker is building (its heartbeats say so): blocked in
        # gloo's rendezvous with a lost peer it is alive, and the coordinator waits for its report
        self._building: int | None = None
        self._stop = threading.Event()
        self._job_failed = ""
        self._applied = -1  # the last step whose optimizer update this worker applied
        self._broken = False  # a peer failed: communicators shut down, waiting for the recovery directive
        # engine and generation change together under it: the heartbeat thread interrupts the
        # engine of the generation the coordinator named, never a newer one
        self._engine_lock = threading.Lock()
        self._interrupted_gen = -1  # the generation we were last told to interrupt (logged once)
        self._given_up: tuple[int, int] | None = None  # (generation, step) last given up: asked once
        self._gave_up: dict[str, Any] | None = None  # reported with the next step request
        self._carry: Any = None  # a given-up step's kept work (engine.PartialStep) for the next layout
        # a group's roll call (elastic.train.abortable) asks the coordinator on a line of its own
        # whether the generation it is for was given up (a peer lost: recovered or rolled back)
        self._asker: RendezvousClient | None = None

    # ---- entry ----------------------------------------------------------------------------
    def run(self) -> int:
        """1. preload, 2. register, 3. heartbeat, 4. wait for a generation that includes us, 5. train.

        Returns an exit code."""
        _preload(self.factory)  # before registering: the launcher waits for this, the rescale pause does not
        try:
            seen = None
            if self.opts.checkpoint_dir:
                ref = checkpoint.latest(self.opts.checkpoint_dir)
                seen = ref.to_json() if ref else None
            reg = self.client.ask("register", Registered, pid=os.getpid(), host=socket.gethostname(),
                                  checkpoint_latest=seen)
        except RendezvousError as e:
            log.error("worker %s: %s", self.worker, e)
            return 3
        self.config = dict(reg.config)
        self._ckpt = checkpoint.CheckpointSettings.from_json(dict(reg.checkpoint) if reg.checkpoint else None)
        self._job = reg.job
        beat = threading.Thread(target=self._heartbeat, args=(reg.heartbeat_interval_s,),
                                name=f"heartbeat-{self.worker}", daemon=True)
        beat.start()
        try:
            return self._main()
        except RendezvousError as e:
            log.error("worker %s lost its coordinator: %s", self.worker, e)
            return 3
        except SpecError as e:  # bad configuration: the job cannot run as configured
            log.error("worker %s: %s", self.worker, e)
            self._report_fail(f"configuration: {e}")
            return 2
        except Exception as e:  # noqa: BLE001 - every failure becomes the job's reason, then an exit
            reason = f"{type(e).__name__}: {_short(e)}"
            log.exception("worker %s failed", self.worker)
            self._report_fail(reason)
            return 1
        finally:
            self._stop.set()
            self._pool.shutdown(wait=False)
            self._reaper.shutdown(wait=False)
            self._writer.shutdown(wait=True)  # a checkpoint being written is finished (the launcher bounds it)
            self.client.close()

    def _main(self) -> int:
        d = self._wait_for_directive()
        if d is None:
            return 0
        step = self._transition(d, self._prepare_now(d))
        if step is None:
            return 0
        return self._train(step)

    def _wait_for_directive(self) -> Directive | None:
        """A worker with no generation yet polls until a directive lists it (or the job ends)."""
        while True:
            resp = self.client.ask("poll", Answer, wait_s=self.opts.long_poll_s)  # long poll: answered on the event
            if resp.action == "join" and resp.directive is not None:
                return resp.directive
            if resp.action == "exit":
                log.info("worker %s: exiting without joining (%s)", self.worker, resp.reason)
                self._exit_notice()
                return None
            time.sleep(_REASK_S)  # never spin on a coordinator that answers "wait" at once (shutting down)

    # ---- step loop ----------------------------------------------------------------------------
    def _train(self, step: int) -> int:
        last: dict[str, Any] | None = None
        while True:
            if last is not None:
                self.faults.hold_step()  # the step just computed does not end while held (a test's fault)
            held = isinstance(self.engine, HeldState) or self._broken
            gave_up, self._gave_up = self._gave_up, None
            asked_at = time.monotonic()
            resp = self.client.ask("step", Answer, generation=self.generation, step=step, result=last,
                                   **({"wait_s": self.opts.long_poll_s} if held else {}),
                                   **({"gave_up": gave_up} if gave_up else {}))
            action = resp.action
            log.debug("worker %s gen %d step %d: %s", self.worker, self.generation, step, action)
            if action == "go":
                if resp.pending is not None:
                    self._prepare_early(resp.pending)
                else:
                    self._drop_stale_prep(asked_at)
                save = bool(resp.save)
                assert self.engine is not None
                if resp.give_up is not None:  # asked to give this step up before it began
                    self._give_up(self.generation, resp.give_up)
                try:
                    result = self.engine.train_step(step)
                except StepGivenUp as e:
                    # every rank gave it up at the same micro-batch: ask for the same step again, and
                    # the coordinator switches the pending shrink there (nothing of the state changed)
                    log.info("worker %s: %s", self.worker, e)
                    self._carry = getattr(e, "carry", None)
                    last, self._gave_up = None, {"step": step, "seconds": round(e.seconds, 4), "micro": e.micro,
                                                 "kept": self._carry is not None}
                    continue
                except torch.OutOfMemoryError as e:
                    # the step is given up with the state intact; the job moves to another layout
                    if not (self.opts.recover and self.engine.recoverable):
                        raise
                    last = None
                    self._out_of_memory(step, e)
                    continue
                except Exception as e:
                    if not (self.opts.recover and _is_comm_error(e) and self.engine.recoverable):
                        raise
                    last = None
                    self._break(step, f"{type(e).__name__}: {_short(e, 160)}")
                    continue
                last = _result_json(result, self.engine.memory)
                if self._ckpt is not None:
                    last["checkpoint"] = list(self._written)
                    if self._write_error:
                        last["checkpoint_error"], self._write_error = self._write_error, ""
                self._applied = step
                step += 1
                if save:
                    self._checkpoint(step)
                self._bury()  # the first step after a rescale is done: its old groups may go now
            elif action == "break" and not self._broken:
                last = None  # a peer was lost while we were between steps: report what we hold, then wait
                self._break(step, f"told to break: {resp.reason or ''}")
            elif action == "switch" and resp.directive is not None:
                last = None
                d = resp.directive
                if d.commit_step is not None and self._applied < d.commit_step:
                    # recovery: a survivor passed this step's commit, so our reduced gradients are final
                    self.engine.apply_ready(d.commit_step)  # type: ignore[union-attr]
                    self._applied = d.commit_step
                if self._broken:
                    self._prep, self._broken = None, False
                    nxt = self._transition(d, self._prepare_now(d))
                else:
                    nxt = self._transition(d, self._take_prep(d))
                if nxt is None:
                    return 0  # a leaver (normally gone already through os._exit)
                step = nxt
            elif action in ("hold", "break") and held:
                # a keeper (its job is paused at ``step``) or a survivor waiting for its recovery
                # directive; the coordinator long-polled already
                last = None
                self._bury()  # a keeper: the reshard group that brought the state in
                time.sleep(_REASK_S)
            elif action in ("stop", "finish"):
                log.info("worker %s: %s at step %d (%s)", self.worker, action, step, resp.reason or "")
                if resp.save and not self._broken:
                    self._checkpoint(step, final=True)
                self._close_engine()
                self._exit_notice()
                return 0
            else:
                raise RendezvousError(f"coordinator answered unknown action {action!r}")

    # ---- checkpoints ----------------------------------------------------------------------------
    def _initial_state(self, d: Directive, layout: Layout, rank: int) -> State | None:
        """A first generation's state: read out of the checkpoint the coordinator starts from (any saved
        layout), or None (the engine initialises it from the seed)."""
        if not d.resume:
            return None
        ref = checkpoint.CheckpointRef(d.resume, d.switch_step, d.resume_layout or "")
        t0 = time.perf_counter()
        state = checkpoint.load_rank(ref, config_model(self.config), layout, rank, config_kind_dtypes(self.config),
                                     device=self.opts.device)
        log.info("worker %s: rank %d of %s read from %s (saved on %s) in %.2f s", self.worker, rank, layout,
                 d.resume, d.resume_layout, time.perf_counter() - t0)
        return state

    def _prepare_snapshot_buffers(self) -> None:
        """On a new layout (or the first), allocate and touch this rank's host buffers for its next
        checkpoint in the background: that checkpoint's copy, which the step waits for, then
        refills warm memory instead of faulting fresh pages in (0.2-5 s for gpt-100m here)."""
        if self._ckpt is None or self.layout is None or self.engine is None or isinstance(self.engine, HeldState):
            return
        from elastic.reshard.spec import sharding_spec

        spec = sharding_spec(config_model(self.config), self.layout, config_kinds(self.config))
        shapes = checkpoint.buffer_shapes(spec, self.rank, self.engine.state())
        if self._snap is not None and {k: (tuple(v.shape), v.dtype) for k, v in self._snap.items()} == {
                k: (v[0], v[1]) for k, v in shapes.items()}:
            return  # the same boxes (a rescale that left this rank's part alone): refilled as they are
        self._snap = None  # the old layout's buffers go (a write still running holds its own)
        self._snap_ready = self._writer.submit(checkpoint.host_buffers, shapes)

    def _checkpoint(self, step: int, *, final: bool = False) -> None:
        """Save the state at ``step`` (the coordinator said so): copy the pieces this rank owns now
        (the next step changes the tensors in place), write them in the background.

        The coordinator begins no checkpoint before the last one is complete, so a write still
        running here is rare (its completion not reported yet); it is waited for, as every rank
        must write its part. ``final`` (the job stops or finishes at ``step``): after the last
        write, and waited for (the launcher bounds it by its exit timeout; cut short, the
        checkpoint is incomplete and the previous one stands)."""
        c = self._ckpt
        if c is None or self.layout is None or self.engine is None or isinstance(self.engine, HeldState):
            return
        if self._writing is not None and not self._writing.done():
            log.info("worker %s: the checkpoint at step %d waits for the write of step %d", self.worker, step,
                     self._writing_step)
        if self._writing is not None:
            self._writing.result()
        if final and self._writing_step == step:
            return
        if self._snap_ready is not None:  # buffers allocated for this layout in the background
            try:
                self._snap = self._snap_ready.result()
            except Exception:  # noqa: BLE001 - out of host memory there: snapshot allocates, or fails itself
                log.exception("worker %s: preparing the checkpoint's host buffers failed", self.worker)
            self._snap_ready = None
        from elastic.reshard.spec import sharding_spec

        assert self.engine is not None
        spec = sharding_spec(config_model(self.config), self.layout, config_kinds(self.config))
        # the last snapshot's buffers are refilled (none is being written here: see above)
        pieces = checkpoint.snapshot(spec, self.rank, self.engine.state(), into=self._snap)
        self._snap = pieces
        root, rank, job, gen = c.dir, self.rank, self._job, self.generation

        def write() -> None:
            try:
                time.sleep(self.faults.checkpoint_write_delay(self.worker))
                checkpoint.write_rank(root, step, spec, rank, pieces, job=job)
                self._written = (step, gen)
                if rank == 0:
                    checkpoint.prune(root, c.keep)
            except Exception as e:  # noqa: BLE001 - a failed write costs this checkpoint, never the job
                log.exception("worker %s: writing the checkpoint at step %d failed", self.worker, step)
                self._write_error = f"{type(e).__name__}: {_short(e, 200)}"

        self._writing, self._writing_step = self._writer.submit(write), step
        if final:
            self._writing.result()

