"""Every SQL statement celery-lease runs.

One method per statement (or per short transaction), each documented with what
it guarantees. Guarded writes name ``id``, ``lease_owner`` and ``attempt`` and
turn zero changed rows into :class:`~celery_lease.errors.LeaseLost`. Every time
comparison uses :class:`~celery_lease.schema.db_now_ms`, the database clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar, cast

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    String,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry

from . import dberrors
from .errors import LeaseError, LeaseLost
from .schema import (
    CANCELLED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATUSES,
    PayloadType,
    check_claim_inputs,
    db_now_ms,
    metadata,
    runs,
)

logger = logging.getLogger(__name__)

#: Execution option for single statements on SQLite: no ``BEGIN``, and no
#: isolation-level switch (SQLAlchemy's costs a PRAGMA at check-out and check-in).
SQLITE_AUTOCOMMIT = "celery_lease_autocommit"

#: How many times one claim call re-runs after losing to a concurrent claim
#: (deadlock, serialization failure, duplicate insert) before reporting busy.
CLAIM_CONTENTION_TRIES = 8

ClaimOutcome = Literal["claimed", "busy", "finished"]

#: Rows one retention statement deletes at most: a short transaction on every dialect.
PURGE_BATCH = 1000

#: A succeeded run keeps no stored message: task arguments are often personal data. A
#: failed or cancelled one keeps it until retention deletes the row, so that
#: ``celery lease rerun`` can publish it again (docs/security.md says so).
_CLEARED_MESSAGE: dict[str, Any] = {"payload": None, "payload_content_type": None}
LeaseKey = tuple[str, str, int]
F = TypeVar("F", bound=Callable[..., Any])


def _db_errors(method: F) -> F:
    """Raise SQLAlchemy and driver errors of a store method as :class:`LeaseDatabaseError`.

    Classified by :func:`celery_lease.dberrors.classify` (transient or
    permanent, and the cause); the driver's exception is kept as ``__cause__``.
    """

    @functools.wraps(method)
    def wrapper(self: LeaseStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise dberrors.wrap(exc, self.dialect) from exc

    return cast(F, wrapper)


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


_KEY_LOCKS: dict[str, _KeyLock] = {
    "postgresql": _PostgresKeyLock(),
    "mysql": _MySQLKeyLock(),
    "mariadb": _MySQLKeyLock(),
}


class RunNotFound(LeaseError):
    """No run row has this id."""

    code = "run_not_found"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"{self.code}: no run with id {run_id!r}")

    def __reduce__(self) -> tuple[type[RunNotFound], tuple[str]]:
        return (type(self), (self.run_id,))


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """What a claim attempt found.

    ``claimed``: this owner holds the lease, ``attempt`` is its fencing token.
    ``busy``: another live lease (or a backoff) blocks it; retry in ``retry_in`` s.
    ``finished``: the run is terminal (``status``); the body must not run.
    """

    outcome: ClaimOutcome
    run_id: str
    owner: str
    attempt: int
    status: str
    retry_in: float = 0.0
    lease_expires_at: int | None = None
    reason: str = ""
    #: For ``finished``: the task id of the delivery that ran the run (None if unknown).
    task_id: str | None = None
    #: For ``claimed``: the attempt at which the run is out of attempts (the row's
    #: ``max_attempts``: the claimer's setting, or more after ``celery lease rerun``).
    max_attempts: int = 0


@dataclasses.dataclass(frozen=True)
class HeartbeatResult:
    """Outcome of one heartbeat tick, as sets of ``(run_id, owner, attempt)``."""

    renewed: frozenset[LeaseKey]
    lost: frozenset[LeaseKey]
    cancel_requested: frozenset[LeaseKey]


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One row of ``celery_lease_runs``; times are epoch milliseconds (DB clock)."""

    id: str
    task_name: str
    status: str
    lease_owner: str | None
    lease_expires_at: int | None
    lease_ms: int
    heartbeat_at: int | None
    attempt: int
    max_attempts: int
    available_at: int
    cancel_requested_at: int | None
    started_at: int | None
    finished_at: int | None
    last_error: str | None
    failure_code: str | None
    concurrency_key: str | None
    task_id: str | None
    payload: bytes | None
    payload_content_type: str | None
    created_at: int
    updated_at: int

    @property
    def terminal(self) -> bool:
        """True once the run is succeeded, failed or cancelled."""
        return self.status in TERMINAL_STATUSES


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


