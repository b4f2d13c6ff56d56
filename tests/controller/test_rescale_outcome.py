"""``RescaleOutcome``'s constructors: each maps every field of the trainer's report to its column.

Every number in the reports below is distinct (and a result's embedded record differs from the
result), so a constructor that reads the wrong field, or the record instead of the result, fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from elastic.backends.base import RescaleOutcome
from elastic.model import Layout
from elastic.train.launch import RescaleResult
from elastic.train.rendezvous.messages import RescaleRecord

REC = RescaleRecord(
    generation=5,
    from_layout=Layout.parse("tp1.pp1.dp4"),
    to_layout=Layout.parse("tp2.pp1.dp2"),
    workers=["w0", "w1", "w2", "w3"],
    joiners=[],
    leavers=[],
    switch_step=31,
    ok=True,
    pause_seconds=0.75,
    bytes_moved=11,
    planned_bytes=22,
    lower_bound_bytes=33,
    plan_seconds=0.125,
    execute_seconds=0.5,
)
# what a JobHandle reports; its own fields, not its record's, are the ones an outcome takes
RES = RescaleResult(
    generation=7,
    from_layout=Layout.parse("tp4.pp1.dp1"),
    to_layout=Layout.parse("tp1.pp2.dp2"),
    switch_step=44,
    pause_seconds=0.25,
    bytes_moved=1001,
    planned_bytes=2002,
    lower_bound_bytes=3003,
    wall_seconds=3.5,
    record=REC,
    leave_seconds=1.5,
)
BEFORE = Layout(1, 1, 4)  # what the backend saw before it asked
ASKED = Layout(2, 2, 1)  # what it asked for, where it names one

CASES: list[tuple[str, Callable[[], RescaleOutcome], RescaleOutcome]] = [
    (
        "from_result: to_layout from the result",
        lambda: RescaleOutcome.from_result("j", BEFORE, RES),
        RescaleOutcome(
            "j",
            BEFORE,
            Layout(1, 2, 2),
            7,
            pause_seconds=0.25,
            total_seconds=3.5,
            bytes_moved=1001,
            bytes_planned=2002,
            bytes_lower_bound=3003,
            step=44,
        ),
    ),
    (
        "from_result: the layout asked for stands over the result's",
        lambda: RescaleOutcome.from_result("j", BEFORE, RES, to_layout=ASKED),
        RescaleOutcome(
            "j",
            BEFORE,
            ASKED,
            7,
            pause_seconds=0.25,
            total_seconds=3.5,
            bytes_moved=1001,
            bytes_planned=2002,
            bytes_lower_bound=3003,
            step=44,
        ),
    ),
    (
        "from_result: an unmeasured pause is none",
        lambda: RescaleOutcome.from_result("j", None, replace(RES, pause_seconds=None)),
        RescaleOutcome(
            "j",
            None,
            Layout(1, 2, 2),
            7,
            pause_seconds=0.0,
            total_seconds=3.5,
            bytes_moved=1001,
            bytes_planned=2002,
            bytes_lower_bound=3003,
            step=44,
        ),
    ),
    (
        "from_record: both layouts from the record, no wall time",
        lambda: RescaleOutcome.from_record("j", REC),
        RescaleOutcome(
            "j",
            Layout(1, 1, 4),
            Layout(2, 1, 2),
            5,
            pause_seconds=0.75,
            total_seconds=0.0,
            bytes_moved=11,
            bytes_planned=22,
            bytes_lower_bound=33,
            step=31,
        ),
    ),
    (
        "from_record: a start has no from_layout, an unmeasured pause is none",
        lambda: RescaleOutcome.from_record("j", replace(REC, from_layout=None, pause_seconds=None)),
        RescaleOutcome(
            "j",
            None,
            Layout(2, 1, 2),
            5,
            pause_seconds=0.0,
            bytes_moved=11,
            bytes_planned=22,
            bytes_lower_bound=33,
            step=31,
        ),
    ),
    (
        "started: nothing paused or moved, the whole start's time",
        lambda: RescaleOutcome.started("j", ASKED, RES),
        RescaleOutcome("j", None, ASKED, 7, pause_seconds=0.0, total_seconds=3.5, step=44),
    ),
    (
        "not_running",
        lambda: RescaleOutcome.not_running("j"),
        RescaleOutcome("j", None, None, 0, 0.0, 0.0, 0, 0, 0, 0),
    ),
    (
        "still_paused: held on the same layout",
        lambda: RescaleOutcome.still_paused("j", BEFORE, 9, 12),
        RescaleOutcome("j", BEFORE, BEFORE, 9, step=12),
    ),
    (
        "still_paused: a coordinator's step -1 is recorded as 0",
        lambda: RescaleOutcome.still_paused("j", BEFORE, 9, -1),
        RescaleOutcome("j", BEFORE, BEFORE, 9, step=0),
    ),
    (
        "stopped: from its layout to none",
        lambda: RescaleOutcome.stopped("j", BEFORE, 9, 12, total_seconds=2.5),
        RescaleOutcome("j", BEFORE, None, 9, total_seconds=2.5, step=12),
    ),
    (
        "stopped: before its first step",
        lambda: RescaleOutcome.stopped("j", None, 1, -1),
        RescaleOutcome("j", None, None, 1, step=0),
    ),
]


@pytest.mark.parametrize(("build", "want"), [(b, w) for _, b, w in CASES], ids=[c[0] for c in CASES])
def test_each_constructor_maps_every_field(build: Callable[[], RescaleOutcome], want: RescaleOutcome) -> None:
    got = build()
    assert got == want
    # 0 == 0.0, so equality alone would pass an int where the history stores seconds as floats
    assert isinstance(got.pause_seconds, float) and isinstance(got.total_seconds, float)
    for layout in (got.from_layout, got.to_layout):
        assert layout is None or isinstance(layout, Layout)
