"""Migrations: ``elastic db upgrade`` applies them once, and they match the ORM models."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from typer.testing import CliRunner

from elastic.cli import app
from elastic.store import Store, current_revision, head_revision, upgrade
from elastic.store.models import Base

ALL = ("0001", "0002", "0003", "0004")  # every shipped revision, in order
EXPECTED_TABLES = {
    "alembic_version", "pools", "inference_services", "training_jobs", "allocations", "decisions",
    "reshard_events", "pending_actions", "audit_log", "leases", "interventions", "signing_keys",
}


def test_cli_upgrade_twice_is_a_noop(db_url: str) -> None:
    runner = CliRunner()
    first = runner.invoke(app, ["db", "upgrade", "--db", db_url])
    assert first.exit_code == 0, first.output
    assert f"upgraded <empty> -> {head_revision()}" in first.output
    second = runner.invoke(app, ["db", "upgrade", "--db", db_url])
    assert second.exit_code == 0, second.output
    assert "up to date" in second.output and "nothing to do" in second.output
    current = runner.invoke(app, ["db", "current", "--db", db_url])
    assert f"revision {head_revision()}, head {head_revision()} (up to date)" in current.output

    store = Store.from_url(db_url)
    try:
        assert set(sa.inspect(store.engine).get_table_names()) == EXPECTED_TABLES
        assert current_revision(store) == head_revision()
    finally:
        store.dispose()


def test_cli_reads_url_from_env(db_url: str, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_DB_URL", db_url)
    result = CliRunner().invoke(app, ["db", "upgrade"])
    assert result.exit_code == 0 and "upgraded" in result.output, result.output


def test_upgrade_result_lists_applied_revisions(db_url: str) -> None:
    r1 = upgrade(db_url)
    assert (r1.before, r1.after, r1.applied) == (None, head_revision(), ALL)
    r2 = upgrade(db_url)
    assert (r2.before, r2.after, r2.applied) == (head_revision(), head_revision(), ())


def test_models_and_migrations_are_in_sync(db_url: str) -> None:
    """Autogenerate against the migrated database finds nothing to do: the migrations
    create exactly what the models declare (types, nullability, indexes, constraints)."""
    store = Store.from_url(db_url)
    try:
        upgrade(store)
        with store.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models differ from migrations on {store.dialect}: {diff}"
        # autogenerate does not compare CHECK constraints: their names at least must agree
        insp = sa.inspect(store.engine)
        for table in Base.metadata.sorted_tables:
            declared = {c.name for c in table.constraints if isinstance(c, sa.CheckConstraint)}
            found = {c["name"] for c in insp.get_check_constraints(table.name)}
            assert declared <= found, f"{table.name}: models declare {declared}, the database has {found}"
    finally:
        store.dispose()


def test_sync_check_detects_drift(db_url: str) -> None:
    """The sync check above can fail: a model column the migrations lack shows up."""
    store = Store.from_url(db_url)
    try:
        upgrade(store)
        md = sa.MetaData()
        for t in Base.metadata.tables.values():
            t.to_metadata(md)
        sa.Table("leases", md, sa.Column("note", sa.Text()), extend_existing=True)
        with store.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), md)
        assert any(d[0] == "add_column" and d[3].name == "note" for d in diff), diff
    finally:
        store.dispose()


_UPGRADE = "import sys; from elastic.store import upgrade; print(','.join(upgrade(sys.argv[1]).applied) or '-')"


def test_concurrent_upgrades_apply_once(db_url: str) -> None:
    """Two controllers starting at once (two processes): the migration runs once, both succeed."""
    procs = [subprocess.Popen([sys.executable, "-c", _UPGRADE, db_url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert sorted(outs) == ["-", ",".join(ALL)], outs


def test_concurrent_upgrades_in_one_process(db_url: str) -> None:
    """Alembic's context is process-global: threads must take turns, not crash."""
    results: list[object] = []

    def run() -> None:
        try:
            results.append(upgrade(db_url).applied)
        except Exception as e:  # recorded, asserted below
            results.append(e)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(r, tuple) for r in results), results
    assert sorted(results, key=len) == [(), ALL], results


