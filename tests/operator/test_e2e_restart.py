"""The operator killed in the middle of an in-place shrink, and a new one taking over.

The operator runs as its own process (``kopf run -m operators.main``); the job's coordinator runs in a
pod of its own (``<job>-coordinator``). ``kubectl scale inferenceservice chat --replicas=3`` makes the
pool shrink the job 4 -> 2 before the Deployment grows; the job's leavers linger after their bytes
landed (``ELASTIC_FAULT_SLOW_LEAVE``), and the operator is SIGKILLed right then. Its successor
(another instance name, the same database) re-attaches to the job's coordinator pod: the shrink the
old operator left in flight is on record as done, the leavers' pods are deleted before their GPUs
count as free, the two survivors train on in place (same pods, same generation, the step counter
going on) and only then does the Deployment grow to 3. No GPU is ever held twice.

The second test deletes the coordinator pod itself: its workers cannot be gathered again, so they
are reported (``WorkerFailed``), deleted, and the job starts again from its newest checkpoint."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest

from . import e2e
from .e2e import NS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _sleepers() -> dict:
    body = e2e.replica_deployment(e2e.free_port())
    ctr = body["spec"]["template"]["spec"]["containers"][0]
    ctr["command"] = ["python", "-c", "import time\nwhile True: time.sleep(0.2)"]
    ctr.pop("readinessProbe")
    return body


@pytest.mark.parametrize("standby", [False, True], ids=["restarted", "standby"])
def test_an_operator_killed_mid_shrink_is_replaced_without_double_booking_a_gpu(tmp_path: Path, standby: bool) -> None:
    """``restarted``: the successor starts after the kill. ``standby``: it runs beside the leader from
    before the shrink, standing by (the lease is the leader's), and takes over once the lease runs out."""
    from kubernetes import client

    from elastic import store as db

    work = tmp_path / "c"
    with e2e.cluster(work) as c, contextlib.ExitStack() as operators:
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(e2e.service_cr())
        job = e2e.job_cr(checkpoint={"dir": str(tmp_path / "ckpt"), "everySteps": 5})
        job["spec"]["template"]["env"] = [{"name": "ELASTIC_FAULT_SLOW_LEAVE", "value": "60"}]
        c.apply(job)
        dbfile = tmp_path / "operator.db"
        lease = {"ELASTIC_LEASE_SECONDS": "3"}
        a = operators.enter_context(e2e.operator_process(c, instance="operator-0", db=dbfile, extra_env=lease))
        wait_for("job on 4 GPUs", lambda: c.refused(e2e.JOB) or c.status("elastictrainingjobs", e2e.JOB).get(
            "worldSize") == 4, 180)
        wait_for("a checkpoint", lambda: c.status("elastictrainingjobs", e2e.JOB).get("step", 0) >= 12, 120)
        if standby:
            operators.enter_context(e2e.operator_process(c, instance="operator-1", db=dbfile, extra_env=lease))
        # kubectl scale inferenceservice chat --replicas=3
        client.CustomObjectsApi(c.api).patch_namespaced_custom_object_scale(
            e2e.G, e2e.V, NS, "inferenceservices", e2e.SERVICE, {"spec": {"replicas": 3}})
        logs = work / "pods"
        gen = c.status("elastictrainingjobs", e2e.JOB)["generation"]  # the 4-GPU layout's

        def leavers() -> list[str]:
            return [f.stem for f in logs.glob("train-w*.log") if "left at generation" in f.read_text(errors="replace")]

        wait_for("both leavers' bytes landed", lambda: len(leavers()) == 2, 120)
        step_at_kill = c.status("elastictrainingjobs", e2e.JOB).get("step", 0)
        assert c.status("gpupools", e2e.POOL, None).get("leader") == "operator-0"
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        killed_at = len(c.emu.events)
        # the shrink's members: the pods that are not leaving (the leavers linger, holding their GPUs)
        survivors = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.worker_pods()
                     if p["metadata"]["name"] not in leavers()}
        assert len(survivors) == 2, survivors
        if not standby:  # nobody acts until the successor starts
            assert c.replicas_wanted() == 1, "the Deployment must not grow before the shrink has freed the GPUs"
            assert len(c.worker_pods()) == 4  # the leavers still linger, holding their GPUs
            in_flight = db.in_flight_reshards(db.Store.from_url(f"sqlite:///{dbfile}"))
            assert [r.job for r in in_flight] == [f"{NS}/{e2e.JOB}"], in_flight
            operators.enter_context(e2e.operator_process(c, instance="operator-1", db=dbfile, extra_env=lease))
        wait_for("Deployment at 3 ready", lambda: c.ready_replicas() == 3, 180)
        wait_for("job on 2 GPUs training on", lambda: c.status("elastictrainingjobs", e2e.JOB).get("worldSize") == 2
                 and c.status("elastictrainingjobs", e2e.JOB).get("phase") == "Running"
                 and c.status("elastictrainingjobs", e2e.JOB).get("step", 0) > step_at_kill, 180)
        st = c.status("elastictrainingjobs", e2e.JOB)
        warnings = [(e["reason"], e["note"]) for e in c.events(e2e.JOB) if e["type"] == "Warning"]
        store = db.Store.from_url(f"sqlite:///{dbfile}")
        left_in_flight = db.in_flight_reshards(store)
        done = [r for r in db.list_reshards(store, f"{NS}/{e2e.JOB}") if r.generation == gen + 1]
        leader = c.status("gpupools", e2e.POOL, None).get("leader")
        survivors_now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.worker_pods()}
    peak, unsched = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS and unsched == [], (peak, unsched)
    assert not any("run without their coordinator" in n for _, n in warnings), warnings
    # adopted in place: the same two pods train on at the shrink's generation; no job pod was created
    # after the kill, and the leavers' pods were gone before any replica pod of the grow was created
    assert survivors_now == survivors, (survivors_now, survivors)
    assert st["generation"] == gen + 1 and st["step"] > step_at_kill, (st, gen, step_at_kill)
    full = e2e.api_log(c.emu)
    alog = full[killed_at:]

    def job_pod(r: str, o: dict) -> bool:
        return r == "pods" and o["metadata"]["labels"].get("elastic.dev/job") == e2e.JOB

    assert e2e.first_rv(alog, lambda r, t, o: job_pod(r, o) and t == "ADDED") is None
    leavers_gone = e2e.last_rv(alog, lambda r, t, o: job_pod(r, o) and t == "DELETED"
                               and o["metadata"]["name"] not in survivors)
    replica_made = e2e.first_rv(alog, lambda r, t, o: r == "pods" and t == "ADDED"
                                and o["metadata"]["labels"].get("app") == e2e.DEPLOYMENT)
    assert leavers_gone is not None and replica_made is not None and leavers_gone < replica_made, (
        leavers_gone, replica_made)
    assert left_in_flight == [] and leader == "operator-1"
    assert [(r.status, r.error) for r in done] == [("done", None)], done  # the shrink the old operator began is on record as done


