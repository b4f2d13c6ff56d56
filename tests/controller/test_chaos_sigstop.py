"""Chaos: two ``elastic serve`` processes on one PostgreSQL and one cluster; the leader is stopped
(SIGSTOP) inside an apply longer than the lease and resumed (SIGCONT) once the standby took over.

The cluster is the chaos backend at our boundary (``tests/controller/_chaos_backend.py``, loaded
with ``--backend``): one truth for both processes, every change logged with the process, its
lease owner and epoch. The database writes are logged by triggers the test puts on every table,
with the writer's PostgreSQL ``application_name`` (one per process). The old leader must change
nothing more in the cluster (its in-flight change is refused at the commit point) and write
nothing more to the DB; the standby must finish what the old leader had begun; no GPU is ever
held by two workloads. Then the same with one host name (lease identity) for both processes, and
with the stop landing while the leader's lease renewal holds the lease row's lock. Last, the
standby shuts down cleanly and the old leader, a standby now, takes over at a new epoch: a write
at any earlier epoch stays refused.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from elastic import store as db
from tests.fixtures.postgres import _admin, _with_database

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = str(Path(sys.executable).with_name("elastic"))
LEASE = 3.0
TICK = 0.25
SLOW = 1.5 * LEASE  # every training start takes this long: an apply longer than the lease
WAIT = 60.0  # bound on every wait for an event
POOL = "chaos"
_n = itertools.count()
LEADING = re.compile(r"leading pool chaos: lease taken by \S+ at epoch (\d+)")

CONFIG = {
    "pool": {"name": POOL, "nodes": 2, "gpus_per_node": 4, "hardware": "h100-80g",
             "rescale_interval_seconds": 0, "gain_threshold": 0.0},
    "services": [{"name": "chat", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 6,
                  "metric": {"preset": "vllm-running", "target": 10}}],
    "jobs": [{"name": "pretrain", "model": "gpt-1.3b", "min_gpus": 1, "max_gpus": 8, "global_batch": 64}],
    "controller": {"tick_seconds": TICK, "lease_seconds": LEASE},
}

# every row written to a controller table, with the writer's application_name (rolled back with
# a refused transaction, so only writes that landed are listed)
AUDIT = """
CREATE TABLE chaos_writes (id bigserial PRIMARY KEY, app text, tbl text, op text, doc jsonb);
CREATE FUNCTION chaos_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO chaos_writes (app, tbl, op, doc) VALUES (current_setting('application_name'), TG_TABLE_NAME,
    TG_OP, CASE WHEN TG_OP = 'DELETE' THEN to_jsonb(OLD) ELSE to_jsonb(NEW) END);
  RETURN NULL;
END $$;
CREATE TABLE chaos_knobs (stall_app text);
CREATE FUNCTION chaos_stall() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('application_name') IN (SELECT stall_app FROM chaos_knobs) THEN
    PERFORM pg_sleep(1);
  END IF;
  RETURN NULL;
