"""The example Llama under named layouts on sub-meshes of one world, trained and resharded in place.

Jobs here run in the processes of ``tests/reshard/_mp.py``'s pool. Every process of the world
stays in the world group the whole job (what changes is which of them a layout's mesh holds),
so a layout's mesh is built by every process (``DeviceMesh`` creates its groups collectively)
and the reshard between two layouts runs over the world group: old workers pass ``src``, new
workers ``dst``, survivors both.

A layout is a name and the world ranks its mesh holds in row-major order:

- ``single``: one process, the plain model;
- ``ddp<n>``: ``DistributedDataParallel`` over ``n`` processes (plain, replicated tensors);
- ``fsdp<n>``: FSDP2 over ``n``;
- ``tp<n>``: tensor parallel over ``n`` (torchtitan's plan: column/row-wise projections,
  sequence-parallel norms, vocab-parallel embedding and head, the loss under ``loss_parallel``);
- ``fsdp<a>xtp<b>``: both, on an ``(a, b)`` mesh (FSDP2's ``_StridedShard`` on dim 0);
- ``pp<s>`` / ``pp<s>xtp<b>``: ``s`` pipeline stages (``torch.distributed.pipelining``, GPipe,
  two microbatches), each stage a subset of the model's keys, optionally tensor parallel.

Every layout trains on the same global batch of ``BATCH`` rows per step (split over the
data-parallel ranks), so every layout follows the single process's loss curve.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from examples.llama.model import Llama, LlamaConfig

SEED = 11
BATCH = 12  # rows per global batch: divisible by every data-parallel width used (1, 2, 3, 4)
CFG = LlamaConfig.tiny()
LR = 1e-2


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@functools.cache
def _corpus() -> torch.Tensor:
    # real text, no download: a standard-library source file as bytes
    text = Path(sysconfig.get_paths()["stdlib"], "dataclasses.py").read_bytes()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch(step: int, rows: int = BATCH, seed: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same in every process and under every layout."""
    data, n = _corpus(), CFG.max_seq_len
    g = torch.Generator().manual_seed(seed + step)
    starts = torch.randint(0, len(data) - n - 1, (rows,), generator=g)
    rows = torch.stack([data[s:s + n + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ddp: bool = False

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp


def parse(name: str) -> Shape:
    if name == "single":
        return Shape()
    m = re.fullmatch(r"(?:(pp|ddp|fsdp)(\d+))?(?:x?tp(\d+))?", name)
    if not m or not name:
        raise ValueError(f"layout {name!r}: expected single, ddp<n>, fsdp<n>, tp<n>, fsdp<a>xtp<b>, pp<s>[xtp<b>]")
    kind, k, tp = m.group(1), int(m.group(2) or 1), int(m.group(3) or 1)
    if kind == "pp":
        return Shape(pp=k, tp=tp)
    return Shape(dp=k, tp=tp, ddp=kind == "ddp")


@dataclass
class Job:
    """One worker's model under one layout (``model is None`` on a process the mesh leaves out)."""

    name: str
    ranks: tuple[int, ...]
    shape: Shape
    mesh: Any
    model: Any = None
    optimizer: Any = None
    stage: int = 0
    step_fn: Callable[[int], float | None] | None = None
    module: Any = None  # the unwrapped model (DDP's .module)

    @property
    def member(self) -> bool:
        return self.model is not None

    def state(self, *, init_optimizer: bool = False) -> dict[str, torch.Tensor] | None:
        from elastic.torch import training_state

        if not self.member:
            return None
        return training_state(self.model, self.optimizer, init_optimizer=init_optimizer)

    def train(self, steps: range) -> dict[int, float]:
        """The loss of every step of ``steps`` (empty on a pipeline stage that computes none)."""
        losses = {}
        for s in steps:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step_fn(s)
            self.optimizer.step()
            if loss is not None:
                losses[s] = loss
        return losses


def build(name: str, ranks: tuple[int, ...], *, dtype: torch.dtype = torch.float64, cfg: LlamaConfig = CFG,
          seed: int = SEED, optimizer: Callable[[Any], Any] | None = None) -> Job:
    """``name`` on the world ranks ``ranks`` (every process of the world calls this)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from examples.llama import parallel as par

    shape = parse(name)
    if len(ranks) != shape.size:
        raise ValueError(f"layout {name} needs {shape.size} ranks, got {ranks}")
    pp = shape.pp > 1
    dims = ("pp", "tp") if pp else ("dp_shard", "tp")
    grid = torch.tensor(ranks).reshape((shape.pp, shape.tp) if pp else (shape.dp, shape.tp))
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=dims)
    job = Job(name, tuple(ranks), shape, mesh)
    if dist.get_rank() not in ranks:
        return job
    model = Llama(cfg).to(dtype).init_weights(seed)
    if pp:
        job.stage = mesh["pp"].get_local_rank()
        par.pipeline_stage_module(model, job.stage, shape.pp)
    if shape.ddp:
        from torch.nn.parallel import DistributedDataParallel

        job.module = model
        model = DistributedDataParallel(model, process_group=mesh["dp_shard"].get_group())
    else:
        par.parallelize(model, mesh, loss_parallel=not pp)
        job.module = model
    job.model = model
    job.optimizer = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1)))(model.parameters())
    job.step_fn = _pipeline_step(job) if pp else _dp_step(job)
    return job


def _dp_step(job: Job) -> Callable[[int], float]:
    import torch.distributed as dist

    from examples.llama import parallel as par

    dp = job.mesh["dp_shard"]
    rows = BATCH // dp.size()

    def step(s: int) -> float:
        x, y = batch(s)
        lo = dp.get_local_rank() * rows
        logits = job.model(x[lo:lo + rows])
        with par.loss_context(logits):
            loss = par.loss_fn(logits, y[lo:lo + rows])
            loss.backward()
        value = par.unwrap_loss(loss).detach().clone()
        if dp.size() > 1:
            dist.all_reduce(value, group=dp.get_group())
        return value.item() / dp.size()

    return step


def _pipeline_step(job: Job) -> Callable[[int], float | None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from examples.llama import parallel as par

    stage = PipelineStage(job.model, job.stage, job.shape.pp, torch.device("cpu"), group=job.mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=par.loss_fn)
    last = job.stage == job.shape.pp - 1

    def step(s: int) -> float | None:
        x, y = batch(s)
        if job.stage == 0:
            schedule.step(x)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=y if last else None, losses=losses if last else None)
        return torch.stack(losses).mean().item() if last else None

    return step


# --------------------------------------------------------------------------------------------
# Looking at state
# --------------------------------------------------------------------------------------------


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)  # a 0-d tensor (Adam's step) has no byte view
    head = f"{tuple(t.shape)}|{t.dtype}|".encode()
    return hashlib.blake2b(head + t.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def full_digests(state: dict[str, torch.Tensor] | None) -> dict[str, str]:
    """Every key's full tensor, hashed (collective over each DTensor's mesh: every holder calls it)."""
    if state is None:
        return {}
    return {k: digest(full(v)) for k, v in sorted(state.items())}


def local_digests(state: dict[str, torch.Tensor] | None) -> dict[str, str]:
    from elastic.torch.regions import local_tensor

    return {k: digest(local_tensor(v)) for k, v in sorted((state or {}).items())}


def init(rank: int, n: int, port: int) -> None:
    """A fresh gloo world for one job of a reused pool process (see elastic.torch.caches)."""
    import torch.distributed as dist

    from elastic.torch.caches import clear_dtensor_caches

    clear_dtensor_caches()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))


# --------------------------------------------------------------------------------------------
# The chain job: train, reshard, train, ...
# --------------------------------------------------------------------------------------------


def _dcp_state(job: Job) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def chain_job(rank: int, n: int, port: int, chain: list[tuple[str, tuple[int, ...] | None]], steps: int,
              dcp_dir: str | None = None, dtype_name: str = "float64") -> dict[str, Any]:
    """Train ``steps`` steps under each layout of ``chain``, resharding in place between them.

    A layout's ranks ``None`` means: the first ``size`` ranks of the world, ordered by
    :func:`elastic.torch.mesh_order` from the previous layout's state. With ``dcp_dir``,
    every transition is also done the checkpoint way (DCP save by the old workers, load into
    a second new model) and the two new models train side by side: their losses and states
    are compared bit for bit.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from elastic.torch import mesh_order, reshard

    init(rank, n, port)
    dtype = getattr(torch, dtype_name)
    try:
        out: dict[str, Any] = {"losses": {}, "transitions": []}
        name, ranks = chain[0]
        job = build(name, ranks or tuple(range(parse(name).size)), dtype=dtype)
        s = 0
        if job.member:
            out["losses"].update(job.train(range(s, s + steps)))
        s += steps
        for i, (name, ranks) in enumerate(chain[1:]):
            src = job.state()
            before = full_digests(src)
            src_local = local_digests(src)
            shape = parse(name)
            if ranks is None:
                dims = (shape.pp, shape.tp) if shape.pp > 1 else (shape.dp, shape.tp)
                order = mesh_order(src, dims, new_members=list(range(shape.size)),
                                   mesh_dim_names=("pp", "tp") if shape.pp > 1 else ("dp_shard", "tp"))
                # mesh_order picks which ranks share each tp group; within a group torch places
                # data by sorted rank anyway, and its tensor-parallel modules compute wrongly on a
                # tp dim whose ranks do not ascend (offsets from mesh coordinates, collectives by
                # group rank): sort each row, which moves no data
                ranks = tuple(r for i in range(0, len(order), shape.tp) for r in sorted(order[i:i + shape.tp]))
            new = build(name, ranks, dtype=dtype)
            dst = new.state(init_optimizer=True)
            stats = reshard(src, dst)
            after = full_digests(dst)
            rec: dict[str, Any] = {
                "to": name, "ranks": ranks, "before": before, "after": after,
                "src_intact": local_digests(src) == src_local,
                "bytes_moved": stats.bytes_moved, "bytes_lower_bound": stats.bytes_lower_bound,
                "messages": stats.messages, "leavers": stats.leavers, "joiners": stats.joiners,
                "scalars": stats.scalars, "member": new.member,
            }
            twin = None
            if dcp_dir is not None:
                folder = f"{dcp_dir}/t{i}"
                old_group = dist.new_group(list(job.ranks))
                new_group = dist.new_group(list(new.ranks))
                if job.member:
                    dcp.save(_dcp_state(job), checkpoint_id=folder, process_group=old_group)
                dist.barrier()
                twin = build(name, ranks, dtype=dtype)
                if twin.member:
                    sd = _dcp_state(twin)
                    dcp.load(sd, checkpoint_id=folder, process_group=new_group)
                    set_state_dict(twin.model, twin.optimizer, model_state_dict=sd["model"],
                                   optim_state_dict=sd["optim"])
                    rec["dcp_equal"] = local_digests(twin.state()) == local_digests(dst)
            job = new
            if job.member:
                # the moved step count must be what the optimizer now steps with (its own zero-lr
                # first step set it to 1)
                rec["step_scalars"] = sorted({float(v.item()) for st in job.optimizer.state.values()
                                              for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 0})
            out["transitions"].append(rec)
            if job.member:
                losses = job.train(range(s, s + steps))
                out["losses"].update(losses)
                if twin is not None:
                    rec["dcp_losses_equal"] = twin.train(range(s, s + steps)) == losses
                    rec["dcp_states_equal"] = local_digests(twin.state()) == local_digests(job.state())
            s += steps
        out["final"] = full_digests(job.state())
        # full_tensor is collective over the mesh: every member gathers, the first one reports
        fulls = {k: full(v) for k, v in job.state().items()} if job.member else None
        out["final_full"] = fulls if rank == job.ranks[0] else None
        return out
    finally:
        dist.destroy_process_group()


def reference_job(rank: int, n: int, port: int, total_steps: int, dtype_name: str = "float64") -> dict[str, Any]:
    """The single process that never reshards."""
    import torch.distributed as dist

    init(rank, n, port)
    try:
        job = build("single", (0,), dtype=getattr(torch, dtype_name))
        losses = job.train(range(total_steps))
        return {"losses": losses, "final_full": {k: full(v) for k, v in job.state().items()}}
    finally:
        dist.destroy_process_group()
