"""A controller PROCESS for the crash test: ``elastic.cli.serve.build`` on a Ray cluster (detached mode),
with the load read from a file the test writes (a metric source at our own boundary). One JSON line per
tick on stdout: what the controller did and what Ray shows, so the test can check it from outside;
and one when a directive reaches the job's coordinator (the test kills the controller after it).

    python -m tests.controller._ray_driver CONFIG.json DB_URL RAY_ADDRESS LOAD_FILE OWNER [finish|give-up]

``finish`` (the default): a shrink's members finish the step in progress; ``give-up``: they give it
up at the next micro-batch (``LaunchOptions.shrink_gives_up_step``, the backends' default).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from elastic.cli.serve import build, run
from elastic.config import load_config
from elastic.metrics.sample import MetricSample


class FileSource:
    def __init__(self, path: str) -> None:
        self.path = path

    def sample(self, service: str, now: float) -> MetricSample | None:
        try:
            return MetricSample(float(open(self.path).read()), now, "file")
        except (OSError, ValueError):
            return None


def main(config: str, db_url: str, address: str, load_file: str, owner: str, shrink: str = "finish") -> None:
    from elastic.backends import ray_jobs
    from elastic.serve.server import ReplicaConfig
    from elastic.train.launch import LaunchOptions

    posted = ray_jobs._RemoteCoordinator.directive

    def directive(self: ray_jobs._RemoteCoordinator, generation: int, layout: Any, members: Any, **kw: Any) -> Any:
        out = posted(self, generation, layout, members, **kw)
        _line({"event": "directive", "job": self.job, "generation": generation})  # the test kills after this
        return out

    ray_jobs._RemoteCoordinator.directive = directive  # type: ignore[method-assign]
    cfg = load_config(data=json.load(open(config)))
    served = build(cfg, db_url=db_url, ray_address=address, owner=owner, sources={"chat": FileSource(load_file)},
                   replica_config=ReplicaConfig(model="tiny", max_running=4),
                   # "finish": a shrink waits out its step in progress, and the crash test kills the
                   # controller while the members compute it (given up, the step's rest takes a
                   # micro-batch: the test then slows the leaver's exit to land its kill mid-shrink)
                   train_options=LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120,
                                               shrink_gives_up_step=shrink == "give-up"))
    import ray

    backend = served.backend
    _line({"event": "started", "adopted": backend.adopted})

    def report(res) -> None:
        rt = backend.job_runtime("tiny-job")
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == backend.namespace]
        _line({
            "event": "tick", "t": time.time(), "reason": res.reason, "acted": res.acted, "applied": res.applied,
            "error": res.error, "ready": served.controller.ready, "leader": served.controller.is_leader,
            "service_gpus": [str(g) for g in backend.service_gpus("chat")],
            "job": None if rt is None else {"layout": str(rt.layout), "generation": rt.generation, "step": rt.step,
                                            "gpus": [str(g) for g in rt.gpus], "phase": rt.phase},
            "ray_gpus_free": ray.available_resources().get("GPU", 0.0), "named_actors": sorted(named),
        })

    run(served, on_tick=report)


def _line(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")  # one write: lines from two threads never interleave
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:7])
