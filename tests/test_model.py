"""Domain types: presets against published sizes, Layout text form and rank order, validation."""

from __future__ import annotations

import json

import pytest

from elastic.model import (
    MODEL_PRESETS,
    PUBLISHED_PARAMS,
    InferenceSpec,
    Layout,
    ModelSpec,
    PoolSpec,
    SpecError,
    TrainingSpec,
    check_layout,
    load_hardware,
    load_model,
)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_published_total(name: str) -> None:
    got = MODEL_PRESETS[name].total_params()
    want = PUBLISHED_PARAMS[name]
    assert abs(got / want - 1) < 0.02, f"{name}: {got / 1e9:.3f}B vs published {want / 1e9:.3f}B"


# Megatron-LM SC'21 (arXiv 2104.04473) counts P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)),
# which includes learned position embeddings (s*h); our GPT presets have none, so subtract s*h.
@pytest.mark.parametrize("name", ["megatron-1.7b", "megatron-3.6b", "megatron-7.5b", "megatron-18.4b",
                                  "megatron-145.6b", "megatron-1t"])
def test_megatron_rows_match_the_paper_formula(name: str) -> None:
    m = MODEL_PRESETS[name]
    n, h, V, s = m.layers, m.hidden, m.vocab, m.seq_len
    formula = 12 * n * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * n * h)) - s * h
    assert abs(m.total_params() / formula - 1) < 0.001


def test_deepseek_v3_active_parameters() -> None:
    m = MODEL_PRESETS["deepseek-v3"]
    assert abs(m.active_params() / 37e9 - 1) < 0.03


@pytest.mark.parametrize(
    "text, layout",
    [
        ("tp2.pp2.dp4", Layout(2, 2, 4)),
        ("tp1.pp4.dp8.ep8.vpp2.z1", Layout(1, 4, 8, ep=8, vpp=2, zero=1)),
        ("TP8.PP1.DP1", Layout(8, 1, 1)),
    ],
)
def test_layout_parse_and_format_round_trip(text: str, layout: Layout) -> None:
    assert Layout.parse(text) == layout
    assert Layout.parse(str(layout)) == layout
    assert str(layout) == text.lower()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("tp0.pp2.dp1", "tp0"),
        ("tp2.pp2", "missing dp"),
        ("tp2.pp2.dp2.xx3", "'xx3'"),
        ("tp2.tp2.pp1.dp1", "given twice"),
        ("", "empty"),
        ("tp1.pp1.dp4.ep3", "ep=3 must divide dp=4"),
        ("tp1.pp1.dp1.vpp2", "vpp=2 needs pp > 1"),
    ],
)
def test_layout_parse_errors_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SpecError, match=needle.replace("(", r"\(")):
        Layout.parse(text)


def test_parsing_a_layout_value_says_to_use_it_as_it_is() -> None:
    with pytest.raises(TypeError, match=r"got the Layout tp2.pp1.dp2 itself \(use it as it is\)"):
        Layout.parse(Layout(tp=2, pp=1, dp=2))


def test_rank_order_is_megatron_tp_fastest_then_dp_then_pp() -> None:
    L = Layout(tp=2, pp=2, dp=3)
    assert L.world_size == 12
    assert [L.coords(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert L.coords(6) == (0, 0, 1)
    for r in range(L.world_size):
        assert L.rank(*L.coords(r)) == r
    assert L.tp_group(5) == [4, 5]
    assert L.dp_group(1) == [1, 3, 5]
    assert L.pp_group(3) == [3, 9]
    # every rank appears in exactly one group of each kind
    for groups in (L.all_tp_groups(), L.all_dp_groups(), L.all_pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(12))


def test_check_layout_shows_the_arithmetic() -> None:
    m = MODEL_PRESETS["llama3-8b"]  # 32 heads, 8 kv heads
    with pytest.raises(SpecError, match=r"tp=3 does not divide heads=32"):
        check_layout(m, Layout(3, 1, 1))
    with pytest.raises(SpecError, match=r"tp=16 does not divide kv_heads=8"):
        check_layout(m, Layout(16, 1, 1))
    with pytest.raises(SpecError, match="never spans nodes"):
        check_layout(m, Layout(8, 1, 1), gpus_per_node=4)
    with pytest.raises(SpecError, match="exceed the 32 layers"):
        check_layout(m, Layout(1, 33, 1))
    check_layout(m, Layout(8, 4, 2), gpus_per_node=8)


def test_model_file_round_trip_and_errors(tmp_path) -> None:
    good = MODEL_PRESETS["llama2-7b"].model_dump(exclude_none=True)
    p = tmp_path / "m.json"
    p.write_text(json.dumps(good))
    assert load_model(str(p)) == MODEL_PRESETS["llama2-7b"]
    y = tmp_path / "m.yaml"
    y.write_text("name: x\nlayers: 2\nhidden: 64\nffn_hidden: 128\nheads: 4\nkv_heads: 4\nvocab: 100\nseq_len: 16\n")
    assert load_model(str(y)).layers == 2
    bad = dict(good)
    del bad["heads"]
    p.write_text(json.dumps(bad))
    with pytest.raises(SpecError, match="field 'heads' is missing"):
        load_model(str(p))
    bad = dict(good, layers=-3)
    p.write_text(json.dumps(bad))
    with pytest.raises(SpecError, match="field 'layers'"):
        load_model(str(p))
    bad = dict(good, layerz=3)
    p.write_text(json.dumps(bad))
    with pytest.raises(SpecError, match="unknown field 'layerz'"):
        load_model(str(p))
    with pytest.raises(SpecError, match="unknown model 'nope'"):
        load_model("nope")
    with pytest.raises(SpecError, match="heads=5"):
        ModelSpec.from_mapping(dict(good, heads=5), "m")


def test_hardware_and_workload_specs() -> None:
    assert load_hardware("h100-80g").memory_bytes == 80 * 2**30
    with pytest.raises(SpecError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")
    with pytest.raises(ValueError, match="min_replicas=5 > max_replicas=2"):
        InferenceSpec(name="s", min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError, match="min_gpus=9 > max_gpus=8"):
        TrainingSpec(name="j", model="tiny", min_gpus=9, max_gpus=8)
    assert PoolSpec(nodes=2, gpus_per_node=8).total_gpus == 16
