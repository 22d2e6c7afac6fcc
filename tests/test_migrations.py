"""The shipped Alembic migrations, on SQLite, PostgreSQL and MySQL/MariaDB."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import OperationalError

from celery_lease.errors import LeaseError
from celery_lease.migrations import (
    VERSION_TABLE,
    MigrationError,
    alembic_config,
    head,
    upgrade,
)
from celery_lease.migrations.lock import migration_lock
from celery_lease.schema import TABLE_NAME, metadata
from celery_lease.store import LeaseStore
from tests.helpers import REPO


def _not_version_table(name: str | None, type_: str, parent_names: object) -> bool:
    return not (type_ == "table" and name == VERSION_TABLE)


def _differences(url: str) -> list[object]:
    """Alembic's diff of the whole database (bar our version table) against the metadata."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"include_name": _not_version_table, "compare_type": True}
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_matches_package_metadata(db_url: str) -> None:
    """After upgrade head, compare_metadata against celery_lease.schema.metadata is empty."""
    result = upgrade(db_url)
    assert (result.before, result.after, result.adopted) == (None, head(), False)
    assert _differences(db_url) == []
    assert _tables(db_url) == {*metadata.tables, VERSION_TABLE}


def test_upgrade_twice_is_a_no_op(db_url: str) -> None:
    """A second upgrade finds the database at head and changes nothing."""
    upgrade(db_url)
    again = upgrade(db_url)
    assert again.before == again.after == head() and not again.changed


def test_own_version_table_leaves_application_history_alone(db_url: str) -> None:
    """The application's alembic_version row survives; ours lives in its own table."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('app_rev_42')"))
    upgrade(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [
            "app_rev_42"
        ]
        assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one() == (
            head()
        )
    engine.dispose()


def test_table_made_by_create_all_is_adopted(db_url: str) -> None:
    """A table the store auto-created is stamped at head instead of failing to re-create."""
    store = LeaseStore.from_url(db_url)
    store.create_schema()
    store.claim("r1", "o:1:x", task_name="t", lease_ms=1000, max_attempts=3)
    result = upgrade(db_url)
    assert result.adopted and result.after == head()
    assert _differences(db_url) == []
    row = store.get("r1")
    assert row is not None and row.status == "running"  # existing rows are untouched
    store.dispose()


def test_foreign_table_with_our_name_is_refused(db_url: str) -> None:
    """A celery_lease_runs table that differs from the schema stops migrate; nothing is stamped."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {TABLE_NAME} (id VARCHAR(255) PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(MigrationError, match="differs from this version's schema"):
        upgrade(db_url)
    assert VERSION_TABLE not in _tables(db_url)


def test_migrated_database_serves_the_store(db_url: str) -> None:
    """A store on a migrated database claims and completes a run."""
    upgrade(db_url)
    store = LeaseStore.from_url(db_url)
    claim = store.claim("r1", "o:1:x", task_name="t", lease_ms=5000, max_attempts=3)
    assert claim.outcome == "claimed"
    store.complete("r1", "o:1:x", claim.attempt)
    row = store.get("r1")
    assert row is not None and row.status == "succeeded"
    store.dispose()


def test_upgrade_from_0001_widens_the_payload(db_url: str) -> None:
    """A database made by 0001 holds arguments over 64 KiB after upgrade head (MySQL: LONGBLOB)."""
    upgrade(db_url, "0001")
    upgrade(db_url)
    assert _differences(db_url) == []
    store = LeaseStore.from_url(db_url)
    payload = b"\x00\xff" * (50 * 1024)
    claim = store.claim(
        "r1", "o:1:x", task_name="t", lease_ms=5000, max_attempts=3, payload=payload
    )
    assert claim.outcome == "claimed"
    row = store.get("r1")
    assert row is not None and row.payload == payload
    store.dispose()


