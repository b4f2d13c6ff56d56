"""``python -m elastic.torch.run ENTRYPOINT [ARGS...]``: a user's training code as one worker of an elastic job.

What it is for: the process a launcher starts for a user job (a Ray actor, a Kubernetes pod, a
local process; ``elastic.train.worker`` comes here when ``ELASTIC_ENTRYPOINT`` is set). It
registers with the job's coordinator (``ELASTIC_JOB``, ``ELASTIC_WORKER_ID``,
``ELASTIC_RENDEZVOUS_URL``, as for the reference trainer's workers), loads the entrypoint --
``package.module:function`` (called with no arguments) or ``path/to/script.py`` (run as
``__main__``) -- with ``sys.argv`` set to ``[entrypoint, *args]``, and calls it. Inside, the
user's ``elastic.torch.Manager(build, ...)`` joins the job.

When the function raises because a peer of its generation was lost (a collective broke, or
:class:`elastic.torch.coordinated.StepInterrupted`), the worker keeps its state, takes part in
the coordinator's recovery and calls the function again: its new ``Manager`` starts from the
recovered model at the step the survivors reached (nothing but the step in flight is redone).
When a shrink gives the step in progress up (:class:`elastic.torch.coordinated.StepGivenUp`
leaves the function at a micro-batch), the worker takes part in the shrink and calls the
function again on the new layout, at the same step; a leaver exits. Any other exception is the
job's failure reason. A keeper (``ELASTIC_KEEPER=1``: launched without a GPU to hold a paused
job's state) loads none of the user's code: it holds the state until the resume sends it on
(:mod:`elastic.torch.keeper`).

The entrypoint comes from the command line, else ``ELASTIC_ENTRYPOINT`` (arguments in
``ELASTIC_ARGS``, a JSON list), else the job's config; modules and relative script paths are
looked up in ``ELASTIC_CODE_DIR`` (the launcher's directory, where it checked them) first; where the job's config names one, a
different one here is refused. An entrypoint that does not load is refused at the worker's
directive: the start (or the rescale it was to join) is abandoned with the import error as the
reason, and nothing else changes.

Exit codes: 0 the job stopped or finished (or this worker left), 1 the job failed, 2 bad
configuration (entrypoint, environment), 3 the coordinator was unreachable.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from elastic.model import SpecError

log = logging.getLogger(__name__)

__all__ = ["load_entrypoint", "main"]

MAX_RECOVERIES = 100  # a function that breaks again and again is a bug, not bad luck


def load_entrypoint(entrypoint: str, args: Sequence[str] = ()) -> Callable[[], Any]:
    """A callable that runs ``entrypoint`` once with ``sys.argv = [entrypoint, *args]``; SpecError
    naming the field when it does not load (the module is imported now, a script is read now)."""
    from elastic.train.userjob import parse_entrypoint

    kind, e = parse_entrypoint(entrypoint)
    argv = [e, *map(str, args)]
    if kind == "script":
        if not os.path.isfile(e):
            raise SpecError(f"entrypoint: script {e!r} does not exist (looked in {os.path.abspath(e)!r})")

        def run_script() -> Any:
            with _argv(argv):
                runpy.run_path(e, run_name="__main__")

        return run_script
    mod, _, fn = e.partition(":")
    try:
        module = importlib.import_module(mod)
    except Exception as err:  # noqa: BLE001 - any failure to import is the entrypoint's fault
        raise SpecError(f"entrypoint: {e!r} does not import: {type(err).__name__}: {err}") from None
    func = getattr(module, fn, None)
    if not callable(func):
        raise SpecError(f"entrypoint: module {mod!r} has no function {fn!r}")

    def run_function() -> Any:
        with _argv(argv):
            return func()

    return run_function


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def _entry_from(argv: Sequence[str], env: Mapping[str, str], config: Mapping[str, Any]) -> tuple[str, list[str]]:
    if argv:
        entry, args = argv[0], list(argv[1:])
    elif env.get("ELASTIC_ENTRYPOINT"):
        entry = env["ELASTIC_ENTRYPOINT"]
        try:
            args = [str(a) for a in json.loads(env.get("ELASTIC_ARGS") or "[]")]
        except ValueError:
            raise SpecError(f"ELASTIC_ARGS={env.get('ELASTIC_ARGS')!r} is not a JSON list of strings") from None
    elif config.get("entrypoint"):
        entry, args = str(config["entrypoint"]), [str(a) for a in config.get("args") or ()]
    else:
        raise SpecError("entrypoint: none given (command line, ELASTIC_ENTRYPOINT or the job's config)")
    want = config.get("entrypoint")
    if want and str(want) != entry:
        raise SpecError(f"entrypoint: this worker runs {entry!r} but job trains {want!r}; the job's config wins: "
                        "fix the pod's command or the job spec")
    return entry, args


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else list(argv)
    from elastic.logs import setup_from_env
    from elastic.train.worker import stacks_on_sigusr1

    stacks_on_sigusr1()  # a worker given up for lost says where it was stuck (see elastic.train.worker)

    try:
        setup_from_env(env=env)  # ELASTIC_LOG_LEVEL / ELASTIC_LOG_FORMAT, as the controller logs
    except SpecError as e:
        print(f"elastic.torch.run: {e}", file=sys.stderr)
        return 2
    from elastic.torch.coordinated import session_from_env, warm_up
    from elastic.train.rendezvous import RendezvousError

    try:
        session = session_from_env(env)
    except SpecError as e:
        print(f"elastic.torch.run: {e}", file=sys.stderr)
        return 2
    code_dir = env.get("ELASTIC_CODE_DIR", "")
    if code_dir and os.path.isdir(code_dir):
        if code_dir not in sys.path:
            sys.path.insert(0, code_dir)
        os.chdir(code_dir)  # a script path and the user's own relative paths mean what they meant there
    try:
        # torch's first-use costs and the user's code come before this worker registers: a launcher
        # waits for the registration before it posts the directive, so they stay out of the pause
        warm_up()
        if session.keeper:  # holds a paused job's state: none of the user's code runs here
            from elastic.torch.keeper import keep

            return keep(session)
        fn, refusal = None, ""
        try:
            if argv or env.get("ELASTIC_ENTRYPOINT"):
                fn = load_entrypoint(*_entry_from(argv, env, {}))
        except SpecError as e:
            refusal = str(e)
        config = session.register()
        try:
            if refusal:
                raise SpecError(refusal)
            entry, args = _entry_from(argv, env, config)
            if fn is None:
                fn = load_entrypoint(entry, args)
        except SpecError as e:
            log.error("worker %s: %s", session.worker, e)
            session.refuse(str(e))
            return 2
        return _run(session, fn)
    except RendezvousError as e:
        log.error("worker %s lost its coordinator: %s", session.worker, e)
        return 3


def _run(session: Any, fn: Callable[[], Any]) -> int:
    from elastic.torch.coordinated import StepGivenUp
    from elastic.train.agent import _short
    from elastic.train.rendezvous import RendezvousError

    recoveries = 0
    while True:
        try:
            fn()
        except StepGivenUp as e:  # a shrink took the step in progress: on to the new layout (or out)
            if session.give_up(e):
                continue
            return 0 if session.phase in ("done", "left") and not _failed(session) else 1
        except SystemExit as e:
            if e.code not in (None, 0):
                session.report_fail(f"the entrypoint exited with {e.code!r}")
                return 1
        except RendezvousError:
            raise
        except Exception as e:  # noqa: BLE001 - a lost peer is recovered; anything else is the job's failure
            if session.recoverable(e) and recoveries < MAX_RECOVERIES:
                recoveries += 1
                log.warning("worker %s: the step broke (%s: %s); recovering", session.worker, type(e).__name__, e)
                if session.recover_from(e):
                    continue
                return 0 if session.phase in ("done", "left") and not _failed(session) else 1
            if isinstance(e, SpecError):
                log.error("worker %s: %s", session.worker, e)
                session.report_fail(f"configuration: {e}")
                return 2
            log.error("worker %s failed:\n%s", session.worker, traceback.format_exc())
            session.report_fail(f"{type(e).__name__}: {_short(e)}")
            return 1
        if session.phase == "training":
            step = session.next_step
            session.report_fail(f"the entrypoint returned at step {step} while the job still trains; its loop must "
                                "run until mgr.steps() ends")
            return 1
        if session.phase in ("new", "registered"):
            session.report_fail("the entrypoint returned without starting an elastic.torch.Manager")
            return 1
        return 1 if _failed(session) else 0


def _failed(session: Any) -> bool:
    return any(r.startswith("stop: ") and "failed" in r for r in session.reasons[-1:])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: no interpreter teardown of GBs of tensors (see elastic.reshard.execute.fast_exit)
    os._exit(code)
