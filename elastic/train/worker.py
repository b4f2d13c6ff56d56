"""``python -m elastic.train.worker``: one training worker configured by environment (Kubernetes pods).

Environment:

* ``ELASTIC_JOB`` (required): the job id; must match the coordinator's.
* ``ELASTIC_WORKER_ID`` (required): this worker's stable id (the pod name is a good one).
* ``ELASTIC_RENDEZVOUS_URL`` (required): the job's coordinator, e.g. ``http://controller:7070``.
* ``ELASTIC_MODEL``, ``ELASTIC_GLOBAL_BATCH``, ``ELASTIC_MICRO_BATCH``, ``ELASTIC_SEED``, ``ELASTIC_DTYPE``
  (optional): the job's settings as this pod was deployed with. The coordinator's job config is
  authoritative (every worker must compute the same maths); a value given here that disagrees
  with it stops the worker with exit code 2 and a message naming the field.
* ``ELASTIC_PG_TIMEOUT`` (seconds, default 120), ``ELASTIC_COORDINATOR_TIMEOUT`` (default 30),
  ``ELASTIC_DEVICE`` (default ``cpu``), ``ELASTIC_VERIFY_RESHARD`` (``1`` = checksum reshards),
  ``ELASTIC_RECOVER`` (default ``1``: when a peer dies, report and wait for the job's recovery).
* ``ELASTIC_EXIT_ON_LEAVE`` (default ``1``): a leaver ends its process with ``os._exit`` once its
  bytes have landed; ``0`` returns from :func:`main` instead (a Ray actor, whose process Ray ends).
* ``ELASTIC_ENGINE_FACTORY`` (optional, ``module:function``): an engine other than
  ``elastic.train.engine.TrainEngine`` that implements :class:`elastic.train.agent.Engine`.
* The fault-injection variables of :mod:`elastic.train.agent.faults` (tests and chaos drills only):
  read here, once, into the agent's :class:`~elastic.train.agent.Faults`.
* ``ELASTIC_ENTRYPOINT`` (optional; ``module:function`` or a script path, arguments as a JSON list
  in ``ELASTIC_ARGS``): the worker of a *user* job, which runs the user's own loop under
  ``elastic.torch.Manager`` (:mod:`elastic.torch.run`) instead of the reference trainer.

Exit codes: 0 stopped/finished/left, 1 the job failed (reason posted to the coordinator),
2 bad configuration, 3 coordinator unreachable.

``SIGUSR1`` writes every thread's Python stack to stderr and the worker goes on (where nothing
else handles that signal): the launcher sends it to a worker it gives up for lost before
killing it, so a stuck worker's log says where it was stuck.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

from elastic.model import SpecError
from elastic.train.agent import AgentOptions, EngineFactory, Faults, WorkerAgent, config_dtype, config_model

# env name -> job config key; checked against the coordinator's config
_CHECKED = {
    "ELASTIC_MODEL": "model",
    "ELASTIC_GLOBAL_BATCH": "global_batch",
    "ELASTIC_MICRO_BATCH": "micro_batch",
    "ELASTIC_SEED": "seed",
    "ELASTIC_DTYPE": "dtype",
}


def _require(env: Mapping[str, str], name: str) -> str:
    v = env.get(name, "").strip()
    if not v:
        raise SpecError(f"environment variable {name} is not set; the worker needs {', '.join(_REQUIRED)}")
    return v


_REQUIRED = ("ELASTIC_JOB", "ELASTIC_WORKER_ID", "ELASTIC_RENDEZVOUS_URL")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        x = float(v)
    except ValueError:
        raise SpecError(f"{name}={v!r} is not a number of seconds") from None
    if x <= 0:
        raise SpecError(f"{name}={v!r} must be > 0")
    return x


def options_from_env(env: Mapping[str, str]) -> AgentOptions:
    return AgentOptions(
        pg_timeout_s=_float(env, "ELASTIC_PG_TIMEOUT", 120.0),
        coordinator_timeout_s=_float(env, "ELASTIC_COORDINATOR_TIMEOUT", 30.0),
        device=env.get("ELASTIC_DEVICE", "cpu") or "cpu",
        verify_reshard=_flag(env, "ELASTIC_VERIFY_RESHARD", False),
        exit_on_leave=_flag(env, "ELASTIC_EXIT_ON_LEAVE", True),
        recover=_flag(env, "ELASTIC_RECOVER", True),
        checkpoint_dir=env.get("ELASTIC_CHECKPOINT_DIR", ""),
    )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    v = env.get(name, "").strip().lower()
    if not v:
        return default
    if v not in ("0", "1", "true", "false"):
        raise SpecError(f"{name}={env[name]!r}: use 1 or 0")
    return v in ("1", "true")


def load_factory(path: str) -> EngineFactory:
    mod, _, fn = path.partition(":")
    if not mod or not fn:
        raise SpecError(f"ELASTIC_ENGINE_FACTORY={path!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise SpecError(f"ELASTIC_ENGINE_FACTORY={path!r}: cannot load ({e})") from None


def check_env_against_config(env: Mapping[str, str], config: dict[str, Any]) -> None:
    """A setting this pod was deployed with must equal the job's (else two workers train different maths)."""
    for name, key in _CHECKED.items():
        v = env.get(name)
        if not v:
            continue
        if key == "model":
            same = config_model({"model": v}) == config_model(config)
        elif key == "dtype":
            same = config_dtype({"dtype": v}) == config_dtype(config)
        else:
            same = str(config.get(key)) == v.strip()
        if not same:
            raise SpecError(f"{name}={v!r} but job {env.get('ELASTIC_JOB')} trains with {key}={config.get(key)!r}; "
                            "fix the pod's environment (the coordinator's job config wins)")


