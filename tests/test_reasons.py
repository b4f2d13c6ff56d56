"""Reason codes have one vocabulary each: ``elastic.reasons`` beside the policy's and the scheduler's.

Every code is a CamelCase plain string on every wire (JSON, the store, a resource's conditions and
Events), no two enums give one name two meanings, and the controller and the operator write the
codes of ``elastic.reasons`` through its members, not as string literals.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from elastic.policy.types import Reason as PolicyReason
from elastic.reasons import DecisionReason, ResourceReason, TickReason
from elastic.scheduler.types import Reason as ScheduleReason

ROOT = Path(__file__).resolve().parents[1]
ENUMS = (TickReason, DecisionReason, ResourceReason, PolicyReason, ScheduleReason)
WRITERS = sorted(
    [
        *(ROOT / "elastic" / "controller").glob("*.py"),
        ROOT / "elastic" / "metrics" / "exporter.py",
        *(ROOT / "operators").glob("*.py"),
    ]
)


def test_every_code_is_a_camel_case_string_and_serialises_as_it() -> None:
    for enum in ENUMS:
        for member in enum:
            assert re.fullmatch(r"(?:[A-Z][a-z0-9]+)+", member.value), (enum.__name__, member)
            assert member == member.value and json.dumps({"r": member}) == json.dumps({"r": member.value})
            assert f"{member}" == member.value


def test_no_name_means_two_things() -> None:
    owners: dict[str, list[str]] = {}
    for enum in ENUMS:
        for member in enum:
            owners.setdefault(member.value, []).append(f"{enum.__module__}.{enum.__name__}")
    assert {k: v for k, v in owners.items() if len(v) > 1} == {
        "Steady": ["elastic.policy.types.Reason", "elastic.scheduler.types.Reason"]
    }


def test_the_controller_and_the_operator_write_codes_through_the_enums() -> None:
    names = "|".join(m.value for e in (TickReason, DecisionReason, ResourceReason) for m in e)
    literal = re.compile(rf'"(?:{names})"')
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in WRITERS
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if literal.search(line) and "JobPhase" not in line and "status.phase" not in line
    ]
    assert not found, "write these through elastic.reasons:\n" + "\n".join(found)
