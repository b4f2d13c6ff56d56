"""The admin-API client commands (``elastic status|get|decisions|reshards|rescale|checkpoint|override|
controller``) against a real uvicorn server on loopback over a real SQLite store and a real
Controller driving the fake backend: through Typer's CliRunner and as a real subprocess."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from elastic import store as db
from elastic.cli import app
from elastic.cli.admin import human_bytes, override_until, parse_duration, when
from elastic.config import load_config
from elastic.controller import job_throughput_tables
from elastic.model import Layout

from .conftest import ADMIN, CONFIG, READER, Env, close_env, controller_state, db_state, make_env

ELASTIC = Path(sys.executable).with_name("elastic")  # the console script of this venv


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = make_env(f"sqlite:///{tmp_path / 'cli.db'}")
    try:
        yield e
    finally:
        close_env(e)


def cli(env: Env | str, *args: str, token: str | None = None, **extra: str | None) -> Result:
    """``elastic *args`` in-process, pointed at ``env`` through ELASTIC_API (and ELASTIC_TOKEN)."""
    url = env if isinstance(env, str) else env.url
    res = CliRunner().invoke(app, list(args), env={"ELASTIC_API": url, "ELASTIC_TOKEN": token, "COLUMNS": "220",
                                                   **extra})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


def one_error_line(res: Result, code: int) -> str:
    """The single stderr line of a failed command (no traceback, nothing on stdout)."""
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    return lines[0]


def _lines(res: Result) -> list[str]:
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return [" ".join(line.split()) for line in res.stdout.splitlines()]


def _row(res: Result, *cells: Any) -> str:
    """The output line holding every one of ``cells`` (as printed), in that order."""
    want = " ".join(str(c) for c in cells)
    hits = [line for line in _lines(res) if want in line]
    assert len(hits) == 1, (want, res.stdout)
    return hits[0]


def _audit(env: Env) -> list[tuple[str, str, str]]:
    return [(a.actor, a.action, a.target) for a in db.list_audit(env.store, limit=100)]


# ---- reads ---------------------------------------------------------------------------------------------

def test_status_shows_what_the_controller_and_the_store_hold(env: Env) -> None:
    env.tick(10.0)
    env.tick(40.0)
    res = cli(env, "status")
    t = env.ctl.last_tick
    alloc = {w: len(a.gpus) for w, a in db.current_allocations(env.store, "p").items()}
    lines = _lines(res)
    assert "controller ctl-a (pool p)" in lines and "leader yes" in lines and "ready yes" in lines
    assert "paused no" in lines
    assert _row(res, "last tick", when(datetime.fromtimestamp(t.at, UTC).isoformat()), "acted", t.reason)
    assert t.message in lines
    assert f"lease holder {db.lease_holder(env.store, 'p', now=datetime.fromtimestamp(env.clock.t, UTC)).owner}" \
        in lines
    used = sum(alloc.values())
    assert (f"GPUs 8 total, {used} in use, {8 - used} idle: "
            + ", ".join(f"{w} {n}" for w, n in sorted(alloc.items()))) in lines
    env.ctl.pause()
    assert "paused yes" in _lines(cli(env, "status"))
    assert cli(env, "status", "--json").stdout.count('"paused": true') == 1


def test_get_lists_and_shows_workloads_and_pools_as_stored(env: Env) -> None:
    env.tick(10.0)
    chat = db.get_service(env.store, "chat")
    st = chat.status
    assert _row(cli(env, "get", "services"), "chat p", st["currentReplicas"], st["desiredReplicas"], "1-6 1",
                f"{st['observedValue']:g} 10", st["reason"])
    jobs = cli(env, "get", "jobs")
    for name in ("pretrain", "big"):
        s = db.get_job(env.store, name).status
        assert _row(jobs, name, "p", s["phase"], s["layout"] or "-", s["worldSize"])
    pretrain = db.get_job(env.store, "pretrain").status
    one = cli(env, "get", "job", "pretrain")  # singular works too
    assert _row(one, "pretrain p Running", pretrain["layout"], pretrain["worldSize"], "1-8", pretrain["step"])
    assert f"pretrain: {pretrain['message']}" in _lines(one) and "big" not in one.stdout
    alloc = {w: len(a.gpus) for w, a in db.current_allocations(env.store, "p").items()}
    used = sum(alloc.values())
    assert _row(cli(env, "get", "pools"), "p h100-80g 2 x 4 8", used, 8 - used, "ctl-a",
                ", ".join(f"{w} {n}" for w, n in sorted(alloc.items())))
    # --json is the API's own document
    assert cli(env, "get", "jobs", "--json").stdout.strip() == _pretty(env.get("/api/v1/jobs").json())
    assert cli(env, "get", "services", "--pool", "elsewhere", "--json").stdout.strip() == _pretty({"items": []})


def _pretty(doc: Any) -> str:
    import json

    return json.dumps(doc, indent=2)


def test_get_unknown_names_and_kinds_are_one_line_exit_2(env: Env) -> None:
    line = one_error_line(cli(env, "get", "jobs", "nope"), 2)
    assert "HTTP 404" in line and "training job 'nope' not found" in line
    assert "service 'ghost'" in one_error_line(cli(env, "get", "services", "ghost"), 2)
    assert "'gpus' is not something to get" in one_error_line(cli(env, "get", "gpus"), 2)


def test_decisions_and_reshards_show_the_logged_rows(env: Env) -> None:
    for load in (10.0, 40.0, 10.0):
        env.tick(load)
    decisions = db.list_decisions(env.store, 100, newest_first=True)
    res = cli(env, "decisions")
    for d in decisions:
        steps = d.plan.get("steps") or [{"action": "-", "workload": "-", "reason": d.reason, "message": d.message}]
        for i, s in enumerate(steps):
            head = (d.id, when(d.tick_at.isoformat()).removesuffix("Z"), "") if i == 0 else ()
            line = _row(res, s["action"], s["workload"], s["reason"], s["message"])
            assert all(str(h) in line for h in head), (head, line)
    ids = [int(line.split()[0]) for line in _lines(res) if line[:1].isdigit()]
    assert ids == [d.id for d in decisions]  # newest first
    newest = cli(env, "decisions", "--limit", "1")
    assert [int(line.split()[0]) for line in _lines(newest) if line[:1].isdigit()] == [decisions[0].id]
    assert "raise --limit" in newest.stdout
    assert not any(line[:1].isdigit() for line in _lines(cli(env, "decisions", "--pool", "elsewhere")))
    assert "query.limit" in one_error_line(cli(env, "decisions", "--limit", "0"), 2)

    reshards = db.list_reshards(env.store, "pretrain", 100, newest_first=True)
    assert len(reshards) >= 2
    res = cli(env, "reshards", "pretrain")
    for r in reshards:
        _row(res, r.generation, when(r.started_at.isoformat()).removesuffix("Z"))
        _row(res, f"{r.from_layout} -> {r.to_layout}", human_bytes(r.bytes_moved), human_bytes(r.bytes_planned),
             human_bytes(r.bytes_lower_bound), f"{r.pause_seconds:.2f} s", r.status)
    assert "training job 'nope'" in one_error_line(cli(env, "reshards", "nope"), 2)


# ---- writes --------------------------------------------------------------------------------------------

def test_rescale_pins_a_layout_by_name_or_gpu_count_and_unpins(env: Env) -> None:
    env.tick(10.0)
    res = cli(env, "rescale", "pretrain", "--layout", "tp2.pp1.dp2", token=ADMIN)
    assert res.exit_code == 0, res.stderr
    assert "pretrain: pinned to tp2.pp1.dp2" in res.stdout and "tokens/s" in res.stdout
    assert env.ctl.pinned["pretrain"][4][0] == Layout(2, 1, 2)
    env.tick(10.0)
    assert str(env.backend.jobs["pretrain"].layout) == "tp2.pp1.dp2"
    # --gpus N pins what the controller's own table picks for N GPUs
    expected = str(job_throughput_tables(load_config(data=CONFIG))["pretrain"][3][0])
    res = cli(env, "rescale", "pretrain", "--gpus", "3", token=ADMIN)
    assert res.exit_code == 0 and f"pinned to {expected}" in res.stdout, res.stderr
    assert list(env.ctl.pinned["pretrain"]) == [3] and str(env.ctl.pinned["pretrain"][3][0]) == expected
    assert "pinned pretrain " + expected in _lines(cli(env, "status"))
    res = cli(env, "rescale", "pretrain", "--unpin", token=ADMIN)
    assert res.exit_code == 0 and "unpinned" in res.stdout and env.ctl.pinned == {}
    assert _audit(env) == [("alice", "job.rescale", "job/pretrain")] * 3


def test_rescale_refusals_are_one_line_and_pin_nothing(env: Env) -> None:
    env.tick(10.0)
    before, ctl_before = db_state(env.store), controller_state(env.ctl)
    line = one_error_line(cli(env, "rescale", "pretrain", "--layout", "tp8.pp1.dp1", token=ADMIN), 2)
    assert line.startswith("error: HTTP 422") and "layout:" in line and "gpus_per_node=4" in line
    line = one_error_line(cli(env, "rescale", "nope", "--layout", "tp1.pp1.dp2", token=ADMIN), 2)
    assert "HTTP 404" in line and "'nope'" in line
    line = one_error_line(cli(env, "rescale", "pretrain", "--gpus", "7", token=ADMIN), 2)
    assert "--gpus 7" in line and "counts that work" in line  # gpt-1.3b has no 7-GPU layout
    assert "exactly one of" in one_error_line(cli(env, "rescale", "pretrain", "--layout", "tp1.pp1.dp1", "--unpin",
                                                  token=ADMIN), 2)
    assert db_state(env.store) == before and controller_state(env.ctl) == ctl_before


def test_checkpoint_asks_or_waits_and_names_what_stands_in_the_way(env: Env) -> None:
    env.tick(10.0)
    res = cli(env, "checkpoint", "pretrain", token=ADMIN)
    assert res.exit_code == 0 and "pretrain: asked for" in res.stdout, res.stderr
    assert env.backend.jobs["pretrain"].checkpoint_step == 0
    res = cli(env, "checkpoint", "pretrain", "--wait", "30", token=ADMIN)
    assert res.stdout.strip() == "pretrain: saved at step 1 on every rank", res.stderr
    assert env.backend.jobs["pretrain"].checkpoint_step == 1
    assert ("checkpoint", "pretrain", 0) in env.backend.calls
    line = one_error_line(cli(env, "checkpoint", "big", token=ADMIN), 2)
    assert "HTTP 409" in line and "no checkpoint settings" in line and "checkpoint.dir" in line
    assert "'nope' not found" in one_error_line(cli(env, "checkpoint", "nope", token=ADMIN), 2)
    line = one_error_line(cli(env, "checkpoint", "pretrain", "--wait", "-1", token=ADMIN), 2)
    assert "HTTP 422" in line and "wait_seconds" in line
    assert env.backend.jobs["pretrain"].checkpoint_step == 1


def test_checkpoint_of_a_job_without_checkpoint_settings_is_the_409_line(tmp_path: Path) -> None:
    config = copy.deepcopy(CONFIG)
    config["jobs"][0].pop("checkpoint")
    e = make_env(f"sqlite:///{tmp_path / 'nockpt.db'}", config=config)
    try:
        e.tick(10.0)
        assert e.backend.jobs["pretrain"].phase == "Running"
        line = one_error_line(cli(e, "checkpoint", "pretrain", "--wait", "5", token=ADMIN), 2)
        assert line == ("error: HTTP 409 Conflict: job pretrain has no checkpoint settings; give it "
                        "checkpoint.dir to save one")
        assert not any(c[0] == "checkpoint" for c in e.backend.calls)
    finally:
        close_env(e)


def test_override_pins_replicas_for_a_while_and_clear_removes_it(env: Env) -> None:
    env.tick(10.0)
    res = cli(env, "override", "chat", "--replicas", "3", "--for", "2h", token=ADMIN)
    assert res.exit_code == 0 and "'chat' pinned to 3 replicas until" in res.stdout, res.stderr
    replicas, until = env.ctl.overrides["chat"]
    assert replicas == 3 and abs(until - (time.time() + 7200)) < 60
    env.tick(10.0)
    assert len(env.backend.service_gpus("chat")) == 3  # the policy alone says 1 at this load
    res = cli(env, "override", "chat", "--replicas", "2", "--until", "2030-01-01T00:00:00Z", token=ADMIN)
    assert res.exit_code == 0 and env.ctl.overrides["chat"] == (2, datetime(2030, 1, 1, tzinfo=UTC).timestamp())
    res = cli(env, "override", "chat", "--clear", token=ADMIN)
    assert res.stdout.strip() == "chat: override cleared; the policy decides" and env.ctl.overrides == {}
    env.tick(10.0)
    assert len(env.backend.service_gpus("chat")) == 1
    before, ctl_before = db_state(env.store), controller_state(env.ctl)
    line = one_error_line(cli(env, "override", "chat", "--replicas", "9", token=ADMIN), 2)
    assert "HTTP 422" in line and "replicas: 9 is outside [1, 6]" in line
    assert "'ghost' not found" in one_error_line(cli(env, "override", "ghost", "--clear", token=ADMIN), 2)
    assert "positive duration" in one_error_line(cli(env, "override", "chat", "--replicas", "2", "--for", "soon",
                                                     token=ADMIN), 2)
    assert "no UTC offset" in one_error_line(cli(env, "override", "chat", "--replicas", "2", "--until",
                                                 "2030-01-01T00:00:00", token=ADMIN), 2)
    assert "--replicas N" in one_error_line(cli(env, "override", "chat", token=ADMIN), 2)
    assert db_state(env.store) == before and controller_state(env.ctl) == ctl_before
    assert [a for _, a, _ in _audit(env)] == ["service.override", "service.override", "service.override.clear"]


def test_controller_pause_and_resume_change_the_controller(env: Env) -> None:
    env.tick(10.0)
    res = cli(env, "controller", "pause", token=ADMIN)
    assert res.stdout.strip() == "controller ctl-a of pool p: paused" and env.ctl.paused
    env.clock.t += 20
    assert env.ctl.tick().reason == "Paused"
    res = cli(env, "controller", "resume", "--json", token=ADMIN)
    assert '"paused": false' in res.stdout and not env.ctl.paused
    assert _audit(env) == [("alice", "controller.pause", "pool/p"), ("alice", "controller.resume", "pool/p")]


WRITES = [
    ("rescale", "pretrain", "--layout", "tp1.pp1.dp2"),
    ("rescale", "pretrain", "--unpin"),
    ("checkpoint", "pretrain"),
    ("override", "chat", "--replicas", "2"),
    ("override", "chat", "--clear"),
    ("controller", "pause"),
    ("controller", "resume"),
]


def test_writes_without_an_admin_token_exit_2_name_the_token_and_change_nothing(env: Env) -> None:
    env.tick(10.0)
    before, ctl_before, calls = db_state(env.store), controller_state(env.ctl), list(env.backend.calls)
    for args in WRITES:
        line = one_error_line(cli(env, *args), 2)
        assert "HTTP 401" in line and "no token was sent" in line and "'admin' token" in line, line
        assert "ELASTIC_TOKEN" in line
    for args in WRITES[::3]:  # rescale, override, resume: the same gate answers every write
        line = one_error_line(cli(env, *args, token=READER), 2)
        assert "HTTP 403" in line and "role 'read'" in line and "'admin' token" in line, line
    line = one_error_line(cli(env, *WRITES[0], token="not-a-known-token-at-all"), 2)
    assert "HTTP 401" in line and "unknown bearer token" in line and "not-a-known" not in line, line
    assert db_state(env.store) == before and controller_state(env.ctl) == ctl_before
    assert env.backend.calls == calls


def test_reads_ask_for_a_token_when_the_server_requires_one(tmp_path: Path) -> None:
    e = make_env(f"sqlite:///{tmp_path / 'closed.db'}", require_auth_for_reads=True)
    try:
        e.tick(10.0)
        line = one_error_line(cli(e, "get", "jobs"), 2)
        assert "HTTP 401" in line and "reads need a bearer token" in line and "--token or ELASTIC_TOKEN" in line
        assert "admin" not in line.split("ELASTIC_TOKEN")[0].split("no token was sent")[-1]  # any token will do
        assert _row(cli(e, "get", "jobs", token=READER), "pretrain", "p", "Running")
        assert _row(cli(e, "get", "jobs", "--token", READER), "pretrain", "p", "Running")  # the option, not env
    finally:
        close_env(e)


# ---- the server's side: exit 1 ---------------------------------------------------------------------------

def test_a_server_error_is_one_line_exit_1(env: Env) -> None:
    import sqlalchemy as sa

    env.tick(10.0)
    api = env.server.config.app.state.api
    broken = Path(env.store.url.removeprefix("sqlite:///")).parent / "missing-dir" / "x.db"
    api.store = db.Store(sa.create_engine(f"sqlite:///{broken}"))
    line = one_error_line(cli(env, "get", "pools"), 1)
    assert line.startswith("error: HTTP 503") and "unavailable" in line
    assert one_error_line(cli(env, "status"), 1).startswith("error: HTTP 503")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_or_silent_api_is_one_line_exit_1() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    line = one_error_line(cli(url, "status"), 1)
    assert f"cannot reach the admin API at {url}" in line and "elastic serve" in line and "ELASTIC_API" in line
    assert one_error_line(cli(url, "controller", "pause", token=ADMIN), 1).startswith("error: cannot reach")
    # a socket that accepts connections and never answers: --timeout bounds the wait
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        line = one_error_line(cli(url, "get", "jobs", "--timeout", "0.3"), 1)
        assert time.monotonic() - t0 < 5 and "no answer within 0.3 s" in line and "--timeout" in line
    assert "not a usable URL" in one_error_line(cli("localhost:8080", "status"), 2)
    assert "--timeout=0" in one_error_line(cli(url, "status", "--timeout", "0"), 2)


# ---- as a real process ---------------------------------------------------------------------------------

def _elastic(*args: str, **env: str) -> subprocess.Popen[str]:
    """``elastic *args`` as a real process of this venv's console script (started, not waited for)."""
    base = {k: v for k, v in os.environ.items() if k not in ("ELASTIC_API", "ELASTIC_TOKEN")}
    return subprocess.Popen([str(ELASTIC), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**base, "COLUMNS": "220", **env})


