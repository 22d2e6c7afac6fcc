"""The database-error taxonomy: real driver errors from each dialect, classified and wrapped."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from celery_lease.dberrors import classify, wrap
from celery_lease.errors import LeaseDatabaseError, LeaseError, LeaseInputError
from celery_lease.schema import MAX_PAYLOAD_BYTES, check_run_id
from celery_lease.store import LeaseStore


def _claim(store: LeaseStore, run_id: str, **kw: object) -> object:
    return store.claim(
        run_id,
        "owner:1:x",
        task_name="t",
        lease_ms=int(kw.pop("lease_ms", 5000)),  # type: ignore[call-overload]
        max_attempts=5,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("dialect", "orig", "transient", "cause"),
    [
        ("postgresql", psycopg.errors.DeadlockDetected(), True, "deadlock"),
        ("postgresql", psycopg.errors.SerializationFailure(), True, "serialization_failure"),
        ("postgresql", psycopg.errors.LockNotAvailable(), True, "lock_not_available"),
        ("postgresql", psycopg.errors.QueryCanceled(), True, "timeout"),
        ("postgresql", psycopg.errors.TooManyConnections(), True, "too_many_connections"),
        ("postgresql", psycopg.errors.AdminShutdown(), True, "server_shutdown"),
        ("postgresql", psycopg.errors.CrashShutdown(), True, "server_shutdown"),
        ("postgresql", psycopg.errors.CannotConnectNow(), True, "server_starting"),
        ("postgresql", psycopg.errors.ReadOnlySqlTransaction(), True, "read_only"),
        ("postgresql", psycopg.errors.StringDataRightTruncation(), False, "data_too_long"),
        ("postgresql", psycopg.errors.NumericValueOutOfRange(), False, "out_of_range"),
        ("postgresql", psycopg.errors.UndefinedTable(), False, "missing_table"),
        ("postgresql", psycopg.errors.UndefinedColumn(), False, "missing_column"),
        ("postgresql", psycopg.errors.SyntaxError(), False, "bad_sql"),
        ("postgresql", psycopg.errors.InvalidPassword(), False, "auth_failed"),
        ("postgresql", psycopg.OperationalError("connection refused"), True, "connection_refused"),
        *(
            (
                "postgresql",
                psycopg.OperationalError(f'connection to server at "db" failed: FATAL: {m}'),
                True,
                "too_many_connections",
            )
            for m in (
                "sorry, too many clients already",
                'too many connections for role "app"',
                'too many connections for database "shop"',
                "remaining connection slots are reserved for roles with the SUPERUSER attribute",
            )
        ),
        (
            "postgresql",
            psycopg.OperationalError("server closed the connection"),
            True,
            "unavailable",
        ),
        ("mysql", pymysql.err.OperationalError(1213, "Deadlock found"), True, "deadlock"),
        (
            "mysql",
            pymysql.err.OperationalError(1205, "Lock wait timeout"),
            True,
            "lock_not_available",
        ),
        ("mysql", pymysql.err.OperationalError(1040, "Too many"), True, "too_many_connections"),
        ("mysql", pymysql.err.OperationalError(2003, "Can't connect"), True, "connection_refused"),
        ("mysql", pymysql.err.OperationalError(2013, "Lost connection"), True, "disconnect"),
        ("mysql", pymysql.err.OperationalError(1969, "max_statement_time"), True, "timeout"),
        ("mysql", pymysql.err.OperationalError(1290, "--read-only option"), True, "read_only"),
        ("mysql", pymysql.err.OperationalError(1792, "READ ONLY transaction"), True, "read_only"),
        ("mysql", pymysql.err.OperationalError(1836, "read-only mode"), True, "read_only"),
        ("mysql", pymysql.err.DataError(1406, "Data too long"), False, "data_too_long"),
        ("mysql", pymysql.err.DataError(1264, "Out of range"), False, "out_of_range"),
        ("mysql", pymysql.err.ProgrammingError(1146, "no such table"), False, "missing_table"),
        ("mysql", pymysql.err.OperationalError(1045, "Access denied"), False, "auth_failed"),
        ("sqlite", sqlite3.OperationalError("database is locked"), True, "database_locked"),
        ("sqlite", sqlite3.OperationalError("no such table: x"), False, "missing_table"),
        ("sqlite", sqlite3.OperationalError("unable to open database file"), False, "cannot_open"),
    ],
)
def test_driver_errors_are_classified_by_their_codes(
    dialect: str, orig: Exception, transient: bool, cause: str
) -> None:
    """Each dialect's codes (SQLSTATE, MySQL error number, SQLite code) pick transient/permanent."""
    exc = DBAPIError.instance("SELECT 1", {"p": "secret-arg"}, orig, type(orig))
    found = classify(exc, dialect)
    assert (found.transient, found.cause) == (transient, cause)
    wrapped = wrap(exc, dialect)
    assert isinstance(wrapped, LeaseError)
    assert wrapped.transient is transient
    expected = "lease_db_unavailable" if transient else f"lease_db_error:{cause}"
    assert wrapped.failure_code == expected and str(wrapped).startswith(expected)
    assert "secret-arg" not in str(wrapped)  # SQL parameters hold task arguments


