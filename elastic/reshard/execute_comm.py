"""The reshard executor's transport: point-to-point operations on a process group or a raw backend.

:class:`_Comm` posts a round's ``isend``/``irecv`` (every tensor as its bytes) and carries the
final all-member sync; :func:`reshard_group` builds a transient gloo/NCCL group for one reshard,
next to any group the job already has.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elastic.reshard.errors import ReshardError
from elastic.reshard.execute_wire import _as_bytes


class _Comm:
    """isend/irecv on either a registered process group or a raw backend (transient group)."""

    def __init__(self, pg: object | None, group_rank: dict[str, int], device: torch.device):
        self.pg = pg
        self.rank = group_rank
        self.raw = pg is not None and not isinstance(pg, dist.ProcessGroup)
        self.nccl = device.type == "cuda"
        self.sync_device = device if self.nccl else torch.device("cpu")

    def post(self, ops: list[tuple[bool, torch.Tensor, str, int]]) -> list:
        """Post every op; each tensor (contiguous, any dtype) travels as its bytes."""
        if not ops:
            return []
        if self.raw:
            works = []
            for is_send, t, peer, tag in ops:
                fn = self.pg.send if is_send else self.pg.recv  # type: ignore[attr-defined]
                works.append(fn([_as_bytes(t)], self.rank[peer], tag))
            return works
        p2p = [dist.P2POp(dist.isend if s else dist.irecv, _as_bytes(t), group=self.pg, tag=tag,
                          group_peer=self.rank[peer])
               for s, t, peer, tag in ops]
        return dist.batch_isend_irecv(p2p)

    def sync_count(self, n: int) -> int:
        """All-reduce (sum) of ``n`` over every member: a barrier that also carries failures."""
        t = torch.tensor([n], dtype=torch.int64, device=self.sync_device)
        if self.raw:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self.pg.allreduce([t], opts).wait()  # type: ignore[attr-defined]
        else:
            dist.all_reduce(t, group=self.pg)
        return int(t.item())


def reshard_group(
    members: Sequence[str],
    me: str,
    store_addr: str,
    port: int,
    generation: int,
    backend: str | None = None,
    *,
    timeout_s: float = 120.0,
) -> tuple[object, dict[str, int]]:
    """A transient process group of ``members`` for one reshard, next to any existing group.

    ``members[0]`` hosts the TCPStore on ``store_addr:port``; keys live under
    ``reshard/<generation>/`` so one store can serve successive generations. Returns the
    group (a raw gloo/NCCL backend, to pass as ``pg`` to :func:`execute`) and the group
    rank of every member (position in ``members``). ``backend``: ``"gloo"`` (CPU tensors)
    or ``"nccl"`` (CUDA tensors); default gloo unless CUDA is available.
    """
    if me not in members:
        raise ReshardError(f"worker '{me}' is not in the reshard members {list(members)}")
    if len(set(members)) != len(members):
        raise ReshardError(f"reshard members contain duplicates: {list(members)}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ranks = {w: i for i, w in enumerate(members)}
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_addr, port, len(members), is_master=ranks[me] == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"reshard/{generation}/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, ranks[me], len(members), timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, ranks[me], len(members), opts)
    else:
        raise ReshardError(f"backend '{backend}': use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors)")
    return pg, ranks
