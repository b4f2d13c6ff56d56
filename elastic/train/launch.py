"""Launchers of elastic training jobs: the common handle and the local-process launcher.

What it is for: a :class:`JobHandle` owns one job's :class:`~elastic.train.rendezvous.Coordinator`
and its worker processes. ``start(layout, workers)`` launches the workers and waits for the
first step; ``rescale(layout, workers)`` validates the new layout, launches the joiners,
posts the directive, waits until the new generation has run its first step and the leavers
are gone, and returns the timings; ``pause()`` moves the whole state into keepers (processes
that hold it in host memory, no GPU) so every GPU is freed and nothing is lost, and a later
``rescale()`` (or ``resume()``) moves it back onto GPU workers at the same step;
``status()`` and ``stop()`` do what they say. Subclasses
only say how to spawn, watch and kill one worker: :class:`ProcessJobHandle` (here, plain
``python -m elastic.train.worker`` subprocesses) and
:class:`~elastic.train.ray_handle.TrainingJobHandle` (Ray actors with one GPU each).

A watcher thread turns an unexpected worker exit into the job's failure reason
("worker w1 exited with code -9"), so nothing waits on a dead process.

What it must not do: decide layouts (the controller does) or touch tensors.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry

from elastic.model import HardwareSpec, Layout, SpecError, check_layout, load_hardware
from elastic.phases import CoordinatorPhase
from elastic.train.agent import config_json
from elastic.train.checkpoint import CheckpointSettings
from elastic.train.procenv import worker_memory_env
from elastic.train.rendezvous import (
    SECRET_ENV,
    Coordinator,
    CoordinatorSettings,
    JobFailed,
    JobStatus,
    RescaleCancelled,
    RescaleFailed,
    RescaleRecord,
    StepRecord,
)
from elastic.train.userjob import is_user_config
from elastic.train.warm import WarmProcess, WarmStartError, start_module

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RescaleResult:
    """What one rescale cost. ``pause_seconds``: training stopped (last old step done -> first new step begun)."""

    generation: int
    from_layout: Layout | None
    to_layout: Layout
    switch_step: int
    pause_seconds: float | None
    bytes_moved: int
    planned_bytes: int
    lower_bound_bytes: int
    wall_seconds: float  # the whole rescale() call: joiners' start-up, waiting for the boundary, first step
    record: RescaleRecord
    leave_seconds: float = 0.0  # new layout running -> every leaver gone and its resources free (Ray: GPUs)


@dataclass(frozen=True)
class LaunchOptions:
    pg_timeout_s: float = 120.0
    coordinator_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 15.0
    join_timeout_s: float = 120.0
    register_timeout_s: float = 120.0  # joiners must start and register within this
    rescale_timeout_s: float = 600.0
    exit_timeout_s: float = 30.0  # leavers and stopped workers must be gone within this
    max_steps: int | None = None
    engine_factory: str | None = None  # "module:function" (see elastic.train.worker); None = TrainEngine
    verify_reshard: bool = False
    # A rescale switches at the step boundary after the one in progress plus this many steps, during
    # which every member prepares its receive buffers while it trains (the pause is shorter). 0 for
    # both: a grow's joiners have registered before the directive (they prepare while the members
    # finish the step in progress) and their GPUs idle until the switch; a shrink frees GPUs someone
    # waits for -- inference, under load. A step is seconds on a large model, a preparation less.
    lookahead_steps: int = 0
    shrink_lookahead_steps: int = 0
    # A shrink does not wait for the step in progress either: its members give it up at their next
    # micro-batch (all ranks agree there through a one-float all-reduce per micro-batch on the CPU
    # group) and the new layout redoes it on the same samples. The GPUs go back a step sooner; the
    # part of the step computed is lost (counted in the rescale's pause). Layouts with one pipeline
    # stage only (1F1B stages run their micro-batches at different times): others finish the step.
    shrink_gives_up_step: bool = True
    # A grow neither (one pipeline stage, the same TP split): its members give the step in progress up
    # at their next micro-batch keeping its work, and the new layout, joiners included, finishes it.
    # The joiners' GPUs train a micro-batch after they are ready instead of at the step's end. Needs
    # shrink_gives_up_step (the engines' checks).
    grow_gives_up_step: bool = True
    # Members hear of a rescale the moment it is posted (their heartbeat long-polls) and plan and
    # allocate their receive buffers beside the step in progress: only what that step leaves undone
    # lands in the pause. False: they prepare at the switch (the lookahead steps, if any, still help).
    prepare_beside_step: bool = True
    # Raise the workers' nice value by this much. Where logical GPUs share a few CPU cores
    # (``elastic demo``), training then yields the cores to the inference replicas, as work
    # on separate GPUs would not compete; 0 = leave the priority alone.
    nice: int = 0
    # A worker lost while training (process gone, heartbeat lost) does not fail the job when its
    # state survives in data-parallel replicas (dp >= 2, no ZeRO-1): the survivors resume on the
    # same TP x PP split with fewer replicas, at the step they all reach (see rendezvous).
    recover: bool = True
    # With ``recover`` on a recoverable layout, a rescale is transactional: members keep their old
    # state whole until every member has exchanged its part, so a worker lost mid-exchange rolls
    # the job back instead of failing it. It costs memory (the dropped shards' memory is not
    # reused for received ones: a rescale that only fits with that reuse is abandoned at prepare,
    # the job going on unchanged) and the new layout's groups are built after the exchange rather
    # than during it. False: reuse the memory; a loss mid-exchange then fails the job.
    transactional_rescale: bool = True
    # Periodic sharded checkpoints into this job's own directory (every worker must be able to
    # write it, and the coordinator to list it): a loss no replica covers (dp = 1, ZeRO-1, two
    # losses) then costs the steps since the last one instead of the whole run, because a start
    # begins at the newest complete checkpoint, on any layout. None: no checkpoint.
    checkpoint: CheckpointSettings | None = None


def coordinator_settings(o: LaunchOptions, *, user: bool = False) -> CoordinatorSettings:
    """The coordinator's settings that ``o`` decides (one place for every launcher). ``user``: a
    user job (``elastic.torch.Manager``), which gives a step up for a shrink only (its loop cannot
    hand over the step's work, so a grow waits for the boundary rather than lose it), prepares at
    the switch, and keeps no checkpoints of ours."""
    return CoordinatorSettings(
        heartbeat_interval_s=o.heartbeat_interval_s, heartbeat_timeout_s=o.heartbeat_timeout_s,
        join_timeout_s=o.join_timeout_s, max_steps=o.max_steps, recover=o.recover,
        lookahead_steps=o.lookahead_steps, shrink_lookahead_steps=o.shrink_lookahead_steps,
        shrink_gives_up_step=o.shrink_gives_up_step, grow_gives_up_step=o.grow_gives_up_step and not user,
        transactional=o.transactional_rescale, prepare_beside_step=o.prepare_beside_step and not user,
        checkpoint=None if user else o.checkpoint, rendezvous_timeout_s=o.pg_timeout_s)


def job_options(options: LaunchOptions | None, spec: Any, *, coordinator_sees: bool = True) -> LaunchOptions | None:
    """One job's launch options: the backend's, with the job's own checkpoint directory
    ``<spec.checkpoint.dir>/<job name>`` (``spec``: a ``TrainingSpec``)."""
    if spec.checkpoint is None:
        return options
    c = spec.checkpoint
    return replace(options or LaunchOptions(), checkpoint=CheckpointSettings(
        os.path.join(c.dir, spec.name), every_steps=c.every_steps, keep=c.keep, coordinator_sees=coordinator_sees,
        every_seconds=c.every_seconds))


def make_validator(cfg: Any, hardware: HardwareSpec | str | None = None, gpus_per_node: int | None = None):
    """Refuse (SpecError) a layout the model, the global batch or the memory planner cannot take."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware

    def validate(layout: Layout, workers: Sequence[str]) -> None:
        # 1. the model must split (heads, layers) and the trainer must support the layout
        check_layout(cfg.model, layout, gpus_per_node or (hw.gpus_per_node if hw else None))
        if is_user_config(cfg):
            cfg.check_axes(layout)  # the user's mesh names a dim for every axis above 1
        # 2. the global batch must split into dp * micro_batch * grad_accum (with vpp > 1, into a
        #    multiple of pp micro-batches: the interleaved schedule goes round in groups of pp)
        cfg.grad_accum(layout)
        # 3. the memory planner must say it fits (when we know the hardware)
        if hw is not None:
            from elastic.parallel.planner import evaluate

            p = evaluate(cfg.model, layout, hw, micro_batch=_planned_micro_batch(cfg, layout),
                         global_batch=cfg.global_batch, gpus_per_node=gpus_per_node)
            if not p.fits:
                raise SpecError(f"layout {layout} does not fit {hw.name}: {p.reason}")

    return validate


def _planned_micro_batch(cfg: Any, layout: Layout) -> int:
    """The micro-batch the memory planner sizes ``layout`` with. A user job's pieces may differ by
    one sample, and the planner takes sizes that divide a replica's share: the smallest such size
    at or above the largest piece, so the estimate never undercounts activations."""
    if not is_user_config(cfg):
        return cfg.micro_batch
    largest, per = cfg.micro_batch_for(layout), cfg.global_batch // layout.dp
    return next(m for m in range(largest, per + 1) if per % m == 0)


class JobHandle(ABC):
    """One training job: its coordinator and its workers."""

    def __init__(self, job: str, cfg: Any, *, options: LaunchOptions | None = None,
                 hardware: HardwareSpec | str | None = None, gpus_per_node: int | None = None,
                 registry: CollectorRegistry | None = None, host: str = "127.0.0.1", coordinator: Any = None) -> None:
        self.job = job
        self.cfg = cfg
        self.opts = options or LaunchOptions()
        self.validate = make_validator(cfg, hardware, gpus_per_node)
        o = self.opts
        # a coordinator of the job's elsewhere (its own process: rendezvous.remote.CoordinatorClient)
        # is driven as it is, else the handle hosts one in this process
        self.coordinator: Any = coordinator if coordinator is not None else Coordinator(
            job, config_json(cfg), host=host, registry=registry, validator=self.validate,
            settings=coordinator_settings(o, user=is_user_config(cfg)))
        self._spawned: set[str] = set()
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        # the watcher and a rescale's wait may both see a worker end: one reaps it, and its exit is
        # on record only once it is reaped (a caller that sees it gone may hand its resources on)
        self._reap_lock = threading.Lock()
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stopping = False
        self.exit_reasons: dict[str, str] = {}  # worker -> how it ended ("exited with code 0"), first seen
        # cancel_pending: a rescale waiting for its joiners may be called off until its directive is posted
        self._cancel = threading.Event()
        self._cancellable = False
        self._cancel_lock = threading.Lock()
        self.keepers: set[str] = set()  # workers launched to hold a paused job's state (no GPU)
        # a rescale that returned before its new layout's first step ended (wait_first_step=False):
        # the next rescale waits for that step first (see _settle)
        self._unsettled: int | None = None

    # ---- launcher specifics -------------------------------------------------------------------
    @abstractmethod
    def _spawn(self, worker: str, env: dict[str, str]) -> None: ...

    @abstractmethod
    def _exit_reason(self, worker: str) -> str | None:
        """None while ``worker`` runs; a reason ("exited with code 1") once it is gone."""

    @abstractmethod
    def _kill(self, worker: str) -> None: ...

    def _reap(self, worker: str) -> None:
        """Hook: ``worker``'s agent has finished; free what still holds its resources (Ray: the actor)."""
        return None

    def _before_directive(self) -> None:
        """Hook: every worker of the job is up (snapshot the platform's free resources)."""
        return None

    def _after_gone(self, workers: Sequence[str], timeout: float) -> None:
        """Hook: wait until the platform sees ``workers``' resources free (Ray: GPUs)."""
        return None

    # ---- public API ---------------------------------------------------------------------------
    def start(self, layout: Layout | str, workers: Sequence[str], *, timeout: float | None = None) -> RescaleResult:
        """Launch ``workers`` on ``layout`` (generation 1) and wait for its first step."""
        lay = _layout(layout)
        self.validate(lay, list(workers))
        self.coordinator.start()
        self._watcher = threading.Thread(target=self._watch, name=f"launcher-{self.job}", daemon=True)
        self._watcher.start()
        res = self._apply(1, lay, list(workers), remap=False, timeout=timeout)
        self._check_declared_size(res.record)
        return res

    def _check_declared_size(self, rec: RescaleRecord) -> None:
        """A user job's code reports the parameters it builds; the planner sized the job from the
        declared model. Say so when they disagree (layouts and memory are then planned for another model)."""
        if not is_user_config(self.cfg):
            return
        built = {int(s["params"]) for s in rec.worker_stats.values() if s.get("params") is not None}
        declared = self.cfg.model.total_params()
        for n in built:
            if abs(n - declared) > 0.05 * declared:
                log.warning("job %s: its code builds %d parameters, its declared model %s has %d; the planner "
                            "sizes layouts from the declared one: declare the model the code builds",
                            self.job, n, self.cfg.model.name, declared)

    def rescale(self, layout: Layout | str, workers: Sequence[str], *, remap: bool = True,
                timeout: float | None = None, wait_first_step: bool = True,
                give_up_step: bool | None = None) -> RescaleResult:
        """Move the job to ``layout`` on ``workers`` in place. Raises SpecError (refused, nothing changed),
        RescaleFailed (abandoned: the job continues on its old layout) or JobFailed.

        Returns once the new layout has run its first step and the leavers are gone. With
        ``wait_first_step=False`` a rescale that has leavers (a shrink: someone waits for the GPUs
        it frees) returns as soon as the new layout has *begun* its first step and the leavers are
        gone (a resume's leavers, keepers without a GPU, do not count): the step adds nothing to the
        freed GPUs and takes a whole step. Its record's ``ok``
        is then None (the step runs on); the next rescale or pause waits for that step first.
        ``give_up_step`` (a shrink): whether its members give the step in progress up instead of
        finishing it (``LaunchOptions.shrink_gives_up_step`` when None; see ``Coordinator.directive``).

        A paused job resumes this way: its keepers send the state to ``workers`` and leave, and
        training continues at the step it paused at."""
        lay = _layout(layout)
        self.validate(lay, list(workers))
        self._settle()
        st = self.coordinator.status()
        # a job held after a step ran out of memory (recovering, ``out_of_memory``) waits for exactly this
        if (st.phase not in (CoordinatorPhase.RUNNING, CoordinatorPhase.PAUSED)
                and not (st.phase == CoordinatorPhase.RECOVERING and st.out_of_memory)):
            raise SpecError(f"job {self.job} is {st.phase}" + (f" ({st.error})" if st.error else "")
                            + "; only a running or paused job (or one held after a step ran out of memory) "
                            "can be rescaled")
        if st.phase == CoordinatorPhase.PAUSED and set(workers) & set(st.workers):
            raise SpecError(f"job {self.job} is paused: its keepers {', '.join(st.workers)} hold no GPU and "
                            "cannot train; resume it on new workers")
        return self._apply(st.generation + 1, lay, list(workers), remap=remap, timeout=timeout,
                           wait_first_step=wait_first_step, give_up_step=give_up_step)

    resume = rescale

    def pause(self, keepers: Sequence[str] | None = None, *, timeout: float | None = None) -> RescaleResult:
        """Free every GPU of the job and keep its state: pause it at a step boundary.

        The state moves peer to peer, as in a rescale, into ``keepers``: new processes without
        a GPU that hold it in host memory, laid out as the current layout without data
        parallelism (``tp.pp.dp1``: one copy of everything, ``tp * pp`` keepers, each as large
        as one model-parallel shard with its optimizer state). Every training worker then
        exits. The keepers run no step; ``rescale()``/``resume()`` later moves the state back
        onto GPU workers and training goes on at the same step, on the same loss curve.
        Raises SpecError when the job is not running (nothing changed), RescaleFailed when
        the move was abandoned before any byte moved (the job trains on), JobFailed.
        """
        self._settle()
        st = self.coordinator.status()
        if st.phase != CoordinatorPhase.RUNNING or st.layout is None:
            raise SpecError(f"job {self.job} is {st.phase}" + (f" ({st.error})" if st.error else "")
                            + "; only a running job can be paused")
        lay = st.layout.held()
        names = list(keepers) if keepers is not None else [
            f"{self.job}-keep{st.generation + 1}-{i}" for i in range(lay.world_size)]
        if len(names) != lay.world_size:
            raise SpecError(f"job {self.job}: pausing {st.layout} holds its state as {lay} on {lay.world_size} "
                            f"keeper(s); got {len(names)}: {names}")
        if clash := sorted(set(names) & set(st.workers)):
            raise SpecError(f"job {self.job}: keeper name(s) {', '.join(clash)} are training workers; use new names")
        return self._apply(st.generation + 1, lay, names, remap=True, timeout=timeout, hold=True)

    def cancel_pending(self) -> bool:
        """Call off the rescale in progress if it still waits for its joiners to start.

        Before its directive is posted a rescale has changed nothing: its joiners are dismissed
        and ``rescale`` raises :class:`RescaleCancelled` (the job continues on its layout, at
        its generation). Returns False when there is nothing to call off: no rescale running,
        or its directive is already posted (it then runs to its end).
        Use: inference needs back the GPUs a grow is still starting joiners on.
        """
        with self._cancel_lock:
            if not self._cancellable:
                return False
            self._cancel.set()
            return True

    def checkpoint(self, timeout: float = 600.0) -> int:
        """Save a checkpoint now (at the next step boundary that allows one) and wait until every
        rank has written its part; returns its step. For maintenance: a node about to be drained,
        a change of model code. Raises SpecError (no checkpoint settings, or the job ended),
        CheckpointFailed (a rank could not write: the previous one stands) or TimeoutError."""
        return self.coordinator.wait_checkpoint(self.coordinator.request_checkpoint(), timeout)

    def status(self) -> JobStatus:
        return self.coordinator.status()

    def history(self) -> list[StepRecord]:
        return self.coordinator.history()

    def wait_step(self, step: int, timeout: float = 120.0) -> StepRecord:
        return self.coordinator.wait_step(step, timeout)

    def stop(self, timeout: float | None = None) -> JobStatus:
        """Workers stop at their next step boundary and exit; stragglers are killed."""
        self._stopping = True
        self.coordinator.request_stop()
        live = self._live()
        self._wait_gone(live, timeout if timeout is not None else self.opts.exit_timeout_s, kill=True)
        self._watching.set()
        st = self.coordinator.status()
        self.coordinator.stop()
        final = self.coordinator.status()
        ended = st.phase in (CoordinatorPhase.FAILED, CoordinatorPhase.FINISHED)
        return replace(final, phase=st.phase if ended else final.phase)

    # ---- orchestration ------------------------------------------------------------------------
    def _apply(self, generation: int, layout: Layout, workers: list[str], *, remap: bool,
               timeout: float | None, hold: bool = False, wait_first_step: bool = True,
               give_up_step: bool | None = None) -> RescaleResult:
        t0 = time.perf_counter()
        old = set(self.coordinator.status().workers)
        joiners = [w for w in workers if w not in old]
        # 1. refuse early what the coordinator would refuse anyway (nobody launched for nothing)
        self.coordinator.check_directive(generation)
        # 2. launch the joiners and wait until they registered (their start-up stays out of the
        #    pause); until the directive is posted the rescale may be called off (cancel_pending)
        with self._cancel_lock:
            self._cancel.clear()
            self._cancellable = True
        try:
            for w in joiners:
                self._launch(w, keeper=hold)
            self._wait_registered(joiners)
        except RescaleCancelled:
            pass  # seen while waiting; dismissed below
        finally:
            with self._cancel_lock:  # from here on the directive goes out: too late to call it off
                self._cancellable = False
                cancelled = self._cancel.is_set()
        if cancelled:
            self._before_directive()  # the platform's free resources with the joiners still counted as held
            self._dismiss(joiners, timeout=min(2.0, self.opts.exit_timeout_s))
            raise RescaleCancelled(f"job {self.job}: rescale to {layout} called off before its directive; joiners "
                                   f"{', '.join(joiners) or '-'} dismissed, nothing changed")
        self._before_directive()
        # 3. post the directive; the coordinator picks the step boundary
        try:
            self.coordinator.directive(generation, layout, workers, remap=remap,
                                       **({"hold": True} if hold else {}),
                                       **({"give_up_step": give_up_step} if give_up_step is not None else {}))
        except SpecError:
            self._dismiss(joiners)  # refused meanwhile (e.g. the job neared max_steps while they started)
            raise
        # 4. wait for the new generation's first step (wait_first_step=False with leavers: only until
        #    the new layout has begun it; the next rescale waits for the rest, see _settle)
        leavers = sorted(old - set(workers))
        # (a resume's leavers are keepers: they hold no GPU, nobody waits for them)
        early = not (hold or wait_first_step) and any(w not in self.keepers for w in leavers)
        try:
            wait = self.coordinator.wait_resumed if early else self.coordinator.wait_generation
            rec = wait(generation, timeout or self.opts.rescale_timeout_s)
        except RescaleFailed:
            self._wait_gone(joiners, self.opts.exit_timeout_s, kill=True)  # they exit on their own; make sure
            raise
        if rec.ok is None:
            self._unsettled = generation
        # 5. leavers are gone and their resources free again
        t_run = time.perf_counter()
        self._wait_gone(leavers, self.opts.exit_timeout_s, kill=True)
        self._after_gone(leavers, self.opts.exit_timeout_s)
        t_end = time.perf_counter()
        return RescaleResult(generation, rec.from_layout, rec.to_layout, rec.switch_step, rec.pause_seconds,
                             rec.bytes_moved, rec.planned_bytes, rec.lower_bound_bytes, t_end - t0, rec,
                             leave_seconds=t_end - t_run)

    def settle(self, timeout: float) -> JobStatus:
        """The job's status once a rescale a launcher that is gone left in flight has ended (its
        members finish it, or roll it back, without one); at once when none is in flight."""
        st = self.coordinator.status()
        rec = st.last_rescale
        if rec is not None and rec.ok is None and st.phase in (
                CoordinatorPhase.STARTING, CoordinatorPhase.RUNNING, CoordinatorPhase.RESCALING):
            try:
                self.coordinator.wait_generation(rec.generation, timeout)
            except (RescaleFailed, JobFailed, TimeoutError) as e:
                log.warning("job %s: the rescale in flight at adoption ended: %s", self.job, e)
            st = self.coordinator.status()
        return st

    def attach(self, workers: Sequence[str]) -> None:
        """Take over ``workers``, started by a launcher that is gone: from now on their exits are
        watched and reported, as for workers this handle started."""
        with self._lock:
            self._spawned.update(workers)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"launcher-{self.job}", daemon=True)
            self._watcher.start()

    def _settle(self) -> None:
        """Wait for the first step of a generation that ``_apply`` returned from early (a shrink), so
        the next directive is not posted while it is in flight. Its failure is no error here: the
        caller then sees the job's phase (recovering, failed) and says so."""
        gen, self._unsettled = self._unsettled, None
        if gen is None:
            return
        try:
            self.coordinator.wait_generation(gen, self.opts.rescale_timeout_s)
        except (RescaleFailed, JobFailed, TimeoutError) as e:
            log.warning("job %s: generation %d's first step: %s", self.job, gen, e)

    def _launch(self, worker: str, *, keeper: bool = False) -> None:
        env = {
            "ELASTIC_JOB": self.job,
            "ELASTIC_WORKER_ID": worker,
            "ELASTIC_RENDEZVOUS_URL": self.coordinator.url,
            SECRET_ENV: self.coordinator.secret,
            "ELASTIC_PG_TIMEOUT": str(self.opts.pg_timeout_s),
            "ELASTIC_COORDINATOR_TIMEOUT": str(self.opts.coordinator_timeout_s),
            "ELASTIC_VERIFY_RESHARD": "1" if self.opts.verify_reshard else "0",
            "ELASTIC_RECOVER": "1" if self.opts.recover else "0",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            # several workers share this host's cores: one intra-op thread each avoids oversubscription
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # huge pages for tensors and malloc's heap: cheaper first touch (prepare) and exit
            # (a leaver's, inside the pause); see elastic.train.procenv
            **worker_memory_env(os.environ),
        }
        if self.opts.checkpoint is not None:
            env["ELASTIC_CHECKPOINT_DIR"] = self.opts.checkpoint.dir
        if self.opts.engine_factory:
            env["ELASTIC_ENGINE_FACTORY"] = self.opts.engine_factory
        if is_user_config(self.cfg):  # the user's own loop (elastic.torch.run) instead of the reference trainer
            env["ELASTIC_ENTRYPOINT"] = self.cfg.entrypoint
            env["ELASTIC_ARGS"] = json.dumps(list(self.cfg.args))
            # where the launcher found the user's code: a worker may start elsewhere (a Ray actor)
            env["ELASTIC_CODE_DIR"] = os.getcwd()
        if self.opts.nice:
            env["ELASTIC_NICE"] = str(self.opts.nice)
        if keeper:  # holds a paused job's state in host memory: no GPU, no CUDA
            env["ELASTIC_KEEPER"] = "1"
            env["ELASTIC_DEVICE"] = "cpu"
            self.keepers.add(worker)
        self._spawn(worker, env)
        with self._lock:  # only now: the watcher must never look for a process that does not exist yet
            self._spawned.add(worker)
            self._gone.discard(worker)

    def _dismiss(self, workers: Sequence[str], timeout: float | None = None) -> None:
        """Stop workers launched for a directive that was not posted (their exit is no failure)."""
        for w in workers:
            self.coordinator.worker_left(w)
            self._kill(w)
        with self._lock:
            self._gone.update(workers)
        self._after_gone(workers, self.opts.exit_timeout_s if timeout is None else timeout)

    def _wait_registered(self, workers: Sequence[str]) -> None:
        deadline = time.monotonic() + self.opts.register_timeout_s
        while True:
            if self._cancel.is_set():
                raise RescaleCancelled(f"job {self.job}: called off while joiners started")
            missing = [w for w in workers if not self.coordinator.registered(w)]
            if not missing:
                return
            dead = {w: r for w, r in self._exit_reasons(missing).items() if r}
            if dead or time.monotonic() > deadline:
                for w in workers:
                    self._kill(w)
                why = (f"exited before registering: {dead}" if dead else
                       f"did not register within register_timeout_s={self.opts.register_timeout_s:g}")
                raise RescaleFailed(f"job {self.job}: worker(s) {', '.join(missing)} {why}; nothing changed")
            time.sleep(0.05)

    def _exit_reasons(self, workers: Sequence[str]) -> dict[str, str | None]:
        """``_exit_reason`` of each of ``workers``. A launcher that reads all its workers' states in
        one request overrides this: one request per poll instead of one per worker."""
        return {w: self._exit_reason(w) for w in workers}

    def _observe_exits(self, workers: Sequence[str]) -> dict[str, str | None]:
        """``_exit_reasons``; the first time a worker is seen gone, reap what is left of it and then
        remember why (another thread that sees it gone meanwhile waits for the reap)."""
        reasons = self._exit_reasons(workers)
        for worker, reason in reasons.items():
            if reason is not None and worker not in self.exit_reasons:
                with self._reap_lock:
                    if worker not in self.exit_reasons:
                        self._reap(worker)
                        self.exit_reasons[worker] = reason
        return reasons

    def _observe_exit(self, worker: str) -> str | None:
        return self._observe_exits([worker])[worker]

    def _live(self) -> list[str]:
        with self._lock:
            return sorted(self._spawned - self._gone)

    def _wait_gone(self, workers: Sequence[str], timeout: float, *, kill: bool) -> None:
        deadline = time.monotonic() + timeout
        pending = list(workers)
        while pending and time.monotonic() < deadline:
            seen = self._observe_exits(pending)
            pending = [w for w in pending if seen[w] is None]
            if pending:
                time.sleep(0.01)  # a leaver ends within ms of its last report; this is on rescale()'s path
        for w in pending:
            log.warning("job %s: worker %s did not exit within %.0f s; killing it", self.job, w, timeout)
            if kill:
                self._dump_stacks(w)
                self._kill(w)
        with self._lock:
            self._gone.update(workers)

    def _watch(self) -> None:
        """An exit the coordinator did not expect (not a leaver, joiner or stop) is a lost worker: the
        coordinator recovers without it or fails the job. A worker the coordinator gave up for lost
        (heartbeat) but whose process still runs is killed: a frozen process holds its peers' sockets."""
        killed: set[str] = set()
        unreachable = False
        while not self._watching.wait(0.2):
            try:
                self._watch_once(killed)
                unreachable = False
            except JobFailed as e:  # a coordinator in a process of its own that is gone: nobody to tell
                if not unreachable:
                    log.warning("job %s: %s", self.job, e)
                unreachable = True

    def _watch_once(self, killed: set[str]) -> None:
        for w, reason in self._observe_exits(self._live()).items():
            if reason is None:
                continue
            with self._lock:
                self._gone.add(w)
            if not self._stopping and not self.coordinator.has_left(w):
                self.coordinator.worker_lost(w, f"worker {w} {reason}")
        for w in self.coordinator.lost_workers():
            if w not in killed and w in self._live():
                log.warning("job %s: killing worker %s, given up for lost", self.job, w)
                self._dump_stacks(w)
                self._kill(w)
                killed.add(w)

    def _dump_stacks(self, worker: str) -> None:
        """Have a worker about to be killed as stuck (given up for lost, or not gone when it was to
        leave) write where its threads are to its log (a frozen worker's stack is the one clue to
        why it froze); a no-op where the launcher cannot signal it."""
        return None


