"""The database classes by SQLAlchemy dialect name, and the engines they make.

Each class (:mod:`~celery_lease.store.sqlite`, :mod:`~celery_lease.store.postgresql`,
:mod:`~celery_lease.store.mysql`, over :mod:`~celery_lease.store.database`) owns
what differs on its database; this module finds the one for a dialect name or
URL, and compiles :class:`~celery_lease.schema.db_now_ms` with its ``clock_sql``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Engine,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

from ..errors import LeaseDatabaseError
from ..schema import db_now_ms
from .bounds import DEFAULT_BOUNDS, WaitBounds
from .database import Database
from .mysql import MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

#: The database objects, by SQLAlchemy dialect name.
DATABASES: dict[str, Database] = {
    name: database for database in (SQLite(), PostgreSQL(), MySQL()) for name in database.names
}


def database_for(name: str) -> Database:
    """The database object for the SQLAlchemy dialect or backend ``name``.

    Raises:
        LeaseDatabaseError: (permanent, cause ``unsupported_database``) for a database
            celery-lease does not know, or "" (a URL that does not parse).
    """
    try:
        return DATABASES[name]
    except KeyError:
        what = f"the {name!r} database" if name else "a URL that does not parse"
        raise LeaseDatabaseError(
            f"celery-lease does not support {what}; supported: sqlite, postgresql, "
            "mysql (and mariadb)",
            transient=False,
            cause="unsupported_database",
        ) from None


def backend_of(url: str) -> str:
    """The database ``url`` names (``postgresql``, ``sqlite``...), or "" if it does not parse."""
    try:
        return make_url(url).get_backend_name()
    except sa_exc.ArgumentError:
        return ""


def create_lease_engine(url: str, *, bounds: WaitBounds = DEFAULT_BOUNDS, **kwargs: Any) -> Engine:
    """An engine for lease traffic on ``url``, every wait bounded by ``bounds``; the
    database's class decides how (:meth:`Database.create_engine`).

    Raises SQLAlchemy's ``ArgumentError`` for a URL that does not parse, and
    :class:`~celery_lease.errors.LeaseDatabaseError` for a database celery-lease
    does not know.
    """
    backend = make_url(url).get_backend_name()
    return database_for(backend).create_engine(url, bounds, **kwargs)


def _compile_clock(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    return DATABASES[compiler.dialect.name].clock_sql


# One compilation per known dialect name and no default one: an unknown database fails
# loudly when a statement is compiled.
for _name in DATABASES:
    compiles(db_now_ms, _name)(_compile_clock)
