"""The shared logging set-up (``elastic.logs``): levels, JSON lines, third-party noise kept out."""

from __future__ import annotations

import io
import json
import logging

import pytest
from typer.testing import CliRunner

from elastic import logs
from elastic.model import SpecError


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    noisy = {n: logging.getLogger(n).level for n in logs.NOISY}
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    for n, lvl in noisy.items():
        logging.getLogger(n).setLevel(lvl)


def _emit() -> None:
    logging.getLogger("elastic.controller").info("decision InferenceDemand: scale up 1 -> 3")
    logging.getLogger("elastic.controller").debug("holding: steady")
    logging.getLogger("httpx").info('HTTP Request: GET http://127.0.0.1:9/metrics "HTTP/1.1 200 OK"')
    logging.getLogger("kopf.objects").info("Timer 'tick' succeeded.")
    logging.getLogger("urllib3.connectionpool").debug("Starting new HTTP connection (1): kube")
    logging.getLogger("httpx").warning("retrying after a reset")


def test_info_keeps_our_lines_and_drops_library_request_lines() -> None:
    out = io.StringIO()
    logs.setup("INFO", "text", stream=out)
    _emit()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("INFO elastic.controller: decision InferenceDemand: scale up 1 -> 3")
    assert lines[1].endswith("WARNING httpx: retrying after a reset")  # a library's warning still shows


def test_debug_lets_everything_speak() -> None:
    out = io.StringIO()
    logs.setup("debug", "text", stream=out)
    _emit()
    text = out.getvalue()
    assert "holding: steady" in text and "HTTP Request: GET" in text and "Timer 'tick'" in text
    assert "Starting new HTTP connection" in text


def test_json_is_one_object_per_line_with_time_level_logger_message_and_extras() -> None:
    out = io.StringIO()
    logs.setup("INFO", "json", stream=out)
    log = logging.getLogger("elastic.controller")
    log.info("rescaled %s: %d bytes", "gpt", 4096, extra={"job": "gpt"})
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("apply failed")
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(docs) == 2
    assert {k: docs[0][k] for k in ("level", "logger", "message", "job")} == {
        "level": "INFO", "logger": "elastic.controller", "message": "rescaled gpt: 4096 bytes", "job": "gpt"}
    assert docs[0]["time"].endswith("+00:00")
    assert docs[1]["level"] == "ERROR" and "RuntimeError: boom" in docs[1]["exc"]


def test_setup_twice_replaces_its_handler() -> None:
    a, b = io.StringIO(), io.StringIO()
    logs.setup("INFO", "text", stream=a)
    logs.setup("WARNING", "json", stream=b)
    logging.getLogger("elastic.x").warning("once")
    logging.getLogger("elastic.x").info("not at WARNING")
    assert a.getvalue() == "" and len(b.getvalue().splitlines()) == 1


@pytest.mark.parametrize("call, match", [
    (lambda: logs.setup("LOUD"), r"--log-level: 'LOUD' is not a log level; use one of DEBUG, INFO, WARNING, ERROR"),
    (lambda: logs.setup("INFO", "xml"), r"--log-format: 'xml' is not a log format; use text .* or json"),
    (lambda: logs.setup_from_env(env={"ELASTIC_LOG_LEVEL": "chatty"}), r"ELASTIC_LOG_LEVEL: 'chatty'"),
    (lambda: logs.setup_from_env(env={"ELASTIC_LOG_FORMAT": "yaml"}), r"ELASTIC_LOG_FORMAT: 'yaml'"),
])
def test_bad_values_name_the_option_and_the_values_it_takes(call, match) -> None:
    with pytest.raises(SpecError, match=match):
        call()


def test_env_settings_are_used() -> None:
    handler = logs.setup_from_env(env={"ELASTIC_LOG_LEVEL": "warn", "ELASTIC_LOG_FORMAT": "JSON"})
    assert isinstance(handler.formatter, logs.JsonFormatter) and logging.getLogger().level == logging.WARNING


def test_serve_refuses_a_bad_log_level_before_starting_anything(tmp_path) -> None:
    from elastic.cli import app

    wide = {"COLUMNS": "220"}
    res = CliRunner().invoke(app, ["serve", "--config", str(tmp_path / "absent.yaml"), "--log-level", "loud"], env=wide)
    assert res.exit_code == 2
    assert "--log-level: 'loud' is not a log level; use one of DEBUG, INFO, WARNING, ERROR" in res.output
    res = CliRunner().invoke(app, ["serve", "--config", str(tmp_path / "absent.yaml"), "--log-format", "xml"],
                             env=wide)
    assert res.exit_code == 2 and "--log-format: 'xml' is not a log format" in res.output


def test_under_kopf_each_line_is_written_once_in_our_format() -> None:
    from kopf._core.actions import loggers as kopf_loggers

    aio = logging.getLogger("asyncio")
    saved = aio.propagate, list(aio.handlers)
    kopf_loggers.configure(verbose=False)  # what `kopf run` does before importing the operator
    aio.propagate, aio.handlers[:] = saved[0], saved[1]
    kopf_handler = next(h for h in logging.getLogger().handlers if type(h).__module__.startswith("kopf"))
    kopf_out, ours = io.StringIO(), io.StringIO()
    kopf_handler.setStream(kopf_out)
    handler = logs.setup("INFO", "json", replace_kopf=True)
    handler.setStream(ours)
    assert kopf_handler not in logging.getLogger().handlers
    logging.getLogger("operators.runtime").info("pool gpus: ready")
    logging.getLogger("kopf.objects").info("Handler 'register' succeeded.")
    assert kopf_out.getvalue() == ""
    assert [json.loads(line)["message"] for line in ours.getvalue().splitlines()] == ["pool gpus: ready"]
