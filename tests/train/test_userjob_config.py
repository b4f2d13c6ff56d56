"""A user job's micro-batch is a cap: the validator, the memory planner and ``micro_batches`` agree."""

from __future__ import annotations

import pytest

from elastic.model import Layout, SpecError, load_model
from elastic.torch.data import micro_batch_count, rank_micro_batches
from elastic.train.launch import _planned_micro_batch, make_validator
from elastic.train.userjob import UserJobConfig

MODEL = load_model("examples/llama/model.json")


def _cfg(global_batch: int, micro_batch: int) -> UserJobConfig:
    return UserJobConfig(model=MODEL, global_batch=global_batch, micro_batch=micro_batch,
                         entrypoint="examples.llama.job:main", mesh_dims={"dp": "dp_replicate", "tp": "tp"})


@pytest.mark.parametrize("dp", range(1, 8))
def test_every_dp_that_divides_the_batch_is_valid_and_the_pieces_are_what_the_manager_cuts(dp: int) -> None:
    cfg = _cfg(420, 36)
    layout = Layout.parse(f"tp1.pp1.dp{dp}")
    pieces = rank_micro_batches(list(range(420)), 0, dp, 36)
    assert cfg.grad_accum(layout) == len(pieces) == micro_batch_count(420, dp, 36)
    assert cfg.micro_batch_for(layout) == max(len(p) for p in pieces) <= 36
    # one pass per 36 samples at most: 420 / dp samples in ceil(420 / dp / 36) passes
    assert cfg.grad_accum(layout) == -(-(420 // dp) // 36)


def test_uneven_pieces_are_planned_with_a_size_that_never_undercounts() -> None:
    cfg = _cfg(10, 4)  # a rank of dp=2 runs [3, 2]
    layout = Layout.parse("tp1.pp1.dp2")
    assert [len(p) for p in rank_micro_batches(list(range(10)), 0, 2, 4)] == [3, 2]
    assert (cfg.grad_accum(layout), cfg.micro_batch_for(layout)) == (2, 3)
    assert _planned_micro_batch(cfg, layout) == 5  # 3 does not divide 5: the next size that does
    make_validator(cfg, "h100-80g")(layout, ["w0", "w1"])


def test_a_dp_that_does_not_divide_the_batch_is_refused_naming_the_field() -> None:
    cfg = _cfg(12, 1)
    with pytest.raises(SpecError, match=r"global_batch=12 does not split over dp=5 .* \(12 % 5 = 2\); .*\(e\.g\. 10 or 15\)"):
        cfg.grad_accum(Layout.parse("tp1.pp1.dp5"))
    with pytest.raises(SpecError, match="global_batch=12 does not split over dp=5"):
        make_validator(cfg, "h100-80g")(Layout.parse("tp1.pp1.dp5"), [f"w{i}" for i in range(5)])
