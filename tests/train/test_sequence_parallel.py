"""Sequence parallelism in the reference trainer (elastic.train.tp): each building block at tp2 against
the same arithmetic on one process, in float64; and the refusal of a sequence that does not split.

The whole model at tp > 1 against one process is tests/train/test_fidelity*.py, test_moe_fidelity.py and
the vpp tests; what it holds, tests/train/test_memory_measured.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from elastic.model import Layout, ModelSpec, SpecError
from elastic.reshard.spec import FP32_KINDS, sharding_spec
from elastic.train.groups import Comm, build_groups
from elastic.train.model import GPTStage, check_sequence_split
from elastic.train.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_linears
from tests.train._mp import MODELS, run_workers

B, S, H, FFN, V = 2, 8, 6, 10, 12
TOL = 1e-12


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _reference() -> dict[str, torch.Tensor]:
    """One process: embedding -> column-parallel (two linears) -> gelu * -> row-parallel + bias, whole."""
    g = torch.Generator().manual_seed(3)
    t = {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape in (
        ("emb", (V, H)), ("wa", (FFN, H)), ("ba", (FFN,)), ("wb", (FFN, H)), ("wo", (H, FFN)), ("bo", (H,)),
        ("dy", (B, S, H)))}
    t["ids"] = torch.randint(0, V, (B, S), generator=g)
    leaves = {k: t[k].clone().requires_grad_() for k in ("emb", "wa", "ba", "wb", "wo", "bo")}
    x = F.embedding(t["ids"], leaves["emb"])
    a, b = F.linear(x, leaves["wa"], leaves["ba"]), F.linear(x, leaves["wb"])
    y = F.linear(F.gelu(a) * b, leaves["wo"], leaves["bo"])
    y.backward(t["dy"])
    t["y"] = y.detach()
    t.update({f"d{k}": v.grad for k, v in leaves.items()})  # type: ignore[misc]
    return t


def sp_blocks(rank: int, world: int) -> dict[str, float]:
    """Rank ``rank`` of tp2: its shards of the same computation; the relative error of each result."""
    torch.set_num_threads(1)
    ref = _reference()
    tp = build_groups(Layout(world, 1, 1), rank).tp
    rows, cols, seq = V // world, FFN // world, S // world
    vr, fr, sr = slice(rank * rows, (rank + 1) * rows), slice(rank * cols, (rank + 1) * cols), \
        slice(rank * seq, (rank + 1) * seq)
    emb = VocabParallelEmbedding(rank * rows, rows, H, tp, torch.float64, "cpu")
    ca = ColumnParallelLinear(H, cols, True, torch.float64, "cpu")
    cb = ColumnParallelLinear(H, cols, False, torch.float64, "cpu")
    ro = RowParallelLinear(cols, H, True, tp, torch.float64, "cpu")
    for p, full in ((emb.weight, ref["emb"][vr]), (ca.weight, ref["wa"][fr]), (ca.bias, ref["ba"][fr]),
                    (cb.weight, ref["wb"][fr]), (ro.weight, ref["wo"][:, fr]), (ro.bias, ref["bo"])):
        assert p is not None
        p.data.copy_(full)
    x = emb(ref["ids"])  # this rank's sequence shard
    assert tuple(x.shape) == (B, seq, H)
    a, b = gather_linears(x, tp, [ca.wb, cb.wb])  # the whole sequence, this rank's columns
    assert tuple(a.shape) == (B, S, cols)
    y = ro(F.gelu(a) * b)  # reduce-scattered: the shard again
    y.backward(ref["dy"][:, sr])
    out = {
        "y": _relerr(y.detach(), ref["y"][:, sr]),
        "demb": _relerr(emb.weight.grad, ref["demb"][vr]),  # type: ignore[arg-type]
        "dwa": _relerr(ca.weight.grad, ref["dwa"][fr]),  # type: ignore[arg-type]
        "dba": _relerr(ca.bias.grad, ref["dba"][fr]),  # type: ignore[arg-type,union-attr]
        "dwb": _relerr(cb.weight.grad, ref["dwb"][fr]),  # type: ignore[arg-type]
        "dwo": _relerr(ro.weight.grad, ref["dwo"][:, fr]),  # type: ignore[arg-type]
        # the bias was applied to this rank's positions only; its gradient is summed over TP
        "dbo": _relerr(ro.bias.grad, ref["dbo"]),  # type: ignore[arg-type,union-attr]
    }
    # a stage passes its sequence shard on between pipeline stages
    stage = GPTStage(sharding_spec(MODELS["tiny"], Layout(world, 1, 1), FP32_KINDS), rank, tp, torch.float64, "cpu")
    assert stage.boundary_shape(3) == (3, MODELS["tiny"].seq_len // world, MODELS["tiny"].hidden)
    return out


def test_sequence_parallel_blocks_match_one_process() -> None:
    results: list[Any] = run_workers(sp_blocks, 2, timeout=120)
    for rank, errs in enumerate(results):
        assert max(errs.values()) < TOL, f"rank {rank}: relative errors {errs}"


def test_a_sequence_that_does_not_split_over_tp_is_refused() -> None:
    odd = MODELS["tiny"].model_copy(update={"name": "tiny-odd", "seq_len": 31})
    assert isinstance(odd, ModelSpec)
    check_sequence_split(odd, 1)
    with pytest.raises(SpecError, match=r"seq_len=31 is not divisible by tp=2.*choose a tp dividing seq_len"):
        check_sequence_split(odd, 2)
    # the trainer's stage refuses it before touching a communicator
    spec = sharding_spec(odd, Layout(2, 1, 1), FP32_KINDS)
    with pytest.raises(SpecError, match="seq_len=31"):
        GPTStage(spec, 0, Comm.solo(0), torch.float64, "cpu")
