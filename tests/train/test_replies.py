"""The coordinator's typed answers: written once at the wire, read back into the same type by a worker."""

from __future__ import annotations

import pytest

from elastic.model import Layout
from elastic.train.rendezvous import Coordinator, RendezvousClient
from elastic.train.rendezvous.messages import Directive
from elastic.train.rendezvous.replies import (
    REPLIES,
    Ack,
    Answer,
    BadReply,
    Beat,
    Decision,
    GaveUpInfo,
    GiveUpAsk,
    Registered,
    read,
    wire,
)
from elastic.train.rendezvous.requests import REQUESTS

D = Directive(
    job="j",
    generation=3,
    layout=Layout.parse("tp1.pp1.dp2"),
    workers=("a", "b"),
    remap=True,
    old_layout=Layout.parse("tp1.pp1.dp1"),
    old_ranks={"a": 0},
    switch_step=9,
    store_host="127.0.0.1",
    store_port=4000,
    join_timeout_s=30.0,
)


@pytest.mark.parametrize(
    ("route", "reply", "body"),
    [
        (
            "register",
            Registered("j", {"model": "tiny"}, 1.0, 15.0),
            {
                "job": "j",
                "config": {"model": "tiny"},
                "heartbeat_interval_s": 1.0,
                "heartbeat_timeout_s": 15.0,
            },
        ),
        ("heartbeat", Beat("running", False, ""), {"phase": "running", "failed": False, "reason": ""}),
        (
            "heartbeat",
            Beat("rescaling", False, "", give_up=GiveUpAsk(2, 8), pending=D, pending_seq=4),
            {
                "phase": "rescaling",
                "failed": False,
                "reason": "",
                "give_up": {"generation": 2, "step": 8},
                "pending": D.to_json(),
                "pending_seq": 4,
            },
        ),
        ("step", Answer("go"), {"action": "go"}),
        ("step", Answer("go", save=True), {"action": "go", "save": True}),
        ("step", Answer("go", pending=D, give_up=8), {"action": "go", "pending": D.to_json(), "give_up": 8}),
        ("step", Answer("switch", directive=D), {"action": "switch", "directive": D.to_json()}),
        (
            "step",
            Answer("stop", "stopped by the controller", save=True),
            {"action": "stop", "reason": "stopped by the controller", "save": True},
        ),
        ("poll", Answer("wait"), {"action": "wait"}),
        ("broken", Answer("hold"), {"action": "hold"}),
        (
            "arrive",
            Decision("go", "", 9, GaveUpInfo(8, 2, True)),
            {
                "decision": "go",
                "reason": "",
                "switch_step": 9,
                "gave_up": {"step": 8, "micro": 2, "kept": True},
            },
        ),
        ("exchanged", Decision("wait"), {"decision": "wait", "reason": ""}),
        ("result", Ack(), {}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_an_answer_is_its_wire_object_and_reads_back(route: str, reply, body: dict) -> None:
    assert wire(reply) == body  # fields that are None are left out
    assert read(route, body) == reply
    assert isinstance(read(route, body), REPLIES[route])


def test_every_route_but_status_has_an_answer_kind() -> None:
    assert set(REPLIES) == set(REQUESTS) - {"status"}


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("step", {}, '"action" is required'),
        ("step", {"action": "jump"}, '"action" must be one of'),
        ("step", {"action": "switch", "directive": {"job": "j"}}, '"directive" does not read as a Directive'),
        ("step", {"action": "switch", "directive": [1]}, '"directive" must be a JSON object'),
        ("heartbeat", {"phase": "running", "failed": "no", "reason": ""}, '"failed" must be true or false'),
        (
            "heartbeat",
            {"phase": "running", "failed": False, "reason": "", "give_up": {"step": 1}},
            '"give_up.generation" is required',
        ),
        ("arrive", {"decision": "maybe"}, '"decision" must be one of'),
        ("register", {"job": "j"}, '"config" is required'),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith('"') else "",
)
def test_an_answer_that_does_not_read_names_the_field(route: str, body: dict, says: str) -> None:
    with pytest.raises(BadReply, match=says.replace("(", r"\(")) as e:
        read(route, body)
    if "required" in says or "must be true" in says:
        assert f"answer to {route}" in str(e.value)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (
            lambda: Answer("jump"),
            'answer: "action" must be one of break, exit, finish, go, hold, join, stop, switch, wait, '
            "got 'jump'",
        ),
        (
            lambda: Decision("maybe"),
            "decision: \"decision\" must be one of abandoned, go, rollback, stop, wait, got 'maybe'",
        ),
    ],
    ids=["answer", "decision"],
)
def test_a_value_out_of_its_closed_set_names_the_kind_field_set_and_value(make, says: str) -> None:
    with pytest.raises(BadReply) as e:
        make()
    assert str(e.value) == says


def test_a_client_asks_for_the_kind_its_route_answers_with() -> None:
    c = Coordinator("j", {"model": "tiny"}).start()
    try:
        cl = RendezvousClient(c.url, "w0", retry_s=2, secret=c.secret)
        reg = cl.ask("register", Registered)
        assert isinstance(reg, Registered) and reg.config == {"model": "tiny"} and reg.job == "j"
        assert cl.ask("poll", Answer).action == "wait"
        with pytest.raises(TypeError, match="poll answers with .*Answer.*, not Decision"):
            cl.ask("poll", Decision)
    finally:
        c.stop()


def test_a_directive_carries_layouts_and_writes_text_only_at_the_wire() -> None:
    body = D.to_json()
    assert (body["layout"], body["old_layout"]) == ("tp1.pp1.dp2", "tp1.pp1.dp1")
    assert (
        Directive.from_json(body) == D
        and Directive.from_json({**body, "old_layout": None}).old_layout is None
    )
    with pytest.raises(TypeError, match=r"Directive.layout: a Layout \(Layout.parse the text\), got str"):
        Directive(**{**body, "workers": ("a", "b"), "old_layout": D.old_layout})
