"""Sharding specs under the reshard planner's name: :mod:`elastic.parallel.sharding`, re-exported. Pure.

The spec (the exact box of every tensor each rank holds under a layout) lives in
``elastic.parallel`` because the layout planner's memory model counts parameters with it and
the reshard planner builds on the layout planner, never the other way round. The trainer,
the reshard planner and the executor import it from here or from there alike.
"""

from __future__ import annotations

from elastic.parallel.sharding import (
    FP32_KINDS,
    MIXED_KINDS,
    OPTIMIZER_KINDS,
    Box,
    Kind,
    Placement,
    ShardingSpec,
    TensorSpec,
    box_numel,
    box_shape,
    full_box,
    model_tensors,
    sharding_spec,
    split_range,
)

__all__ = [
    "FP32_KINDS",
    "MIXED_KINDS",
    "OPTIMIZER_KINDS",
    "Box",
    "Kind",
    "Placement",
    "ShardingSpec",
    "TensorSpec",
    "box_numel",
    "box_shape",
    "full_box",
    "model_tensors",
    "sharding_spec",
    "split_range",
]
