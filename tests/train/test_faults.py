"""Fault injection is one injected object: parsed once from the environment where a worker process
starts, inert by default, and the only place in ``elastic/`` that names its variables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic.errors import SpecError
from elastic.train.agent import faults as faults_module
from elastic.train.agent.faults import DIE_POINTS, NO_FAULTS, Faults

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, Faults()),
        ({"ELASTIC_FAULT_EXCHANGE": "", "ELASTIC_FAULT_SLOW_LEAVE": " "}, Faults()),
        ({"ELASTIC_FAULT_EXCHANGE": "w2:2:exchange"}, Faults(die_at=("w2", 2, "exchange"))),
        ({"ELASTIC_FAULT_EXCHANGE": "pod:a-0:3:init_pg"}, Faults(die_at=("pod:a-0", 3, "init_pg"))),
        ({"ELASTIC_FAULT_SLOW_CHECKPOINT": "w1:4"}, Faults(slow_checkpoint=("w1", 4.0))),
        ({"ELASTIC_FAULT_SLOW_CHECKPOINT": "w1:0.5"}, Faults(slow_checkpoint=("w1", 0.5))),
        ({"ELASTIC_FAULT_SLOW_LEAVE": "60"}, Faults(slow_leave_s=60.0)),
        ({"ELASTIC_FAULT_SLOW_LEAVE": "0"}, Faults()),
        ({"ELASTIC_FAULT_HOLD_STEP": "/tmp/x/hold-step"}, Faults(hold_step_file="/tmp/x/hold-step")),
        (
            {"ELASTIC_FAULT_EXCHANGE": "w3:2:commit", "ELASTIC_FAULT_SLOW_LEAVE": "4", "OTHER": "x"},
            Faults(die_at=("w3", 2, "commit"), slow_leave_s=4.0),
        ),
    ],
)
def test_from_env_parses_each_variable(env: dict[str, str], want: Faults) -> None:
    assert Faults.from_env(env) == want


def test_every_die_point_parses() -> None:
    for where in DIE_POINTS:
        assert Faults.from_env({"ELASTIC_FAULT_EXCHANGE": f"w0:1:{where}"}).die_at == ("w0", 1, where)


@pytest.mark.parametrize(
    "name, value, form",
    [
        ("ELASTIC_FAULT_EXCHANGE", "w2", "<worker>:<generation>:<where>"),
        ("ELASTIC_FAULT_EXCHANGE", "w2:2", "<worker>:<generation>:<where>"),
        ("ELASTIC_FAULT_EXCHANGE", "w2:two:exchange", "generation: an integer"),
        ("ELASTIC_FAULT_EXCHANGE", "w2:-1:exchange", "generation: >= 0"),
        ("ELASTIC_FAULT_EXCHANGE", "w2:2:exchnage", "<where> one of group, rendezvous, exchange"),
        ("ELASTIC_FAULT_EXCHANGE", ":2:exchange", "<worker>:<generation>:<where>"),
        ("ELASTIC_FAULT_SLOW_CHECKPOINT", "4", "<worker>:<seconds>"),
        ("ELASTIC_FAULT_SLOW_CHECKPOINT", ":4", "<worker>:<seconds>"),
        ("ELASTIC_FAULT_SLOW_CHECKPOINT", "w1:slow", "<worker>:<seconds>"),
        ("ELASTIC_FAULT_SLOW_CHECKPOINT", "w1:-1", "seconds: a number >= 0"),
        ("ELASTIC_FAULT_SLOW_LEAVE", "soon", "<seconds>"),
        ("ELASTIC_FAULT_SLOW_LEAVE", "-4", "seconds: a number >= 0"),
        ("ELASTIC_FAULT_SLOW_LEAVE", "inf", "seconds: a number >= 0"),
        ("ELASTIC_FAULT_SLOW_LEAVE", "nan", "seconds: a number >= 0"),
    ],
)
def test_from_env_rejects_a_malformed_value_naming_the_variable_and_its_format(
    name: str, value: str, form: str
) -> None:
    with pytest.raises(ValueError) as e:
        Faults.from_env({name: value})
    assert isinstance(e.value, SpecError)  # a worker turns it into exit code 2 with the message
    assert f"{name}={value!r}" in str(e.value) and form in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"die_at": ("w0", 1, "nowhere")}, "die_at"),
        ({"slow_leave_s": -1.0}, "slow_leave_s"),
        ({"slow_checkpoint": ("w0", float("inf"))}, "slow_checkpoint"),
    ],
)
def test_a_faults_object_validates_itself(kw: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError, match=f"Faults.{field}"):
        Faults(**kw)  # type: ignore[arg-type]


def test_the_default_does_nothing() -> None:
    assert Faults() == NO_FAULTS
    for where in DIE_POINTS:
        NO_FAULTS.at("w0", 1, where)  # returns: the test process lives on
    assert NO_FAULTS.checkpoint_write_delay("w0") == 0.0
    NO_FAULTS.before_leaving()
    NO_FAULTS.hold_step()
    assert Faults.from_env({}) == NO_FAULTS


@pytest.mark.parametrize("worker, want", [("w1", 4.0), ("w10", 0.0), ("w0", 0.0)])
def test_only_the_named_worker_writes_its_checkpoints_slowly(worker: str, want: float) -> None:
    assert Faults(slow_checkpoint=("w1", 4.0)).checkpoint_write_delay(worker) == want


def test_at_kills_the_process_only_at_its_point() -> None:
    """Every other (worker, generation, point) returns; the named one exits 9 as a lost node."""
    code = (
        "from elastic.train.agent.faults import Faults\n"
        "f = Faults(die_at=('w1', 2, 'commit'))\n"
        "for args in [('w0', 2, 'commit'), ('w1', 1, 'commit'), ('w1', 2, 'exchange'), ('w1', 3, 'commit')]:\n"
        "    f.at(*args)\n"
        "print('survived', flush=True)\n"
        "f.at('w1', 2, 'commit')\n"
        "print('after', flush=True)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.split() == ["survived"], p.stdout
    assert "worker w1: fault injected at the commit of generation 2" in p.stderr, p.stderr


def test_a_worker_process_reads_its_faults_from_the_environment_at_start() -> None:
    """The process boundary parses the variables: a malformed one stops the worker with exit code 2
    before it contacts any coordinator."""
    env = {
        **os.environ,
        "ELASTIC_JOB": "j",
        "ELASTIC_WORKER_ID": "w0",
        "ELASTIC_RENDEZVOUS_URL": "http://127.0.0.1:1",
        "ELASTIC_FAULT_SLOW_LEAVE": "soon",
    }
    p = subprocess.run(
        [sys.executable, "-m", "elastic.train.worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "ELASTIC_FAULT_SLOW_LEAVE='soon'" in p.stderr, p.stderr


def test_before_leaving_waits_its_seconds() -> None:
    import time

    t0 = time.monotonic()
    Faults(slow_leave_s=0.2).before_leaving()
    assert time.monotonic() - t0 >= 0.2


def test_hold_step_waits_while_the_file_exists(tmp_path: Path) -> None:
    hold = tmp_path / "hold-step"
    hold.touch()
    release = threading.Timer(0.3, hold.unlink)
    release.start()
    try:
        Faults(hold_step_file=str(hold)).hold_step()
        assert not hold.exists()  # it returned only once the file was gone
    finally:
        release.cancel()


def test_hold_step_returns_at_once_without_the_file(tmp_path: Path) -> None:
    # no file: nothing held (were it held, the test would hang until its timeout)
    Faults(hold_step_file=str(tmp_path / "absent")).hold_step()


def test_hold_step_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hold = tmp_path / "forgotten"
    hold.touch()
    monkeypatch.setattr(faults_module, "HOLD_STEP_MAX_S", 0.2)
    Faults(hold_step_file=str(hold)).hold_step()
    assert hold.exists()  # it gave up waiting although the file is still there


def test_only_faults_py_names_the_fault_variables_in_elastic() -> None:
    """Production code takes an injected ``Faults``; the environment is read in ``faults.py`` alone."""
    allowed = ROOT / "elastic" / "train" / "agent" / "faults.py"
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "elastic").rglob("*.py"))
        if p != allowed
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "ELASTIC_FAULT_" in line
    ]
    assert not found, "read fault injection through elastic.train.agent.faults.Faults:\n" + "\n".join(found)


def test_the_agent_reads_no_environment() -> None:
    """Everything the agent is configured with is passed to it (options, engine factory, faults)."""
    reads = re.compile(r"\bos\.environ\b|\bgetenv\b|\benviron\[")
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "elastic" / "train" / "agent").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert not found, "\n".join(found)
