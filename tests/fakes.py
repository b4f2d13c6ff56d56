"""Fakes at our own boundary that several test packages share."""

from __future__ import annotations


class Clock:
    """The clock a test moves: ``clock()`` reads ``clock.t``, ``clock.t += dt`` advances it. Code
    under test takes it where it would take ``time.time`` (``Controller(clock=...)``,
    ``Coordinator(clock=...)``)."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
