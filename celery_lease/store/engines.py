"""One lease database as every store object reaches it: :class:`Engines`.

The store is split by who uses it (the lease protocol, flow control, the
operators' reads); each part is an object of its own over the same database,
and each takes this one object: the engines, the database's class and the
wait bounds. :func:`db_errors` turns a store method's SQLAlchemy errors into
:class:`~celery_lease.errors.LeaseDatabaseError`, classified by that class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from .bounds import DEFAULT_BOUNDS, WaitBounds
from .database import Database
from .databases import backend_of, database_for
from .driver import DriverStatement, held_for

F = TypeVar("F", bound=Callable[..., Any])


class Engines:
    """A lease database's engines, its :class:`~celery_lease.store.database.Database`
    object and its wait bounds.

    Single statements run in autocommit mode (one round trip each) through
    :meth:`connect`; the few read-then-write paths run in one short transaction
    through :meth:`begin`.

    Attributes:
        engine: the engine for transactions.
        auto: the engine single statements run on (autocommit).
        raw: whether the hot path may run statements at the driver level
            (:class:`~celery_lease.store.driver.DriverStatement`).
        database: what differs on this database.
        dialect: SQLAlchemy's dialect name.
        bounds: the wait bounds the engines were made with.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        autocommit_engine: Engine | None = None,
        bounds: WaitBounds = DEFAULT_BOUNDS,
    ) -> None:
        """Use ``engine`` for transactions and ``autocommit_engine`` for single statements.

        Without ``autocommit_engine``, single statements borrow ``engine``'s pool
        in autocommit mode (each check-in then resets the isolation level). On
        SQLite they borrow it as it is: pysqlite's own transaction handling is
        off on these connections, so a statement outside ``BEGIN`` commits by
        itself, with no isolation-level switch.
        """
        self.engine = engine
        self.dialect = engine.dialect.name
        self.database: Database = database_for(self.dialect)
        self.bounds = bounds
        self._own_auto = autocommit_engine
        self.auto, self.raw = self.database.single_statements(engine, bounds, autocommit_engine)

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float | None = None, **engine_kwargs: Any
    ) -> Engines:
        """New engines for ``url``, their waits bounded for ``lease_seconds``.

        On servers, single statements get an engine of their own whose
        connections stay in autocommit mode (no reset per check-out); SQLite
        shares one pool. Without ``lease_seconds`` the bounds are those of the
        default 30 s lease.

        Raises:
            LeaseDatabaseError: SQLAlchemy could not make an engine (a malformed
                URL, an unknown dialect) or reach the database while setting it
                up; the SQLAlchemy error is ``__cause__``.
        """
        bounds = DEFAULT_BOUNDS if lease_seconds is None else WaitBounds.for_lease(lease_seconds)
        backend = backend_of(url)
        database = database_for(backend)
        try:
            engine, auto = database.open(url, bounds, **engine_kwargs)
            return cls(engine, autocommit_engine=auto, bounds=bounds)
        except SQLAlchemyError as exc:
            raise database.wrap(exc, backend) from exc

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine statements run on (for instrumentation)."""
        return (self.engine,) if self._own_auto is None else (self.engine, self._own_auto)

    def connect(self) -> AbstractContextManager[Connection]:
        """A connection for single statements, each committing by itself."""
        return self.auto.connect()

    def begin(self) -> AbstractContextManager[Connection]:
        """A connection inside one transaction, committed when the block ends without error."""
        return self.engine.begin()

    def begin_live(self) -> AbstractContextManager[Connection]:
        """:meth:`begin` for a caller's own block: on a connection known to be live
        (``Database.begin_live``), since the block cannot be replayed on another."""
        return self.database.begin_live(self.engine)

    def driver(self, statement: Any, *, returns_row: bool) -> DriverStatement | None:
        """``statement`` compiled once to run at the driver level, where the single-statement
        engine allows it (else None: run it through SQLAlchemy)."""
        if not self.raw:
            return None
        return self.database.driver_statement(self.auto, statement, returns_row=returns_row)

    def dispose(self) -> None:
        """Close every pooled connection, and the one the hot path keeps (SQLite)."""
        held = held_for(self.auto)
        if held is not None:
            held.close()
        for engine in self.engines:
            engine.dispose()

    def dispose_after_fork(self) -> None:
        """Drop pooled connections inherited from a parent process without closing them."""
        for engine in self.engines:
            engine.dispose(close=False)


class _OnEngines(Protocol):
    db: Engines


def db_errors(method: F) -> F:
    """Raise SQLAlchemy and driver errors of a store method as :class:`LeaseDatabaseError`.

    Classified by the store's database object (transient or permanent, and the
    cause); the driver's exception is kept as ``__cause__``.
    """

    @functools.wraps(method)
    def wrapper(self: _OnEngines, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise self.db.database.wrap(exc, self.db.dialect) from exc

    return cast(F, wrapper)
