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
