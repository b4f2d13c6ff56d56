"""``elastic plan`` through the real entry point (``elastic.cli.main``) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = {"layout", "tp", "pp", "dp", "ep", "vpp", "zero", "gpus_used", "micro_batch", "grad_accum", "recompute",
        "offload", "fits", "memory_bytes", "gpu_memory_bytes", "stage_layers", "step_seconds", "tokens_per_second",
        "mfu"}


def elastic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from elastic.cli import main; main()", "plan", *args],
                          capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin"})


def test_deepseek_v3_json_lists_a_pp16_plan_with_64_slots() -> None:
    r = elastic("--model", "deepseek-v3", "--gpus", "2048", "--hardware", "h800-80g", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"model", "gpus", "plans", "reason"} and out["gpus"] == 2048
    assert all(set(p) == KEYS for p in out["plans"])
    assert set(out["plans"][0]["memory_bytes"]) == {"weights", "gradients", "optimizer", "activations", "reserve",
                                                    "total"}
    pp16 = [p for p in out["plans"] if p["pp"] == 16 and p["vpp"] == 1 and p["fits"]]
    assert pp16
    # 61 layers in 16 stages of 4 slots: 64 slots, 3 of them virtual
    assert sum(pp16[0]["stage_layers"]) == 61 and max(pp16[0]["stage_layers"]) * 16 == 64


def test_human_table_and_single_layout() -> None:
    r = elastic("--model", "megatron-18.4b", "--gpus", "256", "--hardware", "a100-80g", "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "megatron-18.4b on 256 x a100-80g" in r.stdout and "█" in r.stdout and "layouts fit" in r.stdout
    r = elastic("--model", "megatron-18.4b", "--gpus", "256", "--hardware", "a100-80g", "--layout", "tp1.pp1.dp256")
    assert r.returncode == 2
    assert "tp1.pp1.dp256" in r.stdout


def test_no_feasible_layout_exits_2_with_reason() -> None:
    r = elastic("--model", "gpt3-175b", "--gpus", "8", "--json")
    assert r.returncode == 2
    out = json.loads(r.stdout)
    assert out["plans"] == [] and "more GPUs" in out["reason"]


@pytest.mark.parametrize(("args", "needle"), [
    (("--model", "tiny", "--gpus", "0"), "at least 1 GPU"),
    (("--model", "gpt3-175b", "--gpus", "16", "--layout", "tp16.pp1.dp1"), "gpus_per_node"),
    (("--model", "tiny", "--gpus", "8", "--hardware", "b300"), "unknown hardware"),
    (("--model", "ZEROFILE", "--gpus", "8"), "layers"),
])
def test_bad_input_is_one_line_exit_2(args: tuple[str, ...], needle: str, tmp_path: Path) -> None:
    zero = tmp_path / "zero.yaml"
    zero.write_text("name: empty\nlayers: 0\nhidden: 64\nffn_hidden: 128\nheads: 4\nkv_heads: 4\nvocab: 100\n"
                    "seq_len: 16\n")
    r = elastic(*[str(zero) if a == "ZEROFILE" else a for a in args])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_single_layout_is_planned_with_the_global_batch_given() -> None:
    # dp=15 divides 2160 but not the default 1024: the option must reach the layout's evaluation
    r = elastic("--model", "megatron-145.6b", "--gpus", "1920", "--layout", "tp8.pp16.dp15", "--global-batch", "2160",
                "--json")
    assert r.returncode == 0, r.stderr
    (p,) = json.loads(r.stdout)["plans"]
    assert p["layout"] == "tp8.pp16.dp15" and p["micro_batch"] * p["grad_accum"] * 15 == 2160


def test_keywords_left_out_never_replace_the_options_given() -> None:
    from elastic.model import Layout, load_hardware, load_model
    from elastic.parallel.planner import PlanOptions, evaluate, feasible_layouts

    model, hw = load_model("megatron-145.6b"), load_hardware("h100-80g")
    opts = PlanOptions(global_batch=2160, gpus_per_node=8)
    p = evaluate(model, Layout.parse("tp8.pp16.dp15"), hw, options=opts)
    assert p.micro_batch * p.grad_accum * 15 == 2160
    assert all(q.micro_batch * q.grad_accum * q.layout.dp == 2160
               for q in feasible_layouts(load_model("tiny"), 8, hw, options=PlanOptions(global_batch=2160)))
    # a keyword given still wins over the options
    q = evaluate(model, Layout.parse("tp8.pp16.dp16"), hw, options=opts, global_batch=1024)
    assert q.micro_batch * q.grad_accum * 16 == 1024
