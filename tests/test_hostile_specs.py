"""Values that only fail later, deep inside, are refused where a spec is read, naming the field:
the config loader, the admin API and the CRDs share these models, so they refuse alike."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from elastic.model import InferenceSpec, Layout, SpecError, TrainingSpec

SERVICE = {"name": "chat", "metric": {"preset": "vllm-running", "target": 10}}
JOB = {"name": "train", "model": "tiny"}


@pytest.mark.parametrize("text", ["tp١.pp1.dp٢", "tp２.pp1.dp1", "tp1.pp1.dp" + "9" * 5000, "tp1.pp1.dp1234567"])
def test_layouts_take_a_few_ascii_digits_per_degree(text: str) -> None:
    with pytest.raises(SpecError, match="cannot read") as e:
        Layout.parse(text)
    assert len(str(e.value)) < 300  # a huge value is not echoed back whole
    assert Layout.parse("tp8.pp16.dp15") == Layout(tp=8, pp=16, dp=15)


@pytest.mark.parametrize("field,value", [("target", 1e999), ("target", float("nan")), ("windowSeconds", float("inf"))])
def test_a_float_field_refuses_inf_and_nan(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match="finite number"):
        InferenceSpec.model_validate({**SERVICE, "metric": {**SERVICE["metric"], field: value}})


def test_gpus_per_replica_is_bounded() -> None:
    with pytest.raises(ValidationError, match="gpus_per_replica"):
        InferenceSpec.model_validate({**SERVICE, "gpus_per_replica": 1e30})
    assert InferenceSpec.model_validate({**SERVICE, "gpus_per_replica": 16}).gpus_per_replica == 16


@pytest.mark.parametrize("field", ["allowed_tp", "allowed_pp"])
@pytest.mark.parametrize("value", [[0], [1, -2], [10**9]])
def test_allowed_degrees_are_refused_naming_the_field(field: str, value: list[int]) -> None:
    with pytest.raises(ValidationError, match=f"{field} contains {value[-1]}; degrees are from 1 to 65536"):
        TrainingSpec.model_validate({**JOB, field: value})
    assert TrainingSpec.model_validate({**JOB, field: [1, 2]}).model_dump()[field] == [1, 2]


def test_model_files_are_regular_small_and_their_content_never_echoed(tmp_path) -> None:
    import os

    from elastic.model import MODEL_FILE_MAX_BYTES, load_model

    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="not a regular file"):
        load_model(str(fifo))  # refused before it is opened: a read would block for ever
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MODEL_FILE_MAX_BYTES + 1))
    with pytest.raises(SpecError, match=f"{MODEL_FILE_MAX_BYTES + 1} bytes; a model file is at most"):
        load_model(str(big))
    with pytest.raises(SpecError, match="not a regular file"):
        load_model(str(tmp_path) + "/")
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: hunter2\n  token: [oops\n")
    with pytest.raises(SpecError, match=r"not valid yaml: line \d+") as e:
        load_model(str(secret))
    assert "hunter2" not in str(e.value) and "oops" not in str(e.value)
    bad_json = tmp_path / "secret.json"
    bad_json.write_text('{"token": "hunter2",,}')
    with pytest.raises(SpecError, match=r"not valid json: line 1") as e:
        load_model(str(bad_json))
    assert "hunter2" not in str(e.value)


def test_a_base_dir_confines_model_files(tmp_path) -> None:
    import json

    from elastic.model import load_model

    models = tmp_path / "models"
    models.mkdir()
    spec = {"name": "m", "layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
            "seq_len": 32}
    (models / "m.json").write_text(json.dumps(spec))
    (tmp_path / "outside.json").write_text(json.dumps(spec))
    (models / "link.json").symlink_to(tmp_path / "outside.json")
    assert load_model("m.json", base_dir=models).layers == 2
    assert load_model(str(models / "m.json"), base_dir=models).layers == 2
    for escape in ("../outside.json", str(tmp_path / "outside.json"), "link.json", "/etc/passwd"):
        with pytest.raises(SpecError, match=f"model files are read from {models} only"):
            load_model(escape, base_dir=models)
    assert load_model("tiny", base_dir=models).name == "tiny"  # presets need no file


def test_a_key_given_twice_is_refused_in_configs_and_model_files(tmp_path) -> None:
    from elastic.config import load_config
    from elastic.model import load_model

    cfg = tmp_path / "pool.yaml"
    cfg.write_text("pool:\n  name: p\n  nodes: 1\n  gpus_per_node: 8\npool:\n  name: q\n")
    with pytest.raises(SpecError, match=r"config .*pool\.yaml: not valid YAML: key 'pool' is given twice \(line 5\)"):
        load_config(cfg)
    nested = tmp_path / "nested.yaml"
    nested.write_text("pool:\n  name: p\n  nodes: 1\n  nodes: 2\n")
    with pytest.raises(SpecError, match=r"key 'nodes' is given twice \(line 4\)"):
        load_config(nested)
    model = tmp_path / "m.yaml"
    model.write_text("name: m\nlayers: 2\nlayers: 4\n")
    with pytest.raises(SpecError, match=r"not valid yaml: line 3: key 'layers' is given twice"):
        load_model(str(model))


def test_a_world_readable_token_file_is_loaded_with_a_warning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import os

    from elastic.api.auth import TokenSet

    f = tmp_path / "tokens"
    f.write_text("admin-token-0123456789abcdef admin alice\n")
    os.chmod(f, 0o644)
    with caplog.at_level(logging.WARNING, logger="elastic.api.auth"):
        assert len(TokenSet.from_file(f)) == 1
    assert any("can be read by other users (mode 644)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    os.chmod(f, 0o600)
    with caplog.at_level(logging.WARNING, logger="elastic.api.auth"):
        TokenSet.from_file(f)
    assert not caplog.records
