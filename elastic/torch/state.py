"""A model's and optimizer's training state as one flat dict of live tensors, keyed by name.

What it is for: the unit :func:`elastic.torch.reshard` moves. ``training_state(model, optimizer)``
returns every parameter (``"{fqn}"``) and every per-parameter optimizer tensor
(``"{fqn}::{name}"``: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) as the *live*
tensors (DTensors stay DTensors, plain tensors are taken as replicated), so writing into them
writes the model and the optimizer. 0-d optimizer entries (Adam's ``step``) are scalars: they
travel as values, not bytes.

Names come from ``named_parameters()``, never ``state_dict()``: state-dict hooks rename
parameters (torchtitan's fused QKV becomes ``wq``/``wk``/``wv``) and would not name live
tensors. Wrapper segments (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``,
``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``) are removed, so a DDP model and its
FSDP2 rebuild name their parameters alike.

Must not: communicate, or change any value except through :func:`init_optimizer_state` (a zero
step at learning rate 0 that only creates the optimizer's state) and
:func:`load_training_state`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from elastic.reshard.plan import ReshardError

__all__ = ["SEP", "clean_fqn", "init_optimizer_state", "load_training_state", "training_state"]

SEP = "::"
"""Separates a parameter's name from its optimizer state's name in a key."""

_WRAPPERS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "module")


def clean_fqn(name: str, wrappers: tuple[str, ...] = _WRAPPERS) -> str:
    """``name`` without the segments that wrappers insert (``module.layers.0.w`` -> ``layers.0.w``)."""
    parts = [p for p in name.split(".") if p not in wrappers]
    return ".".join(parts)


def _named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        fqn = clean_fqn(name)
        if fqn in out:
            raise ReshardError(
                f"two parameters of the model are both named {fqn!r} once wrapper prefixes are removed "
                f"({name!r} is one); rename one of them"
            )
        out[fqn] = p
    return out


def _reshard_fsdp(model: nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the optimizer's per-parameter state (as its first ``step`` would) without changing a value.

    A fresh optimizer on a new mesh has no ``exp_avg`` to receive into. This runs one step with
    zero gradients at learning rate 0, then clears the gradients (what
    ``torch.distributed.checkpoint`` does before loading). Returns False when there was
    state already or a gradient is set (nothing done).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(optimizer.state.get(p) for p in params) or any(p.grad is not None for p in params):
        return False
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    saved = []
    for g in optimizer.param_groups:
        saved.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            if lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    return True


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   init_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and per-parameter optimizer tensor of ``model``/``optimizer``, live, by name.

    ``init_optimizer=True`` first creates the optimizer's state if it has none (a fresh
    optimizer on a new mesh, about to receive the moved state; see :func:`init_optimizer_state`).
    Parameters the optimizer does not hold contribute their value only. FSDP2 modules are
    resharded first (a module built with ``reshard_after_forward=False``, or one after an eval
    forward, still holds its gathered parameters), so the state names the sharded DTensors.
    """
    _reshard_fsdp(model)
    params = _named_parameters(model)
    out: dict[str, torch.Tensor] = dict(params)
    if optimizer is None:
        return out
    if init_optimizer:
        init_optimizer_state(optimizer)
    names = {id(p): fqn for fqn, p in params.items()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            fqn = names.get(id(p))
            if fqn is None:
                raise ReshardError(
                    "the optimizer holds a parameter that model.named_parameters() does not list; build the "
                    "optimizer over this model's parameters"
                )
            for name, v in optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor):
                    raise ReshardError(
                        f"optimizer state {fqn}{SEP}{name} is a {type(v).__name__}, not a tensor; only tensor "
                        "state can be resharded (keep it as a tensor, or carry it with the job's own state)"
                    )
                out[f"{fqn}{SEP}{name}"] = v
    return out


@torch.no_grad()
def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy ``state`` (full tensors, or DTensors laid out like the target) into ``model``/``optimizer``.

    Creates the optimizer's state first when it has none, so a fresh optimizer ends up holding
    the given moments and step. A full (plain) tensor is cut to the target's local shard; a
    DTensor must have the target's mesh and placements. Every key of the target must be in
    ``state`` and vice versa. Returns the target's live state.
    """
    from torch.distributed.tensor import DTensor

    from elastic.torch.regions import local_region

    dst = training_state(model, optimizer, init_optimizer=True)
    missing, extra = sorted(set(dst) - set(state)), sorted(set(state) - set(dst))
    if missing or extra:
        raise ReshardError(
            f"state and target differ: missing {missing[:3]}, not in the target {extra[:3]}; give every key of "
            "training_state(model, optimizer)"
        )
    for key, t in dst.items():
        v = state[key]
        if tuple(v.shape) != tuple(t.shape):
            raise ReshardError(f"{key}: the state has shape {list(v.shape)}, the target {list(t.shape)}")
        if isinstance(t, DTensor):
            if isinstance(v, DTensor):
                if v.device_mesh != t.device_mesh or v.placements != t.placements:
                    raise ReshardError(f"{key}: a DTensor on another mesh or placement; reshard it instead")
                t.to_local().copy_(v.to_local())
            else:
                region = local_region(t)
                local = t.to_local()
                if local.numel():  # an empty trailing shard receives nothing
                    local.copy_(v[_region_index(region)].to(t.dtype))
        else:
            t.copy_(v.full_tensor() if isinstance(v, DTensor) else v)
    return dst


def _region_index(region) -> tuple:
    """An index that cuts a region out of the full tensor (a list of indices for a multi-run dim)."""
    idx = []
    for runs in region:
        if len(runs) == 1:
            idx.append(slice(runs[0][0], runs[0][1]))
        elif not runs:
            idx.append(slice(0, 0))
        else:
            idx.append(torch.tensor([i for a, b in runs for i in range(a, b)]))
    if sum(isinstance(i, torch.Tensor) for i in idx) > 1:
        raise ReshardError("a shard strided on two dims cannot be cut from a full tensor in one step")
    return tuple(idx)
