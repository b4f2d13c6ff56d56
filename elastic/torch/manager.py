"""Wrap a user's own training loop so that it rescales in place at step boundaries.

What it is for: the user keeps their loop, model code and parallelize code; the Manager owns
the world (which processes train, on which mesh), hands each rank its share of every step's
samples, and at a rescale builds the new layout through the user's ``build`` and moves the
training state into it with :func:`elastic.torch.reshard`::

    mgr = Manager(build, global_batch=12, micro_batch_size=3, corpus=corpus, schedule=schedule)
    mgr.start()
    for step in mgr.steps():                      # only the steps this process trains
        model, opt = mgr.model, mgr.optimizer     # rebuilt by a rescale (a joiner gets its first here)
        for batch in mgr.micro_batches(step):     # this rank's share of the step's samples
            (loss_fn(model(batch.inputs), batch.labels) * batch.weight).backward()
        opt.step(); opt.zero_grad()
        mgr.step_done(step)                       # at a rescale: new mesh, state moved in place

``build(world)`` returns ``(model, optimizer)`` or ``(model, optimizer, scheduler)`` on
``world.mesh``; a scheduler's ``state_dict`` travels with the state, and so does every object
given in ``state=`` (anything with ``state_dict``/``load_state_dict``). Without a ``schedule``,
``Manager(...)`` is the coordinator-driven :class:`elastic.torch.coordinated.CoordinatedManager`
(a worker of a job the controller launched and rescales). With one, this module is the
*local* directive source: a fixed world of processes (``torch.distributed.run``, a test pool)
and a ``schedule`` of layouts by step, the same on every process. Every process of the world
takes part in every rescale's collectives (mesh creation is collective); a process outside the
current layout waits inside ``steps()`` until a layout includes it, and its ``steps()`` ends
when no later layout does. A rescale whose ``build`` raises on any rank, or whose state cannot
be moved, is abandoned on every rank alike: the old layout trains on, and the error is in
:attr:`Manager.errors`. ``build`` usually communicates (``distribute_tensor`` scatters from the
mesh's first rank): a rank that raises before those collectives leaves its peers waiting in
them until the process group's timeout, after which they raise too and the rescale is
abandoned all the same.

Must not: run user code on any thread but the caller's, or change the samples a step trains on
(they depend on the step only, :mod:`elastic.torch.data`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import SpecError

__all__ = ["DP_DIMS", "Manager", "MeshLayout", "RNGState", "RescaleRecord", "World"]

#: mesh dim names that split the data (the others, e.g. "tp", see the same samples)
DP_DIMS = ("dp", "dp_shard", "dp_replicate")


@dataclass(frozen=True)
class MeshLayout:
    """A mesh: dim names, sizes, and the world ranks it holds in row-major order."""

    dims: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, ranks: Sequence[int], **dims: int) -> MeshLayout:
        """``MeshLayout.of([0, 1, 2, 3], dp_shard=2, tp=2)``."""
        return cls(tuple((k, int(v)) for k, v in dims.items()), tuple(int(r) for r in ranks))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.dims)

    def check(self, world_size: int, field_name: str = "layout") -> None:
        if not self.dims or any(n < 1 for n in self.shape):
            raise SpecError(f"{field_name}: mesh dims {dict(self.dims)} must be positive sizes, e.g. dp_shard=2, tp=2")
        if math.prod(self.shape) != len(self.ranks):
            raise SpecError(f"{field_name}: mesh {dict(self.dims)} has {math.prod(self.shape)} positions but "
                            f"{len(self.ranks)} ranks {list(self.ranks)}; give one rank per position")
        if len(set(self.ranks)) != len(self.ranks) or not all(0 <= r < world_size for r in self.ranks):
            raise SpecError(f"{field_name}: ranks {list(self.ranks)} must be distinct ranks of the world "
                            f"(0..{world_size - 1})")
        dp = [k for k in self.names if k in DP_DIMS]
        if len(dp) > 1:
            raise SpecError(f"{field_name}: one data-parallel dim is supported, got {dp}; name it one of {DP_DIMS}")
        if len(set(self.names)) != len(self.names):
            raise SpecError(f"{field_name}: mesh dim names {list(self.names)} repeat")
        grid = torch.tensor(self.ranks).reshape(self.shape)
        for d, name in enumerate(self.names):
            if name in DP_DIMS or self.shape[d] == 1:
                continue
            # torch's tensor-parallel and pipeline code mixes mesh coordinates with sorted group
            # ranks: on a dim whose ranks do not ascend it computes wrongly (data-parallel dims,
            # FSDP2 and DDP, are fine in any order)
            if not bool((grid.diff(dim=d) > 0).all()):
                raise SpecError(f"{field_name}: the ranks along mesh dim {name!r} do not ascend ({list(self.ranks)} "
                                f"as {list(self.shape)}); order them so that only data-parallel dims are permuted")


@dataclass
class World:
    """What ``build`` gets: the layout, its mesh (every process has it), this process's place.

    ``device``: where the model goes (``cpu``, or this worker's ``cuda`` device under a job);
    ``generation``: the job's layout generation (0 under a local schedule); ``dp_name``: the
    data-parallel dim's name when it is none of :data:`DP_DIMS` (a job's ``mesh_dims``)."""

    layout: MeshLayout
    mesh: Any  # torch DeviceMesh
    rank: int
    generation: int = 0
    device: str = "cpu"
    dp_name: str | None = None

    @property
    def member(self) -> bool:
        return self.rank in self.layout.ranks

    def size(self, dim: str) -> int:
        """The size of mesh dim ``dim`` (1 for a dim this layout does not have)."""
        return dict(self.layout.dims).get(dim, 1)

    @property
    def coordinate(self) -> dict[str, int]:
        """This process's index on each mesh dim (empty when the layout does not include it)."""
        if not self.member:
            return {}
        return {name: int(self.mesh[name].get_local_rank()) for name in self.layout.names}

    @property
    def dp_dim(self) -> str | None:
        if self.dp_name is not None and self.dp_name in self.layout.names:
            return self.dp_name
        return next((k for k in self.layout.names if k in DP_DIMS), None)

    @property
    def dp_size(self) -> int:
        d = self.dp_dim
        return dict(self.layout.dims)[d] if d else 1

    @property
    def dp_rank(self) -> int:
        """This process's index on the data-parallel dim (its tensor-parallel peers share it)."""
        d = self.dp_dim
        if d is None or not self.member:
            return 0
        return int(self.mesh[d].get_local_rank())

    @property
    def dp_group(self) -> Any:
        d = self.dp_dim
        return self.mesh[d].get_group() if d and self.member else None


