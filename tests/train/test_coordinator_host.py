"""A job's coordinator in a process of its own (``python -m elastic.train.rendezvous.host``), driven
over HTTP with ``CoordinatorClient``: the admin route, its errors and codecs, the host's input
and exit, and one live job of real worker processes rescaled through it.

The host runs as a real subprocess on loopback, on a port the test picks (port 0 is not
readable from outside); every wait on it is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from elastic.model import Layout, SpecError, load_model
from elastic.train.checkpoint import CheckpointSettings
from elastic.train.engine import TrainConfig
from elastic.train.launch import LaunchOptions, ProcessJobHandle, coordinator_settings
from elastic.train.rendezvous import (
    CheckpointFailed,
    Coordinator,
    CoordinatorSettings,
    JobFailed,
    JobStatus,
    RendezvousError,
    RescaleCancelled,
    RescaleFailed,
    RescaleRecord,
    StepRecord,
)
from elastic.train.rendezvous.host import settings_from_json
from elastic.train.rendezvous.remote import (
    ADMIN,
    ADMIN_METHODS,
    CoordinatorClient,
    _decode_error,
    _error_doc,
    answer_admin,
)

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-of-the-test-job"
START_S = 60.0  # the host imports torch before it serves: seconds on a busy machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(
    job: str,
    port: int,
    *,
    config: dict[str, Any] | None = None,
    settings: CoordinatorSettings | None = None,
    **extra: str,
) -> dict[str, str]:
    spec = {"config": config or {}, "settings": (settings or CoordinatorSettings()).to_json()}
    return {
        **os.environ,
        "ELASTIC_JOB": job,
        "ELASTIC_JOB_SECRET": SECRET,
        "ELASTIC_COORDINATOR_PORT": str(port),
        "ELASTIC_COORDINATOR_BIND": "127.0.0.1",
        "ELASTIC_COORDINATOR_SPEC": json.dumps(spec),
        **extra,
    }


def _host_cmd() -> list[str]:
    return [sys.executable, "-m", "elastic.train.rendezvous.host"]


@contextmanager
def hosted(job: str, **kw: Any) -> Iterator[tuple[subprocess.Popen[str], CoordinatorClient]]:
    """A host process for ``job`` and a ready client of it; the process is ended however the test ends."""
    port = _free_port()
    proc = subprocess.Popen(
        _host_cmd(), env=_env(job, port, **kw), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        client = CoordinatorClient(f"http://127.0.0.1:{port}", SECRET, job)
        client.ready(START_S)
        yield proc, client
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stderr is not None:
            proc.stderr.close()


def _raw(url: str, body: bytes = b"{}", secret: str | None = SECRET) -> tuple[int, dict[str, Any]]:
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {secret}"} if secret else {}),
    }
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# ---- the host and its admin route -------------------------------------------------------------


def test_a_hosted_coordinator_answers_its_controller_and_exits_0_on_stop() -> None:
    with hosted("host-admin") as (proc, c):
        # 1. a fresh job
        st = c.status()
        assert (st.job, st.phase, st.generation, st.layout, st.step) == (
            "host-admin",
            "starting",
            0,
            None,
            -1,
        )
        assert c.history() == [] and c.registered("w0") is False and c.lost_workers() == []
        # 2. a directive the coordinator refuses arrives as its SpecError, with its message
        with pytest.raises(SpecError, match=r"tp1\.pp1\.dp2 needs 2 workers .* got 1"):
            c.directive(1, "tp1.pp1.dp2", ["w0"])
        # 3. a wait that runs out arrives as TimeoutError
        with pytest.raises(TimeoutError, match="generation 1 did not run a step"):
            c.wait_generation(1, 0.5)
        # 4. the backend's meta round-trips, updates merge
        assert c.get_meta() == {}
        c.update_meta(spec={"name": "host-admin"}, gpus={"w0": [0, 1]})
        c.update_meta(next_id=3)
        assert c.get_meta() == {"spec": {"name": "host-admin"}, "gpus": {"w0": [0, 1]}, "next_id": 3}
        # 5. without the secret: 401, and nothing of the job
        code, body = _raw(f"{c.url}{ADMIN}/status", secret=None)
        assert code == 401 and "host-admin" not in json.dumps(body)
        code, _ = _raw(f"{c.url}{ADMIN}/status", secret="x" * 20)
        assert code == 401
        with pytest.raises(RendezvousError, match="refused the secret"):
            CoordinatorClient(c.url, "x" * 20, "host-admin").status()
        # 6. an unknown method: 404 naming the allowed ones
        code, body = _raw(f"{c.url}{ADMIN}/directiv")
        assert code == 404 and body["error"]["type"] == "KeyError"
        assert all(m in body["error"]["message"] for m in ADMIN_METHODS)
        # 7. arguments that do not fit the method: 400 naming its signature
        code, body = _raw(f"{c.url}{ADMIN}/status", b'{"bogus": 1}')
        assert code == 400 and "bogus" in body["error"]["message"]
        # 8. stop: the host exits 0; the final status stays readable on the client
        c.stop()
        assert proc.wait(30) == 0
        assert c.status().phase == "stopped"
        with pytest.raises(JobFailed, match="was stopped"):
            c.registered("w0")
        assert proc.stderr is not None
        assert f"coordinator for job host-admin serving at {c.url}" in proc.stderr.read()


def test_sigterm_stops_the_hosted_coordinator_and_exits_0() -> None:
    with hosted("host-term") as (proc, c):
        assert c.status().phase == "starting"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with pytest.raises(
            JobFailed, match=r"host-term: its coordinator at http://127\.0\.0\.1:\d+ is unreachable"
        ):
            CoordinatorClient(c.url, SECRET, "host-term", retry_s=0.3).status()


@pytest.mark.parametrize(
    "drop, extra, named",
    [
        ("ELASTIC_JOB", {}, "ELASTIC_JOB"),
        ("ELASTIC_JOB_SECRET", {}, "ELASTIC_JOB_SECRET"),
        (None, {"ELASTIC_JOB_SECRET": "short"}, "ELASTIC_JOB_SECRET"),
        ("ELASTIC_COORDINATOR_SPEC", {}, "ELASTIC_COORDINATOR_SPEC"),
        (None, {"ELASTIC_COORDINATOR_SPEC": "{not json"}, "ELASTIC_COORDINATOR_SPEC"),
        (None, {"ELASTIC_COORDINATOR_SPEC": '{"config": {}, "settings": {"heartbeat_s": 1}}'}, "heartbeat_s"),
        (
            None,
            {"ELASTIC_COORDINATOR_SPEC": '{"config": {}, "settings": {"join_timeout_s": 0}}'},
            "join_timeout_s",
        ),
        (None, {"ELASTIC_COORDINATOR_PORT": "http"}, "ELASTIC_COORDINATOR_PORT"),
        (None, {"ELASTIC_COORDINATOR_PORT": "70000"}, "ELASTIC_COORDINATOR_PORT"),
    ],
)
def test_bad_input_exits_2_naming_the_variable(drop, extra, named) -> None:
    env = _env("host-bad", _free_port(), **extra)
    if drop is not None:
        del env[drop]
    p = subprocess.run(_host_cmd(), env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert named in p.stderr and "Traceback" not in p.stderr


def test_an_unreachable_coordinator_fails_the_job_after_a_bounded_retry() -> None:
    c = CoordinatorClient(f"http://127.0.0.1:{_free_port()}", SECRET, "gone", retry_s=0.3)
    with pytest.raises(
        JobFailed, match=r"job gone: its coordinator at http://127\.0\.0\.1:\d+ is unreachable"
    ):
        c.registered("w0")
    with pytest.raises(TimeoutError, match=r"http://127\.0\.0\.1:\d+ did not answer /healthz"):
        c.ready(0.3)


# ---- codecs -------------------------------------------------------------------------------------

RECORD = RescaleRecord(
    generation=3,
    from_layout=Layout.parse("tp1.pp1.dp2"),
    to_layout=Layout.parse("tp1.pp1.dp1"),
    workers=["w0"],
    joiners=[],
    leavers=["w1"],
    switch_step=7,
    ok=True,
    reason="ok",
    pause_seconds=0.25,
    bytes_moved=10,
    planned_bytes=10,
    lower_bound_bytes=5,
    new_ranks={"w0": 0},
    worker_stats={"w0": {"bytes_sent": 10}},
    gave_up_step=6,
)


@pytest.mark.parametrize(
    "value",
    [
        StepRecord(
            step=4, generation=2, layout=Layout.parse("tp1.pp1.dp2"), loss=2.5, tokens=64, seconds=0.5
        ),
        StepRecord(
            step=0, generation=1, layout=Layout.parse("tp1.pp1.dp1"), loss=None, tokens=0, seconds=0.0
        ),
        RECORD,
        RescaleRecord(1, None, Layout.parse("tp1.pp1.dp1"), ["w0"], ["w0"], [], 0),
        JobStatus(
            job="j",
            phase="running",
            generation=3,
            layout=Layout.parse("tp1.pp1.dp1"),
            workers=["w0"],
            step=9,
            loss=2.0,
            tokens_per_second=128.0,
            step_seconds=0.5,
            error=None,
            last_rescale=RECORD,
            failures=["x"],
            checkpoint_step=-1,
            memory={"params": 1},
            out_of_memory=None,
        ),
        JobStatus("j", "starting", 0, None, [], -1, None, None, None, None, None),
        CoordinatorSettings(),
        CoordinatorSettings(
            max_steps=50,
            recover=True,
            shrink_lookahead_steps=0,
            recovery_timeout_s=3.0,
            checkpoint=CheckpointSettings(
                "/tmp/ck", every_steps=None, every_seconds=30.0, keep=3, coordinator_sees=False
            ),
        ),
    ],
    ids=lambda v: type(v).__name__,
)
def test_what_crosses_the_wire_reads_back_equal(value) -> None:
    doc = json.loads(json.dumps(value.to_json()))  # through JSON text, as on the wire
    read = settings_from_json if isinstance(value, CoordinatorSettings) else type(value).from_json
    assert read(doc) == value


@pytest.mark.parametrize(
    "doc, named",
    [
        ({"max_step": 3}, "max_step"),
        ({"checkpoint": {"dir": "/tmp/ck", "every": 3}}, "every"),
        ({"checkpoint": "/tmp/ck"}, "checkpoint"),
        ({"checkpoint": {"dir": ""}}, "dir"),
    ],
)
def test_settings_that_do_not_read_are_refused_naming_the_key(doc, named) -> None:
    with pytest.raises(SpecError, match=named):
        settings_from_json(doc)


def test_layouts_are_values_and_text_only_on_the_wire() -> None:
    doc = RECORD.to_json()
    assert (doc["from_layout"], doc["to_layout"]) == ("tp1.pp1.dp2", "tp1.pp1.dp1")
    st = JobStatus("j", "running", 3, Layout(1, 1, 1), ["w0"], 9, None, None, None, None, RECORD)
    doc = st.to_json()
    assert (doc["layout"], doc["last_rescale"]["to_layout"]) == ("tp1.pp1.dp1", "tp1.pp1.dp1")
    assert StepRecord(1, 1, Layout(1, 1, 2), None, 1, 1.0).to_json()["layout"] == "tp1.pp1.dp2"


@pytest.mark.parametrize(
    "build, named",
    [
        (
            lambda: JobStatus("j", "running", 3, "tp1.pp1.dp1", ["w0"], 9, None, None, None, None, None),
            "JobStatus.layout",
        ),
        (
            lambda: RescaleRecord(1, "tp1.pp1.dp2", Layout(1, 1, 1), [], [], [], 0),
            "RescaleRecord.from_layout",
        ),
        (lambda: RescaleRecord(1, None, "tp1.pp1.dp1", [], [], [], 0), "RescaleRecord.to_layout"),
        (lambda: RescaleRecord(1, None, None, [], [], [], 0), "RescaleRecord.to_layout"),
        (lambda: StepRecord(1, 1, "tp1.pp1.dp1", None, 1, 1.0), "StepRecord.layout"),
    ],
)
def test_a_layout_given_as_text_is_refused_naming_the_field_and_the_fix(build, named) -> None:
    with pytest.raises(TypeError, match=rf"{named}: a Layout \(Layout.parse the text\), got"):
        build()


@pytest.mark.parametrize(
    "doc, named",
    [
        ({**RECORD.to_json(), "to_layout": None}, "RescaleRecord.to_layout"),
        ({**RECORD.to_json(), "from_layout": 3}, "RescaleRecord.from_layout"),
        (
            {
                **JobStatus("j", "starting", 0, None, [], -1, None, None, None, None, None).to_json(),
                "layout": ["tp1"],
            },
            "JobStatus.layout",
        ),
    ],
)
def test_a_layout_on_the_wire_that_is_not_text_is_refused_naming_the_field(doc, named) -> None:
    read = RescaleRecord.from_json if named.startswith("RescaleRecord") else JobStatus.from_json
    with pytest.raises(ValueError, match=rf"{named}: expected a layout's text"):
        read(doc)


def test_a_record_missing_a_field_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="StepRecord: missing field.*seconds"):
        StepRecord.from_json({"step": 1, "generation": 1, "layout": "tp1.pp1.dp1", "loss": None, "tokens": 1})


@pytest.mark.parametrize(
    "error, want",
    [
        (SpecError("refused"), SpecError),
        (ValueError("bad"), ValueError),
        (TimeoutError("late"), TimeoutError),
        (KeyError("w9"), KeyError),
        (JobFailed("dead"), JobFailed),
        (CheckpointFailed("disk"), CheckpointFailed),
        (RescaleFailed("abandoned", RECORD), RescaleFailed),
        (RescaleCancelled("called off"), RescaleCancelled),
        (ZeroDivisionError("bug"), RuntimeError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_errors_cross_the_wire_as_their_class(error, want) -> None:
    got = _decode_error(json.loads(json.dumps(_error_doc(error))), 409)
    assert type(got) is want
    message = error.args[0]
    assert str(got) == (
        f"{type(error).__name__}: {message}"
        if want is RuntimeError
        else repr(message)
        if want is KeyError
        else message
    )
    if isinstance(error, RescaleFailed):
        assert isinstance(got, RescaleFailed) and got.record == error.record


def test_a_checkpoint_error_arrives_as_the_spec_error_its_caller_catches() -> None:
    """A subclass of a wire error (CheckpointError is a SpecError) crosses as that error."""
    from elastic.train.checkpoint import CheckpointError

    got = _decode_error(_error_doc(CheckpointError("no such dir")), 409)
    assert type(got) is SpecError and str(got) == "no such dir"


def test_the_admin_route_answers_on_an_unstarted_coordinator() -> None:
    """The answer function alone: its status codes and results (no socket)."""
    coord = Coordinator("admin-unit", {})
    ok = answer_admin(coord, "wait_phase", b'{"phases": ["starting"], "timeout": 0}')
    assert (ok.code, ok.body, ok.ends) == (200, {"result": "starting"}, False)
    late = answer_admin(coord, "wait_step", b'{"step": 0, "timeout": 0}')
    assert late.code == 409 and late.body["error"]["type"] == "TimeoutError"
    assert answer_admin(coord, "status", b"[1]").code == 400
    assert answer_admin(coord, "status", b"{nope").code == 400
    assert (
        answer_admin(coord, "_fail_locked", b"{}").code == 404
    )  # only the allowlist, never a private method


# ---- one live job through a hosted coordinator ------------------------------------------------

CFG = TrainConfig(model=load_model("tiny"), global_batch=8, micro_batch=1)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_job_driven_through_a_hosted_coordinator_rescales_in_place(tmp_path) -> None:
    """``ProcessJobHandle(coordinator=CoordinatorClient(...))``: the workers talk to the host, the
    handle drives it over HTTP; a shrink dp2 -> dp1 keeps the step counter and stop ends the host."""
    from elastic.train.agent import config_json

    opts = LaunchOptions(pg_timeout_s=90, heartbeat_timeout_s=60, join_timeout_s=120)
    with hosted("host-job", config=config_json(CFG), settings=coordinator_settings(opts)) as (proc, client):
        h = ProcessJobHandle("host-job", CFG, options=opts, log_dir=str(tmp_path), coordinator=client)
        try:
            first = h.start("tp1.pp1.dp2", ["w0", "w1"], timeout=180)
            assert first.generation == 1 and h.status().phase == "running"
            h.wait_step(1, timeout=120)
            shrink = h.rescale("tp1.pp1.dp1", ["w0"], timeout=240)
            assert (shrink.generation, shrink.to_layout, shrink.record.leavers) == (
                2,
                Layout.parse("tp1.pp1.dp1"),
                ["w1"],
            )
            assert h.procs["w1"].poll() == 0, "the leaver exits cleanly"
            h.wait_step(shrink.switch_step + 1, timeout=120)
            st = h.status()
            assert (st.phase, st.generation, st.layout, st.workers) == (
                "running",
                2,
                Layout.parse("tp1.pp1.dp1"),
                ["w0"],
            )
        finally:
            final = h.stop()
        assert final.phase == "stopped" and final.error is None
        assert proc.wait(30) == 0
    steps = [r.step for r in h.history()]
    assert steps == list(range(len(steps))) and len(steps) > shrink.switch_step
    assert {r.generation for r in h.history()} == {1, 2}
