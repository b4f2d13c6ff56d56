"""The co-scheduler's output: which GPUs each workload holds (``Allocation``) and the ordered,
reasoned steps that get there (``Plan``). Pure value objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from elastic.errors import SpecError


@dataclass(frozen=True)
class GPU:
    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/{self.index}"


@dataclass(frozen=True)
class Allocation:
    """Which GPUs each workload holds. ``holdings``: workload name -> GPUs."""

    holdings: dict[str, tuple[GPU, ...]]

    def gpus_of(self, workload: str) -> tuple[GPU, ...]:
        return self.holdings.get(workload, ())

    def check_disjoint(self) -> None:
        seen: dict[GPU, str] = {}
        for w, gpus in self.holdings.items():
            for g in gpus:
                if g in seen:
                    raise SpecError(f"GPU {g} allocated to both '{seen[g]}' and '{w}'")
                seen[g] = w


@dataclass(frozen=True)
class PlanStep:
    """One ordered action with a machine-readable reason and a human message."""

    action: Literal["shrink_training", "scale_inference_up", "scale_inference_down", "grow_training",
                    "pause_training", "preempt_training", "noop"]
    workload: str
    reason: str
    message: str
    target: Any = None


@dataclass(frozen=True)
class Plan:
    allocation: Allocation
    steps: tuple[PlanStep, ...]
    reason: str
    message: str
