"""The engine a worker drives, the job configuration it is built from, and the agent's options."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from elastic.model import Layout, ModelSpec, SpecError, load_model
from elastic.reshard.execute_wire import State
from elastic.train.rendezvous import Directive

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the agent needs from a trainer: its steps and state, and what a rescale, a given-up step
    and a recovery ask of it. :class:`EngineBase` gives every part beyond the first three a default
    that does nothing (an engine that cannot be recovered in place, interrupted or give a step up);
    ``elastic.train.engine.TrainEngine`` implements them all."""

    # a broken or out-of-memory step leaves the state whole: the agent reports what this rank holds
    # (``recovery_state``) and waits for the recovery instead of failing the job
    recoverable: bool
    # ``resume_partial`` finishes a step from the work a given-up try of it kept
    resumes_partial: bool
    # set by the agent on a generation posted with them: check at each micro-batch whether the
    # step is given up, and keep its work for the next layout
    give_up_checks: bool
    keep_given_up: bool
    memory: Any  # the last measured step's memory by component (MeasuredMemory), or None
    oom_memory: Any  # the memory of a step that ran out of it, or None

    def state(self) -> State: ...

    def train_step(self, step: int) -> Any: ...  # StepResult(step, loss, tokens, seconds)

    def close(self) -> None: ...

    def recovery_state(self) -> dict[str, object]: ...

    def interrupt(self) -> None: ...

    def abort(self) -> None: ...

    def communicators(self) -> list[Any]: ...  # the backends of its own groups, retired after an abort

    def give_up(self, step: int) -> None: ...

    def resume_partial(self, carry: Any, *, contribute: bool = True) -> None: ...


class EngineBase:
    """The optional parts of :class:`Engine`, doing nothing: subclass it and implement ``state``,
    ``train_step`` and ``close``."""

    recoverable = False
    resumes_partial = False
    give_up_checks = False
    keep_given_up = False
    memory: Any = None
    oom_memory: Any = None

    def state(self) -> State:
        raise NotImplementedError

    def train_step(self, step: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def recovery_state(self) -> dict[str, object]:
        return {}

    def interrupt(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def communicators(self) -> list[Any]:
        return []

    def give_up(self, step: int) -> None:
        return None

    def resume_partial(self, carry: Any, *, contribute: bool = True) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot finish a step from kept work (resumes_partial)")


EngineFactory = Callable[[dict[str, Any], Layout, int, "State | None"], Engine]
"""``(job config, layout, rank, state or None) -> Engine``; called with the layout's default group ready."""


def default_engine_factory(config: dict[str, Any], layout: Layout, rank: int, state: State | None, *,
                           timeout_s: float = 120.0) -> Engine:
    from elastic.train.engine import TrainEngine

    return TrainEngine(train_config(config), layout, rank, state=state,
                       timeout=datetime.timedelta(seconds=timeout_s))


# ---- the job config on the wire (JSON) <-> the engine's TrainConfig ------------------------

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def config_json(cfg: Any) -> dict[str, Any]:
    """A ``TrainConfig`` as the JSON the coordinator hands every worker (model by preset name when it is one);
    a user job's config (``elastic.train.userjob.UserJobConfig``) as its own JSON."""
    from elastic.model import MODEL_PRESETS

    if hasattr(cfg, "to_json"):
        return cfg.to_json()

    d = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    m: ModelSpec = d["model"]
    d["model"] = m.name if MODEL_PRESETS.get(m.name) == m else m.model_dump(mode="json")
    d["dtype"] = str(d["dtype"]).removeprefix("torch.")
    d["betas"] = list(d["betas"])
    return d


def train_config(config: dict[str, Any]) -> Any:
    """The job config (JSON from the coordinator) as the engine's ``TrainConfig``."""
    from elastic.train.engine import TrainConfig

    d = dict(config)
    d["model"] = config_model(config)
    d["dtype"] = config_dtype(config)
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    try:
        return TrainConfig(**d)
    except TypeError as e:
        raise SpecError(f"job config: {e}; the keys are TrainConfig's fields") from None


def config_model(config: dict[str, Any]) -> ModelSpec:
    m = config.get("model")
    if isinstance(m, ModelSpec):
        return m
    if isinstance(m, dict):
        return ModelSpec.from_mapping(m, source="job config 'model'")
    if not isinstance(m, str):
        raise SpecError("job config: 'model' must be a preset name, a model file path or a ModelSpec mapping")
    return load_model(m)


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    v = config.get("dtype", "float32")
    if isinstance(v, torch.dtype):
        return v
    name = str(v).removeprefix("torch.")
    if name not in _DTYPES:
        raise SpecError(f"job config: dtype={name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def config_kinds(config: dict[str, Any]) -> tuple[str, ...]:
    from elastic.reshard.spec import FP32_KINDS, MIXED_KINDS

    return MIXED_KINDS if config_dtype(config) == torch.bfloat16 else FP32_KINDS


def config_kind_dtypes(config: dict[str, Any]) -> dict[str, torch.dtype]:
    """Kind -> dtype of the job's state tensors (bf16: bf16 ``param``, fp32 master and moments)."""
    return {k: train_config(config).kind_dtype(k) for k in config_kinds(config)}


_REASK_S = 0.005  # between two long polls that both came back "wait"

FAILED_JOB_GRACE_S = 3.0
"""A worker still running this long after its job failed exits on its own (see ``_heartbeat``)."""


@dataclass(frozen=True)
class AgentOptions:
    pg_timeout_s: float = 120.0  # a silent peer fails a collective after this long
    coordinator_timeout_s: float = 30.0  # exit when the coordinator is unreachable this long
    long_poll_s: float = 2.0  # joiners and the meeting point wait this long per request for an answer
    device: str = "cpu"
    verify_reshard: bool = False  # checksum every reshard message (slower; for tests)
    # A leaver ends its process with os._exit once its bytes have landed (no interpreter teardown
    # of GBs of tensors; the launcher sees the process go). False: run() returns instead, for
    # hosts that must end the process themselves (a Ray actor: os._exit there reads as a crash).
    exit_on_leave: bool = True
    # a collective that breaks because a peer died: report and wait for the coordinator's recovery
    # directive (it fails the job itself when no recovery is possible); False: fail at once
    recover: bool = True
    # the job's checkpoint directory as this worker sees it: what it holds is reported at register
    # (a coordinator that cannot see the directory starts the job there); "" = none
    checkpoint_dir: str = ""


@dataclass
class _Prep:
    """A reshard plan and the executor's prepared buffers for one directive."""

    directive: Directive
    plan: Any  # ReshardPlan, or None for the first generation
    prepared: Any  # execute.Prepared, or None
    digest: str
    plan_info: dict[str, Any]
    old_state: State
    error: str = ""  # planning or preparing failed: the rescale must be abandoned (nothing moved)
    waited: float = 0.0  # seconds the step loop spent on it at the switch (the rest was done in the background)
    ahead: float = 0.0  # seconds between beginning it in the background and the switch (0: prepared at the switch)
    deferred: str = ""  # begun beside a step, it would not fit next to it (GPU memory): prepare at the switch
