"""``elastic serve``: the controller loop for one pool on Ray, with the admin API and ``/metrics``.

What it is for: run the production loop from a config file (``examples/pool.yaml``):

1. load and validate the config, and check that every job has a layout within its GPU bounds
   (a bad file is one line on stderr, exit 2, nothing started);
2. migrate and open the state DB (SQLite file by default, PostgreSQL by URL);
3. connect the backend. Ray by default: ``--ray-address`` joins a running Ray cluster in
   *detached* mode (actors outlive this process; a restarted controller adopts them, see
   ``elastic.backends.ray``); without it an embedded local Ray with the pool's GPUs as
   logical GPUs is started (actors die with this process). ``--backend MODULE:FACTORY``
   brings a cluster adapter of one's own instead (as Ray's autoscaler takes an external
   node provider): ``FACTORY(pool)`` returns an object of the ``Backend`` protocol
   (``elastic.backends.base``); one that has a ``fence`` attribute gets the lease's fence;
   ``close()`` is called, if it has one, when the loop ends;
4. build one metric source per service from its ``metric`` spec (Prometheus, or a direct
   scrape of the service's replicas);
5. serve the admin API and ``/metrics`` (when ``elastic.api`` is installed), then tick
   every ``controller.tick_seconds`` until SIGTERM/SIGINT (or ``--ticks``).

The DB lease makes a second ``elastic serve`` on the same pool stand by until the first
one's lease expires. What it must not do: decide anything itself (the Controller does) or
start work before the config has been validated.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

log = logging.getLogger("elastic.serve")


@dataclass
class Served:
    """What ``build`` wired together (tests and ``run`` use it)."""

    cfg: Any
    store: Any
    backend: Any
    controller: Any
    exporter: Any = None
    external: bool = False  # a backend of one's own (``--backend MODULE:FACTORY``), not Ray


def default_owner() -> str:
    """A controller's lease identity: ``ELASTIC_CONTROLLER_ID``, else one of this process alone
    (host, pid and a random part). Two controllers sharing an identity would both take the lease
    as theirs and act at once; a restarted one waits out its predecessor's lease instead."""
    return os.environ.get("ELASTIC_CONTROLLER_ID") or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def connect_ray(pool: Any, ray_address: str | None) -> tuple[Any, bool]:
    """``ray.init`` for ``pool``: (ray module, detached?). Loopback only for the embedded Ray."""
    from elastic.train.ray_handle import LOCAL_RAY_ENV, init_local_ray

    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    from elastic.logs import quiet_libraries

    if ray_address is None:
        handle, detached = init_local_ray(num_gpus=pool.total_gpus), False
    else:
        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=f"elastic-{pool.name}", log_to_driver=False)
        handle, detached = ray, True
    quiet_libraries()  # ray.init put Ray's own logger back at INFO
    return handle, detached


RAY_BACKEND = "ray"


def backend_factory(spec: str) -> Callable[[Any], Any] | None:
    """What ``--backend`` names: None for the built-in Ray backend, else the callable
    ``MODULE:FACTORY`` (imported now). ``SpecError`` naming the option when it cannot be had."""
    from elastic.model import SpecError

    if spec == RAY_BACKEND:
        return None
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise SpecError(f"--backend: '{spec}' is neither '{RAY_BACKEND}' nor MODULE:FACTORY "
                        "(e.g. mypackage.cluster:make_backend, a callable taking the pool spec)")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix, one line
        raise SpecError(f"--backend: cannot import module '{module}' ({type(e).__name__}: {e}); "
                        "is it installed or on PYTHONPATH?") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise SpecError(f"--backend: module '{module}' has no '{attr}'; name its backend factory after the colon")
    if not callable(obj):
        raise SpecError(f"--backend: '{spec}' is not callable; name a function or class that takes the pool spec")
    return obj


def external_backend(factory: Callable[[Any], Any], pool: Any, spec: str) -> Any:
    """``factory(pool)``, checked to be a ``Backend`` (its missing members named)."""
    from elastic.backends.base import Backend
    from elastic.model import SpecError

    backend = factory(pool)
    if not isinstance(backend, Backend):
        required = ["name", *(n for n in dir(Backend) if not n.startswith("_"))]
        missing = [n for n in required if not hasattr(backend, n)]
        raise SpecError(f"--backend: {spec} returned a {type(backend).__name__}, not a backend: it lacks "
                        f"{', '.join(missing)} (see elastic.backends.base.Backend)")
    return backend


