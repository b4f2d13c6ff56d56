"""A backend's optional capabilities are typed interfaces (``elastic.backends.base``: ``Drains``,
``Pauses``, ``Checkpoints``, ``Fenced``, ``Adopts``), read once when the controller starts; the
controller uses each only where the backend has it and says plainly where it does not."""

from __future__ import annotations

import pytest

from elastic import store as db
from elastic.backends.base import BackendError, Capabilities
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from tests.fakes import Clock

from .fake_backend import FakeBackend

CONFIG = {
    "pool": {"name": "p", "nodes": 1, "gpus_per_node": 4, "hardware": "h100-80g"},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 4}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 4, "global_batch": 64,
              "checkpoint": {"dir": "/checkpoints"}}],
}


class Plain(FakeBackend):
    """Only the required core: no pause, no on-demand checkpoint."""

    pause_job = None  # type: ignore[assignment]
    checkpoint_job = None  # type: ignore[assignment]


class Full(FakeBackend):
    """Every optional capability."""

    fence = None

    def __init__(self, nodes: dict[str, int]) -> None:
        super().__init__(nodes)
        self.adopted = ["adopted job pretrain: tp1.pp1.dp2 generation 3 at step 40"]
        self.drained: list[tuple[str, list]] = []

    def drain_ahead(self, service, gpus, hold_seconds):
        self.drained.append((service, list(gpus)))
        return []

    def adopt(self) -> list[str]:
        return list(self.adopted)


@pytest.mark.parametrize(("backend", "want"), [
    (FakeBackend, Capabilities(pauses=True, checkpoints=True)),
    (Plain, Capabilities()),
    (Full, Capabilities(drains=True, pauses=True, checkpoints=True, fenced=True, adopts=True)),
])
def test_capabilities_are_read_from_the_interfaces_a_backend_implements(backend, want) -> None:
    assert Capabilities.of(backend({"n0": 4})) == want


def _controller(backend, tmp_path) -> Controller:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    db.upgrade(url)
    return Controller(load_config(data=CONFIG), backend, db.Store.from_url(url), {"chat": InProcessSource(max_age=60)},
                      owner="ctl", clock=Clock(1_000_000.0))


def test_the_controller_uses_what_the_backend_has(tmp_path) -> None:
    b = Full({"n0": 4})
    ctl = _controller(b, tmp_path)
    assert ctl.caps.fenced and ctl.caps.adopts
    # the backend was handed the controller's lease check: it refuses while the lease is not held
    with pytest.raises(db.LeaseLost, match="does not hold the lease"):
        b.fence()
    ctl.tick()  # takes the lease and recovers: the backend's adoption notes are on record
    recovered = [d for d in db.list_decisions(ctl.store, 50, pool="p") if d.reason == "Recovered"]
    assert recovered and b.adopted[0] in recovered[0].message, [(d.reason, d.message) for d in recovered]
    b.fence()  # the lease is held now: the check passes


def test_a_backend_without_a_capability_is_told_so_and_nothing_is_called(tmp_path) -> None:
    b = Plain({"n0": 4})
    ctl = _controller(b, tmp_path)
    assert not ctl.caps.pauses and not ctl._can_pause
    with pytest.raises(BackendError, match="backend cannot save a checkpoint on demand"):
        ctl.checkpoint_job("pretrain")
