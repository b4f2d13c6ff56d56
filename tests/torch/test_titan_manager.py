"""torchtitan's llama3, trained by a plain user loop under ``elastic.torch.Manager``, rescaled in place.

The user's script is ``examples/titan/job.py``: torchtitan's llama3 debug model (two layers, a
byte vocabulary, float64) parallelized by torchtitan's own ``parallelize_llama`` (FSDP2 x TP)
on the Manager's mesh, AdamW with a warmup LR schedule, byte tokens of standard-library files.

1. With a local schedule on four pool processes it goes FSDP2 x TP2 on four -> FSDP4 -> TP2 on
   ranks 1 and 3 (two leave) -> FSDP2 x TP2 on four (two join): three rescales that change the
   world size and the mesh shape, each done on every rank with no error. Every step's loss
   equals a never-rescaled single process's to 1e-9 relative, on the same samples, with the same
   learning rate (the scheduler's state travels with the model).
2. As a real job (``examples.titan.job:main`` under ``elastic.torch.run``, launched and
   rescaled by the trainer's process launcher and the job's coordinator) through three
   layouts of other sizes and shapes: the coordinator's loss history is the single process's.
3. ``examples/titan/model.json`` (what the planner sizes layouts from) has the model's shapes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.model import Layout
from examples.titan import job
from tests.reshard._mp import Pool, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOTAL_STEPS = 8
SINGLE = [(0, (0,), {"dp_shard": 1, "tp": 1})]
#: (first step, world ranks in row-major order, mesh dims)
SCHEDULE = [
    (0, (0, 1, 2, 3), {"dp_shard": 2, "tp": 2}),
    (2, (0, 1, 2, 3), {"dp_shard": 4, "tp": 1}),
    (4, (1, 3), {"dp_shard": 1, "tp": 2}),
    (6, (0, 1, 2, 3), {"dp_shard": 2, "tp": 2}),
]
REF_STEPS = 64  # the job test's reference: more steps than its job trains before it is stopped


@pytest.fixture(scope="module")
def reference(pool: Pool, corpus: str) -> dict[str, Any]:
    """One process, one layout, never rescaled (the local Manager on a one-rank world)."""
    (out,) = pool.run(job.train, 1, free_port(), corpus, SINGLE, REF_STEPS, timeout=300)
    assert out["errors"] == [] and sorted(out["losses"]) == list(range(REF_STEPS))
    return out


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def test_titan_llama_rescaled_through_three_meshes_follows_one_process(pool: Pool, corpus: str,
                                                                       reference: dict[str, Any]) -> None:
    t0 = time.monotonic()
    results = pool.run(job.train, 4, free_port(), corpus, SCHEDULE, TOTAL_STEPS, timeout=400)
    elapsed = time.monotonic() - t0
    worst = 0.0
    for r, res in enumerate(results):
        assert res["errors"] == [], (r, res["errors"])
        # the rescales, as rank r saw them: all three done; ranks 0 and 2 leave at 4 and join at 6
        roles = [(step, role) for step, role, done, _ in res["records"] if done]
        leaver = r in (0, 2)
        assert roles == [(2, "stays"), (4, "leaves" if leaver else "stays"), (6, "joins" if leaver else "stays")], \
            (r, res["records"])
        assert all(moved > 0 for _, role, _, moved in res["records"] if role != "leaves"), res["records"]
        assert sorted(res["losses"]) == ([0, 1, 2, 3, 6, 7] if leaver else list(range(TOTAL_STEPS)))
        for s, loss in res["losses"].items():
            want = reference["losses"][s]
            worst = max(worst, _rel(loss, want))
            assert _rel(loss, want) <= 1e-9, f"rank {r} step {s}: {loss!r} vs one process {want!r}"
            assert res["samples"][s] == reference["samples"][s] and len(res["samples"][s]) == job.G, \
                f"rank {r} step {s}: other samples"
            assert res["lrs"][s] == reference["lrs"][s], f"rank {r} step {s}: the LR scheduler did not travel"
            first = max(f for f, _, _ in SCHEDULE if f <= s)
            assert res["layouts"][s] == dict(SCHEDULE[[f for f, _, _ in SCHEDULE].index(first)][2])
    # the world size and the mesh shape change at every rescale, and the LR changes across them
    shapes = [(len(ranks), tuple(dims.values())) for _, ranks, dims in SCHEDULE]
    assert all(a != b for a, b in zip(shapes, shapes[1:], strict=False)) and {n for n, _ in shapes} == {2, 4}
    assert len({reference["lrs"][s] for s in range(TOTAL_STEPS)}) == TOTAL_STEPS
    # the curve is not flat: the model learns, so a step trained on lost state would show
    assert reference["losses"][TOTAL_STEPS - 1] < reference["losses"][0]
    print(f"titan llama3, 3 rescales, {TOTAL_STEPS} steps on 4 processes: {elapsed:.1f} s; "
          f"max loss rel diff to one process {worst:.2e}")


def test_titan_llama_job_rescaled_by_its_coordinator_follows_one_process(corpus: str, reference: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    from elastic.model import load_model
    from elastic.train.launch import LaunchOptions, ProcessJobHandle
    from elastic.train.userjob import UserJobConfig

    cfg = UserJobConfig(model=load_model("examples/titan/model.json"), global_batch=job.G, seed=job.DATA_SEED,
                        micro_batch=job.MICRO, entrypoint="examples.titan.job:main",
                        args=("--corpus", corpus, "--log", str(tmp_path / "steps")))
    opts = LaunchOptions(pg_timeout_s=120, heartbeat_interval_s=0.5, heartbeat_timeout_s=60, join_timeout_s=120,
                         verify_reshard=True)
    h = ProcessJobHandle("titan-chain", cfg, options=opts, log_dir=str(tmp_path / "workers"))
    w4 = ["w0", "w1", "w2", "w3"]
    chain = [("tp1.pp1.dp4", w4), ("tp2.pp1.dp1", ["w1", "w3"]), ("tp2.pp1.dp2", ["w1", "w3", "w4", "w5"])]
    t0 = time.monotonic()
    try:
        h.start("tp2.pp1.dp2", w4, timeout=240)
        h.wait_step(1, timeout=180)
        for layout, workers in chain:
            res = h.rescale(layout, workers, timeout=240)
            assert res.record.ok and res.record.to_layout == Layout.parse(layout), res.record
            assert res.bytes_moved == res.lower_bound_bytes > 0, res
            h.wait_step(h.status().step + 2, timeout=180)
    finally:
        final = h.stop()
    elapsed = time.monotonic() - t0
    assert final.error is None, final.error
    history = h.history()
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))) and len(steps) >= 8, f"a step was lost or repeated: {steps}"
    assert len(steps) <= REF_STEPS, f"the job trained {len(steps)} steps, the reference has {REF_STEPS}"
    assert {r.layout for r in history} == set(map(Layout.parse, ["tp2.pp1.dp2", "tp1.pp1.dp4", "tp2.pp1.dp1"]))
    worst = 0.0
    for r in history:
        want = reference["losses"][r.step]
        assert r.loss is not None and _rel(r.loss, want) <= 1e-9, f"step {r.step} ({r.layout}): {r.loss!r} vs {want!r}"
        worst = max(worst, _rel(r.loss, want))
    logged: dict[int, list[dict[str, Any]]] = {}
    for f in sorted((tmp_path / "steps").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            logged.setdefault(rec["step"], []).append(rec)
    for s in steps:
        assert logged.get(s), f"step {s}: no worker logged it"
        for rec in logged[s]:
            assert rec["samples"] == reference["samples"][s] and rec["lr"] == reference["lrs"][s], (s, rec)
    print(f"titan llama3 job, 3 rescales, {len(steps)} steps: {elapsed:.1f} s; max loss rel diff {worst:.2e}; "
          f"layouts by step {[r.layout for r in history]}")


def test_the_model_file_has_the_titan_models_shapes() -> None:
    import torch

    from elastic.model import load_model
    from examples.titan.model import SEQ, VOCAB, llama_config

    spec = load_model("examples/titan/model.json")
    with torch.device("meta"):
        model = llama_config().build()
    assert spec.total_params() == sum(p.numel() for p in model.parameters())
    assert (spec.vocab, spec.seq_len, spec.layers) == (VOCAB, SEQ, len(model.layers))
    assert VOCAB % 2 == 0  # tp=2 splits the vocabulary-parallel embedding and head evenly