def test_0002_turns_called_off_rows_into_cancelled_and_keeps_the_in_flight_index(db_url: str) -> None:
    """Rows written under 0001 survive 0002: ``failed`` + ``cancelled: `` prefix becomes
    ``cancelled`` (prefix dropped), real failures stay, the one-in-flight-per-job index holds."""
    from datetime import UTC, datetime

    from elastic import store as db

    store = Store.from_url(db_url)
    try:
        assert upgrade(store, "0001").applied == ("0001",)
        t = datetime(2026, 12, 1, tzinfo=UTC)
        row = dict(pool="p", generation=1, from_layout="tp1.pp1.dp2", to_layout="tp1.pp1.dp4", bytes_planned=0,
                   bytes_lower_bound=0, started_at=t, finished_at=t)
        with store.engine.begin() as c:
            c.execute(sa.text(
                "INSERT INTO reshard_events (job, pool, generation, from_layout, to_layout, bytes_planned, "
                "bytes_lower_bound, started_at, finished_at, status, error) VALUES (:job, :pool, :generation, "
                ":from_layout, :to_layout, :bytes_planned, :bytes_lower_bound, :started_at, :finished_at, "
                ":status, :error)"),
                [dict(row, job="a", status="failed", error="cancelled: inference wants the GPUs back"),
                 dict(row, job="a", status="failed", error="joiner w5 never arrived"),
                 dict(row, job="a", status="done", error=None)])
        assert upgrade(store, "0002").applied == ("0002",)
        rows = db.list_reshards(store, job="a")
        assert [(r.status, r.error) for r in rows] == [
            ("cancelled", "inference wants the GPUs back"), ("failed", "joiner w5 never arrived"), ("done", None)]
        # the new status is accepted, and still only one reshard per job may be in flight
        rid = db.start_reshard(store, job="a", pool="p", generation=2, from_layout="tp1.pp1.dp2",
                               to_layout="tp1.pp1.dp4", bytes_planned=0, bytes_lower_bound=0)
        with pytest.raises(db.StoreConflict):
            db.start_reshard(store, job="a", pool="p", generation=3, from_layout="tp1.pp1.dp2",
                             to_layout="tp1.pp1.dp4", bytes_planned=0, bytes_lower_bound=0)
        with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as c:  # the partial unique index
            c.execute(sa.text(
                "INSERT INTO reshard_events (job, pool, generation, from_layout, to_layout, bytes_planned, "
                "bytes_lower_bound, started_at, status) VALUES ('a', 'p', 4, 'x', 'y', 0, 0, :t, 'pending')"),
                {"t": t})
        done = db.finish_reshard(store, rid, bytes_moved=None, pause_seconds=None, error="called off",
                                 cancelled=True)
        assert done.status == "cancelled"
        with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as c:  # the status check holds
            c.execute(sa.text("UPDATE reshard_events SET status = 'maybe' WHERE id = :i"), {"i": rid})
        # and back: 0001 has no such status, the prefix returns; then forward again
        from alembic import command

        from elastic.store.migrate import alembic_config

        store.dispose()
        command.downgrade(alembic_config(db_url), "0001")
        assert current_revision(store) == "0001"
        with store.engine.connect() as c:
            rows = c.execute(sa.text("SELECT status, error FROM reshard_events WHERE id = :i"), {"i": rid}).all()
        assert rows == [("failed", "cancelled: called off")]
        assert upgrade(store, "0002").applied == ("0002",)
    finally:
        store.dispose()


