"""The rescale of :class:`elastic.torch.coordinated.Session`: one directive, on every member of old union new.

What it is for: the steps the coordinated Manager's module doc lists (ranks, groups, build and
plan, meet, move the bytes, adopt or leave), the restore of an abandoned rescale, and the pause
into keepers and the resume out of them (:mod:`elastic.torch.keeper`). A mixin of ``Session``:
it reads and sets the session's membership (generation, layout, ranks, model, optimizer).

Must not: run the user's code other than its ``build(world)``, or talk to the coordinator other
than through the session's client.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch

from elastic.model import Layout, SpecError
from elastic.torch.manager import MeshLayout, RescaleRecord, World, apply_carried, carried
from elastic.torch.session_io import _RolledBack
from elastic.train.agent import _Phases, _short
from elastic.train.rendezvous.messages import Directive

log = logging.getLogger("elastic.torch.coordinated")


class RescaleMixin:
    """Taking part in a directive (mixed into :class:`elastic.torch.coordinated.Session`)."""

    # the session's, declared here so that setting them from a directive does not narrow their type
    layout: Layout | None
    _building: int | None

    # ---- rescale ------------------------------------------------------------------------------------
    def _transition(self, d: Directive) -> int | None:
        """Take part in directive ``d``; the step to go on at, or None when this worker no longer trains."""
        from elastic.reshard.plan import ReshardError
        from elastic.torch.reshard import NoPeers, execute_reshard, prepare_reshard

        t0 = time.perf_counter()
        clock = _Phases()
        was, will, first = self.worker in d.old_ranks, self.worker in d.workers, not d.old_ranks
        rec = RescaleRecord(d.switch_step, MeshLayout(self._dims(d.layout), tuple(range(len(d.workers)))),
                            done=False, role="stays" if was and will else "joins" if will else "leaves")
        if not first:
            self.records.append(rec)
        tag = f"{d.job}/u{d.generation}.{d.switch_step}"
        prep, built, error = None, None, ""
        self._replicated = None
        new_ranks: dict[str, int] = {}
        extras: Any = None
        # 1-3: before the meeting; any failure here is this member's error at the meeting
        try:
            if d.hold and will and not self.keeper:
                raise SpecError(f"{self.worker} is a training worker, not a keeper (ELASTIC_KEEPER=1); a paused "
                                "job's state goes to keepers only")
            new_ranks = self._new_ranks(d, tag)
            # every member plans the way the publisher chose: a collective plan for some and a local
            # one for others would leave the first waiting in the exchange
            known = None if first else (self._replicated if self.worker == self._publisher(d)
                                        else self._shared(d, tag).get("replicated"))
            # replicas that only shrink: every member keeps its own copy and no byte crosses processes,
            # so no group of old and new members is built
            solo = known is not None and set(d.workers) <= set(d.old_ranks)
            clock.mark("ranks")
            self._building = d.generation
            self._comm_sockets.begin()
            if not first and not solo:
                self._union = self._raw_group(d, f"{tag}/union", sorted(d.members))
                if self.opts.device.startswith("cuda"):  # gloo carries no CUDA tensors point to point
                    self._union_bytes = self._raw_group(d, f"{tag}/union-nccl", sorted(d.members), nccl=True)
                clock.mark("union")
            if will:
                self._init_world(d, f"{tag}/train", new_ranks[self.worker], len(d.workers))
                clock.mark("world")
            self._building = None
            err = ""
            if will and not d.hold:  # a keeper builds no model: it holds what it receives as it is
                built, err = self._build_new(d, new_ranks)
                clock.mark("build")
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            if not first:
                from elastic.torch.state import training_state

                # what is not a tensor comes from the first old member, through the store; a member whose
                # new model is wrong says so in the plan's exchange, where every member hears it
                extras = self._kept_extras if self.worker == self._publisher(d) else self._shared(d, tag)["extras"]
                want = len(extras["groups"])
                if built is not None and len(built[1].param_groups) != want:
                    err = (f"{self.worker}: build: the new optimizer has {len(built[1].param_groups)} parameter "
                           f"groups, the running one {want}; build the same optimizer on every layout")
                dst = training_state(built[0], built[1], init_optimizer=True) if built is not None and not err else None
                if d.hold and will:
                    dst = self._holder(d, tag)
                group = NoPeers(sorted(d.members).index(self.worker), len(d.members)) if solo else self._union
                prep = prepare_reshard(self._src if was else None, dst, group=group, transport=self._union_bytes,
                                       errors=[err] if err else [], agree=False, known=known)
                clock.mark("plan")
            elif err:
                raise SpecError(err)
        except (SpecError, ReshardError) as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a lost peer, an aborted roll call: the meeting decides
            error = f"{type(e).__name__}: {_short(e, 300)}"
        finally:
            self._building = None
        if error and prep is None:
            # peers may be waiting for us in the union's collectives: their reads fail now, and they
            # arrive with their errors too, rather than at the groups' timeout
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            self._comm_sockets.cut()
        # 4. meet
        plan = {"new_ranks": new_ranks} if new_ranks else {}
        if prep is not None:
            plan.update(planned_bytes=prep.plan.bytes_planned, lower_bound_bytes=prep.plan.bytes_lower_bound,
                        plan_seconds=prep.plan_seconds)
        decision, reason = self._meet(d, prep.digest if prep is not None else _digest(new_ranks), plan, error)
        clock.mark("meet")
        if decision != "go":
            rec.error = f"rescale abandoned: {reason}"
            log.warning("worker %s: rescale to generation %d (%s) abandoned: %s", self.worker, d.generation,
                        d.layout, reason)
            self.reasons.append(rec.error)
            self._drop_union()
            if not was:
                self._drop_world()
                self._exit_notice()
                self._end("left")
                return None
            try:
                self._restore(d)
            except Exception as e:  # noqa: BLE001 - a peer lost meanwhile: the coordinator recovers the old layout
                self._stand_broken(d.switch_step, f"rebuilding {self.layout} after an abandoned rescale: "
                                                  f"{type(e).__name__}: {_short(e, 200)}")
            return d.switch_step
        # 5. move the bytes; a transactional rescale commits once every member has its part
        stats: Any = None
        try:
            if prep is not None:
                stats = execute_reshard(prep, verify=self.opts.verify_reshard)
                clock.mark("exchange")
            if d.rollback and not first:
                verdict, why = self._exchanged(d)
                clock.mark("commit")
                if verdict == "rollback":
                    raise _RolledBack(why)
                if verdict != "go":
                    self._drop_union()
                    self._drop_world()
                    self._exit_notice()
                    self._end("done")
                    return None
        except Exception as e:  # noqa: BLE001 - after go: back to the kept state, the coordinator recovers
            return self._exchange_broke(d, was, f"{type(e).__name__}: {_short(e, 200)}")
        self._drop_union()
        # 6. adopt (or leave)
        result = {"bytes_sent": getattr(stats, "bytes_sent", 0), "bytes_received": getattr(stats, "bytes_received", 0),
                  **{f"{k}_seconds": round(v, 4) for k, v in clock.seconds.items()},
                  "execute_seconds": getattr(stats, "execute_seconds", 0.0),
                  **({"describe_exchange_seconds": round(prep.exchange_seconds, 4),
                      "plan_compute_seconds": round(prep.plan_seconds, 4)} if prep is not None else {})}
        rec.bytes_moved = getattr(stats, "bytes_moved", 0)
        rec.bytes_lower_bound = getattr(stats, "bytes_lower_bound", 0)
        if not will:
            self._src = None
            self.model = self.optimizer = self.scheduler = None
            rec.done, rec.seconds = True, time.perf_counter() - t0
            self.client.call("result", generation=d.generation, ok=True, stats=result)
            self._leave()
            return None
        if d.hold:
            return self._hold(d, dst, extras, new_ranks, rec, result, t0)
        assert built is not None
        self._adopt(built, extras)
        self.gen, self.layout, self.ranks = d.generation, d.layout, dict(new_ranks)
        self._checks = bool(getattr(d, "give_up_checks", False))
        self._src, self.phase = None, "training"
        self.applied = d.switch_step - 1
        rec.done, rec.seconds = True, time.perf_counter() - t0
        # the parameters the code really builds (DTensors count their global size), for the planner's check
        params = sum(p.numel() for p in self.model.parameters()) if first else None
        self.client.call("result", generation=d.generation, ok=True,
                         stats={**result, "rank": new_ranks[self.worker], "seconds": rec.seconds,
                                **({"params": params} if params is not None else {})})
        return d.switch_step

    def _new_ranks(self, d: Directive, tag: str) -> dict[str, int]:
        """Which worker takes which position of the new mesh (the same map on every member)."""
        if not d.old_ranks:
            return {w: i for i, w in enumerate(d.workers)}
        if d.commit_step is not None:  # a recovery: the old groups are broken, the directive decides
            if self.worker in d.old_ranks and self._src is None and self.model is not None:
                self._src = self._freeze()
                self._drop_world()
            ranks = _recovery_ranks(d)
            if self.worker == self._publisher(d):
                self._publish(d, tag, ranks)
            return ranks
        if self.worker in d.old_ranks and (d.hold or self._held is not None):
            # into keepers, or out of them: any order keeps as many bytes local (none), so the
            # directive's, which every member knows
            if self._src is None:
                from elastic.torch.reshard import freeze

                if self._held is not None:
                    self._src, self._held = freeze(self._held), None
                else:
                    self._src = self._freeze()
                self._drop_world()
            ranks = {w: i for i, w in enumerate(d.workers)}
            if d.hold:  # every old member's keys (pipeline stages hold different ones), for the keepers
                from elastic.torch.keeper import key_table

                self._sign_set(d, f"{tag}/table/{self.worker}", key_table(self._src))
            if self.worker == self._publisher(d):
                self._publish(d, tag, ranks)
            return ranks
        if self.worker in d.old_ranks:
            if self._src is None:
                from elastic.torch.reshard import mesh_order
                from elastic.torch.state import training_state

                live = training_state(self.model, self.optimizer)
                old = {w: r for w, r in d.old_ranks.items()}
                n_old = len(old)
                joiners = [w for w in d.workers if w not in old]
                ids = {**old, **{w: n_old + i for i, w in enumerate(joiners)}}
                lay = d.layout
                replicas = _replicas_only(live, self.layout, lay)
                if replicas:
                    # every old member holds all of it: any order keeps every byte local, and each
                    # member knows this one without asking its peers (a collective saved in the pause)
                    order = sorted((ids[w] for w in d.workers), key=lambda i: (i >= n_old, i))
                else:
                    dims = self._dims(lay)
                    order = mesh_order(live, tuple(n for _, n in dims), new_members=[ids[w] for w in d.workers],
                                       mesh_dim_names=tuple(k for k, _ in dims))
                by_id = {v: w for w, v in ids.items()}
                ranks = {by_id[i]: pos for pos, i in enumerate(order)}
                self._src = self._freeze(live)
                self._drop_world()
                if replicas and self.worker == self._publisher(d):
                    # the whole state, which every old member holds: each member plans from it and
                    # its own new state, without the descriptions' exchange (another collective)
                    self._replicated = _replicated_source(self._src, d)
            else:  # back from an abandoned rescale's rebuild that itself broke: the directive decides
                ranks = {w: i for i, w in enumerate(d.workers)}
            if self.worker == self._publisher(d):
                self._publish(d, tag, ranks)
            return ranks
        return dict(self._shared(d, tag)["ranks"])

    def _publish(self, d: Directive, tag: str, ranks: dict[str, int]) -> None:
        """The first old member's word to the others: the new positions and what is not a tensor."""
        self._sign_set(d, f"{tag}/shared", {"ranks": ranks, "extras": self._kept_extras,
                                             "replicated": self._replicated})

    def _sign_set(self, d: Directive, key: str, value: Any) -> None:
        from elastic.train.rendezvous import sign

        self._store_for(d).set(key, sign(self.client.secret, pickle.dumps(value)))

    def _shared(self, d: Directive, tag: str) -> dict[str, Any]:
        """What the first old member published for directive ``d`` (waiting for it, given up with the rescale)."""
        if self._shared_cache is not None and self._shared_cache[0] == tag:
            return self._shared_cache[1]
        (out,) = self._signed_get(d, [f"{tag}/shared"], "the first old member's word (new ranks, optimizer settings)")
        self._shared_cache = (tag, out)
        return out

    def _signed_get(self, d: Directive, keys: list[str], what: str) -> list[Any]:
        """The values old members signed and set under ``keys`` (waiting for them, given up with the rescale)."""
        store = self._store_for(d)
        aborted = self._aborter(d.generation)
        deadline = time.monotonic() + self.opts.pg_timeout_s
        delay = 0.001
        while not store.check(keys):
            if (why := aborted()) is not None:
                raise RuntimeError(f"gloo rendezvous given up waiting for {what}: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {self.opts.pg_timeout_s:g} s waiting for {what}")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        from elastic.train.rendezvous import verify

        # the store has no authentication: only what a holder of the job's secret signed is unpickled
        return [pickle.loads(verify(self.client.secret, store.get(k), f"entry {k}")) for k in keys]  # noqa: S301

    def _control_ports(self, d: Directive) -> set[int]:
        """Ports of the connections that are not gloo's: the coordinator's HTTP and the job's store."""
        from urllib.parse import urlparse

        return {int(d.store_port), int(urlparse(self.client.url).port or 80)}

    @staticmethod
    def _publisher(d: Directive) -> str:
        return min(d.old_ranks, key=d.old_ranks.__getitem__)

    def _dims(self, layout: Layout) -> tuple[tuple[str, int], ...]:
        from elastic.train.userjob import mesh_of_json

        return mesh_of_json(self.config, layout)

    def _build_new(self, d: Directive | _Restore, new_ranks: dict[str, int]) -> tuple[Any, str]:
        """The user's ``build`` on the new mesh: ``(built, "")`` or ``(None, error)``."""
        from torch.distributed.device_mesh import DeviceMesh

        lay = d.layout
        dims = self._dims(lay)
        ml = MeshLayout(dims, tuple(range(len(d.workers))))
        try:
            mesh = DeviceMesh(self.opts.device.split(":")[0], torch.arange(len(d.workers)).reshape(ml.shape),
                              mesh_dim_names=ml.names)
            bound_gloo_timeouts(mesh.get_all_groups(), self.opts.pg_timeout_s)
            self.world = World(ml, mesh, new_ranks[self.worker], generation=d.generation, device=self.opts.device,
                               dp_name=self.config.get("mesh_dims", {}).get("dp"))
            if self.build is None:
                raise SpecError("no build: create the Manager (Manager(build, ...)) before the job's first directive")
            built = self.build(self.world)
            if not isinstance(built, tuple) or len(built) not in (2, 3):
                raise SpecError("build(world) must return (model, optimizer) or (model, optimizer, scheduler)")
            return built, ""
        except Exception as e:  # noqa: BLE001 - every member must hear of it and abandon together
            log.warning("worker %s: build on %s raised", self.worker, d.layout, exc_info=True)
            return None, f"{self.worker}: build raised {type(e).__name__}: {_short(e, 300)}"

    def _holder(self, d: Directive, tag: str) -> dict[str, Any]:
        """A keeper's ``dst`` of the pause: its share of every tensor, on a CPU mesh of the keepers."""
        from torch.distributed.device_mesh import DeviceMesh

        from elastic.torch.keeper import KEEP_DIM, holder_state

        table: dict[str, tuple] = {}
        for t in self._signed_get(d, [f"{tag}/table/{w}" for w in sorted(d.old_ranks)], "the old members' keys"):
            table.update(t)
        mesh = DeviceMesh("cpu", torch.arange(len(d.workers)), mesh_dim_names=(KEEP_DIM,))
        return holder_state(table, mesh)

    def _hold(self, d: Directive, dst: Any, extras: Any, new_ranks: dict[str, int], rec: RescaleRecord,
              result: dict[str, Any], t0: float) -> int:
        """A keeper with its share of the paused job's state: holds it and what is not a tensor, and
        waits (:meth:`ask` long-polls) for the directive that sends it on."""
        self._held, self._kept_extras = dst, extras
        self.applied = int(extras.get("applied", d.switch_step - 1)) if extras else d.switch_step - 1
        self.gen, self.layout, self.ranks = d.generation, d.layout, dict(new_ranks)
        self._src, self.phase = None, "held"
        rec.done, rec.seconds = True, time.perf_counter() - t0
        held = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in dst.values())
        log.info("worker %s: keeping %d bytes of the job's state (generation %d, step %d)", self.worker, held,
                 d.generation, d.switch_step)
        self.client.call("result", generation=d.generation, ok=True,
                         stats={**result, "rank": new_ranks[self.worker], "seconds": rec.seconds})
        return d.switch_step

    def _extras(self) -> dict[str, Any]:
        """What is not a tensor: the optimizer's hyperparameters (a scheduler changes them), the
        scheduler's state, the user's own state objects."""
        return {**carried(self.optimizer, self.scheduler, self.user_state), "applied": self.applied}

    def _adopt(self, built: tuple, extras: Any) -> None:
        self.model, self.optimizer = built[0], built[1]
        self.scheduler = built[2] if len(built) == 3 else None
        if extras is not None:
            apply_carried(extras, self.optimizer, self.scheduler, self.user_state)
        self._hook(self.optimizer)

    def _hook(self, opt: Any) -> None:
        """Know whether an optimizer update is in progress (a step broken inside it cannot be recovered)
        and which step's update completed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooked = None
        self._in_update = False
        if opt is None or not hasattr(opt, "register_step_pre_hook"):
            return

        def pre(*_: Any) -> None:
            self._in_update = True

        def post(*_: Any) -> None:
            self._in_update = False
            if self.in_flight is not None:
                self.applied = self.in_flight

        self._hooks = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
        self._hooked = opt

    def _restore(self, d: Directive) -> None:
        """An abandoned rescale: the old layout again, from the kept state (every byte local)."""
        from elastic.torch.reshard import reshard
        from elastic.torch.state import training_state

        assert self.layout is not None
        if self._src is None and self.model is not None:
            return  # the old groups were never dropped: the old model trains on as it is
        mine = self._kept_extras
        self._drop_world()
        old = {w: r for w, r in self.ranks.items()}
        fake = _Restore(d.job, self.gen, self.layout, tuple(sorted(old, key=old.__getitem__)), d.store_host,
                        d.store_port)
        self._building = self.gen
        try:
            self._comm_sockets.begin()
            self._init_world(fake, f"{d.job}/u{d.generation}.{d.switch_step}/restore", old[self.worker], len(old))
            built, err = self._build_new(fake, old)
            self._comm_sockets.end(exclude_ports=self._control_ports(d))
            if err:
                raise SpecError(f"rebuilding the old layout {self.layout} after the abandoned rescale: {err}")
            stats = reshard(self._src, training_state(built[0], built[1], init_optimizer=True), group=None)
        finally:
            self._building = None
        self._adopt(built, mine)
        self._src = None
        self.phase = "training"
        log.info("worker %s: back on %s (rebuilt, %d bytes moved)", self.worker, self.layout, stats.bytes_moved)

    def _freeze(self, live: Any = None) -> Any:
        from elastic.torch.reshard import freeze
        from elastic.torch.state import training_state

        self._kept_extras = self._extras()
        return freeze(live if live is not None else training_state(self.model, self.optimizer))

    def _exchange_broke(self, d: Directive, was: bool, error: str) -> int | None:
        """A peer was lost after ``go``, before the commit: old members stand again as the old
        generation's members on their kept state; a joiner has nothing to go back to."""
        log.warning("worker %s: the rescale to generation %d broke (%s)", self.worker, d.generation, error)
        self._comm_sockets.cut()
        self._drop_union()
        self._drop_world()
        if not was:
            try:
                self.client.call("broken", generation=d.generation, step=d.switch_step, applied=-1, error=error,
                                 ready=None, dirty=False, local_apply=False)
            except Exception:  # noqa: BLE001
                pass
            self._exit_notice()
            self._end("left")
            return None
        self._stand_broken(d.switch_step, f"rescale to generation {d.generation} broke: {error}")
        return d.switch_step

    def _stand_broken(self, step: int, error: str) -> None:
        """Stand as a member of the current generation whose step ``step`` broke, holding the kept state,
        and report it; the coordinator's recovery directive comes as a ``switch`` (see :meth:`ask`)."""
        self._drop_world()
        self.model = self.optimizer = self.scheduler = None
        self.phase = "broken"
        self.client.call("broken", generation=self.gen, step=step, applied=self.applied, error=error, ready=None,
                         dirty=False, local_apply=True)


