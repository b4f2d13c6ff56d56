"""Request bodies are bounded (413 before a large body is read whole), a bad value is never
echoed back whole, and a value that would only fail later (an override's end past what can be
stored) is refused when it is given."""

from __future__ import annotations

import socket

import pytest

from .conftest import ADMIN, Env, assert_problem, db_state

SPEC = {"name": "summarise", "min_replicas": 0, "max_replicas": 2, "metric": {"preset": "vllm-running", "target": 5}}


def test_a_body_over_the_limit_is_refused_and_nothing_changes(env: Env) -> None:
    before = db_state(env.store)
    big = {"pool": "p", "spec": {**SPEC, "name": "x" * (2 << 20)}}
    body = assert_problem(env.send("POST", "/api/v1/services", ADMIN, json=big), 413, field="body",
                          needle="at most 1048576 bytes")
    assert len(str(body)) < 2000
    assert db_state(env.store) == before
    # a body within the limit is read and judged on its content
    assert env.send("POST", "/api/v1/services", ADMIN, json={"pool": "p", "spec": SPEC}).status_code == 201


def test_a_chunked_body_over_the_limit_is_refused_without_a_content_length(env: Env) -> None:
    def chunks():
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB in all, no Content-Length

    r = env.send("POST", "/api/v1/services", ADMIN, content=chunks(), headers={"Content-Type": "application/json"})
    assert_problem(r, 413, field="body", needle="more than 1048576")


def test_an_unauthenticated_client_learns_nothing_however_large_its_body(env: Env) -> None:
    host, port = env.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /api/v1/services HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n")
        head = s.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 401"), head  # authentication first, before any body


def test_a_huge_bad_value_is_not_echoed_back_whole(env: Env) -> None:
    name = "y" * 200_000
    r = env.send("POST", "/api/v1/services", ADMIN, json={"pool": name, "spec": SPEC})
    assert r.status_code == 422 and len(r.text) < 5000, (r.status_code, len(r.text))


def test_an_override_until_past_the_last_representable_time_is_refused_naming_it(env: Env) -> None:
    from .conftest import controller_state

    env.tick(5.0)
    before = controller_state(env.ctl)
    r = env.send("PUT", "/api/v1/services/chat/override", ADMIN,
                 json={"replicas": 2, "until": "9999-12-31T23:59:59-23:59"})
    assert_problem(r, 422, field="until", needle="too far in the future")
    assert controller_state(env.ctl) == before
    assert env.get("/api/v1/controller", ADMIN).status_code == 200


@pytest.mark.parametrize("after", [2**63, 10**30, -1, True])
def test_a_continue_token_with_an_id_no_row_can_have_is_refused(env: Env, after: object) -> None:
    # minted with the server's own key, as a forger who knew it would: still a 400, never a 500
    codec = env.server.config.app.state.api.codec
    token = codec.encode(after, {"pool": None, "order": "desc"})  # type: ignore[arg-type]
    assert env.get("/api/v1/decisions", ADMIN, params={"continue": codec.encode(0, {"pool": None, "order": "desc"})}).status_code == 200
    r = env.get("/api/v1/decisions", ADMIN, params={"continue": token})
    assert_problem(r, 400, field="continue")
