"""The operator killed in the middle of an in-place shrink, and a new one taking over.

The operator runs as its own process (``kopf run -m operators.main``); the job's coordinator lives in
it. ``kubectl scale inferenceservice chat --replicas=3`` makes the pool shrink the job 4 -> 2 before
the Deployment grows; the job's leavers linger after their bytes landed (``ELASTIC_FAULT_SLOW_LEAVE``),
and the operator is SIGKILLed right then. Its successor (another instance name, the same database)
finds worker pods whose coordinator died with the old process: their state cannot be adopted, so it
reports them (``WorkerFailed`` with the reason), deletes them and only then hands their GPUs on: the
job starts again from its newest checkpoint on 2 GPUs and the Deployment grows to 3. No GPU is ever
held twice and the step counter goes on from the checkpoint, not from 0."""

from __future__ import annotations

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


def test_an_operator_killed_mid_shrink_is_replaced_without_double_booking_a_gpu(tmp_path: Path) -> None:
    from kubernetes import client

    from elastic import store as db

    work = tmp_path / "c"
    with e2e.cluster(work) as c:
        c.apply(_sleepers())
        c.apply(e2e.pool_cr())
        c.apply(e2e.service_cr())
        job = e2e.job_cr(checkpoint={"dir": str(tmp_path / "ckpt"), "everySteps": 5})
        job["spec"]["template"]["env"] = [{"name": "ELASTIC_FAULT_SLOW_LEAVE", "value": "60"}]
        c.apply(job)
        dbfile = tmp_path / "operator.db"
        with e2e.operator_process(c, instance="operator-0", db=dbfile, extra_env={"ELASTIC_LEASE_SECONDS": "3"}) as a:
            wait_for("job on 4 GPUs", lambda: c.refused(e2e.JOB) or c.status("elastictrainingjobs", e2e.JOB).get(
                "worldSize") == 4, 180)
            wait_for("a checkpoint", lambda: c.status("elastictrainingjobs", e2e.JOB).get("step", 0) >= 12, 120)
            # kubectl scale inferenceservice chat --replicas=3
            client.CustomObjectsApi(c.api).patch_namespaced_custom_object_scale(
                e2e.G, e2e.V, NS, "inferenceservices", e2e.SERVICE, {"spec": {"replicas": 3}})
            logs = work / "pods"
            wait_for("a leaver's bytes landed", lambda: any(
                "left at generation" in f.read_text(errors="replace") for f in logs.glob("train-w*.log")), 120)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            killed_at = len(c.emu.events)
            assert c.replicas_wanted() == 1, "the Deployment must not grow before the shrink has freed the GPUs"
            assert len([p for p in c.worker_pods()]) == 4  # the leavers still linger, holding their GPUs
            in_flight = db.in_flight_reshards(db.Store.from_url(f"sqlite:///{dbfile}"))
            assert [r.job for r in in_flight] == [f"{NS}/{e2e.JOB}"], in_flight
        with e2e.operator_process(c, instance="operator-1", db=dbfile, extra_env={"ELASTIC_LEASE_SECONDS": "3"}):
            wait_for("Deployment at 3 ready", lambda: c.ready_replicas() == 3, 180)
            wait_for("job back on 2 GPUs", lambda: c.status("elastictrainingjobs", e2e.JOB).get("worldSize") == 2
                     and c.status("elastictrainingjobs", e2e.JOB).get("phase") == "Running", 180)
            st = c.status("elastictrainingjobs", e2e.JOB)
            warnings = [(e["reason"], e["note"]) for e in c.events(e2e.JOB) if e["type"] == "Warning"]
            store = db.Store.from_url(f"sqlite:///{dbfile}")
            left_in_flight = db.in_flight_reshards(store)
            leader = c.status("gpupools", e2e.POOL, None).get("leader")
    peak, unsched = e2e.gpu_ledger(c.emu)
    assert peak <= e2e.TOTAL_GPUS and unsched == [], (peak, unsched)
    assert any(r == "WorkerFailed" and "run without their coordinator" in n for r, n in warnings), warnings
    # every worker pod of the old run was gone before any pod of the new run was created (told apart by
    # uid: a new start may be called off and its own pods deleted later, which is no double booking)
    full = e2e.api_log(c.emu)

    def job_pod(r: str, o: dict) -> bool:
        return r == "pods" and o["metadata"]["labels"].get("elastic.dev/job") == e2e.JOB

    old_uids: set[str] = set()  # the job's pods alive when the operator was killed
    for _, r, t, o in full[:killed_at]:
        if job_pod(r, o) and t == "ADDED":
            old_uids.add(o["metadata"]["uid"])
        elif job_pod(r, o) and t == "DELETED":
            old_uids.discard(o["metadata"]["uid"])
    alog = full[killed_at:]
    old_gone = e2e.last_rv(alog, lambda r, t, o: job_pod(r, o) and t == "DELETED" and o["metadata"]["uid"] in old_uids)
    new_made = e2e.first_rv(alog, lambda r, t, o: job_pod(r, o) and t == "ADDED"
                            and o["metadata"]["uid"] not in old_uids)
    assert len(old_uids) == 4, old_uids
    assert old_gone is not None and new_made is not None and old_gone < new_made, (old_gone, new_made)
    assert st["step"] >= 10, st  # resumed from its newest checkpoint, not from step 0
    assert left_in_flight == [] and leader == "operator-1"