def test_0003_keeps_each_old_decision_as_one_tick_and_marks_old_steady_rows_as_holds(db_url: str) -> None:
    """Decisions written under 0002 survive 0003: each is one tick (count 1, last_at = tick_at);
    the old per-tick ``Steady`` rows are holds (left out of the changes-only view), the rest are
    changes; a new identical hold after the upgrade extends nothing old (a digest never matches
    ``'Steady'``) and down-and-up again round-trips."""
    from datetime import UTC, datetime, timedelta

    from elastic import store as db

    store = Store.from_url(db_url)
    try:
        assert upgrade(store, "0002").applied == ("0001", "0002")
        t = datetime(2026, 12, 1, tzinfo=UTC)
        with store.engine.begin() as c:
            for i, reason in enumerate(("InferenceDemand", "Steady", "Steady")):
                c.execute(db.models.DecisionRow.__table__.insert().values(
                    tick_at=t + timedelta(seconds=5 * i), pool="p", inputs={}, plan={"steps": []}, reason=reason,
                    message=f"tick {i}"))
        assert upgrade(store, "0003").applied == ("0003",)
        rows = db.list_decisions(store, pool="p")
        assert [(r.reason, r.count, r.last_at, r.hold) for r in rows] == [
            ("InferenceDemand", 1, t, None), ("Steady", 1, t + timedelta(seconds=5), "Steady"),
            ("Steady", 1, t + timedelta(seconds=10), "Steady")]
        assert [r.reason for r in db.list_decisions(store, pool="p", changes_only=True)] == ["InferenceDemand"]
        new = db.record_decision(store, pool="p", tick_at=t + timedelta(seconds=15), reason="Steady",
                                 message="tick 3", plan={}, inputs={}, hold="0" * 40)
        assert new > rows[-1].id
        from alembic import command

        from elastic.store.migrate import alembic_config

        store.dispose()
        command.downgrade(alembic_config(db_url), "0002")
        with store.engine.connect() as c:
            cols = {col["name"] for col in sa.inspect(c).get_columns("decisions")}
        assert {"count", "last_at", "hold"}.isdisjoint(cols)
        assert upgrade(store, "0003").applied == ("0003",)
        assert len(db.list_decisions(store, pool="p")) == 4
    finally:
        store.dispose()


def test_0004_keeps_an_old_lease_at_epoch_0_adds_interventions_and_round_trips(db_url: str) -> None:
    """A lease written under 0003 survives 0004 at epoch 0 and the next takeover makes it 1;
    interventions and signing keys come and go with the revision."""
    from datetime import UTC, datetime, timedelta

    from alembic import command

    from elastic import store as db
    from elastic.store.migrate import alembic_config

    store = Store.from_url(db_url)
    try:
        assert upgrade(store, "0003").applied == ("0001", "0002", "0003")
        t = datetime(2026, 12, 1, tzinfo=UTC)
        with store.engine.begin() as c:
            c.execute(sa.text("INSERT INTO leases (pool, owner, acquired_at, expires_at) VALUES ('p', 'old', :a, :e)"),
                      {"a": t if store.dialect != "sqlite" else t.replace(tzinfo=None),
                       "e": (t + timedelta(seconds=15)) if store.dialect != "sqlite" else
                       (t + timedelta(seconds=15)).replace(tzinfo=None)})
        assert upgrade(store).applied == ("0004",)
        assert db.lease_holder(store, "p", now=t).epoch == 0
        assert db.take_lease(store, "p", "new", 15, now=t + timedelta(seconds=20)) == 1
        db.set_intervention(store, pool="p", kind="pause", target="p", actor="alice", now=t)
        store.dispose()
        command.downgrade(alembic_config(db_url), "0003")
        with store.engine.connect() as c:
            insp = sa.inspect(c)
            assert {"interventions", "signing_keys"}.isdisjoint(insp.get_table_names())
            assert "epoch" not in {col["name"] for col in insp.get_columns("leases")}
        assert upgrade(store).applied == ("0004",)
        assert db.list_interventions(store, "p") == []
    finally:
        store.dispose()
