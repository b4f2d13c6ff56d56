"""torchtitan's llama3 trained by a plain user loop under ``elastic.torch.Manager``.

This is what a torchtitan user writes to train elastically: ``build(world)`` is torchtitan's
own model and parallelize code on the mesh the Manager gives (:mod:`examples.titan.model`:
the llama3 debug model, two layers, byte vocabulary, FSDP2 x TP via ``parallelize_llama``),
AdamW with a warmup LR schedule, and a loop over ``mgr.steps()`` / ``mgr.micro_batches(step)``
/ ``mgr.step_done(step, loss=...)`` on byte tokens of standard-library files
(``elastic data prepare``, :class:`elastic.torch.TokenCorpus`).

As an elastic job, the job's config names ``entrypoint="examples.titan.job:main"`` and the model
file ``examples/titan/model.json`` (the same shapes, for the planner); the launcher runs
:func:`main` in every worker under ``python -m elastic.torch.run`` and the job's coordinator
decides the layouts (``tp.pp.dp`` as the mesh ``(dp_shard, tp)``)::

    elastic data prepare /tmp/corpus     # byte tokens of the standard library's source
    UserJobConfig(model=load_model("examples/titan/model.json"), global_batch=8, micro_batch=2,
                  entrypoint="examples.titan.job:main", args=("--corpus", "/tmp/corpus"))

Options: ``--corpus DIR`` (required), ``--dtype float32|float64`` (default float64),
``--log DIR`` (one JSON line per step and worker: step, loss, lr, samples, layout).

:func:`train` is the same loop under a local schedule of layouts (a fixed world of processes,
e.g. a test pool): ``tests/torch/test_titan_manager.py`` rescales it through meshes of other
sizes and shapes and compares every step with one process that never rescales.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from examples.titan.model import SEQ, build_model

__all__ = ["G", "LR", "SEQ", "build", "main", "train", "train_step"]

G = 8  # samples per step (a local schedule's; a job's comes from its config)
MICRO = 2  # samples per micro-batch under a local schedule
SEED = 0  # the weights' seed
DATA_SEED = 3  # which samples each step trains on
LR = 1e-3
WARMUP = 3


def lr_factor(step: int) -> float:
    """Linear warmup over :data:`WARMUP` steps, then inverse-square-root decay."""
    return min((step + 1) / WARMUP, (WARMUP / (step + 1)) ** 0.5)


def build(world: Any, dtype: torch.dtype = torch.float64) -> tuple:
    """The user's parallelize code for any mesh: ``(model, optimizer, scheduler)``."""
    model = build_model(world, dtype, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def train_step(mgr: Any, step: int) -> dict[str, Any]:
    """One optimizer step on this rank's micro-batches of ``step``; the step's global mean loss,
    the LR it trained with, every sample it trained on, and the layout (the same on every rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    world, model, opt = mgr.world, mgr.model, mgr.optimizer
    # torchtitan's plan leaves the logits sharded on the vocabulary under TP: the loss and its
    # backward run in loss_parallel
    parallel_loss = loss_parallel if world.size("tp") > 1 else contextlib.nullcontext
    total = torch.zeros((), dtype=torch.float64)
    mine: list[int] = []
    for batch in mgr.micro_batches(step):
        logits = model(batch.inputs)
        with parallel_loss():
            # torchtitan's FSDP2 sums gradients over the data-parallel ranks (divide factor 1), so
            # a micro-batch's mean loss weighs |mb| / G, not the averaging reducer's batch.weight
            share = len(batch) / mgr.global_batch
            loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(0, 1)) * share
            loss.backward()
        total += (loss.to_local() if isinstance(loss, DTensor) else loss).detach().to(torch.float64)
        mine += batch.sample_ids
    opt.step()
    opt.zero_grad()
    lr = opt.param_groups[0]["lr"]
    mgr.scheduler.step()
    samples: list[Any] = [mine]
    if world.dp_size > 1:
        dist.all_reduce(total, group=world.dp_group)
        samples = [None] * world.dp_size
        dist.all_gather_object(samples, mine, group=world.dp_group)
    return {"step": step, "loss": total.item(), "lr": lr, "samples": sorted(i for ids in samples for i in ids),
            "layout": dict(world.layout.dims)}


def train(rank: int, n: int, port: int, corpus_dir: str, spec: list, total_steps: int) -> dict[str, Any]:
    """One process of a local run: ``n`` processes, layouts by ``spec`` (``[(first step, world
    ranks in row-major order, {dim: size})]``, dims a data-parallel one and "tp"), float64.
    Returns what it saw: per step the loss, LR, samples; its rescales and errors."""
    import torch.distributed as dist

    from elastic.torch import Manager, MeshLayout, TokenCorpus, clear_dtensor_caches

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    clear_dtensor_caches()  # a reused process (a test pool) may hold meshes of an earlier world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    try:
        schedule = {step: MeshLayout.of(ranks, **dims) for step, ranks, dims in spec}
        mgr = Manager(build, global_batch=G, micro_batch_size=MICRO, schedule=schedule, total_steps=total_steps,
                      corpus=TokenCorpus.open(corpus_dir, seq_len=SEQ), seed=DATA_SEED)
        mgr.start()
        out: dict[str, Any] = {"losses": {}, "lrs": {}, "samples": {}, "layouts": {}}
        for step in mgr.steps():
            rec = train_step(mgr, step)
            for name, key in (("losses", "loss"), ("lrs", "lr"), ("samples", "samples"), ("layouts", "layout")):
                out[name][step] = rec[key]
            mgr.step_done(step, loss=rec["loss"])
        out["errors"] = mgr.errors
        out["records"] = [(r.step, r.role, r.done, r.bytes_moved) for r in mgr.records]
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    """The job's entrypoint: one worker of a controller-launched job (arguments from sys.argv)."""
    from elastic.torch import Manager, TokenCorpus

    ap = argparse.ArgumentParser(prog="examples.titan.job")
    ap.add_argument("--corpus", required=True, help="a corpus from `elastic data prepare`")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    ap.add_argument("--log", default="", help="a folder for one JSON line per step and worker")
    args = ap.parse_args(sys.argv[1:])
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    corpus = TokenCorpus.open(args.corpus, seq_len=SEQ)

    mgr = Manager(lambda world: build(world, dtype), corpus=corpus)
    mgr.start()
    log = None
    try:
        for step in mgr.steps():
            rec = train_step(mgr, step)
            if args.log:
                if log is None:
                    Path(args.log).mkdir(parents=True, exist_ok=True)
                    worker = os.environ.get("ELASTIC_WORKER_ID", "worker")
                    log = open(Path(args.log) / f"{worker}.jsonl", "a")  # noqa: SIM115 - open for the whole run
                log.write(json.dumps(rec) + "\n")
                log.flush()
            mgr.step_done(step, loss=rec["loss"])
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    main()
