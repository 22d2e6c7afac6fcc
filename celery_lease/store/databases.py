"""Everything that differs between the databases the store speaks: one class per database.

A database object owns, for its database: its SQLAlchemy dialect names and the
driver extra to install; the engine options that bound every wait
(:class:`~celery_lease.store.bounds.WaitBounds`); how its driver's errors are
classified (transient or permanent, and the cause); the SQL of the database
clock (:class:`~celery_lease.schema.db_now_ms` compiles through it); and the
statements that are not the same everywhere: the ``INSERT`` construct, the
claim (one upsert, or a locked read-then-write), the heartbeat's renewal, a
kept delivery, the key lock of a concurrency-limited claim, the sweep's row
locks and retention's pick. The store asks the object to do the work; it never
branches on what the database is.

To add a database: a subclass of :class:`Database` registered in
:data:`DATABASES` (its names, extra, clock, error codes, and the overrides its
SQL needs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import sqlalchemy
from sqlalchemy import (
    Connection,
    Engine,
    Table,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.sql.compiler import SQLCompiler

from ..errors import LeaseDatabaseError
from ..schema import QUEUED, db_now_ms, metadata, runs
from .bounds import DEFAULT_BOUNDS, WaitBounds
from .driver import DriverStatement, _ClientWatchdog
from .sql import claim_params, claim_upsert, claimable, insert_values, takeover_values

#: Execution option for single statements on SQLite: no ``BEGIN``, and no
#: isolation-level switch (SQLAlchemy's costs a PRAGMA at check-out and check-in).
SQLITE_AUTOCOMMIT = "celery_lease_autocommit"

#: psycopg's own default: a statement is prepared on its sixth run.
PSYCOPG_PREPARE_THRESHOLD = 5

ClaimRow = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Classification:
    """``transient`` or not, and a short stable ``cause`` such as ``deadlock``."""

    transient: bool
    cause: str


def _t(cause: str) -> Classification:
    return Classification(True, cause)


def _p(cause: str) -> Classification:
    return Classification(False, cause)


#: Causes the store treats as contention between concurrent claims of one run
#: or one concurrency key (two first claims inserting the same id; InnoDB's
#: gap-lock deadlock): the claim is retried inside the store and, if it keeps
#: losing, reported busy (reason ``race``), never as an unreachable database.
CLAIM_CONTENTION = frozenset({"deadlock", "serialization_failure", "duplicate_key"})


class UpsertClaim:
    """The claim as one ``INSERT .. ON CONFLICT`` statement, compiled once per store.

    On an engine in autocommit mode it runs at the driver level
    (:class:`DriverStatement`); otherwise through SQLAlchemy.
    """

    def __init__(self, insert: Any, auto: Engine, *, raw: bool) -> None:
        self.statement = claim_upsert(insert)
        self._auto = auto
        self._driver = DriverStatement(auto, self.statement, returns_row=True) if raw else None

    def claim(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> ClaimRow | None:
        """Insert or take over the run (in ``conn``'s transaction if given); the new
        attempt, expiry and attempt ceiling, or None when it was not claimable."""
        params = claim_params(values, lease_ms, max_attempts)
        if conn is not None:
            row = conn.execute(self.statement, params).first()
        elif self._driver is not None:
            row = self._driver.execute(params)[1]
        else:
            with self._auto.connect() as auto:
                row = auto.execute(self.statement, params).first()
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


class LockedClaim:
    """The claim as a locked read-then-write in one transaction (no ``ON CONFLICT``)."""

    def __init__(self, insert: Any, engine: Engine) -> None:
        self._insert = insert
        self._engine = engine

    def claim(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> ClaimRow | None:
        """Insert or take over the run (in ``conn``'s transaction if given, else a new one).

        Concurrent first claims of one id can deadlock (both hold the gap lock
        of the missing row) or collide on the insert; both errors propagate to
        the store's claim, which retries them as contention.
        """
        if conn is None:
            with self._engine.begin() as own:
                return self.claim(values, lease_ms, max_attempts, own)
        current = conn.execute(
            select(runs.c.attempt).where(runs.c.id == values["id"]).with_for_update()
        ).first()
        if current is None:
            conn.execute(self._insert(runs).values(insert_values(values, lease_ms)))
            attempt = 1
        else:
            changed = conn.execute(
                update(runs)
                .where(runs.c.id == values["id"], claimable(max_attempts))
                .values(takeover_values(values["lease_owner"], lease_ms, max_attempts, values))
            ).rowcount
            if changed != 1:
                return None
            attempt = int(current[0]) + 1
        expires, ceiling = conn.execute(
            select(runs.c.lease_expires_at, runs.c.max_attempts).where(runs.c.id == values["id"])
        ).one()
        return attempt, int(expires), int(ceiling)


class Database:
    """A server database without ``ON CONFLICT``: the base of the three, and what a
    database SQLAlchemy speaks but celery-lease does not know gets.

    Its statements are the portable ones: the claim and a kept delivery are
    locked read-then-write transactions, the heartbeat an ``UPDATE`` then a
    ``SELECT`` in one transaction, and rows are picked ``FOR UPDATE SKIP LOCKED``.
    """

    #: The SQLAlchemy dialect names this class serves.
    names: ClassVar[tuple[str, ...]] = ()
    #: The package extra that installs its driver (``pip install 'celery-lease[x]'``).
    driver_extra: ClassVar[str] = ""
    #: The database clock in epoch milliseconds, as SQL ("" for none: compiling fails).
    clock_sql: ClassVar[str] = ""

    # -- engines ---------------------------------------------------------------

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """An engine for lease traffic on ``url``, every wait bounded by ``bounds``.

        No ``pool_pre_ping``: it would add a round trip to every statement. A
        connection found dead fails that one statement, SQLAlchemy then discards
        the pool, and each caller already retries.
        """
        connect_args = dict(kwargs.pop("connect_args", {}))
        return create_engine(
            make_url(url), connect_args=connect_args, hide_parameters=True, **kwargs
        )

    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """The store's engines for ``url``: one for transactions, and one of its own for
        single statements, whose connections stay in autocommit mode (no reset per
        check-out), or None when single statements share the first one's pool."""
        engine = self.create_engine(url, bounds, **kwargs)
        # Autocommit connections never hold a transaction: no reset on check-in.
        auto_kwargs = {"pool_reset_on_return": None, **kwargs}
        auto = self.create_engine(url, bounds, isolation_level="AUTOCOMMIT", **auto_kwargs)
        return engine, auto

    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """The engine single statements run on, and whether the hot path may run them at
        the driver level (:class:`DriverStatement`: its connections are in autocommit mode).

        Without an engine of their own (``given``) they borrow ``engine``'s pool in
        autocommit mode, each check-in then resetting the isolation level.
        """
        if given is not None:
            return given, True
        return engine.execution_options(isolation_level="AUTOCOMMIT"), False

    def prepare(self, engine: Engine) -> None:
        """Whatever the database needs before its first task (a server: a migration, run by
        an operator with ``celery lease migrate``; nothing here)."""

    # -- errors ----------------------------------------------------------------

    def classify(self, exc: BaseException) -> Classification:
        """Transient or permanent, and why, for an error raised by SQLAlchemy or this driver.

        The driver's own code decides where this database knows it; otherwise
        SQLAlchemy's judgement: a connection it invalidated, a pool timeout or an
        ``OperationalError`` is transient, anything else permanent.
        """
        orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else exc
        if isinstance(orig, BaseException):
            found = self.classify_driver_error(orig)
            if found is not None:
                return found
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return _t("disconnect")
        if isinstance(exc, sa_exc.TimeoutError):
            return _t("pool_timeout")
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.DisconnectionError)):
            return _t("unavailable")
        if isinstance(exc, sa_exc.IntegrityError):
            return _p("integrity")
        if isinstance(exc, sa_exc.DataError):
            return _p("bad_data")
        if isinstance(exc, sa_exc.ProgrammingError):
            return _p("bad_sql")
        if isinstance(exc, sa_exc.DBAPIError):
            return _p("database_error")
        return _p("client_error")

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class of the driver's error by its code, or None when no code of this
        database covers it."""
        return None

    def wrap(self, exc: BaseException, name: str) -> LeaseDatabaseError:
        """The :class:`LeaseDatabaseError` the store raises for ``exc`` (``raise ... from exc``).

        ``name`` is the database's name in the message, which names the cause and the
        driver's first line, never the SQL parameters (they can hold task arguments).
        """
        found = self.classify(exc)
        orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else None
        text = str(orig if orig is not None else exc).strip()
        # SQLAlchemy appends "[SQL: ...]" and "[parameters: ...]" on later lines.
        detail = text.splitlines()[0][:300] if text else ""
        return LeaseDatabaseError(
            f"{name} {found.cause}: {type(orig or exc).__name__}: {detail}",
            transient=found.transient,
            cause=found.cause,
        )

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """True when the statement gave up waiting for a row lock (the bounded lock wait)."""
        return False

    # -- statements ------------------------------------------------------------

    def insert(self, table: Table) -> Any:
        """The ``INSERT`` construct (the dialect's own where it has ``ON CONFLICT``)."""
        return sqlalchemy.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> UpsertClaim | LockedClaim:
        """How this database claims a run, built once per store."""
        return LockedClaim(self.insert, engine)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """Serialize the claims sharing concurrency ``key`` inside ``conn``'s transaction;
        False means another claimer holds the key (report busy)."""
        return True

    def count_live(self, query: Any) -> Any:
        """The statement counting a key's live leases (as a locking read where needed)."""
        return query

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """In ``conn``'s transaction: insert the ``waiting`` row, or ``bump`` a queued one."""
        run_id = waiting["id"]
        changed = conn.execute(
            update(runs).where(runs.c.id == run_id, runs.c.status == QUEUED).values(bump)
        ).rowcount
        exists = conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first()
        if not changed and exists is None:
            conn.execute(self.insert(runs).values(waiting))

    def renew(
        self, engine: Engine, auto: Engine, renew: Any, guard: Any, columns: Sequence[Any]
    ) -> Sequence[Any]:
        """Run the heartbeat's ``renew`` and return ``columns`` of the rows it renewed."""
        with engine.begin() as conn:
            conn.execute(renew)
            return conn.execute(select(*columns).where(guard)).all()

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """Insert the ``waiting`` row, or let an existing row that ``keeps`` the delivery adopt
        its message where ``adopt``; True when the row now carries the delivery.

        One short locked transaction. A claim inserting the row meanwhile makes it
        fail (a duplicate key or a deadlock): the caller then treats the delivery as
        not kept.
        """
        run_id = waiting["id"]
        adopted = {
            "task_id": waiting["task_id"],
            "payload": waiting["payload"],
            "payload_content_type": waiting["payload_content_type"],
        }
        with engine.begin() as conn:
            found = conn.execute(
                select(runs.c.id).where(runs.c.id == run_id).with_for_update()
            ).first()
            if found is None:
                conn.execute(self.insert(runs).values(waiting))
                return True
            conn.execute(update(runs).where(runs.c.id == run_id, adopt, keeps).values(adopted))
            kept = conn.execute(select(runs.c.id).where(runs.c.id == run_id, keeps)).first()
            return kept is not None

    def lock_expired(self, query: Any) -> Any:
        """The sweep's read of expired leases: ``FOR UPDATE SKIP LOCKED``, so a row a stalled
        transaction holds is skipped this time, never waited for."""
        return query.with_for_update(skip_locked=True)

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """Delete the rows ``oldest`` (a locked ``SELECT id .. LIMIT``) picks; how many.

        One statement, ``id IN (..)``: the rows are locked (or the writer is alone)
        and were picked by the guard, so no second filter.
        """
        with auto.connect() as conn:
            return int(conn.execute(delete(runs).where(runs.c.id.in_(oldest))).rowcount)


class SQLite(Database):
    """SQLite: one writer at a time (``BEGIN IMMEDIATE``), so no row locks to take or skip.

    Upserts with ``ON CONFLICT``; the store's connections have pysqlite's own
    transaction handling off, so single statements share the one pool and each
    commits by itself outside ``BEGIN``. The busy timeout bounds every wait.
    """

    names = ("sqlite",)
    driver_extra = "sqlite"
    # julianday('now') carries milliseconds and is fixed for one statement.
    clock_sql = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"

    extended: ClassVar[dict[int, Classification]] = {
        1555: _p("duplicate_key"),  # SQLITE_CONSTRAINT_PRIMARYKEY
        2067: _p("duplicate_key"),  # SQLITE_CONSTRAINT_UNIQUE
    }
    codes: ClassVar[dict[int, Classification]] = {
        5: _t("database_locked"),  # SQLITE_BUSY
        6: _t("database_locked"),  # SQLITE_LOCKED
        10: _t("io_error"),  # SQLITE_IOERR
        13: _t("insufficient_resources"),  # SQLITE_FULL
        15: _t("database_locked"),  # SQLITE_PROTOCOL
        3: _p("permission_denied"),  # SQLITE_PERM
        8: _p("read_only"),  # SQLITE_READONLY
        11: _p("corrupt"),  # SQLITE_CORRUPT
        14: _p("cannot_open"),  # SQLITE_CANTOPEN: a missing directory, a bad path
        18: _p("data_too_long"),  # SQLITE_TOOBIG
        19: _p("integrity"),  # SQLITE_CONSTRAINT
        20: _p("bad_data"),  # SQLITE_MISMATCH
        23: _p("permission_denied"),  # SQLITE_AUTH
        26: _p("corrupt"),  # SQLITE_NOTADB
    }
    #: SQLite gives nothing finer than ``SQLITE_ERROR`` for these: the message decides.
    messages: ClassVar[tuple[tuple[str, Classification], ...]] = (
        ("database is locked", _t("database_locked")),
        ("no such table", _p("missing_table")),
        ("no such column", _p("missing_column")),
        ("has no column named", _p("missing_column")),
        ("syntax error", _p("bad_sql")),
        ("unable to open database", _p("cannot_open")),
        ("readonly database", _p("read_only")),
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
        return engine.execution_options(**{SQLITE_AUTOCOMMIT: True}), True

    def prepare(self, engine: Engine) -> None:
        """The embedded default needs no migrate step: create the table and its indexes."""
        create_schema(engine)

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

    def insert(self, table: Table) -> Any:
        """SQLite's ``INSERT``, with ``ON CONFLICT``."""
        return sqlite.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> UpsertClaim | LockedClaim:
        """One upsert. The key lock of a limited claim is ``BEGIN IMMEDIATE``'s write lock."""
        return UpsertClaim(self.insert, auto, raw=raw)

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """One upsert that bumps only a row still ``queued``."""
        _record_waiting_upsert(self.insert, conn, waiting, bump)

    def renew(
        self, engine: Engine, auto: Engine, renew: Any, guard: Any, columns: Sequence[Any]
    ) -> Sequence[Any]:
        """One ``UPDATE .. RETURNING``."""
        with auto.connect() as conn:
            return conn.execute(renew.returning(*columns)).all()

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """One conditional upsert (see :meth:`Database.keep`)."""
        return _keep_upsert(self.insert, auto, waiting, adopt, keeps)

    def lock_expired(self, query: Any) -> Any:
        """No row locks: the sweep's transaction is the only writer."""
        return query

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


class PostgreSQL(Database):
    """PostgreSQL: upserts, advisory key locks, ``SKIP LOCKED``, bounds that survive a pooler."""

    names = ("postgresql",)
    driver_extra = "postgres"
    # clock_timestamp(), not now(): now() is frozen at transaction start, which
    # would make a fence inside a long user transaction read a stale clock.
    clock_sql = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"

    codes: ClassVar[dict[str, Classification]] = {
        "40001": _t("serialization_failure"),
        "40P01": _t("deadlock"),
        "55P03": _t("lock_not_available"),
        "57014": _t("timeout"),  # query_canceled: statement_timeout
        "25P03": _t("timeout"),  # idle_in_transaction_session_timeout
        "57P01": _t("server_shutdown"),
        "57P02": _t("server_shutdown"),
        "57P03": _t("server_starting"),
        "53300": _t("too_many_connections"),
        "23505": _p("duplicate_key"),
        "22001": _p("data_too_long"),
        "22003": _p("out_of_range"),
        "42P01": _p("missing_table"),
        "42703": _p("missing_column"),
        "42501": _p("permission_denied"),
        "28000": _p("auth_failed"),
        "28P01": _p("auth_failed"),
        "3D000": _p("missing_database"),
        "25006": _p("read_only"),
    }
    classes: ClassVar[dict[str, Classification]] = {
        "08": _t("disconnect"),
        "53": _t("insufficient_resources"),
        "58": _t("system_error"),
        "22": _p("bad_data"),
        "23": _p("integrity"),
        "42": _p("bad_sql"),
    }
    #: libpq reports connection failures without a SQLSTATE: the message decides.
    messages: ClassVar[tuple[tuple[str, Classification], ...]] = (
        ("password authentication failed", _p("auth_failed")),
        ("no pg_hba.conf entry", _p("auth_failed")),
        ('role "', _p("auth_failed")),  # role "x" does not exist
        # database "x" is not currently accepting connections: it will again.
        ("not currently accepting connections", _t("server_starting")),
        ("the database system is", _t("server_starting")),  # starting up / shutting down
        ('database "', _p("missing_database")),  # database "x" does not exist
        ("connection refused", _t("connection_refused")),
        ("failed to resolve host", _t("unknown_host")),
        ("could not translate host name", _t("unknown_host")),
    )

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """An engine whose every wait is bounded, behind a transaction pooler or not.

        With psycopg (3), each new connection checks whether a pooler stands
        between it and the server (:meth:`_detect_pooler`). Direct, it keeps
        psycopg's server-side prepared statements and sets ``statement_timeout``
        and ``lock_timeout`` once for the session. Behind a pooler, which may hand
        each transaction to another server connection, it prepares nothing (a
        prepared name would be missing there, or name another statement) and
        sends every statement together with ``set_config(..., true)`` calls for
        both timeouts: transaction-local, so they travel with the statement, and
        no extra round trip. ``?prepare_threshold=N`` (or ``none``) in the URL
        decides instead of the check. A client-side watchdog cuts a connection
        that waits past ``bounds.client`` for any reply.
        """
        parsed = make_url(url)
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("connect_timeout", math.ceil(bounds.connect))
        detect = False
        if parsed.get_driver_name() == "psycopg":
            given = parsed.query.get("prepare_threshold")
            parsed = parsed.difference_update_query(["prepare_threshold"])
            detect = given is None and not {"prepare_threshold", "cursor_factory"} & set(
                connect_args
            )
            threshold = _threshold(given)
            connect_args.setdefault("prepare_threshold", threshold)
            cursor = _bounded_psycopg_cursor(bounds, prepared=threshold is not None)
            connect_args.setdefault("cursor_factory", cursor)
        engine = create_engine(parsed, connect_args=connect_args, hide_parameters=True, **kwargs)
        watchdog = _ClientWatchdog(bounds.client)
        watchdog.install(engine)
        if detect:
            self._detect_pooler(engine, bounds, watchdog)
        return engine

    @staticmethod
    def _detect_pooler(engine: Engine, bounds: WaitBounds, watchdog: _ClientWatchdog) -> None:
        """Prepared statements and session timeouts on connections that reach PostgreSQL directly.

        A pooler (PgBouncer, and others) answers the startup itself and gives the
        client a backend key of its own, so the process id the connection was told
        at startup is not the ``pg_backend_pid()`` of the server that runs its
        statements. Where they match, nothing stands in between: session state
        holds, psycopg may prepare, and the timeouts are set once for the session.
        Where they differ, the connection keeps the pooler-safe settings it was
        made with (nothing prepared, timeouts sent with each statement).
        """
        import psycopg

        settings = (
            f"SET statement_timeout = {round(bounds.statement * 1000)}; "
            f"SET lock_timeout = {max(1, round(bounds.lock * 1000))}"
        )
        idle = psycopg.pq.TransactionStatus.IDLE

        def on_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
            with watchdog.guard(dbapi_connection):  # not checked out yet: bound it here
                cursor = psycopg.Cursor(dbapi_connection)
                cursor.execute("SELECT pg_backend_pid()")
                row = cursor.fetchone()
                if row is not None and row[0] == dbapi_connection.info.backend_pid:
                    cursor.execute(settings)
                    dbapi_connection.prepare_threshold = PSYCOPG_PREPARE_THRESHOLD
                    dbapi_connection.cursor_factory = psycopg.Cursor
                cursor.close()
                if dbapi_connection.info.transaction_status != idle:
                    dbapi_connection.commit()  # the session settings must outlive it

        event.listen(engine, "connect", on_connect)

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class by SQLSTATE (``psycopg``'s ``exc.sqlstate``), else by libpq's connection
        message."""
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if isinstance(state, str) and state:
            return self.codes.get(state) or self.classes.get(state[:2])
        text = str(orig).lower()
        if "connection" in text or "host" in text:
            for fragment, classification in self.messages:
                if fragment in text:
                    return classification
        return None

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """``lock_not_available`` (SQLSTATE 55P03): ``lock_timeout`` ended the wait."""
        orig = exc.orig
        return (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) == "55P03"

    def insert(self, table: Table) -> Any:
        """PostgreSQL's ``INSERT``, with ``ON CONFLICT``."""
        return postgresql.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> UpsertClaim | LockedClaim:
        """One upsert."""
        return UpsertClaim(self.insert, auto, raw=raw)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """A transaction-scoped advisory try-lock on the key's hash: a holder frozen inside
        this short transaction must not stall every other claim on the key; they report
        busy instead."""
        return bool(
            conn.execute(
                select(func.pg_try_advisory_xact_lock(func.hashtextextended(key, 0)))
            ).scalar()
        )

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """One upsert that bumps only a row still ``queued``."""
        _record_waiting_upsert(self.insert, conn, waiting, bump)

    def renew(
        self, engine: Engine, auto: Engine, renew: Any, guard: Any, columns: Sequence[Any]
    ) -> Sequence[Any]:
        """One ``UPDATE .. RETURNING``."""
        with auto.connect() as conn:
            return conn.execute(renew.returning(*columns)).all()

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """One conditional upsert (see :meth:`Database.keep`)."""
        return _keep_upsert(self.insert, auto, waiting, adopt, keeps)

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """``id = ANY(ARRAY(...))``: an index condition on the primary key; with ``IN (...)``
        the planner may hash-join against a scan of the table."""
        picked = runs.c.id == func.any(func.array(oldest.scalar_subquery()))
        with auto.connect() as conn:
            return int(conn.execute(delete(runs).where(picked)).rowcount)


class MySQL(Database):
    """MySQL/MariaDB: a locked read-then-write claim; the key's count is a locking read.

    The bounds are session settings and PyMySQL socket timeouts.
    """

    names = ("mysql", "mariadb")
    driver_extra = "mysql"
    # UTC_TIMESTAMP, not NOW(): UNIX_TIMESTAMP(NOW()) converts through the
    # session time zone, which under daylight saving repeats an hour (the
    # clock runs an hour behind, then jumps). Both operands are DATETIMEs,
    # so no time zone is applied at all.
    clock_sql = (
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000"
        " AS SIGNED)"
    )

    #: The server's (or the client's) error number, ``args[0]``.
    codes: ClassVar[dict[int, Classification]] = {
        1213: _t("deadlock"),
        1205: _t("lock_not_available"),  # innodb_lock_wait_timeout
        3572: _t("lock_not_available"),  # NOWAIT
        1040: _t("too_many_connections"),
        1203: _t("too_many_connections"),  # max_user_connections
        3024: _t("timeout"),  # MySQL max_execution_time
        1969: _t("timeout"),  # MariaDB max_statement_time
        1317: _t("timeout"),  # query interrupted
        1053: _t("server_shutdown"),
        1927: _t("disconnect"),  # MariaDB: connection killed
        4031: _t("disconnect"),  # MySQL: idle client disconnected
        2002: _t("connection_refused"),
        2003: _t("connection_refused"),
        2005: _t("unknown_host"),
        2006: _t("disconnect"),
        2013: _t("disconnect"),
        2055: _t("disconnect"),
        1406: _p("data_too_long"),
        1264: _p("out_of_range"),
        1690: _p("out_of_range"),
        1366: _p("bad_data"),
        1292: _p("bad_data"),
        1153: _p("packet_too_large"),
        1146: _p("missing_table"),
        1054: _p("missing_column"),
        1064: _p("bad_sql"),
        1149: _p("bad_sql"),
        1045: _p("auth_failed"),
        1044: _p("permission_denied"),
        1142: _p("permission_denied"),
        1143: _p("permission_denied"),
        1049: _p("missing_database"),
        1062: _p("duplicate_key"),
        1048: _p("integrity"),
        1452: _p("integrity"),
        1792: _p("read_only"),
        1290: _p("read_only"),
    }

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """Session lock-wait and statement bounds on every connection; with PyMySQL, socket
        timeouts a little past the server-side bounds (a read that outlasts them is a
        partition)."""
        parsed = make_url(url)
        connect_args = dict(kwargs.pop("connect_args", {}))
        if parsed.get_driver_name() == "pymysql":
            connect_args.setdefault("connect_timeout", bounds.connect)
            client = max(bounds.client, self._statement_bound(bounds) + 0.5)
            connect_args.setdefault("read_timeout", client)
            connect_args.setdefault("write_timeout", client)
        engine = create_engine(parsed, connect_args=connect_args, hide_parameters=True, **kwargs)
        self._bound_sessions(engine, bounds)
        return engine

    @staticmethod
    def _lock_bound(bounds: WaitBounds) -> int:
        """``innodb_lock_wait_timeout``: whole seconds, at least 1."""
        return max(1, math.ceil(bounds.lock))

    def _statement_bound(self, bounds: WaitBounds) -> float:
        """The statement bound, longer than the (rounded up) lock wait so that one reports first."""
        return max(bounds.statement, self._lock_bound(bounds) + 0.5)

    def _bound_sessions(self, engine: Engine, bounds: WaitBounds) -> None:
        """Session lock-wait and statement bounds on every new connection.

        MySQL has no transaction pooler to lose session state to. MariaDB's
        ``max_statement_time`` (seconds) bounds every statement; MySQL's
        ``max_execution_time`` (milliseconds) bounds reads only, the lock wait
        bounds the writes.
        """
        lock_wait = self._lock_bound(bounds)
        limit = self._statement_bound(bounds)

        def on_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("SELECT VERSION()")
            mariadb = "mariadb" in str(cursor.fetchone()[0]).lower()
            statement = (
                f"max_statement_time = {limit:.3f}"
                if mariadb
                else f"max_execution_time = {round(limit * 1000)}"
            )
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {lock_wait}, {statement}")
            cursor.close()

        event.listen(engine, "connect", on_connect)

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class by error number, or None when it carries no known number."""
        args = getattr(orig, "args", ())
        number = args[0] if args and isinstance(args[0], int) else None
        return None if number is None else self.codes.get(number)

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """Error 1205: ``innodb_lock_wait_timeout`` ended the wait."""
        args: tuple[Any, ...] = getattr(exc.orig, "args", ())
        return bool(args) and args[0] == 1205

    def count_live(self, query: Any) -> Any:
        """The count as ``SELECT .. FOR UPDATE``: InnoDB's next-key locks on the key's
        ``running`` index range block any other claim from adding a live lease to it until
        this transaction ends. Two claimers that both found the range empty deadlock on
        their inserts; the loser is retried by the claim."""
        return query.with_for_update()

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """MySQL refuses ``LIMIT`` in an ``IN`` subquery: pick, then delete, in one transaction."""
        with engine.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if not ids:
                return 0
            return int(conn.execute(delete(runs).where(runs.c.id.in_(ids), purgeable)).rowcount)


def _record_waiting_upsert(
    insert: Any, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
) -> None:
    """``INSERT waiting ON CONFLICT DO UPDATE bump WHERE status = queued``."""
    conn.execute(
        insert(runs)
        .values(waiting)
        .on_conflict_do_update(index_elements=[runs.c.id], set_=bump, where=runs.c.status == QUEUED)
    )


def _keep_upsert(
    insert: Any, auto: Engine, waiting: dict[str, Any], adopt: Any, keeps: Any
) -> bool:
    """A kept delivery as one conditional ``INSERT .. ON CONFLICT .. RETURNING``."""
    insert_stmt = insert(runs).values(waiting)
    excluded = insert_stmt.excluded
    stmt = insert_stmt.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={
            "task_id": sqlalchemy.case((adopt, excluded.task_id), else_=runs.c.task_id),
            "payload": func.coalesce(runs.c.payload, excluded.payload),
            "payload_content_type": sqlalchemy.case(
                (adopt, excluded.payload_content_type),
                else_=runs.c.payload_content_type,
            ),
        },
        where=keeps,
    ).returning(runs.c.id)
    with auto.connect() as conn:
        return conn.execute(stmt).first() is not None


def _threshold(value: Any) -> int | None:
    """psycopg's ``prepare_threshold`` from a URL query value (None: never prepare)."""
    if value is None or str(value).lower() in ("", "none", "off"):
        return None
    return int(value)


def _bounded_psycopg_cursor(bounds: WaitBounds, *, prepared: bool) -> type[Any]:
    """A psycopg cursor class that bounds each statement, in the statement's own round trip.

    ``set_config(..., true)`` lasts until the end of the current transaction:
    the explicit one, or, for a statement outside one, the implicit transaction
    of that one round trip. Behind a transaction pooler both settings therefore
    travel with the statement to whichever server connection runs it.

    Without server-side prepared statements (the default) the settings and the
    statement go as one simple-protocol query, its parameters bound on the
    client: a multi-statement query runs as one implicit transaction, and the
    cursor is moved to the statement's own result. With prepared statements
    (``prepare_threshold`` given) they go in one pipeline (libpq >= 14) ending
    in a single Sync; without pipeline support a statement inside a transaction
    sets them with one more round trip, and one outside has only the client bound.
    """
    import psycopg

    bound_sql = (
        f"SELECT set_config('statement_timeout', '{round(bounds.statement * 1000)}', true), "
        f"set_config('lock_timeout', '{max(1, round(bounds.lock * 1000))}', true)"
    )
    if not prepared:

        class BoundedClientCursor(psycopg.ClientCursor[Any]):
            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                if isinstance(query, bytes):
                    query = query.decode()
                if not isinstance(query, str):  # a psycopg.sql object: sent as it is
                    return super().execute(query, params, **kwargs)
                super().execute(f"{bound_sql}; {query}", params, **kwargs)
                self.nextset()  # the statement's own result, rowcount and description
                return self

        return BoundedClientCursor

    pipelined = psycopg.Pipeline.is_supported()
    plain = psycopg.Cursor
    idle = psycopg.pq.TransactionStatus.IDLE
    bound_bytes = bound_sql.encode()

    class BoundedCursor(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            conn = self.connection
            if pipelined:
                with conn.pipeline():
                    plain(conn).execute(bound_bytes)
                    return super().execute(query, params, **kwargs)
            if conn.info.transaction_status != idle:
                plain(conn).execute(bound_bytes)
            return super().execute(query, params, **kwargs)

    return BoundedCursor


def create_schema(engine: Engine) -> None:
    """Create the runs table and any index it lacks."""
    metadata.create_all(engine, checkfirst=True)
    # A table an earlier version made lacks the indexes added since.
    for index in runs.indexes:
        index.create(engine, checkfirst=True)


#: The database objects, by SQLAlchemy dialect name.
DATABASES: dict[str, Database] = {
    name: database for database in (SQLite(), PostgreSQL(), MySQL()) for name in database.names
}

#: What a database SQLAlchemy speaks but celery-lease does not know gets.
_UNKNOWN = Database()


def database_for(name: str) -> Database:
    """The database object for the SQLAlchemy dialect or backend ``name`` (a generic
    server database for one celery-lease does not know)."""
    return DATABASES.get(name, _UNKNOWN)


def backend_of(url: str) -> str:
    """The database ``url`` names (``postgresql``, ``sqlite``...), or "" if it does not parse."""
    try:
        return make_url(url).get_backend_name()
    except sa_exc.ArgumentError:
        return ""


def create_lease_engine(url: str, *, bounds: WaitBounds = DEFAULT_BOUNDS, **kwargs: Any) -> Engine:
    """An engine for lease traffic on ``url``, every wait bounded by ``bounds``; the
    database's class decides how (:meth:`Database.create_engine`).

    Raises SQLAlchemy's ``ArgumentError`` for a URL that does not parse.
    """
    backend = make_url(url).get_backend_name()
    return database_for(backend).create_engine(url, bounds, **kwargs)


def _compile_clock(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    return DATABASES[compiler.dialect.name].clock_sql


# One compilation per known dialect name and no default one: an unknown database fails
# loudly when a statement is compiled.
for _name in DATABASES:
    compiles(db_now_ms, _name)(_compile_clock)
