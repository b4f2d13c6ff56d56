"""One logging set-up for every elastic process: ``elastic serve``, the operator, the workers.

What it is for: ``setup(level, fmt)`` configures the root logger once, the same way
everywhere, so an operator reads one kind of log:

* ``level`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) for our own loggers (``elastic.*``,
  ``operators.*``). At ``INFO`` they say what changed and why, one line each: a decision that
  acts, a rescale with its layout, bytes and pause, a hold that is not plain steady state,
  a refused request, a lease gained or lost.
* third-party loggers that log every request or poll (``httpx``, ``urllib3``, ``kubernetes``,
  ``aiohttp.access``, ``uvicorn.access``, ``kopf``'s per-object chatter, ``ray``) at
  ``WARNING``, unless the level asked for is ``DEBUG``: then everything speaks.
* ``fmt``: ``text`` (one human line) or ``json`` (one JSON object per line, for log
  shippers: ``time``, ``level``, ``logger``, ``message``, and ``exc`` with a traceback).

``setup_from_env()`` reads ``ELASTIC_LOG_LEVEL`` / ``ELASTIC_LOG_FORMAT`` (what a worker or
the operator gets from its pod spec). Bad values raise ``SpecError`` naming the option and
the values it takes.

What it must not do: decide what is worth logging (the callers do), or install handlers
twice: calling ``setup`` again replaces the handler it installed before.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import IO, Any

from elastic.model import SpecError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
LEVEL_ENV = "ELASTIC_LOG_LEVEL"
FORMAT_ENV = "ELASTIC_LOG_FORMAT"
#: loggers of libraries that log each request, poll or watch event at INFO
NOISY = ("httpx", "httpcore", "urllib3", "kubernetes", "aiohttp.access", "aiohttp.server", "uvicorn.access",
         "uvicorn.error", "kopf", "kopf.objects", "kopf.activities", "asyncio", "ray", "filelock", "alembic")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_elastic_handler"  # set on the handler we install, so a second setup replaces it

# LogRecord attributes that are not "extra" fields a caller passed
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def check_level(level: str, option: str = "--log-level") -> str:
    """``level`` upper-cased, or SpecError naming ``option`` and the accepted values."""
    value = (level or "").strip().upper()
    if value == "WARN":
        value = "WARNING"
    if value not in LEVELS:
        raise SpecError(f"{option}: {level!r} is not a log level; use one of {', '.join(LEVELS)}")
    return value


def check_format(fmt: str, option: str = "--log-format") -> str:
    value = (fmt or "").strip().lower()
    if value not in FORMATS:
        raise SpecError(f"{option}: {fmt!r} is not a log format; use text (one line for people) or json "
                        "(one JSON object per line, for log shippers)")
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                doc[k] = v
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def setup(level: str = "INFO", fmt: str = "text", *, stream: IO[str] | None = None,
          replace_kopf: bool = False) -> logging.Handler:
    """Configure the root logger (see the module docstring); returns the handler installed.

    ``replace_kopf``: also take out the root handler ``kopf run`` installed, so that under Kopf
    every line is written once, in our format (the operator's start-up handler passes it)."""
    lvl, form = check_level(level), check_format(fmt)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False) or (replace_kopf and type(h).__module__.startswith("kopf")):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT_FORMAT))
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    root.setLevel(lvl)
    quiet_libraries()
    return handler


def quiet_libraries() -> None:
    """Put the libraries' loggers at WARNING again (NOTSET when the root logger is at DEBUG).

    Ray sets its own logger's level when it is imported: call this after ``import ray``."""
    debug = logging.getLogger().level <= logging.DEBUG
    for name in NOISY:
        # DEBUG asks for everything; otherwise a library's per-request lines stay out of the log
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)


def setup_from_env(default_level: str = "INFO", default_format: str = "text",
                   env: Mapping[str, str] | None = None, *, replace_kopf: bool = False) -> logging.Handler:
    """``setup`` with ``ELASTIC_LOG_LEVEL`` / ``ELASTIC_LOG_FORMAT`` (errors name the variable)."""
    e = os.environ if env is None else env
    level = check_level(e.get(LEVEL_ENV) or default_level, LEVEL_ENV)
    fmt = check_format(e.get(FORMAT_ENV) or default_format, FORMAT_ENV)
    return setup(level, fmt, replace_kopf=replace_kopf)
