"""A training job's phase has one vocabulary: ``elastic.phases``.

``JobPhase`` is ``JobRuntime.phase`` and ``CoordinatorPhase`` the training coordinator's own phase.
Their members are plain strings on every wire (JSON, the store, a CR's status, metric labels), the
coordinator sets no phase ``RUNTIME_PHASES`` cannot translate, and the controller, the backends'
shared code, the metrics and the operator compare a job's phase against ``JobPhase`` members only.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from elastic.phases import JOB_PHASES, RUNTIME_PHASES, CoordinatorPhase, JobPhase

ROOT = Path(__file__).resolve().parents[1]
RENDEZVOUS = ROOT / "elastic" / "train" / "rendezvous"
# the code that reads JobRuntime.phase and none of Kubernetes' pod phases, which share its names
CONVERTED = sorted([*(ROOT / "elastic" / "controller").glob("*.py"), ROOT / "elastic" / "backends" / "base.py",
                    *(ROOT / "elastic" / "metrics").glob("*.py"), *(ROOT / "operators").glob("*.py")])
_NAMES = "|".join(p.value for p in JobPhase)
# `== "Running"`, `!= "Failed"`, `in ("Failed", ...)`, `in ("...", "Recovering")`
_COMPARED = re.compile(rf'(?:[=!]=\s*"(?:{_NAMES})"|\bin\s*[(\[{{][^)\]}}]*"(?:{_NAMES})")')
# a Kubernetes object's phase (a pod's ``status.phase``) is not a job's: such a line is never flagged
_POD_PHASE = re.compile(r"\bstatus\.phase\b")


def _compares_job_phase_literal(line: str) -> bool:
    return bool(_COMPARED.search(line)) and not _POD_PHASE.search(line)


def test_job_phases_are_the_enum() -> None:
    assert len(JOB_PHASES) == len(set(JOB_PHASES))
    assert set(JOB_PHASES) == set(JobPhase)
    assert JOB_PHASES[0] is JobPhase.PENDING
    assert list(JOB_PHASES[1:]) == sorted(JOB_PHASES[1:])


def test_runtime_phases_translate_every_coordinator_phase() -> None:
    assert set(RUNTIME_PHASES) == set(CoordinatorPhase)
    assert all(isinstance(v, JobPhase) for v in RUNTIME_PHASES.values())
    assert set(RUNTIME_PHASES.values()) <= set(JobPhase)
    # a status off the wire holds a plain string: it looks its phase up all the same
    assert RUNTIME_PHASES["starting"] is JobPhase.PENDING
    assert RUNTIME_PHASES[str(CoordinatorPhase.RECOVERING)] is JobPhase.RECOVERING


def _set_phases(tree: ast.AST) -> set[str]:
    """The phases a module assigns to the coordinator's ``self._phase`` (literals or members), each
    branch of a conditional expression counted."""
    out: set[str] = set()

    def values(node: ast.expr) -> None:
        if isinstance(node, ast.IfExp):
            values(node.body)
            values(node.orelse)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "CoordinatorPhase"):
            out.add(CoordinatorPhase[node.attr].value)
        else:
            raise AssertionError(f"line {node.lineno}: self._phase is set to {ast.unparse(node)}, not a phase")

    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == "_phase":
                values(node.value)
            elif isinstance(target, ast.Tuple):
                for i, t in enumerate(target.elts):
                    if isinstance(t, ast.Attribute) and t.attr == "_phase":
                        assert isinstance(node.value, ast.Tuple), ast.unparse(node)
                        values(node.value.elts[i])
    return out


def test_every_phase_the_coordinator_sets_is_a_coordinator_phase() -> None:
    found: set[str] = set()
    for path in sorted(RENDEZVOUS.glob("*.py")):
        found |= _set_phases(ast.parse(path.read_text(), filename=str(path)))
    assert found == {p.value for p in CoordinatorPhase}
    assert found <= set(RUNTIME_PHASES)


def test_set_phases_reads_literals_members_and_tuples() -> None:
    tree = ast.parse('self._phase = "paused" if hold else CoordinatorPhase.RUNNING\n'
                     'self._phase, self._reason = "finished", f"reached {n}"\n')
    assert _set_phases(tree) == {"paused", "running", "finished"}


@pytest.mark.parametrize("enum", [JobPhase, CoordinatorPhase])
def test_members_are_their_strings(enum: type[JobPhase] | type[CoordinatorPhase]) -> None:
    for member in enum:
        plain = member.value
        assert type(plain) is str
        assert member == plain and hash(member) == hash(plain)
        assert str(member) == plain and f"{member}" == plain and f"{member:>3}" == f"{plain:>3}"
        assert json.dumps(member) == json.dumps(plain)
        assert json.loads(json.dumps({"phase": member})) == {"phase": plain}
        assert enum(plain) is member


def test_job_phase_values_are_the_published_names() -> None:
    # the store, the CRD status and the elastic_job_phase labels carry these names: they never change
    assert [p.value for p in JOB_PHASES] == ["Pending", "Failed", "Finished", "Paused", "Recovering", "Rescaling",
                                             "Running", "Stopped", "Stopping"]


def test_scan_finds_a_phase_literal_in_a_comparison() -> None:
    for line in ('rt.phase == "Running"', 'rt.phase != "Failed"', 'rt.phase in ("Failed", "Recovering")',
                 'st.get("phase") in ("Paused",)', 'x in {"Stopped"}', 'rt.phase in ["Rescaling"]'):
        assert _compares_job_phase_literal(line), line
    for line in ('rt.phase == JobPhase.RUNNING', 'reason == "NotLeader"', '"phase": "BackOff"',
                 'TickResult(now, False, "Paused", "controller paused")', 'p.status.phase in ("Succeeded", "Failed")',
                 'if pod.status.phase == "Running":', 'p.status is not None and p.status.phase == "Pending"'):
        assert not _compares_job_phase_literal(line), line


def test_no_job_phase_literal_is_compared_in_converted_code() -> None:
    assert len(CONVERTED) > 10
    left = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in CONVERTED for n, line in enumerate(path.read_text().splitlines(), 1)
            if _compares_job_phase_literal(line)]
    assert not left, "compare with JobPhase members:\n" + "\n".join(left)
