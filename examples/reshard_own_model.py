"""Reshard your own model in place: FSDP2 on 4 processes -> tensor parallel on 2 -> FSDP2 on 4.

Run on CPU (gloo)::

    python -m torch.distributed.run --nproc-per-node 4 examples/reshard_own_model.py

Every process trains a small MLP under FSDP2 on all four; then the job shrinks to tensor
parallel on ranks 0 and 1 (ranks 2 and 3 leave), then grows back to FSDP2 on four (2 and 3
join empty-handed). Parameters and AdamW state move between the meshes in memory, and
training goes on from the same step. It prints the losses, each rank's role and each
reshard's bytes.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import elastic.torch as et

STEPS = 3


def build(layout: str, ranks: list[int]) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
    """The user's own code: a model and optimizer on a mesh over ``ranks`` (every process calls it,
    as mesh creation is collective; processes outside the mesh get ``(None, None)``)."""
    mesh = DeviceMesh("cpu", torch.tensor(ranks))
    if dist.get_rank() not in ranks:
        return None, None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    if layout == "tp":
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)  # the same global batch on every process
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run with --nproc-per-node 4")
    model, optimizer = build("fsdp", [0, 1, 2, 3])
    train(model, optimizer, range(0, STEPS))
    step = STEPS
    for layout, ranks in (("tp", [0, 1]), ("fsdp", [0, 1, 2, 3])):
        src = et.training_state(model, optimizer) if model is not None else None  # None: a joiner
        model, optimizer = build(layout, ranks)
        dst = et.training_state(model, optimizer, init_optimizer=True) if model is not None else None
        stats = et.reshard(src, dst)  # every process calls it; dst None: a leaver
        role = "leaves" if dst is None else ("joins" if src is None else "stays")
        print(f"rank {rank} {role}: {layout} on {ranks}, {stats.bytes_moved} bytes moved "
              f"(lower bound {stats.bytes_lower_bound}) in {stats.seconds:.3f} s", flush=True)
        if model is not None:
            train(model, optimizer, range(step, step + STEPS))
        step += STEPS
    # Tear down while the interpreter is whole: wait until every process is done communicating,
    # free the meshes' groups (the model and optimizer hold them), then destroy the rest. Groups
    # left for interpreter shutdown to free can abort the process there.
    dist.barrier()
    del model, optimizer, src, dst
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