def test_invalidated_connection_is_transient_whatever_the_code() -> None:
    """SQLAlchemy's own verdict (connection invalidated) makes an unknown error transient."""
    exc = DBAPIError.instance(
        "SELECT 1", {}, RuntimeError("?"), RuntimeError, connection_invalidated=True
    )
    assert classify(exc, "postgresql").transient


def test_wrapped_errors_survive_pickling_and_celery_rebuilding() -> None:
    """Celery's result backend rebuilds an exception from its args: code and cause survive."""
    import pickle

    error = LeaseDatabaseError("postgresql data_too_long: x", False, "data_too_long")
    for copy in (pickle.loads(pickle.dumps(error)), type(error)(*error.args)):
        assert str(copy) == str(error) and copy.failure_code == "lease_db_error:data_too_long"
    refused = LeaseInputError("payload", "too big")
    assert str(type(refused)(*refused.args)) == str(refused)


def test_check_run_id_bounds_the_id_column() -> None:
    """check_run_id accepts 255 characters and refuses 256, empty and non-strings, and text
    no database stores the same way (a NUL, a lone surrogate)."""
    assert check_run_id("k" * 255) == "k" * 255
    for bad in ("k" * 256, "", None, 5, "a\x00b", "a\ud800b"):
        with pytest.raises(LeaseInputError) as refused:
            check_run_id(bad)
        assert refused.value.field == "run_id"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_read_only_session_is_a_transient_claim_error(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """A session that may not write (a standby, or a primary being switched over:
    PostgreSQL 25006, MySQL 1792) fails the claim as transient ``read_only``: the
    delivery is sent again later, never failed for good."""
    url = str(request.getfixturevalue("pg_url" if backend == "postgresql" else "mysql_url"))
    LeaseStore.from_url(url).create_schema()
    engine = create_engine(url)
    statement = (
        "SET SESSION default_transaction_read_only = on"
        if backend == "postgresql"
        else "SET SESSION TRANSACTION READ ONLY"
    )

    @event.listens_for(engine, "connect")
    def read_only(dbapi_connection: Any, _: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(statement)
        cursor.close()
        dbapi_connection.commit()

    store = LeaseStore(engine)
    try:
        with pytest.raises(LeaseDatabaseError) as failed:
            _claim(store, "r1")
        assert failed.value.transient and failed.value.cause == "read_only"
        assert failed.value.failure_code == "lease_db_unavailable"
    finally:
        store.dispose()


def test_permanent_error_from_the_store_names_its_cause(store: LeaseStore) -> None:
    """A missing table is permanent (lease_db_error:missing_table), raised from the driver error."""
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE celery_lease_runs"))
    with pytest.raises(LeaseDatabaseError) as failed:
        _claim(store, "r1")
    assert not failed.value.transient
    assert failed.value.failure_code == "lease_db_error:missing_table"
    assert isinstance(failed.value.__cause__, DBAPIError)


def test_value_too_long_for_its_column_is_permanent(store: LeaseStore) -> None:
    """PostgreSQL's 'value too long' and MySQL's 'Data too long' are permanent data_too_long."""
    if store.db.dialect == "sqlite":
        pytest.skip("SQLite does not enforce VARCHAR lengths")
    claim = _claim(store, "r1")
    with pytest.raises(LeaseDatabaseError) as failed:
        store.fail(
            "r1", "owner:1:x", claim.attempt, error="e", failure_code="c" * 100, retry_in=None
        )  # type: ignore[attr-defined]
    assert (failed.value.transient, failed.value.cause) == (False, "data_too_long")


def test_number_out_of_range_is_permanent(store: LeaseStore) -> None:
    """A BIGINT overflow is the permanent out_of_range on both servers."""
    if store.db.dialect == "sqlite":
        pytest.skip("pysqlite refuses big integers in Python, before SQLite sees them")
    claim = _claim(store, "r1")
    with pytest.raises(LeaseDatabaseError) as failed:
        store.release("r1", "owner:1:x", claim.attempt, available_in=1e17)  # type: ignore[attr-defined]
    assert (failed.value.transient, failed.value.cause) == (False, "out_of_range")


def test_refused_connection_is_transient(db_url: str, tmp_path: Path) -> None:
    """Nothing listening on the port: transient (PostgreSQL, MySQL); a missing SQLite
    directory is permanent (cannot_open)."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        dead = f"sqlite:///{tmp_path / 'missing' / 'leases.sqlite3'}"
        expected = (False, "cannot_open")
    else:
        dead = url.set(host="127.0.0.1", port=1).render_as_string(hide_password=False)
        expected = (True, "connection_refused")
    store = LeaseStore.from_url(dead)
    try:
        with pytest.raises(LeaseDatabaseError) as failed:
            store.get("r1")
    finally:
        store.dispose()
    assert (failed.value.transient, failed.value.cause) == expected


def test_failed_login_is_permanent(db_url: str) -> None:
    """An unknown user is auth_failed, permanent, on both servers."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        pytest.skip("SQLite has no logins")
    store = LeaseStore.from_url(
        url.set(username="no_such_user_cl", password="x").render_as_string(hide_password=False)
    )
    try:
        with pytest.raises(LeaseDatabaseError) as failed:
            store.get("r1")
    finally:
        store.dispose()
    assert (failed.value.transient, failed.value.cause) == (False, "auth_failed")
    assert "x@" not in str(failed.value)


def test_thirty_day_lease_is_refused_before_any_sql(store: LeaseStore) -> None:
    """lease_ms past the 32-bit column (30 days) is a LeaseInputError, not out of range."""
    with pytest.raises(LeaseInputError) as refused:
        _claim(store, "r1", lease_ms=30 * 86_400_000)
    assert refused.value.field == "lease_ms"
    assert store.get("r1") is None


def test_arguments_over_64_kib_are_stored_on_every_dialect(store: LeaseStore) -> None:
    """A 100 KiB message is stored whole (MySQL's BLOB stopped at 64 KiB: 'Data too long')."""
    payload = os.urandom(100 * 1024)
    claim = _claim(store, "r1", payload=payload, payload_content_type="application/x-test")
    assert claim.outcome == "claimed"  # type: ignore[attr-defined]
    row = store.get("r1")
    assert row is not None and row.payload == payload


def test_arguments_over_the_bound_are_refused_before_any_sql(store: LeaseStore) -> None:
    """A message over MAX_PAYLOAD_BYTES is a LeaseInputError naming the payload."""
    with pytest.raises(LeaseInputError, match="payload") as refused:
        _claim(store, "r1", payload=b"x" * (MAX_PAYLOAD_BYTES + 1))
    assert refused.value.failure_code == "lease_input_invalid:payload"
    assert store.get("r1") is None


def test_end_unclaimed_fails_free_runs_and_leaves_live_leases(store: LeaseStore) -> None:
    """end_unclaimed: no row -> a failed row; a live lease elsewhere -> untouched (running);
    an expired lease -> failed with the code; a terminal run keeps its status."""
    end = {
        "task_name": "t",
        "max_attempts": 5,
        "failure_code": "lease_db_unavailable",
        "error": "e",
    }
    assert store.end_unclaimed("new", **end) == "failed"  # type: ignore[arg-type]
    row = store.get("new")
    assert row is not None and (row.status, row.failure_code, row.payload) == (
        "failed",
        "lease_db_unavailable",
        None,
    )
    held = _claim(store, "held", lease_ms=60_000, payload=b"p")
    assert store.end_unclaimed("held", **end) == "running"  # type: ignore[arg-type]
    assert store.get("held").lease_owner == "owner:1:x"  # type: ignore[union-attr]
    store.expire("held")
    assert store.end_unclaimed("held", **end) == "failed"  # type: ignore[arg-type]
    row = store.get("held")
    assert row is not None and row.payload == b"p" and row.finished_at is not None
    done = _claim(store, "done")
    store.complete("done", "owner:1:x", done.attempt)  # type: ignore[attr-defined]
    assert store.end_unclaimed("done", **end) == "succeeded"  # type: ignore[arg-type]
    assert held.outcome == "claimed"  # type: ignore[attr-defined]


def test_config_refuses_a_thirty_day_lease() -> None:
    """lease_seconds of 30 days is ImproperlyConfigured naming the key (it used to overflow)."""
    from celery.exceptions import ImproperlyConfigured

    from celery_lease.config import LeaseConfig

    with pytest.raises(ImproperlyConfigured, match="lease_seconds must be at most"):
        LeaseConfig.from_mapping({"lease_seconds": 30 * 86_400})
    with pytest.raises(ImproperlyConfigured, match="lease_retry_backoff_max"):
        LeaseConfig.from_mapping({"lease_retry_backoff_max": 10 * 86_400})
    with pytest.raises(ImproperlyConfigured, match="lease_max_attempts"):
        LeaseConfig.from_mapping({"lease_max_attempts": 10**9})


def test_operational_error_without_a_known_code_is_transient() -> None:
    """An OperationalError no table knows (a refused connection has no SQLSTATE) is transient."""
    exc = OperationalError("SELECT 1", {}, Exception("boom"))
    assert classify(exc, "postgresql").transient
    assert not classify(DBAPIError("SELECT 1", {}, Exception("x")), "postgresql").transient


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("not a url", "a URL that does not parse"),
        ("nosuchdb://u:pw@h/db", "the 'nosuchdb' database"),
    ],
)
def test_from_url_refuses_a_database_it_does_not_know(url: str, named: str) -> None:
    """A URL that does not parse, or names a database celery-lease has no class for, is a
    permanent LeaseDatabaseError saying so (no generic fallback database), without the
    password."""
    with pytest.raises(LeaseDatabaseError) as info:
        LeaseStore.from_url(url)
    assert not info.value.transient and info.value.cause == "unsupported_database"
    assert f"does not support {named}" in str(info.value) and "pw" not in str(info.value)