def _race_migrate(url: str, tmp_path: Path, *extra: str, racers: int = 2) -> list[Any]:
    """Start ``racers`` ``celery lease migrate`` processes in lock-step; their results."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CL_RACERS": str(racers),
        "CL_MIGRATE_DELAY": "1.0",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.migrate_racer",
                str(barrier),
                f"racer{i}",
                "lease",
                "--database-url",
                url,
                "migrate",
                *extra,
            ],
            env=env,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(racers)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        results.append((proc.returncode, out))
    return results


@pytest.mark.timeout(90)
def test_two_migrate_runs_at_once_leave_one_schema(db_url: str, tmp_path: Path) -> None:
    """Two `lease migrate` processes started together both exit 0: one migrates, one waits."""
    results = _race_migrate(db_url, tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    outputs = sorted(out for _, out in results)
    assert sum("migrated (empty) -> " in out for out in outputs) == 1, outputs
    assert sum(f"already at revision {head()}" in out for out in outputs) == 1, outputs
    engine = create_engine(db_url)
    with engine.connect() as conn:
        versions = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    engine.dispose()
    assert versions == [head()]
    assert _tables(db_url) == {*metadata.tables, VERSION_TABLE}
    assert _differences(db_url) == []


@pytest.mark.timeout(90)
def test_two_migrate_runs_at_once_through_pgbouncer(pgbouncer_url: str, tmp_path: Path) -> None:
    """The PostgreSQL lock is transaction-scoped: it works behind PgBouncer in transaction mode."""
    results = _race_migrate(pgbouncer_url, tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    assert sum("migrated (empty) -> " in out for _, out in results) == 1, results
    assert _differences(pgbouncer_url) == []


@pytest.mark.timeout(60)
def test_migrate_waits_a_bounded_time_for_the_lock(db_url: str, tmp_path: Path) -> None:
    """While another run holds the migration lock, migrate gives up after --lock-timeout."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            lock = migration_lock(conn)
            with conn.begin():
                lock.acquire(conn, 5)
                started = time.monotonic()
                proc = subprocess.run(
                    [
                        *(sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease"),
                        *("--database-url", db_url, "migrate", "--lock-timeout", "1"),
                    ],
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                    cwd=str(REPO),
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                waited = time.monotonic() - started
            lock.release(conn)
    finally:
        engine.dispose()
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "held the migration lock for more than 1 s" in lines[0], lines
    assert 0.9 <= waited < 20
    assert upgrade(db_url).after == head()  # and the lock is free again


def _ddl_waiting(conn: Any) -> bool:
    """True while another session's DDL waits for a lock on the runs table."""
    if conn.dialect.name == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (query ILIKE '%%CREATE INDEX%%' OR query ILIKE '%%ALTER TABLE%%')"
            " AND wait_event_type = 'Lock'"
        )
    else:
        query = (
            "SELECT count(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID()"
            " AND (info LIKE '%%CREATE INDEX%%' OR info LIKE '%%ALTER TABLE%%')"
            " AND state LIKE '%%metadata lock%%'"
        )
    return bool(conn.exec_driver_sql(query).scalar())


class _Heartbeats(threading.Thread):
    """Renews one lease every 0.2 s, recording each renewal's latency and whether it held."""

    def __init__(self, renew: Callable[[], bool]) -> None:
        super().__init__(daemon=True)
        self.renew = renew
        self.stop = threading.Event()
        self.beats: list[tuple[float, bool]] = []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            started = time.monotonic()
            try:
                held = self.renew()
            except LeaseError:
                held = False
            self.beats.append((time.monotonic() - started, held))


def _renewal(store: LeaseStore, url: str, key: tuple[str, str, int]) -> Callable[[], bool]:
    """The store's heartbeat; on MySQL/MariaDB the same renewal by primary key.

    The store's MySQL heartbeat reads the (status, lease_expires_at) index and
    so waits for every running row's lock, a fenced one included, migration or
    not; this test is about the migration's locks only.
    """
    if not url.startswith("mysql"):
        return lambda: key in store.heartbeat([key]).renewed
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    renew = text(
        "UPDATE celery_lease_runs SET lease_expires_at = :now + lease_ms"
        " WHERE id = :id AND lease_owner = :owner AND attempt = :attempt"
        " AND status = 'running' AND lease_expires_at > :now"
    )

    def beat() -> bool:
        run_id, owner, attempt = key
        now = int(time.time() * 1000)
        with engine.connect() as conn:
            params = {"id": run_id, "owner": owner, "attempt": attempt, "now": now}
            return conn.execute(renew, params).rowcount == 1

    return beat


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("backend", "start", "bound"),
    [
        ("postgresql", "0003", 1.5),  # the index is built concurrently: no wait at all
        ("mysql", "0003", 2.5),
        # 0002's ADD COLUMN needs a brief exclusive lock: renewals wait at most its
        # lock_timeout (2 s) per try, never for the whole fence.
        ("postgresql", "0001", 3.0),
        ("mysql", "0001", 2.5),
    ],
)
def test_migrate_beside_a_fenced_transaction_blocks_no_heartbeat(
    backend: str, start: str, bound: float, request: pytest.FixtureRequest
) -> None:
    """`lease migrate` to head while a fence holds a run's row: heartbeats keep renewing.

    One run's fence transaction stays open (as a worker committing its writes
    holds it) while another run's lease is renewed every 0.2 s. No migration
    may queue those renewals behind the open fence: each renewal stays under
    ``bound`` seconds, the 3 s lease is never lost, and migrate finishes once
    the fence commits.
    """
    url = str(request.getfixturevalue({"postgresql": "pg_url"}.get(backend, "mysql_url")))
    upgrade(url, start)
    engine = create_engine(url)
    with engine.begin() as conn:  # claimed by hand: this version's claim needs 0002's column
        now = int(time.time() * 1000)
        for run_id, owner, lease_ms in (("fenced", "o:1:a", 60_000), ("beating", "o:2:b", 3_000)):
            conn.execute(
                text(
                    f"INSERT INTO {TABLE_NAME} (id, task_name, status, lease_owner,"
                    " lease_expires_at, lease_ms, attempt, max_attempts, available_at,"
                    " started_at, created_at, updated_at) VALUES (:id, 't', 'running', :owner,"
                    " :expires, :lease_ms, 1, 3, :now, :now, :now, :now)"
                ),
                {"id": run_id, "owner": owner, "expires": now + lease_ms, "lease_ms": lease_ms}
                | {"now": now},
            )
    store = LeaseStore.from_url(url)
    heartbeats = _Heartbeats(_renewal(store, url, ("beating", "o:2:b", 1)))
    proc = None
    try:
        with engine.connect() as fence_conn, engine.connect() as watch:
            fence_tx = fence_conn.begin()
            store.fence(fence_conn, "fenced", "o:1:a", 1)
            heartbeats.start()
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease"),
                    *("--database-url", url, "migrate"),
                ],
                env={**os.environ, "PYTHONPATH": str(REPO)},
                cwd=str(REPO),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            deadline = time.monotonic() + 30
            while not _ddl_waiting(watch):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "migrate never reached the index build"
                watch.rollback()
                time.sleep(0.1)
            time.sleep(6.0)  # the fence stays open past the 3 s lease
            fence_tx.commit()
        out, _ = proc.communicate(timeout=60)
    finally:
        heartbeats.stop.set()
        heartbeats.join(timeout=30)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        engine.dispose()
    assert proc.returncode == 0 and f"-> {head()}" in out, out
    slowest = max(latency for latency, _ in heartbeats.beats)
    # MySQL's online DDL still waits for an exclusive metadata lock at its start and end,
    # queueing writes behind it for at most its lock_wait_timeout (1 s) per try.
    assert slowest < bound, heartbeats.beats
    assert all(held for _, held in heartbeats.beats), heartbeats.beats
    assert len(heartbeats.beats) >= 10, heartbeats.beats
    rows = {run: store.get(run) for run in ("fenced", "beating")}
    assert [(r.status, r.lease_owner) for r in rows.values() if r is not None] == [
        ("running", "o:1:a"),
        ("running", "o:2:b"),
    ]
    store.dispose()
    assert _differences(url) == []


