"""A generation's mesh groups time out at the job's ``pg_timeout_s``, not torch's default.

torch builds a ``DeviceMesh``'s groups with its own default timeout (30 minutes on gloo), not the
default group's. A collective that cutting the connections cannot fail (a send gloo had queued
when its connection broke: gloo fails it only at the timeout) would hold a survivor that long,
past the time the coordinator waits for it. ``elastic.torch.rescale.bound_gloo_timeouts`` gives
the mesh's gloo groups ``pg_timeout_s``; here a peer that never joins a collective on the mesh's
tp group makes it raise at that timeout, where torch's default would outlast the job's timeout.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.reshard._mp import Pool, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _skipped_collective_job(rank: int, n: int, port: int, seconds: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from elastic.torch.rescale import bound_gloo_timeouts
    from tests.torch._layouts import init

    init(rank, n, port)
    try:
        # dp2 x tp2: the tp groups ({0, 1}, {2, 3}) are groups of their own (a dim over the whole world
        # would be the default group, which has the job's timeout already)
        mesh = DeviceMesh("cpu", torch.arange(n).reshape(2, n // 2), mesh_dim_names=("dp", "tp"))
        bound_gloo_timeouts(mesh.get_all_groups(), seconds)
        out: dict[str, Any] = {}
        if rank == 0:  # its tp peer (rank 1) never joins: its connections stay open, so only the timeout ends the wait
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4), group=mesh["tp"].get_group())
                out["error"] = None
            except RuntimeError as e:
                out["error"] = str(e)
            out["seconds"] = time.monotonic() - t0
        dist.barrier()  # the default group (60 s): the others wait here while rank 0's collective times out
        return out
    finally:
        dist.destroy_process_group()


def test_a_mesh_groups_collective_raises_at_the_jobs_pg_timeout(pool: Pool) -> None:
    # the pool's own timeout (60 s) is far below torch's default for the mesh's groups (30 minutes):
    # without the bound this job would time out in the pool instead of raising in rank 0
    first, *_ = pool.run(_skipped_collective_job, 4, free_port(), 2.0, timeout=60)
    assert first["error"] is not None and "Timed out" in first["error"], first
    assert first["seconds"] >= 1.5, first  # it waited for the bound, not for a broken connection
