"""Engine factories for the agent tests, loaded by worker processes through ``ELASTIC_ENGINE_FACTORY``.

:func:`slow_steps`: the real engine, each step padded to a fixed wall time, so a test knows
roughly where the job is (rescales near ``max_steps``); with ``ELASTIC_TEST_FIRST_STEP_RELEASE=<file>``
the first step of an engine built from a state (a later generation's) also waits for that file; with
``ELASTIC_TEST_SLOW_HOLD_STEP=<step>`` that step, in any generation, begins by marking
``<ELASTIC_TEST_HOLD_MARK>/<worker>.held`` and waiting for ``ELASTIC_TEST_HOLD_RELEASE``.

A fault at our own boundary (the :class:`elastic.train.agent.Engine` protocol), not a mock of
the trainer: :func:`mislaid_state_on_one_worker` builds the real ``TrainEngine`` and trains
with it unchanged; only the state it *hands to the resharder* on the worker named by
``ELASTIC_TEST_FAULTY_WORKER`` has one tensor in column-major order, which
``elastic.reshard.execute.prepare`` refuses (``ReshardError``) before anything moves.
"""

from __future__ import annotations

import os
import time
from typing import Any

from elastic.model import Layout
from elastic.train.agent import EngineBase, State, default_engine_factory


class _MislaidState(EngineBase):
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def state(self) -> State:
        out = dict(self._engine.state())
        key = next(k for k, t in out.items() if t.dim() == 2 and min(t.shape) > 1)
        out[key] = out[key].t().contiguous().t()  # same shape and values, column-major: not the contract
        return out

    def train_step(self, step: int) -> Any:
        return self._engine.train_step(step)

    def close(self) -> None:
        self._engine.close()