def carried(optimizer: Any, scheduler: Any, user_state: Mapping[str, Any]) -> dict[str, Any]:
    """What a rescale carries that is not a tensor: the optimizer's hyperparameters (a scheduler
    changes them), the scheduler's state and the user's own state objects."""
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if optimizer is not None else [],
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "user": {k: v.state_dict() for k, v in user_state.items()}}


def apply_carried(kept: Mapping[str, Any], optimizer: Any, scheduler: Any, user_state: Mapping[str, Any]) -> None:
    """:func:`carried` of the old layout, applied to the new one's objects."""
    for g, old in zip(optimizer.param_groups, kept["groups"], strict=True):
        g.update(old)
    if scheduler is not None and kept["scheduler"] is not None:
        scheduler.load_state_dict(kept["scheduler"])
    for k, sd in kept["user"].items():
        if k in user_state:
            user_state[k].load_state_dict(sd)


class RNGState:
    """Torch's random number generators (CPU, and CUDA when there is one) as state that travels with a
    rescale: ``Manager(..., state={"rng": RNGState()})``. Every new rank gets the first old rank's
    generators, so dropout and sampling go on as on that rank (give each rank its own stream from
    it, e.g. by seeding with the rank, if they must differ)."""

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


@dataclass
class RescaleRecord:
    """One rescale as this process saw it."""

    step: int  # the first step of the new layout
    to: MeshLayout
    done: bool
    error: str | None = None
    bytes_moved: int = 0
    bytes_lower_bound: int = 0
    seconds: float = 0.0
    role: str = ""  # "stays", "joins", "leaves", "idle"