def build(cfg: Any, *, db_url: str, ray_address: str | None = None, owner: str | None = None,
          sources: Mapping[str, Any] | None = None, replica_config: Any = None, train_options: Any = None,
          clock: Callable[[], float] | None = None, throughput: Mapping[str, Any] | None = None,
          spare_workers: int = 0, spare_replicas: int = 0, config_source: str | None = None,
          backend: str = RAY_BACKEND) -> Served:
    """Steps 1b-4 of the module docstring. ``sources`` overrides the metric sources (tests);
    ``throughput``: the jobs' planner tables if the caller already computed them; ``backend``:
    as ``--backend``."""
    from elastic import store as db
    from elastic.backends.base import BackendUnavailable
    from elastic.controller import Controller, check_feasible, job_throughput_tables
    from elastic.metrics import build_source

    # 1b. every job must have a layout within its bounds (the planner; before anything starts),
    # and an adapter of one's own must be importable
    tables = dict(throughput) if throughput is not None else job_throughput_tables(cfg)
    check_feasible(cfg, tables)
    factory = backend_factory(backend)

    # 2. state
    migrated = db.upgrade(db_url)
    if migrated.applied:
        log.info("%s", migrated.describe())
    store = db.Store.from_url(db_url)
    # 3. cluster
    if factory is not None:
        actuator = external_backend(factory, cfg.pool, backend)
    else:
        from elastic.backends.ray import RayBackend

        try:
            ray, detached = connect_ray(cfg.pool, ray_address)
        except Exception as e:  # noqa: BLE001 - an unreachable cluster is a user-facing error, one line
            raise BackendUnavailable(f"cannot connect to Ray at {ray_address or 'a new local instance'}: {e}") from e
        actuator = RayBackend(cfg.pool, replica_config=replica_config, train_options=train_options,
                              local=ray_address is None, detached=detached,
                              namespace=ray.get_runtime_context().namespace if detached else None,
                              spare_workers=spare_workers, spare_replicas=spare_replicas)
    # 4. metric sources (a direct scrape asks the backend for the replicas' URLs)
    if sources is None:
        targets = getattr(actuator, "metric_targets", None) or actuator.service_targets
        sources = {s.name: build_source(s.metric, targets=targets)
                   for s in cfg.services if s.metric is not None}
    kw = {"clock": clock} if clock is not None else {}
    ctl = Controller(cfg, actuator, store, sources, owner=owner or default_owner(), throughput=tables,
                     config_source=config_source, **kw)
    exporter = None
    try:
        from elastic.metrics.exporter import Exporter

        exporter = Exporter()
    except ImportError:  # pragma: no cover - the exporter ships with the package
        pass
    return Served(cfg, store, actuator, ctl, exporter, external=factory is not None)


def start_api(served: Served, port: int, tokens: Any, *, host: str = "127.0.0.1",
              auth_reads: bool = False, max_body_bytes: int | None = None,
              model_dir: str | None = None) -> int | None:
    """Step 5a: the admin API on ``host``:``port`` (0 = any free port) with ``tokens`` (a TokenSet,
    loaded and checked in step 1); ``auth_reads``: reads need a token too. Returns the port, None if absent."""
    try:
        from elastic.api.app import create_app
        from elastic.api.server import serve_api
    except ImportError:  # pragma: no cover
        log.warning("elastic.api is not installed: no admin API")
        return None
    app = create_app(served.store, served.controller, tokens=tokens, require_auth_for_reads=auth_reads,
                     registry=served.exporter.registry if served.exporter is not None else None,
                     **({"max_body_bytes": max_body_bytes} if max_body_bytes is not None else {}),
                     **({"model_dir": model_dir} if model_dir is not None else {}))
    server, _ = serve_api(app, host, port)
    return int(getattr(server, "port", port))


def run(served: Served, *, ticks: int | None = None, stop: threading.Event | None = None,
        on_tick: Callable[[Any], None] | None = None) -> int:
    """Step 5b: tick until ``stop`` is set (or ``ticks`` ticks). Returns the number of ticks."""
    ctl = served.controller
    stop = stop or threading.Event()
    n = 0
    last_error: str | None = None
    while not stop.is_set():
        started = ctl.clock()
        res = ctl.tick()
        n += 1
        if served.exporter is not None:
            try:
                served.exporter.observe_tick(res, ctl)
            except Exception:  # noqa: BLE001 - metrics must never stop the loop
                log.exception("exporter failed")
        if on_tick is not None:
            on_tick(res)
        if res.error and res.error != last_error:  # once while the same error lasts
            log.warning("tick: %s: %s", res.reason, res.error)
        last_error = res.error
        if ticks is not None and n >= ticks:
            break
        ctl.housekeep()  # retention, between ticks, on the lease holder only
        stop.wait(max(0.0, ctl.cfg.controller.tick_seconds - (ctl.clock() - started)))
    return n


