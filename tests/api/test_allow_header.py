"""A method a path does not answer gets 405 with an ``Allow`` header naming every method it does
answer (RFC 9110), taken from the API's own OpenAPI document: the router alone named only the
methods of the first route that matched the path (``Allow: GET`` on a job that takes PUT and DELETE)."""

from __future__ import annotations

import re

import pytest

from .conftest import ADMIN, close_env, make_env

PROBES = ("PATCH", "PUT", "POST", "DELETE", "GET")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    e = make_env(f"sqlite:///{tmp_path_factory.mktemp('allow') / 'api.db'}")
    yield e
    close_env(e)


def test_405_names_every_method_of_the_path(env) -> None:
    paths = env.get("/openapi.json").json()["paths"]
    checked = 0
    for path, ops in paths.items():
        answered = {m.upper() for m in ops}
        probe = next((m for m in PROBES if m not in answered), None)
        if probe is None:
            continue
        url = re.sub(r"\{[^}]+\}", "x", path)
        r = env.send(probe, url, token=ADMIN, json={})
        assert r.status_code == 405, (probe, url, r.status_code, r.text)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert allow == answered, (probe, url, allow, answered)
        checked += 1
    assert checked >= 10, checked  # the API has that many paths with a method to refuse
