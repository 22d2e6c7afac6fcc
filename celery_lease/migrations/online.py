"""Schema changes that never queue lease writes for long behind them.

A DDL statement that waits for a table lock makes every later statement on that
table wait behind it. While a worker's fenced transaction is open, that is
every heartbeat, claim and completion: leases expire and runs are lost. So each
change the migrations make to ``celery_lease_runs`` goes through :func:`ddl`,
one class per database:

- PostgreSQL: indexes are built ``CONCURRENTLY`` outside any transaction (they
  take no lock that conflicts with writes); other changes run under a
  transaction-local ``lock_timeout``. A lock wait past :data:`LOCK_TIMEOUT` is
  given up and retried, at most :data:`ATTEMPTS` times. A concurrent build that
  failed leaves an ``INVALID`` index: it is dropped and built again, by this
  run or by the next ``migrate``.
- MySQL/MariaDB: InnoDB online DDL (``ALGORITHM=INPLACE, LOCK=NONE``) under a
  short ``lock_wait_timeout``: the metadata lock it needs at its start and end
  is waited for at most :data:`MYSQL_LOCK_WAIT` seconds per try, then retried.
- SQLite: plain DDL; the migration holds the file's write lock throughout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.schema import CreateColumn

#: Seconds one PostgreSQL DDL statement may wait for a lock before it is retried.
LOCK_TIMEOUT = 2.0

#: Seconds (whole) one MySQL/MariaDB DDL statement may wait for the metadata lock.
MYSQL_LOCK_WAIT = 1

#: Tries per statement before the migration fails (it can be run again).
ATTEMPTS = 15

#: Pause between tries, so the lock holder can finish.
RETRY_PAUSE = 0.5


class OnlineDDL:
    """Plain DDL: what SQLite runs, and what offline (``--sql``) scripts print."""

    def add_column(self, table: str, column: sa.Column[object]) -> None:
        """Add a nullable column."""
        op.add_column(table, column)

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """Create an index (subclasses: without holding up lease writes)."""
        op.create_index(name, table, list(columns))

    def drop_index(self, name: str, table: str) -> None:
        """Drop an index (subclasses: without holding up lease writes)."""
        op.drop_index(name, table_name=table)

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` (one DDL statement) with a bounded lock wait."""
        change()


def _retry(attempt: Callable[[], None], timed_out: Callable[[OperationalError], bool]) -> None:
    for tries_left in range(ATTEMPTS - 1, -1, -1):
        try:
            attempt()
            return
        except OperationalError as exc:
            if not tries_left or not timed_out(exc):
                raise
        time.sleep(RETRY_PAUSE)


class PostgresDDL(OnlineDDL):
    """``CREATE INDEX CONCURRENTLY`` outside the transaction; ``lock_timeout`` on the rest."""

    @staticmethod
    def _timed_out(exc: OperationalError) -> bool:
        return getattr(exc.orig, "sqlstate", None) == "55P03"  # lock_not_available

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` in a savepoint under ``SET LOCAL lock_timeout``, retrying a timeout."""
        connection = op.get_bind()

        def attempt() -> None:
            with connection.begin_nested():
                connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{_ms(LOCK_TIMEOUT)}ms'")
                change()

        _retry(attempt, self._timed_out)

    def add_column(self, table: str, column: sa.Column[object]) -> None:
        """``ADD COLUMN`` (catalog only) under a bounded wait for its brief exclusive lock."""
        self.bounded(lambda: op.add_column(table, column))

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """Build the index concurrently; drop an ``INVALID`` leftover first.

        Inside a caller's own transaction (``alembic_config(connection)`` used
        by hand) nothing can run outside it: a plain build, under a bounded wait.
        """
        if not _own_transactions():
            self.bounded(lambda: op.create_index(name, table, list(columns)))
            return
        self._concurrently(lambda: self._build(op.get_bind(), name, table, columns))

    def drop_index(self, name: str, table: str) -> None:
        """``DROP INDEX CONCURRENTLY`` outside the transaction (plain inside a caller's)."""
        if not _own_transactions():
            self.bounded(lambda: op.drop_index(name, table_name=table))
            return
        self._concurrently(
            lambda: op.drop_index(
                name, table_name=table, postgresql_concurrently=True, if_exists=True
            )
        )

    def _concurrently(self, change: Callable[[], None]) -> None:
        """Run ``change`` outside any transaction under a session ``lock_timeout``, retrying."""
        with op.get_context().autocommit_block():
            connection = op.get_bind()
            connection.exec_driver_sql(f"SET lock_timeout = '{_ms(LOCK_TIMEOUT)}ms'")
            try:
                _retry(change, self._timed_out)
            finally:
                connection.exec_driver_sql("RESET lock_timeout")

    @staticmethod
    def _build(connection: Connection, name: str, table: str, columns: Sequence[str]) -> None:
        valid = connection.execute(
            sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
            {"name": name},
        ).scalar()
        if valid:
            return
        if valid is not None:  # a failed or interrupted concurrent build
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
        op.create_index(name, table, list(columns), postgresql_concurrently=True)


class MySQLDDL(OnlineDDL):
    """InnoDB online DDL under a short ``lock_wait_timeout``."""

    @staticmethod
    def _timed_out(exc: OperationalError) -> bool:
        return getattr(exc.orig, "args", (None,))[0] == 1205  # ER_LOCK_WAIT_TIMEOUT

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` with the metadata-lock wait capped, retrying a timeout."""
        connection = op.get_bind()
        previous = connection.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
        connection.exec_driver_sql(f"SET SESSION lock_wait_timeout = {MYSQL_LOCK_WAIT}")
        try:
            _retry(change, self._timed_out)
        finally:
            connection.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(previous)}")

    def add_column(self, table: str, column: sa.Column[object]) -> None:
        """``ADD COLUMN, ALGORITHM=INPLACE, LOCK=NONE``: writes go on while it runs."""
        spec = CreateColumn(column).compile(dialect=op.get_bind().dialect)
        self.bounded(
            lambda: op.execute(
                f"ALTER TABLE {table} ADD COLUMN {spec}, ALGORITHM=INPLACE, LOCK=NONE"
            )
        )

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """``CREATE INDEX ... ALGORITHM=INPLACE LOCK=NONE``: writes go on while it builds."""
        listed = ", ".join(columns)
        self.bounded(
            lambda: op.execute(
                f"CREATE INDEX {name} ON {table} ({listed}) ALGORITHM=INPLACE LOCK=NONE"
            )
        )

    def drop_index(self, name: str, table: str) -> None:
        """``DROP INDEX, ALGORITHM=INPLACE, LOCK=NONE``."""
        statement = f"ALTER TABLE {table} DROP INDEX {name}, ALGORITHM=INPLACE, LOCK=NONE"
        self.bounded(lambda: op.execute(statement))


def _own_transactions() -> bool:
    """Whether this run may commit and step outside a transaction (set by ``env.py``)."""
    return bool(op.get_context().opts.get("celery_lease_own_transactions"))


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


_DDL: dict[str, type[OnlineDDL]] = {
    "postgresql": PostgresDDL,
    "mysql": MySQLDDL,
    "mariadb": MySQLDDL,
}


def ddl() -> OnlineDDL:
    """The lease-safe DDL for the database the running migration targets."""
    context = op.get_context()
    if context.as_sql:  # a printed script: plain DDL, the operator runs it
        return OnlineDDL()
    return _DDL.get(context.dialect.name, OnlineDDL)()
