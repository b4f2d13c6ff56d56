"""The trainer's measured memory per component against the planner's prediction (CPU).

Units: the planner counts bf16 weights (2 bytes), fp32 gradients (4) and 12 bytes of Adam state
per element; a CPU run holds float32 or float64. So weights, gradients and optimizer state are
compared in elements, exactly (both come from the sharding spec's boxes), and the planner's
bytes must be those elements times its bytes per element, exactly.

Activations are compared in two parts:

* the schedule, exactly: under 1F1B a stage holds ``min(m, pp - p)`` micro-batches at its peak
  (``memory.chunks_in_flight``); measured, the peak with ``m`` micro-batches is exactly that many
  times the peak with one;
* the level, within 10% on every layout, tp > 1 included: the planner's activation terms in the
  trainer's element size (its per-layer and embedding terms are bf16, its logits term fp32).
  The trainer holds what fused production kernels hold (:mod:`elastic.train.model`), with
  sequence parallelism whenever tp > 1 as the planner assumes, and its attention is a flash
  kernel, which keeps no attention scores: the planner's count for that is its ``selective``
  recompute (Korthikanti et al.'s ``34 sbh / t``), which is what is compared. What the planner
  counts and the trainer does not hold: dropout masks (the trainer has no dropout) and, on the
  first stage, the embedding's dropout; so the trainer is at or a little under the prediction.

One process runs tp1.pp1.dp1; four gloo processes run five more layouts, two of them with tp2;
the table of every rank's components (predicted, measured, ratio) is printed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic.model import Layout, load_hardware
from elastic.parallel.memory import (
    DTYPE_PRECISION,
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_BYTES,
    Recompute,
    StageProfile,
    activation_terms,
    chunks_in_flight,
    stage_mixes,
)
from elastic.parallel.memory_report import MeasuredMemory, stage_memory
from elastic.parallel.params import rank_params
from elastic.parallel.planner import PlanOptions, evaluate
from elastic.train.engine import TrainEngine
from elastic.train.memory import write_measured
from tests.train._mp import DTYPES, MODELS, make_cfg, run_workers

CPU = load_hardware("cpu")
TINY = MODELS["tiny"]
LEVEL_TOL = 0.10
# the trainer's attention is a flash kernel: it keeps what the planner counts under selective recompute
TRAINER_RECOMPUTE: Recompute = "selective"
GLOBAL_BATCH = 8
LAYOUTS = ["tp1.pp2.dp2.z1", "tp1.pp4.dp1", "tp1.pp1.dp4.z1", "tp2.pp2.dp1", "tp2.pp1.dp2"]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _predicted(layout: Layout, micro_batch: int, global_batch: int, pp_rank: int) -> Any:
    o = PlanOptions(global_batch=global_batch)
    p = evaluate(TINY, layout, CPU, micro_batch=micro_batch, recompute=TRAINER_RECOMPUTE, offload=False, options=o)
    return p, stage_memory(TINY, p, CPU, o)[pp_rank]


def _predicted_activations(m: MeasuredMemory, predicted_bytes: int) -> float:
    """The planner's activation bytes of ``m``'s stage in the trainer's precision (``memory.PRECISIONS``:
    its per-layer and embedding terms scale from bf16, its logits from fp32); ``predicted_bytes``, the
    bf16 count of the same terms, checks they are the stage's."""
    L, seq = m.layout, TINY.seq_len
    mix = stage_mixes(TINY, L.pp, L.vpp)[m.pp_rank]
    prof = StageProfile(m.pp_rank, sum(d for d, _ in mix), sum(x for _, x in mix), tuple(sorted(set(mix))),
                        m.pp_rank == 0, m.pp_rank == L.pp - 1)
    held = chunks_in_flight(L.pp, L.vpp, m.grad_accum, m.pp_rank)
    tokens = seq * m.micro_batch
    assert activation_terms(TINY, prof, L.tp, seq, TRAINER_RECOMPUTE).bytes(tokens, held, L.vpp) == predicted_bytes
    t = activation_terms(TINY, prof, L.tp, seq, TRAINER_RECOMPUTE, DTYPE_PRECISION[m.dtype])
    return tokens * (t.chunk * held + t.embed * held / L.vpp + t.once)


def _check_elements(m: MeasuredMemory) -> None:
    """Weights, gradients, optimizer: exactly the planner's elements for this very rank."""
    tp_rank, dp_rank, pp_rank = m.layout.coords(m.rank)
    want = rank_params(TINY, m.layout, pp_rank, tp_rank, dp_rank)
    assert (m.weight_elements, m.gradient_elements, m.optimizer_elements) == \
        (want.params, want.params, want.optimizer_elements), f"{m.layout} rank {m.rank}"
    size = torch.empty(0, dtype=DTYPES[m.dtype]).element_size()
    assert (m.weights, m.gradients, m.optimizer) == (m.weight_elements * size, m.gradient_elements * size,
                                                    m.optimizer_elements * m.optimizer_kinds * size)


def _level(m: MeasuredMemory, predicted_bytes: int) -> float:
    return m.activations / _predicted_activations(m, predicted_bytes)


def _rows(m: MeasuredMemory, predicted_bytes: int) -> list[str]:
    """Table rows (layout, rank, component, predicted, measured, ratio): elements for the exact components,
    bytes in the trainer's dtype for activations."""
    tp_rank, dp_rank, pp_rank = m.layout.coords(m.rank)
    want = rank_params(TINY, m.layout, pp_rank, tp_rank, dp_rank)
    head = f"{str(m.layout):16} rank {m.rank} stage {m.pp_rank}"
    out = [f"{head}  {name:11} {p:>9} el {g:>9} el  {g / p:.3f}" for name, p, g in (
        ("weights", want.params, m.weight_elements), ("gradients", want.params, m.gradient_elements),
        ("optimizer", want.optimizer_elements, m.optimizer_elements))]
    pred = _predicted_activations(m, predicted_bytes)
    out.append(f"{head}  {'activations':11} {pred:>9.0f} B  {m.activations:>9} B   {m.activations / pred:.3f}")
    return out


