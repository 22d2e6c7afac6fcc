"""SQLite, the embedded default: :class:`SQLite` and its migration lock."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    Connection,
    Engine,
    Table,
    create_engine,
    delete,
    event,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from ..schema import runs
from .bounds import MigrationBounds, WaitBounds
from .database import (
    ClaimPath,
    Classification,
    Database,
    MigrationLock,
    MigrationLockTimeout,
    OnlineDDL,
    PlainDDL,
    UpsertClaim,
    create_schema,
    permanent,
    transient,
    upsert_kept,
    upsert_rate,
    upsert_renew,
    upsert_waiting,
)
from .driver import HOLD_CONNECTION, DriverStatement

if TYPE_CHECKING:
    from alembic.operations import Operations

#: Execution option for single statements on SQLite: no ``BEGIN``, and no
#: isolation-level switch (SQLAlchemy's costs a PRAGMA at check-out and check-in).
SQLITE_AUTOCOMMIT = "celery_lease_autocommit"


class SQLite(Database):
    """SQLite: one writer at a time (``BEGIN IMMEDIATE``), so no row locks to take or skip.

    Upserts with ``ON CONFLICT``; the store's connections have pysqlite's own
    transaction handling off, so single statements share the one pool and each
    commits by itself outside ``BEGIN``. The busy timeout bounds every wait.
    """

    extended: ClassVar[dict[int, Classification]] = {
        1555: permanent("duplicate_key"),  # SQLITE_CONSTRAINT_PRIMARYKEY
        2067: permanent("duplicate_key"),  # SQLITE_CONSTRAINT_UNIQUE
    }
    codes: ClassVar[dict[int, Classification]] = {
        5: transient("database_locked"),  # SQLITE_BUSY
        6: transient("database_locked"),  # SQLITE_LOCKED
        10: transient("io_error"),  # SQLITE_IOERR
        13: transient("insufficient_resources"),  # SQLITE_FULL
        15: transient("database_locked"),  # SQLITE_PROTOCOL
        3: permanent("permission_denied"),  # SQLITE_PERM
        8: permanent("read_only"),  # SQLITE_READONLY
        11: permanent("corrupt"),  # SQLITE_CORRUPT
        14: permanent("cannot_open"),  # SQLITE_CANTOPEN: a missing directory, a bad path
        18: permanent("data_too_long"),  # SQLITE_TOOBIG
        19: permanent("integrity"),  # SQLITE_CONSTRAINT
        20: permanent("bad_data"),  # SQLITE_MISMATCH
        23: permanent("permission_denied"),  # SQLITE_AUTH
        26: permanent("corrupt"),  # SQLITE_NOTADB
    }
    #: SQLite gives nothing finer than ``SQLITE_ERROR`` for these: the message decides.
    messages: ClassVar[tuple[tuple[str, Classification], ...]] = (
        ("database is locked", transient("database_locked")),
        ("no such table", permanent("missing_table")),
        ("no such column", permanent("missing_column")),
        ("has no column named", permanent("missing_column")),
        ("syntax error", permanent("bad_sql")),
        ("unable to open database", permanent("cannot_open")),
        ("readonly database", permanent("read_only")),
    )

    def __init__(self) -> None:
        super().__init__(
            names=("sqlite",),
            driver_extra="sqlite",
            # julianday('now') carries milliseconds and is fixed for one statement.
            clock_sql="CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
        )

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """A plain engine; :meth:`single_statements` sets the busy timeout and WAL on it."""
        connect_args = dict(kwargs.pop("connect_args", {}))
        return create_engine(
            make_url(url), connect_args=connect_args, hide_parameters=True, **kwargs
        )

    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """One engine: single statements share its pool (see :meth:`single_statements`)."""
        return self.create_engine(url, bounds, **kwargs), None

    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """WAL and the busy timeout on ``engine``; single statements commit outside ``BEGIN``."""
        self._configure(engine, bounds)
        if given is not None:
            return given, True
        return engine.execution_options(**{SQLITE_AUTOCOMMIT: True, HOLD_CONNECTION: True}), True

    def prepare(self, engine: Engine) -> None:
        """The embedded default needs no migrate step: create the table and its indexes,
        and build again, partial, an index a file made before 0013 holds whole."""
        create_schema(engine)
        _partial_indexes(engine)

    def unreachable(self, url: URL) -> str | None:
        """A file whose directory does not exist (SQLite would not create the directory)."""
        path = _file_of(url)
        if path is None:
            return None
        folder = os.path.dirname(os.path.abspath(path))
        return None if os.path.isdir(folder) else f"directory {folder} does not exist"

    def missing(self, url: URL) -> str | None:
        """A file that does not exist: connecting would silently create an empty one."""
        path = _file_of(url)
        if path is None or os.path.exists(path):
            return None
        return "SQLite file does not exist (check lease_database_url and the working directory)"

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The primary result code (``sqlite_errorcode & 0xFF``) and, for the catch-all
        ``SQLITE_ERROR``, the message."""
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int) and code in self.extended:
            return self.extended[code]
        if isinstance(code, int) and (code & 0xFF) in self.codes:
            return self.codes[code & 0xFF]
        text = str(orig).lower()
        for fragment, classification in self.messages:
            if fragment in text:
                return classification
        return None

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """Never: no row locks here; a busy database ends in ``database is locked``."""
        return False

    def begin_live(self, engine: Engine) -> AbstractContextManager[Connection]:
        """``engine.begin()``: a file's connection does not die under the caller."""
        return engine.begin()

    def insert(self, table: Table) -> Any:
        """SQLite's ``INSERT``, with ``ON CONFLICT``."""
        return sqlite.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> ClaimPath:
        """One upsert."""
        return UpsertClaim(self, auto, raw=raw)

    def driver_statement(
        self, auto: Engine, statement: Any, *, returns_row: bool
    ) -> DriverStatement:
        """The driver's cursor (:class:`~celery_lease.store.driver.DriverStatement`)."""
        return DriverStatement(auto, statement, returns_row=returns_row)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """Nothing to take: ``BEGIN IMMEDIATE``'s write lock already serializes the claim."""
        return True

    def count_live(self, query: Any) -> Any:
        """The plain count: the transaction is the only writer."""
        return query

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """One upsert that bumps only a row still ``queued``."""
        upsert_waiting(self.insert, conn, waiting, bump)

    def reserve_rate(self, engine: Engine, auto: Engine, params: dict[str, Any]) -> tuple[int, int]:
        """One upsert (see :func:`~celery_lease.store.database.upsert_rate`)."""
        return upsert_rate(self.insert, auto, params)

    def renew(
        self,
        engine: Engine,
        auto: Engine,
        renew: Any,
        guard: Any,
        columns: Sequence[Any],
        params: dict[str, Any] | None = None,
    ) -> Sequence[Any]:
        """One ``UPDATE .. RETURNING``."""
        return upsert_renew(auto, renew, columns, params)

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """One conditional upsert (see :func:`~celery_lease.store.database.upsert_kept`)."""
        return upsert_kept(self.insert, auto, waiting, adopt, keeps)

    def lock_expired(self, query: Any) -> Any:
        """No row locks: the sweep's transaction is the only writer."""
        return query

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """One statement, ``id IN (..)``: the writer is alone and the rows were picked by the
        guard, so no second filter."""
        with auto.connect() as conn:
            return int(conn.execute(delete(runs).where(runs.c.id.in_(oldest))).rowcount)

    def migration_lock(self) -> MigrationLock:
        """The file's write lock (:class:`SQLiteMigrationLock`)."""
        return SQLiteMigrationLock()

    def online_ddl(self, operations: Operations, bounds: MigrationBounds) -> OnlineDDL:
        """Plain DDL: the migration already holds the file's write lock throughout."""
        return PlainDDL(operations, bounds)

    def _configure(self, engine: Engine, bounds: WaitBounds) -> None:
        """WAL, a busy timeout (``bounds.statement``, at least 1 s), and ``BEGIN IMMEDIATE``."""
        busy_ms = max(1000, round(bounds.statement * 1000))

        def on_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
            # Take transaction control from pysqlite so that `begin` below decides.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.close()

        def on_begin(conn: Connection) -> None:
            options = conn.get_execution_options()
            if options.get(SQLITE_AUTOCOMMIT) or options.get("isolation_level") == "AUTOCOMMIT":
                return  # no BEGIN: each statement commits by itself
            # IMMEDIATE takes the write lock up front, so a read-then-write
            # transaction can never fail to upgrade its lock half way through.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        def on_checkout(dbapi_connection: Any, record: ConnectionPoolEntry, proxy: Any) -> None:
            # SQLAlchemy's reset after an AUTOCOMMIT check-out (by any user of this
            # engine) turns pysqlite's implicit transactions back on; a statement
            # run on the raw cursor would then be rolled back at check-in.
            if dbapi_connection.isolation_level is not None:
                dbapi_connection.isolation_level = None

        if not event.contains(engine, "connect", on_connect):
            event.listen(engine, "connect", on_connect)
            event.listen(engine, "begin", on_begin)
            event.listen(engine.pool, "checkout", on_checkout)
            engine.dispose()  # connections made before the listeners would lack the settings


