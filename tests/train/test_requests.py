"""The coordinator's requests, one typed message per route: read once at the wire, refused there
naming the route and the field (an HTTP 400), written back unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from elastic.train.rendezvous import Coordinator
from elastic.train.rendezvous.requests import (
    REQUESTS,
    Arrive,
    BadRequest,
    Broken,
    Exchanged,
    Exit,
    Fail,
    GaveUp,
    Heartbeat,
    PlanInfo,
    Poll,
    Register,
    Request,
    Result,
    SeenCheckpoint,
    Status,
    Step,
    StepReport,
    parse,
)

# every route's request with every field away from its default
FULL: list[Request] = [
    Register(
        "w0", SeenCheckpoint("/ckpt/j/step-00000040-tp1.pp1.dp2", 40, "tp1.pp1.dp2"), pid=4242, host="node-a"
    ),
    Heartbeat("w0", generation=3, building=4, wait_s=1.5, seen=7),
    Poll("w0", wait_s=5.0),
    Step(
        "w0",
        3,
        12,
        StepReport(
            11,
            loss=2.5,
            tokens=256,
            seconds=0.4,
            checkpoint=(10, 3),
            checkpoint_error="disk full",
            memory={"rank": 0, "device_peak": 1024},
        ),
        wait_s=2.0,
        gave_up=GaveUp(12, seconds=0.8, micro=3, kept=True),
    ),
    Arrive(
        "w0",
        4,
        "d1g3st",
        PlanInfo({"w0": 1, "w1": 0}, 1000, 800, 0.25),
        error="MemoryError: no room",
        wait_s=5.0,
    ),
    Result(
        "w0", 4, ok=True, error="none", stats={"bytes_sent": 100, "execute_seconds": 0.5}, checkpoint=(10, 3)
    ),
    Exchanged("w0", 4, wait_s=5.0),
    Fail("w0", "ValueError: bad batch"),
    Broken(
        "w0",
        3,
        12,
        11,
        ready=12,
        dirty=True,
        local_apply=True,
        error="connection reset",
        out_of_memory={"layout": "tp1.pp1.dp2", "rank": 0, "step": 12, "error": "OOM", "memory": None},
    ),
    Exit("w0"),
    Status("w0"),
]

# every route's request with its required fields only (what the least a client may send)
MINIMAL: dict[str, dict] = {
    "register": {"worker": "w0"},
    "heartbeat": {"worker": "w0"},
    "poll": {"worker": "w0"},
    "step": {"worker": "w0", "generation": 1, "step": 0},
    "arrive": {"worker": "w0", "generation": 1},
    "result": {"worker": "w0", "generation": 1},
    "exchanged": {"worker": "w0", "generation": 1},
    "fail": {"worker": "w0"},
    "broken": {"worker": "w0", "generation": 1, "step": 2, "applied": 1},
    "exit": {"worker": "w0"},
    "status": {},
}


def test_the_tables_cover_every_route() -> None:
    assert sorted(type(x).route for x in FULL) == sorted(REQUESTS) == sorted(MINIMAL)
    for x in FULL:  # no field left at its default: the round trip below checks each one
        kind = type(x)
        defaults = kind(**MINIMAL[kind.route]) if kind.route != "status" else kind()
        same = [
            f.name
            for f in dataclasses.fields(x)
            if getattr(x, f.name) == getattr(defaults, f.name) and f.name not in MINIMAL[kind.route]
        ]
        assert same == [], f"{kind.route}: {same} at their defaults"


@pytest.mark.parametrize("message", FULL, ids=lambda x: type(x).route)
def test_every_request_round_trips_through_its_wire_dict_and_json(message: Request) -> None:
    kind = type(message)
    assert kind.from_wire(message.to_wire()) == message
    wire = json.loads(json.dumps(message.to_wire()))  # what crosses the socket
    assert parse(kind.route, wire) == message == parse(f"/v1/{kind.route}", wire)


@pytest.mark.parametrize("route", sorted(MINIMAL))
def test_the_required_fields_alone_make_a_request_and_round_trip(route: str) -> None:
    m = parse(route, MINIMAL[route])
    assert type(m) is REQUESTS[route]
    assert parse(route, m.to_wire()) == m


@pytest.mark.parametrize(
    "route, missing",
    [(route, name) for route, body in MINIMAL.items() for name in body],
)
def test_a_missing_required_field_is_refused_naming_the_route_and_the_field(route: str, missing: str) -> None:
    body = {k: v for k, v in MINIMAL[route].items() if k != missing}
    with pytest.raises(BadRequest, match=rf'^{route}: "{missing}" is required: ') as e:
        parse(route, body)
    assert (e.value.route, e.value.field) == (route, missing)


@pytest.mark.parametrize(
    "route, field, value, message",
    [
        ("step", "generation", "x", "step: \"generation\" must be an integer, got 'x'"),
        ("step", "generation", True, 'step: "generation" must be an integer, got True'),
        ("step", "step", 1.5, 'step: "step" must be an integer, got 1.5'),
        ("step", "generation", None, 'step: "generation" must be an integer, got None'),
        ("register", "worker", 7, 'register: "worker" must be a string, got 7'),
        ("heartbeat", "generation", "3", "heartbeat: \"generation\" must be an integer or null, got '3'"),
        ("heartbeat", "wait_s", "soon", "heartbeat: \"wait_s\" must be a finite number, got 'soon'"),
        ("poll", "wait_s", math.inf, 'poll: "wait_s" must be a finite number, got inf'),
        ("broken", "dirty", "yes", "broken: \"dirty\" must be true or false, got 'yes'"),
        ("broken", "out_of_memory", [1], 'broken: "out_of_memory" must be a JSON object or null, got [1]'),
        ("result", "stats", "fast", "result: \"stats\" must be a JSON object, got 'fast'"),
        ("result", "checkpoint", [3], 'result: "checkpoint" must be a list of 2 integers or null, got [3]'),
        # nested parts name the path to the field
        ("step", "result", {"step": "last"}, "step: \"result.step\" must be an integer, got 'last'"),
        (
            "step",
            "result",
            {"step": 1, "checkpoint": [3, "one"]},
            "step: \"result.checkpoint[1]\" must be an integer, got 'one'",
        ),
        ("step", "result", {"loss": 2.0}, 'step: "result.step" is required: an integer'),
        ("step", "gave_up", 3, 'step: "gave_up" must be a JSON object or null, got 3'),
        (
            "arrive",
            "plan",
            {"new_ranks": {"w0": "first"}},
            "arrive: \"plan.new_ranks.w0\" must be an integer, got 'first'",
        ),
        (
            "arrive",
            "plan",
            {"new_ranks": [0, 1]},
            'arrive: "plan.new_ranks" must be a JSON object of integers, got [0, 1]',
        ),
        (
            "register",
            "checkpoint_latest",
            {"path": "/c", "step": "40", "layout": "tp1.pp1.dp1"},
            "register: \"checkpoint_latest.step\" must be an integer, got '40'",
        ),
    ],
)
def test_a_wrong_type_is_refused_naming_the_route_the_field_and_what_was_expected(
    route, field, value, message
) -> None:
    with pytest.raises(BadRequest) as e:
        parse(route, {**MINIMAL[route], field: value})
    assert str(e.value) == message
    assert e.value.route == route and e.value.field.split(".")[0].split("[")[0] == field


def test_a_huge_bad_value_is_clipped_in_the_message() -> None:
    with pytest.raises(BadRequest, match=r"got 'xxxx.*\(\d+ characters\)$"):
        parse("step", {**MINIMAL["step"], "generation": "x" * 10_000})


@pytest.mark.parametrize("route", ["nope", "/v1/nope", "/v2/step", "", "STEP"])
def test_an_unknown_route_is_refused_naming_it_and_the_routes_there_are(route: str) -> None:
    with pytest.raises(BadRequest, match="no such route \\(the routes are register, heartbeat,") as e:
        parse(route, {"worker": "w0"})
    assert e.value.route == route and e.value.field is None
    c = Coordinator("job", {}, registry=CollectorRegistry())
    with pytest.raises(KeyError):  # the server's 404
        c.handle(route, {"worker": "w0"})


@pytest.mark.parametrize("body", [[1, 2], "worker", None, 3])
def test_a_body_that_is_not_an_object_is_refused(body) -> None:
    with pytest.raises(BadRequest, match="^step: the body must be a JSON object, got "):
        parse("step", body)


def test_nulls_the_clients_send_read_as_the_defaults_and_unknown_fields_are_ignored() -> None:
    # the reference agent sends error=None and a user job plan={} where they have none, every
    # step request result=None; a newer client may send fields this coordinator does not know
    assert parse(
        "arrive",
        {"worker": "w0", "generation": 2, "digest": "d", "plan": None, "error": None, "wait_s": None},
    ) == Arrive("w0", 2, "d")
    assert parse("step", {"worker": "w0", "generation": 1, "step": 0, "result": None}) == Step("w0", 1, 0)
    assert parse("fail", {"worker": "w0", "reason": None}) == Fail("w0", "no reason given")
    assert parse("register", {"worker": "w0", "pid": 1, "host": "h", "gpu": "h100"}) == Register(
        "w0", pid=1, host="h"
    )
    assert parse("step", MINIMAL["step"] | {"wait_s": 3}).wait_s == 3.0  # a JSON integer is a number
    assert math.isnan(parse("step", MINIMAL["step"] | {"result": {"step": 0, "loss": math.nan}}).result.loss)


def test_receive_takes_requests_only() -> None:
    c = Coordinator("job", {"model": "tiny"}, registry=CollectorRegistry())
    assert c.receive(Register("w0")).config == {"model": "tiny"} and c.registered("w0")
    with pytest.raises(TypeError, match="not a coordinator request: dict"):
        c.receive({"worker": "w0"})  # type: ignore[arg-type]


def _post(c: Coordinator, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{c.url}{path}",
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {c.secret}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_malformed_body_gets_a_400_naming_the_field_and_the_job_goes_on() -> None:
    c = Coordinator("job", {"model": "tiny"}, registry=CollectorRegistry()).start()
    try:
        code, out = _post(c, "/v1/register", json.dumps({"worker": "w0"}).encode())
        assert (code, out["config"]) == (200, {"model": "tiny"})
        code, out = _post(c, "/v1/step", json.dumps({"worker": "w0", "generation": "x", "step": 0}).encode())
        assert code == 400 and out == {
            "error": "bad request: step: \"generation\" must be an integer, got 'x'"
        }
        code, out = _post(c, "/v1/heartbeat", json.dumps({"generation": 1}).encode())
        assert code == 400 and '"worker" is required' in out["error"]
        code, out = _post(c, "/v1/step", b"{not json")
        assert code == 400 and "/v1/step: the body is not JSON" in out["error"]
        code, out = _post(c, "/v1/nope", b"{}")
        assert code == 404 and "/v1/nope" in out["error"]
        # nothing of the bad requests reached the state: the job is as it was, and answers on
        assert c.status().phase == "starting" and c.registered("w0")
        code, out = _post(c, "/v1/heartbeat", json.dumps({"worker": "w0", "generation": None}).encode())
        assert (code, out["phase"]) == (200, "starting")
    finally:
        c.stop()
