"""The worker agent's ``Engine``: one protocol, every part of it implemented or defaulted, never probed."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch

from elastic.train.agent import Engine, EngineBase, HeldState
from elastic.train.engine import TrainEngine

MEMBERS = sorted({n for n in dir(Engine) if not n.startswith("_")} | set(typing.get_type_hints(Engine)))


def test_the_protocol_names_every_part_the_agent_uses() -> None:
    assert set(MEMBERS) >= {
        "state",
        "train_step",
        "close",
        "recovery_state",
        "interrupt",
        "abort",
        "communicators",
        "give_up",
        "resume_partial",
        "recoverable",
        "resumes_partial",
        "give_up_checks",
        "keep_given_up",
        "memory",
        "oom_memory",
    }


@pytest.mark.parametrize("cls", [EngineBase, HeldState])
def test_the_base_and_a_keepers_held_state_have_every_part(cls) -> None:
    missing = [n for n in MEMBERS if not hasattr(cls, n)]
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_reference_trainer_implements_every_part() -> None:
    # the four attributes are set per instance in __init__; the rest are the class's
    per_instance = {"give_up_checks", "keep_given_up", "memory", "oom_memory"}
    missing = [n for n in MEMBERS if n not in per_instance and not hasattr(TrainEngine, n)]
    assert not missing, f"TrainEngine lacks {missing}"
    assert TrainEngine.recoverable and TrainEngine.resumes_partial


def test_the_defaults_do_nothing_and_say_so() -> None:
    held = HeldState({"w": torch.zeros(2)})
    assert (held.recoverable, held.resumes_partial, held.memory, held.oom_memory) == (
        False,
        False,
        None,
        None,
    )
    assert held.recovery_state() == {} and held.communicators() == []
    held.interrupt(), held.abort(), held.give_up(3)  # nothing to stop: no error either
    with pytest.raises(NotImplementedError, match="resumes_partial"):
        held.resume_partial(object())
    with pytest.raises(RuntimeError, match="runs no step"):
        held.train_step(1)


def test_the_agent_never_probes_its_engine() -> None:
    """Capabilities are declared on the engine (``recoverable``, ``resumes_partial``), not guessed
    with ``hasattr``/``getattr`` on it."""
    pattern = re.compile(r"(hasattr|getattr)\((self\.)?(engine|eng)\b")
    hits = [
        f"{p.name}:{i}"
        for p in sorted(Path("elastic/train/agent").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
