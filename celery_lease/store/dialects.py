"""What differs between the SQL dialects the store speaks: one object per dialect.

A :class:`Dialect` owns the statements and strategies that are not the same
everywhere: the ``INSERT`` construct (with ``ON CONFLICT`` where the dialect
has it), whether the claim is one upsert or a locked read-then-write, how the
claims of one concurrency key are serialized and counted, whether reads may
``SKIP LOCKED``, and how retention picks the rows it deletes. The clock
expression is :func:`celery_lease.schema.db_now_ms`, compiled per dialect. To add
a dialect: subclass :class:`Dialect`, register it in :data:`DIALECTS`, and give
:mod:`celery_lease.dberrors` a classifier for its driver's errors.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy
from sqlalchemy import Connection, Engine, Table, func, select
from sqlalchemy.dialects import postgresql, sqlite

from ..schema import runs
from .engine import SQLITE_AUTOCOMMIT, WaitBounds, _configure_sqlite


class _KeyLock:
    """How a dialect serializes the claims sharing one concurrency key, inside the
    claim's transaction. SQLite: ``BEGIN IMMEDIATE`` already holds the write lock."""

    def acquire(self, conn: Connection, key: str) -> bool:
        """Take the key's lock; False means another claimer holds it (report busy)."""
        return True

    def count_live(self, query: Any) -> Any:
        """The statement counting the key's live leases (as a locking read where needed)."""
        return query


class _PostgresKeyLock(_KeyLock):
    """A transaction-scoped advisory try-lock on the key's hash."""

    def acquire(self, conn: Connection, key: str) -> bool:
        """Try-lock: a holder frozen inside this short transaction must not stall
        every other claim on the key; they report busy instead."""
        return bool(
            conn.execute(
                select(func.pg_try_advisory_xact_lock(func.hashtextextended(key, 0)))
            ).scalar()
        )


class _MySQLKeyLock(_KeyLock):
    """The count itself is a locking read (``FOR UPDATE``): InnoDB's next-key locks on
    the key's ``running`` index range block any other claim from adding a live
    lease to it until this transaction ends. Two claimers that both found the range
    empty deadlock on their inserts; the loser is retried by the claim."""

    def count_live(self, query: Any) -> Any:
        """The count as ``SELECT .. FOR UPDATE``."""
        return query.with_for_update()


class Dialect:
    """A server dialect without ``ON CONFLICT``: the base for MySQL/MariaDB and unknown ones."""

    #: ``INSERT .. ON CONFLICT DO UPDATE`` and ``UPDATE .. RETURNING``: the claim is
    #: one upsert statement, the heartbeat one statement that returns what it renewed.
    upsert = False
    #: Reads that pick rows to change may ``FOR UPDATE SKIP LOCKED``.
    skip_locked = True
    #: Retention may delete by ``id IN (SELECT .. LIMIT ..)`` in one statement.
    delete_by_subquery = True
    #: How the claims sharing one concurrency key are serialized and counted.
    key_lock: _KeyLock = _KeyLock()
    #: The engine's own connections commit each statement outside ``BEGIN``: single
    #: statements (and the hot path, at the driver level) share its pool.
    raw_autocommit = False

    def insert(self, table: Table) -> Any:
        """The ``INSERT`` construct (the dialect's own where it has ``ON CONFLICT``)."""
        return sqlalchemy.insert(table)

    def autocommit(self, engine: Engine, bounds: WaitBounds) -> Engine:
        """``engine`` set up for this store, as the engine single statements borrow."""
        return engine.execution_options(isolation_level="AUTOCOMMIT")

    def picked(self, oldest: Any) -> Any:
        """The condition naming the rows ``oldest`` (a ``SELECT id``) picked for deletion."""
        return runs.c.id.in_(oldest)


class SQLiteDialect(Dialect):
    """SQLite: one writer at a time (``BEGIN IMMEDIATE``), so no row locks to skip."""

    upsert = True
    skip_locked = False
    raw_autocommit = True

    def insert(self, table: Table) -> Any:
        """SQLite's ``INSERT``, with ``ON CONFLICT``."""
        return sqlite.insert(table)

    def autocommit(self, engine: Engine, bounds: WaitBounds) -> Engine:
        """WAL and the busy timeout on ``engine``; single statements commit outside ``BEGIN``."""
        _configure_sqlite(engine, bounds)
        return engine.execution_options(**{SQLITE_AUTOCOMMIT: True})


class PostgresDialect(Dialect):
    """PostgreSQL: upserts, advisory key locks, ``SKIP LOCKED``."""

    upsert = True
    key_lock = _PostgresKeyLock()

    def insert(self, table: Table) -> Any:
        """PostgreSQL's ``INSERT``, with ``ON CONFLICT``."""
        return postgresql.insert(table)

    def picked(self, oldest: Any) -> Any:
        """``id = ANY(ARRAY(...))``: an index condition on the primary key; with
        ``IN (...)`` the planner may hash-join against a scan of the table."""
        return runs.c.id == func.any(func.array(oldest.scalar_subquery()))


class MySQLDialect(Dialect):
    """MySQL/MariaDB: a locked read-then-write claim; the key's count is a locking read."""

    #: MySQL refuses ``LIMIT`` in an ``IN`` subquery: pick, then delete.
    delete_by_subquery = False
    key_lock = _MySQLKeyLock()


#: The dialect objects, by SQLAlchemy dialect name.
DIALECTS: dict[str, Dialect] = {
    "sqlite": SQLiteDialect(),
    "postgresql": PostgresDialect(),
    "mysql": MySQLDialect(),
    "mariadb": MySQLDialect(),
}


def dialect_for(name: str) -> Dialect:
    """The dialect object for the SQLAlchemy dialect ``name`` (the base for unknown ones)."""
    return DIALECTS.get(name) or Dialect()
