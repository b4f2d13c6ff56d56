"""A rescale's meeting and the coordinator's deadlines as pure decisions (no coordinator, no clock)."""

from __future__ import annotations

import pytest

from elastic.model import Layout
from elastic.train.rendezvous.meeting import first_silent, join_overdue, meet, silent_in_recovery
from elastic.train.rendezvous.messages import Directive

# a grow tp1.pp1.dp2 on {a, b} -> dp3 with joiner c
D = Directive(
    job="j",
    generation=2,
    layout=Layout.parse("tp1.pp1.dp3"),
    workers=("a", "b", "c"),
    remap=True,
    old_layout=Layout.parse("tp1.pp1.dp2"),
    old_ranks={"a": 0, "b": 1},
    switch_step=5,
    store_host="h",
    store_port=1,
    join_timeout_s=10.0,
)


@pytest.mark.parametrize(
    ("case", "arrived", "worker", "digest", "ranks", "error", "decision", "says", "counted"),
    [
        ("the first waits", {}, "a", "x", {}, None, "wait", "", True),
        ("the last with the same plan: go", {"a": "x", "b": "x"}, "c", "x", {}, None, "go", "", True),
        (
            "a rank map of its own choosing",
            {"a": "x", "b": "x"},
            "c",
            "x",
            {"c": 0, "a": 1, "b": 2},
            None,
            "go",
            "",
            True,
        ),
        (
            "an error abandons, nothing counted",
            {"a": "x"},
            "b",
            "",
            {},
            "OOM planning",
            "abandon",
            "worker b could not plan or prepare the reshard: OOM planning",
            False,
        ),
        (
            "a plan for other workers",
            {},
            "a",
            "x",
            {"a": 0, "z": 1, "b": 2},
            None,
            "abandon",
            "a plan for other workers",
            False,
        ),
        (
            "a rank map with a gap",
            {},
            "a",
            "x",
            {"a": 0, "b": 2, "c": 3},
            None,
            "abandon",
            "for other workers",
            False,
        ),
        (
            "two plans",
            {"a": "x"},
            "b",
            "y",
            {},
            None,
            "abandon",
            "different reshard plans {'x': ['a'], 'y': ['b']}",
            True,
        ),
        ("an arrival asked again is not counted twice", {"a": "x"}, "a", "y", {}, None, "wait", "", False),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_meet(case, arrived, worker, digest, ranks, error, decision, says, counted) -> None:
    m = meet(D, arrived, worker, digest, ranks, error)
    assert (m.decision, m.counted) == (decision, counted), case
    assert says in m.reason if says else m.reason == "", (case, m.reason)
    assert dict(m.arrived) == ({**arrived, worker: digest} if counted else arrived), case
    assert worker not in arrived or arrived[worker] == "x"  # the input is not changed


@pytest.mark.parametrize(
    ("case", "arrived", "now", "says"),
    [
        ("within the timeout", {}, 110.0, None),
        (
            "the joiner never came",
            {"a": "x", "b": "x"},
            110.5,
            "joiner(s) c did not arrive within join_timeout_s=10",
        ),
        ("a member never came", {"a": "x", "c": "x"}, 111.0, "member(s) b did not arrive"),
        ("a member and a joiner", {"a": "x"}, 111.0, "member(s) b, c did not arrive"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_join_overdue(case, arrived, now, says) -> None:
    why = join_overdue(D, arrived, 100.0, now)
    assert (why is None) == (says is None), case
    if says:
        assert says in why and "nothing moved" in why, why


def test_first_silent_by_name_and_never_seen_is_not_judged() -> None:
    seen = {"b": 80.0, "a": 84.0, "c": 99.0}
    assert first_silent(["c", "b", "a", "never"], seen, 100.0, 15.0) == ("a", 16.0)
    assert first_silent(["c", "never"], seen, 100.0, 15.0) is None
    assert first_silent(["a"], seen, 99.0, 15.0) is None  # exactly at the timeout: not yet


def test_silent_in_recovery_counts_beats() -> None:
    seen = {"a": 97.0, "b": 97.6}
    # interval 1 s: quiet after 2.5 s; a member never seen counts as seen now
    assert silent_in_recovery(["a", "b", "never"], seen, 100.0, 1.0) == [("a", 3.0)]
    assert silent_in_recovery(["a", "b"], seen, 100.0, 2.0) == []
