"""The state every part of :class:`~celery_lease.store.LeaseStore` shares."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError

from .. import dberrors
from ..errors import LeaseLost
from ..schema import db_now_ms, runs
from .dialects import Dialect
from .driver import DriverStatement
from .engine import WaitBounds
from .records import RunRecord

F = TypeVar("F", bound=Callable[..., Any])


def _db_errors(method: F) -> F:
    """Raise SQLAlchemy and driver errors of a store method as :class:`LeaseDatabaseError`.

    Classified by :func:`celery_lease.dberrors.classify` (transient or
    permanent, and the cause); the driver's exception is kept as ``__cause__``.
    """

    @functools.wraps(method)
    def wrapper(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise dberrors.wrap(exc, self.dialect) from exc

    return cast(F, wrapper)


class StoreBase:
    """The engines and settings the parts share, and the reads every part uses."""

    engine: Engine
    dialect: str
    bounds: WaitBounds
    _own_auto: Engine | None
    _auto: Engine
    _ops: Dialect
    _upsert: bool
    _complete_stmt: Any
    _claim_stmt: Any
    _complete_driver: DriverStatement | None
    _claim_driver: DriverStatement | None

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