def _finished(p: subprocess.Popen[str]) -> tuple[int, str, list[str]]:
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return p.returncode, out, err.strip().splitlines()


def test_the_installed_command_talks_to_the_api_with_exit_codes_and_one_line_errors(env: Env) -> None:
    assert ELASTIC.exists(), f"{ELASTIC}: install the package into this venv (make venv)"
    env.tick(10.0)
    unreachable = f"http://127.0.0.1:{_free_port()}"
    # three processes at once (each pays the interpreter's start-up): a write, a 404, no server
    pause = _elastic("controller", "pause", ELASTIC_API=env.url, ELASTIC_TOKEN=ADMIN)
    missing = _elastic("rescale", "nope", "--layout", "tp1.pp1.dp2", "--api", env.url, ELASTIC_TOKEN=ADMIN)
    down = _elastic("status", ELASTIC_API=unreachable)
    code, out, err = _finished(pause)
    assert code == 0 and out.strip() == "controller ctl-a of pool p: paused" and err == [], err
    assert env.ctl.paused
    code, out, err = _finished(missing)
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("error: HTTP 404") and "training job 'nope' not found" in err[0]
    code, out, err = _finished(down)
    assert code == 1 and out == "" and len(err) == 1 and unreachable in err[0] and "elastic serve" in err[0], err
    # the only write that got through is the pause: the 404 changed nothing
    assert _audit(env) == [("alice", "controller.pause", "pool/p")] and env.ctl.pinned == {}


# ---- input parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("until, for_, needle", [(None, "0s", "positive"), (None, "-5m", "positive"),
                                                 ("tomorrow", None, "RFC 3339"), ("2030-01-01", "1h", "not both")])
def test_bad_override_ends(until: str | None, for_: str | None, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        override_until(until, for_, datetime(2030, 1, 1, tzinfo=UTC))


def test_override_end_defaults_to_an_hour_and_keeps_the_offset() -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    assert override_until(None, None, now) == datetime(2030, 1, 1, 13, tzinfo=UTC)
    t = override_until("2030-01-02T00:00:00+02:00", None, now)
    assert t.utcoffset() == timedelta(hours=2)
