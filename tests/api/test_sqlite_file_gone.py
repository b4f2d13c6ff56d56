"""A SQLite file removed or replaced under a running controller: it stops acting and goes
not-ready, instead of writing on into an unlinked file that a restart would never find."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic import store as db

from .conftest import READER, Env, close_env, make_env


@pytest.fixture
def sqlite_env(tmp_path: Path) -> Iterator[Env]:
    env = make_env(f"sqlite:///{tmp_path / 'elastic.db'}")
    try:
        yield env
    finally:
        close_env(env)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_the_controller_stops_acting_and_readyz_says_why(sqlite_env: Env, tmp_path: Path, how: str) -> None:
    env = sqlite_env
    env.tick(5.0)
    assert env.get("/readyz").status_code == 200
    path = tmp_path / "elastic.db"
    if how == "removed":
        os.remove(path)
    else:
        shutil.copy(path, tmp_path / "copy.db")
        os.replace(tmp_path / "copy.db", path)
    with pytest.raises(db.StoreUnavailable, match=f"its file {path} was {how}"):
        env.store.ping()
    res = env.ctl.tick()
    assert res.reason == "Unavailable" and f"was {how}" in (res.error or "")
    assert not env.ctl.ready
    r = env.get("/readyz", READER)
    assert r.status_code == 503 and f"was {how}" in r.json()["detail"], r.text
    assert env.get("/readyz").json()["detail"] == "not ready: database: unavailable; controller: not acting"


def test_a_file_not_created_yet_is_not_an_error(tmp_path: Path) -> None:
    store = db.Store.from_url(f"sqlite:///{tmp_path / 'new.db'}")
    store.ping()  # SQLite creates it on the first connection
    assert (tmp_path / "new.db").exists()
    store.ping()
    store.dispose()
