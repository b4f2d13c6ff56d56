"""``Controller.recover`` decides, from the backend's truth, how an action left in flight by a killed
controller ended: table-driven over what the backend shows. Fake backend (our boundary), real store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic import store as db
from elastic.backends.base import JobRuntime
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.model import GPU, Layout
from elastic.phases import JobPhase

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g"},
    "services": [{"name": "chat", "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "jobs": [{"name": "job", "model": "tiny", "min_gpus": 1, "max_gpus": 8, "global_batch": 840}],
}
G = [GPU("n0", i) for i in range(8)]
OLD = JobRuntime("job", JobPhase.RUNNING, Layout.parse("tp1.pp1.dp4"), tuple(G[4:8]), generation=1, step=50)
NEW = replace(OLD, layout=Layout.parse("tp1.pp1.dp3"), gpus=tuple(G[5:8]), generation=2, step=52,
              last_pause_seconds=0.4, last_bytes_moved=123_456)


@pytest.mark.parametrize("truth, status, bytes_moved, needle", [
    # the workers finished the shrink without a controller: done, with what the job reports
    (NEW, "done", 123_456, "completed by the workers"),
    # killed before the directive went out: the job is still on the old layout
    (OLD, "failed", None, "abandoned"),
    # the job is gone altogether (embedded Ray died with the controller)
    (None, "failed", None, "abandoned"),
])
def test_recover_closes_what_was_in_flight_from_the_backends_truth(db_url, truth, status, bytes_moved,
                                                                  needle) -> None:
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    # 1. what the killed controller left: an open shrink action and a running reshard event
    db.upsert_pool(store, "p", {})
    db.begin_action(store, pool="p", kind="shrink_training", workload="job", payload={"gpus": []})
    db.start_reshard(store, job="job", pool="p", generation=2, from_layout="tp1.pp1.dp4", to_layout="tp1.pp1.dp3",
                     bytes_planned=0, bytes_lower_bound=0)
    # 2. what the backend shows when the new controller starts
    backend = FakeBackend({"n0": 8})
    backend.services["chat"] = (G[0],)
    if truth is not None:
        backend.jobs["job"] = truth
    ctl = Controller(load_config(data=CONFIG), backend, store, {"chat": InProcessSource()}, owner="b")
    assert ctl._lead(ctl.clock())  # recovery is the leader's: its writes are fenced by the lease
    notes = ctl.recover()
    # 3. nothing is left in flight, the reshard says how it ended, and the allocation is the backend's
    assert db.open_actions(store, "p") == [] and db.in_flight_reshards(store, "p") == []
    ev = db.list_reshards(store, job="job")[0]
    assert (ev.status, ev.bytes_moved) == (status, bytes_moved), ev
    assert (ev.error is None) == (status == "done") and (status == "done" or "interrupted" in ev.error)
    assert any(needle in n for n in notes), notes
    rec = db.list_decisions(store, limit=5, pool="p")
    assert [d.reason for d in rec] == ["Recovered"] and needle in rec[0].message
    alloc = db.current_allocation(store, "p")
    alloc.check_disjoint()
    assert alloc.gpus_of("job") == (truth.gpus if truth else ())
    store.dispose()