class Manager:
    """The user's loop, rescaled in place by a local schedule of layouts (see the module doc).

    ``schedule``: ``{first step: MeshLayout}`` with an entry at step 0, or a sequence of
    ``(step, MeshLayout)``. ``total_steps``: where ``steps()`` ends. ``corpus``: any sample
    source with ``len()`` and ``samples(indices)`` (:class:`elastic.torch.data.TokenCorpus`).
    """

    def __new__(cls, *args: Any, **kw: Any) -> Manager:
        # no schedule: the layouts come from the job's coordinator (a worker the controller launched)
        if cls is Manager and kw.get("schedule") is None:
            from elastic.torch.coordinated import CoordinatedManager

            return super().__new__(CoordinatedManager)
        return super().__new__(cls)

    def __init__(self, build: Callable[[World], tuple], *, global_batch: int, schedule: Mapping[int, MeshLayout]
                 | Sequence[tuple[int, MeshLayout]], total_steps: int, corpus: Any = None,
                 micro_batch_size: int | None = None, seed: int = 0, group: Any = None, device: str = "cpu",
                 state: Mapping[str, Any] | None = None):
        if not dist.is_initialized():
            raise SpecError("Manager: torch.distributed is not initialised; call init_process_group first "
                            "(torch.distributed.run sets its environment)")
        self.build = build
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        items = sorted((dict(schedule) if isinstance(schedule, Mapping) else dict(schedule)).items())
        if not items or items[0][0] != 0:
            raise SpecError("schedule: needs the layout of step 0, e.g. {0: MeshLayout.of([0, 1], dp_shard=2)}")
        for s, lay in items:
            if not isinstance(lay, MeshLayout):
                raise SpecError(f"schedule[{s}]: a {type(lay).__name__}, expected a MeshLayout")
            lay.check(self.world_size, f"schedule[{s}]")
        if micro_batch_size is not None and int(micro_batch_size) < 1:
            raise SpecError(f"micro_batch_size: {micro_batch_size}; give the most samples a rank computes at once (>= 1)")
        if int(global_batch) < 1:
            raise SpecError(f"global_batch: {global_batch}; give the number of samples per step (>= 1)")
        for s, lay in items:
            dp = World(lay, None, self.rank).dp_size
            if global_batch % dp:
                raise SpecError(f"global_batch: {global_batch} samples do not split over the {dp} data-parallel "
                                f"ranks of schedule[{s}]; make it a multiple of every layout's dp size")
        self.schedule = dict(items)
        self.total_steps = int(total_steps)
        self.global_batch = int(global_batch)
        self.micro_batch_size = micro_batch_size
        self.corpus = corpus
        self.seed = seed
        self.device = device
        self.world: World | None = None
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.records: list[RescaleRecord] = []
        self.user_state = dict(state or {})
        self._next = 0  # the step whose boundary has been handled
        self._groups: dict[tuple[int, ...], Any] = {}

    @property
    def errors(self) -> list[str]:
        return [f"step {r.step}: {r.error}" for r in self.records if r.error]

    # ---- the loop ----------------------------------------------------------------------------

    def start(self) -> tuple[Any, Any]:
        """Build the layout of step 0; ``(None, None)`` on a process it does not include."""
        if self.world is not None:
            raise SpecError("start() was called twice")
        self.world = self._make_world(self.schedule[0])
        if self.world.member:
            self._adopt(self.build(self.world))
        return self.model, self.optimizer

    def steps(self) -> Iterator[int]:
        """The steps this process trains, in order; rescales happen at their boundaries."""
        if self.world is None:
            raise SpecError("call start() before steps()")
        step = self._next
        while step < self.total_steps:
            if step != self._next:
                raise SpecError(f"step_done({step - 1}) was not called: call it at the end of every step")
            if step in self.schedule and step > 0 and not self._handled(step):
                self._rescale(step)
            if self.world.member:
                yield step
                step += 1
            else:
                later = [s for s in self.schedule if s > step]
                if not later:
                    return
                step = later[0]
                self._next = step

    def step_done(self, step: int, loss: Any = None) -> tuple[Any, Any]:
        """End of ``step``: at a boundary, rescale; the model and optimizer to train the next step with.
        (``loss`` is for a job's loss history; a local schedule keeps none.)"""
        if step != self._next:
            raise SpecError(f"step_done({step}): the step in progress is {self._next}")
        self._next = step + 1
        if self._next in self.schedule and self._next < self.total_steps:
            self._rescale(self._next)
        return self.model, self.optimizer

    def micro_batches(self, step: int) -> Iterator[Any]:
        """This rank's micro-batches of ``step`` (:func:`elastic.torch.data.micro_batches`)."""
        from elastic.torch.data import micro_batches

        if self.corpus is None:
            raise SpecError("Manager(corpus=...) is needed for micro_batches(); give a TokenCorpus")
        w = self.world
        if w is None or not self._trains():
            raise SpecError(f"micro_batches({step}): this process trains in no layout at this step")
        mbs = self.micro_batch_size or self.global_batch // w.dp_size
        for b in micro_batches(self.corpus, step, global_batch=self.global_batch, dp_rank=w.dp_rank,
                               dp_size=w.dp_size, micro_batch_size=mbs, seed=self.seed):
            self._before_batch()
            yield b.to(self.device) if self.device != "cpu" else b

    def _trains(self) -> bool:
        return self.world is not None and self.world.member

    def _before_batch(self) -> None:
        """Called before each micro-batch is handed out (a job's Manager stops a step whose peer was lost)."""

    # ---- rescale -----------------------------------------------------------------------------

    def _handled(self, step: int) -> bool:
        return any(r.step == step for r in self.records)

    def _make_world(self, layout: MeshLayout) -> World:
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.tensor(layout.ranks).reshape(layout.shape)
        return World(layout, DeviceMesh(self.device, grid, mesh_dim_names=layout.names), self.rank)

    def _union_group(self, ranks: tuple[int, ...]) -> Any:
        g = self._groups.get(ranks)
        if g is None:  # every process of the world calls new_group, members or not
            g = self._groups[ranks] = dist.new_group(list(ranks))
        return g

    def _adopt(self, built: tuple) -> None:
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise SpecError("build(world) must return (model, optimizer) or (model, optimizer, scheduler)")
        self.model, self.optimizer = built[0], built[1]
        self.scheduler = built[2] if len(built) == 3 else None

    def _rescale(self, step: int) -> None:
        from elastic.torch.caches import clear_dtensor_caches

        t0 = time.perf_counter()
        # a layout may repeat an earlier mesh (same ranks and dims, new groups); torch's DTensor
        # caches would hand the new model the earlier mesh on some ranks and not others, depending
        # on each rank's history: every process clears them here and once the new layout is in force
        clear_dtensor_caches()
        old = self.world
        assert old is not None
        new_layout = self.schedule[step]
        new = self._make_world(new_layout)
        union = tuple(sorted(set(old.layout.ranks) | set(new_layout.ranks)))
        group = self._union_group(union)
        rec = RescaleRecord(step, new_layout, done=False)
        self.records.append(rec)
        if self.rank not in union:
            rec.role = "idle"
        else:
            self._move(step, old, new, union, group, rec)
        # every process of the world, idle ones too, must agree on the layout now in force: the
        # next rescale's union group is built from it
        outcome: list[Any] = [None] * self.world_size
        dist.all_gather_object(outcome, rec.error if rec.role != "idle" else None, group=self.group)
        failed = next((e for e in outcome if e), None)
        clear_dtensor_caches()
        if failed is None:
            self.world = new
            rec.done = True
            rec.seconds = time.perf_counter() - t0
        elif rec.role == "idle":
            rec.error = failed

    def _move(self, step: int, old: World, new: World, union: tuple[int, ...], group: Any,
              rec: RescaleRecord) -> None:
        """The union's part of a rescale: build, agree, reshard, carry the non-tensor state."""
        from elastic.reshard.plan import ReshardError
        from elastic.torch.reshard import reshard
        from elastic.torch.state import training_state

        was, will = old.member, new.member
        rec.role = "stays" if was and will else ("joins" if will else "leaves")
        built, error = None, None
        if will:
            try:
                built = self.build(new)
                if not isinstance(built, tuple) or len(built) not in (2, 3):
                    raise SpecError("build(world) must return (model, optimizer) or (model, optimizer, scheduler)")
            except Exception as e:  # noqa: BLE001 - every rank must hear of it and abandon together
                error = f"rank {self.rank}: build raised {type(e).__name__}: {e}"
        # one exchange before any byte moves: build errors, and what is not a tensor (the
        # optimizer's hyperparameters, which a scheduler changes, and the scheduler's state)
        extra = None
        if was:
            extra = carried(self.optimizer, self.scheduler, self.user_state)
        n_groups = len(built[1].param_groups) if built is not None and error is None else None
        told: list[Any] = [None] * len(union)
        dist.all_gather_object(told, (error, extra, n_groups), group=group)
        kept = told[union.index(min(old.layout.ranks))][1]
        bad = [e for e, _, _ in told if e]
        want = len(kept["groups"])
        bad += [f"rank {union[i]}: build: the new optimizer has {n} parameter groups, the running one {want}; "
                "build the same optimizer on every layout" for i, (_, _, n) in enumerate(told) if n not in (None, want)]
        if bad:
            rec.error = "rescale abandoned: " + "; ".join(bad[:3])
            return  # the old layout trains on; the new mesh is simply not used
        src = training_state(self.model, self.optimizer) if was else None
        dst = training_state(built[0], built[1], init_optimizer=True) if will else None
        try:
            stats = reshard(src, dst, group=group)
        except ReshardError as e:  # raised on every rank alike, before any byte moved
            rec.error = f"rescale abandoned: {e}"
            return
        if will:
            self._adopt(built)
            apply_carried(kept, self.optimizer, self.scheduler, self.user_state)
        else:
            self.model = self.optimizer = self.scheduler = None
        rec.bytes_moved, rec.bytes_lower_bound = stats.bytes_moved, stats.bytes_lower_bound

