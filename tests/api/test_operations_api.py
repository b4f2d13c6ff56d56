"""The decision log as runs of holds, the state database's size and oldest rows: through the
admin API, ``/metrics`` and the ``elastic decisions`` / ``elastic status`` commands (real
uvicorn, real store, real Controller over the fake backend)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic import store as db
from elastic.cli.admin import when

from .conftest import READER, Env, close_env, make_env
from .test_cli_client import _lines, cli


def _history(env: Env) -> tuple[list[db.DecisionRecord], list[db.DecisionRecord]]:
    """Two changes, each followed by a run of identical holds. Returns (all rows, changes), oldest first."""
    env.tick(10.0)  # starts: inference 1, training 6
    for _ in range(3):
        env.tick(10.0)  # holds
    env.tick(40.0)  # scale up, training shrinks
    for _ in range(2):
        env.tick(40.0)
    rows = db.list_decisions(env.store, 100)
    return rows, [r for r in rows if r.hold is None]


def test_decisions_are_changes_and_runs_of_holds_with_count_and_first_last_time(env: Env) -> None:
    rows, changes = _history(env)
    assert [r.hold is None for r in rows] == [True, False, True, False]
    assert [r.count for r in rows] == [1, 3, 1, 2]
    body = env.get("/api/v1/decisions", params={"order": "asc"}).json()
    items = body["items"]
    assert [(d["id"], d["hold"], d["count"]) for d in items] == [(r.id, r.hold is not None, r.count) for r in rows]
    run = items[1]
    assert run["first_at"] == run["tick_at"] and run["last_at"] > run["first_at"]
    assert [d["id"] for d in env.get("/api/v1/decisions", params={"changes": "true"}).json()["items"]] == \
        [r.id for r in reversed(changes)]  # latest change first
    # paging the changes only: the token belongs to that listing
    page = env.get("/api/v1/decisions", params={"changes": "true", "limit": 1}).json()
    nxt = env.get("/api/v1/decisions", params={"changes": "true", "limit": 1,
                                               "continue": page["metadata"]["continue"]}).json()
    assert [d["id"] for d in page["items"] + nxt["items"]] == [r.id for r in reversed(changes)]
    mixed = env.get("/api/v1/decisions", params={"limit": 1, "continue": page["metadata"]["continue"]})
    assert mixed.status_code == 400 and "continue" in mixed.json()["field"]


def _metric(text: str, name: str) -> dict[tuple[str, ...], float]:
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return {tuple(s.labels.values()): s.value for s in fam.samples}
    return {}


def test_database_size_and_oldest_rows_in_the_api_and_metrics(env: Env) -> None:
    rows, _ = _history(env)
    info = env.get("/api/v1/database").json()
    assert info["dialect"] == env.store.dialect and info["size_bytes"] == db.database_size(env.store) > 0
    tables = {t["table"]: t for t in info["tables"]}
    assert set(tables) == {"decisions", "allocations", "audit", "reshards", "actions"}
    assert tables["decisions"]["rows"] == len(rows) and tables["decisions"]["oldest"].startswith("2023-11-14T22:")
    assert (tables["decisions"]["retention_days"], tables["audit"]["retention_days"],
            tables["reshards"]["retention_days"]) == (30, 365, None)
    text = env.get("/metrics").text
    assert _metric(text, "elastic_store_size_bytes")[()] > 0
    assert _metric(text, "elastic_store_rows")[("decisions",)] == len(rows)
    assert _metric(text, "elastic_store_oldest_row_timestamp_seconds")[("decisions",)] == \
        rows[0].tick_at.timestamp()
    assert ("audit",) not in _metric(text, "elastic_store_oldest_row_timestamp_seconds")  # empty: no sample


def test_database_needs_a_token_when_reads_do(db_url: str) -> None:
    e = make_env(db_url, require_auth_for_reads=True)
    try:
        assert e.get("/api/v1/database").status_code == 401
        assert e.get("/api/v1/database", token=READER).status_code == 200
    finally:
        close_env(e)


def test_a_refused_write_is_one_info_line(env: Env, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="elastic.api"):
        r = env.send("POST", "/api/v1/jobs/pretrain/rescale", json={"layout": "tp9.pp1.dp1"})
    assert r.status_code == 422
    refused = [m for m in caplog.messages if m.startswith("refused POST /api/v1/jobs/pretrain/rescale: 422")]
    assert len(refused) == 1 and "layout" in refused[0]


@pytest.fixture
def cli_env(tmp_path: Path) -> Iterator[Env]:
    e = make_env(f"sqlite:///{tmp_path / 'cli.db'}")
    try:
        yield e
    finally:
        close_env(e)


def test_cli_decisions_shows_latest_changes_and_all_shows_runs_as_x_n(cli_env: Env) -> None:
    rows, changes = _history(cli_env)
    ids = [int(line.split()[0]) for line in _lines(cli(cli_env, "decisions")) if line[:1].isdigit()]
    assert ids == [r.id for r in reversed(changes)]
    res = cli(cli_env, "decisions", "--all")
    assert [int(line.split()[0]) for line in _lines(res) if line[:1].isdigit()] == [r.id for r in reversed(rows)]
    run = next(r for r in rows if r.count == 3)
    line = next(line for line in _lines(res) if line.startswith(str(run.id)))
    first, last = when(run.tick_at.isoformat()), when(run.last_at.isoformat())
    assert f"{first} .. {last[11:]} x 3" in line and "hold" in line, line


def test_cli_decisions_says_when_there_is_no_change_yet(cli_env: Env) -> None:
    assert "no changes on record; --all shows the holds too" in cli(cli_env, "decisions").stdout


def test_cli_status_shows_the_database_size_and_oldest_rows(cli_env: Env) -> None:
    rows, _ = _history(cli_env)
    lines = _lines(cli(cli_env, "status"))
    db_line = next(line for line in lines if line.startswith("database"))
    assert "sqlite, " in db_line and ("KiB" in db_line or "MiB" in db_line)
    table = {line.split()[0]: line for line in lines if " rows, oldest " in line}
    assert f"{len(rows)} rows, oldest {when(rows[0].tick_at.isoformat())}, kept 30 d" in table["decisions"]
    assert "0 rows, oldest -, kept 365 d" in table["audit"]
    assert table["reshards"].endswith(", kept")
