"""Inference replica policy: how many replicas each service needs, now and a few minutes ahead.

Pure decision code (HPA v2 semantics, KEDA-style scale to zero, a short-horizon forecast and
a fail-safe on missing metrics). It must not read the clock, Prometheus, the DB or Ray:
``decide(ctx)`` gets everything in ``ctx`` and returns ``(ReplicaDecision, PolicyState)``.
"""

from __future__ import annotations

from elastic.policy.replicas import decide, landed
from elastic.policy.stages import DEFAULT_DOWN, DEFAULT_TOLERANCE, DEFAULT_UP, Rule, Rules, effective_rules
from elastic.policy.types import HoltWintersState, PolicyContext, PolicyState, Reason, ReplicaDecision

__all__ = [
    "DEFAULT_DOWN", "DEFAULT_TOLERANCE", "DEFAULT_UP", "HoltWintersState", "PolicyContext", "PolicyState",
    "Reason", "ReplicaDecision", "Rule", "Rules", "decide", "effective_rules", "landed",
]
