"""What the agent's halves share: held state, phase timing, plan digests and small helpers."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.model import Layout
from elastic.train.agent.options import EngineBase, State, default_engine_factory
from elastic.train.rendezvous import Directive

log = logging.getLogger(__name__)

@dataclass
class _Snapshot:
    """A generation's state a member holds without an engine: the old one a transactional rescale
    goes back to if it is rolled back, or the new one received when building its groups broke."""

    generation: int
    layout: Layout | None
    state: State
    applied: int


class HeldState(EngineBase):
    """What a keeper holds while its job is paused: the state tensors of its box, nothing else.

    It stands where the engine stands so the next directive's plan and prepare read
    ``state()`` as from any engine; it has no model, no process group and runs no step.
    """

    def __init__(self, state: State) -> None:
        self._state = state

    def state(self) -> State:
        return self._state

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state.values())

    def train_step(self, step: int) -> Any:
        raise RuntimeError(f"a keeper holds a paused job's state and runs no step (asked for step {step})")

    def close(self) -> None:
        self._state = {}


class _Phases:
    """Seconds between successive ``mark``s, by phase name (the rescale's per-worker breakdown)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def report(self) -> dict[str, float]:
        s = self.seconds
        out = {f"{k}_seconds": v for k, v in s.items()}
        out["execute_seconds"] = s.get("group", 0.0) + s.get("exchange", 0.0)
        out["rebuild_seconds"] = s.get("close", 0.0) + s.get("init_pg", 0.0) + s.get("engine", 0.0)
        return out


ROLL_CALL_ASK_S = 0.1
"""A roll call still waiting after this long asks the coordinator whether to give up (then as often)."""


def _preload(factory: Any) -> None:
    """Import what a rescale needs now, so that a joiner's first plan and engine do not pay for it.

    Importing the planner (numpy/scipy) and the engine takes a noticeable part of a second; done
    on first use, all of it would land inside the pause of the first rescale a joiner takes part in.
    """
    import elastic.reshard.execute  # noqa: F401
    import elastic.reshard.plan  # noqa: F401

    if getattr(factory, "func", factory) is default_engine_factory:
        import elastic.train.engine  # noqa: F401


def plan_digest(plan: Any) -> str:
    """The same for two plans exactly when they move the same bytes to the same ranks."""
    h = hashlib.sha256()
    h.update(repr(sorted(plan.new_ranks.items())).encode())
    h.update(repr(plan.messages).encode())
    h.update(repr(plan.local_copies).encode())
    h.update(repr(plan.new_shards).encode())
    return h.hexdigest()[:32]


_COMM_ERRORS = ("connection closed", "connection reset", "read error", "write error", "timed out", "gloo",
                "nccl", "broken pipe", "socket")


EARLY_PREPARE_HEADROOM = 0.9
"""Of a GPU's unreserved memory, the share a preparation beside a running step may take."""


def _early_alloc_budget(device: str | torch.device) -> int | None:
    """Bytes a preparation beside a running step may allocate on ``device``: None (no limit) for
    host memory; on a GPU, ``EARLY_PREPARE_HEADROOM`` of what no allocator has reserved, so the
    step never finds its own cached blocks taken (whatever it took from the cache it can get back
    from the driver)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free * EARLY_PREPARE_HEADROOM)


def _kept_contributors(d: Directive, new_ranks: dict[str, int]) -> set[str] | None:
    """Who adds a given-up step's kept work when the new layout of ``d`` finishes it: per TP
    coordinate, the old member at that coordinate on both sides with the lowest new rank (its kept
    gradients are exactly its new boxes', summed over the old replicas already); the new DP
    all-reduce hands them to everyone, joiners included. None: the work cannot be used (no
    directive switching from one stage to one stage with the same TP split, a recovery or a hold,
    or a TP coordinate no such old member holds). The same answer on every member: it reads
    only the directive and the agreed plan's ranks."""
    if d.hold or d.commit_step is not None or not d.old_layout:
        return None
    old, new = d.old_layout, d.layout
    if old.pp != 1 or new.pp != 1 or old.tp != new.tp or old.ep != 1 or new.ep != 1:
        return None
    chosen: dict[int, tuple[int, str]] = {}
    for w, r in new_ranks.items():
        t = new.coords(r)[0]
        if w in d.old_ranks and old.coords(d.old_ranks[w])[0] == t and (t not in chosen or r < chosen[t][0]):
            chosen[t] = (r, w)
    if len(chosen) != new.tp:
        return None
    return {w for _, w in chosen.values()}


def _same_rescale(a: Directive | None, b: Directive) -> bool:
    """``a`` is ``b`` up to its switch step (a shrink whose step in progress was given up switches
    one step earlier than first posted; the plan and the buffers prepared for it are the same)."""
    return a is not None and dataclasses.replace(a, switch_step=b.switch_step) == b


def _is_comm_error(e: BaseException) -> bool:
    """A collective failed because a peer went away (as opposed to a bug or a bad input here), or
    the step was given up because the coordinator said one did (``StepInterrupted``)."""
    from elastic.train.groups import StepInterrupted

    if isinstance(e, (StepInterrupted, getattr(dist, "DistError", ()))):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _COMM_ERRORS)


def _same_tensors(a: State, b: State) -> bool:
    """Whether both states are views of the same memory, tensor by tensor.

    Not ``is``: ``param.data`` is a new tensor object on every call, so identity would call
    every early preparation stale and redo it inside the pause.
    """
    return a.keys() == b.keys() and all(_same_memory(a[k], b[k]) for k in a)


def _same_memory(x: Any, y: Any) -> bool:
    return x is y or (x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
                      and x.dtype == y.dtype and x.device == y.device)


def _result_json(r: Any, memory: Any = None) -> dict[str, Any]:
    """A step's result as the worker reports it with its next step request. ``memory``: the
    engine's last ``MeasuredMemory`` (the reference trainer's ``TrainEngine.memory``), sent only
    when it is of this very step (the engine measures a layout's first steps and every
    ``MEMORY_EVERY``-th): the coordinator keeps each generation's worst rank for the controller."""
    loss = getattr(r, "loss", None)
    loss = float(loss) if loss is not None and math.isfinite(float(loss)) else None
    out: dict[str, Any] = {"step": int(r.step), "loss": loss, "tokens": int(getattr(r, "tokens", 0)),
                           "seconds": float(getattr(r, "seconds", 0.0))}
    if memory is not None and getattr(memory, "step", None) == out["step"]:
        out["memory"] = memory.as_json()
    return out


def _short(e: BaseException, limit: int = 400) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _shutdown(pg: Any) -> None:
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean shutdown
        pass


def _hard_exit(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)
