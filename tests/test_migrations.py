"""The shipped Alembic migrations, on SQLite, PostgreSQL and MySQL/MariaDB."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from celery import Celery
from sqlalchemy import create_engine, func, inspect, select, text
from sqlalchemy.exc import OperationalError

from celery_lease.errors import LeaseError
from celery_lease.migrations import (
    VERSION_TABLE,
    DDLLockTimeout,
    MigrationBounds,
    MigrationError,
    alembic_config,
    current,
    head,
    migration_bounds,
    schema_differences,
    upgrade,
)
from celery_lease.schema import TABLE_NAME, metadata
from celery_lease.store import LeaseStore
from celery_lease.store.databases import database_for
from celery_lease.store.mysql import MySQLMigrationLock
from celery_lease.store.postgresql import PG_LOCK_KEY
from tests.cluster import Cluster
from tests.helpers import REPO, Worker, plain_engine, require, wait_for
from tests.workerapp import effects, effects_metadata


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


def test_a_database_at_a_revision_this_version_does_not_ship_is_one_line(db_url: str) -> None:
    """`lease migrate` of a database a newer celery-lease migrated (or an older release's
    migrate during a rolling deploy): one line naming the revision, exit 1 (it printed
    Alembic's traceback, "Can't locate revision identified by '0099'")."""
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0099'"))
    engine.dispose()
    proc = _migrate_cli(db_url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "the database is at revision '0099', which this version does not ship" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_shortest_lease_in_use_counts_runs_that_ended_within_the_hour(db_url: str) -> None:
    """An idle worker of the previous release (a 3 s lease this app does not know) may
    claim again during the migration: the lease of a run that ended within the hour counts,
    as a running one's does (with nothing running, migrate used this app's longer lease)."""
    upgrade(db_url)
    store = LeaseStore.from_url(db_url)
    for run_id, lease_ms in (("old-short", 3_000), ("new-long", 30_000)):
        claim = store.claim(run_id, "o:1:x", task_name="t", lease_ms=lease_ms, max_attempts=3)
        store.complete(run_id, "o:1:x", claim.attempt)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            assert migration_bounds(conn, 30.0).shortest_lease == 3.0
            conn.execute(
                text(
                    f"UPDATE {TABLE_NAME} SET finished_at = finished_at - 7200000 "
                    "WHERE id = 'old-short'"
                )
            )
            conn.commit()
            assert migration_bounds(conn, 30.0).shortest_lease == 30.0  # two hours ago
    finally:
        engine.dispose()
        store.dispose()


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
            lock = database_for(conn.dialect.name).migration_lock()
            with conn.begin():
                lock.acquire(conn, 5)
                started = time.monotonic()
                proc = _migrate_cli(db_url, "--lock-timeout", "1", timeout=30)
                waited = time.monotonic() - started
            lock.release(conn)
    finally:
        engine.dispose()
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "held the migration lock for more than 1 s" in lines[0], lines
    assert 0.9 <= waited < 20
    assert upgrade(db_url).after == head()  # and the lock is free again


def _migrating(conn: Any) -> bool:
    """True while a `lease migrate` run holds the database's migration lock."""
    if conn.dialect.name == "postgresql":
        key = PG_LOCK_KEY
        query = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            f" AND classid = {key >> 32} AND objid = {key & 0xFFFFFFFF} AND objsubid = 1"
        )
    else:
        query = f"SELECT IS_USED_LOCK({MySQLMigrationLock.NAME}) IS NOT NULL"
    return bool(conn.exec_driver_sql(query).scalar())


def _revision(conn: Any) -> str | None:
    return conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar()


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
    ("backend", "start"),
    [
        ("postgresql", "0003"),  # 0004's index is built concurrently: no write waits for it
        ("mysql", "0003"),  # 0004's index: online, a brief metadata lock at start and end
        ("postgresql", "0001"),  # 0002's ADD COLUMN needs a brief exclusive lock
        ("mysql", "0001"),
    ],
)
def test_migrate_beside_a_fenced_transaction_blocks_no_heartbeat(
    backend: str, start: str, request: pytest.FixtureRequest
) -> None:
    """`lease migrate` to head while a fence holds a run's row: heartbeats keep renewing.

    One run's fence transaction stays open (as a worker committing its writes
    holds it) while another run's 3 s lease is renewed every 0.2 s. The
    migration cannot get its table lock until the fence commits, and keeps
    trying; each try may queue the renewals behind it for a tenth of the
    shortest running lease (0.3 s here; MariaDB, whose waits are whole seconds,
    does not wait at all). Each renewal stays under that plus 0.5 s of slack,
    the lease is never lost, and migrate finishes once the fence commits.
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
            while not _migrating(watch):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "migrate never took the migration lock"
                watch.rollback()
                time.sleep(0.1)
            watch.rollback()
            time.sleep(6.0)  # the fence stays open past the 3 s lease
            assert proc.poll() is None and _revision(watch) == start  # held up by the fence
            watch.rollback()
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
    assert slowest < 0.3 + 0.5, heartbeats.beats
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
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_change_that_never_gets_its_lock_stops_after_the_total(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """An ALTER TABLE kept from its lock by a transaction that stays open is tried, ``pause``
    apart, for ``total`` seconds, then the migration stops with DDLLockTimeout (one line, no
    SQLAlchemy error) and the schema stays at the revision before it."""
    url = str(request.getfixturevalue({"postgresql": "pg_url"}.get(backend, "mysql_url")))
    upgrade(url, "0001")
    bounds = MigrationBounds(shortest_lease=3.0, lock_wait=0.1, pause=0.3, total=2.0)
    engine = create_engine(url)
    try:
        with engine.connect() as holder:
            holder.execute(text(f"SELECT count(*) FROM {TABLE_NAME}"))  # table open, uncommitted
            started = time.monotonic()
            with pytest.raises(DDLLockTimeout, match="did not get its lock in 2 s") as info:
                command.upgrade(alembic_config(url=url, bounds=bounds), "head")
            took = time.monotonic() - started
            holder.rollback()
            assert info.value.tries >= 3 and 1.5 < took < 15, (info.value.tries, took)
            # The line names its code and the wait each try had: MariaDB's lock_wait_timeout
            # is whole seconds, so 0.1 s is no wait at all (it said "at most 0.1 s").
            message = str(info.value)
            assert message.startswith("ddl_lock_timeout: "), message
            each = {"postgresql": ("of at most 0.1 s",)}.get(
                backend, ("without waiting (NOWAIT)", "of at most 1 s")
            )
            assert any(words in message for words in each), message
        with engine.connect() as conn:
            assert _revision(conn) == "0001"
    finally:
        engine.dispose()
    assert upgrade(url).after == head()


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


PARTIAL = {
    "ix_celery_lease_runs_concurrency": "concurrency_key IS NOT NULL",
    "ix_celery_lease_runs_status_finished": "finished_at IS NOT NULL",
}


def _index_wheres(url: str) -> dict[str, str | None]:
    """Each of the two indexes 0013 changes, and the rows it holds (None: every row)."""
    engine = create_engine(url)
    try:
        indexes = inspect(engine).get_indexes(TABLE_NAME)
    finally:
        engine.dispose()
    out: dict[str, str | None] = {}
    for index in indexes:
        if index["name"] in PARTIAL:
            options = index.get("dialect_options", {})
            where = options.get("postgresql_where") or options.get("sqlite_where")
            out[str(index["name"])] = None if where is None else " ".join(str(where).split())
    return out


@pytest.mark.timeout(90)
def test_keyless_and_unfinished_runs_stay_out_of_two_indexes_after_0013(db_url: str) -> None:
    """0013 makes the concurrency and the (status, finished_at) indexes partial where the
    database has partial indexes (a claim and a completion of a run without a key then
    touch neither); MySQL keeps both whole. A downgrade makes them whole again."""
    partial = not db_url.startswith("mysql")
    whole: dict[str, str | None] = dict.fromkeys(PARTIAL)
    upgrade(db_url, "0012")
    assert _index_wheres(db_url) == whole
    upgrade(db_url)
    wheres = _index_wheres(db_url)
    assert set(wheres) == set(PARTIAL)
    for name, where in wheres.items():
        if partial:
            assert where is not None and PARTIAL[name] in where, (name, where)
        else:
            assert where is None, (name, where)
    assert _differences(db_url) == []
    command.downgrade(alembic_config(url=db_url), "0012")
    assert _index_wheres(db_url) == whole
    command.upgrade(alembic_config(url=db_url), "head")
    assert _index_wheres(db_url) == wheres


@pytest.mark.timeout(90)
def test_embedded_worker_makes_a_whole_index_of_an_older_sqlite_file_partial(
    sqlite_url: str, workers: list[Worker], tmp_path: Path
) -> None:
    """The embedded default has no migrate step: a worker started on a SQLite file made
    before 0013 builds the two indexes again, partial (one BEGIN IMMEDIATE transaction),
    and runs tasks on it."""
    upgrade(sqlite_url, "0012")
    assert _index_wheres(sqlite_url) == dict.fromkeys(PARTIAL)
    folder = tmp_path / "broker"
    (folder / "control").mkdir(parents=True)
    broker = {"CL_BROKER_URL": "filesystem://", "CL_FS_DIR": str(folder)}
    cluster = Cluster(sqlite_url, broker, tmp_path, workers)  # its create_schema adds nothing
    try:
        cluster.start("w", pool="threads")
        wheres = _index_wheres(sqlite_url)
        assert all(where and PARTIAL[name] in where for name, where in wheres.items()), wheres
        task_id = cluster.send("work", 0.0)
        wait_for(lambda: _status(cluster.engine, task_id) == "succeeded", 30, 0.1, "the run")
    finally:
        cluster.close()


@pytest.mark.timeout(90)
def test_migrate_after_an_embedded_worker_upgraded_the_file_records_head(
    sqlite_url: str, workers: list[Worker], tmp_path: Path
) -> None:
    """A worker on a SQLite file made by an earlier version adds what the table lacks,
    without recording a revision; `lease migrate` then failed on every run (``duplicate
    column name``). It finds the table current and records head."""
    upgrade(sqlite_url, "0005")
    folder = tmp_path / "broker"
    (folder / "control").mkdir(parents=True)
    broker = {"CL_BROKER_URL": "filesystem://", "CL_FS_DIR": str(folder)}
    cluster = Cluster(sqlite_url, broker, tmp_path, workers)
    try:
        worker = cluster.start("w", pool="threads")
        task_id = cluster.send("work", 0.0)
        wait_for(lambda: _status(cluster.engine, task_id) == "succeeded", 30, 0.1, "the run")
        worker.stop()
    finally:
        cluster.close()
    proc = _migrate_cli(sqlite_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _revision_of(sqlite_url) == head()
    assert upgrade(sqlite_url).after == head()  # and again: nothing to do


def _migrate_cli(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``celery lease --database-url URL migrate ARGS``, run as an operator runs it."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease"),
            *("--database-url", url, "migrate", *args),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _revision_of(url: str) -> str | None:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return current(conn)
    finally:
        engine.dispose()


def _index_names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {str(index["name"]) for index in inspect(engine).get_indexes(TABLE_NAME)}
    finally:
        engine.dispose()


#: The last commit whose schema ended at 0005: the release before checkpoints (0006), flow
#: control (0007), trace context (0008) and the web view's indexes (0009).
PREVIOUS_RELEASE = "29c8447f66f10118e58c73b02bfb9da8d78af931"


@pytest.fixture
def previous_release(tmp_path: Path) -> Path:
    """The previous release's package and test app, from this repository's history."""
    target = tmp_path / "previous"
    target.mkdir()
    archive = tmp_path / "previous.tar"
    made = subprocess.run(
        [
            *("git", "-C", str(REPO), "archive", "-o", str(archive), PREVIOUS_RELEASE),
            *("celery_lease", "tests/__init__.py", "tests/helpers.py", "tests/workerapp.py"),
        ],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        require(None, f"the previous release ({PREVIOUS_RELEASE[:7]}) in git history")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    imported = subprocess.run(
        [sys.executable, "-c", "import celery_lease; print(celery_lease.__file__)"],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=str(target),
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.startswith(str(target)), imported  # not this checkout's package
    return target


def _running(engine: Any) -> int:
    with engine.connect() as conn:
        return int(
            conn.exec_driver_sql(
                f"SELECT count(*) FROM {TABLE_NAME} WHERE status = 'running'"
            ).scalar_one()
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["postgresql", "mysql", "sqlite"])
def test_rolling_deploy_migrate_loses_no_short_lease(
    backend: str,
    previous_release: Path,
    redis_url: str,
    workers: list[Worker],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers of the previous release (schema 0005) hold 3 s leases while `lease migrate`
    of this one takes the schema to head beside an open writing transaction: no lease is
    lost, no body runs twice.

    The open transaction (a failed run's row updated and not committed) keeps every
    ALTER TABLE from its lock for 15 s; each try may queue the old workers' heartbeats,
    claims and completions behind it for at most a tenth of the shortest running lease,
    which migrate reads from the database (the old workers' 3 s, not this app's 30 s).
    The table holds 20,000 finished rows, so the index builds take a while. SQLite has
    no such wait (its migration holds the file's write lock throughout): its workers'
    writes wait for the whole migration, well inside their busy timeout.

    (The held row is a failed run's: on MariaDB a held row just past the ``running``
    range of the status index blocks the heartbeat's range scan by itself, migration or
    not.)
    """
    # A Django settings module another test left in the environment would make Celery's
    # Django fixup import it in the old workers, whose checkout has no Django site.
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    url = str(request.getfixturevalue({"postgresql": "pg_url"}.get(backend, f"{backend}_url")))
    upgrade(url, "0005")
    engine = plain_engine(url)
    effects_metadata.create_all(engine)
    now = int(time.time() * 1000)
    with engine.begin() as conn:  # 0005's columns only
        conn.execute(
            text(
                f"INSERT INTO {TABLE_NAME} (id, task_name, status, lease_ms, attempt,"
                " max_attempts, available_at, finished_at, created_at, updated_at)"
                " VALUES (:id, 't', :status, 30000, 1, 5, :now, :now, :now, :now)"
            ),
            [{"id": "old-held", "status": "failed", "now": now}]
            + [{"id": f"old-{i}", "status": "succeeded", "now": now} for i in range(20_000)],
        )
    queue = f"q{uuid.uuid4().hex[:8]}"
    env = {"CL_BROKER_URL": redis_url, "CL_QUEUE": queue, "CL_LEASE_DB": url}
    env |= {"CL_LEASE_SECONDS": "3"}
    for name in ("old1", "old2"):
        worker = Worker(
            env, tmp_path / f"{name}.log", name=name, pool="threads", concurrency=4,
            path=previous_release,
        )  # fmt: skip
        workers.append(worker)
        worker.wait_ready(60)
    producer = Celery("producer", broker=redis_url)
    producer.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)

    def send(seconds: float) -> str:
        task_id = uuid.uuid4().hex
        producer.send_task("workerapp.work", args=(seconds,), task_id=task_id, queue=queue)
        return task_id

    sent = [send(20.0) for _ in range(6)]
    wait_for(lambda: _running(engine) >= 4, 60, 0.1, "the old workers running four runs")
    proc = None
    try:
        with engine.connect() as holder, engine.connect() as watch:
            if backend != "sqlite":
                held = f"UPDATE {TABLE_NAME} SET updated_at = 0 WHERE id = 'old-held'"
                holder.execute(text(held))
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
            if backend != "sqlite":
                wait_for(lambda: _migrating(watch) or proc.poll() is not None, 30, 0.1, "migrate")
                watch.rollback()
                sent += [send(3.0) for _ in range(4)]  # claims and completions meanwhile
                time.sleep(15.0)
                assert proc.poll() is None and _revision(watch) == "0005"  # held up
                watch.rollback()
                holder.commit()
            out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and f"0005 -> {head()}" in out, out
        sent += [send(3.0) for _ in range(2)]  # the old release on the new schema
        wait_for(
            lambda: all(_status(engine, task_id) == "succeeded" for task_id in sent),
            90,
            0.2,
            "every run to succeed",
        )
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    logs = "".join(worker.log() for worker in workers)
    with engine.connect() as conn:
        attempts = conn.exec_driver_sql(
            f"SELECT id, attempt FROM {TABLE_NAME} WHERE id NOT LIKE 'old-%%'"
        ).all()
        starts = conn.execute(
            select(effects.c.run_id, func.count())
            .where(effects.c.kind == "start")
            .group_by(effects.c.run_id)
        ).all()
    engine.dispose()
    assert len(attempts) == len(sent) and {a for _, a in attempts} == {1}, (attempts, logs[-6000:])
    assert len(starts) == len(sent) and {n for _, n in starts} == {1}, starts
    failed_beats = logs.count("heartbeat failed")
    assert "-> lost" not in logs, (failed_beats, logs[-6000:])
    engine = create_engine(url)
    with engine.connect() as conn:
        assert schema_differences(conn) == []
    engine.dispose()


