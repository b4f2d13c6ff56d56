"""One job's coordinator in a process of its own: ``python -m elastic.train.rendezvous.host``.

What it is for: on Kubernetes a job's :class:`~elastic.train.rendezvous.Coordinator` runs in a
CPU pod of its own, so the operator can restart without the job losing its rendezvous (as Ray's
detached coordinator actor does). This process serves that one coordinator -- workers and the
controller on one port; the controller through the admin route and
:class:`~elastic.train.rendezvous.remote.CoordinatorClient` -- until it is stopped: an admin
``stop``, SIGTERM or SIGINT stop the coordinator and the process exits 0.

Its input is the environment (what a pod spec sets):

* ``ELASTIC_JOB``: the job's name.
* ``ELASTIC_JOB_SECRET``: the job's secret (16 characters or more), which every request carries.
* ``ELASTIC_COORDINATOR_SPEC``: ``{"config": <the job's config as config_json gives it>,
  "settings": <CoordinatorSettings.to_json()>}``.
* ``ELASTIC_COORDINATOR_PORT`` (29400; 0: any free port).
* ``ELASTIC_ADVERTISE_HOST``, else ``POD_IP``: the host the workers are told to reach; else the
  bind host when it is one address, else the address of this machine's hostname.
* ``ELASTIC_COORDINATOR_BIND``: the address to listen on; default the advertised host when one is
  given (the pod's IP), else ``0.0.0.0``.

Missing or bad input exits 2 with one line naming the variable and the fix.

What it must not do: decide anything about the job (the controller posts directives) or hold
state that a restart of the controller needs beyond what the coordinator and the admin route keep.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from elastic.logs import setup_from_env
from elastic.model import SpecError
from elastic.train.rendezvous.coordinator import Coordinator
from elastic.train.rendezvous.messages import SECRET_ENV
from elastic.train.rendezvous.remote import admin_desk
from elastic.train.rendezvous.settings import CoordinatorSettings

log = logging.getLogger("elastic.train.rendezvous.host")  # not __main__: it runs with -m

JOB_ENV = "ELASTIC_JOB"
SPEC_ENV = "ELASTIC_COORDINATOR_SPEC"
PORT_ENV = "ELASTIC_COORDINATOR_PORT"
BIND_ENV = "ELASTIC_COORDINATOR_BIND"
ADVERTISE_ENV = "ELASTIC_ADVERTISE_HOST"
POD_IP_ENV = "POD_IP"
DEFAULT_PORT = 29400
DEFAULT_BIND = "0.0.0.0"
MIN_SECRET = 16
_ANY_ADDRESS = ("0.0.0.0", "::", "")


class HostInputError(Exception):
    """The environment does not describe a coordinator to host; the message names the variable."""


@dataclass(frozen=True)
class HostInput:
    """What the environment says to host."""

    job: str
    secret: str
    config: dict[str, Any]
    settings: CoordinatorSettings
    bind: str
    port: int
    advertise_host: str


def read_input(env: Mapping[str, str]) -> HostInput:
    """The coordinator ``env`` describes; HostInputError naming the variable and the fix."""
    job = env.get(JOB_ENV, "").strip()
    if not job:
        raise HostInputError(f"{JOB_ENV} is not set: give the job's name")
    secret = env.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET:
        raise HostInputError(
            f"{SECRET_ENV} is {'not set' if not secret else 'too short'}: give the job's secret, "
            f"at least {MIN_SECRET} characters (its workers and controller carry the same)"
        )
    config, settings = _read_spec(env.get(SPEC_ENV, ""))
    port_text = env.get(PORT_ENV, str(DEFAULT_PORT)).strip()
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise HostInputError(
            f"{PORT_ENV}={port_text!r}: give a TCP port, 0..65535 (0: any free port; default {DEFAULT_PORT})"
        )
    advertise = (env.get(ADVERTISE_ENV) or env.get(POD_IP_ENV) or "").strip()
    # the HTTP API and the TCPStore listen on the one address workers are told, not on every interface
    # of the node (the store has no authentication of its own), unless asked otherwise
    bind = env.get(BIND_ENV, "").strip() or advertise or DEFAULT_BIND
    if not advertise:
        advertise = bind if bind not in _ANY_ADDRESS else _own_address()
    return HostInput(job, secret, config, settings, bind, port, advertise)


def _read_spec(text: str) -> tuple[dict[str, Any], CoordinatorSettings]:
    fix = f'give {SPEC_ENV} as {{"config": {{...}}, "settings": {{...}}}} (the launcher writes it)'
    if not text.strip():
        raise HostInputError(f"{SPEC_ENV} is not set: {fix}")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise HostInputError(f"{SPEC_ENV} is not JSON ({e}): {fix}") from None
    if not isinstance(doc, dict):
        raise HostInputError(f"{SPEC_ENV} is a JSON {type(doc).__name__}, not an object: {fix}")
    if unknown := sorted(set(doc) - {"config", "settings"}):
        raise HostInputError(f"{SPEC_ENV}: unknown key(s) {', '.join(unknown)}: {fix}")
    config = doc.get("config")
    if not isinstance(config, dict):
        raise HostInputError(f"{SPEC_ENV}: config must be the job's config object: {fix}")
    settings_doc = doc.get("settings") or {}
    if not isinstance(settings_doc, dict):
        raise HostInputError(f"{SPEC_ENV}: settings must be an object (CoordinatorSettings.to_json()): {fix}")
    try:
        settings = settings_from_json(settings_doc)
    except (SpecError, TypeError) as e:
        raise HostInputError(f"{SPEC_ENV}: settings: {e}") from None
    return config, settings


def settings_from_json(d: Mapping[str, Any]) -> CoordinatorSettings:
    """The settings ``CoordinatorSettings.to_json`` wrote. A key that is no setting raises SpecError
    naming it (a launcher and a coordinator of different releases must not drop a rule silently)."""
    from elastic.train.checkpoint import CheckpointSettings

    d = dict(d)
    _check_keys("coordinator settings", d, CoordinatorSettings)
    ckpt = d.get("checkpoint")
    if ckpt is not None:
        if not isinstance(ckpt, Mapping):
            raise SpecError(f"coordinator settings: checkpoint must be an object (or null), got {ckpt!r}")
        _check_keys("coordinator settings: checkpoint", ckpt, CheckpointSettings)
        d["checkpoint"] = CheckpointSettings(**ckpt)
    return CoordinatorSettings(**d)


def _check_keys(what: str, d: Mapping[str, Any], kind: type) -> None:
    known = {f.name for f in fields(kind)}
    if unknown := sorted(set(d) - known):
        raise SpecError(f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise HostInputError(
            f"this machine's hostname has no address ({e}): set {ADVERTISE_ENV} (or {POD_IP_ENV}) "
            "to the address its workers reach"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Host one job's coordinator until it is stopped; 0 once stopped, 2 on bad input."""
    argparse.ArgumentParser(
        prog="python -m elastic.train.rendezvous.host",
        description="Serve one elastic training job's coordinator until it is stopped. Input from the "
        f"environment: {JOB_ENV}, {SECRET_ENV}, {SPEC_ENV}, {PORT_ENV} (default {DEFAULT_PORT}), "
        f"{ADVERTISE_ENV} or {POD_IP_ENV}, {BIND_ENV} (default the advertised host, else {DEFAULT_BIND}).",
    ).parse_args(argv)
    try:
        setup_from_env()
        inp = read_input(os.environ)
    except (HostInputError, SpecError) as e:
        print(f"coordinator host: {e}", file=sys.stderr)
        return 2
    coord = Coordinator(
        inp.job,
        inp.config,
        inp.settings,
        host=inp.bind,
        port=inp.port,
        advertise_host=inp.advertise_host,
        secret=inp.secret,
    )
    try:
        coord.start()
    except OSError as e:
        print(
            f"coordinator host: cannot serve on {inp.bind}:{inp.port} ({e}): choose another {PORT_ENV} "
            f"or {BIND_ENV}",
            file=sys.stderr,
        )
        return 2
    except SpecError as e:  # e.g. a checkpoint directory it cannot write
        print(f"coordinator host: job {inp.job}: {e}", file=sys.stderr)
        coord.stop()
        return 2
    desk = admin_desk(coord)
    signalled: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        # only a flag: the main thread may hold the event's lock when a signal lands
        signalled.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    log.info("coordinator for job %s serving at %s", inp.job, coord.url)
    while not signalled and not desk.ended.wait(0.5):
        pass
    log.info(
        "coordinator for job %s stopping (%s)",
        inp.job,
        f"signal {signal.Signals(signalled[0]).name}" if signalled else "stopped by its controller",
    )
    coord.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