@pytest.mark.timeout(60)
def test_invalid_index_left_by_a_failed_concurrent_build_is_rebuilt(pg_url: str) -> None:
    """An INVALID index from an interrupted CREATE INDEX CONCURRENTLY is dropped and rebuilt."""
    upgrade(pg_url, "0003")
    engine = create_engine(pg_url)
    try:
        with engine.connect() as writer, engine.connect() as builder:
            writer.execute(text(f"UPDATE {TABLE_NAME} SET updated_at = 0"))  # holds ROW EXCLUSIVE
            auto = builder.execution_options(isolation_level="AUTOCOMMIT")
            auto.exec_driver_sql("SET lock_timeout = '200ms'")
            with pytest.raises(OperationalError, match="lock timeout"):
                auto.exec_driver_sql(
                    f"CREATE INDEX CONCURRENTLY ix_celery_lease_runs_status_finished"
                    f" ON {TABLE_NAME} (status, finished_at)"
                )
            writer.commit()
        validity = text(
            "SELECT indisvalid FROM pg_index"
            " WHERE indexrelid = to_regclass('ix_celery_lease_runs_status_finished')"
        )
        with engine.connect() as conn:
            assert conn.execute(validity).scalar_one() is False
        assert upgrade(pg_url).after == head()
        with engine.connect() as conn:
            assert conn.execute(validity).scalar_one() is True
    finally:
        engine.dispose()
    assert _differences(pg_url) == []


@pytest.mark.timeout(60)
def test_alembic_by_url_downgrades_and_upgrades_0004_online(db_url: str) -> None:
    """Alembic run by URL owns its transactions: 0004 drops and rebuilds its index online."""
    upgrade(db_url)
    command.downgrade(alembic_config(url=db_url), "0003")
    assert "ix_celery_lease_runs_status_finished" not in _index_names(db_url)
    command.upgrade(alembic_config(url=db_url), "head")
    assert "ix_celery_lease_runs_status_finished" in _index_names(db_url)
    assert _differences(db_url) == []


def _index_names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {str(index["name"]) for index in inspect(engine).get_indexes(TABLE_NAME)}
    finally:
        engine.dispose()
