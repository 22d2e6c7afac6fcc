"""The public :class:`LeaseStore`: engine set-up, composed of the statement parts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, bindparam, inspect, update
from sqlalchemy.exc import SQLAlchemyError

from .. import dberrors
from ..schema import db_now_ms, metadata, runs
from .admin import Control, OperatorReads
from .base import _db_errors
from .claim import Claims
from .dialects import dialect_for
from .driver import DriverStatement
from .engine import DEFAULT_BOUNDS, WaitBounds, create_lease_engine
from .recovery import Recovery


class LeaseStore(Claims, Recovery, Control, OperatorReads):
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
        self._ops = dialect_for(self.dialect)
        self._auto = autocommit_engine or self._ops.autocommit(engine, bounds)
        self._upsert = self._ops.upsert
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
        if self._ops.raw_autocommit or autocommit_engine is not None:
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

        Raises:
            LeaseDatabaseError: SQLAlchemy could not make an engine (a malformed
                URL, an unknown dialect) or reach the database while setting it
                up; the SQLAlchemy error is ``__cause__``.
        """
        bounds = DEFAULT_BOUNDS if lease_seconds is None else WaitBounds.for_lease(lease_seconds)
        try:
            engine = create_lease_engine(url, bounds=bounds, **engine_kwargs)
            if dialect_for(engine.dialect.name).raw_autocommit:
                return cls(engine, bounds=bounds)
            # Autocommit connections never hold a transaction: no reset on check-in.
            auto_kwargs = {"pool_reset_on_return": None, **engine_kwargs}
            auto = create_lease_engine(
                url, bounds=bounds, isolation_level="AUTOCOMMIT", **auto_kwargs
            )
            return cls(engine, autocommit_engine=auto, bounds=bounds)
        except SQLAlchemyError as exc:
            raise dberrors.wrap(exc, dberrors.backend_of(url)) from exc

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
