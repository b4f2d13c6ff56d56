"""Keepers of a paused user job: processes without a GPU that hold its training state in host memory.

What it is for: when inference needs every GPU a user job has (the job would go below its
``min_gpus``), the controller pauses it instead of dropping its state. The launcher starts
keepers (``ELASTIC_KEEPER=1``, no GPU), the job's workers send them the whole training state
peer to peer, as in a rescale, and leave; when GPUs come back, the keepers send it to the new
workers, whose ``build(world)`` made the model on the new mesh, and leave. Training goes on at
the step it paused at, on the same loss curve, with the optimizer's hyperparameters, the
scheduler and the user's ``state=`` objects as they were.

A keeper runs none of the user's code: it needs no model, only each tensor's global shape and
dtype, which the first old member publishes with the new ranks. Keeper ``i`` of ``K`` holds
rows ``[i*c, (i+1)*c)`` (``c = ceil(rows / K)``, torch's chunking) of every tensor of at least
``K`` rows, as a ``Shard(0)`` DTensor on a CPU mesh of the keepers; smaller tensors are held
whole by every keeper, and 0-d values (Adam's ``step``) are set. So ``K`` keepers each need
about ``1/K`` of the state's bytes in host memory.

Must not: import the user's entrypoint, touch a GPU, or train.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from elastic.model import SpecError

log = logging.getLogger(__name__)

__all__ = ["KEEP_DIM", "holder_state", "keep", "key_table"]

KEEP_DIM = "keep"  # the keepers' mesh dim


def key_table(src: Any) -> dict[str, tuple]:
    """Per key of a described state (``elastic.torch.reshard.freeze``): ``("t", global shape, dtype)``
    or ``("s", dtype)``: what a keeper allocates to receive it."""
    out: dict[str, tuple] = {}
    for key, entry in src.table.items():
        out[key] = ("s", entry[1]) if entry[0] == "s" else ("t", tuple(entry[1]), entry[2])
    return out


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SpecError(f"a kept tensor has dtype {name!r}, which this torch does not know")
    return dt


def holder_state(table: Mapping[str, tuple], mesh: Any) -> dict[str, torch.Tensor]:
    """This keeper's share of every key of ``table`` (:func:`key_table`), allocated on ``mesh``
    (1-D, the keepers in rank order) and not yet filled: the ``dst`` of the pause's reshard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    k, i = mesh.size(), mesh.get_local_rank()
    out: dict[str, torch.Tensor] = {}
    for key, entry in table.items():
        if entry[0] == "s":
            out[key] = torch.zeros((), dtype=_dtype(entry[1]))
            continue
        shape, dtype = tuple(entry[1]), _dtype(entry[2])
        rows = shape[0]
        if rows >= k:
            c = -(-rows // k)
            mine = max(0, min(rows, (i + 1) * c) - i * c)
            local = torch.empty((mine, *shape[1:]), dtype=dtype)
            out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                          stride=torch.empty(shape, device="meta").stride())
        else:
            out[key] = DTensor.from_local(torch.empty(shape, dtype=dtype), mesh, [Replicate()], run_check=False)
    return out


def keep(session: Any) -> int:
    """A keeper's whole life: register, receive the state (the pause), hold it until a directive
    sends it on (the resume) or the job ends. The process's exit code."""
    if not session.start():
        return 1 if session.phase == "broken" else 0
    step = session.next_step
    while session.ask(step):  # a keeper is only ever told to hold, switch (and leave) or stop
        session.report_fail(f"keeper {session.worker} was told to train step {step}; a keeper holds a paused "
                            "job's state and trains nothing")
        return 1
    return 0
