"""Bring your own loop: the example Llama trained by a plain loop under ``elastic.torch.Manager``.

Run ``make example-byo`` (or ``python -m examples.llama.byo``): four local processes train the
Llama of ``examples/llama`` in float64 on a byte-token corpus of standard-library files through
a scripted schedule of layouts (FSDP4 -> FSDP2 x TP2 -> TP2 on two ranks -> FSDP2 x TP2 on
four -> FSDP3 on a permuted mesh), and one process trains the same model on the same steps
without any rescale. It prints one JSON line::

    {"steps", "rescales", "layouts", "max_loss_rel_diff", "state_bitwise_equal", "samples_equal", ...}

and exits 1 when the rescaled run leaves the single process's loss curve (1e-9 relative), when
a rescale changed any full tensor, or when any step trained on other samples.

:func:`train` is the user's side: ``build(world)`` is their parallelize code, the loop is
theirs; only ``mgr.steps()``, ``mgr.micro_batches()`` and ``mgr.step_done()`` come from us.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import socket
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import torch

G = 12  # samples per step
SEQ = 32
SEED = 11
LR = 1e-2

#: (first step, world ranks in row-major order, mesh dims)
SCHEDULE = [
    (0, (0, 1, 2, 3), {"dp_shard": 4, "tp": 1}),
    (2, (0, 1, 2, 3), {"dp_shard": 2, "tp": 2}),
    (4, (1, 3), {"dp_shard": 1, "tp": 2}),
    (6, (0, 1, 2, 3), {"dp_shard": 2, "tp": 2}),
    (8, (2, 0, 3), {"dp_shard": 3, "tp": 1}),
]
SINGLE = [(0, (0,), {"dp_shard": 1})]
TOTAL_STEPS = 10


def config() -> Any:
    from examples.llama.model import LlamaConfig

    # 257 byte+EOD tokens, padded so that tp 2 divides the vocabulary
    return dataclasses.replace(LlamaConfig.tiny(), vocab=258, max_seq_len=SEQ)


def schedule_of(spec: list[tuple[int, tuple[int, ...], dict[str, int]]]) -> dict[int, Any]:
    from elastic.torch import MeshLayout

    return {step: MeshLayout.of(ranks, **dims) for step, ranks, dims in spec}


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every key's full tensor, hashed (collective over each DTensor's mesh)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, t in sorted(state.items()):
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().reshape(-1)
        out[k] = hashlib.blake2b(f"{full.dtype}|".encode() + full.view(torch.uint8).numpy().tobytes(),
                                 digest_size=12).hexdigest()
    return out


def train(rank: int, n: int, port: int, corpus_dir: str, spec: list, total_steps: int = TOTAL_STEPS,
          fail_build_at: int | None = None, failure: str = "raise") -> dict[str, Any]:
    """One process's run. To show an abandoned rescale, ``build`` for the layout of step
    ``fail_build_at`` goes wrong: ``failure="raise"``: its first rank raises (after the mesh's
    collectives); ``"keys"``: every rank builds a model with a third block, whose keys the
    running state does not have."""
    import torch.distributed as dist

    from elastic.torch import Manager, TokenCorpus, clear_dtensor_caches, training_state
    from examples.llama import parallel as par
    from examples.llama.model import Llama

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    clear_dtensor_caches()  # a reused process (a test pool) may hold meshes of an earlier world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    try:
        schedule = schedule_of(spec)
        failing = schedule.get(fail_build_at) if fail_build_at is not None else None
        times_failing_built = sum(1 for s, lay in schedule.items() if failing is not None and s <= fail_build_at
                                  and lay == failing)
        built: list[Any] = []

        def build(world: Any) -> tuple:
            built.append(world.layout)
            wrong = world.layout == failing and built.count(failing) == times_failing_built
            cfg = dataclasses.replace(config(), n_layers=3) if wrong and failure == "keys" else config()
            model = Llama(cfg).to(torch.float64).init_weights(SEED)
            par.parallelize(model, world.mesh, loss_parallel=True)  # collective over the new mesh
            if wrong and failure == "raise" and rank == world.layout.ranks[0]:
                raise RuntimeError("out of memory on the new layout (simulated)")
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
            return model, opt, sched

        mgr = Manager(build, global_batch=G, schedule=schedule, total_steps=total_steps,
                      corpus=TokenCorpus.open(corpus_dir, seq_len=SEQ), seed=3)
        mgr.start()
        out: dict[str, Any] = {"losses": {}, "samples": {}, "lrs": {}, "before": {}, "after": {}}
        for step in mgr.steps():
            model, opt = mgr.model, mgr.optimizer  # rebuilt by a rescale (a joiner gets its first here)
            if step in schedule and step > 0:
                out["after"][step] = _digests(training_state(model, opt))
            total = torch.zeros((), dtype=torch.float64)
            mine: list[int] = []
            for batch in mgr.micro_batches(step):
                logits = model(batch.inputs)
                with par.loss_context(logits):
                    loss = par.loss_fn(logits, batch.labels)
                    (loss * batch.weight).backward()
                total += par.unwrap_loss(loss).detach() * len(batch)
                mine += batch.sample_ids
            opt.step()
            opt.zero_grad()
            out["lrs"][step] = opt.param_groups[0]["lr"]
            mgr.scheduler.step()
            w = mgr.world
            if w.dp_size > 1:
                dist.all_reduce(total, group=w.dp_group)
                got: list[Any] = [None] * w.dp_size
                dist.all_gather_object(got, mine, group=w.dp_group)
                mine = [i for ids in got for i in ids]
            out["losses"][step] = total.item() / G
            out["samples"][step] = sorted(mine)
            if step + 1 in schedule and step + 1 < total_steps:
                out["before"][step + 1] = _digests(training_state(model, opt))
            mgr.step_done(step)
        out["errors"] = mgr.errors
        out["records"] = [(r.step, r.role, r.done, r.bytes_moved, r.bytes_lower_bound) for r in mgr.records]
        return out
    finally:
        dist.destroy_process_group()


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' views as one: per step the loss and samples, per rescale the digests."""
    out: dict[str, Any] = {"losses": {}, "samples": {}, "lrs": {}, "before": {}, "after": {}, "conflicts": []}
    for r, res in enumerate(results):
        for name in ("losses", "samples", "lrs"):
            for s, v in res[name].items():
                if out[name].setdefault(s, v) != v:
                    out["conflicts"].append(f"rank {r} {name} step {s}")
        for name in ("before", "after"):
            for s, d in res[name].items():
                merged = out[name].setdefault(s, {})
                for k, v in d.items():
                    if merged.setdefault(k, v) != v:
                        out["conflicts"].append(f"rank {r} {name} {s} {k}")
    return out