@dataclass(frozen=True)
class _Restore:
    """The old generation as a directive-like value (for rebuilding it after an abandoned rescale)."""

    job: str
    generation: int
    layout: Layout
    workers: tuple[str, ...]
    store_host: str
    store_port: int


def bound_gloo_timeouts(groups: Any, seconds: float) -> None:
    """Give the gloo groups of a generation's mesh the job's ``pg_timeout_s``. torch builds a
    ``DeviceMesh``'s groups with its own default (30 minutes on gloo), not the default group's: a
    collective that cutting the connections cannot fail (a send gloo had queued when its connection
    broke) then blocks its survivor for that long, past any recovery; with ``pg_timeout_s`` it raises
    within the time the coordinator waits for a survivor that holds the only copy of a shard. NCCL
    groups keep their own timeout (their watchdog ends the process when one passes)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=seconds)
    for g in groups:
        try:
            backend = g._get_backend(torch.device("cpu"))
        except RuntimeError:  # no CPU backend on this group
            continue
        if isinstance(backend, dist.ProcessGroupGloo):
            backend._set_default_timeout(timeout)


def _recovery_ranks(d: Directive) -> dict[str, int]:
    """Recovery positions: each survivor keeps its tensor/pipeline coordinate, replicas renumbered in the
    directive's order (its complete replicas first); the directive's order where that is no bijection."""
    old, new = d.old_layout, d.layout
    assert old is not None  # a recovery has an old generation
    replicas: dict[int, int] = {}
    out: dict[str, int] = {}
    for w in d.workers:
        t, r, p = old.coords(d.old_ranks[w])
        k = replicas.setdefault(r, len(replicas))
        if k >= new.dp or t >= new.tp or p >= new.pp:
            return {w: i for i, w in enumerate(d.workers)}
        out[w] = new.rank(t, k, p)
    if sorted(out.values()) != list(range(len(d.workers))):
        return {w: i for i, w in enumerate(d.workers)}
    return out


def _replicas_only(live: Any, old: Layout | None, new: Layout) -> bool:
    """Plain data parallelism on both sides: no tensor or pipeline split, and no DTensor in the
    state (no FSDP shard): every old member's state is the whole of it."""
    from elastic.torch.regions import is_dtensor

    return (old is not None and old.tp == old.pp == new.tp == new.pp == 1
            and not any(is_dtensor(t) for t in live.values()))


def _replicated_source(src: Any, d: Directive) -> Any:
    """The old state as every member's known source of directive ``d`` (ranks in the union group,
    whose members are ``d.members`` in sorted order); None (exchange the descriptions) if it holds
    a DTensor after all."""
    from elastic.reshard.plan import ReshardError
    from elastic.torch.reshard import replicated

    members = sorted(d.members)
    try:
        return replicated(src, [i for i, w in enumerate(members) if w in d.old_ranks],
                          [i for i, w in enumerate(members) if w in d.workers])
    except ReshardError:
        return None


def _digest(ranks: dict[str, int]) -> str:
    return hashlib.blake2b(json.dumps(sorted(ranks.items())).encode(), digest_size=12).hexdigest()