def _status(engine: Any, task_id: str) -> str | None:
    with engine.connect() as conn:
        found = conn.exec_driver_sql(
            f"SELECT status FROM {TABLE_NAME} WHERE task_id = '{task_id}'"
        ).scalar()
    return None if found is None else str(found)


_APP_ENV = """
from alembic import context
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine

from celery_lease.migrations import exclude_lease_tables

target_metadata = MetaData()
Table("orders", target_metadata, Column("id", Integer, primary_key=True), Column("sku", String(20)))

connectable = create_engine(context.config.get_main_option("sqlalchemy.url"))
with connectable.connect() as connection:
    options = {"include_name": exclude_lease_tables} if FILTERED else {}
    context.configure(connection=connection, target_metadata=target_metadata, **options)
    with context.begin_transaction():
        context.run_migrations()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("filtered", [True, False], ids=["documented", "unfiltered"])
def test_the_apps_own_alembic_check_passes_beside_the_lease_tables(
    db_url: str, tmp_path: Path, filtered: bool
) -> None:
    """An application's own Alembic environment (its `orders` table) in the lease database,
    after `lease migrate`: with migrations.md's `env.py` filter, `alembic check` finds
    nothing to do; without it, it wants to drop every celery-lease table (as users saw)."""
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id INTEGER NOT NULL PRIMARY KEY, sku VARCHAR(20))"))
    engine.dispose()
    (tmp_path / "app_migrations" / "versions").mkdir(parents=True)
    (tmp_path / "app_migrations" / "env.py").write_text(
        f"FILTERED = {filtered}\n" + _APP_ENV, encoding="utf-8"
    )
    (tmp_path / "app_migrations" / "script.py.mako").write_text("", encoding="utf-8")
    (tmp_path / "alembic.ini").write_text(
        f"[alembic]\nscript_location = app_migrations\nsqlalchemy.url = {db_url}\n",
        encoding="utf-8",
    )
    checked = subprocess.run(
        [str(Path(sys.executable).with_name("alembic")), "check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = checked.stdout + checked.stderr
    if filtered:
        assert checked.returncode == 0, output
        assert "No new upgrade operations detected" in output
    else:
        assert checked.returncode != 0
        assert "remove_table" in output and TABLE_NAME in output
