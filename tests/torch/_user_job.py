"""The example Llama job (``examples.llama.job:main``) with faults injected from the environment, for tests.

A test launches workers with entrypoint ``tests.torch._user_job:main``; the workers inherit its
environment, and each variable below arms one fault in the worker it names:

* ``ELASTIC_TEST_BUILD_FAULT=<mesh>:<raise|keys>``: the first build on that mesh (``dp_shard2.tp2``)
  raises on the new world's rank 0 after the mesh's collectives (``raise``), or builds a model with
  a third block on every rank, whose keys the running state does not have (``keys``).
* ``ELASTIC_TEST_DIE=<worker>:<step>``: that worker SIGKILLs itself in that step, after its first
  micro-batch's backward (a lost node mid-step); ``<worker>:+<n>``: in the n-th step it trains
  (0-based; a joiner's first steps come whenever it has started).
* ``ELASTIC_TEST_DIE_EXCHANGE=<worker>:<generation>``: that worker SIGKILLs itself inside the
  exchange of that generation's rescale, before it sends or copies anything (a lost node
  mid-reshard).
* ``ELASTIC_TEST_MANAGER_GLOBAL_BATCH=<n>``: the loop passes ``global_batch=n`` to its Manager
  (a script whose settings disagree with the job's).
* ``ELASTIC_TEST_HOLD_FOR_GIVE_UP=<step>``: every worker, in that step, after its first
  micro-batch, waits until the coordinator has asked it to give the step up (a shrink posted
  while the step is in progress; bounded), so the next micro-batch's check gives it up.
* ``ELASTIC_TEST_STEP_GATE=<file>``: before asking for step ``s``, every worker waits while
  ``s`` is at or past the number the file holds (bounded): the test holds the job at a boundary
  while a grow's joiners start, so a tiny model cannot reach ``max_steps`` meanwhile.

Nothing here is shipped: the faults live in the test's process, around the user's code and
around ``elastic.reshard.execute.execute``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any


def _me() -> str:
    return os.environ.get("ELASTIC_WORKER_ID", "")


def _die(why: str) -> None:
    print(f"worker {_me()}: dying ({why})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_build(spec: str) -> None:
    import torch.distributed as dist

    from examples.llama import job

    mesh, _, kind = spec.rpartition(":")
    original = job.build
    fired: list[bool] = []

    def build(world: Any, dtype: Any = None) -> tuple:
        shape = ".".join(f"{k}{v}" for k, v in world.layout.dims)
        armed = shape == mesh and not fired
        if armed:
            fired.append(True)
        if armed and kind == "keys":
            from examples.llama import byo

            cfg = dataclasses.replace(byo.config(), n_layers=3)
            saved = byo.config
            job.config = lambda: cfg  # type: ignore[assignment]
            try:
                return original(world, dtype)
            finally:
                job.config = saved  # type: ignore[assignment]
        out = original(world, dtype)
        if armed and kind == "raise" and dist.get_rank() == 0:
            raise RuntimeError(f"out of memory on {shape} (simulated)")
        return out

    job.build = build  # type: ignore[assignment]


def _arm_die(spec: str) -> None:
    from elastic.torch.coordinated import CoordinatedManager

    worker, _, step = spec.rpartition(":")
    if worker != _me():
        return
    original = CoordinatedManager.micro_batches
    trained: list[int] = []

    def micro_batches(self: Any, s: int) -> Any:
        if s not in trained:
            trained.append(s)
        due = len(trained) - 1 == int(step[1:]) if step.startswith("+") else s == int(step)
        for i, b in enumerate(original(self, s)):
            if due and i == 1:
                _die(f"in step {s}, after its first micro-batch")
            yield b

    CoordinatedManager.micro_batches = micro_batches  # type: ignore[method-assign]


def _arm_die_exchange(spec: str) -> None:
    import elastic.reshard.execute as ex
    from elastic.torch.coordinated import current_session

    worker, _, gen = spec.rpartition(":")
    if worker != _me():
        return
    def dying(original: Any) -> Any:
        def execute(prepared: Any, *a: Any, **kw: Any) -> Any:
            s = current_session()
            if s is not None and s.gen + 1 == int(gen):  # moving into generation gen (not a recovery)
                _die(f"inside the exchange of generation {gen}")
            return original(prepared, *a, **kw)

        return execute

    # execute_local: replicas that shrink copy locally, with no group (no byte crosses processes)
    ex.execute, ex.execute_local = dying(ex.execute), dying(ex.execute_local)


def _arm_manager_batch(n: str) -> None:
    import elastic.torch as et

    real = et.Manager

    def manager(build: Any, **kw: Any) -> Any:
        return real(build, global_batch=int(n), **kw)

    et.Manager = manager  # type: ignore[assignment,misc]


_HELD: list[int] = []  # the step this process held in (once: the function is called again after a give-up)


def _arm_hold_for_give_up(step: str) -> None:
    import time

    from elastic.torch.coordinated import CoordinatedManager, current_session

    if getattr(CoordinatedManager.micro_batches, "_holds", False):
        return  # armed by the first call of main()
    original = CoordinatedManager.micro_batches

    def micro_batches(self: Any, s: int) -> Any:
        for i, b in enumerate(original(self, s)):  # the next item's check runs in enumerate's next()
            yield b
            if s == int(step) and i == 0 and not _HELD:
                _HELD.append(s)
                session = current_session()
                deadline = time.monotonic() + 120
                while session._give_up_req != (session.gen, s) and time.monotonic() < deadline:
                    time.sleep(0.01)

    micro_batches._holds = True  # type: ignore[attr-defined]
    CoordinatedManager.micro_batches = micro_batches  # type: ignore[method-assign]


def _arm_step_gate(path: str) -> None:
    import time
    from pathlib import Path

    from elastic.torch.coordinated import CoordinatedManager, current_session

    if getattr(CoordinatedManager.steps, "_gated", False):
        return  # armed by the first call of main()
    original = CoordinatedManager.steps

    def limit() -> int:
        text = Path(path).read_text().strip() if Path(path).exists() else ""
        return int(text) if text else 1 << 62

    def steps(self: Any) -> Any:
        it = original(self)
        while True:
            session = current_session()
            if session is not None:
                deadline = time.monotonic() + 300
                while session.next_step >= limit():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"step gate {path} held step {session.next_step} for 300 s")
                    time.sleep(0.01)
            try:
                s = next(it)
            except StopIteration:
                return
            yield s

    steps._gated = True  # type: ignore[attr-defined]
    CoordinatedManager.steps = steps  # type: ignore[method-assign]


def main() -> None:
    from examples.llama import job

    if n := os.environ.get("ELASTIC_TEST_MANAGER_GLOBAL_BATCH"):
        _arm_manager_batch(n)
    if spec := os.environ.get("ELASTIC_TEST_BUILD_FAULT"):
        _arm_build(spec)
    if spec := os.environ.get("ELASTIC_TEST_DIE"):
        _arm_die(spec)
    if spec := os.environ.get("ELASTIC_TEST_DIE_EXCHANGE"):
        _arm_die_exchange(spec)
    if spec := os.environ.get("ELASTIC_TEST_HOLD_FOR_GIVE_UP"):
        _arm_hold_for_give_up(spec)
    if spec := os.environ.get("ELASTIC_TEST_STEP_GATE"):
        _arm_step_gate(spec)
    job.main()