def close(served: Served) -> None:
    """Release the lease; stop embedded workloads, leave detached ones to the next controller
    (a backend of one's own: its ``close()``, if it has one)."""
    served.controller.release_lease()
    b = served.backend
    if served.external:
        getattr(b, "close", lambda: None)()
    elif b.detached:
        b.detach()
    else:
        b.shutdown()
    served.store.dispose()


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        config: Path = typer.Option(..., "--config", "-c", help="pool/services/jobs YAML (see examples/pool.yaml)"),
        db_url: str = typer.Option("sqlite:///./elastic.db", "--db", envvar="ELASTIC_DB_URL",
                                   help="state database URL (SQLite file or postgresql+psycopg://...)"),
        api_port: int = typer.Option(8080, "--api-port", help="admin API and /metrics port; -1 = none"),
        api_host: str = typer.Option("127.0.0.1", "--api-host", envvar="ELASTIC_API_HOST",
                                     help="address the admin API listens on (0.0.0.0: every interface; "
                                          "writes need an admin token from --token-file)"),
        token_file: str | None = typer.Option(None, "--token-file", help="admin API bearer tokens file"),
        auth_reads: bool = typer.Option(False, "--auth-reads", envvar="ELASTIC_API_AUTH_READS",
                                        help="reads of /api/v1 need a token too (read or admin); /healthz, "
                                             "/readyz and /metrics stay open"),
        max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", envvar="ELASTIC_API_MAX_BODY_BYTES", min=1024,
                                           help="largest request body the admin API takes (413 above it)"),
        model_dir: str | None = typer.Option(None, "--model-dir", envvar="ELASTIC_MODEL_DIR",
                                             help="the only directory model files named through the admin API are "
                                                  "read from (default ./models; the config file's own are trusted)"),
        ray_address: str | None = typer.Option(None, "--ray-address", envvar="ELASTIC_RAY_ADDRESS",
                                               help="join this Ray cluster (detached actors); none = embedded"),
        backend: str = typer.Option(RAY_BACKEND, "--backend",
                                    help="ray, or MODULE:FACTORY: a cluster adapter of your own, FACTORY(pool) "
                                         "returning an elastic.backends.base.Backend"),
        owner: str | None = typer.Option(None, "--owner", help="lease identity (default: $ELASTIC_CONTROLLER_ID, "
                                                               "else one for this process alone)"),
        ticks: int | None = typer.Option(None, "--ticks", min=1, help="stop after this many ticks"),
        log_level: str = typer.Option("INFO", "--log-level", envvar="ELASTIC_LOG_LEVEL",
                                      help="DEBUG, INFO, WARNING or ERROR; below DEBUG, libraries' per-request "
                                           "lines (httpx, urllib3, ...) stay out"),
        log_format: str = typer.Option("text", "--log-format", envvar="ELASTIC_LOG_FORMAT",
                                       help="text, or json: one JSON object per line for log shippers"),
        spare_workers: int = typer.Option(0, "--spare-workers", min=0,
                                          help="per job, training workers kept started without a GPU (torch "
                                               "imported) to join the next grow at once; embedded Ray only"),
        spare_replicas: int = typer.Option(0, "--spare-replicas", min=0,
                                           help="per service, reference replicas kept started without a GPU "
                                                "(model loaded) to serve the next scale-up at once; embedded "
                                                "Ray only"),
    ) -> None:
        """Run the controller loop: observe -> decide -> apply -> record, every tick_seconds."""
        from elastic.cli import console
        from elastic.config import load_config
        from elastic.controller import check_feasible, job_throughput_tables
        from elastic.logs import check_format, check_level, setup
        from elastic.model import SpecError

        try:
            log_level, log_format = check_level(log_level), check_format(log_format)
        except SpecError as e:
            option, _, why = str(e).partition(": ")
            raise typer.BadParameter(why, param_hint=option) from None
        if ray_address is not None and (spare_workers or spare_replicas):
            raise typer.BadParameter("spares are kept by the embedded Ray only (detached actors on a cluster "
                                     "cannot take them over); drop --ray-address or the --spare-* options",
                                     param_hint="--spare-workers/--spare-replicas")
        if backend != RAY_BACKEND and (ray_address is not None or spare_workers or spare_replicas):
            raise typer.BadParameter("--ray-address and the --spare-* options are the Ray backend's; drop them "
                                     "or --backend", param_hint="--backend")
        from elastic.api.auth import TokenSet

        # 1. the config and the API tokens are validated before anything starts (SpecError -> one line, exit 2)
        tokens = TokenSet.load(token_file)
        if auth_reads and len(tokens) == 0:
            raise typer.BadParameter("with reads behind a token and no tokens nobody could read the API; "
                                     "give --token-file (or ELASTIC_API_TOKENS), or drop --auth-reads",
                                     param_hint="--auth-reads")
        cfg = load_config(config)
        tables = job_throughput_tables(cfg)
        check_feasible(cfg, tables)
        try:
            backend_factory(backend)
        except SpecError as e:
            raise typer.BadParameter(str(e).removeprefix("--backend: "), param_hint="--backend") from None
        setup(log_level, log_format)
        served = build(cfg, db_url=db_url, ray_address=ray_address, owner=owner, throughput=tables,
                       config_source=str(config), backend=backend,
                       spare_workers=spare_workers, spare_replicas=spare_replicas)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            port = (start_api(served, api_port, tokens, host=api_host, auth_reads=auth_reads,
                              max_body_bytes=max_body_bytes, model_dir=model_dir)
                    if api_port >= 0 else None)
            console.print(f"elastic serve: pool {cfg.pool.name} ({cfg.pool.total_gpus} GPUs), "
                          f"{len(cfg.services)} service(s), {len(cfg.jobs)} job(s), owner {served.controller.owner}"
                          + (f", API on http://{api_host}:{port}" if port else ""))
            run(served, ticks=ticks, stop=stop)
        finally:
            close(served)
