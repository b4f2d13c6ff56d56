"""The memory report (``elastic plan --report``): the planner's own numbers per stage, its files, its plot."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastic.cli import app
from elastic.cli._plan_report import overlapping_labels, read_measured, render, report_paths, write_report
from elastic.model import Layout, SpecError, load_hardware, load_model
from elastic.parallel.memory_report import (
    COMPONENTS,
    NEXT_BEST,
    SCHEMA,
    TRAINER_RECOMPUTE,
    MeasuredMemory,
    memory_report,
    stage_memory,
    worst_stage,
)
from elastic.parallel.planner import PlanOptions, evaluate, plan

H100 = load_hardware("h100-80g")
H800 = load_hardware("h800-80g")
CPU = load_hardware("cpu")
TINY = load_model("tiny")


def _measured(**kw: object) -> MeasuredMemory:
    base = {"model": "tiny", "layout": Layout(1, 1, 1), "rank": 0, "pp_rank": 0, "step": 1, "dtype": "float32",
            "micro_batch": 2, "grad_accum": 4, "weights": 870_656, "gradients": 870_656, "optimizer": 1_741_312,
            "activations": 1_645_904, "weight_elements": 217_664, "gradient_elements": 217_664,
            "optimizer_elements": 217_664, "optimizer_kinds": 2}
    base.update(kw)
    return MeasuredMemory(**base)  # type: ignore[arg-type]


# ---- per stage: the planner's numbers ---------------------------------------------------------


@pytest.mark.parametrize(("model", "hw", "layout", "kw"), [
    ("llama3-70b", H100, "tp8.pp4.dp2", {}),
    ("llama3-70b", H100, "tp4.pp4.dp4", {}),  # the planner offloads the optimizer here
    ("gpt3-175b", H100, "tp8.pp8.dp1.vpp3", {"global_batch": 64}),  # tied embeddings, interleaved
    ("deepseek-v3", H800, "tp2.pp16.dp64.ep8.z1", {}),  # 61 layers in 64 slots, MoE after 3 dense
    ("deepseek-v3", H800, "tp8.pp8.dp1", {"global_batch": 8}),  # does not fit: the closest choice
    ("tiny", CPU, "tp2.pp2.dp1", {"global_batch": 8}),
])
def test_worst_stage_is_exactly_the_planners_memory(model: str, hw: object, layout: str, kw: dict) -> None:
    spec = load_model(model)
    o = PlanOptions(**kw)
    p = evaluate(spec, Layout.parse(layout), hw, options=o)  # type: ignore[arg-type]
    stages = stage_memory(spec, p, hw, o)  # type: ignore[arg-type]
    assert [s.pp_rank for s in stages] == list(range(p.layout.pp))
    assert sum(s.layers for s in stages) == spec.layers
    w = worst_stage(stages)
    assert w.pp_rank == p.memory.stage
    assert {k: getattr(w, k) for k in (*COMPONENTS, "total")} == p.memory.as_dict()
    assert w.host_optimizer == p.memory.host_optimizer


def test_first_stage_holds_the_most_micro_batches_under_1f1b() -> None:
    spec = load_model("llama2-70b")
    p = evaluate(spec, Layout.parse("tp8.pp4.dp2"), H100, micro_batch=1, recompute="selective", offload=False)
    stages = stage_memory(spec, p, H100)
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]
    assert [s.activations for s in stages[:3]] == sorted((s.activations for s in stages[:3]), reverse=True)
    assert worst_stage(stages).pp_rank == 0


# ---- the report ---------------------------------------------------------------------------------


def test_report_has_the_chosen_and_the_next_best_in_the_planners_order() -> None:
    spec = load_model("llama3-70b")
    res = plan(spec, 64, H100)
    rep = memory_report(spec, 64, H100, res.plans, reason=res.reason)
    assert [str(e.plan.layout) for e in rep.layouts] == [str(p.layout) for p in res.plans[:1 + NEXT_BEST]]
    assert [e.place for e in rep.layouts] == [1, 2, 3, 4]
    out = json.loads(json.dumps(rep.as_json()))
    assert out["schema"] == SCHEMA and out["budget_bytes"] == H100.memory_bytes
    first = out["layouts"][0]
    assert set(first) == {"layout", "place", "fits", "gpus_used", "micro_batch", "grad_accum", "recompute",
                          "offload", "global_batch", "budget_bytes", "worst_stage", "worst", "stages", "measured"}
    assert first["worst"] == res.plans[0].memory.as_dict() and first["measured"] is None
    assert first["stages"][first["worst_stage"]]["total"] == first["worst"]["total"]


def test_measured_goes_next_to_the_same_choice_or_gets_its_own_entry() -> None:
    o = PlanOptions(global_batch=8, precision="fp32")  # the measurement is of a float32 run
    # the reference trainer's choice: no offload, and its flash attention keeps what the planner's
    # selective count does
    mine = evaluate(TINY, Layout(1, 1, 1), CPU, micro_batch=2, recompute=TRAINER_RECOMPUTE, offload=False, options=o)
    # the same choice among the reported plans: the measurement sits next to it
    rep = memory_report(TINY, 1, CPU, [mine], options=o, measured=[_measured(), _measured(rank=0, activations=1)])
    assert len(rep.layouts) == 1 and rep.layouts[0].measured == _measured()  # the rank that held the most
    # not among them: an entry of its own, predicted for exactly what ran (micro-batch 2, global batch 8)
    other = evaluate(TINY, Layout(1, 1, 2), CPU, options=o)
    rep = memory_report(TINY, 2, CPU, [other], options=o, measured=[_measured()])
    assert [e.place for e in rep.layouts] == [1, 0]
    extra = rep.layouts[1]
    assert extra.measured == _measured() and extra.plan.micro_batch == 2 and extra.plan.grad_accum == 4
    assert extra.plan.memory == mine.memory
    # the same layout and micro-batch planned in bf16 mixed precision is another choice: its own entry,
    # predicted in the measurement's precision (fp32 weights, gradients and Adam's two moments: exact)
    bf16 = evaluate(TINY, Layout(1, 1, 1), CPU, micro_batch=2, recompute=TRAINER_RECOMPUTE, offload=False,
                    options=PlanOptions(global_batch=8))
    rep = memory_report(TINY, 1, CPU, [bf16], options=PlanOptions(global_batch=8), measured=[_measured()])
    assert [e.place for e in rep.layouts] == [1, 0] and rep.layouts[1].plan.memory == mine.memory
    m, w = _measured(), mine.memory
    assert (w.weights, w.gradients, w.optimizer) == (m.weights, m.gradients, m.optimizer)
    assert bf16.memory.weights * 2 == w.weights and bf16.memory.activations < w.activations


def test_measured_of_another_model_is_refused() -> None:
    spec = load_model("gpt-100m")
    p = evaluate(spec, Layout(1, 1, 1), CPU, global_batch=8)
    with pytest.raises(SpecError, match=r"model 'tiny', the plan is of 'gpt-100m'.*--model tiny"):
        memory_report(spec, 1, CPU, [p], options=PlanOptions(global_batch=8), measured=[_measured()])


@pytest.mark.parametrize(("change", "needle"), [
    ({"layout": None}, r"field 'layout' must be a layout"),
    ({"layout": "tp2.pq1"}, r"field 'layout':"),
    ({"weights": -1}, r"field 'weights' must be a whole number >= 0, got -1"),
    ({"activations": "12"}, r"field 'activations' must be a whole number"),
    ({"rank": 3}, r"rank 3 \(pipeline stage 0\) is outside layout tp1.pp1.dp1"),
    ({"micro_batch": 0}, r"micro_batch=0, grad_accum=4: both must be >= 1"),
])
def test_measured_json_errors_name_the_field(change: dict, needle: str) -> None:
    obj = _measured().as_json()
    obj.update(change)
    with pytest.raises(SpecError, match=needle):
        MeasuredMemory.from_json(obj)
    del obj["model"]
    with pytest.raises(SpecError, match=r"field 'model' is missing"):
        MeasuredMemory.from_json(obj)


def test_measured_round_trips_through_its_json(tmp_path: Path) -> None:
    m = _measured(device_peak=123)
    assert MeasuredMemory.from_json(json.loads(json.dumps(m.as_json()))) == m
    f = tmp_path / "m.json"
    f.write_text(json.dumps([m.as_json(), replace(m, rank=0).as_json()]))
    assert read_measured(str(f)) == [m, m]
    f.write_text("[]")
    with pytest.raises(SpecError, match="list is empty"):
        read_measured(str(f))


# ---- files and plot -----------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "json_name", "png_name"), [
    ("out/mem", "mem.json", "mem.png"), ("out/mem.png", "mem.json", "mem.png"), ("mem.v2", "mem.v2.json", "mem.v2.png"),
])
def test_report_path_is_a_prefix(given: str, json_name: str, png_name: str) -> None:
    js, png = report_paths(given)
    assert (js.name, png.name) == (json_name, png_name) and js.parent == png.parent


def test_a_directory_is_not_a_report_prefix() -> None:
    with pytest.raises(SpecError, match="give a file prefix"):
        report_paths("reports/")


def test_overlap_check_sees_an_overlap() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.text(0.5, 0.5, "one label")
    ax.text(0.5, 0.5, "another label")
    try:
        assert ("one label", "another label") in overlapping_labels(fig)
    finally:
        plt.close(fig)


def test_plot_labels_never_overlap_with_long_layout_names_and_a_measured_panel() -> None:
    import matplotlib.pyplot as plt

    spec = load_model("deepseek-v3")
    long = [evaluate(spec, Layout.parse(t), H800) for t in ("tp2.pp16.dp64.ep64.vpp3.z1", "tp8.pp16.dp16.ep16.vpp3.z1",
                                                             "tp2.pp8.dp128.ep128.vpp2.z1", "tp4.pp8.dp64.ep64.vpp2")]
    rep = memory_report(spec, 2048, H800, long)
    measured = memory_report(TINY, 4, CPU, plan(TINY, 4, CPU, global_batch=8).plans,
                             options=PlanOptions(global_batch=8), measured=[_measured()])
    assert sum(e.measured is not None for e in measured.layouts) == 1
    for r in (rep, measured):
        fig = render(r)
        try:
            assert overlapping_labels(fig) == []
        finally:
            plt.close(fig)


def test_cli_writes_json_and_png_with_the_measured_run(tmp_path: Path) -> None:
    m = tmp_path / "measured.json"
    m.write_text(json.dumps([_measured().as_json()]))
    res = CliRunner().invoke(app, ["plan", "--model", "tiny", "--gpus", "4", "--hardware", "cpu", "--global-batch",
                                   "8", "--report", str(tmp_path / "r" / "tiny.png"), "--measured", str(m)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "r" / "tiny.json").read_text())
    assert [x["place"] for x in out["layouts"]] == [1, 2, 3, 4, 0]
    assert out["layouts"][-1]["measured"]["activations"] == 1_645_904
    assert (tmp_path / "r" / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_measured_needs_report(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["plan", "--model", "tiny", "--gpus", "4", "--measured", str(tmp_path / "m.json")])
    assert isinstance(res.exception, SpecError) and "give --report PATH too" in str(res.exception)


def test_report_is_written_when_nothing_fits(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["plan", "--model", "gpt3-175b", "--gpus", "8", "--report", str(tmp_path / "r")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2
    out = json.loads((tmp_path / "r.json").read_text())
    assert len(out["layouts"]) == 1 and out["layouts"][0]["fits"] is False
    assert out["layouts"][0]["worst"]["total"] > out["budget_bytes"]
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_write_report_to_a_fresh_folder(tmp_path: Path) -> None:
    spec = load_model("llama3-70b")
    res = plan(spec, 64, H100)
    js, png = write_report(memory_report(spec, 64, H100, res.plans), str(tmp_path / "a" / "b" / "r"))
    assert js.exists() and png.exists() and png.stat().st_size > 10_000
