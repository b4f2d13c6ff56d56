"""Warm starts (:mod:`elastic.train.warm`): a forked worker runs as ``python -m`` would start it:
exactly its environment, working directory, argv, log, session and exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.train import warm
from elastic.train.warm import WarmStarter, WarmStartError, start_key

REPO = str(Path(__file__).resolve().parents[2])
PRELOAD = ("torch",)
CHILD = "tests.train._warm_child"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "VIRTUAL_ENV")}
    env.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra})
    return env


def _seen(path: Path, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"the child never wrote {path}"
        time.sleep(0.01)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def starter() -> Any:
    s = WarmStarter(PRELOAD, _env())
    yield s
    s.close()


def test_a_child_gets_exactly_its_environment_cwd_argv_log_and_a_session_of_its_own(starter: Any,
                                                                                     tmp_path: Path) -> None:
    out, logf = tmp_path / "seen.json", tmp_path / "child.log"
    logf.write_text("earlier line\n")
    env = _env(ELASTIC_JOB="j1", ONLY_HERE="yes")
    p = starter.start(CHILD, [str(out), "exit:0"], env=env, cwd=str(tmp_path), log_path=str(logf))
    assert p.wait(30) == 0
    seen = _seen(out)
    assert seen["env"] == env, "the child's environment is exactly the one asked for"
    assert seen["cwd"] == str(tmp_path)
    assert seen["argv"][1:] == [str(out), "exit:0"] and seen["argv"][0].endswith("_warm_child.py")
    assert seen["name"] == "__main__" and seen["comm"] == "_warm_child", "named after its module"
    assert seen["pid"] == p.pid and seen["sid"] == p.pid, "a session (and process group) of its own"
    assert logf.read_text() == "earlier line\nchild says hello\n", "stdout appended to the log"


def test_exit_codes_signals_and_exceptions_come_back_as_popen_gives_them(starter: Any, tmp_path: Path) -> None:
    env = _env()
    p3 = starter.start(CHILD, [str(tmp_path / "a"), "exit:3"], env=env)
    bad = starter.start(CHILD, [str(tmp_path / "b"), "raise"], env=env, log_path=str(tmp_path / "b.log"))
    slow = starter.start(CHILD, [str(tmp_path / "c"), "sleep"], env=env)
    assert p3.wait(30) == 3
    assert bad.wait(30) == 1
    assert "RuntimeError: child failed on purpose" in (tmp_path / "b.log").read_text()
    _seen(tmp_path / "c")
    assert slow.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(0.2)
    slow.send_signal(signal.SIGTERM)
    assert slow.wait(30) == -signal.SIGTERM
    slow.kill()  # after its exit: nothing is signalled (the pid may be another process's by now)
    assert slow.poll() == -signal.SIGTERM


def test_a_child_ends_as_an_interpreter_does(starter: Any, tmp_path: Path) -> None:
    """After its module returns: its non-daemon threads finish, then its atexit handlers run."""
    out = tmp_path / "f"
    p = starter.start(CHILD, [str(out), "finish"], env=_env())
    assert p.wait(30) == 0
    assert (tmp_path / "f.thread").read_text() == "done"
    assert (tmp_path / "f.atexit").read_text() == "True", "atexit ran after the thread was joined"


def test_children_draw_different_random_numbers_and_compute_with_torch(starter: Any, tmp_path: Path) -> None:
    ps = [starter.start(CHILD, [str(tmp_path / f"s{i}"), "torch"], env=_env()) for i in range(3)]
    assert [p.wait(60) for p in ps] == [0, 0, 0]
    seen = [_seen(tmp_path / f"s{i}") for i in range(3)]
    assert len({s["random"] for s in seen}) == 3, "each child reseeds the generator it copied"
    assert all(s["sum"] == 45.0 and s["threads"] == 1 for s in seen)


def test_variables_bound_at_start_pick_a_starter_of_their_own(tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read when OpenMP loads: a child asked for 2 threads must not be forked
    from a starter that loaded it with 1."""
    assert start_key(_env(OMP_NUM_THREADS="2")) != start_key(_env())
    assert start_key(_env(ELASTIC_JOB="x")) == start_key(_env()), "per-worker variables do not key it"
    a = warm.start_module(CHILD, [str(tmp_path / "one"), "torch"], env=_env(), preload=PRELOAD)
    b = warm.start_module(CHILD, [str(tmp_path / "two"), "torch"], env=_env(OMP_NUM_THREADS="2"), preload=PRELOAD)
    assert a.wait(60) == 0 and b.wait(60) == 0
    assert _seen(tmp_path / "one")["threads"] == 1 and _seen(tmp_path / "two")["threads"] == 2
    assert a._starter is not b._starter
    with pytest.raises(WarmStartError, match="bound at start"):
        a._starter.start(CHILD, [str(tmp_path / "x")], env=_env(OMP_NUM_THREADS="2"))


