"""The coordinator's protocol, driven request by request with an injected clock (no processes).

Requests go in as typed messages (``Coordinator.receive``); the HTTP tests check the wire and the
``/metrics`` endpoint.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from elastic.model import Layout, SpecError
from elastic.train.rendezvous import (
    Coordinator,
    CoordinatorSettings,
    Directive,
    JobFailed,
    RendezvousClient,
    RendezvousError,
    RescaleFailed,
)
from elastic.train.rendezvous.replies import read, wire
from elastic.train.rendezvous.requests import parse
from tests.fakes import Clock


def make(**kw) -> tuple[Coordinator, Clock, CollectorRegistry]:
    """A coordinator on a fake clock; ``kw``: its settings (validator= goes to the coordinator)."""
    clock, reg = Clock(1000.0), CollectorRegistry()
    kw.setdefault("heartbeat_timeout_s", 5.0)
    kw.setdefault("join_timeout_s", 10.0)
    validator = kw.pop("validator", None)
    settings = CoordinatorSettings(heartbeat_interval_s=1.0, **kw)
    c = Coordinator("job", {"model": "tiny"}, settings, registry=reg, clock=clock, validator=validator)
    return c, clock, reg


def call(c: Coordinator, route: str, worker: str, **body) -> dict:
    """``worker``'s request to ``route`` as its typed message (no wire: the HTTP tests below have it),
    and the coordinator's typed answer as the JSON object the worker gets; every answer must read
    back as what the coordinator said (the worker's side of the wire)."""
    reply = c.receive(parse(route, {"worker": worker, **body}))
    out = wire(reply)
    if route != "status":
        assert read(route, out) == reply, (route, out)
    return out


def started(workers=("w0", "w1"), layout="tp1.pp1.dp2", **kw) -> tuple[Coordinator, Clock, CollectorRegistry]:
    """A job whose generation 1 runs on ``workers`` (rank = position), at step 1."""
    c, clock, reg = make(**{k: v for k, v in kw.items() if not k.startswith("_")})
    for w in workers:
        call(c, "register", w)
    c.directive(1, layout, list(workers))
    for w in workers:
        assert call(c, "poll", w)["action"] == "join"
    for w in workers:
        out = call(c, "arrive", w, generation=1, digest="")
    assert out["decision"] == "go"
    for w in workers:
        call(c, "result", w, generation=1, ok=True, stats={})
    if not kw.get("_no_steps"):
        run_step(c, workers, 1, 0)
        run_step(c, workers, 1, 1)  # step 0 finished: generation 1 is running, step 1 begun
    return c, clock, reg


def metric(reg: CollectorRegistry, name: str) -> float | None:
    return reg.get_sample_value(name, {"job": "job"})


def run_step(c: Coordinator, workers, gen: int, step: int, loss: float = 2.0) -> list[str]:
    res = {"step": step - 1, "loss": loss, "tokens": 256, "seconds": 0.5} if step > 0 else None
    return [call(c, "step", w, generation=gen, step=step, result=res)["action"] for w in workers]


def spy_waits(cond: threading.Condition) -> tuple[threading.Semaphore, list[bool]]:
    """Spies on a long poll's condition (the coordinator's ``_alarm`` for heartbeats, ``_cv`` for the
    rest): the semaphore is released as a request starts to wait, the list gets what each wait
    returned (True: woken by a notification, False: it ran out its ``wait_s``), so a test tells
    "answered by the event" apart without a clock. The request still holds the lock when it is
    counted: what the test does next takes the lock, so it runs once the request waits."""
    alarm, waiting, ends = cond, threading.Semaphore(0), []
    real = alarm.wait

    def wait(timeout: float | None = None) -> bool:
        waiting.release()
        ends.append(real(timeout))
        return ends[-1]

    alarm.wait = wait  # type: ignore[method-assign]
    return waiting, ends


def test_first_generation_starts_all_members_and_steps_aggregate_into_history_and_metrics() -> None:
    c, _, reg = started(_no_steps=True)
    assert c.status().phase == "starting"
    for s in range(3):
        assert run_step(c, ["w0", "w1"], 1, s, loss=3.0 - s) == ["go", "go"]
    st = c.status()
    assert (st.phase, st.generation, st.layout, st.workers, st.step) == (
        "running", 1, Layout.parse("tp1.pp1.dp2"), ["w0", "w1"], 1)
    assert [r.loss for r in c.history()] == [2.0, 1.0]  # step 0's loss is reported with step 1's request
    assert st.tokens_per_second == pytest.approx(512.0)
    assert metric(reg, "elastic_training_steps_total") == 2
    assert metric(reg, "elastic_training_loss") == 1.0
    assert metric(reg, "elastic_training_world_size") == 2


@pytest.mark.parametrize(
    "begun, lookahead, expected_switch",
    [
        # a member may be inside the highest begun step; its peers must join it -> next boundary + lookahead
        (["w0"], 1, 4),  # w0 began step 2 -> step 3 must run everywhere, prepare during it, switch at 4
        (["w0", "w1"], 0, 3),
        ([], 1, 3),  # both began step 1 only: step 2 still runs (lookahead), switch at 3
    ],
)
def test_switch_step_is_after_the_highest_begun_step(begun, lookahead, expected_switch) -> None:
    c, _, _ = started(lookahead_steps=lookahead)
    for w in begun:
        assert call(c, "step", w, generation=1, step=2)["action"] == "go"
    d = c.directive(2, "tp1.pp1.dp1", ["w0"])
    assert d.switch_step == expected_switch
    assert d.leavers == ("w1",) and d.joiners == ()
    for s in range(2, expected_switch):
        for w in ("w0", "w1"):
            out = call(c, "step", w, generation=1, step=s)
            assert out["action"] == "go"
            assert out.get("pending", {}).get("generation") == 2  # announced early: prepare while stepping
    assert run_step(c, ["w0", "w1"], 1, expected_switch) == ["switch", "switch"]


def test_rescale_goes_when_every_member_arrived_with_the_same_plan_and_records_the_pause() -> None:
    c, clock, reg = started()
    call(c, "register", "w2")
    d = c.directive(2, "tp1.pp1.dp1", ["w2"], remap=False)  # w0, w1 leave; w2 joins
    assert call(c, "poll", "w2")["action"] == "join"
    run_step(c, ["w0", "w1"], 1, 2)
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["switch", "switch"]
    clock.t += 1.0
    plan = {"new_ranks": {"w2": 0}, "planned_bytes": 100, "lower_bound_bytes": 80}
    assert call(c, "arrive", "w0", generation=2, digest="abc", plan=plan)["decision"] == "wait"
    assert call(c, "arrive", "w1", generation=2, digest="abc", plan=plan)["decision"] == "wait"
    assert call(c, "arrive", "w2", generation=2, digest="abc", plan=plan)["decision"] == "go"
    for w, sent in (("w0", 50), ("w1", 50), ("w2", 0)):
        call(c, "result", w, generation=2, ok=True, stats={"bytes_sent": sent})
    clock.t += 0.5
    assert call(c, "step", "w2", generation=2, step=d.switch_step)["action"] == "go"
    assert call(c, "step", "w2", generation=2, step=d.switch_step + 1,
                result={"step": d.switch_step, "loss": 1.5, "tokens": 256, "seconds": 0.2})["action"] == "go"
    rec = c.wait_generation(2, timeout=1)
    assert (rec.ok, rec.bytes_moved, rec.planned_bytes, rec.lower_bound_bytes) == (True, 100, 100, 80)
    assert rec.pause_seconds == pytest.approx(1.5)  # last old member at the boundary -> first new step begun
    assert c.status().workers == ["w2"] and c.status().phase == "running"
    assert metric(reg, "elastic_training_rescales_total") == 1
    assert metric(reg, "elastic_training_last_rescale_pause_seconds") == pytest.approx(1.5)
    assert metric(reg, "elastic_training_reshard_bytes_total") == 100
    assert metric(reg, "elastic_training_last_reshard_lower_bound_bytes") == 80


def test_joiner_that_never_arrives_abandons_the_rescale_before_anything_moves() -> None:
    c, clock, reg = started()
    d = c.directive(2, "tp1.pp1.dp4", ["w0", "w1", "w2", "ghost"], join_timeout_s=10)
    call(c, "register", "w2")
    assert run_step(c, ["w0", "w1"], 1, 2) == ["go", "go"]
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["switch", "switch"]
    for w in ("w0", "w1", "w2"):
        assert call(c, "arrive", w, generation=2, digest="x")["decision"] == "wait"
    for _ in range(3):  # members keep beating while they wait
        clock.t += 3.5
        for w in ("w0", "w1", "w2"):
            call(c, "heartbeat", w)
    c.tick()
    out = call(c, "arrive", "w0", generation=2, digest="x")
    assert out["decision"] == "abandoned" and "ghost" in out["reason"]
    st = c.status()
    assert (st.phase, st.generation, st.layout) == ("running", 1, Layout.parse("tp1.pp1.dp2"))
    assert "ghost" in st.reason and "did not arrive" in st.reason
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["go", "go"]  # the old layout continues
    out = call(c, "poll", "w2")  # a joiner launched for the abandoned rescale leaves instead of idling
    assert out["action"] == "exit" and "ghost" in out["reason"]
    with pytest.raises(RescaleFailed, match="ghost"):
        c.wait_generation(2, timeout=1)
    assert metric(reg, "elastic_training_rescale_failures_total") == 1
    # the same generation number may be tried again, and that try is decided on its own: the
    # first try's "abandoned" must not answer its meeting (the job would switch, hear abandoned,
    # switch again... until the join timeout)
    d2 = c.directive(2, "tp1.pp1.dp1", ["w0"])
    assert run_step(c, ["w0", "w1"], 1, d2.switch_step) == ["switch", "switch"]
    assert call(c, "arrive", "w0", generation=2, digest="y")["decision"] == "wait"
    assert call(c, "arrive", "w1", generation=2, digest="y")["decision"] == "go"  # w1 leaves
    call(c, "result", "w0", generation=2, ok=True, stats={})
    call(c, "result", "w1", generation=2, ok=True, stats={})
    assert call(c, "step", "w0", generation=2, step=d2.switch_step)["action"] == "go"
    assert run_step(c, ["w0"], 2, d2.switch_step + 1) == ["go"]
    st = c.status()
    assert (st.phase, st.generation, st.layout) == ("running", 2, Layout.parse("tp1.pp1.dp1"))


def test_a_joiner_of_an_abandoned_rescale_lost_on_its_way_out_costs_the_job_nothing() -> None:
    # found by benchmarks/train_soak.py --mid-kill-prob: it failed the whole job
    c, _, _ = started(recover=True)
    c.directive(2, "tp1.pp1.dp4", ["w0", "w1", "w2", "w3"])
    for w in ("w2", "w3"):
        call(c, "register", w)
    out = call(c, "arrive", "w2", generation=2, digest="", error="MemoryError: no room")
    assert out["decision"] == "abandoned"
    c.worker_lost("w3", "worker w3 exited with signal 9")  # told to go, killed before its exit notice
    st = c.status()
    assert (st.phase, st.error, st.generation, st.layout) == ("running", None, 1, Layout.parse("tp1.pp1.dp2"))
    assert run_step(c, ["w0", "w1"], 1, 2) == ["go", "go"]


def test_a_plan_for_other_workers_than_the_directives_abandons_the_rescale() -> None:
    # a member still holding the plan of an abandoned try of the same generation number must never
    # make its rank map the job's layout
    c, _, _ = started()
    d = c.directive(2, "tp1.pp1.dp1", ["w0"])
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["switch", "switch"]
    stale = {"new_ranks": {"w0": 0, "w1": 1, "w2": 2, "w3": 3}}
    out = call(c, "arrive", "w0", generation=2, digest="stale", plan=stale)
    assert out["decision"] == "abandoned" and "plan for other workers" in out["reason"]
    st = c.status()
    assert (st.phase, st.generation, st.layout) == ("running", 1, Layout.parse("tp1.pp1.dp2"))


def test_members_with_different_plans_abandon_the_rescale() -> None:
    c, _, _ = started()
    d = c.directive(2, "tp1.pp1.dp1", ["w0"])
    run_step(c, ["w0", "w1"], 1, d.switch_step)
    call(c, "arrive", "w0", generation=2, digest="aaa")
    out = call(c, "arrive", "w1", generation=2, digest="bbb")
    assert out["decision"] == "abandoned" and "different reshard plans" in out["reason"]


def test_lost_heartbeat_fails_the_job_with_the_workers_name_and_stops_the_rest() -> None:
    c, clock, reg = started()
    clock.t += 3.0
    call(c, "heartbeat", "w0")
    clock.t += 3.0  # w1 silent for 6 s > 5 s
    c.tick()
    st = c.status()
    assert st.phase == "failed" and "worker w1 lost: no heartbeat" in (st.error or "")
    assert call(c, "step", "w0", generation=1, step=2)["action"] == "stop"
    assert call(c, "heartbeat", "w0")["failed"] is True
    assert metric(reg, "elastic_training_failed") == 1


@pytest.mark.parametrize(
    "generation, layout, members, match",
    [
        (3, "tp1.pp1.dp1", ["w0"], "expected 2"),
        (2, "tp1.pp1.dp4", ["w0", "w1"], "needs 4 workers"),
        (2, "tp1.pp1.dp2", ["w0", "w0"], "listed twice"),
        (2, "tp1.px1.dp2", ["w0", "w1"], "cannot read 'px1'"),
    ],
)
def test_bad_directives_are_refused_and_change_nothing(generation, layout, members, match) -> None:
    c, _, _ = started()
    before = c.status()
    with pytest.raises(SpecError, match=match):
        c.directive(generation, layout, members)
    assert c.status() == before


def test_second_directive_while_one_is_in_flight_is_refused() -> None:
    c, _, _ = started()
    c.directive(2, "tp1.pp1.dp1", ["w0"])
    with pytest.raises(SpecError, match="still in flight"):
        c.directive(3, "tp1.pp1.dp1", ["w1"])


def test_validator_refuses_before_anything_changes() -> None:
    def no_tp(layout, workers):
        if layout.tp > 1:
            raise SpecError(f"layout {layout}: tp not allowed here")

    c, _, _ = make(validator=no_tp)
    with pytest.raises(SpecError, match="tp not allowed"):
        c.directive(1, "tp2.pp1.dp1", ["w0", "w1"])
    assert c.status().phase == "starting" and c.rescale_record(1) is None


def test_http_round_trip_and_metrics_endpoint() -> None:
    reg = CollectorRegistry()
    c = Coordinator("job", {"model": "tiny", "global_batch": 8}, registry=reg).start()
    try:
        cl = RendezvousClient(c.url, "w0", retry_s=2, secret=c.secret)
        assert cl.call("register")["config"] == {"model": "tiny", "global_batch": 8}
        assert c.registered("w0") and c.store_port > 0
        c.directive(1, "tp1.pp1.dp1", ["w0"])
        assert cl.call("poll")["directive"]["store_port"] == c.store_port
        assert cl.status()["phase"] == "starting"
        req = urllib.request.Request(f"{c.url}/metrics", headers={"Authorization": f"Bearer {c.secret}"})
        text = urllib.request.urlopen(req, timeout=5).read().decode()
        assert 'elastic_training_generation{job="job"}' in text
    finally:
        c.stop()
    with pytest.raises(Exception, match="unreachable"):
        RendezvousClient(c.url, "w0", retry_s=0.2, secret=c.secret).call("heartbeat")


def test_only_holders_of_the_job_secret_are_answered() -> None:
    import urllib.error

    c = Coordinator("job", {"model": "tiny"}, registry=CollectorRegistry()).start()
    try:
        assert len(c.secret) >= 32 and Coordinator("k", {}).secret != c.secret  # one per job
        for secret in (None, "", c.secret[:-1] + ("x" if c.secret[-1] != "x" else "y")):
            with pytest.MonkeyPatch.context() as mp:
                mp.delenv("ELASTIC_JOB_SECRET", raising=False)
                cl = RendezvousClient(c.url, "intruder", retry_s=0.5, secret=secret)
            with pytest.raises(RendezvousError, match="HTTP 401"):
                cl.call("register")
            with pytest.raises(urllib.error.HTTPError, match="401"):
                cl.status()
        assert not c.registered("intruder") and c.status().phase == "starting"
        for path in ("/metrics", "/v1/status"):
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(f"{c.url}{path}", timeout=5)
        # liveness needs no secret and says nothing about the job
        assert json.loads(urllib.request.urlopen(f"{c.url}/healthz", timeout=5).read()) == {"ok": True}
        # the secret handed to workers in their environment is what a client uses by default
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ELASTIC_JOB_SECRET", c.secret)
            assert RendezvousClient(c.url, "w0", retry_s=2).call("register")["config"] == {"model": "tiny"}
    finally:
        c.stop()
    with pytest.raises(SpecError, match="secret: at least 16 characters"):
        Coordinator("job", {}, secret="short")


def test_the_store_listens_on_the_coordinator_host_only() -> None:
    import socket

    c = Coordinator("job", {"model": "tiny"}, registry=CollectorRegistry(), host="127.0.0.1").start()
    try:
        port = c.store_port
        listening = open("/proc/net/tcp").read().splitlines()[1:]
        local = [ln.split()[1] for ln in listening if ln.split()[3] == "0A"]  # state LISTEN
        ours = [a for a in local if int(a.split(":")[1], 16) == port]
        assert ours == ["0100007F:" + f"{port:04X}"], ours  # 127.0.0.1 only, not 0.0.0.0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        c.stop()


def test_signed_store_entries_round_trip_and_forged_ones_are_refused() -> None:
    from elastic.train.rendezvous import sign, verify

    signed = sign("s" * 32, b"payload")
    assert verify("s" * 32, signed, "entry x") == b"payload"
    for bad in (sign("t" * 32, b"payload"), signed[:-1] + b"X", b"short", b"payload"):
        with pytest.raises(RendezvousError, match="entry x in the job's store fails its signature check"):
            verify("s" * 32, bad, "entry x")
    with pytest.raises(RendezvousError, match="ELASTIC_JOB_SECRET is not set"):
        sign(None, b"payload")


def test_a_name_that_left_counts_as_registered_only_once_its_new_process_registers() -> None:
    # a launcher reusing a leaver's name must wait for the new process, not post the directive at
    # once (the pause would then include that process's start: 1.7 s seen on Ray, 2026-12-01)
    c, _, _ = started()
    c.worker_left("w1")
    assert not c.registered("w1")
    call(c, "register", "w1")
    assert c.registered("w1") and not c.has_left("w1")


@pytest.mark.parametrize(
    "order, failing",
    [
        # (arrival order, the member whose plan/prepare failed)
        (["w0", "w1", "w2"], "w0"),  # the first to arrive fails: the others hear at once
        (["w0", "w2", "w1"], "w1"),  # the last old member fails after the joiner waited
        (["w2", "w0", "w1"], "w2"),  # the joiner itself could not prepare
    ],
)
def test_member_that_cannot_prepare_abandons_the_rescale_for_everyone(order, failing) -> None:
    c, _, reg = started()
    call(c, "register", "w2")
    d = c.directive(2, "tp1.pp1.dp4", ["w0", "w1", "w2", "w3"])
    call(c, "register", "w3")
    run_step(c, ["w0", "w1"], 1, 2)
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["switch", "switch"]
    answers = {}
    for w in order:
        err = "ReshardError: staging cap 8 bytes is smaller than one row" if w == failing else ""
        answers[w] = call(c, "arrive", w, generation=2, digest="same", error=err)["decision"]
    # nobody before the failing one got an answer other than wait; from it on, everyone hears abandoned
    first_bad = order.index(failing)
    assert [answers[w] for w in order] == ["wait"] * first_bad + ["abandoned"] * (len(order) - first_bad)
    assert call(c, "arrive", "w3", generation=2, digest="same")["decision"] == "abandoned"
    st = c.status()
    assert (st.phase, st.generation, st.layout, st.error) == ("running", 1, Layout.parse("tp1.pp1.dp2"), None)
    assert f"worker {failing} could not plan or prepare the reshard: ReshardError: staging cap" in st.reason
    assert "nothing moved" in st.reason
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["go", "go"]  # the old layout goes on
    assert call(c, "poll", "w3")["action"] == "exit"  # a joiner that had not heard yet leaves too
    with pytest.raises(RescaleFailed, match=f"worker {failing} could not plan"):
        c.wait_generation(2, timeout=1)
    assert metric(reg, "elastic_training_rescale_failures_total") == 1


def test_long_poll_answers_each_waiting_member_when_the_decision_falls() -> None:
    c, _, _ = started()
    d = c.directive(2, "tp1.pp1.dp1", ["w0"])
    run_step(c, ["w0", "w1"], 1, d.switch_step)
    with ThreadPoolExecutor(1) as pool:
        # w0 arrives first and holds its request open (wait_s) instead of polling
        waiting, _ = spy_waits(c._cv)
        held = pool.submit(call, c, "arrive", "w0", generation=2, digest="d", wait_s=30)
        assert waiting.acquire(timeout=30) and not held.done()
        assert call(c, "arrive", "w1", generation=2, digest="d")["decision"] == "go"
        # answered by the decision: a wait run out (capped at LONG_POLL_MAX_S) answers "wait"
        assert held.result(timeout=30)["decision"] == "go"


def test_long_poll_hands_a_waiting_joiner_its_directive_when_it_is_posted() -> None:
    c, _, _ = started()
    call(c, "register", "w2")
    with ThreadPoolExecutor(1) as pool:
        waiting, _ = spy_waits(c._cv)
        held = pool.submit(call, c, "poll", "w2", wait_s=30)
        assert waiting.acquire(timeout=30) and not held.done()
        c.directive(2, "tp1.pp1.dp1", ["w2"])
        out = held.result(timeout=30)
    assert out["action"] == "join" and out["directive"]["generation"] == 2


@pytest.mark.parametrize(
    "layout, members, expected_switch",
    [
        ("tp1.pp1.dp1", ["w0"], 2),  # a shrink: the boundary after the step in progress (1), no lookahead
        ("tp1.pp1.dp2", ["w1", "w0"], 3),  # the same workers in another rank order: the lookahead step too
        ("tp1.pp1.dp3", ["w0", "w1", "w2"], 3),  # a grow: its joiners' lookahead step
    ],
)
def test_a_shrink_switches_at_the_next_boundary_and_other_rescales_after_their_lookahead(
        layout, members, expected_switch) -> None:
    """``shrink_lookahead_steps=0`` (what LaunchOptions sets): a shrink frees GPUs someone waits for;
    its survivors prepare in the pause. Members still go through every step before the switch."""
    c, _, _ = started(lookahead_steps=1, shrink_lookahead_steps=0)
    if "w2" in members:
        call(c, "register", "w2")
    d = c.directive(2, layout, members, remap=False)
    assert d.switch_step == expected_switch
    for s in range(2, expected_switch):
        assert run_step(c, ["w0", "w1"], 1, s) == ["go", "go"]
    assert run_step(c, ["w0", "w1"], 1, expected_switch) == ["switch", "switch"]


def test_wait_resumed_answers_once_the_new_layout_has_begun_its_first_step_before_that_step_ends() -> None:
    """What a shrink's caller waits for: the pause is over and every member reported its part (the
    leaver is leaving); the first step of the new layout is not waited for. wait_generation still is."""
    c, clock, _ = started(shrink_lookahead_steps=0)
    d = c.directive(2, "tp1.pp1.dp1", ["w0"], remap=False)
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["switch", "switch"]
    clock.t += 1.0
    for w in ("w0", "w1"):
        call(c, "arrive", w, generation=2, digest="d", plan={"new_ranks": {"w0": 0}})
    with pytest.raises(TimeoutError, match="did not begin a step"):
        c.wait_resumed(2, timeout=0.05)  # reshard reported by nobody yet
    for w, sent in (("w0", 0), ("w1", 70)):
        call(c, "result", w, generation=2, ok=True, stats={"bytes_sent": sent})
    clock.t += 0.25
    with ThreadPoolExecutor(1) as pool:
        waiting, _ = spy_waits(c._cv)
        fut = pool.submit(c.wait_resumed, 2, 5.0)
        assert waiting.acquire(timeout=30) and not fut.done()  # every part moved, the new layout not training yet
        assert call(c, "step", "w0", generation=2, step=d.switch_step)["action"] == "go"
        rec = fut.result(timeout=30)  # woken by the first step's begin (its 5 s timeout would raise)
    assert (rec.ok, rec.bytes_moved, rec.leavers) == (None, 70, ["w1"])
    assert rec.pause_seconds == pytest.approx(1.25)
    with pytest.raises(TimeoutError):
        c.wait_generation(2, timeout=0.05)  # its first step has not finished
    call(c, "step", "w0", generation=2, step=d.switch_step + 1,
         result={"step": d.switch_step, "loss": 1.5, "tokens": 256, "seconds": 0.2})
    assert c.wait_generation(2, timeout=1).ok is True
    assert c.wait_resumed(2, timeout=1).ok is True  # a completed generation answers as wait_generation


def test_a_negative_lookahead_is_refused() -> None:
    with pytest.raises(SpecError, match="shrink_lookahead_steps=-1.*>= 0"):
        make(shrink_lookahead_steps=-1)


@pytest.mark.parametrize(
    "max_steps, outcome",
    [
        # started() leaves both members at step 1 (begun); lookahead 1 -> switch at step 3
        (3, "refused"),  # step 3 would be the switch, but the job's last step is 2
        (4, "completes"),  # one step (3) on the new layout, then finish
        (10, "completes"),
    ],
)
def test_rescale_near_max_steps_either_completes_or_is_refused(max_steps, outcome) -> None:
    c, _, _ = started(max_steps=max_steps)
    if outcome == "refused":
        before = c.status()
        with pytest.raises(SpecError, match=rf"would switch at step 3 .* max_steps={max_steps}"):
            c.directive(2, "tp1.pp1.dp1", ["w0"])
        assert c.status() == before and c.rescale_record(2) is None
        assert run_step(c, ["w0", "w1"], 1, 2) == ["go", "go"]
        assert run_step(c, ["w0", "w1"], 1, 3) == ["finish", "finish"]
        assert c.status().phase == "finished"
        return
    d = c.directive(2, "tp1.pp1.dp1", ["w0"])
    assert d.switch_step == 3 < max_steps
    run_step(c, ["w0", "w1"], 1, 2)
    assert run_step(c, ["w0", "w1"], 1, 3) == ["switch", "switch"]
    for w in ("w0", "w1"):
        call(c, "arrive", w, generation=2, digest="d", plan={"new_ranks": {"w0": 0}})
        call(c, "result", w, generation=2, ok=True, stats={})
    step = 3
    while call(c, "step", "w0", generation=2, step=step,
               result={"step": step - 1, "loss": 1.0, "tokens": 256, "seconds": 0.1} if step > 3 else None
               )["action"] == "go":
        step += 1
    assert step == max_steps and c.status().phase == "finished"
    rec = c.wait_generation(2, timeout=1)  # completed: the new layout ran its steps before the end
    assert rec.ok is True


def test_wait_generation_never_hangs_on_a_finished_job() -> None:
    c, _, _ = started(max_steps=2)
    assert run_step(c, ["w0", "w1"], 1, 2) == ["finish", "finish"]
    t0 = time.monotonic()
    with pytest.raises(JobFailed, match="is finished"):
        c.wait_generation(2, timeout=5)
    assert time.monotonic() - t0 < 4  # answered by the phase, not by the timeout


def _pause(c: Coordinator, clock: Clock, keepers=("k0",), workers=("w0", "w1"), gen: int = 2):
    """Post a hold directive moving generation ``gen - 1`` into ``keepers`` and run it to its end."""
    for k in keepers:
        call(c, "register", k)
    d = c.directive(gen, "tp1.pp1.dp1", list(keepers), hold=True)
    assert d.hold and d.joiners == tuple(sorted(keepers)) and set(d.leavers) == set(workers)
    for k in keepers:
        assert call(c, "poll", k)["action"] == "join"
    run_step(c, workers, gen - 1, d.switch_step - 1)
    assert run_step(c, workers, gen - 1, d.switch_step) == ["switch"] * len(workers)
    clock.t += 0.25
    plan = {"new_ranks": {k: i for i, k in enumerate(keepers)}, "planned_bytes": 100, "lower_bound_bytes": 100}
    for m in d.members:
        call(c, "arrive", m, generation=gen, digest="x", plan=plan)
    for m in d.members:
        call(c, "result", m, generation=gen, ok=True, stats={"bytes_sent": 100 if m in workers[:1] else 0})
    return d


def test_a_held_generation_pauses_the_job_until_the_next_directive_and_resumes_at_the_same_step() -> None:
    c, clock, reg = started()
    d = _pause(c, clock)
    rec = c.wait_generation(2, timeout=1)  # a hold completes without a step: nothing will step
    assert (rec.ok, rec.hold, rec.bytes_moved, rec.pause_seconds) == (True, True, 100, pytest.approx(0.25))
    st = c.status()
    assert (st.phase, st.workers, st.layout, st.step) == (
        "paused", ["k0"], Layout.parse("tp1.pp1.dp1"), d.switch_step - 1)
    assert "paused at step" in st.reason
    assert (metric(reg, "elastic_training_paused"), metric(reg, "elastic_training_world_size")) == (1, 0)
    assert metric(reg, "elastic_training_rescales_total") == 0  # a pause is not a rescale; its bytes count
    assert metric(reg, "elastic_training_reshard_bytes_total") == 100
    # the keeper asks before the step it sits at and is told to hold (after the long poll, here none)
    assert call(c, "step", "k0", generation=2, step=d.switch_step)["action"] == "hold"
    with pytest.raises(SpecError, match="paused already"):
        c.directive(3, "tp1.pp1.dp1", ["k1"], hold=True)
    # resume on two new workers: the switch is the step the keeper sits at (no lookahead: it steps nothing)
    for w in ("w5", "w6"):
        call(c, "register", w)
    r = c.directive(3, "tp2.pp1.dp1", ["w5", "w6"])
    assert (r.switch_step, r.old_ranks, r.leavers, r.hold) == (d.switch_step, {"k0": 0}, ("k0",), False)
    assert call(c, "step", "k0", generation=2, step=d.switch_step)["action"] == "switch"
    for m in r.members:
        call(c, "arrive", m, generation=3, digest="y", plan={"new_ranks": {"w5": 0, "w6": 1}})
    for m in r.members:
        call(c, "result", m, generation=3, ok=True, stats={"bytes_sent": 100 if m == "k0" else 0})
    clock.t += 0.5
    assert [call(c, "step", w, generation=3, step=d.switch_step)["action"] for w in ("w5", "w6")] == ["go", "go"]
    assert run_step(c, ["w5", "w6"], 3, d.switch_step + 1) == ["go", "go"]
    assert c.rescale_record(3).pause_seconds == pytest.approx(0.5)  # keeper at the boundary -> training again
    assert c.wait_generation(3, timeout=1).ok
    st = c.status()
    assert (st.phase, st.workers, st.step) == ("running", ["w5", "w6"], d.switch_step)
    assert [h.step for h in c.history()] == list(range(d.switch_step + 1))  # no step lost, none repeated
    assert (metric(reg, "elastic_training_paused"), metric(reg, "elastic_training_world_size")) == (0, 2)
    assert metric(reg, "elastic_training_rescales_total") == 1


def test_a_held_job_can_be_stopped_and_an_abandoned_resume_leaves_it_paused() -> None:
    c, clock, _ = started()
    d = _pause(c, clock)
    c.wait_generation(2, timeout=1)
    call(c, "register", "w9")
    c.directive(3, "tp1.pp1.dp1", ["w9"], join_timeout_s=5)
    assert call(c, "step", "k0", generation=2, step=d.switch_step)["action"] == "switch"
    call(c, "arrive", "k0", generation=2 + 1, digest="y")
    clock.t += 6  # the joiner never arrives (the keeper keeps beating)
    call(c, "heartbeat", "k0")
    c.tick()
    assert c.status().phase == "paused" and c.status().workers == ["k0"]
    assert call(c, "step", "k0", generation=2, step=d.switch_step)["action"] == "hold"
    c.request_stop("done for today")
    assert call(c, "step", "k0", generation=2, step=d.switch_step)["action"] == "stop"


def test_hold_is_refused_for_a_job_with_nothing_to_keep() -> None:
    c, _, _ = make()
    with pytest.raises(SpecError, match="has not started"):
        c.directive(1, "tp1.pp1.dp1", ["k0"], hold=True)


# ---- recovery from surviving replicas ---------------------------------------------------------

W4 = ("w0", "w1", "w2", "w3")  # tp1.pp2.dp2: w0 (dp0, pp0), w1 (dp1, pp0), w2 (dp0, pp1), w3 (dp1, pp1)


def _res(step: int) -> dict:
    return {"step": step, "loss": 1.0, "tokens": 256, "seconds": 0.2}


def test_a_lost_worker_is_recovered_from_the_surviving_replica_at_the_step_they_all_reach() -> None:
    c, clock, reg = started(workers=W4, layout="tp1.pp2.dp2", recover=True)
    run_step(c, W4, 1, 2)
    run_step(c, W4, 1, 3)  # steps 0..2 on record; everyone is inside step 3
    c.worker_lost("w3", "worker w3 exited with code -9")
    st = c.status()
    assert st.phase == "recovering" and "w3 exited" in st.reason
    # w0 and w2 passed step 3's commit (they report its result); w1 broke inside the commit
    assert call(c, "step", "w0", generation=1, step=4, result=_res(3))["action"] == "break"
    call(c, "broken", "w0", generation=1, step=4, applied=3, ready=None, dirty=False, local_apply=True)
    call(c, "step", "w2", generation=1, step=4, result=_res(3))
    call(c, "broken", "w2", generation=1, step=4, applied=3, ready=None, dirty=False, local_apply=True)
    assert c.status().last_rescale.generation == 1  # not posted until every survivor reported
    clock.t += 0.3
    call(c, "broken", "w1", generation=1, step=3, applied=2, ready=3, dirty=False, local_apply=True)
    rec = c.rescale_record(2)
    assert rec is not None and "lost w3" in rec.recovery
    # the intact replica (w0, w2) keeps the model-parallel split; w1 sends what it holds and leaves
    out = call(c, "step", "w1", generation=1, step=3)
    assert out["action"] == "switch"
    d = out["directive"]
    assert (d["layout"], d["workers"], d["commit_step"], d["switch_step"]) == ("tp1.pp2.dp1", ["w0", "w2"], 3, 4)
    assert d["old_ranks"] == {"w0": 0, "w1": 1, "w2": 2}  # w3 holds nothing any more
    for w in ("w0", "w2"):
        assert call(c, "step", w, generation=1, step=4)["action"] == "switch"
    for w in ("w0", "w1", "w2"):
        call(c, "arrive", w, generation=2, digest="r", plan={"new_ranks": {"w0": 0, "w2": 1}})
    for w in ("w0", "w1", "w2"):
        call(c, "result", w, generation=2, ok=True, stats={})
    clock.t += 0.2
    for w in ("w0", "w2"):  # the first step of a generation carries no result
        assert call(c, "step", w, generation=2, step=4)["action"] == "go"
    run_step(c, ["w0", "w2"], 2, 5)
    rec = c.wait_generation(2, timeout=1)
    assert rec.ok and rec.pause_seconds == pytest.approx(0.5)  # from the loss to the first step again
    st = c.status()
    assert (st.phase, st.workers, st.layout) == ("running", ["w0", "w2"], Layout.parse("tp1.pp2.dp1"))
    assert st.reason.startswith("recovered (lost w3")
    assert [h.step for h in c.history()] == [0, 1, 2, 3, 4]  # step 3 on record from the survivors' reports
    assert c.lost_workers() == ["w3"]
    assert metric(reg, "elastic_training_recoveries_total") == 1 and metric(reg, "elastic_training_failed") == 0


def test_the_backends_runtime_reports_a_recovery_nobody_asked_for_once_it_is_done() -> None:
    """What the Ray and Kubernetes backends hand the controller (``coordinator_runtime``) after the
    coordinator recovered on its own: fewer GPUs, the lost worker and the layout before."""
    from elastic.backends.base import coordinator_runtime, still_held
    from elastic.model import GPU

    c, clock, _ = started(recover=True)  # tp1.pp1.dp2 on w0, w1; inside step 1
    gpus = {GPU("n0", 0): "w0", GPU("n0", 1): "w1"}
    assert coordinator_runtime("job", c.status(), gpus, None).recovery == ""
    c.worker_lost("w1", "worker w1 exited with code -9")
    call(c, "broken", "w0", generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
    assert coordinator_runtime("job", c.status(), gpus, None).phase == "Recovering"
    assert call(c, "step", "w0", generation=1, step=1)["action"] == "switch"
    call(c, "arrive", "w0", generation=2, digest="r", plan={"new_ranks": {"w0": 0}})
    call(c, "result", "w0", generation=2, ok=True, stats={})
    clock.t += 0.25
    call(c, "step", "w0", generation=2, step=1)
    run_step(c, ["w0"], 2, 2)
    st = c.status()
    rt = coordinator_runtime("job", st, still_held(gpus, st.workers), None)
    assert (rt.phase, rt.layout, rt.gpus, rt.generation) == ("Running", Layout.parse("tp1.pp1.dp1"), (GPU("n0", 0),), 2)
    assert "lost w1" in rt.recovery and rt.recovered_from == Layout.parse("tp1.pp1.dp2")
    assert rt.last_pause_seconds == pytest.approx(0.25)


def test_a_heartbeat_long_polls_and_tells_a_survivor_still_computing_to_give_its_step_up() -> None:
    c, clock, _ = started(workers=W4, layout="tp1.pp1.dp4", recover=True)
    # nothing to say: a beat without a generation or a wait answers at once, without interrupt
    assert "interrupt" not in call(c, "heartbeat", "w0")
    # w0 long-polls its beat while computing step 1; w3 dies meanwhile: w0 is answered at once
    waiting, ends = spy_waits(c._alarm)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(call, c, "heartbeat", "w0", generation=1, wait_s=4.0)
        assert waiting.acquire(timeout=30) and not fut.done()  # long-polling
        c.worker_lost("w3", "worker w3 exited with code -9")
        out = fut.result(timeout=30)  # its wait ends by itself after 4 s: the spy says which ended it
    assert out["interrupt"] == 1 and ends == [True]  # woken by the loss, not its wait running out
    assert call(c, "heartbeat", "w1", generation=1, wait_s=4.0)["interrupt"] == 1 and ends == [True]  # no wait
    # the lost worker, a stale generation and a survivor that reported are not interrupted
    assert "interrupt" not in call(c, "heartbeat", "w0", generation=0)
    call(c, "broken", "w1", generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
    assert "interrupt" not in call(c, "heartbeat", "w1", generation=1)
    for w in ("w0", "w2"):
        call(c, "broken", w, generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
    assert c.rescale_record(2) is not None  # posted: nobody is interrupted any more
    assert "interrupt" not in call(c, "heartbeat", "w0", generation=1)
    # nor told to prepare it beside a step: the survivors are broken, it comes as their switch
    assert "pending" not in call(c, "heartbeat", "w0", generation=1, seen=0)


@pytest.mark.parametrize("layout, workers, why", [
    ("tp2.pp1.dp1", ("w0", "w1"), "no replica"),  # a TP shard has no second copy
    ("tp1.pp1.dp2.z1", ("w0", "w1"), "zero"),  # ZeRO-1: the lost rank's optimizer slice is gone
])
def test_a_loss_without_a_surviving_copy_fails_the_job(layout, workers, why) -> None:
    c, _, reg = started(workers=workers, layout=layout, recover=True)
    c.worker_lost("w1", "worker w1 exited with code -9")
    st = c.status()
    assert st.phase == "failed" and st.error == "worker w1 exited with code -9", why
    assert metric(reg, "elastic_training_failed") == 1


@pytest.mark.parametrize("lost, workers, error", [
    # tp2.pp1.dp2: w0 (tp0, dp0), w1 (tp1, dp0), w2 (tp0, dp1), w3 (tp1, dp1)
    (("w1", "w2"), ["w0", "w3"], None),  # two broken replicas make one whole: each keeps its shard
    (("w1", "w3"), None, "no survivor holds tp rank 1, pp rank 0"),  # both copies of tp rank 1 gone
])
def test_a_recovery_takes_one_survivor_of_every_shard_or_fails_naming_the_shard_none_holds(lost, workers, error):
    c, _, _ = started(workers=W4, layout="tp2.pp1.dp2", recover=True)
    for w in lost:
        c.worker_lost(w, f"worker {w} exited with code -9")
    for w in sorted(set(W4) - set(lost)):
        call(c, "broken", w, generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
    st = c.status()
    if error is not None:
        assert st.phase == "failed" and error in st.error, st.error
        assert c.rescale_record(2) is None  # nothing posted that the survivors could not fill
        return
    d = call(c, "step", "w0", generation=1, step=1)["directive"]
    assert (d["layout"], d["workers"]) == ("tp2.pp1.dp1", workers)  # in the new rank order: tp0, then tp1


def test_recovery_candidates_put_intact_replicas_first_and_members_keep_their_shards() -> None:
    from elastic.train.rendezvous.recovery import recovery_candidates, recovery_members

    old = Layout.parse("tp2.pp2.dp3")  # rank = t + 2 * (d + 3 * p)
    ranks = {f"w{r}": r for r in range(12)}
    survivors = {w: r for w, r in ranks.items() if w not in ("w0", "w9")}  # replica 0 lost (t0, p0), replica 1 (t1, p1)
    cand, missing = recovery_candidates(old, survivors)
    assert missing == []
    # replica 2 (w4, w5, w10, w11) is the intact one: its workers come first for every shard
    assert cand == {(0, 0): ["w4", "w2"], (1, 0): ["w5", "w1", "w3"], (0, 1): ["w10", "w6", "w8"],
                    (1, 1): ["w11", "w7"]}
    two = recovery_members(old, Layout.parse("tp2.pp2.dp2"), cand)
    assert two == ["w4", "w5", "w2", "w1", "w10", "w11", "w6", "w7"]
    new = Layout.parse("tp2.pp2.dp2")
    for pos, w in enumerate(two):  # each member's new coordinate is the one of the shard it holds
        t, _, p = new.coords(pos)
        assert old.coords(ranks[w])[0::2] == (t, p)
    assert recovery_candidates(old, {w: r for w, r in survivors.items() if r % 2 == 0})[1] == [
        "tp rank 1, pp rank 0", "tp rank 1, pp rank 1"]


def test_recovery_refuses_inconsistent_or_unlost_states_and_gives_silent_survivors_up() -> None:
    # every worker reports back alive: no worker was lost, a retry would repeat the fault
    c, _, _ = started(workers=W4, layout="tp1.pp2.dp2", recover=True)
    for w in W4:
        call(c, "broken", w, generation=1, step=2, applied=1, ready=None, dirty=False, local_apply=True)
    assert c.status().phase == "failed" and "no worker was lost" in c.status().error
    # a survivor broke inside an optimizer update: its state is at two steps
    c, _, _ = started(workers=W4, layout="tp1.pp2.dp2", recover=True)
    c.worker_lost("w3", "gone")
    for w, dirty in (("w0", False), ("w1", True), ("w2", False)):
        call(c, "broken", w, generation=1, step=2, applied=1, ready=None, dirty=dirty, local_apply=True)
    assert c.status().phase == "failed" and "inside an optimizer update" in c.status().error
    # a member silent for a few heartbeats during a recovery is dead, launcher or not
    c, clock, _ = started(workers=W4, layout="tp1.pp2.dp2", recover=True, recovery_timeout_s=30)
    c.worker_lost("w3", "gone")
    for w in ("w0", "w2"):
        call(c, "broken", w, generation=1, step=2, applied=1, ready=None, dirty=False, local_apply=True)
    clock.t += 2
    c.tick()
    assert c.lost_workers() == ["w3"]  # 2 s < 2.5 heartbeats: w1 may still be alive
    clock.t += 1
    for w in ("w0", "w2"):
        call(c, "heartbeat", w)
    c.tick()
    assert c.lost_workers() == ["w1", "w3"]
    d = c.status()
    assert d.phase == "recovering" and c.rescale_record(2).workers == ["w0", "w2"]
    assert call(c, "step", "w1", generation=1, step=2)["action"] == "stop"
    # a survivor that never reports (it beats, but its main thread is stuck) is given up at the timeout
    c, clock, _ = started(workers=W4, layout="tp1.pp2.dp2", recover=True, recovery_timeout_s=3)
    c.worker_lost("w3", "gone")
    for w in ("w0", "w2"):
        call(c, "broken", w, generation=1, step=2, applied=1, ready=None, dirty=False, local_apply=True)
    for _ in range(4):
        clock.t += 1
        for w in ("w0", "w1", "w2"):
            call(c, "heartbeat", w)
        c.tick()
    assert c.lost_workers() == ["w1", "w3"] and c.rescale_record(2).workers == ["w0", "w2"]


def test_a_joiner_lost_before_its_rescale_began_calls_the_rescale_off_not_the_job() -> None:
    c, _, reg = started(recover=True)
    call(c, "register", "w2")
    c.worker_lost("w9", "worker w9 exited with code 1")  # launched for a directive not posted yet
    assert c.status().phase == "running"
    d = c.directive(2, "tp1.pp1.dp3", ["w0", "w1", "w2"])
    c.worker_lost("w2", "worker w2 exited with code 1")  # the joiner dies while starting
    st = c.status()
    assert st.phase == "running" and st.generation == 1 and "joiner lost before the rescale began" in st.reason
    with pytest.raises(RescaleFailed, match="joiner lost"):
        c.wait_generation(2, timeout=1)
    assert run_step(c, ["w0", "w1"], 1, d.switch_step) == ["go", "go"]  # training goes on, no switch
    assert metric(reg, "elastic_training_failed") == 0


def test_a_worker_lost_while_the_first_generation_starts_fails_the_job() -> None:
    c, _, _ = make(recover=True)
    c.directive(1, "tp1.pp1.dp2", ["w0", "w1"])
    c.worker_lost("w1", "worker w1 exited with code 1")
    assert c.status().phase == "failed" and "could not start" in c.status().error


# ---- a rescale that loses a member before its commit rolls back ----------------------------------

def _to_commit(c: Coordinator, d, old=("w0", "w1")) -> None:
    """Old members reach the switch, every member arrives with the same plan: bytes move."""
    run_step(c, list(old), 1, 2)
    assert set(run_step(c, list(old), 1, d.switch_step)) == {"switch"}
    out = [call(c, "arrive", w, generation=d.generation, digest="x")["decision"] for w in d.members]
    assert out[-1] == "go"


def test_a_rescale_of_a_replicated_job_commits_once_every_member_exchanged_its_part() -> None:
    c, clock, reg = started(recover=True)
    for w in ("w2", "w3"):
        call(c, "register", w)
    d = c.directive(2, "tp1.pp1.dp4", list(W4))
    assert d.rollback  # replicas without ZeRO: a loss before the commit can go back
    _to_commit(c, d)
    for w in ("w0", "w1", "w2"):
        assert call(c, "exchanged", w, generation=2)["decision"] == "wait"
    with ThreadPoolExecutor(1) as pool:  # a member long-polls at the commit and hears go when the last one is in
        waiting = pool.submit(call, c, "exchanged", "w0", generation=2, wait_s=5)
        time.sleep(0.1)
        assert call(c, "exchanged", "w3", generation=2)["decision"] == "go"
        assert waiting.result(timeout=5)["decision"] == "go"
    # without recovery, or with ZeRO-1 (the optimizer state has one copy), nothing could go back to
    c2, _, _ = started()
    assert not c2.directive(2, "tp1.pp1.dp1", ["w0"]).rollback
    c3, _, _ = started(layout="tp1.pp1.dp2.z1", recover=True)
    assert not c3.directive(2, "tp1.pp1.dp1", ["w0"]).rollback


@pytest.mark.parametrize("rendezvous_timeout_s, outcome", [(None, "given-up"), (60.0, "recovered")])
def test_a_survivor_blocked_in_a_groups_rendezvous_is_waited_for_until_its_timeout(rendezvous_timeout_s,
                                                                                  outcome) -> None:
    # A peer lost between the roll call and its part of gloo's C++ rendezvous leaves the others
    # blocked there until pg_timeout_s (nothing in Python can give it up). They still beat, saying
    # they build groups; given up after recovery_timeout_s (< pg_timeout_s) the job failed: seen by
    # benchmarks/train_soak.py --mid-kill-prob in 2 of 73 mid-rescale kills.
    c, clock, _ = started(recover=True, rendezvous_timeout_s=rendezvous_timeout_s)
    for w in ("w2", "w3"):
        call(c, "register", w)
    d = c.directive(2, "tp1.pp1.dp4", list(W4))
    _to_commit(c, d)
    call(c, "exchanged", "w0", generation=2)
    c.worker_lost("w3", "worker w3 exited with code -9")  # a joiner, mid-exchange: roll back
    assert c.status().phase == "recovering"
    call(c, "broken", "w0", generation=1, step=d.switch_step, applied=d.switch_step - 1, ready=None,
         dirty=False, local_apply=True)
    call(c, "broken", "w2", generation=2, step=d.switch_step, applied=-1, ready=None, dirty=False,
         local_apply=False)
    seconds = 40 if outcome == "recovered" else 7  # past recovery_timeout_s (5 s here) either way
    for _ in range(seconds):  # w1 sits in the rendezvous of generation 2's group, beating
        clock.t += 1.0
        call(c, "heartbeat", "w1", generation=1, building=2)
        call(c, "heartbeat", "w0", generation=1)
        c.tick()
    if outcome == "given-up":
        # the old behaviour: a live worker given up (killed by its launcher); here its state had a
        # replica, with tp/pp the job had nothing to recover from and failed
        assert "w1" in c.lost
        out = call(c, "step", "w0", generation=1, step=d.switch_step)
        assert out["action"] == "switch" and out["directive"]["workers"] == ["w0"], out
        return
    assert c.status().phase == "recovering" and "w1" not in c.lost
    # its rendezvous times out: it reports from the old state it kept whole, and the job recovers
    call(c, "broken", "w1", generation=1, step=d.switch_step, applied=d.switch_step - 1, ready=None,
         dirty=False, local_apply=True)
    out = call(c, "step", "w0", generation=1, step=d.switch_step)
    assert out["action"] == "switch" and out["directive"]["workers"] == ["w0", "w1"], out


@pytest.mark.parametrize("layout, rendezvous_timeout_s, reports_after, outcome", [
    # tp2.pp1.dp2 (w0: tp0 dp0, w1: tp1 dp0, w2: tp0 dp1, w3: tp1 dp1), w3 lost: w1 holds the only
    # copy of tp rank 1 left, and its step is stuck in a collective until pg_timeout_s
    ("tp2.pp1.dp2", 60.0, 40, ["w0", "w1"]),  # waited for beyond recovery_timeout_s: it reports, the job recovers
    ("tp2.pp1.dp2", 60.0, None, "failed"),  # it never reports: given up at rendezvous_timeout_s + recovery_timeout_s
    ("tp2.pp1.dp2", None, None, "failed"),  # no timeout known for its collectives: given up at recovery_timeout_s
    # tp1.pp1.dp4: every survivor holds everything; the stuck one is not waited for
    ("tp1.pp1.dp4", 60.0, None, ["w0", "w2"]),
])
def test_a_beating_survivor_stuck_in_a_collective_is_waited_for_only_while_it_holds_a_shard_no_other_has(
        layout, rendezvous_timeout_s, reports_after, outcome) -> None:
    c, clock, _ = started(workers=W4, layout=layout, recover=True, rendezvous_timeout_s=rendezvous_timeout_s)
    c.worker_lost("w3", "worker w3 exited with code -9")
    for w in ("w0", "w2"):
        call(c, "broken", w, generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
    waited = 0
    for second in range(80):  # recovery_timeout_s is 5 s here
        if c.status().phase != "recovering" or c.rescale_record(2) is not None:
            break
        if second == reports_after:  # its collective timed out: it reports what it holds
            call(c, "broken", "w1", generation=1, step=1, applied=0, ready=None, dirty=False, local_apply=True)
            continue
        clock.t += 1.0
        waited += 1
        for w in ("w0", "w1", "w2"):  # w1's heartbeat thread beats on while its step is stuck
            call(c, "heartbeat", w, generation=1)
        c.tick()
    if outcome == "failed":
        st = c.status()
        assert st.phase == "failed" and "no survivor holds tp rank 1, pp rank 0" in st.error, st.error
        assert "w1" in c.lost
        assert waited == (66 if rendezvous_timeout_s else 6)  # past 60 + 5 s, or past 5 s
        return
    d = call(c, "step", "w0", generation=1, step=1)["directive"]
    assert d["workers"] == outcome, d
    assert ("w1" in c.lost) == ("w1" not in outcome)
    assert waited == (reports_after if reports_after is not None else 6)


def test_a_survivor_that_stops_beating_in_a_rendezvous_is_given_up_as_before() -> None:
    c, clock, _ = started(recover=True, rendezvous_timeout_s=60.0)
    for w in ("w2", "w3"):
        call(c, "register", w)
    d = c.directive(2, "tp1.pp1.dp4", list(W4))
    _to_commit(c, d)
    call(c, "heartbeat", "w1", generation=1, building=2)
    c.worker_lost("w3", "worker w3 exited with code -9")
    call(c, "broken", "w0", generation=1, step=d.switch_step, applied=d.switch_step - 1, ready=None,
         dirty=False, local_apply=True)
    for _ in range(20):  # w1 beats no more: silent for 2.5 beats is dead, building or not
        clock.t += 1.0
        call(c, "heartbeat", "w0", generation=1)
        c.tick()
    assert c.status().phase in ("failed", "recovering")
    assert "w1" in c.lost


def test_a_member_lost_before_the_commit_rolls_the_job_back_and_it_recovers_on_the_old_generation() -> None:
    c, clock, reg = started(recover=True)
    for w in ("w2", "w3"):
        call(c, "register", w)
    d = c.directive(2, "tp1.pp1.dp4", list(W4))
    _to_commit(c, d)
    for w in ("w0", "w2"):  # their part is done: they wait at the commit
        assert call(c, "exchanged", w, generation=2)["decision"] == "wait"
    assert "abort" not in call(c, "heartbeat", "w1", generation=1, building=2)  # building its groups: go on
    with ThreadPoolExecutor(1) as pool:  # w1 long-polls while it waits for a peer at the group's door
        beat = pool.submit(call, c, "heartbeat", "w1", generation=1, building=2, wait_s=4.0)
        time.sleep(0.3)
        c.worker_lost("w3", "worker w3 exited with code -9")  # a joiner, mid-exchange
        answer = beat.result(timeout=2)  # at once, not after 4 s
    assert answer["abort"] == 2 and "rolled back to generation 1" in answer["abort_reason"], answer
    assert "abort" not in call(c, "heartbeat", "w1", generation=1)  # not building anything: nothing to give up
    st = c.status()
    assert (st.phase, st.generation, st.layout) == ("recovering", 1, Layout.parse("tp1.pp1.dp2"))
    failed = c.rescale_record(2)
    assert failed.ok is False and "rolled back to generation 1" in failed.reason and "w3" in failed.reason
    with pytest.raises(RescaleFailed, match="rolled back"):
        c.wait_generation(2, timeout=1)
    assert metric(reg, "elastic_training_rescale_failures_total") == 1
    with pytest.raises(SpecError, match="recovering"):  # nothing new until the job runs again
        c.directive(2, "tp1.pp1.dp1", ["w0"])
    # the commit answers rollback; the joiner that had no old state is told to stop
    assert call(c, "exchanged", "w0", generation=2)["decision"] == "rollback"
    assert call(c, "broken", "w2", generation=2, step=d.switch_step, applied=-1, ready=None, dirty=False,
                local_apply=False)["action"] == "stop"
    # the old members report from the old state they kept whole
    for w in ("w0", "w1"):
        out = call(c, "broken", w, generation=1, step=d.switch_step, applied=d.switch_step - 1, ready=None,
                   dirty=False, local_apply=True)
        assert out["action"] == "hold"
    out = call(c, "step", "w0", generation=1, step=d.switch_step)
    assert out["action"] == "switch"
    r = out["directive"]
    # a fresh generation number (2 was the rolled-back rescale's), the old layout on every old member
    assert (r["generation"], r["layout"], r["workers"], r["old_layout"]) == (3, "tp1.pp1.dp2", ["w0", "w1"],
                                                                            "tp1.pp1.dp2")
    assert r["switch_step"] == d.switch_step and r["old_ranks"] == {"w0": 0, "w1": 1}
    assert "rescale to generation 2 broke" in c.rescale_record(3).recovery
    assert call(c, "step", "w1", generation=1, step=d.switch_step)["action"] == "switch"
    for w in ("w0", "w1"):
        call(c, "arrive", w, generation=3, digest="r", plan={"new_ranks": {"w0": 0, "w1": 1}})
    for w in ("w0", "w1"):
        call(c, "result", w, generation=3, ok=True, stats={})
    for w in ("w0", "w1"):
        assert call(c, "step", w, generation=3, step=d.switch_step)["action"] == "go"
    run_step(c, ["w0", "w1"], 3, d.switch_step + 1)
    st = c.status()
    assert (st.phase, st.generation, st.layout) == ("running", 3, Layout.parse("tp1.pp1.dp2"))
    assert c.rescale_record(3).ok
    c.directive(4, "tp1.pp1.dp1", ["w0"])  # and the job can be rescaled again


def test_past_the_commit_a_lost_leaver_costs_nothing_and_a_lost_member_is_recovered_from_the_new_generation() -> None:
    c, clock, reg = started(workers=W4, layout="tp1.pp1.dp4", recover=True)
    d = c.directive(2, "tp1.pp1.dp2", ["w0", "w1"])  # w2, w3 leave
    assert d.rollback
    run_step(c, list(W4), 1, 2)
    assert set(run_step(c, list(W4), 1, d.switch_step)) == {"switch"}
    for w in W4:
        call(c, "arrive", w, generation=2, digest="x", plan={"new_ranks": {"w0": 0, "w1": 1}})
    for w in W4:
        call(c, "exchanged", w, generation=2)  # the commit: every part landed
    assert call(c, "exchanged", "w0", generation=2)["decision"] == "go"
    c.worker_lost("w3", "worker w3 exited with code -9")  # a leaver, on its way out
    st = c.status()
    assert (st.phase, st.generation) == ("rescaling", 2) and st.error is None
    # a member of the new generation lost before its first step is done: recovered from generation 2
    call(c, "result", "w0", generation=2, ok=True, stats={})
    c.worker_lost("w1", "worker w1 exited with code -9")
    st = c.status()
    assert (st.phase, st.generation) == ("recovering", 2), st
    # w0 may be waiting for w1 at the new default group's door: it gives that up
    answer = call(c, "heartbeat", "w0", generation=1, building=2)
    assert answer["abort"] == 2 and "w1" in answer["abort_reason"], answer
    done = c.rescale_record(2)
    assert done.ok and "lost before its first step finished" in done.reason
    assert c.wait_generation(2, timeout=1).ok  # the launcher's wait sees the rescale done
    call(c, "broken", "w0", generation=2, step=d.switch_step, applied=d.switch_step - 1, ready=None, dirty=False,
         local_apply=True)
    r = call(c, "step", "w0", generation=2, step=d.switch_step)
    assert r["action"] == "switch"
    assert (r["directive"]["generation"], r["directive"]["layout"], r["directive"]["old_layout"]) == (
        3, "tp1.pp1.dp1", "tp1.pp1.dp2")


@pytest.mark.parametrize("kept", [0, 2])
def test_a_shrink_that_gives_up_the_step_in_progress_switches_there_and_counts_the_lost_work_as_pause(kept) -> None:
    """``shrink_gives_up_step``: members computing step 1 hear ``give_up`` on their heartbeat at once
    (a long poll woken by the post); once they gave it up (the step asked for again, ``gave_up``) the
    shrink switches at step 1, not 2, and its pause counts from step 1's begin: its work was lost.
    When the new layout finished the step from its kept work (its members report
    ``kept_micro_batches``), the pause counts from the boundary and nothing counts as thrown away."""
    c, clock, reg = started(shrink_lookahead_steps=0, shrink_gives_up_step=True)
    begun = clock.t  # step 1 was begun at this time (started())
    clock.t += 2.0
    with ThreadPoolExecutor(1) as pool:
        waiting, _ = spy_waits(c._alarm)
        beat = pool.submit(call, c, "heartbeat", "w1", generation=1, wait_s=3.0)
        assert waiting.acquire(timeout=30) and not beat.done()  # nothing to say yet
        d = c.directive(2, "tp1.pp1.dp1", ["w0"], remap=False)
        assert beat.result(timeout=30)["give_up"] == {"generation": 1, "step": 1}
    assert d.switch_step == 2 and d.give_up_checks  # as posted: after the step in progress; engines check
    clock.t += 0.5
    out = [call(c, "step", w, generation=1, step=1, gave_up={"step": 1, "seconds": s})
           for w, s in (("w0", 2.4), ("w1", 2.5))]
    assert [o["action"] for o in out] == ["switch", "switch"]
    assert {o["directive"]["switch_step"] for o in out} == {1}
    assert "give_up" not in call(c, "heartbeat", "w0", generation=1)  # said until they gave it up
    for w in ("w0", "w1"):
        call(c, "arrive", w, generation=2, digest="d", plan={"new_ranks": {"w0": 0}})
    boundary = clock.t
    for w, sent in (("w0", 0), ("w1", 70)):
        call(c, "result", w, generation=2, ok=True,
             stats={"bytes_sent": sent, **({"kept_micro_batches": kept} if kept and w == "w0" else {})})
    clock.t += 0.25
    assert call(c, "step", "w0", generation=2, step=1)["action"] == "go"  # the new layout redoes step 1
    rec = c.rescale_record(2)
    assert (rec.switch_step, rec.gave_up_step, rec.gave_up_seconds, rec.kept_micro_batches) == (1, 1, 2.5, kept)
    if kept:  # 0.25: the reshard only
        assert rec.pause_seconds == pytest.approx(clock.t - boundary)
    else:  # 2.75: the lost step and the reshard
        assert rec.pause_seconds == pytest.approx(clock.t - begun)
    call(c, "step", "w0", generation=2, step=2, result={"step": 1, "loss": 1.5, "tokens": 256, "seconds": 0.2})
    assert c.wait_generation(2, timeout=1).ok is True
    assert [r.step for r in c.history()] == [0, 1]  # step 1 once: the given-up try left no result
    assert (metric(reg, "elastic_training_steps_given_up_total"), metric(reg, "elastic_training_given_up_seconds_total"),
            metric(reg, "elastic_training_given_up_steps_kept_total"),
            metric(reg, "elastic_training_rescales_total")) == (1.0, 0.0 if kept else 2.5, 1.0 if kept else 0.0, 1.0)


@pytest.mark.parametrize("layout, workers, new, new_workers, why", [
    ("tp1.pp2.dp1", ("w0", "w1"), "tp1.pp1.dp1", ["w0"], "1F1B stages cannot meet at every micro-batch"),
    ("tp1.pp1.dp1", ("w0",), "tp1.pp1.dp2", ["w0", "w1"], "a grow asks only with grow_gives_up_step"),
])
def test_only_a_shrink_on_one_pipeline_stage_asks_for_the_step_in_progress(layout, workers, new, new_workers,
                                                                           why) -> None:
    c, _, _ = started(workers, layout, shrink_lookahead_steps=0, lookahead_steps=0, shrink_gives_up_step=True)
    call(c, "register", "w1")
    d = c.directive(2, new, new_workers, remap=False)
    assert "give_up" not in call(c, "heartbeat", workers[0], generation=1), why
    assert d.switch_step == 2
    # a member that says it gave a step up anyway is switched only at the posted step
    assert call(c, "step", workers[0], generation=1, step=1, gave_up={"step": 1, "seconds": 1.0})["action"] == "go"


@pytest.mark.parametrize("kept", [True, False])
def test_a_grow_gives_up_the_step_in_progress_and_its_joiner_hears_the_amended_switch_with_the_go(kept) -> None:
    """``grow_gives_up_step``: the member computing step 1 is told to give it up; the joiner, which
    holds the directive as posted (switch at 2) and arrived first, hears with the ``go`` that the
    switch moved to 1 and whether every old member kept the work; a new layout that finished the
    step from it (its members report ``kept_micro_batches``) paused from the boundary only."""
    c, clock, _ = started(("w0",), "tp1.pp1.dp1", shrink_lookahead_steps=0, lookahead_steps=0,
                          shrink_gives_up_step=True, grow_gives_up_step=True)
    call(c, "register", "w1")
    begun = clock.t
    d = c.directive(2, "tp1.pp1.dp2", ["w0", "w1"], remap=False)
    assert d.switch_step == 2 and call(c, "heartbeat", "w0", generation=1)["give_up"] == {"generation": 1, "step": 1}
    joined = call(c, "poll", "w1")
    assert joined["action"] == "join" and joined["directive"]["switch_step"] == 2
    plan = {"new_ranks": {"w0": 0, "w1": 1}}
    assert call(c, "arrive", "w1", generation=2, digest="d", plan=plan)["decision"] == "wait"
    clock.t += 0.8
    out = call(c, "step", "w0", generation=1, step=1, gave_up={"step": 1, "seconds": 0.8, "micro": 3, "kept": kept})
    assert out["action"] == "switch" and out["directive"]["switch_step"] == 1
    boundary = clock.t
    go = call(c, "arrive", "w0", generation=2, digest="d", plan=plan)
    assert (go["decision"], go["switch_step"], go["gave_up"]) == ("go", 1, {"step": 1, "micro": 3, "kept": kept})
    assert call(c, "arrive", "w1", generation=2, digest="d", plan=plan) == go  # the joiner hears the same
    for w in ("w0", "w1"):
        call(c, "result", w, generation=2, ok=True, stats={"kept_micro_batches": 3} if kept else {})
    clock.t += 0.3
    assert [call(c, "step", w, generation=2, step=1)["action"] for w in ("w0", "w1")] == ["go", "go"]
    rec = c.rescale_record(2)
    assert (rec.switch_step, rec.gave_up_step, rec.kept_micro_batches) == (1, 1, 3 if kept else 0)
    assert rec.pause_seconds == pytest.approx(clock.t - (boundary if kept else begun))


def test_a_step_that_ended_before_its_give_up_switches_the_shrink_after_it() -> None:
    """The request came after the last micro-batch's check: the step completes, nothing is lost,
    and the shrink switches after it as if nothing had been asked."""
    c, _, _ = started(shrink_lookahead_steps=0, shrink_gives_up_step=True)
    d = c.directive(2, "tp1.pp1.dp1", ["w0"], remap=False)
    assert run_step(c, ["w0", "w1"], 1, 2) == ["switch", "switch"]
    assert "give_up" in call(c, "heartbeat", "w0", generation=1)  # until the decision: harmless, step 1 is over
    for w in ("w0", "w1"):
        call(c, "arrive", w, generation=2, digest="d", plan={"new_ranks": {"w0": 0}})
    assert "give_up" not in call(c, "heartbeat", "w0", generation=1)
    rec = c.rescale_record(2)
    assert (rec.switch_step, rec.gave_up_step, rec.gave_up_seconds) == (d.switch_step, None, 0.0)


def test_a_member_that_begins_the_step_after_the_shrink_was_posted_is_told_to_give_it_up() -> None:
    c, _, _ = started(shrink_lookahead_steps=0, shrink_gives_up_step=True)
    res = {"step": 1, "loss": 2.0, "tokens": 256, "seconds": 0.5}
    assert call(c, "step", "w0", generation=1, step=2, result=res)["action"] == "go"
    c.directive(2, "tp1.pp1.dp1", ["w0"], remap=False)
    out = call(c, "step", "w1", generation=1, step=2, result=res)
    assert (out["action"], out["give_up"]) == ("go", 2)  # its peer is computing step 2 already


def test_whether_engines_check_for_a_give_up_is_fixed_per_generation_when_it_is_posted() -> None:
    """The check is a collective: all ranks of a generation run it or none does. A joiner registering
    after the setting changed still gets its generation's value, from the directive (it once came
    from the register answer, and a generation mixed checking and non-checking engines: deadlock)."""
    c, _, _ = started(shrink_lookahead_steps=0, shrink_gives_up_step=False)
    d2 = c.directive(2, "tp1.pp1.dp1", ["w0"], remap=False)
    c.settings = replace(c.settings, shrink_gives_up_step=True)  # changed while generation 2 is in flight: it keeps its value
    assert "give_up_checks" not in call(c, "register", "w2")  # a joiner learns it from its directive only
    assert not d2.give_up_checks and not Directive.from_json(
        call(c, "step", "w0", generation=1, step=2, result={"step": 1, "loss": 2.0, "tokens": 1, "seconds": 0.1}
             )["directive"]).give_up_checks


def test_a_heartbeat_tells_the_members_of_a_posted_rescale_at_once_so_they_prepare_during_the_step() -> None:
    # no lookahead: the switch is the next boundary, and the step loop would hear of the directive
    # only there. A member's beat long-polls and is answered the moment a rescale of its generation
    # is posted; it says the last post it was told of (``seen``), so it is told of each post once.
    c, clock, _ = started(workers=("w0", "w1"), lookahead_steps=0)
    call(c, "register", "w2")
    assert "pending" not in call(c, "heartbeat", "w0", generation=1, seen=0)  # nothing posted
    waiting, ends = spy_waits(c._alarm)
    with ThreadPoolExecutor(2) as pool:
        beats = [pool.submit(call, c, "heartbeat", w, generation=1, wait_s=4.0, seen=0) for w in ("w0", "w1")]
        assert all(waiting.acquire(timeout=30) for _ in beats) and not any(f.done() for f in beats)  # long-polling
        d = c.directive(2, "tp1.pp1.dp3", ["w0", "w1", "w2"])
        outs = [f.result(timeout=30) for f in beats]  # their waits end by themselves after 4 s
    assert ends == [True, True]  # both woken by the post, neither by its wait running out
    assert d.switch_step == 2  # step 1 in progress: the next boundary
    for out in outs:
        assert Directive.from_json(out["pending"]) == d and out["pending_seq"] >= 1
    seq = outs[0]["pending_seq"]
    # told once: a beat that has seen it long-polls on (here: answers without it after its wait)
    t0 = time.monotonic()
    assert "pending" not in call(c, "heartbeat", "w0", generation=1, wait_s=0.3, seen=seq)
    assert time.monotonic() - t0 >= 0.25
    # not told: a beat without ``seen`` (an older worker), another generation, a joiner (it polls)
    assert "pending" not in call(c, "heartbeat", "w0", generation=1)
    assert "pending" not in call(c, "heartbeat", "w0", generation=0, seen=0)
    assert "pending" not in call(c, "heartbeat", "w2", seen=0)
    # abandoned (the joiner never came): nothing pending any more; posted again under the same
    # number with another layout: a new post, told again
    for _ in range(4):  # past join_timeout_s, the members beating
        clock.t += 3.0
        for w in ("w0", "w1"):
            call(c, "heartbeat", w)
        c.tick()
    assert c.rescale_record(2).ok is False
    assert "pending" not in call(c, "heartbeat", "w1", generation=1, seen=0)
    d2 = c.directive(2, "tp1.pp1.dp1", ["w0"])
    out = call(c, "heartbeat", "w1", generation=1, seen=seq)
    assert Directive.from_json(out["pending"]) == d2 and out["pending_seq"] > seq
    # switched off (LaunchOptions.prepare_beside_step=False, for A/B measurements): nobody is told
    c, _, _ = started(workers=("w0", "w1"), lookahead_steps=0, prepare_beside_step=False)
    c.directive(2, "tp1.pp1.dp1", ["w0"])
    assert "pending" not in call(c, "heartbeat", "w0", generation=1, seen=0)



def _shrink_asks_for_the_step(config: dict, to: str, elapsed: float, **kwargs) -> bool:
    """Three members train ``tp1.pp1.dp3`` in steps of 0.5 s (as reported); ``elapsed`` seconds into
    step 3 a shrink to ``to`` on two of them is posted: whether the heartbeat asks for that step."""
    clock, reg = Clock(1000.0), CollectorRegistry()
    c = Coordinator("job", config, CoordinatorSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0,
                    join_timeout_s=10.0, lookahead_steps=0, shrink_gives_up_step=True), registry=reg, clock=clock)
    workers = ["w0", "w1", "w2"]
    for w in workers:
        call(c, "register", w)
    c.directive(1, "tp1.pp1.dp3", workers)
    for w in workers:
        call(c, "poll", w)
        call(c, "arrive", w, generation=1, digest="")
    for w in workers:
        call(c, "result", w, generation=1, ok=True, stats={})
    for s in range(4):  # step 3 begins now
        run_step(c, workers, 1, s)
    clock.t += elapsed
    d = c.directive(2, to, ["w0", "w1"], **kwargs)
    assert d.switch_step == 4
    return "give_up" in call(c, "heartbeat", "w0", generation=1)


@pytest.mark.parametrize("elapsed, explicit, asked", [(0.05, None, True), (0.2, None, False), (0.2, True, True)])
def test_a_user_job_gives_a_shrinks_step_up_only_while_that_costs_less_than_waiting(elapsed, explicit, asked) -> None:
    """A user job redoes a given-up step whole: three members 0.05 s into a 0.5 s step throw 0.15 s
    away to save 0.45 s of waiting (given up); 0.2 s into it, 0.6 s to save 0.3 s (it waits),
    unless the rescale asks for the step explicitly."""
    kwargs = {"give_up_step": explicit} if explicit is not None else {}
    assert _shrink_asks_for_the_step({"kind": "user", "model": "tiny"}, "tp1.pp1.dp2", elapsed, **kwargs) == asked


@pytest.mark.parametrize("to, elapsed, asked", [
    ("tp1.pp1.dp2", 0.2, True),  # the same split: the new layout finishes the step from the work done
    ("tp1.pp2.dp1", 0.05, True),  # another split redoes the step whole: 0.15 s thrown away saves 0.45 s
    ("tp1.pp2.dp1", 0.2, False),  # 0.6 s thrown away to save 0.3 s: it waits for the boundary
    ("tp2.pp1.dp1", 0.2, False),
])
def test_the_reference_trainer_gives_a_step_up_for_another_split_only_while_that_pays(to, elapsed, asked) -> None:
    """The reference trainer keeps a given-up step's work only for a new layout of the same TP
    split and one pipeline stage; a shrink to another split weighs the step like a user job's."""
    assert _shrink_asks_for_the_step({"model": "tiny"}, to, elapsed) == asked
