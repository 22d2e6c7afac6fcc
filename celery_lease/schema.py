"""Table definition and the database clock.

Times are stored as **epoch milliseconds** (``BIGINT``), computed by the
database server inside each statement with :class:`db_now_ms`. Integers compare
the same way on every dialect and keep millisecond resolution on SQLite, whose
``CURRENT_TIMESTAMP`` has only one-second resolution.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

QUEUED = "queued"
RUNNING = "running"
RETRYING = "retrying"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

STATUSES = (QUEUED, RUNNING, RETRYING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL_STATUSES = frozenset({SUCCEEDED, FAILED, CANCELLED})

TABLE_NAME = "celery_lease_runs"

metadata = MetaData()

runs = Table(
    TABLE_NAME,
    metadata,
    Column("id", String(255), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("status", String(16), nullable=False),
    Column("lease_owner", String(255), nullable=True),
    Column("lease_expires_at", BigInteger, nullable=True),
    Column("lease_ms", Integer, nullable=False),
    Column("heartbeat_at", BigInteger, nullable=True),
    Column("attempt", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("available_at", BigInteger, nullable=False),
    Column("cancel_requested_at", BigInteger, nullable=True),
    Column("started_at", BigInteger, nullable=True),
    Column("finished_at", BigInteger, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("failure_code", String(64), nullable=True),
    Column("concurrency_key", String(255), nullable=True),
    # The Celery task id of the delivery that claimed the run last: the id whose
    # result the run's body records. Deliveries under other ids are duplicates.
    Column("task_id", String(255), nullable=True),
    Column("payload", LargeBinary, nullable=True),
    Column("payload_content_type", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Index("ix_celery_lease_runs_status_expires", "status", "lease_expires_at"),
    Index("ix_celery_lease_runs_concurrency", "concurrency_key", "status"),
)


class db_now_ms(FunctionElement[int]):
    """The database server's clock in epoch milliseconds, as a SQL expression.

    Compiled per dialect (sqlite, postgresql, mysql). There is deliberately no
    default compilation, so an unsupported database fails loudly at compile time.
    """

    type = BigInteger()
    inherit_cache = True


@compiles(db_now_ms, "sqlite")
def _sqlite_now(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    # julianday('now') carries milliseconds and is fixed for one statement.
    return "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


@compiles(db_now_ms, "postgresql")
def _postgresql_now(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at transaction start, which
    # would make a fence inside a long user transaction read a stale clock.
    return "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"


@compiles(db_now_ms, "mysql")
@compiles(db_now_ms, "mariadb")
def _mysql_now(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)"
