"""PostgreSQL, directly or behind a transaction pooler: :class:`PostgreSQL`, its migration
lock and its online DDL."""

from __future__ import annotations

import itertools
import math
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy
from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    LargeBinary,
    String,
    Table,
    create_engine,
    delete,
    event,
    func,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from ..schema import partial, runs
from .bounds import MigrationBounds, WaitBounds
from .database import (
    ClaimPath,
    Classification,
    Database,
    DDLLockTimeout,
    MigrationLock,
    MigrationLockTimeout,
    OnlineDDL,
    UpsertClaim,
    begin_live_on,
    own_transactions,
    permanent,
    retry_ddl,
    server_engines,
    server_single_statements,
    socket_dropped,
    transient,
    unresolvable_host,
    upsert_kept,
    upsert_rate,
    upsert_renew,
    upsert_waiting,
)
from .driver import DriverStatement, _ClientWatchdog

if TYPE_CHECKING:
    from alembic.operations import Operations

#: psycopg's own default: a statement is prepared on its sixth run.
PSYCOPG_PREPARE_THRESHOLD = 5


class PostgreSQL(Database):
    """PostgreSQL: upserts, advisory key locks, ``SKIP LOCKED``, bounds that survive a pooler."""

    codes: ClassVar[dict[str, Classification]] = {
        "40001": transient("serialization_failure"),
        "40P01": transient("deadlock"),
        "55P03": transient("lock_not_available"),
        "57014": transient("timeout"),  # query_canceled: statement_timeout
        "25P03": transient("timeout"),  # idle_in_transaction_session_timeout
        "57P01": transient("server_shutdown"),
        "57P02": transient("server_shutdown"),
        "57P03": transient("server_starting"),
        "53300": transient("too_many_connections"),
        # A standby, or a primary being switched over: writable again after the failover.
        "25006": transient("read_only"),  # read_only_sql_transaction
        "23505": permanent("duplicate_key"),
        "22001": permanent("data_too_long"),
        "22003": permanent("out_of_range"),
        "42P01": permanent("missing_table"),
        "42703": permanent("missing_column"),
        "42501": permanent("permission_denied"),
        "28000": permanent("auth_failed"),
        "28P01": permanent("auth_failed"),
        "3D000": permanent("missing_database"),
    }
    classes: ClassVar[dict[str, Classification]] = {
        "08": transient("disconnect"),
        "53": transient("insufficient_resources"),
        "58": transient("system_error"),
        "22": permanent("bad_data"),
        "23": permanent("integrity"),
        "42": permanent("bad_sql"),
    }
    #: libpq reports connection failures without a SQLSTATE: the message decides.
    messages: ClassVar[tuple[tuple[str, Classification], ...]] = (
        # 53300 at connect time, first: 'too many connections for role "x"' (or database)
        # names a role that exists. Also "sorry, too many clients already", "remaining
        # connection slots are reserved ...", PgBouncer's "no more connections allowed".
        ("too many c", transient("too_many_connections")),
        ("remaining connection slots are reserved", transient("too_many_connections")),
        ("no more connections allowed", transient("too_many_connections")),
        ("password authentication failed", permanent("auth_failed")),
        ("no pg_hba.conf entry", permanent("auth_failed")),
        ('role "', permanent("auth_failed")),  # role "x" does not exist
        # database "x" is not currently accepting connections: it will again.
        ("not currently accepting connections", transient("server_starting")),
        ("the database system is", transient("server_starting")),  # starting up / shutting down
        ('database "', permanent("missing_database")),  # database "x" does not exist
        ("connection refused", transient("connection_refused")),
        ("failed to resolve host", transient("unknown_host")),
        ("could not translate host name", transient("unknown_host")),
    )

    def __init__(self) -> None:
        super().__init__(
            names=("postgresql",),
            driver_extra="postgres",
            # clock_timestamp(), not now(): now() is frozen at transaction start, which
            # would make a fence inside a long user transaction read a stale clock.
            clock_sql="CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)",
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

    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """Two engines: transactions, and single statements in autocommit mode."""
        return server_engines(self, url, bounds, **kwargs)

    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """The autocommit engine :meth:`open` made (else ``engine``'s pool, borrowed)."""
        return server_single_statements(engine, given)

    def prepare(self, engine: Engine) -> None:
        """Nothing: an operator makes the tables with ``celery lease migrate``."""

    def unreachable(self, url: URL) -> str | None:
        """A host that does not resolve."""
        return unresolvable_host(url)

    def missing(self, url: URL) -> str | None:
        """Nothing to see without connecting (the server says so)."""
        return None

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

    def begin_live(self, engine: Engine) -> AbstractContextManager[Connection]:
        """A connection whose socket says the server dropped it is replaced first, with no
        round trip (see :func:`~celery_lease.store.database.socket_dropped`)."""
        return begin_live_on(engine, socket_dropped)

    def insert(self, table: Table) -> Any:
        """PostgreSQL's ``INSERT``, with ``ON CONFLICT``."""
        return postgresql.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> ClaimPath:
        """One upsert."""
        return UpsertClaim(self, auto, raw=raw)

    def driver_statement(
        self, auto: Engine, statement: Any, *, returns_row: bool
    ) -> DriverStatement:
        """With psycopg, through libpq (:class:`LibpqStatement`); else the driver's cursor."""
        if auto.dialect.driver == "psycopg":
            return LibpqStatement(auto, statement, returns_row=returns_row)
        return DriverStatement(auto, statement, returns_row=returns_row)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """A transaction-scoped advisory try-lock on the key's hash: a holder frozen inside
        this short transaction must not stall every other claim on the key; they report
        busy instead."""
        return bool(
            conn.execute(
                select(func.pg_try_advisory_xact_lock(func.hashtextextended(key, 0)))
            ).scalar()
        )

    def count_live(self, query: Any) -> Any:
        """The plain count: the key's advisory lock (:meth:`lock_key`) serializes its claims."""
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
        """``FOR UPDATE SKIP LOCKED``: a row a stalled transaction holds is skipped this time."""
        return query.with_for_update(skip_locked=True)

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """``id = ANY(ARRAY(...))``: an index condition on the primary key; with ``IN (...)``
        the planner may hash-join against a scan of the table."""
        picked = runs.c.id == func.any(func.array(oldest.scalar_subquery()))
        with auto.connect() as conn:
            return int(conn.execute(delete(runs).where(picked)).rowcount)

    def migration_lock(self) -> MigrationLock:
        """An advisory lock (:class:`PostgresMigrationLock`)."""
        return PostgresMigrationLock()

    def online_ddl(self, operations: Operations, bounds: MigrationBounds) -> OnlineDDL:
        """Indexes built concurrently, other changes under a short ``lock_timeout``
        (:class:`PostgresDDL`)."""
        return PostgresDDL(operations, bounds)


#: The advisory lock key of ``lease migrate``: a fixed 64-bit number ("cellmigr").
PG_LOCK_KEY = 0x63656C6C6D696772


class PostgresMigrationLock(MigrationLock):
    """``pg_try_advisory_xact_lock``, tried in short transactions until ``timeout``.

    Transaction-scoped, so it is released when the lock's transaction ends and
    works behind PgBouncer in transaction mode (a session lock would not). The
    migration runs on a second connection, so it can commit step by step (and
    build indexes outside any transaction) while the lock stays held.
    """

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

    def release(self, connection: Connection) -> None:
        """End the lock's transaction."""
        connection.rollback()

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the lock in ``connection``'s transaction; migrate on a second connection."""
        self.acquire(connection, timeout)
        try:
            with connection.engine.connect() as migrating:
                yield migrating
        finally:
            self.release(connection)


class PostgresDDL(OnlineDDL):
    """``CREATE INDEX CONCURRENTLY`` outside the transaction; ``lock_timeout`` on the rest.

    ``ALTER TABLE`` needs the table's ``ACCESS EXCLUSIVE`` lock (for a
    catalog-only change, briefly); while it waits, every write queues behind
    it. So it waits at most ``bounds.lock_wait`` (a transaction-local
    ``lock_timeout``), then gives up, lets the queue drain for ``bounds.pause``
    and tries again. A concurrent index build takes ``SHARE UPDATE EXCLUSIVE``,
    which no write waits for, so it may wait for open transactions as long as
    the migration keeps trying (``bounds.total``). A concurrent build that failed
    leaves an ``INVALID`` index: it is dropped and built again, by this run or
    by the next ``migrate``.
    """

    @staticmethod
    def _timed_out(exc: sa_exc.OperationalError) -> bool:
        return getattr(exc.orig, "sqlstate", None) == "55P03"  # lock_not_available

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` in a savepoint under ``SET LOCAL lock_timeout``, retrying a timeout."""
        connection = self.op.get_bind()
        wait = f"SET LOCAL lock_timeout = '{_ms(self.bounds.lock_wait)}ms'"

        def attempt() -> None:
            with connection.begin_nested():
                connection.exec_driver_sql(wait)
                change()

        retry_ddl(attempt, self._timed_out, self.bounds)

    def add_column(self, table: str, column: sqlalchemy.Column[Any]) -> None:
        """``ADD COLUMN`` (catalog only) under a bounded wait for its brief exclusive lock."""
        self.bounded(lambda: self.op.add_column(table, column))

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """Build the index concurrently; drop an ``INVALID`` leftover first.

        Inside a caller's own transaction (``alembic_config(connection)`` used
        by hand) nothing can run outside it: a plain build, under a bounded wait.
        """
        if not own_transactions(self.op):
            self.bounded(lambda: self.op.create_index(name, table, list(columns)))
            return
        self._concurrently(lambda: self._build(self.op.get_bind(), name, table, columns))

    def drop_index(self, name: str, table: str) -> None:
        """``DROP INDEX CONCURRENTLY`` outside the transaction (plain inside a caller's)."""
        if not own_transactions(self.op):
            self.bounded(lambda: self.op.drop_index(name, table_name=table))
            return
        self._concurrently(
            lambda: self.op.drop_index(
                name, table_name=table, postgresql_concurrently=True, if_exists=True
            )
        )

    def set_partial(self, name: str, table: str, columns: Sequence[str], where: str | None) -> None:
        """Build the new index concurrently under a temporary name, drop the old one
        concurrently, then rename the new one (``ALTER INDEX .. RENAME``, which no write
        waits for): queries have one of the two throughout. Inside a caller's own
        transaction: a plain drop and build, under a bounded wait."""
        if not own_transactions(self.op):
            self.bounded(lambda: self.op.drop_index(name, table_name=table))
            self.bounded(lambda: self.op.create_index(name, table, list(columns), **partial(where)))
            return
        building = f"{name[: 63 - len(_BUILDING)]}{_BUILDING}"
        self._concurrently(
            lambda: self._build(self.op.get_bind(), building, table, columns, where=where)
        )
        self.drop_index(name, table)
        self.bounded(lambda: self.op.execute(f"ALTER INDEX {building} RENAME TO {name}"))

    def _concurrently(self, change: Callable[[], None]) -> None:
        """Run ``change`` outside any transaction, waiting at most ``bounds.total`` for locks
        (none that a write waits for)."""
        with self.op.get_context().autocommit_block():
            connection = self.op.get_bind()
            connection.exec_driver_sql(f"SET lock_timeout = '{_ms(self.bounds.total)}ms'")
            try:
                change()
            except sa_exc.OperationalError as exc:
                if self._timed_out(exc):
                    raise DDLLockTimeout(self.bounds, 1, self.bounds.total) from exc
                raise
            finally:
                connection.exec_driver_sql("RESET lock_timeout")

    def _build(
        self,
        connection: Connection,
        name: str,
        table: str,
        columns: Sequence[str],
        *,
        where: str | None = None,
    ) -> None:
        valid = connection.execute(
            text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
            {"name": name},
        ).scalar()
        if valid:
            return
        if valid is not None:  # a failed or interrupted concurrent build
            self.op.drop_index(name, table_name=table, postgresql_concurrently=True)
        self.op.create_index(
            name, table, list(columns), postgresql_concurrently=True, **partial(where)
        )


#: The suffix of an index :meth:`PostgresDDL.set_partial` builds before it takes the name.
_BUILDING = "_new"


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


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


class LibpqStatement(DriverStatement):
    """A hot-path statement on a direct psycopg connection, through libpq itself.

    psycopg's cursor (query conversion, parameter adaptation, its prepared
    statements manager, result objects) costs about as much client CPU as the
    round trip's own system calls: about 16 µs a statement on this project's
    benchmark machine. The claim and the completion need none of it: their
    parameters are text, integers and bytes, and they return integers and text.
    On a connection that reaches PostgreSQL directly (:meth:`PostgreSQL._detect_pooler`
    gave it psycopg's plain cursor, prepared statements and session timeouts)
    and talks UTF-8, the statement is prepared once under a name of its own
    and run with ``PQexecPrepared``, which releases the GIL while it waits. The
    pool's check-out, its watchdog and SQLAlchemy's error classes stay as for
    :class:`DriverStatement`. Any other connection (behind a pooler, settings
    given in the URL) and any value outside those types go through the cursor.
    A prepared statement the server no longer has, or whose plan a schema
    change made stale, is prepared again and the statement sent once more
    (neither ran it).
    """

    _numbers = itertools.count(1)

    def __init__(self, engine: Engine, statement: Any, *, returns_row: bool) -> None:
        import psycopg

        super().__init__(engine, statement, returns_row=returns_row)
        self._psycopg = psycopg
        self._name = f"celery_lease_{next(self._numbers)}".encode()
        order: dict[str, int] = {}

        def number(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"
            return f"${order.setdefault(match.group(1), len(order) + 1)}"

        self._libpq_sql = re.sub(r"%%|%\(([^)]+)\)s", number, self.sql).encode()
        types = {name: bind.type for bind, name in self.compiled.bind_names.items()}
        self._order = tuple(order)
        self._binary = tuple(isinstance(types.get(n), LargeBinary) for n in self._order)
        self._index = {name: i for i, name in enumerate(self._order)}
        self._formats = [1 if binary else 0 for binary in self._binary]
        self._types = [_BYTEA_OID if binary else 0 for binary in self._binary]
        self._ready: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._ok = (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK)
        self._stale = (b"26000", b"0A000")  # no such prepared statement; cached plan changed
        # Only integers and text come back decoded here.
        returned = getattr(self.compiled, "effective_returning", None) or ()
        self._fits = all(isinstance(column.type, (Integer, String)) for column in returned)
        # The statement's literal values ('running', 1, NULL), encoded once; a call
        # encodes only the parameters it gives.
        try:
            self._fixed = [
                _encode(self._defaults.get(name), binary, psycopg.Binary)
                for name, binary in zip(self._order, self._binary, strict=True)
            ]
        except _Unsendable:
            self._fixed, self._fits = [], False

    def _run(self, raw: Any, given: dict[str, Any]) -> tuple[int, Any]:
        conn = raw.dbapi_connection
        ready = self._ready.get(conn)
        if ready is None:
            ready = self._ready[conn] = self._prepare(conn)
        values = self._values(given) if ready else None
        if values is None:
            return super()._run(raw, given)
        result = self._exec(conn.pgconn, values)
        if result.status not in self._ok:
            if result.error_field(_SQLSTATE) not in self._stale:
                raise self._psycopg.errors.error_from_result(result)
            conn.pgconn.exec_(b"DEALLOCATE " + self._name)
            self._ready[conn] = self._prepare(conn)
            result = self._exec(conn.pgconn, values)
            if result.status not in self._ok:
                raise self._psycopg.errors.error_from_result(result)
        row = None
        if self.returns_row and result.ntuples:
            row = tuple(
                _decode(result.ftype(i), result.get_value(0, i)) for i in range(result.nfields)
            )
        return int(result.command_tuples or 0), row

    def _exec(self, pgconn: Any, values: list[bytes | None]) -> Any:
        """One round trip: the prepared statement run with ``values``; libpq's result."""
        return pgconn.exec_prepared(self._name, values, self._formats)

    def _prepare(self, conn: Any) -> bool:
        """Prepare the statement on ``conn`` if it takes this path; whether it does."""
        psycopg = self._psycopg
        direct = (
            self._fits
            and isinstance(conn, psycopg.Connection)
            and conn.autocommit
            and conn.cursor_factory is psycopg.Cursor
            and conn.pgconn.parameter_status(b"client_encoding") == b"UTF8"
        )
        if not direct:
            return False
        result = conn.pgconn.prepare(self._name, self._libpq_sql, self._types)
        if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
            raise psycopg.errors.error_from_result(result)
        return True

    def _values(self, given: dict[str, Any]) -> list[bytes | None] | None:
        """The parameters as libpq takes them (the caller's ``given`` over the literal
        ones), or None if one is of another type or is text libpq cannot take as it is
        (then the cursor sends it, or refuses it)."""
        out = self._fixed.copy()
        index, binary, wrapper = self._index, self._binary, self._psycopg.Binary
        try:
            for name, value in given.items():
                i = index.get(name)
                if i is not None:
                    out[i] = _encode(value, binary[i], wrapper)
        except _Unsendable:
            return None
        return out


#: PostgreSQL's type of a ``bytea`` parameter, sent in binary.
_BYTEA_OID = 17
#: libpq's diagnostic field code of the SQLSTATE.
_SQLSTATE = ord("C")


#: The type of a returned ``smallint``, ``integer`` or ``bigint`` column.
_INTEGER_OIDS = frozenset((20, 21, 23))


def _decode(oid: int, value: bytes | None) -> Any:
    """A returned text-format value of type ``oid``: an integer, or UTF-8 text."""
    if value is None:
        return None
    return int(value) if oid in _INTEGER_OIDS else value.decode()


class _Unsendable(Exception):
    """A value libpq cannot take as it is (:func:`_encode`)."""


def _encode(value: Any, binary: bool, wrapper: type[Any]) -> bytes | None:
    """``value`` as a libpq parameter: bytes (binary for a ``bytea``), or None for NULL.

    Raises:
        _Unsendable: another type; text with a NUL (libpq would end the parameter
            there) or a lone surrogate (no UTF-8 for it).
    """
    if value is None:
        return None
    if binary:
        if isinstance(value, wrapper):
            value = value.obj
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise _Unsendable
        return bytes(value)
    if isinstance(value, str):
        if "\x00" in value:
            raise _Unsendable
        try:
            return value.encode()
        except UnicodeEncodeError:
            raise _Unsendable from None
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return b"%d" % value
    raise _Unsendable
