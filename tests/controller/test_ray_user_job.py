"""A user's own training loop as a job of the controller on real local Ray (8 logical GPUs).

The job is the example Llama's loop (``examples.llama.job:main``, float64, FSDP2 x TP on the mesh
``(dp_shard, tp)``), declared in the controller's config like any job (``entrypoint``, ``args``,
the model file the planner sizes it from) and run by the Ray backend as worker actors. The
inference load (pushed, ``InProcessSource``) moves the GPUs inference leaves free through 6, 4,
3, 2, 1 and back to 6; the controller rescales the job in place each time, from the planner's table
for this job (injected: FSDP2 x TP2 at 6 and at 2, FSDP4 at 4, FSDP3 at 3), so the world size
and the mesh change, with leavers on the way down and joiners on the way up. One GPU is under the
job's minimum of two: it is paused into two keeper actors (no GPU, none of its code), and resumed
from them onto six new workers at the step it paused at. The job follows
the loss curve of one process that never rescaled to 1e-9, on the same samples with the same
learning rate, and every rescale is on record with its bytes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.model import Layout
from tests.fakes import Clock

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

JOB = "llama"
# the planner's table for the job, as the controller reads it: GPU count -> (layout, tokens/s)
TABLE = {6: (Layout(2, 1, 3), 600.0), 4: (Layout(1, 1, 4), 400.0), 3: (Layout(1, 1, 3), 300.0),
         2: (Layout(2, 1, 1), 200.0)}


def _config(corpus: str, log_dir: str) -> dict:
    return {
        "pool": {"name": "ray-local", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g",
                 "rescale_interval_seconds": 0, "gain_threshold": 0.0},
        "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 7,
                      "metric": {"preset": "vllm-running", "target": 10}, "startup_seconds": 0,
                      "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                                   "scaleDown": {"stabilizationWindowSeconds": 0}}}],
        "jobs": [{"name": JOB, "model": "examples/llama/model.json", "entrypoint": "examples.llama.job:main",
                  "args": ["--corpus", corpus, "--log", log_dir], "min_gpus": 2, "max_gpus": 6,
                  "global_batch": 12, "micro_batch": 1, "seed": 3, "allowed_tp": [1, 2]}],
        "controller": {"tick_seconds": 1, "metrics_max_age_seconds": 3600},
    }



@pytest.fixture(scope="module")
def ray_local():
    from elastic.train.ray_handle import init_local_ray

    ray = init_local_ray(num_gpus=8, num_cpus=2)
    yield ray
    ray.shutdown()


def _reference(corpus: str, steps: int, out: Path) -> dict[int, dict]:
    """One process that never rescales (the example's local Manager on one rank), in a child process."""
    code = ("import json, socket, sys; from examples.llama import byo\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            f"r = byo.train(0, 1, port, {corpus!r}, byo.SINGLE, {steps})\n"
            f"open({str(out)!r}, 'w').write(json.dumps(r))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=os.getcwd(),
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    r = json.loads(out.read_text())
    return {int(s): {"loss": r["losses"][s], "samples": r["samples"][s], "lr": r["lrs"][s]} for s in r["losses"]}


def test_a_user_job_is_rescaled_by_the_controller_on_ray_through_four_layouts_on_one_loss_curve(
        ray_local, tmp_path) -> None:
    from elastic.backends.ray import RayBackend
    from elastic.serve.server import ReplicaConfig
    from elastic.torch.data import prepare_corpus
    from elastic.train.launch import LaunchOptions

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = str(tmp_path / "corpus")
    prepare_corpus(corpus, [stdlib / "dataclasses.py", stdlib / "functools.py", stdlib / "textwrap.py"])
    url = f"sqlite:///{tmp_path}/state.db"
    db.upgrade(url)
    store = db.Store.from_url(url)
    cfg = load_config(data=copy.deepcopy(_config(corpus, str(tmp_path / "steps"))))
    assert cfg.jobs[0].entrypoint == "examples.llama.job:main" and cfg.jobs[0].on_below_minimum == "pause"
    backend = RayBackend(cfg.pool, replica_config=ReplicaConfig(model="tiny", max_running=4),
                         train_options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120,
                                                     verify_reshard=True),
                         drain_seconds=0.5)
    source, clock = InProcessSource(max_age=3600), Clock(2_000_000.0)
    ctl = Controller(cfg, backend, store, {"chat": source}, owner="t", clock=clock, throughput={JOB: TABLE})

    def tick(load: float) -> None:
        clock.t += 30
        source.set("chat", load, clock.t)
        res = ctl.tick()
        assert res.error is None, res.error

    # load per phase -> replicas (target 10 each) -> GPUs left for the job -> its layout; at 70 the
    # seven replicas leave one GPU, under the job's minimum of two: paused into keepers, then resumed
    phases = [(10.0, "tp2.pp1.dp3"), (30.0, "tp1.pp1.dp4"), (50.0, "tp1.pp1.dp3"), (60.0, "tp2.pp1.dp1"),
              (70.0, "paused"), (10.0, "tp2.pp1.dp3")]
    seen = []
    try:
        for load, want in phases:
            tick(load)
            rt = backend.job_runtime(JOB)
            handle = backend.jobs[JOB].handle
            if want == "paused":
                assert rt is not None and rt.phase == "Paused" and rt.gpus == (), (load, rt)
                st = handle.status()
                assert st.phase == "paused" and len(st.workers) == 2, st  # tp2: two keepers, no GPU
                assert len(backend.service_gpus("chat")) == 7
                seen.append(("paused", st.generation))
                continue
            assert rt is not None and str(rt.layout) == want, (load, rt)
            assert len(rt.gpus) == Layout.parse(want).world_size
            seen.append((str(rt.layout), rt.generation))
            handle.wait_step(max(rt.step, 0) + 2, timeout=180)  # it trains on the new layout
        assert [g for _, g in seen] == [1, 2, 3, 4, 5, 6], seen
        history = handle.history()
    finally:
        backend.shutdown()
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))), f"a step was lost or repeated: {steps}"
    assert {r.layout for r in history} == {Layout.parse(w) for _, w in phases if w != "paused"}
    ref = _reference(corpus, len(steps) + 5, tmp_path / "ref.json")
    for r in history:
        want = ref[r.step]["loss"]
        assert r.loss is not None and abs(r.loss - want) <= 1e-9 * abs(want), f"step {r.step} ({r.layout}): {r.loss}"
    logged: dict[int, list[dict]] = {}
    for f in (tmp_path / "steps").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            logged.setdefault(rec["step"], []).append(rec)
    for s in steps:
        assert logged.get(s) and all(x["samples"] == ref[s]["samples"] and x["lr"] == ref[s]["lr"] for x in logged[s]), s
    reshards = db.list_reshards(store, job=JOB)
    moves = [(r.from_layout, r.to_layout, r.status) for r in reshards]
    assert moves == [("tp2.pp1.dp3", "tp1.pp1.dp4", "done"), ("tp1.pp1.dp4", "tp1.pp1.dp3", "done"),
                     ("tp1.pp1.dp3", "tp2.pp1.dp1", "done"), ("tp2.pp1.dp1", "paused:tp2.pp1.dp1", "done"),
                     ("paused:tp2.pp1.dp1", "tp2.pp1.dp3", "done")], moves
    assert all(r.bytes_moved and r.bytes_moved > 0 for r in reshards)
    print("reshards:", [(r.from_layout, r.to_layout, r.bytes_moved, round(r.pause_seconds or 0, 3)) for r in reshards])
    store.dispose()

