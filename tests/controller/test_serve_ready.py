"""Readiness: a controller whose PostgreSQL goes away stops acting, says why (``ready`` False, ``/readyz``
503 with the reason) and never raises out of its loop; the fake backend (our boundary) stands in for Ray."""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from elastic import store as db
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource

from .fake_backend import FakeBackend

_n = itertools.count()

CONFIG = {
    "pool": {"name": "ready", "nodes": 1, "gpus_per_node": 8, "hardware": "h100-80g"},
    "services": [{"name": "chat", "min_replicas": 1, "max_replicas": 4,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "controller": {"tick_seconds": 1},
}


@pytest.fixture
def doomed_db(postgres_url: str):
    """A database of its own on the session server, which the test then drops under the controller."""
    name = f"doomed_{next(_n)}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    url = postgres_url.rsplit("/", 1)[0] + f"/{name}"

    def drop() -> None:
        with admin.connect() as c:
            c.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))

    yield url, drop
    drop()
    admin.dispose()


def test_lost_database_makes_the_controller_not_ready_and_readyz_503(doomed_db) -> None:
    from elastic.api.app import create_app
    from elastic.api.auth import TokenSet

    url, drop = doomed_db
    db.upgrade(url)
    store = db.Store.from_url(url, connect_timeout=2)
    source = InProcessSource(max_age=600)
    ctl = Controller(load_config(data=CONFIG), FakeBackend({"n0": 8}), store, {"chat": source}, owner="r")
    client = TestClient(create_app(store, ctl, tokens=TokenSet()))
    source.set("chat", 10.0, ctl.clock())
    assert ctl.tick().acted and ctl.ready
    assert client.get("/readyz").status_code == 200

    drop()
    res = ctl.tick()  # must not raise
    assert not res.acted and res.reason == "Unavailable" and not ctl.ready
    assert "StoreUnavailable" in (ctl.last_error or ""), ctl.last_error
    r = client.get("/readyz")
    assert r.status_code == 503, r.text
    store.dispose()
