"""Soak: one live job of real worker processes driven through a long random walk of in-place rescales.

What it is for: finding bugs in the trainer's critical path -- coordinator
(``elastic/train/rendezvous/``), worker agent (``agent.py``), launcher (``launch.py``) and the
resharder (``elastic/reshard/``) -- with nothing mocked. A job of ``python -m elastic.train.worker``
processes (:class:`~elastic.train.launch.ProcessJobHandle`, gloo on loopback) starts on a random
layout; then, ``--rescales`` times:

1. it trains a random 1-4 steps;
2. with ``--kill-prob``, when its layout can recover (dp >= 2, no ZeRO-1), one worker is
   SIGKILLed and the in-place recovery is waited for (the job must resume on its survivors);
3. it is rescaled in place to a random layout that the model and the global batch accept
   (``tp x pp x dp``, with or without ZeRO-1), on a random worker set of the right size drawn
   from the current workers and fresh names (a name that left is never used again), in random
   order (``remap`` on or off); or, now and then, it is paused into keepers and resumed on fresh
   workers (``pause()``, then ``resume()``). With ``--mid-kill-prob``, a rescale between two
   recoverable layouts has one of its members (old or joining) SIGKILLed right after its directive
   is posted: whatever becomes of the rescale (done, abandoned, rolled back), the job must run on
   without the victim, on the same loss curve. ``--layouts`` narrows the draw.

Every operation is checked as it happens (the layout and workers it ends on, bytes moved equal
to the plan, leavers and keepers gone with exit code 0, nothing stepping while paused) and is
bounded in time: a watchdog dumps every thread's stack and kills the workers when one hangs.
At the end the job is stopped and every step on record (``history()``) is compared with a
never-rescaled single-process run of the same config: float64 to 1e-9 relative, float32 to 1e-4.

Prints one line per operation and a verdict, and on failure the seed and the exact sequence
(``--json`` writes it; ``--replay`` runs a written sequence again). Exit code 0: every rescale
done, every loss equal; 1: a mismatch or an unexpected failure; 2: a hang.

    .venv/bin/python benchmarks/train_soak.py --seed 1 --rescales 30
    .venv/bin/python benchmarks/train_soak.py --seed 3 --kill-prob 0.2 --json /tmp/soak.json
    .venv/bin/python benchmarks/train_soak.py --replay /tmp/soak.json

What it must not do: decide anything the trainer decides (the recovery layout is the
coordinator's), or touch tensors of the job; it drives the public launcher API only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from elastic.model import Layout, ModelSpec, SpecError, load_model  # noqa: E402
from elastic.train.agent import config_json  # noqa: E402
from elastic.train.engine import TrainConfig, TrainEngine  # noqa: E402
from elastic.train.launch import LaunchOptions, ProcessJobHandle, RescaleResult, make_validator  # noqa: E402
from elastic.train.rendezvous import RescaleFailed  # noqa: E402

# GPT-2 flavour (tests/train/_mp.py): gelu, biases, LayerNorm, tied embeddings; vocab 251 and ffn 175
# split unevenly over tp, 5 layers pad over pp2/pp4
EXTRA_MODELS: dict[str, ModelSpec] = {
    "tiny-gpt2": ModelSpec(name="tiny-gpt2", layers=5, hidden=64, ffn_hidden=175, heads=4, kv_heads=4, vocab=251,
                           seq_len=16, mlp="gelu", tie_embeddings=True),
}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}  # relative, per step


class SoakFailure(RuntimeError):
    """An operation did not do what the public API promises (the soak stops there)."""


@dataclass
class SoakOptions:
    seed: int = 0
    rescales: int = 30
    model: str = "tiny"
    max_workers: int = 4
    kill_prob: float = 0.0
    pause_prob: float = 0.1
    # a worker SIGKILLed in the middle of a rescale between two recoverable layouts (right after its
    # directive is posted: inside the meeting, the exchange, the commit or the first step)
    mid_kill_prob: float = 0.0
    layouts: list[str] | None = None  # draw only these (each must be valid); None: every valid layout
    dtype: str = "float64"
    global_batch: int = 12
    micro_batch: int = 1
    op_timeout_s: float = 120.0  # one start / rescale / pause / recovery / wait
    verify_reshard: bool = True
    log_dir: str | None = None  # worker logs (default: a temporary directory, removed on success)
    replay: list[dict[str, Any]] | None = None  # run these actions instead of drawing them


@dataclass
class SoakReport:
    seed: int
    options: dict[str, Any]
    actions: list[dict[str, Any]] = field(default_factory=list)  # the exact sequence (replayable)
    events: list[dict[str, Any]] = field(default_factory=list)  # what each action did
    failures: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    hang: str = ""
    traceback: str = ""  # of an unexpected exception
    steps: int = 0
    max_rel_error: float = 0.0
    seconds: float = 0.0
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        return not (self.failures or self.mismatches or self.hang)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# ---- pure helpers ------------------------------------------------------------------------------


def model_spec(name: str) -> ModelSpec:
    return EXTRA_MODELS[name] if name in EXTRA_MODELS else load_model(name)


def train_config(opts: SoakOptions) -> TrainConfig:
    return TrainConfig(model=model_spec(opts.model), global_batch=opts.global_batch, micro_batch=opts.micro_batch,
                       seed=7, lr=3e-3, dtype=DTYPES[opts.dtype])


def valid_layouts(cfg: TrainConfig, max_workers: int) -> list[Layout]:
    """Every ``tp x pp x dp`` (with and without ZeRO-1) of at most ``max_workers`` workers that the
    launcher's validator accepts for ``cfg`` (heads, layers, global batch)."""
    validate = make_validator(cfg)
    out: list[Layout] = []
    for tp in range(1, max_workers + 1):
        for pp in range(1, max_workers // tp + 1):
            for dp in range(1, max_workers // (tp * pp) + 1):
                for zero in (0, 1):
                    try:
                        lay = Layout(tp, pp, dp, zero=zero)
                        validate(lay, [f"x{i}" for i in range(lay.world_size)])
                    except SpecError:
                        continue
                    out.append(lay)
    return out


def recoverable(layout: Layout) -> bool:
    """A lost worker's state survives in a data-parallel replica (the coordinator's rule)."""
    return layout.dp >= 2 and not layout.zero


def draw_workers(rng: random.Random, current: Sequence[str], size: int, fresh: Callable[[], str]) -> list[str]:
    """``size`` workers: a random number of the current ones (random picks), the rest fresh names, shuffled.

    ``current`` is taken sorted: the draw depends on who the workers are, not on the rank order the
    planner gave them, so a seed draws the same sequence on every run."""
    keep = rng.randint(0, min(size, len(current)))
    out = rng.sample(sorted(current), keep) + [fresh() for _ in range(size - keep)]
    rng.shuffle(out)
    return out


def compare_losses(history: Sequence[Any], reference: Sequence[float], rel_tol: float) -> tuple[list[str], float]:
    """Mismatches between the job's step records and the reference curve, and the largest relative error.

    A step must be on record exactly once, in order from 0, with a finite loss equal to the
    reference's within ``rel_tol``."""
    bad: list[str] = []
    steps = [r.step for r in history]
    if steps != list(range(len(steps))):
        missing = sorted(set(range(max(steps, default=-1) + 1)) - set(steps))
        dup = sorted({s for s in steps if steps.count(s) > 1})
        bad.append(f"steps on record are not 0..{len(steps) - 1} once each: missing {missing[:10]}, "
                   f"repeated {dup[:10]}")
    worst = 0.0
    for r in history:
        want = reference[r.step] if 0 <= r.step < len(reference) else None
        got = r.loss
        if want is None or got is None or not math.isfinite(got):
            bad.append(f"step {r.step} (gen {r.generation}, {r.layout}): loss {got!r}, reference {want!r}")
            continue
        err = abs(got - want) / max(abs(want), 1e-300)
        worst = max(worst, err)
        if not math.isclose(got, want, rel_tol=rel_tol, abs_tol=0.0):
            bad.append(f"step {r.step} (gen {r.generation}, {r.layout}): loss {got!r} vs reference {want!r} "
                       f"(rel {err:.2e})")
    return bad, worst


class ReferenceCurve:
    """The never-rescaled run (tp1.pp1.dp1, one process, one intra-op thread), extended on demand
    and shared by every soak of the same config in this process."""

    _cache: dict[str, ReferenceCurve] = {}

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.losses: list[float] = []
        self._engine: TrainEngine | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> ReferenceCurve:
        key = json.dumps(config_json(cfg), sort_keys=True, default=str)
        if key not in cls._cache:
            cls._cache[key] = cls(cfg)
        return cls._cache[key]

    def first(self, steps: int) -> list[float]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if self._engine is None:
                self._engine = TrainEngine(self.cfg, Layout(1, 1, 1), 0)
            while len(self.losses) < steps:
                self.losses.append(self._engine.train_step(len(self.losses)).loss)
        finally:
            torch.set_num_threads(threads)
        return self.losses[:steps]


# ---- the hang guard ----------------------------------------------------------------------------


class Watchdog:
    """Bounds every operation: past its deadline, dump every thread's stack, note the hang and call
    ``on_hang`` (kill the workers: whatever waits on them then fails instead of hanging). With
    ``hard_exit`` the process exits (code 2) if the main thread is still stuck ``grace_s`` later."""

    def __init__(self, on_hang: Callable[[str], None], *, grace_s: float = 60.0, hard_exit: bool = False) -> None:
        self._on_hang, self._grace, self._hard = on_hang, grace_s, hard_exit
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._closed = False
        self._done = threading.Event()
        self.fired = ""
        self._thread = threading.Thread(target=self._run, name="soak-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, seconds: float) -> None:
        with self._cv:
            self._what, self._deadline = what, time.monotonic() + seconds
            self._cv.notify_all()

    def disarm(self) -> None:
        with self._cv:
            self._deadline = None
            self._cv.notify_all()

    def close(self) -> None:
        self._done.set()
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self.fired = f"hang: {self._what} did not finish in time"
                self._deadline = None
                break
        if not self.fired:
            return
        print(f"\n!!! {self.fired}; every thread's stack:\n{_stacks()}", file=sys.stderr, flush=True)
        self._on_hang(self.fired)
        if self._hard and not self._done.wait(self._grace):
            print(f"!!! still stuck {self._grace:.0f} s after killing the workers; exiting", file=sys.stderr,
                  flush=True)
            os._exit(2)


def _stacks() -> str:
    """Every thread's Python stack (in Python: works whatever ``sys.stderr`` is, unlike faulthandler)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


# ---- the soak ----------------------------------------------------------------------------------


class Soak:
    """One soak run: ``run()`` executes (or draws, then executes) the actions and returns the report."""

    def __init__(self, opts: SoakOptions, *, out: Callable[[str], None] = print, hard_exit: bool = False) -> None:
        self.opts = opts
        self.out = out
        self.cfg = train_config(opts)
        self.rng = random.Random(opts.seed)
        self.layouts = valid_layouts(self.cfg, opts.max_workers)
        if opts.layouts:
            wanted = [Layout.parse(x) for x in opts.layouts]
            if bad := [str(x) for x in wanted if x not in self.layouts]:
                raise SpecError(f"layouts {bad} are not valid for {opts.model} with global batch "
                                f"{opts.global_batch} on up to {opts.max_workers} workers")
            self.layouts = wanted
        self.report = SoakReport(opts.seed, {k: v for k, v in asdict(opts).items() if k != "replay"})
        self.used: set[str] = set()  # every name ever given to a process (never reused)
        self.killed: set[str] = set()
        self._next = 0
        self._own_logs = opts.log_dir is None
        self.log_dir = opts.log_dir or tempfile.mkdtemp(prefix=f"soak-{opts.seed}-")
        self.report.log_dir = self.log_dir
        self.registry = CollectorRegistry()
        t = opts.op_timeout_s
        launch = LaunchOptions(pg_timeout_s=t, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0, join_timeout_s=t,
                               register_timeout_s=t, rescale_timeout_s=t, exit_timeout_s=30.0,
                               verify_reshard=opts.verify_reshard, recover=True)
        self.h = ProcessJobHandle(f"soak-{opts.seed}", self.cfg, options=launch, registry=self.registry,
                                  log_dir=self.log_dir)
        self.dog = Watchdog(self._kill_everyone, hard_exit=hard_exit)

    # ---- entry ------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        """1. start, 2. the actions, 3. stop, 4. compare with the reference; always clean up."""
        t0 = time.monotonic()
        try:
            try:
                for action in self._actions():
                    self._do(action)
            except Exception as e:  # noqa: BLE001 - every failure goes into the report with the sequence
                self.report.failures.append(f"{type(e).__name__}: {e}")
                if not isinstance(e, SoakFailure):
                    self.report.traceback = traceback.format_exc()
            finally:
                self._stop()
            if not self.report.hang:
                self._compare()
        finally:
            self.dog.close()
            self._kill_everyone("cleanup")
            self.report.seconds = time.monotonic() - t0
        if self.report.ok and self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return self.report

    def _actions(self):
        """The replayed sequence, or one drawn action at a time from the job's current state."""
        if self.opts.replay is not None:
            yield from self.opts.replay
            return
        yield self._draw_start()
        for _ in range(self.opts.rescales):
            yield {"op": "wait", "steps": self.rng.randint(1, 4)}
            lay, workers = self._current()
            while self.opts.kill_prob > 0 and recoverable(lay) and self.rng.random() < self.opts.kill_prob:
                yield {"op": "kill", "victim": self.rng.choice(sorted(workers)),
                       "delay_s": round(self.rng.uniform(0.0, 0.05), 3)}
                yield {"op": "wait", "steps": self.rng.randint(1, 3)}
                lay, workers = self._current()
            if self.rng.random() < self.opts.pause_prob:
                yield self._draw_pause()
                yield self._draw_move("resume", fresh_only=True)
            else:
                yield self._draw_mid_kill(self._draw_move("rescale"))

    # ---- drawing -----------------------------------------------------------------------------
    def _fresh(self, prefix: str = "w") -> str:
        while True:
            name, self._next = f"{prefix}{self._next}", self._next + 1
            if name not in self.used:
                return name

    def _current(self) -> tuple[Layout, list[str]]:
        st = self.h.status()
        return st.layout or Layout(1, 1, 1), list(st.workers)

    def _draw_start(self) -> dict[str, Any]:
        lay = self.rng.choice(self.layouts)
        return {"op": "start", "layout": str(lay), "workers": [self._fresh() for _ in range(lay.world_size)]}

    def _draw_move(self, op: str, *, fresh_only: bool = False) -> dict[str, Any]:
        lay = self.rng.choice(self.layouts)
        current = [] if fresh_only else self._current()[1]
        workers = draw_workers(self.rng, current, lay.world_size, self._fresh)
        return {"op": op, "layout": str(lay), "workers": workers, "remap": self.rng.random() < 0.5}

    def _draw_mid_kill(self, move: dict[str, Any]) -> dict[str, Any]:
        """With ``mid_kill_prob``, when the job can recover before and after: one member of the rescale
        (old or new) is SIGKILLed ``after_s`` seconds after the directive is posted."""
        lay, workers = self._current()
        if not (self.opts.mid_kill_prob > 0 and recoverable(lay) and recoverable(Layout.parse(move["layout"]))
                and self.rng.random() < self.opts.mid_kill_prob):
            return move
        members = sorted(set(workers) | set(move["workers"]))
        return {**move, "kill": {"victim": self.rng.choice(members), "after_s": round(self.rng.uniform(0, 0.4), 3)}}

    def _draw_pause(self) -> dict[str, Any]:
        held = self._current()[0].held()
        return {"op": "pause", "keepers": [self._fresh("k") for _ in range(held.world_size)],
                "hold_s": round(self.rng.uniform(0.1, 0.6), 3)}

    # ---- doing -------------------------------------------------------------------------------
    def _do(self, action: dict[str, Any]) -> None:
        self.report.actions.append(action)
        op = action["op"]
        self.dog.arm(f"{op} {json.dumps(action)}", self.opts.op_timeout_s + 60)
        try:
            getattr(self, f"_op_{op}")(action)
        finally:
            self.dog.disarm()
        if self.dog.fired:
            raise SoakFailure(self.dog.fired)

    def _claim(self, names: Sequence[str], old: Sequence[str]) -> None:
        """Fresh names must never have been used; a name may only stay if it is a current worker."""
        for w in names:
            if w in self.used and w not in old:
                raise SoakFailure(f"the sequence reuses worker name {w}, which left earlier")
        self.used.update(names)

    def _op_start(self, a: dict[str, Any]) -> None:
        self._claim(a["workers"], [])
        res = self.h.start(a["layout"], a["workers"], timeout=self.opts.op_timeout_s)
        self._expect(a["layout"], a["workers"], ordered=True)
        self._event(a, res, "start")

    def _op_wait(self, a: dict[str, Any]) -> None:
        target = self.h.status().step + int(a["steps"])
        self.h.wait_step(target, timeout=self.opts.op_timeout_s)
        self._expect_phase("running")

    def _op_rescale(self, a: dict[str, Any]) -> None:
        if a.get("kill"):
            self._move_with_kill(a)
        else:
            self._move(a, self.h.rescale)

    def _move_with_kill(self, a: dict[str, Any]) -> None:
        """A rescale with a member SIGKILLed once its directive is out. Whatever the rescale's fate (done,
        rolled back, abandoned, refused while the job recovers), the job must end up running without
        the victim, on the never-rescaled loss curve; it must not fail (both layouts can recover)."""
        before = self.h.status()
        victim, after = a["kill"]["victim"], float(a["kill"]["after_s"])
        self._claim(a["workers"], before.workers)
        done = threading.Event()
        signalled: list[float] = []
        killer = threading.Thread(target=self._kill_when_posted, args=(victim, after, before.generation, done,
                                                                       signalled), daemon=True)
        killer.start()
        t0 = time.monotonic()
        outcome = "done"
        try:
            res = self.h.rescale(a["layout"], a["workers"], remap=bool(a.get("remap", True)),
                                 timeout=self.opts.op_timeout_s)
            outcome = f"done (gen {res.generation})"
        except (SpecError, RescaleFailed) as e:
            outcome = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            done.set()
            killer.join(self.opts.op_timeout_s)
        st = self._wait_settled(victim)
        if signalled:
            self.killed.add(victim)
        took = time.monotonic() - t0
        self.report.events.append({"op": "rescale+kill", "victim": victim, "after_s": after, "from": str(before.layout),
                                   "to": str(st.layout), "wanted": a["layout"], "outcome": outcome,
                                   "killed": bool(signalled), "wall_s": took})
        self.out(f"  rescale {before.layout} -> {a['layout']} with {victim} killed {after:.3f} s after the "
                 f"directive{'' if signalled else ' (already gone)'}: {outcome}; now {st.layout} {st.workers} "
                 f"({took:.2f} s)")

    def _kill_when_posted(self, victim: str, after: float, generation: int, done: threading.Event,
                          signalled: list[float]) -> None:
        """Wait until the rescale's directive is out (the job ``rescaling``) or the call ended, then kill."""
        deadline = time.monotonic() + self.opts.op_timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            st = self.h.status()
            if st.phase != "running" or st.generation != generation:
                break
            time.sleep(0.002)
        time.sleep(after)
        p = self.h.procs.get(victim)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            signalled.append(time.monotonic())

    def _wait_settled(self, victim: str) -> Any:
        """The job runs again, without ``victim``, nothing in flight, and steps."""
        deadline = time.monotonic() + self.opts.op_timeout_s
        while time.monotonic() < deadline:
            st = self.h.status()
            if st.phase not in ("running", "rescaling", "recovering"):
                raise SoakFailure(f"job {st.phase} after a kill mid-rescale: {st.error or st.reason}")
            if st.phase == "running" and victim not in st.workers and (
                    st.last_rescale is None or st.last_rescale.ok is not None):
                self.h.wait_step(st.step + 1, timeout=self.opts.op_timeout_s)
                return self.h.status()
            time.sleep(0.02)
        raise TimeoutError(f"not settled within {self.opts.op_timeout_s:g} s after killing {victim}: "
                           f"{self.h.status()}")

    def _op_resume(self, a: dict[str, Any]) -> None:
        before = self.h.status()
        self._expect_phase("paused")
        self._move(a, self.h.resume)
        keepers = before.workers
        bad = {k: self.h.procs[k].poll() for k in keepers if self.h.procs[k].poll() != 0}
        if bad:
            raise SoakFailure(f"keepers did not exit cleanly after the resume: {bad} (exit codes)")
        rec = self.h.coordinator.rescale_record(self.h.status().generation)
        if rec is None or rec.switch_step != before.step + 1:
            raise SoakFailure(f"resumed at step {rec.switch_step if rec else None}, paused after step {before.step}")

    def _move(self, a: dict[str, Any], call: Callable[..., RescaleResult]) -> None:
        before = self.h.status()
        self._claim(a["workers"], before.workers)
        res = call(a["layout"], a["workers"], remap=bool(a.get("remap", True)), timeout=self.opts.op_timeout_s)
        self._check_result(res, before.layout, a["layout"])
        self._expect(a["layout"], a["workers"], ordered=not a.get("remap", True))
        leavers = sorted(set(before.workers) - set(a["workers"]))
        if sorted(res.record.leavers) != leavers:
            raise SoakFailure(f"record names leavers {res.record.leavers}, expected {leavers}")
        bad = {w: self.h.procs[w].poll() for w in leavers if self.h.procs[w].poll() != 0}
        if bad:
            raise SoakFailure(f"leavers did not exit cleanly: {bad} (exit codes; None = still running)")
        self._event(a, res, a["op"])

    def _op_pause(self, a: dict[str, Any]) -> None:
        before = self.h.status()
        self._claim(a["keepers"], [])
        res = self.h.pause(a["keepers"], timeout=self.opts.op_timeout_s)
        if before.layout is None:
            raise SoakFailure(f"paused a job with no layout ({before.phase})")
        held = str(before.layout.held())
        self._check_result(res, before.layout, held)
        if not res.record.hold:
            raise SoakFailure("the pause's record is not a hold")
        self._expect(held, a["keepers"], ordered=False, phase="paused")
        bad = {w: self.h.procs[w].poll() for w in before.workers if self.h.procs[w].poll() != 0}
        if bad:
            raise SoakFailure(f"workers did not exit cleanly at the pause: {bad} (exit codes)")
        at = self.h.status().step
        time.sleep(float(a.get("hold_s", 0.2)))
        st = self.h.status()
        if st.step != at or st.phase != "paused":
            raise SoakFailure(f"paused at step {at}, now step {st.step} phase {st.phase}: something stepped")
        self._event(a, res, "pause")

    def _op_kill(self, a: dict[str, Any]) -> None:
        victim = a["victim"]
        before = self.h.status()
        if victim not in before.workers:
            raise SoakFailure(f"kill: {victim} is not a worker of the job ({before.workers})")
        time.sleep(float(a.get("delay_s", 0.0)))
        t0 = time.monotonic()
        os.kill(self.h.pid(victim), signal.SIGKILL)
        self.killed.add(victim)
        st = self._wait_recovered(before.generation)
        took = time.monotonic() - t0
        rec = self.h.coordinator.rescale_record(st.generation)
        if rec is None or not rec.ok or f"lost {victim}" not in rec.recovery:
            raise SoakFailure(f"recovery record after killing {victim}: {rec}")
        if rec.bytes_moved != rec.planned_bytes:
            raise SoakFailure(f"recovery moved {rec.bytes_moved} bytes, planned {rec.planned_bytes}")
        if victim in st.workers or not set(st.workers) <= set(before.workers):
            raise SoakFailure(f"recovered onto {st.workers} from {before.workers} after losing {victim}")
        lay, old = st.layout, before.layout
        if lay is None or old is None or (lay.tp, lay.pp) != (old.tp, old.pp) or lay.dp >= old.dp:
            raise SoakFailure(f"recovered {before.layout} -> {st.layout}: expected the same tp x pp, fewer replicas")
        self.report.events.append({"op": "kill", "victim": victim, "from": str(old), "to": str(lay),
                                   "generation": st.generation, "switch_step": rec.switch_step,
                                   "pause_s": rec.pause_seconds, "bytes_moved": rec.bytes_moved, "wall_s": took})
        self.out(f"  kill {victim:>5} {str(old):>16} -> {str(lay):<16} recovered at step {rec.switch_step}, "
                 f"pause {rec.pause_seconds or 0:.3f} s, moved {rec.bytes_moved:>9,} B, wall {took:.2f} s")

    def _wait_recovered(self, generation: int) -> Any:
        deadline = time.monotonic() + self.opts.op_timeout_s
        while time.monotonic() < deadline:
            st = self.h.status()
            if st.phase == "running" and st.generation > generation:
                return st
            if st.phase not in ("running", "recovering"):
                raise SoakFailure(f"job {st.phase} instead of recovering: {st.error or st.reason}")
            time.sleep(0.05)
        raise TimeoutError(f"not recovered within {self.opts.op_timeout_s:g} s: {self.h.status()}")

    # ---- checks ------------------------------------------------------------------------------
    def _check_result(self, res: RescaleResult, frm: Layout | None, to: str) -> None:
        rec = res.record
        if not rec.ok or res.to_layout != Layout.parse(to) or res.from_layout != frm:
            raise SoakFailure(f"rescale {frm} -> {to}: got {res.from_layout} -> {res.to_layout}, ok={rec.ok} "
                              f"({rec.reason})")
        if res.bytes_moved != res.planned_bytes or res.lower_bound_bytes > res.planned_bytes:
            raise SoakFailure(f"rescale {frm} -> {to}: moved {res.bytes_moved} B, planned {res.planned_bytes} B, "
                              f"lower bound {res.lower_bound_bytes} B")

    def _expect(self, layout: str, workers: Sequence[str], *, ordered: bool, phase: str = "running") -> None:
        st = self.h.status()
        same = list(st.workers) == list(workers) if ordered else sorted(st.workers) == sorted(workers)
        if st.layout != Layout.parse(layout) or not same or st.phase != phase:
            raise SoakFailure(f"expected {phase} on {layout} with {list(workers)}, job is {st.phase} on "
                              f"{st.layout} with {st.workers} ({st.error or st.reason})")

    def _expect_phase(self, phase: str) -> None:
        st = self.h.status()
        if st.phase != phase:
            raise SoakFailure(f"expected the job {phase}, it is {st.phase} ({st.error or st.reason})")

    def _event(self, a: dict[str, Any], res: RescaleResult, op: str) -> None:
        rec = res.record
        ev = {"op": op, "generation": res.generation, "from": str(res.from_layout) if res.from_layout else None,
              "to": str(res.to_layout),
              "switch_step": res.switch_step, "pause_s": res.pause_seconds, "bytes_moved": res.bytes_moved,
              "planned_bytes": res.planned_bytes, "lower_bound_bytes": res.lower_bound_bytes,
              "wall_s": res.wall_seconds, "leave_s": res.leave_seconds, "joiners": len(rec.joiners),
              "leavers": len(rec.leavers), "remap": a.get("remap")}
        self.report.events.append(ev)
        n = sum(1 for e in self.report.events if e["op"] in ("rescale", "resume", "pause"))
        pause = "-" if res.pause_seconds is None else f"{res.pause_seconds:.3f} s"
        self.out(f"{n:3d} {op:<7} {str(res.from_layout or '-'):>16} -> {str(res.to_layout):<16} pause {pause:>9}  moved "
                 f"{res.bytes_moved:>9,} B  wall {res.wall_seconds:5.2f} s  (+{len(rec.joiners)} -{len(rec.leavers)}"
                 f", step {res.switch_step})")

    # ---- end ---------------------------------------------------------------------------------
    def _stop(self) -> None:
        self.dog.arm("stop", 120)
        try:
            final = self.h.stop(timeout=30)
        finally:
            self.dog.disarm()
        if self.dog.fired:
            self.report.hang = self.dog.fired
        if final.error is not None and not self.report.failures:
            self.report.failures.append(f"the job ended with an error: {final.error}")
        for w, p in sorted(self.h.procs.items()):
            code = p.poll()
            want = -signal.SIGKILL if w in self.killed else 0
            if code != want and not self.report.failures and not self.report.hang:
                self.report.failures.append(f"worker {w} ended with {code}, expected {want}")
        steps = self.registry.get_sample_value("elastic_training_steps_total", {"job": self.h.job})
        history = self.h.history()
        if steps != len(history) and not self.report.failures:
            self.report.failures.append(f"elastic_training_steps_total={steps}, {len(history)} steps on record")

    def _compare(self) -> None:
        history = self.h.history()
        self.report.steps = len(history)
        ref = ReferenceCurve.of(self.cfg).first(len(history))
        bad, worst = compare_losses(history, ref, TOLERANCE[self.opts.dtype])
        self.report.mismatches.extend(bad)
        self.report.max_rel_error = worst
        # each generation's first step is on its layout
        for ev in self.report.events:
            s = ev.get("switch_step")
            if ev["op"] in ("start", "rescale", "resume", "kill") and s is not None and 0 <= s < len(history):
                r = history[s]
                if (r.generation, str(r.layout)) != (ev["generation"], ev["to"]):  # events are text (the report)
                    self.report.mismatches.append(f"step {s}: on record as gen {r.generation} {r.layout}, the "
                                                  f"{ev['op']} put gen {ev['generation']} {ev['to']} there")

    def _kill_everyone(self, why: str) -> None:
        if why.startswith("hang"):
            self.report.hang = why
        for p in list(self.h.procs.values()):
            if p.poll() is None:
                p.kill()
        for p in list(self.h.procs.values()):
            try:
                p.wait(5)
            except Exception:  # noqa: BLE001 - best effort: the process may be a zombie of a dead session
                pass


def run_soak(opts: SoakOptions, *, out: Callable[[str], None] = print, hard_exit: bool = False) -> SoakReport:
    return Soak(opts, out=out, hard_exit=hard_exit).run()


# ---- command line ------------------------------------------------------------------------------


def _verdict(report: SoakReport, out: Callable[[str], None]) -> None:
    moves = [e for e in report.events if e["op"] in ("rescale", "resume")]
    pauses = sorted(e["pause_s"] for e in moves if e["pause_s"] is not None)
    kills = [e for e in report.events if e["op"] == "kill"]
    mid = [e for e in report.events if e["op"] == "rescale+kill"]
    med = pauses[len(pauses) // 2] if pauses else float("nan")
    out(f"\n{len(moves)} rescales ({sum(e['op'] == 'resume' for e in moves)} resumes from a pause), {len(kills)} "
        f"kills recovered, {len(mid)} rescales with a member killed, {report.steps} steps, pause median {med:.3f} s max {max(pauses, default=0):.3f} s, "
        f"largest loss error {report.max_rel_error:.1e} (rel), {report.seconds:.1f} s")
    if report.ok:
        out(f"PASS seed {report.seed}: every rescale done, every step's loss equals the never-rescaled run")
        return
    out(f"FAIL seed {report.seed} (worker logs: {report.log_dir})")
    for line in ([report.hang] if report.hang else []) + report.failures + report.mismatches[:20]:
        out(f"  - {line}")
    if report.traceback:
        out(report.traceback.rstrip())
    out("sequence (replay with --replay on the --json file):")
    for a in report.actions:
        out(f"  {json.dumps(a)}")


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rescales", type=int, default=30)
    ap.add_argument("--model", default="tiny", help=f"a preset or {', '.join(EXTRA_MODELS)}")
    ap.add_argument("--max-workers", type=int, default=4)
    ap.add_argument("--kill-prob", type=float, default=0.0)
    ap.add_argument("--pause-prob", type=float, default=0.1)
    ap.add_argument("--mid-kill-prob", type=float, default=0.0,
                    help="kill a member right after a rescale's directive (both layouts recoverable)")
    ap.add_argument("--layouts", default=None, help="comma-separated: draw only these layouts")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--op-timeout", type=float, default=120.0, help="seconds for one operation")
    ap.add_argument("--no-verify", action="store_true", help="skip the reshard checksums")
    ap.add_argument("--log-dir", default=None, help="keep worker logs here (default: temp, removed on success)")
    ap.add_argument("--json", default=None, help="write the report (with the exact sequence) here")
    ap.add_argument("--replay", default=None, help="run the actions of a --json report instead of drawing them")
    args = ap.parse_args(argv)
    replay = None
    opts_from: dict[str, Any] = {}
    if args.replay:
        with open(args.replay) as f:
            saved = json.load(f)
        replay = saved["actions"]
        opts_from = {k: saved["options"][k] for k in ("model", "dtype", "global_batch", "micro_batch", "seed")}
    opts = SoakOptions(seed=args.seed, rescales=args.rescales, model=args.model, max_workers=args.max_workers,
                       kill_prob=args.kill_prob, pause_prob=args.pause_prob, mid_kill_prob=args.mid_kill_prob,
                       layouts=args.layouts.split(",") if args.layouts else None,
                       dtype=args.dtype,
                       global_batch=args.global_batch, micro_batch=args.micro_batch, op_timeout_s=args.op_timeout,
                       verify_reshard=not args.no_verify, log_dir=args.log_dir, replay=replay)
    for k, v in opts_from.items():
        setattr(opts, k, v)
    signal.signal(signal.SIGTERM, _interrupted)  # a terminated soak still stops its job and kills its workers
    print(f"soak seed {opts.seed}: {opts.model} {opts.dtype}, global batch {opts.global_batch}, "
          f"{'replaying ' + str(len(replay)) + ' actions' if replay else str(opts.rescales) + ' rescales'}, "
          f"up to {opts.max_workers} workers, kill-prob {opts.kill_prob:g}, mid-kill-prob {opts.mid_kill_prob:g}",
          flush=True)
    report = run_soak(opts, out=lambda s: print(s, flush=True), hard_exit=True)
    _verdict(report, print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 2 if report.hang else 1


if __name__ == "__main__":
    sys.exit(main())
