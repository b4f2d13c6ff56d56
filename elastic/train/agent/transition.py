"""A worker's part in a rescale: plan and prepare (early when it can), meet, exchange, commit."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import Layout, SpecError
from elastic.train.agent.options import (
    _REASK_S,
    Engine,
    State,
    _Prep,
    config_dtype,
    config_kind_dtypes,
    config_kinds,
    config_model,
    train_config,
)
from elastic.train.agent.support import (
    HeldState,
    _early_alloc_budget,
    _is_comm_error,
    _kept_contributors,
    _Phases,
    _same_rescale,
    _same_tensors,
    _short,
    _shutdown,
    _Snapshot,
    plan_digest,
)
from elastic.train.rendezvous import Directive, RendezvousError
from elastic.train.rendezvous.replies import Decision

log = logging.getLogger(__name__)

class _Transition:
    """The rescale half of :class:`WorkerAgent` (its state and helpers are the agent's)."""

    # ---- rescale ------------------------------------------------------------------------------
    def _prepare_early(self, d: Directive, *, told_on: int | None = None) -> None:
        """Plan and allocate for ``d`` in the background while the current step runs.

        From the step loop (a ``go`` that carries the pending directive: with a lookahead) or from
        the heartbeat thread (``told_on``: the generation the beat was sent from), which hears of a
        directive the moment it is posted; with no lookahead its switch is the next boundary, and
        what is not prepared by then is prepared inside the pause. ``prepare`` reads only shapes,
        so it runs beside the step; at the switch the step loop waits for what is left of it.
        """
        with self._engine_lock:  # the engine of the generation the directive rescales, never a newer one
            if told_on is not None and (told_on != self.generation or self._broken or self.engine is None):
                return
            with self._prep_lock:
                # the whole directive, not its number: a rescale abandoned before its switch step leaves
                # its number to the next try, which may name other workers or another layout
                if _same_rescale(self._taken, d) or (self._prep is not None and _same_rescale(self._prep_d, d)):
                    return
                self._prep_d, self._prep_at = d, time.monotonic()
                self._prep = self._pool.submit(self._plan_and_prepare, d, self.engine.state() if self.engine else {},
                                               early=True)

    def _drop_stale_prep(self, asked_at: float) -> None:
        """No rescale is pending (the coordinator said so after ``asked_at``): buffers prepared for
        one that was abandoned before its switch are let go rather than held until the next."""
        with self._prep_lock:
            if self._prep is not None and self._prep_at < asked_at:
                self._prep = self._prep_d = None

    def _take_prep(self, d: Directive) -> _Prep:
        """The early preparation if it is for ``d`` and still matches the engine's tensors, else prepare
        now. ``waited`` on the result: the seconds this took (inside the pause)."""
        t0 = time.perf_counter()
        with self._prep_lock:
            fut, self._prep, prep_d, prep_at, self._taken = self._prep, None, self._prep_d, self._prep_at, d
        prep: _Prep | None = None
        if fut is not None and _same_rescale(prep_d, d):
            ahead = time.monotonic() - prep_at
            prep = fut.result()
            prep.ahead = ahead
            now = self.engine.state() if self.engine is not None else {}
            if prep.deferred:
                log.info("worker %s: preparing generation %d at the switch: %s", self.worker, d.generation,
                         prep.deferred)
                prep = None
            elif not (prep.error or _same_tensors(prep.old_state, now)):
                log.warning("worker %s: engine replaced its state tensors after prepare; preparing again", self.worker)
                prep = None
        if prep is None:
            prep = self._prepare_now(d)
        prep.waited = time.perf_counter() - t0
        return prep

    def _prepare_now(self, d: Directive) -> _Prep:
        t0 = time.perf_counter()
        with self._prep_lock:
            self._taken = d
        state = self.engine.state() if self.engine is not None else {}
        prep = self._plan_and_prepare(d, state)
        prep.waited = time.perf_counter() - t0
        return prep

    def _plan_and_prepare(self, d: Directive, old_state: State, *, early: bool = False) -> _Prep:
        """Plan and prepare; a failure here is reported at the meeting (the rescale is abandoned), never raised.

        Nothing has moved yet and ``prepare`` never writes the old state, so whatever went wrong
        (an impossible plan, a staging cap, memory for the receive buffers), the job can go on
        on its old layout. ``early``: beside a running step. On a GPU the buffers must then fit in
        memory nobody has reserved (the step's peak may need its allocator's cache); if they do
        not, or allocating them fails, the result is ``deferred`` and the switch prepares again
        after the step, when its activations are gone -- never an abandoned rescale.
        """
        if not d.old_ranks:  # the first generation: nothing to move, everyone starts fresh
            return _Prep(d, None, None, "", {"new_ranks": {w: i for i, w in enumerate(d.workers)}}, {})
        from elastic.reshard.execute import AllocBudgetExceeded

        try:
            budget = _early_alloc_budget(self.opts.device) if early else None
            return self._plan_and_prepare_or_raise(d, old_state, max_alloc_bytes=budget)
        except Exception as e:  # noqa: BLE001 - any error before a byte moves abandons instead of failing
            if early and isinstance(e, (AllocBudgetExceeded, torch.OutOfMemoryError)):
                return _Prep(d, None, None, "", {}, old_state, deferred=f"{type(e).__name__}: {_short(e)}")
            log.warning("worker %s: cannot reshard to generation %d (%s)", self.worker, d.generation, e,
                        exc_info=not isinstance(e, SpecError))
            return _Prep(d, None, None, "", {}, old_state, error=f"{type(e).__name__}: {_short(e)}")

    def _plan_and_prepare_or_raise(self, d: Directive, old_state: State, *,
                                   max_alloc_bytes: int | None = None) -> _Prep:
        from elastic.reshard.execute import prepare
        from elastic.reshard.plan import plan_reshard

        model = config_model(self.config)
        dtype = config_dtype(self.config)
        kinds = config_kinds(self.config)
        t0 = time.perf_counter()
        plan = plan_reshard(model, _old_layout(d), d.old_ranks, d.layout,
                            list(d.workers), kinds=kinds,
                            bytes_per_element=torch.empty((), dtype=dtype).element_size(), remap=d.remap)
        plan_s = time.perf_counter() - t0
        # a transactional rescale keeps the old state whole until every member exchanged: no new
        # tensor may live in the memory of an old shard that is dropped
        prepared = prepare(plan, self.worker, dict(old_state), device=self.opts.device,
                           dtypes=config_kind_dtypes(self.config), recycle_dropped=not d.rollback,
                           max_alloc_bytes=max_alloc_bytes)
        info = {"new_ranks": dict(plan.new_ranks), "planned_bytes": plan.bytes_planned,
                "lower_bound_bytes": plan.bytes_lower_bound, "plan_seconds": plan_s}
        return _Prep(d, plan, prepared, plan_digest(plan), info, old_state)

    def _transition(self, d: Directive, prep: _Prep) -> int | None:
        """Meet, move the bytes, rebuild. Returns the step to continue at, or None when this worker leaves.

        Per-phase seconds go to the coordinator with the result (``RescaleRecord.worker_stats``):
        meet, group (the reshard group), exchange, close (old engine), init_pg (the new default
        group: when a worker joins it is built during group + exchange, and this is only the
        wait beyond them), engine (the new engine); ``execute_seconds`` = group + exchange,
        ``rebuild_seconds`` = close + init_pg + engine.
        """
        clock = _Phases()
        # what the step loop spent on the plan and buffers at the switch (the rest was done beside
        # the step before it); for an old member inside the pause, for a joiner before it
        clock.seconds["prepare_wait"] = prep.waited
        carry, self._carry = self._carry, None  # a given-up step's work: only this transition may use it
        # 1. meet: the coordinator decides go / abandoned before any byte moves
        decision, reason, told = self._meet(d, prep)
        clock.mark("meet")
        if decision == "go" and told.switch_step not in (None, d.switch_step):
            # a joiner: the members gave the step in progress up, and the switch moved there
            d = dataclasses.replace(d, switch_step=told.switch_step)
        if decision != "go":
            log.warning("worker %s: rescale to generation %d abandoned: %s", self.worker, d.generation, reason)
            if self.engine is None:  # a joiner: nothing to continue
                self._exit_notice()
                return None
            return d.switch_step
        new_ranks = {str(k): int(v) for k, v in prep.plan_info["new_ranks"].items()}
        layout, rank = d.layout, new_ranks.get(self.worker)
        keep_default = self._keeps_default_group(d, new_ranks)
        old_group = prep.prepared is not None and self._old_group_is_members(d, prep)
        # transactional (Directive.rollback): the old state stays whole, and the new layout is not
        # built, until every member has exchanged its part; a loss before that rolls the job back
        txn = d.rollback and prep.prepared is not None
        snapshot = (_Snapshot(self.generation, self.layout, prep.old_state, self._applied)
                    if txn and self.engine is not None else None)
        new_pg: Future[None] | None = None
        if prep.prepared is not None and not old_group:
            # 2a. a transient group will carry the bytes (someone joins): the old groups are idle
            # already, so drop them now and build the new default group while the bytes move
            # (keepers of a held generation need none: they run no collective; a transactional
            # rescale builds it after the commit: a member lost meanwhile would hang its rendezvous)
            self._close_engine()
            clock.mark("close")
            if rank is not None and not d.hold and not txn:
                new_pg = self._pool.submit(self._init_default_group, d, layout, rank, own_store=True)
        # 2. move the bytes over a group of old union new (the old default group when it is exactly that)
        broke = ""
        try:
            new_state, stats = self._execute(d, prep, clock, old_group=old_group)
        except Exception as e:
            if not (txn and self.opts.recover and _is_comm_error(e)):
                raise
            broke = f"{type(e).__name__}: {_short(e, 160)}"
        if broke:  # outside the except: the traceback no longer holds the broken groups
            return self._exchange_broke(d, snapshot, broke)
        if txn:
            # 2b. the commit: every member has its new bytes (and still its old ones)
            self.faults.at(self.worker, d.generation, "commit")
            verdict, why = self._exchanged(d)
            clock.mark("commit")
            if verdict == "rollback":
                new_state = {}
                return self._exchange_broke(d, snapshot, why, rolled_back=True)
            if verdict != "go":  # the job failed or is stopping meanwhile
                log.info("worker %s: stop at the commit of generation %d (%s)", self.worker, d.generation, why)
                self._close_engine()
                self._exit_notice()
                return None
            snapshot = None
        # 3. the old engine and its groups go (if still there)
        if self.engine is not None or (dist.is_initialized() and new_pg is None):
            self._close_engine(keep_default=keep_default)
        clock.mark("close")
        if rank is None:
            self._report_result(d, {**stats, **clock.report(), "prepare_ahead_seconds": prep.ahead})
            return self._leave()
        # 4. the new layout's default group (or what is left of building it) and engine
        self._building = d.generation
        try:
            if new_pg is not None:
                new_pg.result()
            elif not keep_default and not d.hold:
                self.faults.at(self.worker, d.generation, "init_pg")
                self._init_default_group(d, layout, rank)
            clock.mark("init_pg")
            if d.hold:  # a keeper: hold the state as received, build nothing, step nothing
                engine: Engine = HeldState(new_state)
            else:
                from elastic.train.abortable import abortable_groups

                # the engine's own groups (TP, DP, PP) hold a roll call each, given up on a lost peer
                with abortable_groups(self._aborter(d), self.opts.pg_timeout_s,
                                      before=lambda: self.faults.at(self.worker, d.generation, "groups")):
                    engine = self.factory(self.config, layout, rank,
                                          new_state if d.old_ranks else self._initial_state(d, layout, rank))
                if d.give_up_checks:
                    engine.give_up_checks = engine.keep_given_up = True
                finish = self._kept_step(d, told, carry, new_ranks)
                if finish is not None and engine.resumes_partial:
                    engine.resume_partial(finish[0], contribute=finish[1])
                    stats = {**stats, "kept_micro_batches": finish[0].micro}
        except Exception as e:
            # past a transactional commit the new state is whole on every member: a peer lost while
            # the groups are built is recovered from the new generation, like one lost in a step
            if not (txn and self.opts.recover and _is_comm_error(e)):
                raise
            broke = f"{type(e).__name__}: {_short(e, 160)}"
        finally:
            self._building = None
        if broke:
            return self._build_broke(d, layout, new_state, broke)
        with self._engine_lock:
            self.engine, self.generation, self.layout, self.rank = engine, d.generation, layout, rank
        self._applied = d.switch_step - 1
        clock.mark("engine")
        self.faults.at(self.worker, d.generation, "engine")
        self._report_result(d, {**stats, "rank": rank, **clock.report(), "prepare_ahead_seconds": prep.ahead})
        self._prepare_snapshot_buffers()
        return d.switch_step

    def _build_broke(self, d: Directive, layout: Layout, new_state: State, error: str) -> int:
        """A peer was lost while this member built the new generation's groups, after the commit:
        drop what was built, hold the new state as received and report like a broken step."""
        log.warning("worker %s: building generation %d broke (%s); holding its state for the recovery",
                    self.worker, d.generation, error)
        self._drop_communicators()
        return self._stand_broken(_Snapshot(d.generation, layout, new_state, d.switch_step - 1), d.switch_step,
                                  f"building generation {d.generation}: {error}")

    def _stand_broken(self, held: _Snapshot, step: int, error: str) -> int:
        """Stand as a member of ``held.generation`` whose step ``step`` broke, holding ``held.state``
        (no engine, no communicator), and report it; the recovery directive comes as a ``switch``."""
        with self._engine_lock:
            self.engine, self.generation, self.layout = HeldState(held.state), held.generation, held.layout
        self._applied = held.applied
        self._prep, self._broken = None, True
        self.client.call("broken", generation=held.generation, step=step, applied=held.applied, error=error,
                         ready=None, dirty=False, local_apply=True)
        return step

    def _exchanged(self, d: Directive) -> tuple[str, str]:
        """Report our part of a transactional rescale done; long-poll for the commit (``go``), a
        ``rollback``, or ``stop``."""
        while True:
            resp = self.client.ask("exchanged", Decision, generation=d.generation, wait_s=self.opts.long_poll_s)
            if resp.decision != "wait":
                return resp.decision, resp.reason
            time.sleep(_REASK_S)

    def _exchange_broke(self, d: Directive, snapshot: _Snapshot | None, error: str, *,
                        rolled_back: bool = False) -> int | None:
        """A transactional rescale failed before its commit (a peer was lost mid-exchange): shut every
        communicator down at once, and either stand again as the old generation's member with the
        old state kept whole (report it, like a broken step, and wait for the recovery directive)
        or, with nothing old to go back to (a joiner), leave. Returns the step to continue at, or
        None when this worker leaves."""
        what = "was rolled back" if rolled_back else "broke"
        self._drop_communicators()
        if snapshot is None:
            log.warning("worker %s: the rescale to generation %d %s (%s); a joiner has nothing to go back "
                        "to: leaving", self.worker, d.generation, what, error)
            with self._engine_lock:
                self.engine = None
            try:
                self.client.call("broken", generation=d.generation, step=d.switch_step, applied=-1, error=error,
                                 ready=None, dirty=False, local_apply=False)
            except RendezvousError:
                pass
            self._exit_notice()
            return None
        log.warning("worker %s: the rescale to generation %d %s (%s); back on generation %d with the old "
                    "state, waiting for the recovery", self.worker, d.generation, what, error, snapshot.generation)
        return self._stand_broken(snapshot, d.switch_step, f"rescale to generation {d.generation} {what}: {error}")

    def _meet(self, d: Directive, prep: _Prep) -> tuple[str, str, Decision]:
        """Arrive with the plan digest (or the preparation error) and long-poll for the decision;
        returns it, the reason and the whole answer (a ``go`` says the switch step as it stands and
        whether the step given up for it was kept)."""
        while True:
            resp = self.client.ask("arrive", Decision, generation=d.generation, digest=prep.digest,
                                   plan=prep.plan_info, error=prep.error, wait_s=self.opts.long_poll_s)
            if resp.decision != "wait":
                return resp.decision, resp.reason, resp
            time.sleep(_REASK_S)

    def _kept_step(self, d: Directive, told: Decision, carry: Any,
                   new_ranks: dict[str, int]) -> tuple[Any, bool] | None:
        """(the given-up step's kept work, whether this worker adds it) when the new layout finishes
        that step from it, else None. Every member agrees: the ``go`` said every old member kept it
        (``gave_up.kept``) and :func:`_kept_contributors` reads the directive and the agreed plan.
        A joiner holds no kept work: it computes its share of the samples left and adds nothing."""
        gave = told.gave_up
        if gave is None or not gave.kept or gave.step != d.switch_step:
            return None
        contributors = _kept_contributors(d, new_ranks)
        if contributors is None:
            return None
        if self.worker in contributors:
            if carry is None or carry.step != d.switch_step:  # cannot be: the coordinator saw it kept
                raise RuntimeError(f"worker {self.worker}: told to finish step {d.switch_step} from its kept work, "
                                   "which it does not hold")
            return carry, True
        from elastic.train.engine import PartialStep

        cfg, old = train_config(self.config), _old_layout(d)
        return PartialStep(d.switch_step, gave.micro, old.dp, cfg.grad_accum(old), cfg.micro_batch_for(old),
                           None, 0.0), False

    def _old_group_is_members(self, d: Directive, prep: _Prep) -> bool:
        """Every member of the reshard is an old member (no joiner) and the old default group exists."""
        return (dist.is_initialized() and set(prep.plan.members) == set(d.old_ranks)
                and dist.get_world_size() == len(d.old_ranks))

    def _keeps_default_group(self, d: Directive, new_ranks: dict[str, int]) -> bool:
        """Same workers on the same ranks: the old default group serves the new layout as it is."""
        return dist.is_initialized() and new_ranks == d.old_ranks and dist.get_world_size() == len(new_ranks)

    def _execute(self, d: Directive, prep: _Prep, clock: _Phases, *, old_group: bool) -> tuple[State, dict[str, Any]]:
        if prep.prepared is None:
            clock.mark("group")
            clock.mark("exchange")
            return {}, {}
        from elastic.reshard.execute import execute

        pg: Any = None
        if old_group:
            # no joiner: the old default group already connects every member (saves a gloo rendezvous)
            grank = dict(d.old_ranks)
        else:
            members = list(prep.plan.members)
            grank = {w: i for i, w in enumerate(members)}
            self.faults.at(self.worker, d.generation, "group")
            store = dist.PrefixStore(f"{d.job}/g{d.generation}/reshard/", self._store_for(d))
            self._building = d.generation
            try:
                self._roll_call(d, store, grank[self.worker], len(members))
                # after the roll call, before its part of gloo's rendezvous
                self.faults.at(self.worker, d.generation, "rendezvous")
                pg = dist.ProcessGroupGloo(store, grank[self.worker], len(members), self._timeout())
            finally:
                self._building = None
        clock.mark("group")
        self.faults.at(self.worker, d.generation, "exchange")
        try:
            new_state = execute(prep.prepared, pg, grank, verify=self.opts.verify_reshard)
        except BaseException:
            if pg is not None:  # destroyed now, not retired: a peer blocked on it fails at once
                _shutdown(pg)
                pg = None
            raise
        finally:
            if pg is not None:
                _shutdown(pg)
                self._retire([pg])
        clock.mark("exchange")
        st = prep.prepared.stats
        return new_state, {"bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                           "prepare_seconds": st.prepare_seconds, "exchange_seconds": st.exchange_seconds}


def _old_layout(d: Directive) -> Layout:
    """The layout ``d`` moves from; a first generation's directive has none, and asks for no reshard."""
    if d.old_layout is None:
        raise RuntimeError(f"generation {d.generation}: a directive with no old layout moves no state")
    return d.old_layout
