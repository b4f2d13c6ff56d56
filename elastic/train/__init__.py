"""Reference elastic trainer: a Megatron-style GPT with TP x PP x DP (+ZeRO-1) on torch.distributed.

``TrainEngine`` runs one rank of one layout generation and exposes its complete state in the
sharding spec's terms (:mod:`elastic.reshard.spec`), so a job rescales in place: the
resharder moves the state between layouts, and a new engine adopts it at the same step.
The worker agent, rendezvous and launchers build on the engine (see their modules).
"""

from __future__ import annotations

from elastic.train.engine import State, StepResult, TrainConfig, TrainEngine

__all__ = ["State", "StepResult", "TrainConfig", "TrainEngine"]