def compare(rescaled: list[dict[str, Any]], reference: dict[str, Any], spec: list) -> dict[str, Any]:
    got, ref = merge(rescaled), merge([reference])
    steps = sorted(ref["losses"])
    rel = max(abs(got["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s]) if s in got["losses"] else float("inf")
              for s in steps)
    bitwise = bool(got["before"]) and all(got["after"].get(s) == d for s, d in got["before"].items())
    return {
        "steps": len(got["losses"]),
        "rescales": sum(1 for *_, done, _, _ in (rescaled[0]["records"]) if done),
        "layouts": [f"{'x'.join(f'{k}{v}' for k, v in dims.items() if v > 1) or 'single'}@{list(ranks)}"
                    for _, ranks, dims in spec],
        "max_loss_rel_diff": rel,
        "state_bitwise_equal": bitwise and not got["conflicts"],
        "samples_equal": all(got["samples"].get(s) == ref["samples"][s] for s in steps),
        "lr_equal": all(got["lrs"].get(s) == ref["lrs"][s] for s in steps),
        "bytes_moved_is_lower_bound": all(m == b for res in rescaled for *_, m, b in res["records"]),
        "errors": sorted({e for res in rescaled for e in res["errors"]}),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, n: int, port: int, corpus_dir: str, spec: list, folder: str) -> None:
    torch.set_num_threads(1)
    res = train(rank, n, port, corpus_dir, spec)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(res))


def _run(n: int, spec: list, corpus_dir: str) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    def ints(d: dict) -> dict:  # JSON keys are strings
        return {int(k): v for k, v in d.items()}

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_spawned, args=(n, _free_port(), corpus_dir, spec, folder), nprocs=n,
                           start_method="spawn")
        out = []
        for r in range(n):
            res = json.loads(Path(folder, f"rank{r}.json").read_text())
            for name in ("losses", "samples", "lrs", "before", "after"):
                res[name] = ints(res[name])
            out.append(res)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", help="a corpus from `elastic data prepare` (default: a few stdlib files)")
    args = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus
        if corpus is None:
            from elastic.torch import prepare_corpus

            stdlib = Path(sysconfig.get_paths()["stdlib"])
            corpus = str(Path(tmp, "corpus"))
            prepare_corpus(corpus, [stdlib / f for f in ("dataclasses.py", "functools.py", "textwrap.py")])
        rescaled = _run(4, SCHEDULE, corpus)
        (reference,) = _run(1, SINGLE, corpus)
    report = compare(rescaled, reference, SCHEDULE)
    print(json.dumps(report))
    ok = (report["max_loss_rel_diff"] <= 1e-9 and report["state_bitwise_equal"] and report["samples_equal"]
          and report["steps"] == TOTAL_STEPS and not report["errors"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