def test_a_job_whose_coordinator_pod_is_deleted_starts_again_from_its_checkpoint(tmp_path: Path) -> None:
    from kubernetes import client

    work = tmp_path / "c"
    with e2e.cluster(work) as c:
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(e2e.service_cr())
        c.apply(e2e.job_cr(checkpoint={"dir": str(tmp_path / "ckpt"), "everySteps": 5}))
        with e2e.operator_process(c, instance="operator-0", db=tmp_path / "operator.db"):
            wait_for("job on 4 GPUs", lambda: c.refused(e2e.JOB) or c.status("elastictrainingjobs", e2e.JOB).get(
                "worldSize") == 4, 180)
            wait_for("a checkpoint", lambda: c.status("elastictrainingjobs", e2e.JOB).get("step", 0) >= 12, 120)
            old = {p["metadata"]["uid"] for p in c.worker_pods()}
            killed_at = len(c.emu.events)
            # kubectl delete pod train-coordinator --grace-period=0
            client.CoreV1Api(c.api).delete_namespaced_pod(f"{e2e.JOB}-coordinator", NS, grace_period_seconds=0)
            wait_for("the job trains again on new pods", lambda: c.status("elastictrainingjobs", e2e.JOB).get(
                "phase") == "Running" and {p["metadata"]["uid"] for p in c.worker_pods()}.isdisjoint(old)
                and c.worker_pods(), 240)
            st = c.status("elastictrainingjobs", e2e.JOB)
            warnings = [(e["reason"], e["note"]) for e in c.events(e2e.JOB) if e["type"] == "Warning"]
    peak, unsched = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS and unsched == [], (peak, unsched)
    assert any(r == "WorkerFailed" and "run without their coordinator" in n for r, n in warnings), warnings
    alog = e2e.api_log(c.emu)[killed_at:]

    def job_pod(r: str, o: dict) -> bool:
        return r == "pods" and o["metadata"]["labels"].get("elastic.dev/job") == e2e.JOB

    # every old worker pod was gone before any new one was created (no GPU held twice)
    old_gone = e2e.last_rv(alog, lambda r, t, o: job_pod(r, o) and t == "DELETED" and o["metadata"]["uid"] in old)
    new_made = e2e.first_rv(alog, lambda r, t, o: job_pod(r, o) and t == "ADDED" and o["metadata"]["uid"] not in old)
    assert old_gone is not None and new_made is not None and old_gone < new_made, (old_gone, new_made)
    assert st["step"] >= 10, st  # resumed from its newest checkpoint, not from step 0
