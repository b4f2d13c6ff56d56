"""Recovering from the survivors as a pure decision: reports in, the step and layout to resume at
(or why not) out. Table-driven; the processes that get there are test_recover's."""

from __future__ import annotations

import pytest

from elastic.model import Layout, SpecError
from elastic.train.rendezvous.recovery import Resume, Stop, consistent_step, plan_recovery, recovery_layout

L = Layout.parse
DP4 = L("tp1.pp1.dp4")
RANKS4 = {"w0": 0, "w1": 1, "w2": 2, "w3": 3}


def held(applied: int, ready: int | None = None, dirty: bool = False, local_apply: bool = True) -> dict:
    return {"applied": applied, "ready": ready, "dirty": dirty, "local_apply": local_apply}


@pytest.mark.parametrize(
    ("case", "reports", "step", "says"),
    [
        ("all at one step", {"a": held(7), "b": held(7)}, 7, ""),
        ("one a step behind with the gradients ready", {"a": held(7), "b": held(6, ready=7)}, 7, ""),
        ("one behind without them", {"a": held(7), "b": held(6)}, 7, "worker b holds step 6 (ready None)"),
        (
            "behind, ready, but may not apply alone",
            {"a": held(7), "b": held(6, ready=7, local_apply=False)},
            7,
            "worker b holds step 6",
        ),
        ("two behind", {"a": held(7), "b": held(5, ready=6)}, 7, "worker b holds step 5"),
        (
            "broken inside an update",
            {"a": held(7), "b": held(7, dirty=True)},
            7,
            "worker b broke inside an optimizer",
        ),
        (
            "the first found is named",
            {"b": held(7, dirty=True), "a": held(7, dirty=True)},
            7,
            "worker b broke",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_step_every_survivor_can_stand_at(case, reports, step, says) -> None:
    r, why = consistent_step(reports)
    assert r == step, case
    assert (says in why) if says else why == "", (case, why)


def test_out_of_memory_says_so() -> None:
    assert (
        "ran out of memory inside an optimizer update"
        in consistent_step({"a": held(3, dirty=True)}, oom=True)[1]
    )
    assert "no consistent state to go on from" in consistent_step({"a": held(3), "b": held(1)}, oom=True)[1]


def plan(ranks=RANKS4, old=DP4, lost=("w1",), reports=None, **kw):
    lost_map = {w: f"{w} died" for w in lost}
    reps = reports if reports is not None else {w: held(9) for w in ranks if w not in lost_map}
    args = {
        "why": "lost " + ", ".join(lost),
        "rollback": False,
        "max_steps": None,
        "validator": None,
        "global_batch": None,
        "micro_batch": 1,
        "first_reason": "w1 died",
    }
    args.update(kw)
    return plan_recovery(old, ranks, reps, lost_map, **args)


def too_big(limit: int):
    def check(lay: Layout, members) -> None:
        if lay.world_size > limit:
            raise SpecError(f"{lay} needs more memory than the survivors have")

    return check


@pytest.mark.parametrize(
    ("case", "kw", "expected"),
    [
        ("three survivors of dp4 resume as dp3", {}, Resume(10, L("tp1.pp1.dp3"), ("w0", "w2", "w3"), 9)),
        ("the batch picks dp2", {"global_batch": 8}, Resume(10, L("tp1.pp1.dp2"), ("w0", "w2"), 9)),
        ("the validator picks dp1", {"validator": too_big(1)}, Resume(10, L("tp1.pp1.dp1"), ("w0",), 9)),
        ("nothing fits", {"validator": too_big(0)}, Stop("lost w1; no layout fits the 3 survivor(s)")),
        ("max_steps reached", {"max_steps": 10}, Stop("reached max_steps=10 (lost w1)", finished=True)),
        (
            "nobody lost: a retry would repeat it",
            {"lost": ()},
            Stop("w1 died; every worker reported back alive"),
        ),
        (
            "a rollback with everyone alive goes back",
            {"lost": (), "rollback": True},
            Resume(10, DP4, ("w0", "w1", "w2", "w3"), 9),
        ),
        (
            "no survivor",
            {"lost": ("w0", "w1", "w2", "w3"), "reports": {}},
            Stop("lost w0, w1, w2, w3; no survivor"),
        ),
        (
            "an inconsistent survivor",
            {"reports": {"w0": held(9), "w2": held(7), "w3": held(9)}},
            Stop("lost w1; worker w2 holds step 7"),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_plan_recovery(case, kw, expected) -> None:
    got = plan(**kw)
    assert type(got) is type(expected), (case, got)
    if isinstance(expected, Stop):
        assert got.reason.startswith(expected.reason) and got.finished == expected.finished, (case, got)
    else:
        assert got == expected, case


def test_a_lost_shard_with_no_copy_cannot_be_rebuilt() -> None:
    # tp2.pp1.dp2: w0/w1 replica 0 (tp ranks 0, 1), w2/w3 replica 1; losing both tp-rank-1 holders
    got = plan(old=L("tp2.pp1.dp2"), lost=("w1", "w3"))
    assert isinstance(got, Stop) and "no survivor holds tp rank 1, pp rank 0" in got.reason
    # losing one of each replica still leaves one whole set, from two broken replicas
    got = plan(old=L("tp2.pp1.dp2"), lost=("w1", "w2"))
    assert got == Resume(10, L("tp2.pp1.dp1"), ("w0", "w3"), 9)


def test_an_interleaved_pipeline_falls_back_to_plain_stages_where_the_batch_needs_it() -> None:
    old = L("tp1.pp2.dp2.vpp2")
    ranks = {f"w{i}": i for i in range(4)}
    # dp1 x micro 1 on global 2: 2 micro-batches per replica, a multiple of pp=2: interleaving stays
    members, lay, refusals = recovery_layout(
        old, {w: r for w, r in ranks.items() if w != "w2"}, None, global_batch=2, micro_batch=1
    )
    assert lay == L("tp1.pp2.dp1.vpp2") and len(members) == 2 and refusals == []
    # global 3 splits into no pp multiple: the same stages without interleaving
    _, lay, refusals = recovery_layout(
        old, {w: r for w, r in ranks.items() if w != "w2"}, None, global_batch=3, micro_batch=1
    )
    assert lay == L("tp1.pp2.dp1") and "not a multiple of pp=2" in refusals[0]
