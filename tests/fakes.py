"""Fakes at our own boundary that several test packages share."""

from __future__ import annotations

from typing import Any


class Clock:
    """The clock a test moves: ``clock()`` reads ``clock.t``, ``clock.t += dt`` advances it. Code
    under test takes it where it would take ``time.time`` (``Controller(clock=...)``,
    ``Coordinator(clock=...)``)."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tick(ctl: Any, source: Any, clock: Clock, load: float, dt: float = 20.0, service: str = "chat") -> Any:
    """``dt`` seconds later, ``load`` on ``service``'s metric: one controller tick, which must not fail."""
    clock.t += dt
    source.set(service, load, clock.t)
    res = ctl.tick()
    assert res.error is None, res.error
    return res
