"""The database-error taxonomy: which driver errors are worth retrying.

Every error the store raises passes through :func:`classify`, which answers one
question: could the same statement succeed later without anyone changing the
code, the schema or the settings? *Transient* errors (a disconnect, a timeout,
a deadlock, a serialization failure, a lock not available, too many
connections, a refused connection) could; *permanent* ones (a value too long
for its column, a number out of range, a missing table or column, bad SQL, a
failed login) never will, and retrying them only hides the cause.

The decision is made by each database's class in
:mod:`celery_lease.store.databases`, from the driver's own code, never from the
message text where a code exists: PostgreSQL's SQLSTATE (``exc.orig.sqlstate``),
the MySQL/MariaDB error number (``exc.orig.args[0]``), SQLite's result code
(``exc.orig.sqlite_errorcode``). Errors without a known code fall back on
SQLAlchemy's own judgement: a connection SQLAlchemy invalidated, a pool
timeout or an ``OperationalError`` is transient, anything else permanent. The
functions here are for code that holds a dialect name rather than a store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import exc as sa_exc

from .errors import LeaseDatabaseError
from .store.database import Classification
from .store.databases import backend_of, database_for


def classify(exc: BaseException, dialect: str) -> Classification:
    """Transient or permanent, and why, for an error raised by SQLAlchemy or its driver."""
    return database_for(dialect).classify(exc)


def wrap(exc: BaseException, dialect: str) -> LeaseDatabaseError:
    """The :class:`LeaseDatabaseError` the store raises for ``exc`` (``raise ... from exc``).

    The message names the cause and the driver's first line, never the SQL
    parameters (they can hold task arguments).
    """
    return database_for(dialect).wrap(exc, dialect)


@contextlib.contextmanager
def translated(url: str) -> Iterator[None]:
    """Raise the SQLAlchemy errors of the block as :func:`wrap` does (``from`` them), for
    the database ``url`` names.

    For code outside the store that runs SQLAlchemy itself (the ``migrate``
    command around :func:`celery_lease.migrations.upgrade`).
    """
    dialect = backend_of(url)
    try:
        yield
    except sa_exc.SQLAlchemyError as exc:
        raise wrap(exc, dialect) from exc
