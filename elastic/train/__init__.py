"""Reference elastic trainer: a Megatron-style GPT with TP x PP x DP (+ZeRO-1) on torch.distributed.

``TrainEngine`` runs one rank of one layout generation and exposes its complete state in the
sharding spec's terms (:mod:`elastic.reshard.spec`), so a job rescales in place: the
resharder moves the state between layouts, and a new engine adopts it at the same step.
The worker agent, rendezvous and launchers build on the engine (see their modules).
"""

from __future__ import annotations

from typing import Any

__all__ = ["State", "StepResult", "TrainConfig", "TrainEngine"]


def __getattr__(name: str) -> Any:
    # the engine (and torch) load on first use: ``elastic.train.userjob`` is read by the controller and
    # by spec validation, which must not import torch
    if name in __all__:
        from elastic.train import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'elastic.train' has no attribute {name!r}")