TABLE_HEAD = f"{'layout':16} {'rank':>6} {'stage':>7}  {'component':11} {'predicted':>12} {'measured':>12}  ratio"


# ---- one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_single_process_matches_the_planner_per_component(dtype: str, micro_batch: int) -> None:
    cfg = make_cfg("tiny", dtype, global_batch=GLOBAL_BATCH, micro_batch=micro_batch)
    eng = TrainEngine(cfg, Layout(1, 1, 1), 0)
    for s in range(2):
        eng.train_step(s)
    m = eng.memory
    assert m is not None and m.step == 1 and m.device_peak is None
    _check_elements(m)
    p, stage = _predicted(m.layout, micro_batch, GLOBAL_BATCH, 0)
    # the planner's bytes are the same elements at its bytes per element
    assert (p.memory.weights, p.memory.gradients, p.memory.optimizer) == \
        (m.weight_elements * WEIGHT_BYTES, m.gradient_elements * GRAD_BYTES, m.optimizer_elements * OPTIMIZER_BYTES)
    level = _level(m, stage.activations)
    print(f"\n{dtype} mb{micro_batch}\n{TABLE_HEAD}\n" + "\n".join(_rows(m, stage.activations)))
    assert abs(level - 1) <= LEVEL_TOL, f"activations {level:.3f} x the prediction"
    assert eng.meter.current == 0  # every saved tensor was released after its backward


def test_measuring_changes_nothing_the_step_computes() -> None:
    cfg = make_cfg("tiny", "float64", global_batch=4, micro_batch=2)
    a, b = TrainEngine(cfg, Layout(1, 1, 1), 0), TrainEngine(cfg, Layout(1, 1, 1), 0)
    for s in range(3):
        assert a.train_step(s).loss == b._train_step(s).loss  # b: the same step without the meter
    assert a.memory is not None and a.memory.activations > 0 and b.memory is None
    assert all(torch.equal(a.state()[k], b.state()[k]) for k in a.state())


def test_a_layouts_first_steps_and_every_hundredth_are_measured() -> None:
    from elastic.train.engine import MEMORY_EVERY, MEMORY_FIRST_STEPS

    eng = TrainEngine(make_cfg("tiny", "float32", global_batch=2), Layout(1, 1, 1), 0)
    for s in range(MEMORY_FIRST_STEPS + 2):
        eng.train_step(s)
    assert eng.memory is not None and eng.memory.step == MEMORY_FIRST_STEPS - 1
    eng.train_step(MEMORY_EVERY)
    assert eng.memory.step == MEMORY_EVERY and eng.meter.current == 0


def test_written_records_read_back(tmp_path) -> None:
    from elastic.cli._plan_report import read_measured

    eng = TrainEngine(make_cfg("tiny", "float32", global_batch=2), Layout(1, 1, 1), 0)
    eng.train_step(0)
    assert eng.memory is not None
    write_measured(tmp_path / "m.json", [eng.memory])
    assert read_measured(str(tmp_path / "m.json")) == [eng.memory]


# ---- four processes -----------------------------------------------------------------------------


def measure_layouts(rank: int, world: int, layouts: list[str]) -> dict[str, dict[str, Any]]:
    """Per layout and global batch (8, and dp: one micro-batch per replica), this rank's record."""
    out: dict[str, dict[str, Any]] = {}
    for text in layouts:
        layout = Layout.parse(text)
        for gb in (GLOBAL_BATCH, layout.dp):
            eng = TrainEngine(make_cfg("tiny", "float32", global_batch=gb, micro_batch=1), layout, rank)
            eng.train_step(0)
            assert eng.memory is not None
            out[f"{text}/{gb}"] = eng.memory.as_json()
            eng.close()
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, dict[str, Any]]]:
    return run_workers(measure_layouts, 4, LAYOUTS, timeout=300)


def test_four_ranks_match_the_planner_per_component(four: list[dict[str, dict[str, Any]]]) -> None:
    rows, bad = [TABLE_HEAD], []
    for text in LAYOUTS:
        layout = Layout.parse(text)
        for rank in range(4):
            m = MeasuredMemory.from_json(four[rank][f"{text}/{GLOBAL_BATCH}"])
            one = MeasuredMemory.from_json(four[rank][f"{text}/{layout.dp}"])
            _check_elements(m)
            # the schedule: exactly the planner's micro-batches in flight, times one micro-batch's bytes
            m_micro = GLOBAL_BATCH // layout.dp
            held = chunks_in_flight(layout.pp, 1, m_micro, m.pp_rank)
            assert m.activations == held * one.activations, f"{text} rank {rank}: {held} micro-batches in flight"
            _, stage = _predicted(layout, 1, GLOBAL_BATCH, m.pp_rank)
            assert stage.in_flight == held
            rows += _rows(m, stage.activations)
            level = _level(m, stage.activations)
            if abs(level - 1) > LEVEL_TOL:
                bad.append(rows[-1])
    print("\n" + "\n".join(rows))
    assert not bad, f"activations off the prediction by more than {LEVEL_TOL:.0%}: {bad}"
    assert any(Layout.parse(t).tp > 1 for t in LAYOUTS)