def test_a_starter_that_dies_leaves_its_children_running_and_the_next_start_gets_a_new_one(tmp_path: Path) -> None:
    env = _env(WARM_TEST="dies")  # a key of its own: a starter no other test shares
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    child = warm.start_module(CHILD, [str(tmp_path / "c"), "sleep"], env=env, preload=PRELOAD)
    _seen(tmp_path / "c")
    first = child._starter
    first.proc.kill()
    first.proc.wait(10)
    deadline = time.monotonic() + 10
    while not first.dead:
        assert time.monotonic() < deadline, "the launcher never noticed its starter died"
        time.sleep(0.01)
    assert child.poll() is None, "the child outlives its starter"
    child.kill()
    assert child.wait(10) == warm.LOST_STATUS, "its exit is seen, its status is lost with the starter"
    again = warm.start_module(CHILD, [str(tmp_path / "d"), "exit:0"], env=env, preload=PRELOAD)
    assert again._starter is not first and again.wait(30) == 0


def test_a_starter_that_cannot_import_its_modules_says_so() -> None:
    with pytest.raises(WarmStartError, match="exited while importing no_such_module_here"):
        WarmStarter(("no_such_module_here",), _env())


def test_a_worker_started_warm_and_one_started_cold_train_the_same_job(tmp_path: Path) -> None:
    """The job handle's default start (warm) and the fresh-interpreter one (``warm=False``) run the
    same worker: one job with a worker of each kind trains on one loss curve."""
    from elastic.model import Layout
    from elastic.train.launch import LaunchOptions, ProcessJobHandle
    from tests.train._mp import make_cfg, reference_losses

    cfg = make_cfg(global_batch=4)
    want = reference_losses(cfg, 3)
    h = ProcessJobHandle("warm-cold", cfg, options=LaunchOptions(max_steps=3), log_dir=str(tmp_path))
    assert h.warm
    spawn = h._spawn

    def alternate(worker: str, env: dict[str, str]) -> None:
        h.warm = worker.endswith("0")
        spawn(worker, env)

    h._spawn = alternate  # type: ignore[method-assign]
    try:
        h.start(Layout(1, 1, 2), ["w0", "w1"])
        kinds = {w: type(p).__name__ for w, p in h.procs.items()}
        assert kinds == {"w0": "WarmProcess", "w1": "Popen"}
        h.wait_step(2, 120)
        got = [r.loss for r in sorted(h.history(), key=lambda r: r.step)][:3]
    finally:
        h.stop()
    assert [p.poll() for p in h.procs.values()] == [0, 0]
    assert len(got) == 3 and all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(got, want, strict=True))


def test_the_module_runs_as_a_script_of_its_own() -> None:
    """``python -m elastic.train.warm`` with nothing to preload answers ready and exits on EOF."""
    p = subprocess.run([sys.executable, "-m", "elastic.train.warm"], input=b"", capture_output=True, timeout=60,
                       env=_env())
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[0])["ready"] > 0
