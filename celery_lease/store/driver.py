"""The hot path's executor below SQLAlchemy, and the client-side wait bound."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import ConnectionPoolEntry

from ..events import Event

logger = logging.getLogger(__name__)


class _ClientWatchdog:
    """Cuts a checked-out connection that has waited longer than ``bound`` for the server.

    A partition that drops packets leaves a client blocked in a socket read
    that no server-side timeout can end, and the driver (libpq) has no read
    timeout. One daemon thread per process looks at the connections checked out
    of the engine's pool; one past its bound gets its socket shut down, so the
    blocked call fails at once with a disconnect error and SQLAlchemy discards
    the connection. The file descriptor is not closed here, so it cannot be
    reused under the driver's feet.

    Only waits for the server count: a connection is armed from its check-out
    (the hot path's statements run there, below SQLAlchemy) and around each
    statement, commit and rollback SQLAlchemy runs on it, and disarmed after
    each statement and at check-in. A caller's transaction left idle between
    its statements (``lease.transaction()`` around a provider call) is the
    caller's time, never cut.
    """

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self._pid = 0
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, int]] = {}

    def install(self, engine: Engine) -> None:
        """Arm at every pool check-out and before each statement, commit and rollback;
        disarm after each statement, at check-in and at invalidation."""
        event.listen(engine.pool, "checkout", self._arm)
        event.listen(engine.pool, "checkin", self._disarm)
        event.listen(engine.pool, "invalidate", self._disarm_invalid)
        event.listen(engine, "before_cursor_execute", self._arm_statement)
        event.listen(engine, "after_cursor_execute", self._disarm_statement)
        event.listen(engine, "commit", self._arm_connection)
        event.listen(engine, "rollback", self._arm_connection)

    @contextlib.contextmanager
    def guard(self, dbapi_connection: Any) -> Iterator[None]:
        """Bound the calls made on ``dbapi_connection`` inside this block."""
        self._arm_key(id(dbapi_connection), dbapi_connection)
        try:
            yield
        finally:
            self._disarm_key(id(dbapi_connection))

    def _arm(self, dbapi_connection: Any, record: ConnectionPoolEntry, proxy: Any) -> None:
        self._arm_key(id(dbapi_connection), dbapi_connection)

    def _disarm(self, dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        if dbapi_connection is not None:
            self._disarm_key(id(dbapi_connection))

    def _arm_connection(self, conn: Connection) -> None:
        dbapi_connection = _driver_connection(conn)
        if dbapi_connection is not None:
            self._arm_key(id(dbapi_connection), dbapi_connection)

    def _arm_statement(self, conn: Connection, *args: Any) -> None:
        self._arm_connection(conn)

    def _disarm_statement(self, conn: Connection, *args: Any) -> None:
        dbapi_connection = _driver_connection(conn)
        if dbapi_connection is not None:
            self._disarm_key(id(dbapi_connection))

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
            extra={"lease_event": Event.DB_WAIT_BOUND, "run_id": None},
        )
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()


def _driver_connection(conn: Connection) -> Any:
    """The DBAPI connection under ``conn``, or None once it is invalidated or closed:
    ``conn.connection`` would then try to reconnect, and inside a transaction raise
    (as in the rollback that follows a dropped connection)."""
    if conn.invalidated or conn.closed:
        return None
    return conn.connection.dbapi_connection


#: Execution option: the engine's hot-path statements run on one connection the first
#: thread to run one keeps checked out (:class:`HeldConnection`).
HOLD_CONNECTION = "celery_lease_hold_connection"


class HeldConnection:
    """One pooled connection kept checked out by the first thread to run a hot-path statement.

    On SQLite a pool check-out and check-in cost as much CPU as one of the two
    statements' own work outside the engine (about 10 µs a statement); the
    claim and the completion then run on a connection the task thread keeps
    (a prefork pool child has one such thread; in a threads pool the others
    check out of the pool as before, so the pool is short of one connection
    at most). Only for an embedded database: no server drops an idle
    connection, and no watchdog bounds a check-out. Each statement still
    commits by itself and closes its cursor, so the connection holds no lock
    between statements. The connection is given up when the engine's pool is
    replaced (``engine.dispose()``: closed; after a fork, in the child: kept
    unclosed, as ``dispose(close=False)`` keeps the parent's) or found dead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: Any = None
        self._pool: Any = None
        self._thread = 0
        self._pid = 0

    def take(self, engine: Engine) -> Any:
        """The held connection if this thread holds it or nobody does (then it takes one
        from ``engine``'s pool), else None: check out of the pool as usual."""
        raw = self._raw
        me = threading.get_ident()
        if (
            raw is not None
            and self._thread == me
            and self._pool is engine.pool
            and self._pid == os.getpid()
        ):
            return raw
        with self._lock:
            if self._raw is not None and (
                self._pool is not engine.pool or self._pid != os.getpid()
            ):
                self._give_up()
            if self._raw is None:
                self._raw = engine.raw_connection()
                self._pool, self._thread, self._pid = engine.pool, me, os.getpid()
                return self._raw
            return self._raw if self._thread == me else None

    def forget(self, raw: Any) -> None:
        """``raw`` was invalidated: the next statement takes a new connection."""
        with self._lock:
            if raw is self._raw:
                self._raw = None

    def close(self) -> None:
        """Give the connection up now (``Engines.dispose``): closed in this process, kept
        unclosed if a parent process took it."""
        with self._lock:
            if self._raw is not None:
                self._give_up()

    def _give_up(self) -> None:
        raw, self._raw = self._raw, None
        if self._pid != os.getpid():
            _INHERITED.append(raw)  # the parent's: never closed, never returned here
            return
        dbapi_connection = raw.dbapi_connection
        raw.detach()
        with contextlib.suppress(Exception):
            dbapi_connection.close()


#: Connections a forked child found held by its parent: referenced so that no garbage
#: collection returns them to a pool (and resets them) in the child.
_INHERITED: list[Any] = []
#: One :class:`HeldConnection` per engine that asks for it (``HOLD_CONNECTION``).
_HELD: weakref.WeakKeyDictionary[Engine, HeldConnection] = weakref.WeakKeyDictionary()
_HELD_LOCK = threading.Lock()


def held_for(engine: Engine) -> HeldConnection | None:
    """The :class:`HeldConnection` of ``engine`` if it asks for one (``HOLD_CONNECTION``)."""
    if not engine.get_execution_options().get(HOLD_CONNECTION):
        return None
    with _HELD_LOCK:
        held = _HELD.get(engine)
        if held is None:
            held = _HELD[engine] = HeldConnection()
        return held


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
    bounded cursor class, the pool's watchdog). On an engine with
    ``HOLD_CONNECTION`` (SQLite's) the calling thread may skip the pool
    (:class:`HeldConnection`).
    """

    def __init__(self, engine: Engine, statement: Any, *, returns_row: bool) -> None:
        dialect = engine.dialect
        compiled = statement.compile(dialect=dialect)
        if compiled.escaped_bind_names:
            raise ValueError("bind parameter names must not need escaping")
        self.engine = engine
        self.compiled = compiled
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
        self._held = held_for(engine)

    def _process(self, params: dict[str, Any]) -> dict[str, Any]:
        for name, process in self._processors.items():
            if name in params and params[name] is not None:
                params[name] = process(params[name])
        return params

    def execute(self, params: dict[str, Any]) -> tuple[int, Any]:
        """Run with ``params`` (by bind name); ``(rowcount, first row or None)``."""
        given = self._process(params)
        try:
            held = self._held.take(self.engine) if self._held is not None else None
            raw = held if held is not None else self.engine.raw_connection()
        except self._dbapi_error as exc:
            raise self._wrap(exc, given, invalidated=False) from exc
        try:
            return self._run(raw, given)
        except self._dbapi_error as exc:
            dead = self.engine.dialect.is_disconnect(
                exc,  # type: ignore[arg-type]
                raw.dbapi_connection,
                None,
            )
            if dead:
                raw.invalidate(exc)
                if held is not None and self._held is not None:
                    self._held.forget(held)
                    held = None
            raise self._wrap(exc, given, invalidated=dead) from exc
        finally:
            if held is None:
                raw.close()

    def _run(self, raw: Any, given: dict[str, Any]) -> tuple[int, Any]:
        """The statement on the pooled connection ``raw`` (a DBAPI cursor's execute), with
        the caller's parameters ``given`` (processed) over the statement's literal ones."""
        merged = {**self._defaults, **given}
        args: Any = merged if self._positions is None else [merged[n] for n in self._positions]
        cursor = raw.cursor()
        try:
            cursor.execute(self.sql, args)
            row = cursor.fetchone() if self.returns_row else None
            return int(cursor.rowcount), row
        finally:
            # The statement's own outcome (or error) is what counts.
            with contextlib.suppress(self._dbapi_error):
                cursor.close()

    def _wrap(self, exc: Exception, params: Any, *, invalidated: bool) -> Exception:
        return DBAPIError.instance(
            self.sql,
            params,
            exc,
            self._dbapi_error,
            hide_parameters=self.engine.hide_parameters,
            connection_invalidated=invalidated,
            dialect=self.engine.dialect,
        )
