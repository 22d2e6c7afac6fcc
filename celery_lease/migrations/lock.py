"""The lock that serializes ``celery lease migrate`` runs on one database.

A rolling deploy may start several ``migrate`` runs at once. Each takes this
lock before it reads the schema's revision, so the first one migrates and the
others wait, then find the schema at head and change nothing. Every wait is
bounded: past ``timeout`` seconds :class:`MigrationLockTimeout` is raised.

One class per database, each using that database's own primitive.
:meth:`MigrationLock.held` also decides where the migration runs: on
PostgreSQL and MySQL a second connection, so the migration can commit step by
step (and build indexes outside any transaction) while the lock stays held;
on SQLite the lock's own transaction.

- PostgreSQL: ``pg_try_advisory_xact_lock``, transaction-scoped, so it is
  released when the lock's transaction ends and works behind PgBouncer in
  transaction mode (a session lock would not). It is tried every 0.1 s until
  ``timeout``.
- MySQL/MariaDB: ``GET_LOCK(name, timeout)``, named after the database and
  released with ``RELEASE_LOCK`` after the migration commits (DDL commits
  implicitly there, so a transaction cannot hold it).
- SQLite: ``BEGIN IMMEDIATE``, the database file's own write lock, held by the
  one transaction the whole migration runs in, waiting at most ``busy_timeout``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError

from ..errors import LeaseError

#: Seconds a ``migrate`` run waits for another one to finish before giving up.
DEFAULT_LOCK_TIMEOUT = 300.0

#: PostgreSQL advisory lock key: a fixed 64-bit number ("celery_lease migrate").
PG_LOCK_KEY = 0x63656C6C6D696772


class MigrationLockTimeout(LeaseError):
    """Another migration held the lock longer than the allowed wait."""

    code = "migration_lock_timeout"

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"another `celery lease migrate` held the migration lock for more than "
            f"{timeout:g} s; try again when it has finished (or raise --lock-timeout)"
        )
        self.timeout = timeout


class MigrationLock:
    """Serializes migrations on one database; :meth:`acquire` first, :meth:`release` last."""

    def acquire(self, connection: Connection, timeout: float) -> None:
        """Wait at most ``timeout`` s for the lock, as the first statement of the migration."""
        raise NotImplementedError

    def release(self, connection: Connection) -> None:
        """Give the lock up after the migration's transaction ended (default: it ended with it)."""

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the lock on ``connection``; yield a second connection to migrate on."""
        try:
            with connection.begin():
                self.acquire(connection, timeout)
                with connection.engine.connect() as migrating:
                    yield migrating
        finally:
            self.release(connection)


class PostgresMigrationLock(MigrationLock):
    """``pg_try_advisory_xact_lock``, tried in short transactions until ``timeout``."""

    #: Seconds between two tries.
    POLL = 0.1

    def acquire(self, connection: Connection, timeout: float) -> None:
        """Take the advisory lock; the transaction it is taken in ends it (commit or rollback).

        Each losing try is its own short transaction, rolled back at once: a
        waiter blocked inside ``pg_advisory_xact_lock`` would hold a snapshot,
        and the holder's ``CREATE INDEX CONCURRENTLY`` waits for every older
        snapshot to end, so holder and waiter would wait for each other.
        """
        deadline = time.monotonic() + timeout
        try_lock = text("SELECT pg_try_advisory_xact_lock(:key)")
        while not connection.execute(try_lock, {"key": PG_LOCK_KEY}).scalar():
            connection.rollback()
            if time.monotonic() >= deadline:
                raise MigrationLockTimeout(timeout)
            time.sleep(min(self.POLL, max(0.0, deadline - time.monotonic())))
        # End on a statement that takes no snapshot: the last SELECT's portal
        # would keep its snapshot for as long as this transaction stays open.
        connection.exec_driver_sql("SHOW lock_timeout")

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the lock in ``connection``'s transaction; migrate on a second connection."""
        self.acquire(connection, timeout)
        try:
            with connection.engine.connect() as migrating:
                yield migrating
        finally:
            connection.rollback()


class MySQLMigrationLock(MigrationLock):
    """``GET_LOCK`` named after the current database, released after the commit."""

    NAME = "CONCAT('celery_lease.migrate.', MD5(DATABASE()))"

    def acquire(self, connection: Connection, timeout: float) -> None:
        """Take the named lock (held by this connection's session)."""
        got = connection.execute(
            text(f"SELECT GET_LOCK({self.NAME}, :timeout)"),
            {"timeout": max(1, math.ceil(timeout))},
        ).scalar()
        if got != 1:
            raise MigrationLockTimeout(timeout)

    def release(self, connection: Connection) -> None:
        """Release the named lock on the same session."""
        connection.execute(text(f"SELECT RELEASE_LOCK({self.NAME})"))
        connection.commit()


class SQLiteMigrationLock(MigrationLock):
    """``BEGIN IMMEDIATE``: the file's write lock, for the migration's whole transaction."""

    def __init__(self) -> None:
        self._isolation_level: Any = None
        self._busy_timeout: Any = None

    def acquire(self, connection: Connection, timeout: float) -> None:
        """Open the transaction with the write lock, waiting at most ``timeout`` s."""
        driver: Any = connection.connection.driver_connection
        # The sqlite3 module would open its own deferred transaction, and only
        # before DML: take manual control so BEGIN IMMEDIATE comes first.
        self._isolation_level = driver.isolation_level
        driver.isolation_level = None
        self._busy_timeout = connection.exec_driver_sql("PRAGMA busy_timeout").scalar()
        connection.exec_driver_sql(f"PRAGMA busy_timeout = {max(1, math.ceil(timeout * 1000))}")
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        except OperationalError as exc:
            if "locked" in str(exc.orig):
                raise MigrationLockTimeout(timeout) from exc
            raise

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the write lock and migrate inside it, on the same connection."""
        try:
            with connection.begin():
                self.acquire(connection, timeout)
                yield connection
        finally:
            self.release(connection)

    def release(self, connection: Connection) -> None:
        """Hand the connection back to the sqlite3 module's transaction handling."""
        driver: Any = connection.connection.driver_connection
        if self._busy_timeout is not None:
            connection.exec_driver_sql(f"PRAGMA busy_timeout = {int(self._busy_timeout)}")
        driver.isolation_level = self._isolation_level


_LOCKS: dict[str, type[MigrationLock]] = {
    "postgresql": PostgresMigrationLock,
    "mysql": MySQLMigrationLock,
    "mariadb": MySQLMigrationLock,
    "sqlite": SQLiteMigrationLock,
}


def migration_lock(connection: Connection) -> MigrationLock:
    """The migration lock for ``connection``'s database."""
    try:
        return _LOCKS[connection.dialect.name]()
    except KeyError:
        raise LeaseError(f"no migration lock for the {connection.dialect.name} dialect") from None
