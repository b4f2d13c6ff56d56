"""The Ray backend on a real two-node Ray cluster (two raylets on loopback, 4 logical GPUs each):
every training worker and replica runs on the node of the GPU the allocation gives it.

The co-scheduler plans per node (TP groups within a node, whole nodes lent first) and the
controller books GPUs by node; Ray, left alone, puts a 1-GPU actor on whichever node has one
free. Then a TP group can span nodes and a replica later pinned to "its" node finds that node's
GPUs taken by a training worker booked elsewhere: it waits for a GPU nobody will free."""

from __future__ import annotations

import os
import time

import pytest

from elastic.config import load_config
from elastic.model import GPU, Layout

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

CONFIG = {
    "pool": {"name": "two-nodes", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g"},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 4,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "jobs": [{"name": "tp-job", "model": "tiny", "min_gpus": 2, "max_gpus": 4, "global_batch": 8,
              "micro_batch": 1}],
}


@pytest.fixture(scope="module")
def two_nodes():
    for k, v in (("RAY_AUTH_MODE", "disabled"), ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
                 ("RAY_USAGE_STATS_ENABLED", "0"), ("GLOO_SOCKET_IFNAME", "lo")):
        os.environ.setdefault(k, v)
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "num_gpus": 4, "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of_worker(handle, worker: str) -> str:
    import ray

    return ray.get(handle.actors[worker].warm.remote(), timeout=60)  # the actor's node id (imports: done)



@pytest.mark.parametrize("detached", [False, True], ids=["embedded", "detached"])
def test_workers_and_replicas_run_on_their_gpus_nodes_and_the_pool_fills_up(two_nodes, detached: bool) -> None:
    import ray

    from elastic.backends.ray import RayBackend
    from elastic.serve.server import ReplicaConfig
    from elastic.train.launch import LaunchOptions

    cfg = load_config(data=CONFIG)
    backend = RayBackend(cfg.pool, local=False, replica_config=ReplicaConfig(model="tiny", max_running=4),
                         train_options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120),
                         drain_seconds=0.5, detached=detached, namespace="two-nodes" if detached else None,
                         spare_workers=0 if detached else 1)  # detached mode (a cluster you run) keeps no spares
    assert backend.inventory() == {"node-0": 4, "node-1": 4}
    node_id = {name: backend._nodes[name][0] for name in ("node-0", "node-1")}
    job, svc = cfg.jobs[0], cfg.services[0]
    try:
        # 1. tp2 x dp2 across the nodes: one TP pair on each (ranks 0,1 on node-0, ranks 2,3 on node-1)
        train = (GPU("node-0", 2), GPU("node-0", 3), GPU("node-1", 0), GPU("node-1", 1))
        out = backend.set_job_gpus(job, train, Layout.parse("tp2.pp1.dp2"))
        assert str(out.to_layout) == "tp2.pp1.dp2"
        j = backend.jobs[job.name]
        for g, w in j.workers.items():
            assert _node_of_worker(j.handle, w) == node_id[g.node], (g, w)
        members = j.handle.status().workers  # in rank order
        assert [j.workers[g] for g in train] == list(members)

        # 2. replicas on the other GPUs of both nodes: each starts, on its own node
        serve = (GPU("node-0", 0), GPU("node-0", 1), GPU("node-1", 2), GPU("node-1", 3))
        t0 = time.monotonic()
        backend.set_service_gpus(svc, serve)
        assert time.monotonic() - t0 < 120
        for r in backend.replicas[svc.name]:
            assert ray.get(r.actor.node_id.remote(), timeout=30) == node_id[r.gpu.node], r.gpu
        assert ray.available_resources().get("GPU", 0.0) == 0.0  # all 8 booked, none twice

        # 3. inference takes node-0's training pair: the job shrinks onto node-1 in place...
        step = j.handle.status().step
        backend.set_job_gpus(job, train[2:], Layout.parse("tp2.pp1.dp1"))
        backend.set_service_gpus(svc, serve + train[:2])
        assert {r.gpu for r in backend.replicas[svc.name]} == set(serve + train[:2])
        for r in backend.replicas[svc.name]:
            assert ray.get(r.actor.node_id.remote(), timeout=30) == node_id[r.gpu.node], r.gpu
        # ... and grows back onto node-0 when they are free again; the joiners run there
        backend.set_service_gpus(svc, serve)
        out = backend.set_job_gpus(job, train, Layout.parse("tp2.pp1.dp2"))
        assert str(out.to_layout) == "tp2.pp1.dp2" and out.step >= step
        for g, w in j.workers.items():
            assert _node_of_worker(j.handle, w) == node_id[g.node], (g, w)
        st = j.handle.status()
        assert st.step >= out.step and st.layout == Layout.parse("tp2.pp1.dp2")
    finally:
        backend.shutdown()