END $$;
"""
# the stall knob: a lease update of the named process takes a second after it locked the row, so
# the test can stop that process while its transaction holds the lease row's lock
STALL = "CREATE TRIGGER chaos_stall AFTER UPDATE ON leases FOR EACH ROW EXECUTE FUNCTION chaos_stall()"


@pytest.fixture
def chaos_db(postgres_url: str):
    name = f"chaos_{os.getpid()}_{next(_n)}"
    _admin(postgres_url, f'CREATE DATABASE "{name}"')
    url = _with_database(postgres_url, name)
    db.upgrade(url)
    engine = sa.create_engine(url)
    with engine.begin() as c:
        tables = [r[0] for r in c.execute(sa.text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"))]
        c.execute(sa.text(AUDIT))
        for t in tables:
            c.execute(sa.text(f'CREATE TRIGGER chaos_w AFTER INSERT OR UPDATE OR DELETE ON "{t}" '
                              "FOR EACH ROW EXECUTE FUNCTION chaos_log()"))
        c.execute(sa.text(STALL))
    try:
        yield url, engine
    finally:
        engine.dispose()
        _admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Serve:
    """One ``elastic serve`` process; ``app``: its PostgreSQL application_name (the test's tag)."""

    def __init__(self, tmp: Path, url: str, app: str, *, owner: str | None) -> None:
        self.app, self.tmp, self.err = app, tmp, tmp / f"{app}.err"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PGAPPNAME": app, "CHAOS_DIR": str(tmp),
               "CHAOS_SLOW": str(SLOW), "CHAOS_HOLD": "1", "COLUMNS": "400"}
        env.pop("ELASTIC_CONTROLLER_ID", None)
        if owner is not None:  # the lease identity as a deployment sets it
            env["ELASTIC_CONTROLLER_ID"] = owner
        cfg = tmp / "pool.yaml"
        cfg.write_text(yaml.safe_dump(CONFIG))
        self.files = [open(tmp / f"{app}.out", "w"), open(self.err, "w")]
        self.proc = subprocess.Popen(
            [ELASTIC, "serve", "--config", str(cfg), "--db", url, "--api-port", "-1",
             "--backend", "tests.controller._chaos_backend:backend"],
            cwd=ROOT, env=env, stdout=self.files[0], stderr=self.files[1], start_new_session=True)
        self.pid = self.proc.pid

    def release(self) -> None:
        """Let its held training start go on (see the chaos backend's hold)."""
        (self.tmp / f"release-{self.pid}").touch()

    def log(self) -> str:
        return self.err.read_text()

    def alive(self) -> None:
        assert self.proc.poll() is None, f"{self.app} exited ({self.proc.returncode}): {self.log()[-3000:]}"

    def signal(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def stop(self) -> int:
        """SIGTERM (a clean shutdown: the lease is handed back if held); SIGKILL if that hangs."""
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        for f in self.files:
            f.close()
        return self.proc.returncode


def _events(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]  # a line being written is left for later


def _until(what: str, pred: Callable[[], Any], *procs: Serve) -> Any:
    deadline = time.monotonic() + WAIT
    while True:
        got = pred()
        if got:
            return got
        for p in procs:
            p.alive()
        assert time.monotonic() < deadline, f"timed out after {WAIT:g} s waiting for {what}"
        time.sleep(0.05)


def _writes(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as c:
        return [dict(r._mapping) for r in c.execute(sa.text("SELECT id, app, tbl, op, doc FROM chaos_writes "
                                                             "ORDER BY id"))]


def _sql(engine: sa.Engine, query: str) -> Any:
    with engine.begin() as c:
        res = c.execute(sa.text(query))
        return res.scalar() if res.returns_rows else None


def _ledger(events: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Replay the cluster's changes in commit order; no GPU may ever be held by two workloads."""
    held: dict[str, set[str]] = {}
    for e in (e for e in events if e["phase"] == "commit"):
        held[e["workload"]] = set(e["gpus"])
        seen: dict[str, str] = {}
        for w, gpus in held.items():
            for g in gpus:
                assert g not in seen, f"GPU {g} held by {seen[g]} and {w} after {e}"
                seen[g] = w
    return {w: g for w, g in held.items() if g}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("owners, where", [
    pytest.param((None, None), "apply", id="distinct-identities"),
    pytest.param(("gpu-host-1", "gpu-host-1"), "apply", id="same-host-name"),
    # the stop lands while the leader's heartbeat, renewing the lease during the apply, holds the
    # lease row's lock in an open transaction: the standby must not wait on it for ever
    pytest.param((None, None), "renewal", id="stopped-mid-renewal"),
])
def test_a_leader_stopped_mid_apply_and_resumed_after_a_takeover_does_nothing_more(chaos_db, tmp_path, owners,
                                                                                    where):
    url, engine = chaos_db
    procs = [Serve(tmp_path, url, f"chaos-{i}", owner=owners[i]) for i in (0, 1)]
    try:
        # 1. both start; the one that leads (A) enters the training start and is held at its slow
        # part; the other (B) will not be held
        entered = _until("a leader to enter the training start", lambda: [
            e for e in _events(tmp_path) if e["phase"] == "enter" and e["kind"] == "job"], *procs)[0]
        a, b = procs if procs[0].pid == entered["pid"] else procs[::-1]
        b.release()
        a_epoch, a_owner = entered["epoch"], entered["owner"]
        assert a_epoch is not None and "leading pool chaos" in a.log(), a.log()
        # 2. B stands by while A holds the lease (A's heartbeat renews it through the long apply)
        _until("B to stand by", lambda: "standing by: the lease of pool chaos is held by" in b.log(), a, b)
        # 3. A is stopped inside its apply: its heartbeat stops with it
        if where == "renewal":
            _sql(engine, f"INSERT INTO chaos_knobs VALUES ('{a.app}')")
            _until("A's heartbeat to be inside a lease renewal", lambda: _sql(engine, (
                f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{a.app}' "
                "AND wait_event = 'PgSleep'")), a)
        a.signal(signal.SIGSTOP)
        _sql(engine, "DELETE FROM chaos_knobs")
        stopped_at = len(_events(tmp_path))
        # 4. B takes over (after the lease ran out), recovers and finishes the start A had begun
        done = _until("B to start the job A had begun", lambda: [
            e for e in _events(tmp_path)[stopped_at:]
            if e["pid"] == b.pid and e["phase"] == "commit" and e["workload"] == "pretrain"], b)[0]
        b_epoch = done["epoch"]
        assert b_epoch == a_epoch + 1, (a_epoch, done)
        _until("B to record the decision that started it", lambda: [
            w for w in _writes(engine) if w["app"] == b.app and w["tbl"] == "decisions"
            and any("pretrain" in step for step in w["doc"]["plan"].get("applied", []))], b)
        # 5. A resumes: its in-flight change reaches its commit point and is refused there
        a.release()
        a.signal(signal.SIGCONT)
        refused, ended = _until("A's in-flight start to end", lambda: [
            (i, e) for i, e in enumerate(_events(tmp_path))
            if i >= stopped_at and e["pid"] == a.pid and e["phase"] in ("refused", "commit")], a)[0]
        assert ended["phase"] == "refused", f"the stopped leader's change landed after the takeover: {ended}"
        _until("A to stand down", lambda: "lost the lease of pool chaos" in a.log(), a)
        # ... and goes on ticking as a standby: three more ticks (its pings) with nothing done
        _until("three standby ticks of A", lambda: sum(
            1 for e in _events(tmp_path)[refused:] if e["pid"] == a.pid and e["phase"] == "ping") >= 3, a, b)
        a.alive()
        b.alive()

        events = _events(tmp_path)
        after = events[stopped_at:]
        # the old leader performed no further action: one refusal (the call it was in), nothing else
        mine = [e for e in after if e["pid"] == a.pid and e["phase"] != "ping"]
        assert [(e["phase"], e["workload"], e["epoch"]) for e in mine] == [("refused", "pretrain", a_epoch)], mine
        # every change after the stop is B's, at B's epoch; the fencing token never went back
        changes = [e for e in events if e["phase"] == "commit"]
        assert all(e["pid"] == b.pid and e["epoch"] == b_epoch for e in after if e["phase"] == "commit"), after
        assert [e["epoch"] for e in changes] == sorted(e["epoch"] for e in changes), changes
        # no GPU held twice at any time; the standby finished the decision: the job runs on the GPUs
        # A had begun to give it, next to the service
        held = _ledger(events)
        assert held["pretrain"] == set(entered["gpus"]), (held, entered)
        assert len(held.get("chat", ())) == 1, held  # the service's minimum (its metric is missing: held)
        # no DB write of A landed after B took the lease
        writes = _writes(engine)
        takeover = next(w for w in writes if w["app"] == b.app and w["tbl"] == "leases"
                        and w["doc"]["epoch"] == b_epoch)
        from_a = [w for w in writes if w["app"] == a.app]
        assert from_a, "A wrote nothing while it led: the audit does not see its writes"
        late = [w for w in from_a if w["id"] > takeover["id"]]
        assert not late, late
        # B closed A's interrupted action from the cluster's truth; the lease is B's at its epoch
        store = db.Store.from_url(url)
        try:
            assert db.open_actions(store, POOL) == []
            holder = db.lease_holder(store, POOL)
            assert holder is not None and (holder.owner, holder.epoch) == (done["owner"], b_epoch), holder
        finally:
            store.dispose()
        assert "Traceback" not in a.log() and "Traceback" not in b.log(), a.log() + b.log()

        # 6. B shuts down cleanly and hands the lease back at its epoch; A, a standby now, takes it
        # at a new one: the fencing token never goes back (not even for a process of the same
        # name), so the DB goes on refusing a write at A's old epoch or B's
        assert b.stop() == 0, b.log()
        _until("A to lead again", lambda: len(LEADING.findall(a.log())) == 2, a)
        assert int(LEADING.findall(a.log())[-1]) == b_epoch + 1, a.log()
        store = db.Store.from_url(url)
        try:
            for owner, epoch in ((a_owner, a_epoch), (done["owner"], b_epoch)):
                stale = db.FencedStore(store, POOL, owner)
                stale.epoch = epoch
                with pytest.raises(db.LeaseLost):
                    db.record_decision(stale, pool=POOL, tick_at=datetime.now(UTC), reason="Stale",
                                       message="a write at an old epoch", plan={}, inputs={})
        finally:
            store.dispose()
        assert a.stop() == 0, a.log()
    finally:
        for p in procs:
            p.stop()


# ---- ``elastic serve --backend``, which the chaos test runs on --------------------------------------

@pytest.mark.parametrize("spec, needle", [
    ("nonsense", "--backend: 'nonsense' is neither 'ray' nor MODULE:FACTORY"),
    ("no_such_module_x:make", "--backend: cannot import module 'no_such_module_x'"),
    ("tests.controller._chaos_backend:nope", "has no 'nope'; name its backend factory after the colon"),
    ("tests.controller._chaos_backend:HOLD_LIMIT", "is not callable"),
])
def test_a_backend_that_cannot_be_had_is_named_with_the_fix(spec: str, needle: str) -> None:
    from elastic.cli.serve import backend_factory
    from elastic.model import SpecError

    with pytest.raises(SpecError, match=re.escape(needle)):
        backend_factory(spec)


def test_a_factory_that_returns_no_backend_says_what_it_lacks() -> None:
    from elastic.cli.serve import backend_factory, external_backend
    from elastic.model import SpecError

    with pytest.raises(SpecError, match="returned a object, not a backend: it lacks name, cancel_grow, inventory"):
        external_backend(lambda pool: object(), None, "x:y")
    assert backend_factory("ray") is None


@pytest.mark.slow
def test_serve_refuses_a_backend_it_cannot_import_before_anything_starts(tmp_path: Path) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    p = subprocess.run([ELASTIC, "serve", "--config", str(cfg), "--db", f"sqlite:///{tmp_path}/x.db",
                        "--backend", "no_such_module_x:make"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 2 and "cannot import module 'no_such_module_x'" in p.stderr, p.stderr
    assert "--backend" in p.stderr and not (tmp_path / "x.db").exists()
