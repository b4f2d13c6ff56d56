"""The pipeline bubble of interleaved 1F1B against plain 1F1B, next to Megatron's model.

Megatron's model (Narayanan et al. 2021, section 2.2): with ``p`` stages, ``m`` micro-batches
and ``v`` model chunks per stage, the idle time of a step is ``(p-1)/(v*m)`` of its ideal
(compute-only) time; plain 1F1B is ``v = 1``. Two measurements, at the same ``p`` and ``m``:

* ``schedule``: the orders the trainer runs (``elastic.train.pipeline.one_f_one_b_order`` and
  ``interleaved_order``) on a model of time (``simulate``): a chunk's forward costs 1/v, its
  backward 2/v of a stage's, messages are free. Exact and deterministic.
* ``measured``: the trainer's own executors (``one_f_one_b``, ``interleaved_one_f_one_b``) on
  4 gloo processes, every layer a fixed cost (a sleep of ``--layer-ms`` forward and twice that
  backward, so the figure does not depend on how busy the cores are), 8 layers split over the
  ranks; bubble = (slowest rank's step time - ideal) / ideal. Point-to-point messages and the
  per-operation cost of the executor are real and grow with ``v`` (``v`` times the operations
  and messages), so here interleaving gains less than the model says, and at small ``m*v``
  chunks a deeper ``v`` can gain nothing: the schedule rows leave those costs out.

Writes ``benchmarks/results/pipeline_bubble.json`` and prints a table.

    .venv/bin/python benchmarks/pipeline_bubble_bench.py [--layer-ms 20] [--repeats 3] [--no-measure]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastic.model import Layout  # noqa: E402
from elastic.parallel.partition import StagePartition, partition_layers  # noqa: E402
from elastic.train.groups import build_groups  # noqa: E402
from elastic.train.pipeline import (  # noqa: E402
    ChunkForwardStep,
    P2PShape,
    interleaved_one_f_one_b,
    interleaved_order,
    one_f_one_b,
    one_f_one_b_order,
    simulate,
)

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 8
WORLD = 4
CASES = [  # (pp, m, vpps): every vpp divides the 8 layers' share of a rank
    (2, 4, (1, 2, 4)),
    (2, 8, (1, 2, 4)),
    (4, 4, (1, 2)),
    (4, 8, (1, 2)),
]


def megatron(pp: int, vpp: int, m: int) -> float:
    return (pp - 1) / (vpp * m)


def schedule_bubble(pp: int, vpp: int, m: int) -> float:
    if vpp == 1:
        return simulate([one_f_one_b_order(pp, r, m) for r in range(pp)], 1).bubble
    return simulate([interleaved_order(pp, vpp, r, m) for r in range(pp)], vpp, 1 / vpp, 2 / vpp).bubble


class _Layers(torch.autograd.Function):
    """``n`` layers of fixed cost: sleeps ``n * seconds`` forward and twice that backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


def _stage(part: StagePartition, r: int, shape: P2PShape, layer_s: float) -> ChunkForwardStep:
    """Pipeline rank ``r``'s forward step: its chunk's layers at a fixed cost each; the last
    virtual stage returns a scalar to back-propagate."""
    seed = torch.ones(shape.shape, requires_grad=True)
    last = part.num_chunks - 1

    def forward_step(chunk: int, micro: int, x: torch.Tensor | None) -> torch.Tensor:
        v = chunk * part.pp + r
        y = _Layers.apply(seed if x is None else x, len(part.chunks[v]) * layer_s)
        return y.sum() if v == last else y

    return forward_step


def _measure(rank: int, world: int, cases: list[tuple[int, int, tuple[int, ...]]], layer_s: float,
             repeats: int) -> dict[str, float]:
    """Seconds of the slowest rank's step per (pp, vpp, m), median of ``repeats`` (run in every worker)."""
    out: dict[str, float] = {}
    shape = P2PShape((1, 4, 8), torch.float32)
    for pp, m, vpps in cases:
        for vpp in vpps:
            layout = Layout(1, pp, world // pp, vpp=vpp)
            groups = build_groups(layout, rank)
            part = partition_layers(LAYERS, pp, vpp)
            forward_step = _stage(part, groups.pp.index, shape, layer_s)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if vpp == 1:
                    one_f_one_b(lambda micro, x, f=forward_step: f(0, micro, x), m, groups.pp, shape)
                else:
                    interleaved_one_f_one_b(forward_step, m, vpp, groups.pp, shape)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(t.item())
            groups.close()
            out[f"{pp}/{vpp}/{m}"] = statistics.median(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer-ms", type=float, default=20.0, help="forward cost of one layer (backward: twice)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-measure", action="store_true", help="schedule rows only (no processes)")
    a = p.parse_args()
    measured: dict[str, float] = {}
    if not a.no_measure:
        from tests.train._mp import run_workers

        measured = run_workers(_measure, WORLD, CASES, a.layer_ms / 1e3, a.repeats, timeout=600)[0]
    rows = []
    for pp, m, vpps in CASES:
        base_sched = schedule_bubble(pp, 1, m)
        ideal = m * (LAYERS // pp) * 3 * a.layer_ms / 1e3
        base_meas = (measured[f"{pp}/1/{m}"] - ideal) / ideal if measured else None
        for vpp in vpps:
            sched = schedule_bubble(pp, vpp, m)
            row: dict[str, Any] = {"pp": pp, "vpp": vpp, "micro_batches": m, "megatron_model": megatron(pp, vpp, m),
                                   "schedule_bubble": round(sched, 6),
                                   "schedule_ratio_vs_1f1b": round(sched / base_sched, 6)}
            if measured:
                meas = (measured[f"{pp}/{vpp}/{m}"] - ideal) / ideal
                row |= {"step_seconds": round(measured[f"{pp}/{vpp}/{m}"], 4), "ideal_seconds": round(ideal, 4),
                        "measured_bubble": round(meas, 4), "measured_ratio_vs_1f1b": round(meas / base_meas, 4)}
            rows.append(row)
    result = {"layers": LAYERS, "layer_forward_ms": a.layer_ms, "backward_over_forward": 2.0, "repeats": a.repeats,
              "processes": WORLD, "backend": "gloo", "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_bubble.json").write_text(json.dumps(result, indent=2) + "\n")
    head = f"{'pp':>3} {'vpp':>3} {'m':>3} {'model (p-1)/(vm)':>17} {'schedule':>9} {'ratio':>6}"
    print(head + (f" {'measured':>9} {'ratio':>6} {'step s':>7}" if measured else ""))
    for r in rows:
        line = (f"{r['pp']:>3} {r['vpp']:>3} {r['micro_batches']:>3} {r['megatron_model']:>17.4f} "
                f"{r['schedule_bubble']:>9.4f} {r['schedule_ratio_vs_1f1b']:>6.3f}")
        if measured:
            line += f" {r['measured_bubble']:>9.4f} {r['measured_ratio_vs_1f1b']:>6.3f} {r['step_seconds']:>7.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
