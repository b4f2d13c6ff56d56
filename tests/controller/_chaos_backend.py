"""A cluster shared by several ``elastic serve`` processes, for the chaos test: the fake backend
(our boundary), loaded with ``elastic serve --backend tests.controller._chaos_backend:backend``.

Its truth (which GPUs each service and job holds) lives in ``$CHAOS_DIR/truth.json``, so every
process sees one cluster; a file lock makes each change atomic, and a change that would give a
GPU held by another workload is refused loudly. Every call is logged to ``$CHAOS_DIR/events.jsonl``
with the calling process (pid, lease owner, lease epoch):

* ``ping``    once per tick (the tick's first step), so a test can count a process's ticks;
* ``enter``   a change begins (after the fence: the process believed it led);
* ``refused`` the fence refused it at its commit point (nothing changed);
* ``commit``  the change landed in the truth.

A training start or rescale takes ``$CHAOS_SLOW`` seconds between ``enter`` and its commit point
(an apply longer than the lease); with ``CHAOS_HOLD=1`` the process's first one also waits there
until ``$CHAOS_DIR/release-<its pid>`` exists, so a test can stop it inside the action at a known
point.
Like a backend that fences (see ``Backend``'s ``fence``), it asks the controller's fence right
before each change lands.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic.backends.base import BackendError, JobRuntime, RescaleOutcome
from elastic.model import GPU, InferenceSpec, Layout, TrainingSpec
from elastic.phases import JobPhase

HOLD_LIMIT = 60.0  # a hold never outlives the test that set it


def _gpu(text: str) -> GPU:
    node, index = text.split("/")
    return GPU(node, int(index))


class ChaosBackend:
    name = "chaos"
    detached = False
    fence: Callable[[], None] | None = None  # set by the controller

    def __init__(self, nodes: dict[str, int], directory: Path, slow: float, hold: bool) -> None:
        self.nodes, self.dir, self.slow, self.hold = dict(nodes), directory, slow, hold
        self.truth, self.events = directory / "truth.json", directory / "events.jsonl"

    # ---- shared state ---------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        with open(self.dir / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.truth.read_text()) if self.truth.exists() else {"services": {}, "jobs": {}}
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                tmp = self.truth.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                tmp.replace(self.truth)

    def _read(self) -> dict[str, Any]:
        with self._locked() as state:
            return state

    def _log(self, state: dict[str, Any] | None, phase: str, kind: str = "", workload: str = "",
             gpus: tuple[GPU, ...] = ()) -> None:
        ctl = getattr(self.fence, "__self__", None)  # the controller whose fence this is
        row = {"t": time.time(), "pid": os.getpid(), "owner": getattr(ctl, "owner", None),
               "epoch": ctl.db.epoch if ctl is not None else None, "phase": phase, "kind": kind,
               "workload": workload, "gpus": [str(g) for g in gpus]}
        if state is None:
            with self._locked():
                self._append(row)
        else:
            self._append(row)

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.events, "a") as f:  # under the lock: one line per event, in commit order
            f.write(json.dumps(row) + "\n")

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    def _change(self, kind: str, workload: str, gpus: tuple[GPU, ...], apply: Callable[[dict], None]) -> None:
        """The commit point: the fence, then the change (refused if a GPU is another's), logged."""
        try:
            self._fenced()
        except Exception:
            self._log(None, "refused", kind, workload, gpus)
            raise
        with self._locked() as state:
            held = {g for s, gs in state["services"].items() if s != workload for g in gs}
            held |= {g for j, rt in state["jobs"].items() if j != workload for g in rt["gpus"]}
            clash = held & {str(g) for g in gpus}
            if clash:
                raise BackendError(f"{workload}: GPUs {sorted(clash)} are still held by another workload")
            apply(state)
            self._log(state, "commit", kind, workload, gpus)

    # ---- the Backend protocol -------------------------------------------------------------------
    def ping(self) -> None:
        self._log(None, "ping")

    def inventory(self) -> dict[str, int]:
        return dict(self.nodes)

    def service_gpus(self, service: str) -> tuple[GPU, ...]:
        return tuple(_gpu(g) for g in self._read()["services"].get(service, []))

    def ready_replicas(self, service: str) -> int:
        return len(self.service_gpus(service))

    def service_targets(self, service: str) -> list[str]:
        return []  # no replica serves metrics: the controller holds inference on missing data

    def set_service_gpus(self, spec: InferenceSpec, gpus: tuple[GPU, ...]) -> None:
        self._fenced()
        self._log(None, "enter", "service", spec.name, gpus)
        self._change("service", spec.name, gpus, lambda st: st["services"].__setitem__(spec.name, [str(g) for g in gpus]))

    def job_runtime(self, job: str) -> JobRuntime | None:
        rt = self._read()["jobs"].get(job)
        if rt is None:
            return None
        return JobRuntime(job, JobPhase.RUNNING, Layout.parse(rt["layout"]), tuple(_gpu(g) for g in rt["gpus"]),
                          rt["generation"])

    def set_job_gpus(self, spec: TrainingSpec, gpus: tuple[GPU, ...], layout: Layout | None) -> RescaleOutcome:
        self._fenced()
        self._log(None, "enter", "job", spec.name, gpus)
        time.sleep(self.slow)  # the slow part (workers starting, state moving): longer than the lease
        if self.hold:
            self.hold = False
            deadline = time.monotonic() + HOLD_LIMIT
            while not (self.dir / f"release-{os.getpid()}").exists():
                if time.monotonic() > deadline:
                    raise BackendError(f"{spec.name}: held {HOLD_LIMIT:g} s and never released")
                time.sleep(0.05)
        before = self.job_runtime(spec.name)
        gen = before.generation + 1 if before is not None else 0

        def apply(state: dict) -> None:
            if gpus:
                state["jobs"][spec.name] = {"gpus": [str(g) for g in gpus], "layout": str(layout), "generation": gen}
            else:
                state["jobs"].pop(spec.name, None)

        self._change("job", spec.name, gpus, apply)
        return RescaleOutcome(spec.name, before.layout if before else None, layout if gpus else None, gen,
                              pause_seconds=0.01, bytes_moved=1000 * len(gpus), bytes_planned=1000 * len(gpus),
                              bytes_lower_bound=1000 * len(gpus))

    def cancel_grow(self, job: str) -> bool:
        return False  # a grow runs to its end here

    def close(self) -> None:
        pass  # the cluster outlives its controllers


def backend(pool: Any) -> ChaosBackend:
    """The factory ``elastic serve --backend`` calls with the pool spec."""
    return ChaosBackend({f"n{i}": pool.gpus_per_node for i in range(pool.nodes)}, Path(os.environ["CHAOS_DIR"]),
                        float(os.environ.get("CHAOS_SLOW", "0")), os.environ.get("CHAOS_HOLD") == "1")