class _ClientWatchdog:
    """Cuts a checked-out connection that has waited longer than ``bound`` for the server.

    A partition that drops packets leaves a client blocked in a socket read
    that no server-side timeout can end, and the driver (libpq) has no read
    timeout. One daemon thread per process looks at the connections checked out
    of the engine's pool; one past its bound gets its socket shut down, so the
    blocked call fails at once with a disconnect error and SQLAlchemy discards
    the connection. The file descriptor is not closed here, so it cannot be
    reused under the driver's feet.
    """

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self._pid = 0
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, int]] = {}

    def install(self, engine: Engine) -> None:
        """Arm at every pool check-out, disarm at check-in and invalidation."""
        event.listen(engine.pool, "checkout", self._arm)
        event.listen(engine.pool, "checkin", self._disarm)
        event.listen(engine.pool, "invalidate", self._disarm_invalid)

    @contextlib.contextmanager
    def guard(self, dbapi_connection: Any) -> Iterator[None]:
        """Bound the calls made on ``dbapi_connection`` inside this block."""
        self._arm_key(id(dbapi_connection), dbapi_connection)
        try:
            yield
        finally:
            self._disarm_key(id(dbapi_connection))

    def _arm(self, dbapi_connection: Any, record: ConnectionPoolEntry, proxy: Any) -> None:
        self._arm_key(id(record), dbapi_connection)

    def _disarm(self, dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        self._disarm_key(id(record))

    def _arm_key(self, key: int, dbapi_connection: Any) -> None:
        try:
            fd = int(dbapi_connection.fileno())
        except Exception:  # no socket to cut (closed, or a driver without fileno())
            return
        if self._pid != os.getpid():
            self._start()
        with self._lock:
            self._armed[key] = (time.monotonic() + self.bound, fd)

    def _disarm_key(self, key: int) -> None:
        with self._lock:
            self._armed.pop(key, None)

    def _disarm_invalid(
        self, dbapi_connection: Any, record: ConnectionPoolEntry, exception: Any
    ) -> None:
        self._disarm(dbapi_connection, record)

    def _start(self) -> None:
        # First use in this process (or in a forked child, whose copy of the
        # parent's lock and entries must not be trusted).
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._armed = {}
        thread = threading.Thread(target=self._watch, name="celery-lease-watchdog", daemon=True)
        thread.start()

    def _watch(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(max(0.05, self.bound / 4.0))
            now = time.monotonic()
            with self._lock:
                for key, (deadline, fd) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        self._cut(fd)

    def _cut(self, fd: int) -> None:
        logger.warning(
            "celery-lease: no reply from the lease database within %.1fs: connection cut",
            self.bound,
            extra={"lease_event": "db_wait_bound", "run_id": None},
        )
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()


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


def _lock_wait_ended(exc: DBAPIError) -> bool:
    """True when the statement gave up waiting for a row lock (the bounded lock wait)."""
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code == "55P03":  # PostgreSQL lock_not_available (lock_timeout)
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] == 1205  # MySQL/MariaDB lock wait timeout


class DriverStatement:
    """A statement compiled once and run on a pooled DBAPI cursor, below SQLAlchemy.

    The claim and the completion run once per task. Through
    ``Connection.execute`` SQLAlchemy's connection, parameter and result
    machinery cost about as much CPU as the round trip itself; here a call is a
    pool checkout, ``cursor.execute`` and a check-in. Only for statements that
    need no result processing (integers back, if anything), and only on an
    engine whose connections are in autocommit mode. Driver errors are raised as
    SQLAlchemy's ``DBAPIError`` subclasses, as ``Connection.execute`` would, and
    a connection found dead is invalidated. SQLAlchemy's execution events
    (``before_cursor_execute``) do not see these statements; the engine's
    connection settings do apply (psycopg's ``prepare_threshold`` and the
    bounded cursor class, the pool's watchdog).
    """

    def __init__(self, engine: Engine, statement: Any, *, returns_row: bool) -> None:
        dialect = engine.dialect
        compiled = statement.compile(dialect=dialect)
        if compiled.escaped_bind_names:
            raise ValueError("bind parameter names must not need escaping")
        self.engine = engine
        self.sql = compiled.string
        self.returns_row = returns_row
        self._positions = tuple(compiled.positiontup or ()) if compiled.positional else None
        self._processors = {
            name: process
            for name, bind in compiled.binds.items()
            if (process := bind.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }
        # Literal values compiled into binds ('running', 1, NULL), processed once.
        self._defaults = self._process(dict(compiled.params))
        self._dbapi_error: type[Exception] = dialect.loaded_dbapi.Error

    def _process(self, params: dict[str, Any]) -> dict[str, Any]:
        for name, process in self._processors.items():
            if name in params and params[name] is not None:
                params[name] = process(params[name])
        return params

    def execute(self, params: dict[str, Any]) -> tuple[int, Any]:
        """Run with ``params`` (by bind name); ``(rowcount, first row or None)``."""
        merged = {**self._defaults, **self._process(params)}
        args: Any = merged if self._positions is None else [merged[n] for n in self._positions]
        try:
            raw = self.engine.raw_connection()
        except self._dbapi_error as exc:
            raise self._wrap(exc, args, invalidated=False) from exc
        cursor = None
        try:
            cursor = raw.cursor()
            cursor.execute(self.sql, args)
            row = cursor.fetchone() if self.returns_row else None
            return int(cursor.rowcount), row
        except self._dbapi_error as exc:
            dead = self.engine.dialect.is_disconnect(
                exc,  # type: ignore[arg-type]
                raw.dbapi_connection,
                cursor,
            )
            if dead:
                raw.invalidate(exc)
            raise self._wrap(exc, args, invalidated=dead) from exc
        finally:
            if cursor is not None:
                # The statement's own outcome (or error) is what counts.
                with contextlib.suppress(self._dbapi_error):
                    cursor.close()
            raw.close()

    def _wrap(self, exc: Exception, args: Any, *, invalidated: bool) -> Exception:
        return DBAPIError.instance(
            self.sql,
            args,
            exc,
            self._dbapi_error,
            hide_parameters=self.engine.hide_parameters,
            connection_invalidated=invalidated,
            dialect=self.engine.dialect,
        )


class LeaseStore:
    """All lease SQL, over one SQLAlchemy engine.

    Single statements run in autocommit mode (one round trip each); the few
    read-then-write paths run in one short transaction.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        autocommit_engine: Engine | None = None,
        bounds: WaitBounds = DEFAULT_BOUNDS,
    ) -> None:
        """Use ``engine`` for transactions and ``autocommit_engine`` for single statements.

        ``bounds`` sets SQLite's busy timeout; on servers the waits are bounded
        by the engines themselves (:func:`create_lease_engine`).

        Without ``autocommit_engine``, single statements borrow ``engine``'s pool
        in autocommit mode (each check-in then resets the isolation level). On
        SQLite they borrow it as it is: pysqlite's own transaction handling is
        off on this store's connections, so a statement outside ``BEGIN``
        commits by itself, with no isolation-level switch.
        """
        self.engine = engine
        self.dialect = engine.dialect.name
        self.bounds = bounds
        self._own_auto = autocommit_engine
        if self.dialect == "sqlite":
            _configure_sqlite(engine, bounds)
            self._auto = autocommit_engine or engine.execution_options(**{SQLITE_AUTOCOMMIT: True})
        else:
            self._auto = autocommit_engine or engine.execution_options(isolation_level="AUTOCOMMIT")
        self._key_lock = _KEY_LOCKS.get(self.dialect, _KeyLock())
        self._upsert = self.dialect in ("sqlite", "postgresql")
        self._returning = self.dialect in ("sqlite", "postgresql")
        # The hot path's two statements are compiled once and run at the driver
        # level (DriverStatement) on an engine in autocommit mode: SQLite's
        # connections are (the driver's own transaction handling is off), a
        # server's autocommit engine is. Without one, they go through SQLAlchemy.
        complete = update(runs).where(
            self._guarded(bindparam("p_id"), bindparam("p_owner"), bindparam("p_attempt"))
        )
        self._complete_stmt = complete.values(**self._success_values(db_now_ms()))
        self._claim_stmt: Any = self._build_claim_upsert() if self._upsert else None
        self._complete_driver: DriverStatement | None = None
        self._claim_driver: DriverStatement | None = None
        if self.dialect == "sqlite" or autocommit_engine is not None:
            self._complete_driver = DriverStatement(
                self._auto, self._complete_stmt, returns_row=False
            )
            if self._claim_stmt is not None:
                self._claim_driver = DriverStatement(self._auto, self._claim_stmt, returns_row=True)

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float | None = None, **engine_kwargs: Any
    ) -> LeaseStore:
        """A store on new engines for ``url``, its waits bounded for ``lease_seconds``.

        On servers, single statements get an engine of their own whose
        connections stay in autocommit mode (no reset per check-out); SQLite
        shares one pool, whose connections commit each statement outside
        ``BEGIN`` by themselves. Without ``lease_seconds`` the bounds are those
        of the default 30 s lease.
        """
        bounds = DEFAULT_BOUNDS if lease_seconds is None else WaitBounds.for_lease(lease_seconds)
        engine = create_lease_engine(url, bounds=bounds, **engine_kwargs)
        if engine.dialect.name == "sqlite":
            return cls(engine, bounds=bounds)
        # Autocommit connections never hold a transaction: no reset on check-in.
        auto_kwargs = {"pool_reset_on_return": None, **engine_kwargs}
        auto = create_lease_engine(url, bounds=bounds, isolation_level="AUTOCOMMIT", **auto_kwargs)
        return cls(engine, autocommit_engine=auto, bounds=bounds)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine this store runs statements on (for instrumentation)."""
        return (self.engine,) if self._own_auto is None else (self.engine, self._own_auto)

    def dispose(self) -> None:
        """Close every pooled connection of this store."""
        for engine in self.engines:
            engine.dispose()

    # -- schema ---------------------------------------------------------------

    @_db_errors
    def create_schema(self) -> None:
        """Create the runs table and any index it lacks (the embedded default; else migrate)."""
        metadata.create_all(self.engine, checkfirst=True)
        # A table an earlier version made lacks the indexes added since.
        for index in runs.indexes:
            index.create(self.engine, checkfirst=True)

    @_db_errors
    def has_schema(self) -> bool:
        """True when the runs table exists."""
        return bool(inspect(self.engine).has_table(runs.name))

    def dispose_after_fork(self) -> None:
        """Drop pooled connections inherited from a parent process without closing them."""
        for engine in self.engines:
            engine.dispose(close=False)

    # -- claim ----------------------------------------------------------------

    @_db_errors
    def claim(
        self,
        run_id: str,
        owner: str,
        *,
        task_name: str,
        lease_ms: int,
        max_attempts: int,
        concurrency_key: str | None = None,
        max_concurrency: int | None = None,
        payload: bytes | None = None,
        payload_content_type: str | None = None,
        task_id: str | None = None,
    ) -> ClaimResult:
        """Insert the run or take it over, atomically; ``attempt`` grows by one per claim.

        A run is taken over when it is queued/retrying and available, or running
        with an expired lease, and has attempts left and no cancel request.
        Otherwise nothing changes and the result says why (busy or finished).
        With ``max_concurrency``, the claim also waits (busy, reason
        ``concurrency``) while that many live leases share ``concurrency_key``;
        the count and the claim happen under one lock on the key. ``task_id``
        is the claiming delivery's Celery task id, recorded as the run's own.
        """
        check_claim_inputs(
            run_id=run_id,
            task_name=task_name,
            owner=owner,
            lease_ms=lease_ms,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
            payload=payload,
            task_id=task_id,
        )
        values = {
            "id": run_id,
            "task_name": task_name,
            "status": RUNNING,
            "lease_owner": owner,
            "lease_ms": lease_ms,
            "attempt": 1,
            "max_attempts": max_attempts,
            "concurrency_key": concurrency_key,
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
        }
        limit = max_concurrency if concurrency_key is not None else None
        for tries in range(1, CLAIM_CONTENTION_TRIES + 1):
            try:
                return self._claim_once(values, lease_ms, max_attempts, limit)
            except SQLAlchemyError as exc:
                if isinstance(exc, DBAPIError) and _lock_wait_ended(exc):
                    # A transaction holds the row (a worker frozen inside fence()):
                    # that is a live owner as far as this claim can tell.
                    return ClaimResult(
                        "busy", run_id, owner, 0, RUNNING, self.bounds.lock, reason="locked"
                    )
                found = dberrors.classify(exc, self.dialect)
                if found.cause not in dberrors.CLAIM_CONTENTION:
                    raise
                if tries == CLAIM_CONTENTION_TRIES:
                    logger.info(
                        "celery-lease: claim of %s kept losing to concurrent claims (%s)",
                        run_id,
                        found.cause,
                        extra={"lease_event": "claim_contention", "run_id": run_id},
                    )
                    break
            # Jittered, growing pause: the winner usually commits within it.
            time.sleep(random.uniform(0, 0.002 * 2**tries))
        return ClaimResult("busy", run_id, owner, 0, QUEUED, 0.05, reason="race")

    def _claim_once(
        self, values: dict[str, Any], lease_ms: int, max_attempts: int, limit: int | None
    ) -> ClaimResult:
        """One claim attempt (see :meth:`claim`); contention errors propagate."""
        run_id, owner = values["id"], values["lease_owner"]
        if limit is not None:
            limited = self._claim_limited(values, lease_ms, max_attempts, limit)
            if isinstance(limited, ClaimResult):
                return limited
            row = limited
        elif self._upsert:
            row = self._claim_upsert(values, lease_ms, max_attempts)
        else:
            with self.engine.begin() as conn:
                row = self._claim_locked(conn, values, lease_ms, max_attempts)
        if row is not None:
            return ClaimResult(
                "claimed", run_id, owner, row[0], RUNNING, 0.0, row[1], max_attempts=row[2]
            )
        return self._claim_refused(run_id, owner, max_attempts)

    @staticmethod
    def _attempt_ceiling(max_attempts: Any) -> Any:
        """The attempt at which a run is out of attempts: the claimer's ``max_attempts``,
        or the row's own when larger (``celery lease rerun`` raises it, so that
        ``attempt``, the fencing token, never goes back)."""
        return case((runs.c.max_attempts > max_attempts, runs.c.max_attempts), else_=max_attempts)

    def _claimable(self, max_attempts: Any) -> Any:
        now = db_now_ms()
        return and_(
            or_(
                and_(
                    # Two equalities, not IN: an IN list is expanded on every execution.
                    or_(runs.c.status == QUEUED, runs.c.status == RETRYING),
                    runs.c.available_at <= now,
                ),
                and_(runs.c.status == RUNNING, runs.c.lease_expires_at <= now),
            ),
            runs.c.attempt < self._attempt_ceiling(max_attempts),
            runs.c.cancel_requested_at.is_(None),
        )

    def _takeover_values(
        self, owner: Any, lease_ms: Any, max_attempts: Any, values: dict[str, Any]
    ) -> dict[str, Any]:
        now = db_now_ms()
        return {
            "status": RUNNING,
            "lease_owner": owner,
            # The claimer's delivery becomes the run's own: its id and message.
            "task_id": values["task_id"],
            "payload": values["payload"],
            "payload_content_type": values["payload_content_type"],
            "lease_ms": lease_ms,
            "lease_expires_at": now + lease_ms,
            "heartbeat_at": now,
            "attempt": runs.c.attempt + 1,
            "max_attempts": self._attempt_ceiling(max_attempts),
            "started_at": func.coalesce(runs.c.started_at, now),
            "finished_at": None,
            "updated_at": now,
        }

    def _insert_values(self, values: dict[str, Any], lease_ms: Any) -> dict[str, Any]:
        now = db_now_ms()
        return {
            **values,
            "lease_expires_at": now + lease_ms,
            "heartbeat_at": now,
            "available_at": now,
            "started_at": now,
            "created_at": now,
            "updated_at": now,
        }

    def _build_claim_upsert(self) -> Any:
        """``INSERT .. ON CONFLICT DO UPDATE .. WHERE claimable RETURNING`` (PG, SQLite)."""
        dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        lease_ms = bindparam("p_lease_ms", type_=Integer)
        max_attempts = bindparam("p_max_attempts", type_=Integer)
        values = {
            "id": bindparam("p_id", type_=String),
            "task_name": bindparam("p_task_name", type_=String),
            "status": RUNNING,
            "lease_owner": bindparam("p_owner", type_=String),
            "lease_ms": lease_ms,
            "attempt": 1,
            "max_attempts": max_attempts,
            "concurrency_key": bindparam("p_concurrency_key", type_=String),
            "task_id": bindparam("p_task_id", type_=String),
            "payload": bindparam("p_payload", type_=PayloadType),
            "payload_content_type": bindparam("p_payload_content_type", type_=String),
        }
        return (
            dialect_insert(runs)
            .values(self._insert_values(values, lease_ms))
            .on_conflict_do_update(
                index_elements=[runs.c.id],
                set_=self._takeover_values(values["lease_owner"], lease_ms, max_attempts, values),
                where=self._claimable(max_attempts),
            )
            .returning(runs.c.attempt, runs.c.lease_expires_at, runs.c.max_attempts)
        )

    def _claim_upsert(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> tuple[int, int, int] | None:
        """Run the prebuilt claim upsert; the new attempt and expiry, or None."""
        params = {
            "p_id": values["id"],
            "p_task_name": values["task_name"],
            "p_owner": values["lease_owner"],
            "p_lease_ms": lease_ms,
            "p_max_attempts": max_attempts,
            "p_concurrency_key": values["concurrency_key"],
            "p_task_id": values["task_id"],
            "p_payload": values["payload"],
            "p_payload_content_type": values["payload_content_type"],
        }
        if conn is not None:
            row = conn.execute(self._claim_stmt, params).first()
        elif self._claim_driver is not None:
            row = self._claim_driver.execute(params)[1]
        else:
            with self._auto.connect() as auto:
                row = auto.execute(self._claim_stmt, params).first()
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]))

    def _claim_limited(
        self, values: dict[str, Any], lease_ms: int, max_attempts: int, limit: int
    ) -> ClaimResult | tuple[int, int, int] | None:
        """Claim under a per-key lock, only while fewer than ``limit`` live leases share the key.

        The count and the claim run in one transaction, under the dialect's
        key lock (:class:`_KeyLock`): PostgreSQL a transaction-scoped advisory
        try-lock, SQLite the write lock of ``BEGIN IMMEDIATE``, MySQL the count
        as a locking read.
        """
        key = values["concurrency_key"]
        now = db_now_ms()
        with self.engine.begin() as conn:
            if not self._key_lock.acquire(conn, key):
                return ClaimResult(
                    "busy",
                    values["id"],
                    values["lease_owner"],
                    0,
                    RUNNING,
                    0.5,
                    reason="concurrency",
                )
            live = conn.execute(
                self._key_lock.count_live(
                    select(func.count(), func.min(runs.c.lease_expires_at - now)).where(
                        runs.c.concurrency_key == key,
                        runs.c.status == RUNNING,
                        runs.c.lease_expires_at > now,
                        runs.c.id != values["id"],
                    )
                )
            ).one()
            if int(live[0]) >= limit:
                left_ms = max(0, int(live[1] or 0))
                self._record_waiting(conn, values, left_ms)
                left = left_ms / 1000.0
                return ClaimResult(
                    "busy",
                    values["id"],
                    values["lease_owner"],
                    0,
                    RUNNING,
                    left,
                    reason="concurrency",
                )
            if self._upsert:
                return self._claim_upsert(values, lease_ms, max_attempts, conn)
            return self._claim_locked(conn, values, lease_ms, max_attempts)

    def _record_waiting(self, conn: Connection, values: dict[str, Any], wait_ms: int) -> None:
        """Record a run waiting for a concurrency slot as ``queued`` (with its arguments).

        If its re-published delivery is lost, the sweeper finds the row stranded
        after ``available_at`` (the latest a slot must free) and re-enqueues it.
        """
        now = db_now_ms()
        waiting = {
            **values,
            "status": QUEUED,
            "lease_owner": None,
            "attempt": 0,
            "available_at": now + wait_ms,
            "created_at": now,
            "updated_at": now,
        }
        bump = {"available_at": now + wait_ms, "updated_at": now}
        if self._upsert:
            dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
            conn.execute(
                dialect_insert(runs)
                .values(waiting)
                .on_conflict_do_update(
                    index_elements=[runs.c.id], set_=bump, where=runs.c.status == QUEUED
                )
            )
            return
        changed = conn.execute(
            update(runs).where(runs.c.id == values["id"], runs.c.status == QUEUED).values(bump)
        ).rowcount
        exists = conn.execute(select(runs.c.id).where(runs.c.id == values["id"])).first()
        if not changed and exists is None:
            conn.execute(insert(runs).values(waiting))

    def _claim_locked(
        self, conn: Connection, values: dict[str, Any], lease_ms: int, max_attempts: int
    ) -> tuple[int, int, int] | None:
        """The same claim with a row lock, inside the caller's transaction (MySQL).

        Concurrent first claims of one id can deadlock (both hold the gap lock
        of the missing row) or collide on the insert; both errors propagate to
        :meth:`claim`, which retries them as contention.
        """
        current = conn.execute(
            select(runs.c.attempt).where(runs.c.id == values["id"]).with_for_update()
        ).first()
        if current is None:
            conn.execute(insert(runs).values(self._insert_values(values, lease_ms)))
            attempt = 1
        else:
            changed = conn.execute(
                update(runs)
                .where(runs.c.id == values["id"], self._claimable(max_attempts))
                .values(
                    self._takeover_values(values["lease_owner"], lease_ms, max_attempts, values)
                )
            ).rowcount
            if changed != 1:
                return None
            attempt = int(current[0]) + 1
        expires, ceiling = conn.execute(
            select(runs.c.lease_expires_at, runs.c.max_attempts).where(runs.c.id == values["id"])
        ).one()
        return attempt, int(expires), int(ceiling)

    def _claim_refused(self, run_id: str, owner: str, max_attempts: int) -> ClaimResult:
        """Why a claim changed nothing; ends runs that can never be claimed again."""
        for _ in range(5):
            now = db_now_ms()
            with self._auto.connect() as conn:
                row = conn.execute(
                    select(
                        runs.c.status,
                        runs.c.attempt,
                        runs.c.cancel_requested_at,
                        runs.c.lease_expires_at - now,
                        runs.c.available_at - now,
                        runs.c.task_id,
                        runs.c.max_attempts,
                    ).where(runs.c.id == run_id)
                ).first()
            if row is None:
                return ClaimResult("busy", run_id, owner, 0, QUEUED, 0.0)
            status, attempt, cancel_requested, lease_left, available_left, task_id, ceiling = row
            max_attempts = max(max_attempts, int(ceiling))
            if status in TERMINAL_STATUSES:
                return ClaimResult("finished", run_id, owner, attempt, status, task_id=task_id)
            wait_ms = lease_left if status == RUNNING else available_left
            claimable = wait_ms is None or wait_ms <= 0
            if claimable and cancel_requested is not None:
                if self._end_unclaimable(run_id, status, attempt, CANCELLED, "cancelled", None):
                    return ClaimResult(
                        "finished", run_id, owner, attempt, CANCELLED, task_id=task_id
                    )
                continue
            if claimable and attempt >= max_attempts:
                code = "lease_expired" if status == RUNNING else "attempts_exhausted"
                error = f"attempts exhausted: {attempt} of {max_attempts} used"
                if self._end_unclaimable(run_id, status, attempt, FAILED, code, error):
                    return ClaimResult("finished", run_id, owner, attempt, FAILED, task_id=task_id)
                continue
            if claimable:
                # It became claimable between our two statements: try again soon.
                return ClaimResult("busy", run_id, owner, attempt, status, 0.0, reason="race")
            return ClaimResult(
                "busy",
                run_id,
                owner,
                attempt,
                status,
                max(0, wait_ms) / 1000.0,
                reason="lease" if status == RUNNING else "backoff",
            )
        return ClaimResult("busy", run_id, owner, 0, RUNNING, 0.0)

    def _end_unclaimable(
        self,
        run_id: str,
        status: str,
        attempt: int,
        new_status: str,
        failure_code: str,
        error: str | None,
    ) -> bool:
        """Move a run nobody may claim any more to a terminal status, if unchanged since read."""
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status == status, runs.c.attempt == attempt)
            .values(
                status=new_status,
                failure_code=failure_code,
                last_error=case((runs.c.last_error.is_(None), error), else_=runs.c.last_error)
                if error
                else runs.c.last_error,
                lease_expires_at=now,  # when it ended: `lease top` counts recent ends by it
                finished_at=now,
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def end_unclaimed(
        self, run_id: str, *, task_name: str, max_attempts: int, failure_code: str, error: str
    ) -> str:
        """End a run whose claim cannot succeed: ``failed`` with ``failure_code``.

        For a claim that failed on a database error (permanent, or transient
        with its retries spent). A run held by a live lease of another owner
        is left alone (that owner finishes it); a terminal run keeps its
        status; a run with no row gets a ``failed`` row without arguments.
        Returns the run's status afterwards.
        """
        now = db_now_ms()
        ended = {
            "status": FAILED,
            "failure_code": failure_code,
            "last_error": error,
            "lease_expires_at": now,
            "finished_at": now,
            "updated_at": now,
        }
        stmt = (
            update(runs)
            .where(
                runs.c.id == run_id,
                or_(
                    runs.c.status == QUEUED,
                    runs.c.status == RETRYING,
                    and_(runs.c.status == RUNNING, runs.c.lease_expires_at <= now),
                ),
            )
            .values(ended)
        )
        with self._auto.connect() as conn:
            if conn.execute(stmt).rowcount == 1:
                return FAILED
            status = conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar()
            if status is not None:
                return str(status)
            row = {
                "id": run_id,
                "task_name": task_name,
                "lease_ms": 1,
                "attempt": 0,
                "max_attempts": max_attempts,
                "available_at": now,
                "created_at": now,
                **ended,
            }
            try:
                conn.execute(insert(runs).values(row))
            except SQLAlchemyError as exc:
                if dberrors.classify(exc, self.dialect).cause != "duplicate_key":
                    raise
                return self.end_unclaimed(
                    run_id,
                    task_name=task_name,
                    max_attempts=max_attempts,
                    failure_code=failure_code,
                    error=error,
                )
        return FAILED

    # -- while running --------------------------------------------------------

    @_db_errors
    def heartbeat(self, leases: Iterable[LeaseKey]) -> HeartbeatResult:
        """Renew every given lease that is still held and unexpired, in one statement.

        Each renewed lease expires ``lease_ms`` after the database's now. A lease
        not renewed (taken over, expired, ended) is reported lost. Renewed leases
        whose run has a cancel request are reported in ``cancel_requested``.
        """
        keys = list(leases)
        if not keys:
            return HeartbeatResult(frozenset(), frozenset(), frozenset())
        now = db_now_ms()
        guard = and_(
            tuple_(runs.c.id, runs.c.lease_owner, runs.c.attempt).in_(keys),
            runs.c.status == RUNNING,
            runs.c.lease_expires_at > now,
        )
        renew = (
            update(runs)
            .where(guard)
            .values(lease_expires_at=now + runs.c.lease_ms, heartbeat_at=now, updated_at=now)
        )
        columns = (runs.c.id, runs.c.lease_owner, runs.c.attempt, runs.c.cancel_requested_at)
        if self._returning:
            with self._auto.connect() as conn:
                rows = conn.execute(renew.returning(*columns)).all()
        else:
            with self.engine.begin() as conn:
                conn.execute(renew)
                rows = conn.execute(select(*columns).where(guard)).all()
        renewed = frozenset((r[0], r[1], int(r[2])) for r in rows)
        cancel = frozenset((r[0], r[1], int(r[2])) for r in rows if r[3] is not None)
        lost = frozenset(keys) - renewed
        return HeartbeatResult(renewed, lost, cancel)

    @_db_errors
    def fence(
        self,
        connection: Connection,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        complete: bool = False,
    ) -> None:
        """Inside the caller's transaction, lock the run row and prove the lease is live.

        Raises :class:`LeaseLost` unless this owner and attempt hold an unexpired
        lease. The row stays locked until the caller's transaction ends, so a
        takeover cannot slip in before the caller's writes commit. With
        ``complete=True`` the run is also marked ``succeeded`` in that same
        transaction: the caller's writes and the completion commit together.
        """
        now = db_now_ms()
        values: dict[str, Any] = {"heartbeat_at": runs.c.heartbeat_at}
        if complete:
            values = self._success_values(now)
        stmt = (
            update(runs)
            .where(self._guarded(run_id, owner, attempt), runs.c.lease_expires_at > now)
            .values(**values)
        )
        if connection.execute(stmt).rowcount != 1:
            raise self._lost(run_id, owner, attempt, "fence refused")

    # -- outcomes -------------------------------------------------------------

    def _guarded(self, run_id: Any, owner: Any, attempt: Any) -> Any:
        return and_(
            runs.c.id == run_id,
            runs.c.lease_owner == owner,
            runs.c.attempt == attempt,
            runs.c.status == RUNNING,
        )

    def _guarded_update(
        self, run_id: str, owner: str, attempt: int, action: str, **values: Any
    ) -> None:
        stmt = update(runs).where(self._guarded(run_id, owner, attempt)).values(**values)
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, f"{action} refused")

    @staticmethod
    def _success_values(now: Any) -> dict[str, Any]:
        return {
            "status": SUCCEEDED,
            "lease_expires_at": now,
            "finished_at": now,
            "updated_at": now,
            "last_error": None,
            "failure_code": None,
            **_CLEARED_MESSAGE,
        }

    @_db_errors
    def complete(self, run_id: str, owner: str, attempt: int) -> None:
        """Record success; only the current owner of a running run can. Else :class:`LeaseLost`.

        Idempotent for its owner: if this owner and attempt already completed
        the run (``fence(complete=True)``, or a retry after a lost reply), it
        returns quietly.
        """
        params = {"p_id": run_id, "p_owner": owner, "p_attempt": attempt}
        if self._complete_driver is not None:
            if self._complete_driver.execute(params)[0] == 1:
                return
        else:
            with self._auto.connect() as conn:
                if conn.execute(self._complete_stmt, params).rowcount == 1:
                    return
        row = self.get(run_id)
        if row and row.status == SUCCEEDED and row.lease_owner == owner and row.attempt == attempt:
            return
        raise self._lost(run_id, owner, attempt, "complete refused")

    @_db_errors
    def fail(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        error: str,
        failure_code: str,
        retry_in: float | None,
        message: tuple[bytes, str] | None = None,
    ) -> str:
        """Record a failed attempt: ``retrying`` after ``retry_in`` s, or ``failed`` when None.

        Guarded like :meth:`complete`. Returns the new status. ``message``
        (payload, content type) replaces the stored message of a retrying run,
        e.g. with the retry Celery published; a failed run keeps its message for
        ``lease rerun``.
        """
        now = db_now_ms()
        status = FAILED if retry_in is None else RETRYING
        values: dict[str, Any] = {
            "status": status,
            "last_error": error,
            "failure_code": failure_code,
            "updated_at": now,
        }
        values["lease_expires_at"] = now
        if retry_in is None:
            values.update(finished_at=now)
        else:
            values["available_at"] = now + round(retry_in * 1000)
            if message is not None:
                values.update(payload=message[0], payload_content_type=message[1])
        self._guarded_update(run_id, owner, attempt, "fail", **values)
        return status

    @_db_errors
    def release(self, run_id: str, owner: str, attempt: int, *, available_in: float = 0.0) -> None:
        """Hand a held lease back: ``retrying``, claimable after ``available_in`` s."""
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "release",
            status=RETRYING,
            available_at=now + round(available_in * 1000),
            lease_expires_at=now,
            updated_at=now,
        )

    @_db_errors
    def end(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        status: str,
        failure_code: str,
        error: str | None = None,
    ) -> None:
        """End a held run in the terminal ``status`` the body chose (Ignore, Reject, replace).

        Guarded like :meth:`complete`. No sweep publishes a terminal run again; its
        stored message is cleared when it succeeded (replace), kept for ``lease rerun``
        otherwise.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"end() takes a terminal status, not {status!r}")
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "end",
            status=status,
            failure_code=failure_code,
            last_error=error,
            lease_expires_at=now,
            finished_at=now,
            updated_at=now,
            **(_CLEARED_MESSAGE if status == SUCCEEDED else {}),
        )

    @_db_errors
    def refuse_message(
        self, record: RunRecord, failure_code: str, error: str, *, status: str = FAILED
    ) -> bool:
        """End a waiting run whose stored message must not be published again.

        ``failed`` (or ``cancelled`` for an expired message). Guarded on the status
        and attempt the sweeper read, so a run claimed meanwhile is left alone.
        True when this call ended it.
        """
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(
                runs.c.id == record.id,
                runs.c.attempt == record.attempt,
                or_(runs.c.status == QUEUED, runs.c.status == RETRYING),
            )
            .values(
                status=status,
                failure_code=failure_code,
                last_error=error,
                lease_expires_at=now,
                finished_at=now,
                updated_at=now,
                **_CLEARED_MESSAGE,
            )
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def mark_cancelled(self, run_id: str, owner: str, attempt: int) -> None:
        """End a held run as ``cancelled`` after its worker honoured a cancel request."""
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "cancel",
            status=CANCELLED,
            failure_code="cancelled",
            lease_expires_at=now,
            finished_at=now,
            updated_at=now,
        )

    # -- recovery -------------------------------------------------------------

    @_db_errors
    def keep_delivery(
        self,
        run_id: str,
        *,
        task_name: str,
        task_id: str,
        payload: bytes,
        payload_content_type: str,
        lease_ms: int,
        max_attempts: int,
        available_in: float = 0.0,
        concurrency_key: str | None = None,
    ) -> bool:
        """Leave a delivery the broker refused to the sweeper; True when a sweep will send it.

        No row: a ``queued`` row (attempt 0) carrying the message and ``task_id``,
        available after ``available_in`` s, which :meth:`reclaim_stale` finds.
        A row that is not terminal and whose own delivery is this one (or that
        has no stored message, which it then takes) is left as it is:
        ``queued``/``retrying`` rows are reclaimed, a ``running`` one ends or is
        handed back by :meth:`sweep_expired`. A terminal row, or one whose own
        delivery has another task id, cannot carry this delivery: False.
        """
        now = db_now_ms()
        waiting = {
            "id": run_id,
            "task_name": task_name,
            "status": QUEUED,
            "lease_owner": None,
            "lease_ms": lease_ms,
            "attempt": 0,
            "max_attempts": max_attempts,
            "available_at": now + round(max(0.0, available_in) * 1000),
            "concurrency_key": concurrency_key,
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
            "created_at": now,
            "updated_at": now,
        }
        adopt = runs.c.payload.is_(None)
        keeps = and_(
            runs.c.status.not_in(sorted(TERMINAL_STATUSES)),
            or_(adopt, func.coalesce(runs.c.task_id, runs.c.id) == task_id),
        )
        if self._upsert:
            dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
            insert_stmt = dialect_insert(runs).values(waiting)
            excluded = insert_stmt.excluded
            stmt = insert_stmt.on_conflict_do_update(
                index_elements=[runs.c.id],
                set_={
                    "task_id": case((adopt, excluded.task_id), else_=runs.c.task_id),
                    "payload": func.coalesce(runs.c.payload, excluded.payload),
                    "payload_content_type": case(
                        (adopt, excluded.payload_content_type),
                        else_=runs.c.payload_content_type,
                    ),
                },
                where=keeps,
            ).returning(runs.c.id)
            with self._auto.connect() as conn:
                return conn.execute(stmt).first() is not None
        # MySQL: no upsert with a condition; the same in one short locked transaction.
        # A claim inserting the row meanwhile makes it fail (a duplicate key or a
        # deadlock): the caller then treats the delivery as not kept.
        adopted = {
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
        }
        with self.engine.begin() as conn:
            found = conn.execute(
                select(runs.c.id).where(runs.c.id == run_id).with_for_update()
            ).first()
            if found is None:
                conn.execute(insert(runs).values(waiting))
                return True
            conn.execute(update(runs).where(runs.c.id == run_id, adopt, keeps).values(adopted))
            kept = conn.execute(select(runs.c.id).where(runs.c.id == run_id, keeps)).first()
            return kept is not None

    @_db_errors
    def sweep_expired(self, limit: int = 500) -> list[tuple[RunRecord, str]]:
        """End or hand back running runs whose lease expired (DB clock), at most ``limit``.

        Each row moves, by a statement guarded on owner, attempt, status and the
        expiry, to ``retrying`` (available now), or ``failed`` with
        ``lease_expired`` when attempts are spent, or ``cancelled`` when a cancel
        was requested. Only rows this call moved are returned, so two sweepers
        never both act on the same expired lease. On PostgreSQL and MySQL the
        rows are read ``FOR UPDATE SKIP LOCKED``: a row locked by a stalled
        transaction is skipped this time, never waited for.
        """
        # A scalar subquery is an index bound; the volatile clock itself would be
        # a filter evaluated on every running row.
        now = select(db_now_ms()).scalar_subquery()
        query = (
            select(runs)
            .where(runs.c.status == RUNNING, runs.c.lease_expires_at <= now)
            .order_by(runs.c.lease_expires_at)
            .limit(limit)
        )
        if self.dialect != "sqlite":
            query = query.with_for_update(skip_locked=True)
        moved: list[tuple[RunRecord, str]] = []
        with self.engine.begin() as conn:
            for row in conn.execute(query).mappings().all():
                record = RunRecord(**dict(row))
                status = self._sweep_one(record, conn)
                if status is not None:
                    moved.append((record, status))
        return moved

    def _sweep_one(self, record: RunRecord, conn: Connection | None = None) -> str | None:
        """The guarded transition of one expired lease; None if it changed meanwhile."""
        now = db_now_ms()
        values: dict[str, Any] = {"updated_at": now, "lease_expires_at": now}
        if record.cancel_requested_at is not None:
            status = CANCELLED
            values.update(failure_code="cancelled", finished_at=now)
        elif record.attempt >= record.max_attempts:
            status = FAILED
            values.update(
                failure_code="lease_expired",
                last_error=f"lease expired on attempt {record.attempt} of {record.max_attempts}"
                " (worker lost or stalled)",
                finished_at=now,
            )
        else:
            status = RETRYING
            values.update(
                available_at=now,
                failure_code="lease_expired",
                last_error=f"lease expired on attempt {record.attempt} (worker lost or stalled)",
            )
        stmt = (
            update(runs)
            .where(
                runs.c.id == record.id,
                runs.c.lease_owner == record.lease_owner,
                runs.c.attempt == record.attempt,
                runs.c.status == RUNNING,
                runs.c.lease_expires_at <= now,
            )
            .values(status=status, **values)
        )
        if conn is not None:
            return status if conn.execute(stmt).rowcount == 1 else None
        with self._auto.connect() as auto:
            return status if auto.execute(stmt).rowcount == 1 else None

    @_db_errors
    def reclaim_stale(self, older_than: float, limit: int = 500) -> list[RunRecord]:
        """Queued/retrying runs available for ``older_than`` s yet never claimed.

        Their delivery was most likely lost (a broker that does not redeliver, a
        failed publish). Each returned row had ``available_at`` moved to now by
        a guarded statement, so concurrent sweepers return disjoint rows.
        """
        now = db_now_ms()
        with self._auto.connect() as conn:
            rows = (
                conn.execute(
                    select(runs)
                    .where(
                        runs.c.status.in_((QUEUED, RETRYING)),
                        runs.c.available_at <= now - round(older_than * 1000),
                        runs.c.cancel_requested_at.is_(None),
                        # No message: a direct call or eager apply(); never sent to workers.
                        runs.c.payload.is_not(None),
                    )
                    .order_by(runs.c.available_at)
                    .limit(limit)
                )
                .mappings()
                .all()
            )
            taken: list[RunRecord] = []
            for row in rows:
                record = RunRecord(**dict(row))
                stmt = (
                    update(runs)
                    .where(
                        runs.c.id == record.id,
                        runs.c.status == record.status,
                        runs.c.attempt == record.attempt,
                        runs.c.available_at == record.available_at,
                    )
                    .values(available_at=db_now_ms(), updated_at=db_now_ms())
                )
                if conn.execute(stmt).rowcount == 1:
                    taken.append(record)
        return taken

    @_db_errors
    def release_owned_by(self, worker_id: str) -> list[RunRecord]:
        """Hand back every running lease taken by the worker whose id is ``worker_id``.

        Used on a worker's cold shutdown. Owners taken inside a worker end in
        ``.<worker id>`` (a random id per worker, see ``celery_lease.app.worker_id``),
        so another worker is never touched, even one with the same node name.
        Each release is guarded like :meth:`release`; the released rows are returned.
        """
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        with self._auto.connect() as conn:
            rows = (
                conn.execute(
                    select(runs).where(
                        runs.c.status == RUNNING,
                        runs.c.lease_owner.endswith(f".{worker_id}", autoescape=True),
                    )
                )
                .mappings()
                .all()
            )
        released: list[RunRecord] = []
        for row in rows:
            record = RunRecord(**dict(row))
            try:
                self.release(record.id, str(record.lease_owner), record.attempt)
            except LeaseLost:
                continue
            released.append(record)
        return released

    # -- control --------------------------------------------------------------

    @_db_errors
    def expire(self, run_id: str) -> bool:
        """End a running run's lease now, so another worker may take it over.

        For operators and tests of the lease-lost path. Returns True when a
        running lease was expired.
        """
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status == RUNNING)
            .values(lease_expires_at=now, updated_at=now)
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def cancel(self, run_id: str, *, task_id: str | None = None) -> str:
        """Cancel a run: queued/retrying end ``cancelled`` at once; running get a request.

        Returns the resulting status (``cancelled``, or ``running`` with
        ``cancel_requested_at`` set, or the status it has when nothing changed).
        With ``task_id``, only a run whose own delivery has that Celery task id
        is touched (a revoked duplicate never cancels the run it duplicates).
        Raises :class:`RunNotFound` for an unknown id.
        """
        now = db_now_ms()
        own = (
            runs.c.id == run_id
            if task_id is None
            else and_(runs.c.id == run_id, runs.c.task_id == task_id)
        )
        at_once = (
            update(runs)
            .where(own, runs.c.status.in_((QUEUED, RETRYING)))
            .values(
                status=CANCELLED,
                failure_code="cancelled",
                cancel_requested_at=now,
                lease_expires_at=now,  # when it ended: `lease top` counts recent ends by it
                finished_at=now,
                updated_at=now,
            )
        )
        request = (
            update(runs)
            .where(own, runs.c.status == RUNNING)
            .values(
                cancel_requested_at=func.coalesce(runs.c.cancel_requested_at, now),
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            if conn.execute(at_once).rowcount == 1:
                return CANCELLED
            if conn.execute(request).rowcount == 1:
                return RUNNING
            row = conn.execute(
                select(runs.c.status, runs.c.task_id).where(runs.c.id == run_id)
            ).first()
        if row is None:
            raise RunNotFound(run_id)
        status, own_task_id = row
        if status not in TERMINAL_STATUSES and (task_id is None or own_task_id == task_id):
            return self.cancel(run_id, task_id=task_id)  # it changed status between statements
        return str(status)

    # -- retention ------------------------------------------------------------

    @staticmethod
    def _purgeable(status: str, older_than_ms: int) -> Any:
        """Rows of finished ``status`` that finished more than ``older_than_ms`` ago (DB clock)."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"only finished runs can be purged, not {status!r} ones")
        if older_than_ms < 0:
            raise ValueError(f"older_than_ms must be >= 0, got {older_than_ms}")
        # A scalar subquery, evaluated once: an index bound (clock_timestamp() is
        # volatile, so PostgreSQL would filter every row of the status instead).
        cutoff = select(db_now_ms() - older_than_ms).scalar_subquery()
        return and_(runs.c.status == status, runs.c.finished_at < cutoff)

    @_db_errors
    def purge_finished(self, status: str, older_than_ms: int, limit: int = PURGE_BATCH) -> int:
        """Delete the oldest ``limit`` rows of ``status`` finished over ``older_than_ms`` ago.

        Only terminal rows (``succeeded``, ``failed``, ``cancelled``) are ever
        touched. One short transaction, in the order of the
        ``(status, finished_at)`` index; on PostgreSQL and MySQL the rows are
        picked ``FOR UPDATE SKIP LOCKED``, so a concurrent purge or a locked row
        is skipped, never waited for. Returns how many rows were deleted.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        purgeable = self._purgeable(status, older_than_ms)
        oldest = (
            select(runs.c.id)
            .where(purgeable)
            .order_by(runs.c.finished_at)
            .limit(limit)
            .with_for_update(skip_locked=True)  # SQLite compiles no FOR UPDATE
        )
        if self.dialect not in ("mysql", "mariadb"):
            # The rows are locked (PostgreSQL) or the writer is alone (SQLite) and
            # were picked by the guard: no second filter. PostgreSQL gets
            # id = ANY(ARRAY(...)), an index condition on the primary key; with
            # IN (...) its planner may hash-join against a scan of the table.
            picked: Any = (
                runs.c.id == func.any(func.array(oldest.scalar_subquery()))
                if self.dialect == "postgresql"
                else runs.c.id.in_(oldest)
            )
            with self._auto.connect() as conn:
                return int(conn.execute(delete(runs).where(picked)).rowcount)
        # MySQL refuses LIMIT in an IN subquery: pick, then delete, in one transaction.
        with self.engine.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if not ids:
                return 0
            return int(conn.execute(delete(runs).where(runs.c.id.in_(ids), purgeable)).rowcount)

    @_db_errors
    def count_finished(self, status: str, older_than_ms: int) -> int:
        """How many rows :meth:`purge_finished` would delete now, by index; read only."""
        stmt = select(func.count()).select_from(runs).where(self._purgeable(status, older_than_ms))
        with self._auto.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    # -- reads ----------------------------------------------------------------

    @_db_errors
    def get(self, run_id: str) -> RunRecord | None:
        """The run row, or None."""
        with self._auto.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.id == run_id)).mappings().first()
        return None if row is None else RunRecord(**dict(row))

    @_db_errors
    def now_ms(self) -> int:
        """The database clock, in epoch milliseconds."""
        with self._auto.connect() as conn:
            return int(conn.execute(select(db_now_ms())).scalar_one())

    def _lost(self, run_id: str, owner: str, attempt: int, action: str) -> LeaseLost:
        """A :class:`LeaseLost` whose reason says what the row holds now (failure path only)."""
        try:
            row = self.get(run_id)
        except Exception:  # the diagnosis must never hide the lease loss itself
            row = None
        if row is None:
            reason = f"{action}: run row not found"
        elif row.attempt != attempt or row.lease_owner != owner:
            reason = f"{action}: taken over by attempt {row.attempt} (status {row.status})"
        else:
            reason = f"{action}: run is {row.status}"
        return LeaseLost(run_id, owner, attempt, reason)

    # -- operator reads (CLI) --

    @_db_errors
    def list_runs(
        self, *, status: str | None = None, task_name: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        """Up to ``limit`` runs, newest first, filtered by status and task name; read only."""
        stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id).limit(max(0, limit))
        if status is not None:
            stmt = stmt.where(runs.c.status == status)
        if task_name is not None:
            stmt = stmt.where(runs.c.task_name == task_name)
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
    def stats(self, *, window_ms: int = 3_600_000) -> dict[str, Any]:
        """Per-status counts, live and expired leases, oldest running run, recent expiries.

        Read only, four statements (not one snapshot), each answered from the
        ``(status, ...)`` indexes: the counts from the status index alone, the
        rest from live rows and recently failed ones, never the whole table's
        rows. Keys: ``now`` (DB clock,
        epoch ms), ``counts`` (status -> rows), ``live_leases`` (running, lease
        unexpired), ``expired_leases`` (running, lease expired: awaiting takeover
        or the sweeper), ``oldest_running`` (a :class:`RunRecord` or None),
        ``lease_expired_recent`` (rows with ``failure_code = 'lease_expired'``
        updated within ``window_ms``; a finished row is last updated when it finished).
        """
        now = db_now_ms()
        running = runs.c.status == RUNNING
        per_status = select(runs.c.status, func.count()).group_by(runs.c.status)
        leases = select(
            func.sum(case((runs.c.lease_expires_at > now, 1), else_=0)),
            func.sum(case((runs.c.lease_expires_at <= now, 1), else_=0)),
        ).where(running)
        oldest = (
            select(runs)
            .where(running)
            .order_by(runs.c.started_at.is_(None), runs.c.started_at, runs.c.id)
            .limit(1)
        )
        # A scalar subquery is an index bound (a volatile clock is not); only
        # live rows and runs that failed within the window can carry the code.
        since = select(now - window_ms).scalar_subquery()
        recent = select(now, func.count()).where(
            runs.c.failure_code == "lease_expired",
            or_(
                and_(
                    runs.c.status.in_((QUEUED, RUNNING, RETRYING)),
                    runs.c.updated_at >= since,
                ),
                and_(runs.c.status == FAILED, runs.c.finished_at >= since),
            ),
        )
        with self._auto.connect() as conn:
            grouped = conn.execute(per_status).all()
            live, expired = conn.execute(leases).one()
            oldest_row = conn.execute(oldest).mappings().first()
            db_now, expired_recent = conn.execute(recent).one()
        return {
            "now": int(db_now),
            "counts": {str(r[0]): int(r[1]) for r in grouped},
            "live_leases": int(live or 0),
            "expired_leases": int(expired or 0),
            "oldest_running": None if oldest_row is None else RunRecord(**dict(oldest_row)),
            "lease_expired_recent": int(expired_recent),
        }

    # -- operator: rerun and top (CLI) --

    @_db_errors
    def rerun(self, run_id: str, *, attempts: int, force: bool = False) -> RunRecord:
        """Put a ``failed``/``cancelled`` run (``succeeded`` too with ``force``) back to ``queued``.

        One guarded UPDATE (``WHERE status IN (...)``), so a run a worker holds
        or has queued is never touched. The run gets ``attempts`` fresh attempts
        without lowering ``attempt``, the fencing token: ``max_attempts`` becomes
        ``attempt + attempts``. Owner, lease, cancel request, failure and times
        of the ended series are cleared; the stored message (if any) and the
        run's own ``task_id`` are kept. Returns the row as it is now. Raises
        :class:`RunNotFound`, or :class:`RunNotRerunnable` with the status found.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        allowed = [FAILED, CANCELLED] + ([SUCCEEDED] if force else [])
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status.in_(allowed))
            .values(
                status=QUEUED,
                max_attempts=runs.c.attempt + attempts,
                lease_owner=None,
                lease_expires_at=None,
                heartbeat_at=None,
                available_at=now,
                cancel_requested_at=None,
                started_at=None,
                finished_at=None,
                last_error=None,
                failure_code=None,
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        record = self.get(run_id)
        if record is None:
            raise RunNotFound(run_id)
        if changed != 1:
            raise RunNotRerunnable(run_id, record.status)
        return record

    @_db_errors
    def live_leases(self, limit: int = 50) -> list[RunRecord]:
        """Up to ``limit`` running runs, soonest lease expiry first; read only.

        An index range on ``(status, lease_expires_at)``: the expired leases
        (awaiting takeover or the sweeper) come first.
        """
        stmt = (
            select(runs)
            .where(runs.c.status == RUNNING)
            .order_by(runs.c.lease_expires_at, runs.c.id)
            .limit(max(0, limit))
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
    def activity(self, now: int, window_ms: int = 60_000) -> Activity:
        """Counts of live runs per status, and of the runs that ended or went
        ``retrying`` within ``window_ms`` before ``now``; one read-only statement.

        ``now`` is the database clock (:meth:`now_ms`), passed as a value: the
        planner then sees the window's bound and reads only index ranges on
        ``(status, lease_expires_at)``, never the whole table (a bound computed
        in the statement from the volatile clock hides its selectivity, and
        PostgreSQL scans the table). Read: every live row, plus the terminal and
        ``retrying`` rows whose lease ended inside the window (each end of an
        attempt sets ``lease_expires_at`` to that moment).
        """
        since = now - window_ms
        live = (QUEUED, RUNNING, RETRYING)
        recent = runs.c.lease_expires_at >= since
        stmt = (
            select(
                runs.c.status,
                func.count(),
                func.sum(case((recent, 1), else_=0)),
                func.sum(case((runs.c.attempt > 1, 1), else_=0)),
                func.sum(case((runs.c.lease_expires_at <= now, 1), else_=0)),
            )
            .where(
                or_(
                    runs.c.status.in_(live),
                    and_(runs.c.status.in_(sorted(TERMINAL_STATUSES)), recent),
                )
            )
            .group_by(runs.c.status)
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).all()
        counts = {str(r[0]): int(r[1]) for r in rows if r[0] in live}
        ended = {str(r[0]): int(r[1]) for r in rows if r[0] not in live}
        by_status = {str(r[0]): r for r in rows}
        retrying = by_status.get(RETRYING)
        running = by_status.get(RUNNING)
        return Activity(
            now=now,
            window_ms=window_ms,
            counts={status: counts.get(status, 0) for status in live},
            ended_recently={status: ended.get(status, 0) for status in sorted(TERMINAL_STATUSES)},
            retried_recently=0 if retrying is None else int(retrying[2] or 0),
            running_retries=0 if running is None else int(running[3] or 0),
            expired_leases=0 if running is None else int(running[4] or 0),
        )


class RunNotRerunnable(LeaseError):
    """``celery lease rerun`` refused: the run is live, or succeeded without ``force``."""

    code = "run_not_rerunnable"

    def __init__(self, run_id: str, status: str) -> None:
        self.run_id = run_id
        self.status = status
        super().__init__(f"{self.code}: run {run_id!r} is {status}")

    def __reduce__(self) -> tuple[type[RunNotRerunnable], tuple[str, str]]:
        return (type(self), (self.run_id, self.status))


@dataclasses.dataclass(frozen=True)
class Activity:
    """What :meth:`LeaseStore.activity` counted; times are epoch ms (DB clock).

    ``counts``: live runs per status (queued, running, retrying).
    ``ended_recently``: runs that ended within the window, per terminal status.
    ``retried_recently``: runs that went ``retrying`` within the window and
    wait for their next claim (a retry claimed again already is running).
    ``running_retries``: running runs past their first attempt.
    ``expired_leases``: running runs whose lease has expired.
    """

    now: int
    window_ms: int
    counts: dict[str, int]
    ended_recently: dict[str, int]
    retried_recently: int
    running_retries: int
    expired_leases: int
