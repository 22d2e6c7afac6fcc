"""The hot path's executor below SQLAlchemy, and the client-side wait bound."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, event
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
            extra={"lease_event": Event.DB_WAIT_BOUND, "run_id": None},
        )
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()


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
