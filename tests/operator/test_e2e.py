"""Kubernetes end to end with live workers (``tests.operator.e2e``): the real Kopf operator in its
coordinator runtime, worker pods that train and reshard in place, reference replicas under load.

One scenario, as a user runs it: a job on 4 GPUs beside 1 replica; load rises -> the job shrinks in
place to 2 (its leavers' pods go once their bytes landed, after exiting 0) and only then the
Deployment grows to 3; load falls -> the Deployment shrinks to 1 and only then the job grows back
to 4 in place (2 joiner pods). The step counter continues, every loss equals the never-rescaled
run's (float64, 1e-9 relative), no GPU is ever held twice, and the Events and printer columns say
each step with its reason.

The same with the job's own code (``examples.llama.job:main`` under ``elastic.torch.Manager``):
once as load moves it, and once through four layouts that ``kubectl scale inferenceservice`` pins,
changing the world size and the mesh (FSDP and TP), with leavers and joiners, on the samples and
the loss curve of one process that never rescaled."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastic.model import Layout

from . import e2e
from .e2e import NS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_live_job_shrinks_in_place_before_the_deployment_grows_and_grows_back_after(tmp_path: Path) -> None:
    out = e2e.run(tmp_path / "e2e")
    d = out["detail"]
    # every rescale in place: one job, three generations, the step counter continuing, the same losses
    assert out["generations"] == [1, 2, 3] and out["reshards_in_place"] == 2, out
    assert out["steps_monotonic"], "the step counter must continue across rescales, no gap, no repeat"
    assert out["loss_matches"], d["max_rel_loss_diff"]
    assert d["history_steps"] >= 6
    # pods: 4 at the start, 2 leavers that exited 0 before their pods went (no signal needed), 2 joiners
    assert out["worker_pods_started"] == 6
    assert d["start"]["workers"] == ["train-w0", "train-w1", "train-w2", "train-w3"]
    assert len(d["shrink"]["workers"]) == 2 and set(d["shrink"]["workers"]) < set(d["start"]["workers"])
    assert all(v == "ended 0 then deleted" for v in d["leavers"].values()) and len(d["leavers"]) == 2, d["leavers"]
    assert d["worker_signals"] == [], "a leaver ends on its own once its bytes landed"
    assert len(d["joiners"]) == 2 and set(d["shrink"]["workers"]) < set(d["grow"]["workers"])
    assert set(d["generation_annotations"].values()) == {"3"}, d["generation_annotations"]
    # the Deployment: 1 -> 3 -> 1, and the order shrink-before-grow both ways (Events and the API's record)
    assert out["deployment_scaled"] == [1, 3, 1]
    assert out["events_in_order"], (d["job_events"], d["service_events"], d["api_order"])
    assert ("shrink_training", "InferenceDemand") in d["job_events"]
    assert ("scale_inference_down", "LoadFall") in d["service_events"]
    # never double-booked: at most the pool's 6 GPUs held by pods at any change the API saw,
    # no pod left unschedulable, every pool status balanced
    assert d["gpu_peak"] <= e2e.TOTAL_GPUS and d["unschedulable"] == [], (d["gpu_peak"], d["unschedulable"])
    assert d["pool_ticks"] > 0 and d["unbalanced_ticks"] == []
    # kubectl get: LAYOUT GPUS STEP PHASE and REPLICAS DESIRED LOAD as the user sees them
    shrunk = d["shrink"]["columns"]
    assert (shrunk["GPUS"], shrunk["PHASE"]) == (2, "Running") and shrunk["LAYOUT"] == d["shrink"]["layout"]
    assert d["grow"]["columns"]["GPUS"] == 4 and d["grow"]["columns"]["STEP"] > shrunk["STEP"]
    svc = d["shrink"]["service_columns"]
    assert (svc["REPLICAS"], svc["DESIRED"]) == (3, 3) and svc["LOAD"] > 0 and svc["READY"] == "True"


def test_a_user_training_loop_is_rescaled_in_place_by_the_operator_on_one_loss_curve(tmp_path: Path) -> None:
    """The same scenario with the job's own code: ``entrypoint: examples.llama.job:main`` (FSDP x TP
    under ``elastic.torch.Manager``, float64). Its batch of 12 takes the 3 GPUs left beside 3 replicas:
    tp2.pp1.dp2 -> tp1.pp1.dp3 -> tp2.pp1.dp2, the mesh rebuilt in place each time, on the loss curve
    of one process that never rescaled."""
    out = e2e.run(tmp_path / "e2e", user=True)
    d = out["detail"]
    assert out["generations"] == [1, 2, 3] and out["steps_monotonic"], out
    assert out["loss_matches"], d["max_rel_loss_diff"]
    assert (d["start"]["layout"], d["shrink"]["layout"], d["grow"]["layout"]) == (
        "tp2.pp1.dp2", "tp1.pp1.dp3", "tp2.pp1.dp2")
    assert list(d["leavers"].values()) == ["ended 0 then deleted"] and len(d["joiners"]) == 1
    assert out["worker_pods_started"] == 5 and d["worker_signals"] == []
    assert out["deployment_scaled"] == [1, 3, 1] and out["events_in_order"], d["api_order"]
    assert d["gpu_peak"] <= e2e.TOTAL_GPUS and d["unschedulable"] == []


# kubectl scale inferenceservice chat --replicas=N on a node of 8 GPUs -> the GPUs left for the
# example's batch of 12 (allowedTP [1, 2], maxGPUs 6) -> the planner's layout there: TP and the
# FSDP degree both change, the world size goes 4 -> 3 -> 2 -> 6 (leavers, then joiners)
PINS = [(4, "tp2.pp1.dp2"), (5, "tp1.pp1.dp3"), (6, "tp1.pp1.dp2"), (2, "tp2.pp1.dp3")]
NODE_GPUS = 8


def _mesh(lay: Layout) -> dict[str, int]:
    """What the example logs as its mesh (``{dp: dp_shard, tp: tp}``) for a layout."""
    return {"dp_shard": lay.dp, "tp": lay.tp}


def test_a_user_job_follows_kubectl_scale_through_four_layouts_in_place_on_one_loss_curve(tmp_path: Path) -> None:
    """Four layouts of ``examples.llama.job:main`` on Kubernetes, each pinned by ``kubectl scale`` of
    the InferenceService (its Deployment's pods only sleep: the pin, not their load, sizes it):
    tp2.pp1.dp2 -> tp1.pp1.dp3 -> tp1.pp1.dp2 -> tp2.pp1.dp3, the mesh rebuilt in place each time.
    The step counter continues, every step trains on the never-rescaled run's samples with its
    learning rate and loss (float64, 1e-9 relative), each leaver exits 0 before its pod is deleted,
    and no GPU is ever held twice."""
    from kubernetes import client

    from tests.operator.test_e2e_restart import _sleepers

    work = tmp_path / "e2e"
    logs = work / "steps"
    job = e2e.user_job(work, step_log=logs)
    job["spec"]["maxGPUs"] = 6
    svc = e2e.service_cr()
    svc["spec"].update(maxReplicas=6, replicas=PINS[0][0])
    phases: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with e2e.cluster(work, {"n0": NODE_GPUS}) as c, e2e.operator(c):
        scale = client.CustomObjectsApi(c.api)
        c.apply(_sleepers())
        c.apply(e2e.pool_cr(NODE_GPUS))
        c.apply(svc)
        c.apply(job)
        for i, (replicas, layout) in enumerate(PINS):
            if i:  # kubectl scale inferenceservice chat --replicas=N
                scale.patch_namespaced_custom_object_scale(e2e.G, e2e.V, NS, "inferenceservices", e2e.SERVICE,
                                                           {"spec": {"replicas": replicas}})
            want = Layout.parse(layout).world_size

            seen: dict[str, Any] = {}

            def on_layout(gen: int = i + 1, want: int = want, layout: str = layout, seen: dict = seen) -> bool:
                st = c.status("elastictrainingjobs", e2e.JOB)
                seen.update({k: st.get(k) for k in ("generation", "worldSize", "layout", "phase")})
                return c.refused(e2e.JOB) or (st.get("generation") == gen and st.get("worldSize") == want
                                              and st.get("layout") == layout and st.get("phase") == "Running")

            try:
                wait_for(f"job on {layout} (generation {i + 1}) with {replicas} replica(s)", on_layout, 180)
            except AssertionError as e:
                raise AssertionError(f"{e}; the job's status: {seen}") from None
            wait_for(f"Deployment at {replicas}", lambda r=replicas: c.replicas_wanted() == r
                     and len([p for p in c.replica_pods() if not p["metadata"].get("deletionTimestamp")]) == r, 60)
            h = c.handle()
            st = h.status()
            h.wait_step(st.step + 2, timeout=90)  # it trains on the new mesh
            workers = sorted(p["metadata"]["name"] for p in c.worker_pods())
            phases.append({"layout": str(st.layout), "generation": st.generation, "workers": workers,
                           "seconds": round(time.monotonic() - t0, 1)})
            if i:  # the leavers' pods are gone once their bytes landed and they exited
                left = sorted(set(phases[i - 1]["workers"]) - set(workers))
                wait_for(f"leaver pods {left} deleted", lambda left=left: all(
                    c.emu.get("pods", NS, n) is None for n in left), 60)
        history = h.history()
        signals = [s for s in c.agent.signals if s[0].startswith(f"{e2e.JOB}-w")]
    peak, unsched = e2e.gpu_ledger(c.emu)

    # four layouts, one job, each reached in place: the world size and the mesh change every time
    assert [(p["layout"], p["generation"]) for p in phases] == [(lay, i + 1) for i, (_, lay) in enumerate(PINS)], phases
    assert [len(p["workers"]) for p in phases] == [4, 3, 2, 6]
    # leavers on the way down (they exit 0 once their bytes landed, then their pods go; no signal
    # needed), joiners on the way up (the survivors keep their pods)
    leavers = [sorted(set(a["workers"]) - set(b["workers"])) for a, b in zip(phases, phases[1:], strict=False)]
    joiners = [sorted(set(b["workers"]) - set(a["workers"])) for a, b in zip(phases, phases[1:], strict=False)]
    assert [len(x) for x in leavers] == [1, 1, 0] and [len(x) for x in joiners] == [0, 0, 4], (leavers, joiners)
    how_left = e2e.leavers_ended_before_deleted(c.emu, [n for x in leavers for n in x])
    assert set(how_left.values()) == {"ended 0 then deleted"}, how_left
    assert signals == [], "a leaver ends on its own once its bytes landed"
    # no GPU held twice: never more than the node's GPUs held by pods, no pod left unschedulable
    assert peak <= NODE_GPUS and unsched == [], (peak, unsched)

    # the step counter continues across the three rescales, every layout trained
    steps = [r.step for r in history]
    assert steps == list(range(len(steps))), f"a step was lost or repeated: {steps}"
    assert {r.generation: r.layout for r in history} == {i + 1: Layout.parse(lay) for i, (_, lay) in enumerate(PINS)}
    # the never-rescaled run: the same loss (float64, 1e-9 relative), samples and learning rate at every step
    ref = e2e.user_reference_steps(job, len(steps) + 2, work / "reference.json")
    for r in history:
        want = ref[r.step]["loss"]
        assert r.loss is not None and abs(r.loss - want) <= 1e-9 * abs(want), f"step {r.step} ({r.layout}): {r.loss}"
    logged = e2e.step_log(logs)
    by_gen = {r.generation: r.layout for r in history}
    for s in steps:
        recs = logged.get(s)
        assert recs, f"step {s}: no worker logged it"
        for x in recs:
            assert x["samples"] == ref[s]["samples"] and x["lr"] == ref[s]["lr"], (s, x, ref[s])
            assert x["layout"] == _mesh(by_gen[x["generation"]]), (s, x)  # the mesh the step ran on
        # every worker of that step's layout logged it
        assert len(recs) == by_gen[recs[0]["generation"]].world_size, (s, recs)
    print("phases:", [(p["layout"], len(p["workers"]), p["seconds"]) for p in phases], "steps:", len(steps),
          "seconds:", round(time.monotonic() - t0, 1))
