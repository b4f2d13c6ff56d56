"""The example Llama as an elastic job: the user's loop that the controller launches and rescales.

This is what a user writes (with ``examples/llama/parallel.py`` as their parallelize code): a
``build(world)`` and a plain loop. The job spec names it ``entrypoint: examples.llama.job:main``;
every worker runs it under ``python -m elastic.torch.run``, and the controller decides the layouts
(``tp.pp.dp`` mapped onto the mesh dims the job declares, e.g. ``{dp: dp_shard, tp: tp}``).

    elastic data prepare /tmp/corpus                  # byte tokens of the standard library's source
    elastic serve --config examples/llama/job.yaml    # the controller runs and rescales it

The data-parallel dim decides how the model is spread over it: ``dp_shard`` shards parameters
and optimizer state (FSDP2, with tensor parallel on ``tp``); ``dp_replicate`` keeps a full copy
on every rank and averages gradients (DDP-style), which lets the job survive a lost worker
(declare ``dp_replicas: true``). Options (after the entrypoint in ``args``): ``--corpus DIR``
(required), ``--dtype float32|float64``, ``--log DIR`` (one JSON line per step and worker:
step, loss, samples, learning rate, layout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from examples.llama.byo import LR, SEED, SEQ, config

__all__ = ["build", "main"]


def build(world: Any, dtype: torch.dtype = torch.float64) -> tuple:
    """The user's parallelize code for any mesh the job gets: ``(model, optimizer, scheduler)``."""
    from examples.llama import parallel as par
    from examples.llama.model import Llama

    model = Llama(config()).to(dtype).init_weights(SEED).to(world.device)  # the same weights on any device
    dp = world.dp_dim
    par.parallelize(model, world.mesh, tp_dim="tp", dp_dim="dp_shard" if dp == "dp_shard" else "-",
                    loss_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def _average_gradients(model: torch.nn.Module, world: Any) -> None:
    """DDP-style: the replicas' gradients averaged, as DDP does (the micro-batch weights assume an
    averaging reducer: see ``elastic.torch.micro_batches``)."""
    import torch.distributed as dist

    if world.dp_dim != "dp_replicate" or world.dp_size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=world.dp_group)
            g.div_(world.dp_size)


def main() -> None:
    import torch.distributed as dist

    from elastic.torch import Manager, TokenCorpus
    from examples.llama import parallel as par

    ap = argparse.ArgumentParser(prog="examples.llama.job")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    ap.add_argument("--log", default="")
    args = ap.parse_args(sys.argv[1:])
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    corpus = TokenCorpus.open(args.corpus, seq_len=SEQ)

    mgr = Manager(lambda world: build(world, dtype), corpus=corpus)
    model, opt = mgr.start()
    log = None
    for step in mgr.steps():
        world = mgr.world
        total = torch.zeros((), dtype=torch.float64)
        mine: list[int] = []
        for batch in mgr.micro_batches(step):
            logits = model(batch.inputs)
            with par.loss_context(logits):
                loss = par.loss_fn(logits, batch.labels)
                (loss * batch.weight).backward()
            total += par.unwrap_loss(loss).detach().to(torch.float64) * len(batch)
            mine += batch.sample_ids
        _average_gradients(model, world)
        opt.step()
        opt.zero_grad()
        lr = opt.param_groups[0]["lr"]
        mgr.scheduler.step()
        if world.dp_size > 1:
            dist.all_reduce(total, group=world.dp_group)
        value = total.item() / mgr.global_batch
        if args.log:  # which samples the whole step trained on: every data-parallel rank's share
            samples: list[Any] = [mine]
            if world.dp_size > 1:
                samples = [None] * world.dp_size
                dist.all_gather_object(samples, mine, group=world.dp_group)
            if log is None:
                Path(args.log).mkdir(parents=True, exist_ok=True)
                log = open(Path(args.log) / f"{os.environ.get('ELASTIC_WORKER_ID', 'worker')}.jsonl", "a")  # noqa: SIM115
            log.write(json.dumps({"step": step, "loss": value, "lr": lr, "generation": world.generation,
                                  "samples": sorted(i for ids in samples for i in ids),
                                  "layout": dict(world.layout.dims)}) + "\n")
            log.flush()
        model, opt = mgr.step_done(step, loss=value)
    if log is not None:
        log.close()


if __name__ == "__main__":
    main()