def mislaid_state_on_one_worker(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    engine = default_engine_factory(config, layout, rank, state, timeout_s=60)
    if os.environ.get("ELASTIC_WORKER_ID") == os.environ.get("ELASTIC_TEST_FAULTY_WORKER"):
        return _MislaidState(engine)
    return engine


def _wait_for_file(path: str, seconds: float = 120.0) -> None:
    """Until ``path`` exists (bounded: a test that failed before writing it must not hang a worker)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class _Slow(EngineBase):
    """Every step takes at least ``ELASTIC_TEST_STEP_SECONDS``: a job whose progress a test can outpace.
    With ``release``, the first step also waits until that file exists: a test reads the job while
    that step is certainly in progress, then lets it end. With ``hold_step``, that step marks
    ``<mark>/<worker>.held`` and waits for ``hold_release``: the coordinator has answered ``go`` for
    it (it counts as begun) and the job is still running until the test writes the file."""

    def __init__(self, engine: Any, seconds: float, release: str | None = None, hold_step: int = -1,
                 mark: str | None = None, hold_release: str | None = None) -> None:
        self._engine, self._seconds, self._release = engine, seconds, release
        self._hold_step, self._mark, self._hold_release = hold_step, mark, hold_release

    def state(self) -> State:
        return self._engine.state()

    def train_step(self, step: int) -> Any:
        t0 = time.monotonic()
        if self._release is not None:
            _wait_for_file(self._release)
            self._release = None
        if step == self._hold_step:
            if self._mark:
                with open(os.path.join(self._mark, f"{os.environ.get('ELASTIC_WORKER_ID', os.getpid())}.held"), "w"):
                    pass
            if self._hold_release:
                _wait_for_file(self._hold_release)
        out = self._engine.train_step(step)
        time.sleep(max(0.0, self._seconds - (time.monotonic() - t0)))
        return out

    def close(self) -> None:
        self._engine.close()


def slow_steps(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    engine = default_engine_factory(config, layout, rank, state, timeout_s=60)
    # built from a state: a later generation (a survivor or a joiner of a rescale), whose first step is held
    release = os.environ.get("ELASTIC_TEST_FIRST_STEP_RELEASE") if state is not None else None
    return _Slow(engine, float(os.environ.get("ELASTIC_TEST_STEP_SECONDS", "0.3")), release,
                 int(os.environ.get("ELASTIC_TEST_SLOW_HOLD_STEP", "-1")), os.environ.get("ELASTIC_TEST_HOLD_MARK"),
                 os.environ.get("ELASTIC_TEST_HOLD_RELEASE"))


def slow_micro_batches(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    """The real engine (give-up checks and all), each micro-batch padded by ``ELASTIC_TEST_MICRO_SECONDS``
    after its give-up check: a step a shrink can catch in the middle."""
    engine = default_engine_factory(config, layout, rank, state, timeout_s=60)
    seconds = float(os.environ.get("ELASTIC_TEST_MICRO_SECONDS", "0.5"))
    forward = engine._forward_step  # type: ignore[attr-defined]

    def padded(step: int, micro: int, x: Any, losses: list[Any]) -> Any:
        out = forward(step, micro, x, losses)
        time.sleep(seconds)
        return out

    engine._forward_step = padded  # type: ignore[attr-defined]
    return engine


_HELD: list[int] = []  # the step this process held in (once)


def _held(engine: Any, state: State | None) -> Any:
    """In step ``ELASTIC_TEST_HOLD_STEP`` (once per process, first generation only), wait before the
    second micro-batch's give-up check until the agent has asked for the step to be given up
    (bounded): a rescale posted while that step is in progress is then caught at micro-batch 1
    whatever the machine's load, not only when it lands before the last check. With
    ``ELASTIC_TEST_HOLD_RELEASE=<file>`` the wait is for that file instead, which the test writes once
    it has posted a rescale that asks for no give-up (two pipeline stages): the step then ends nowhere
    before the rescale is posted. With ``ELASTIC_TEST_HOLD_MARK=<dir>`` each worker says it is holding
    (``<dir>/<worker>.held``): a test that posts after every mark is there knows micro-batch 0's work
    is done and kept. With pipeline stages only the first stage's members get there before the
    release: a later stage receives its second micro-batch's input outside ``_forward_step``, from
    a first stage that holds."""
    # built from no state: the first generation. A joiner or a rescaled member finishing the
    # given-up step must not wait for a request that will not come
    hold = int(os.environ.get("ELASTIC_TEST_HOLD_STEP", "-1")) if state is None else -1
    release = os.environ.get("ELASTIC_TEST_HOLD_RELEASE")
    forward = engine._forward_step  # type: ignore[attr-defined]

    def held(step: int, micro: int, x: Any, losses: list[Any]) -> Any:
        if step == hold and micro == 1 and not _HELD:
            _HELD.append(step)
            if mark := os.environ.get("ELASTIC_TEST_HOLD_MARK"):  # the test posts once every member is here
                with open(os.path.join(mark, f"{os.environ.get('ELASTIC_WORKER_ID', os.getpid())}.held"), "w"):
                    pass
            if release:
                _wait_for_file(release)
            else:
                deadline = time.monotonic() + 120
                while getattr(engine, "_give_up_step", None) != step and time.monotonic() < deadline:
                    time.sleep(0.01)
        return forward(step, micro, x, losses)  # its give-up check comes first

    engine._forward_step = held  # type: ignore[attr-defined]
    return engine


def held_checked_micro_batches(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    """:func:`slow_checked_micro_batches`, held for a give-up (:func:`_held`)."""
    return _held(slow_checked_micro_batches(config, layout, rank, state), state)


def held_micro_batches(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    """:func:`slow_micro_batches`, held for a give-up (:func:`_held`)."""
    return _held(slow_micro_batches(config, layout, rank, state), state)


def slow_checked_micro_batches(config: dict[str, Any], layout: Layout, rank: int, state: State | None) -> Any:
    """The real engine, each micro-batch padded by ``ELASTIC_TEST_MICRO_SECONDS``: before its give-up
    check from the second on, after it on the first. A rescale posted at any time inside a step is
    then caught at a micro-batch >= 1 with work done (the windows before the first check and after
    the last are milliseconds)."""
    engine = default_engine_factory(config, layout, rank, state, timeout_s=60)
    seconds = float(os.environ.get("ELASTIC_TEST_MICRO_SECONDS", "0.5"))
    forward = engine._forward_step  # type: ignore[attr-defined]

    def padded(step: int, micro: int, x: Any, losses: list[Any]) -> Any:
        if micro > 0:
            time.sleep(seconds)
        out = forward(step, micro, x, losses)  # its give-up check comes first
        if micro == 0:
            time.sleep(seconds)
        return out

    engine._forward_step = padded  # type: ignore[attr-defined]
    return engine