class _EnvCheckedAgent(WorkerAgent):
    def __init__(self, env: Mapping[str, str], **kw: Any) -> None:
        super().__init__(**kw)
        self._env = env

    def _main(self) -> int:
        check_env_against_config(self._env, self.config)
        return super()._main()


def main(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    stacks_on_sigusr1()
    if env.get("ELASTIC_ENTRYPOINT"):
        _nice(env)
        from elastic.torch.run import main as run_user

        return run_user([], env)
    from elastic.logs import setup_from_env

    try:
        setup_from_env(env=env)  # ELASTIC_LOG_LEVEL / ELASTIC_LOG_FORMAT, as the controller logs
    except SpecError as e:
        print(f"elastic worker: {e}", file=sys.stderr)
        return 2
    try:
        job, worker, url = (_require(env, n) for n in _REQUIRED)
        opts = options_from_env(env)
        faults = Faults.from_env(env)
        factory = load_factory(env["ELASTIC_ENGINE_FACTORY"]) if env.get("ELASTIC_ENGINE_FACTORY") else None
    except SpecError as e:
        print(f"elastic.train.worker: {e}", file=sys.stderr)
        return 2
    _nice(env)
    agent = _EnvCheckedAgent(env, worker=worker, url=url, engine_factory=factory, options=opts, faults=faults)
    try:
        return agent.run()
    except SpecError as e:
        print(f"elastic.train.worker {worker} (job {job}): {e}", file=sys.stderr)
        return 2


def stacks_on_sigusr1() -> None:
    """``SIGUSR1``: every thread's stack to stderr (faulthandler writes it from the signal handler,
    so it comes even while the main thread is blocked inside a collective's C++ code)."""
    import faulthandler
    import signal

    try:
        # only where nothing handles it (None: a handler installed outside Python, e.g. by a host runtime)
        if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):  # not the main thread, or no such signal here
        pass


def _nice(env: Mapping[str, str]) -> None:
    nice = env.get("ELASTIC_NICE", "0")
    if nice not in ("", "0"):
        try:
            os.nice(int(nice))
        except (ValueError, OSError) as e:
            print(f"elastic.train.worker: ELASTIC_NICE={nice!r} not applied: {e}", file=sys.stderr)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: no interpreter teardown of GBs of tensors (see elastic.reshard.execute.fast_exit)
    os._exit(code)
