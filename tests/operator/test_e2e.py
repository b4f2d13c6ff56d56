"""Kubernetes end to end with live workers (``tests.operator.e2e``): the real Kopf operator in its
coordinator runtime, worker pods that train and reshard in place, reference replicas under load.

One scenario, as a user runs it: a job on 4 GPUs beside 1 replica; load rises -> the job shrinks in
place to 2 (its leavers' pods go once their bytes landed, after exiting 0) and only then the
Deployment grows to 3; load falls -> the Deployment shrinks to 1 and only then the job grows back
to 4 in place (2 joiner pods). The step counter continues, every loss equals the never-rescaled
run's (float64, 1e-9 relative), no GPU is ever held twice, and the Events and printer columns say
each step with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import e2e

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
