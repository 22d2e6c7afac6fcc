"""Django: the lease database on the project's own database, and fencing inside ``atomic()``.

:func:`lease_database_url` turns an entry of ``settings.DATABASES`` into the
SQLAlchemy URL for ``CELERY_LEASE_DATABASE_URL``, so the run table lives beside
Django's own tables. :func:`fenced_atomic` is ``transaction.atomic()`` whose
commit also proves the lease, and with ``complete=True`` records the run
succeeded, in the same transaction as the ORM writes made inside it.

``Lease.fence`` needs a SQLAlchemy ``Connection`` in the transaction to fence;
Django's ORM writes on its own DBAPI connection. A second connection (an
engine of your own) would be a second transaction: not atomic with the ORM
writes, and on SQLite blocked by Django's write lock. :func:`fenced_atomic`
instead wraps Django's own DBAPI connection in a SQLAlchemy ``Connection`` for
the duration of the block, so both write in one transaction, which Django
commits or rolls back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from celery.exceptions import ImproperlyConfigured
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

from ..errors import LeaseError
from ..lease.lease import Lease, current_lease

#: Django database backends and the SQLAlchemy dialect+driver celery-lease uses for them.
BACKEND_URLS = {
    "django.db.backends.sqlite3": "sqlite",
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.db.backends.mysql": "mysql+pymysql",
}

#: libpq connection options copied from a PostgreSQL entry's ``OPTIONS`` into the URL.
PG_URL_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout", "options")

#: The SQLAlchemy driver for the module of a DBAPI connection Django holds.
_DRIVERS = {
    "sqlite3": "sqlite+pysqlite",
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
    "MySQLdb": "mysql+mysqldb",
    "pymysql": "mysql+pymysql",
}


#: Where :func:`fenced_atomic` keeps its engine on Django's connection wrapper.
_ENGINE_ATTR = "_celery_lease_engine"


def lease_database_url(database: Mapping[str, Any]) -> str:
    """The lease database URL for one ``settings.DATABASES`` entry (SQLite, PostgreSQL, MySQL).

    Call it in ``settings.py``: ``CELERY_LEASE_DATABASE_URL =
    lease_database_url(DATABASES["default"])``. PostgreSQL gets the psycopg (3)
    driver and MySQL/MariaDB PyMySQL (the ``postgres`` and ``mysql`` extras).

    Raises:
        ImproperlyConfigured: an engine celery-lease does not support, or a
            SQLite entry without a file name.
    """
    engine = database.get("ENGINE", "")
    driver = BACKEND_URLS.get(engine)
    if driver is None:
        raise ImproperlyConfigured(
            f"DATABASES engine {engine!r} is not supported by celery-lease; supported: "
            + ", ".join(BACKEND_URLS)
        )
    name = str(database.get("NAME") or "")
    if driver == "sqlite":
        if not name or name == ":memory:" or name.startswith("file:"):
            raise ImproperlyConfigured(
                "the lease database needs a SQLite file every worker process can open; "
                f"DATABASES NAME is {name!r}"
            )
        return URL.create("sqlite", database=str(name)).render_as_string()
    options = database.get("OPTIONS") or {}
    query = {key: str(options[key]) for key in PG_URL_OPTIONS if key in options}
    port = database.get("PORT")
    url = URL.create(
        driver,
        username=database.get("USER") or None,
        password=database.get("PASSWORD") or None,
        host=database.get("HOST") or None,
        port=int(port) if port else None,
        database=name or None,
        query=query if driver.startswith("postgresql") else {},
    )
    return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def fenced_atomic(
    lease: Lease | None = None,
    *,
    using: str | None = None,
    complete: bool = True,
    send: Any = None,
) -> Iterator[None]:
    """``transaction.atomic(using, durable=True)`` that commits only while the lease holds.

    The block's ORM writes and the fence (by default ``complete=True``: the run
    recorded ``succeeded``) run in one transaction on Django's connection
    ``using``, fenced as the block ends, just before the commit. Either both
    commit or neither does. The lease database must be that same database
    (:func:`lease_database_url`).

    Args:
        lease: the lease to fence; default :func:`~celery_lease.current_lease`.
        using: the Django database alias (default ``"default"``).
        complete: record the run succeeded in the same transaction.
        send: follow-up tasks (a Celery signature or a list of them), recorded in
            the same transaction and published once Django has committed it
            (``Lease.fence(send=...)``).

    Raises:
        LeaseLost: the lease is no longer held; the block's writes are rolled back.
        LeaseError: called inside another ``atomic()`` block (Django decides
            the commit of the outermost one only), or the lease database is
            not the database ``using`` names.
    """
    from django.db import DEFAULT_DB_ALIAS, connections, transaction

    lease = current_lease() if lease is None else lease
    alias = DEFAULT_DB_ALIAS if using is None else using
    django_connection = connections[alias]
    if django_connection.in_atomic_block:
        raise LeaseError(
            "fenced_atomic() must be the outermost transaction: it is fenced and committed "
            "as its block ends, which an enclosing atomic() block would postpone"
        )
    _check_same_database(lease, django_connection.settings_dict, alias)
    connection = _wrap(django_connection)
    committed = False
    try:
        with transaction.atomic(using=alias, durable=True):
            yield
            lease.fence(connection, complete=complete, send=send)
        committed = True
    finally:
        # Django has ended the transaction; tell SQLAlchemy, whose commit and
        # rollback events move the lease (completed, or held again). The DBAPI
        # commit or rollback it sends then finds no transaction open.
        if committed:
            connection.commit()
        else:
            connection.rollback()
        connection.close()


def _wrap(django_connection: Any) -> Connection:
    """A SQLAlchemy ``Connection`` on the DBAPI connection Django holds, never closing it.

    The engine is kept on Django's connection wrapper while that DBAPI
    connection lives, so SQLAlchemy's first-connect work (server inspection,
    a notice handler on psycopg) happens once per connection, not per block.
    """
    django_connection.ensure_connection()
    dbapi = django_connection.connection
    cached: tuple[Any, Engine] | None = getattr(django_connection, _ENGINE_ATTR, None)
    if cached is not None and cached[0] is dbapi:
        return cached[1].connect()
    driver = _DRIVERS.get(type(dbapi).__module__.split(".")[0])
    if driver is None:
        raise LeaseError(f"fenced_atomic() does not support the {type(dbapi).__module__} driver")
    engine = create_engine(
        f"{driver}://",
        creator=lambda: dbapi,
        poolclass=StaticPool,
        # Check-in must not roll back (or close) the connection Django owns.
        pool_reset_on_return=None,
    )
    # Connects before the atomic block begins: SQLAlchemy's first connect
    # inspects the server and then rolls back, which must not touch our writes.
    connection = engine.connect()
    setattr(django_connection, _ENGINE_ATTR, (dbapi, engine))
    return connection


def _check_same_database(lease: Lease, settings_dict: Mapping[str, Any], alias: str) -> None:
    """Refuse to fence on a Django database that is not the lease database.

    Compares the backend and the database name (a SQLite file's path): a host
    may be spelled two ways, a database's name rarely is.
    """
    ours = make_url(lease_database_url(settings_dict))
    lease_url = lease.store.engine.url
    if (ours.get_backend_name(), ours.database) != (
        lease_url.get_backend_name(),
        lease_url.database,
    ):
        raise LeaseError(
            f"fenced_atomic(using={alias!r}): the lease database is not that Django "
            "database; point CELERY_LEASE_DATABASE_URL at it (lease_database_url)"
        )