class ProcessJobHandle(JobHandle):
    """Workers as local ``python -m elastic.train.worker`` processes (tests, single-host runs).

    ``warm`` (default): each worker is forked from a process that has imported torch and the
    trainer once (:mod:`elastic.train.warm`), so a worker, a joiner included, starts in
    milliseconds instead of seconds of imports; ``False``, or a starter that cannot start,
    starts each one as a fresh interpreter."""

    def __init__(self, job: str, cfg: Any, *, log_dir: str | None = None, warm: bool = True, **kw: Any) -> None:
        super().__init__(job, cfg, **kw)
        self.log_dir = log_dir
        self.warm = warm
        self.procs: dict[str, subprocess.Popen[bytes] | WarmProcess] = {}

    def _spawn(self, worker: str, env: dict[str, str]) -> None:
        path = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            path = os.path.join(self.log_dir, f"{worker}.log")
        full = {**os.environ, **env}
        if self.warm:
            try:
                self.procs[worker] = start_module("elastic.train.worker", env=full, log_path=path)
                return
            except WarmStartError as e:
                log.warning("job %s: %s; starting worker %s cold (and every later one)", self.job, e, worker)
                self.warm = False
        out: Any = open(path, "ab") if path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        self.procs[worker] = subprocess.Popen(
            [sys.executable, "-m", "elastic.train.worker"], env=full, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )

    def _exit_reason(self, worker: str) -> str | None:
        p = self.procs.get(worker)
        if p is None:
            return "was never started"
        code = p.poll()
        if code is None:
            return None
        return f"exited with signal {-code}" if code < 0 else f"exited with code {code}"

    def _dump_stacks(self, worker: str) -> None:
        import signal

        p = self.procs.get(worker)
        if p is None or p.poll() is not None:
            return
        try:
            p.send_signal(signal.SIGUSR1)  # elastic.train.worker: every thread's stack to its stderr
        except OSError:
            return
        # the dump comes from the worker's signal handler; a SIGKILL sent at once may land first
        time.sleep(STACK_DUMP_GRACE_S)

    def _kill(self, worker: str) -> None:
        p = self.procs.get(worker)
        if p is not None and p.poll() is None:
            p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def pid(self, worker: str) -> int:
        return self.procs[worker].pid


STACK_DUMP_GRACE_S = 0.5
"""How long a lost worker is given to write its stacks before it is killed (diagnostics only)."""


def gpu_workers(workers: Sequence[str], keepers: set[str]) -> list[str]:
    """The workers that hold a GPU (keepers do not)."""
    return [w for w in workers if w not in keepers]


def _layout(layout: Layout | str) -> Layout:
    return layout if isinstance(layout, Layout) else Layout.parse(layout)
