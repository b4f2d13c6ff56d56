"""Fault injection for tests and chaos drills: one object the worker agent asks at its fault points.

What it is for: a test (or a drill) makes a worker die as a lost node at a named point of a rescale,
write its checkpoints slowly, leave slowly, or hold a step it computed. :class:`WorkerAgent` takes a
:class:`Faults` (``faults=``) and calls it at those points; the default, :data:`NO_FAULTS`, does
nothing. The environment is read once, where a worker process starts
(:func:`elastic.train.worker.main` calls :meth:`Faults.from_env`): a test that launches real worker
processes sets the variables below, one that builds an agent itself passes a ``Faults``.

What it must not do: read the process environment itself, or change anything but timing and whether the
process lives.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from elastic.errors import SpecError
from elastic.train.agent.support import _hard_exit

__all__ = ["DIE_POINTS", "HOLD_STEP_MAX_S", "NO_FAULTS", "Faults"]

DIE_POINTS = ("group", "rendezvous", "exchange", "commit", "init_pg", "groups", "engine")
"""The points of a rescale where :meth:`Faults.at` can make a worker die (see ``Faults.die_at``)."""

HOLD_STEP_MAX_S = 300.0
"""The longest :meth:`Faults.hold_step` waits: a forgotten file cannot hang a job."""

_HOLD_POLL_S = 0.05

_EXCHANGE = "ELASTIC_FAULT_EXCHANGE"
_SLOW_CHECKPOINT = "ELASTIC_FAULT_SLOW_CHECKPOINT"
_SLOW_LEAVE = "ELASTIC_FAULT_SLOW_LEAVE"
_HOLD_STEP = "ELASTIC_FAULT_HOLD_STEP"


@dataclass(frozen=True)
class Faults:
    """The faults injected into one worker; ``Faults()`` injects none."""

    die_at: tuple[str, int, str] | None = None
    """``ELASTIC_FAULT_EXCHANGE="<worker>:<generation>:<where>"``: that worker dies (``os._exit(9)``,
    as a lost node) in the rescale to that generation: ``group`` before it joins the reshard group,
    ``rendezvous`` after that group's roll call, before its own part of gloo's rendezvous,
    ``exchange`` as the exchange begins (its peers wait for it inside it), ``commit`` just after its
    part of it, ``init_pg`` after the commit, before it joins the new default group, ``groups``
    after the new default group, before each of the engine's own groups (TP, DP, PP), ``engine``
    once its new engine is built (its peers are then in the first step)."""

    slow_checkpoint: tuple[str, float] | None = None
    """``ELASTIC_FAULT_SLOW_CHECKPOINT="<worker>:<seconds>"``: that worker's checkpoint writes take
    that much longer (a slow disk)."""

    slow_leave_s: float = 0.0
    """``ELASTIC_FAULT_SLOW_LEAVE="<seconds>"``: a leaver whose bytes have landed waits that long
    before it goes (a node slow to let its GPU go); the crash test lands a controller's kill while a
    shrink waits for its leaver."""

    hold_step_file: str = ""
    """``ELASTIC_FAULT_HOLD_STEP="<file>"``: while that file exists, a worker that computed a step
    waits before it reports it (at most :data:`HOLD_STEP_MAX_S`): a test holds the job inside a
    step, so a controller's kill lands while a shrink waits for the step's boundary however fast
    the steps are."""

    def __post_init__(self) -> None:
        if self.die_at is not None and self.die_at[2] not in DIE_POINTS:
            raise SpecError(
                f"Faults.die_at: unknown point {self.die_at[2]!r}; use one of {', '.join(DIE_POINTS)}"
            )
        seconds = [("slow_leave_s", self.slow_leave_s)]
        if self.slow_checkpoint is not None:
            seconds.append(("slow_checkpoint", self.slow_checkpoint[1]))
        for name, s in seconds:
            if not (math.isfinite(s) and s >= 0):
                raise SpecError(f"Faults.{name}: {s!r} seconds; use a finite number >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Faults:
        """The faults the ``ELASTIC_FAULT_*`` variables of ``environ`` name (unset or empty: none).

        Raises :class:`SpecError` (a ``ValueError``) naming the variable and its format."""
        die = environ.get(_EXCHANGE, "").strip()
        slow = environ.get(_SLOW_CHECKPOINT, "").strip()
        leave = environ.get(_SLOW_LEAVE, "").strip()
        return cls(
            die_at=_die_point(die) if die else None,
            slow_checkpoint=_worker_seconds(slow) if slow else None,
            slow_leave_s=_seconds(_SLOW_LEAVE, leave, '"<seconds>"') if leave else 0.0,
            hold_step_file=environ.get(_HOLD_STEP, "").strip(),
        )

    def at(self, worker: str, generation: int, where: str) -> None:
        """``worker`` reached ``where`` in the rescale to ``generation``: die there if told to."""
        if self.die_at == (worker, generation, where):
            _hard_exit(9, f"worker {worker}: fault injected at the {where} of generation {generation}")

    def checkpoint_write_delay(self, worker: str) -> float:
        """Seconds ``worker`` waits before each checkpoint write (0: none)."""
        if self.slow_checkpoint is not None and self.slow_checkpoint[0] == worker:
            return self.slow_checkpoint[1]
        return 0.0

    def before_leaving(self) -> None:
        """A leaver's bytes have landed: wait ``slow_leave_s`` before it goes."""
        if self.slow_leave_s > 0:
            time.sleep(self.slow_leave_s)

    def hold_step(self) -> None:
        """A step was computed: wait while ``hold_step_file`` exists, at most :data:`HOLD_STEP_MAX_S`."""
        if not self.hold_step_file:
            return
        deadline = time.monotonic() + HOLD_STEP_MAX_S
        while os.path.exists(self.hold_step_file) and time.monotonic() < deadline:
            time.sleep(_HOLD_POLL_S)


NO_FAULTS = Faults()
"""The agent's default: no fault anywhere."""


def _die_point(text: str) -> tuple[str, int, str]:
    form = f'"<worker>:<generation>:<where>" with <where> one of {", ".join(DIE_POINTS)}'
    parts = text.rsplit(":", 2)  # a worker id may hold a colon; a generation and a point do not
    if len(parts) != 3 or not parts[0] or parts[2] not in DIE_POINTS:
        raise SpecError(f"{_EXCHANGE}={text!r}: must be {form}")
    worker, generation, where = parts
    try:
        gen = int(generation)
    except ValueError:
        raise SpecError(f"{_EXCHANGE}={text!r}: must be {form} (generation: an integer)") from None
    if gen < 0:
        raise SpecError(f"{_EXCHANGE}={text!r}: must be {form} (generation: >= 0)")
    return worker, gen, where


def _worker_seconds(text: str) -> tuple[str, float]:
    form = '"<worker>:<seconds>"'
    worker, sep, seconds = text.rpartition(":")
    if not sep or not worker:
        raise SpecError(f"{_SLOW_CHECKPOINT}={text!r}: must be {form}")
    return worker, _seconds(_SLOW_CHECKPOINT, seconds, form, text)


def _seconds(name: str, seconds: str, form: str, text: str | None = None) -> float:
    try:
        s = float(seconds)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s >= 0):
        shown = seconds if text is None else text
        raise SpecError(f"{name}={shown!r}: must be {form} (seconds: a number >= 0)")
    return s
