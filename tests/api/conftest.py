"""Fixtures for the admin API tests: a real uvicorn server on loopback over a real store
(SQLite and PostgreSQL via ``db_url``) and a real Controller driving the fake backend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from elastic import store as db
from elastic.api import ApiServer, TokenSet, create_app, serve_api
from elastic.config import load_config
from elastic.controller import Controller
from elastic.metrics import InProcessSource
from elastic.metrics.exporter import Exporter
from elastic.store.models import Base
from tests.controller.fake_backend import FakeBackend
from tests.fakes import Clock

ADMIN = "admin-token-0123456789abcdef"
READER = "read-token-0123456789abcdef"
TOKEN_FILE = f"""# token role name
{ADMIN} admin alice
{READER} read grafana
"""
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z: the controller's (fake) clock starts here

CONFIG: dict[str, Any] = {
    "pool": {"name": "p", "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10},
                  "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64,
              "checkpoint": {"dir": "/checkpoints"}},
             {"name": "big", "model": "llama2-70b", "min_gpus": 4, "max_gpus": 8, "global_batch": 64,
              "priority": -1}],
    "controller": {"tick_seconds": 1},
}



@dataclass
class Env:
    store: db.Store
    ctl: Controller
    backend: FakeBackend
    source: InProcessSource
    clock: Clock
    server: ApiServer
    exporter: Exporter
    url: str
    http: httpx.Client = field(repr=False)

    def tick(self, load: float, dt: float = 20.0) -> Any:
        self.clock.t += dt
        self.source.set("chat", load, self.clock.t)
        res = self.ctl.tick()
        assert res.error is None, res.error
        self.exporter.observe_tick(res, self.ctl)
        return res

    def get(self, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        return self.http.get(path, headers=_auth(token), **kw)

    def send(self, method: str, path: str, token: str | None = ADMIN, **kw: Any) -> httpx.Response:
        headers = {**_auth(token), **kw.pop("headers", {})}
        return self.http.request(method, path, headers=headers, **kw)


_TLS = httpx.create_ssl_context()  # built once: tens of ms of CPU per client otherwise


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def make_env(db_url: str, *, operator_mode: bool = False, require_auth_for_reads: bool = False,
             config: dict[str, Any] | None = None, clock: Any = None) -> Env:
    """1. migrate + connect; 2. controller over the fake backend; 3. app; 4. uvicorn on a free port."""
    db.upgrade(db_url)
    store = db.Store.from_url(db_url)
    clock = clock or Clock(T0)
    backend = FakeBackend({"n0": 4, "n1": 4})
    source = InProcessSource(max_age=60)
    ctl = Controller(load_config(data=config or CONFIG), backend, store, {"chat": source}, owner="ctl-a",
                     clock=clock)
    exporter = Exporter()
    app = create_app(store, ctl, tokens=TokenSet.parse(TOKEN_FILE, "test tokens"), operator_mode=operator_mode,
                     registry=exporter.registry, require_auth_for_reads=require_auth_for_reads)
    server, _ = serve_api(app, "127.0.0.1", 0)
    http = httpx.Client(base_url=server.url, timeout=60, verify=_TLS)  # an entrypoint check imports torch: slow on a loaded machine
    return Env(store, ctl, backend, source, clock, server, exporter, server.url, http)


def close_env(env: Env) -> None:
    env.http.close()
    env.server.stop()
    env.store.dispose()


@pytest.fixture
def env(db_url: str) -> Iterator[Env]:
    e = make_env(db_url)
    try:
        yield e
    finally:
        close_env(e)


def db_state(store: db.Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, ordered: equal before and after means nothing changed."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with store.engine.connect() as conn:
        for table in Base.metadata.sorted_tables:
            rows = conn.execute(sa.select(table).order_by(*table.primary_key.columns)).all()
            out[table.name] = [tuple(repr(v) for v in r) for r in rows]
    return out


def controller_state(ctl: Controller) -> tuple[Any, ...]:
    return ctl.paused, dict(ctl.overrides), {k: dict(v) for k, v in ctl.pinned.items()}


def assert_problem(resp: httpx.Response, status: int, *, field: str | None = None, needle: str = "") -> dict:
    """A problem+json body with the RFC 9457 members, naming ``field`` and containing ``needle``."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/problem+json"), resp.headers
    body = resp.json()
    assert {"type", "title", "status", "detail"} <= body.keys(), body
    assert body["status"] == status and body["type"].startswith("urn:elastic:problem:"), body
    if field is not None:
        assert body.get("field") == field, body
        assert field in body["detail"], body
    assert needle.lower() in body["detail"].lower(), body
    return body