def _partial_indexes(engine: Engine) -> None:
    """Rebuild each runs index the schema has partial (``sqlite_where``) that the file holds
    whole: what migration 0013 does, in one ``BEGIN IMMEDIATE`` transaction (a worker
    starting beside this one waits, then finds the indexes partial)."""
    partial = [
        index for index in runs.indexes if index.dialect_options["sqlite"]["where"] is not None
    ]
    with engine.begin() as conn:
        for index in partial:
            sql = conn.execute(
                text("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :name"),
                {"name": index.name},
            ).scalar()
            if sql is not None and " WHERE " not in str(sql).upper():
                index.drop(conn)
                index.create(conn)


def _file_of(url: URL) -> str | None:
    """The file a SQLite URL names (None in memory, or for a ``file:`` URI)."""
    path = url.database
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return str(path)


class SQLiteMigrationLock(MigrationLock):
    """``BEGIN IMMEDIATE``: the file's write lock, held by the one transaction the whole
    migration runs in, waiting at most ``timeout`` for it (``busy_timeout``)."""

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
        except sa_exc.OperationalError as exc:
            if "locked" in str(exc.orig):
                raise MigrationLockTimeout(timeout) from exc
            raise

    def release(self, connection: Connection) -> None:
        """Hand the connection back to the sqlite3 module's transaction handling."""
        driver: Any = connection.connection.driver_connection
        if self._busy_timeout is not None:
            connection.exec_driver_sql(f"PRAGMA busy_timeout = {int(self._busy_timeout)}")
        driver.isolation_level = self._isolation_level

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the write lock and migrate inside it, on the same connection."""
        try:
            with connection.begin():
                self.acquire(connection, timeout)
                yield connection
        finally:
            self.release(connection)
