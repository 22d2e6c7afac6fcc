"""Engines for lease traffic: every wait on the database bounded."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import ConnectionPoolEntry

from .driver import _ClientWatchdog

#: Execution option for single statements on SQLite: no ``BEGIN``, and no
#: isolation-level switch (SQLAlchemy's costs a PRAGMA at check-out and check-in).
SQLITE_AUTOCOMMIT = "celery_lease_autocommit"


@dataclasses.dataclass(frozen=True)
class WaitBounds:
    """How long any wait on the lease database may last, in seconds.

    Derived from ``lease_seconds`` by :meth:`for_lease` (see the settings
    docs): ``statement`` bounds one statement on the server
    (``statement_timeout``, MariaDB ``max_statement_time``, MySQL
    ``max_execution_time``, SQLite's busy timeout), ``lock`` a row-lock wait
    (``lock_timeout``, ``innodb_lock_wait_timeout``), ``connect`` opening a
    connection, and ``client`` how long this process waits for any reply on a
    checked-out connection before it cuts the connection (a network partition
    that drops packets never answers, so only the client can end that wait).
    """

    connect: float
    statement: float
    lock: float
    client: float

    @classmethod
    def for_lease(cls, lease_seconds: float) -> WaitBounds:
        """The bounds for a lease of ``lease_seconds``: a heartbeat never waits past a third."""
        statement = min(lease_seconds / 4.0, 60.0)
        return cls(
            connect=max(2.0, min(lease_seconds / 4.0, 30.0)),  # libpq's minimum is 2 s
            statement=statement,
            lock=statement * 2.0 / 3.0,
            client=min(lease_seconds / 3.0, 90.0),
        )


#: The bounds of a store made without a lease length (30 s, the default).
DEFAULT_BOUNDS = WaitBounds.for_lease(30.0)


def create_lease_engine(url: str, *, bounds: WaitBounds = DEFAULT_BOUNDS, **kwargs: Any) -> Engine:
    """An engine for lease traffic, every wait bounded by ``bounds``.

    No ``pool_pre_ping``: it would add a round trip to every statement. A
    connection found dead fails that one statement, SQLAlchemy then discards
    the pool, and each caller already retries (claims fail closed and are
    re-published, heartbeats retry, completions retry).

    PostgreSQL with psycopg (3): each new connection checks whether a pooler
    stands between it and the server (:func:`_detect_pooler`). Direct, it keeps
    psycopg's server-side prepared statements and sets ``statement_timeout``
    and ``lock_timeout`` once for the session. Behind a pooler, which may hand
    each transaction to another server connection, it prepares nothing (a
    prepared name would be missing there, or name another statement) and sends
    every statement together with ``set_config(..., true)`` calls for both
    timeouts: transaction-local, so they travel with the statement, and no
    extra round trip. ``?prepare_threshold=N`` (or ``none``) in the URL decides
    instead of the check. MySQL/MariaDB: the bounds are session settings and
    PyMySQL socket timeouts. SQLite: the busy timeout (set by the store).
    """
    parsed = make_url(url)
    connect_args = dict(kwargs.pop("connect_args", {}))
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    detect = False
    if backend == "postgresql":
        connect_args.setdefault("connect_timeout", math.ceil(bounds.connect))
        if driver == "psycopg":
            given = parsed.query.get("prepare_threshold")
            parsed = parsed.difference_update_query(["prepare_threshold"])
            detect = given is None and not {"prepare_threshold", "cursor_factory"} & set(
                connect_args
            )
            threshold = _threshold(given)
            connect_args.setdefault("prepare_threshold", threshold)
            cursor = _bounded_psycopg_cursor(bounds, prepared=threshold is not None)
            connect_args.setdefault("cursor_factory", cursor)
    elif backend in ("mysql", "mariadb") and driver == "pymysql":
        connect_args.setdefault("connect_timeout", bounds.connect)
        # A socket read that outlasts the server-side bounds is a partition.
        client = max(bounds.client, _mysql_statement_bound(bounds) + 0.5)
        connect_args.setdefault("read_timeout", client)
        connect_args.setdefault("write_timeout", client)
    engine = create_engine(parsed, connect_args=connect_args, hide_parameters=True, **kwargs)
    if backend in ("mysql", "mariadb"):
        _bound_mysql_sessions(engine, bounds)
    if backend == "postgresql":
        watchdog = _ClientWatchdog(bounds.client)
        watchdog.install(engine)
        if detect:
            _detect_pooler(engine, bounds, watchdog)
    return engine


#: psycopg's own default: a statement is prepared on its sixth run.
PSYCOPG_PREPARE_THRESHOLD = 5


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


def _mysql_lock_bound(bounds: WaitBounds) -> int:
    """``innodb_lock_wait_timeout``: whole seconds, at least 1."""
    return max(1, math.ceil(bounds.lock))


def _mysql_statement_bound(bounds: WaitBounds) -> float:
    """The statement bound, longer than the (rounded up) lock wait so that one reports first."""
    return max(bounds.statement, _mysql_lock_bound(bounds) + 0.5)


def _bound_mysql_sessions(engine: Engine, bounds: WaitBounds) -> None:
    """Session lock-wait and statement bounds on every new MySQL/MariaDB connection.

    MySQL has no transaction pooler to lose session state to. MariaDB's
    ``max_statement_time`` (seconds) bounds every statement; MySQL's
    ``max_execution_time`` (milliseconds) bounds reads only, the lock wait
    bounds the writes.
    """
    lock_wait = _mysql_lock_bound(bounds)
    limit = _mysql_statement_bound(bounds)

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


def _configure_sqlite(engine: Engine, bounds: WaitBounds) -> None:
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
