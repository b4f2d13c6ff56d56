"""What every part of the controller builds on: the state one pool's controller keeps, and the
small value types and helpers its parts share.

``ControllerState`` only declares the state (``Controller.__init__`` sets it), so that each part
(lease, interventions, observe, decide, apply, record) is a typed mixin over the same object: one
controller per pool, whose attributes the admin API, the operator and the tests read directly.
Nothing here touches the backend or the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from elastic.backends.base import Backend, Capabilities, JobRuntime
from elastic.config import ControllerConfig
from elastic.metrics.sample import MetricSource
from elastic.model import GPU, HardwareSpec, Layout
from elastic.policy.types import PolicyState, ReplicaDecision
from elastic.scheduler.types import SchedulePlan
from elastic.store import FencedStore, InterventionRecord, Store

#: every part logs under the one name operators filter on
log = logging.getLogger("elastic.controller")


@dataclass(frozen=True)
class Backoff:
    """A job whose start or grow failed ``failures`` times in a row: not given more GPUs before ``next_at``."""

    failures: int
    reason: str
    next_at: float
    last_failure_at: float


@dataclass
class TickResult:
    at: float
    acted: bool
    reason: str
    message: str
    plan: SchedulePlan | None = None
    replica_decisions: dict[str, ReplicaDecision] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def _call_within(fn: Callable[[], Any], timeout: float, what: str, error: type[Exception], *,
                 hanging: dict[str, threading.Thread] | None = None, key: str = "") -> Any:
    """``fn()`` in a helper thread, waited for at most ``timeout`` seconds; ``error`` after that
    (the call goes on in its daemon thread, noted in ``hanging[key]``: Python cannot interrupt it)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=run, name=f"call {what}", daemon=True)
    t.start()
    if not done.wait(timeout):
        if hanging is not None:
            hanging[key] = t
        raise error(f"{what} did not answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _recorded_layout(rt: JobRuntime | None) -> str | None:
    """``rt.recorded_layout``, None for no runtime: the layout text the reshard history and a job's
    status write (the co-scheduler's view, ``decide._training_layout``, is ``rt.layout`` less paused jobs)."""
    return rt.recorded_layout if rt is not None else None


class ControllerState:
    """The state of one pool's controller, declared once for every part; ``Controller.__init__``
    sets it (the comments there say what each field is for)."""

    # what it runs, on what, for whom
    cfg: ControllerConfig
    config_source: str | None
    backend: Backend
    caps: Capabilities  # the backend's optional capabilities, read once at start
    store: Store
    db: FencedStore
    sources: dict[str, MetricSource]
    owner: str
    pool: str
    clock: Callable[[], float]
    hardware: HardwareSpec
    _throughput: dict[str, Mapping[int, tuple[Layout, float]]]
    _lock: threading.Lock
    _stop: threading.Event
    # the lease
    is_leader: bool
    recovered: bool
    _lead_until: float
    _lost: str | None
    _lease_state: bool | None
    # operators' interventions
    paused: bool
    overrides: dict[str, tuple[int, float]]
    pinned: dict[str, dict[int, tuple[Layout, float]]]
    intervened: dict[tuple[str, str], InterventionRecord]
    _expired_overrides: bool
    # what the ticks observed and did
    policy_state: dict[str, PolicyState]
    last_rescale: dict[str, float]
    backoff: dict[str, Backoff]
    recoveries: list[tuple[str, int]]
    _recoveries_seen: dict[str, int]
    _hanging: dict[str, threading.Thread]
    _source_errors: dict[str, str]
    async_grow: bool
    _growing: dict[str, tuple[threading.Thread, tuple[GPU, ...], list[str]]]
    _replan: bool
    _ahead: dict[str, set[GPU]]
    # never out of memory (observe): job -> layouts dropped for it (loaded from its status on first
    # use); job -> (the table and dropped layouts its re-planned table is for, that table)
    _mem_dropped: dict[str, dict[Any, Any]]
    _mem_tables: dict[str, tuple[Any, dict[int, tuple[Layout, float]]]]
    #: (job, model, layout, stage, micro-batch, accumulation) -> the planner's bytes for that choice
    _predicted_memory: dict[tuple[Any, ...], dict[str, int] | None]
    # what the ticks recorded
    ready: bool
    last_error: str | None
    last_tick: TickResult | None
    _hold: str | None
    _vanished_seen: set[tuple[str, str]]
    _housekept_at: float | None

    @property
    def _can_pause(self) -> bool:
        return self.caps.pauses
