"""The reference replica as a Ray actor, for the embedded Ray backend.

``ReplicaActor`` (``num_gpus=1``: it holds one logical GPU of the embedded pool while the
work runs on CPU) starts the same HTTP server as ``python -m elastic.serve`` in a thread of
the actor process, on a free loopback port, and returns its URL. The backend scales a
service by creating or killing these actors; the controller reads their ``/metrics``.
This module imports Ray; nothing pure may import it.
"""

from __future__ import annotations

from dataclasses import asdict

import ray

from elastic.serve.server import ReplicaConfig, ThreadedReplica


class _Replica:
    def __init__(self, config: dict | None = None, host: str = "127.0.0.1") -> None:
        self.config = ReplicaConfig(**(config or {}))
        self.host = host
        self._replica: ThreadedReplica | None = None

    def start(self) -> str:
        """Start the server (idempotent) and return its base URL."""
        if self._replica is None:
            self._replica = ThreadedReplica(self.config, self.host, 0)
        return self._replica.url

    def node_id(self) -> str:
        """The Ray node this replica runs on (a spare's GPU lease is pinned there)."""
        return ray.get_runtime_context().get_node_id()

    def url(self) -> str | None:
        return None if self._replica is None else self._replica.url

    def stop(self) -> None:
        if self._replica is not None:
            self._replica.stop()
            self._replica = None


ReplicaActor = ray.remote(num_gpus=1, num_cpus=0)(_Replica)


def start_replica(config: ReplicaConfig | None = None, **actor_options) -> tuple[ray.actor.ActorHandle, str]:
    """Create one replica actor and wait for its URL: ``(handle, "http://127.0.0.1:PORT")``."""
    handle = ReplicaActor.options(**actor_options).remote(asdict(config or ReplicaConfig()))
    return handle, ray.get(handle.start.remote(), timeout=120)
