"""Keepers on Kubernetes: a job pushed below its minimum keeps its state in keeper pods (the job's
template without GPU requests: CPU and host memory) and resumes in place when GPUs come back, as on
Ray. The real Kopf operator (coordinator runtime), the node agent running every pod, float64.

6 GPUs; the job needs 4 (``minGPUs: 4``). Load for 1 replica: the job trains on 4. Load for 3: the
job cannot give one GPU and stay at its minimum, so it pauses: its state moves peer to peer into 2
keeper pods (``tp2.pp1.dp1``: one copy, no GPU), every worker pod goes, and only then the Deployment
grows. Load for 1 again: the Deployment shrinks, and the keepers hand the state to 4 new worker pods;
the step counter goes on and every loss equals the never-rescaled run's. The same for a user's own
loop (the example Llama under ``elastic.torch.Manager``): its keeper pods run none of its code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from . import e2e
from .e2e import NS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("user", [False, True], ids=["reference", "user"])
def test_a_job_below_its_minimum_waits_in_keeper_pods_and_resumes_in_place(tmp_path: Path, user: bool) -> None:
    from elastic.metrics import InProcessSource
    from elastic.model import Layout
    from tests.operator.test_e2e_restart import _sleepers

    job = e2e.user_job(tmp_path, step_log=tmp_path / "steps") if user else e2e.job_cr()
    job["spec"]["minGPUs"] = 4
    source = InProcessSource(max_age=3600)
    source.set(f"{NS}/{e2e.SERVICE}", 4.0, time.time())  # target 4: 1 replica
    with e2e.cluster(tmp_path / "c") as c, e2e.operator(c, source=source):
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(e2e.service_cr())
        c.apply(job)
        wait_for("job on 4 GPUs", lambda: c.refused(e2e.JOB) or (c.status("elastictrainingjobs", e2e.JOB).get(
            "worldSize") == 4 and c.status("elastictrainingjobs", e2e.JOB).get("phase") == "Running"), 150)
        h = c.handle()
        h.wait_step(h.status().step + 2, timeout=60)
        running = h.status().layout
        # the reference trainer measures a layout's first steps: the worst rank's bytes in the CR status
        mem = {} if user else wait_for("measured memory in the job's status", lambda: c.status(
            "elastictrainingjobs", e2e.JOB).get("memory"), 60)
        workers = sorted(p["metadata"]["name"] for p in c.worker_pods())

        # 1. load for 3 replicas: the job pauses into keepers, then the Deployment grows
        source.set(f"{NS}/{e2e.SERVICE}", 12.0, time.time())
        wait_for("job paused", lambda: c.status("elastictrainingjobs", e2e.JOB).get("phase") == "Paused", 120)
        wait_for("3 replicas", lambda: c.ready_replicas() == 3, 60)
        keepers = [p for p in c.worker_pods() if p["metadata"]["labels"].get("elastic.dev/keeper") == "true"]
        paused = h.status()
        gpu_pods = [p["metadata"]["name"] for p in c.worker_pods() if p not in keepers]
        st_paused = c.status("elastictrainingjobs", e2e.JOB)

        # 2. load for 1 again: the Deployment shrinks, the keepers hand the state back to 4 GPU workers
        source.set(f"{NS}/{e2e.SERVICE}", 4.0, time.time())
        wait_for("job resumed on 4", lambda: c.status("elastictrainingjobs", e2e.JOB).get("worldSize") == 4
                 and c.status("elastictrainingjobs", e2e.JOB).get("phase") == "Running", 150)
        resumed = h.status()
        h.wait_step(resumed.step + 2, timeout=60)
        history = h.history()
        cfg = h.cfg
        # a background grow's Event is posted by the operator's next cycle after it landed
        events = wait_for("the resume's grow_training Event", lambda: e2e.events_through(
            c, (e2e.SERVICE, "scale_inference_down"), (e2e.JOB, "grow_training")), 60)
        # a keeper's pod is deleted once it ended, by whichever launcher thread saw it end first: the
        # resume (and so its Event) may finish while the launcher's watcher still deletes it
        left = wait_for("the keeper pods deleted once they handed the state over", lambda: (
            names := sorted(p["metadata"]["name"] for p in c.worker_pods(live=False))) and not any(
                "-k" in n for n in names) and names, 60)
    # the keepers: the held layout (one copy, no data parallelism), no GPU asked, not pinned to a node
    if not user:
        assert mem["layout"] == str(running) and mem["weights"] > 0 and mem["activations"] > 0, mem
        assert mem["total"] == mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"], mem
        # beside it the planner's bytes for the same rank, in the run's precision (float64: 8 bytes a
        # weight, exactly what it holds) and the per-GPU budget the layout was fitted in
        assert mem["weights"] == mem["predicted"]["weights"] and mem["predicted"]["activations"] > 0, mem
        assert mem["budgetBytes"] > mem["total"], mem
    assert running is not None
    held = running.held()
    assert paused.phase == "paused" and paused.layout == held, (running, paused)
    assert len(keepers) == held.world_size and gpu_pods == [], (keepers, gpu_pods)
    if not user:
        assert paused.layout == Layout.parse("tp2.pp1.dp1"), paused
    for k in keepers:
        ctr = k["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in str(ctr.get("resources")) and "affinity" not in k["spec"]
        assert {"name": "ELASTIC_KEEPER", "value": "1"} in ctr["env"]
    assert (st_paused["worldSize"], st_paused["layout"]) == (0, str(held))
    # the pause before the Deployment grew; the Deployment shrank before the resume
    pause_i = events.index((e2e.JOB, "pause_training"))
    up_i = next(i for i in range(pause_i, len(events)) if events[i] == (e2e.SERVICE, "scale_inference_up"))
    down_i = events.index((e2e.SERVICE, "scale_inference_down"))
    grow_i = next(i for i in range(down_i, len(events)) if events[i] == (e2e.JOB, "grow_training"))
    assert pause_i < up_i < down_i < grow_i, events
    # resumed in place: new worker pods, keepers gone, the same step counter and loss curve
    assert set(left).isdisjoint(workers) and not any("-k" in n for n in left), left
    steps = [r.step for r in history]
    assert steps == list(range(len(steps)))
    assert len({r.generation for r in history}) == 2  # the paused generation ran no step
    ref = (e2e.user_reference(job, len(history), tmp_path / "reference.json") if user
           else e2e.reference_losses(cfg, len(history)))
    worst = max(abs(r.loss - w) / abs(w) for r, w in zip(history, ref, strict=True))
    assert worst <= 1e-9, worst
    peak, unsched = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS and unsched == []
