"""The one entry point the migration scripts change ``celery_lease_runs`` through: :func:`ddl`.

A DDL statement that waits for a table lock makes every later statement on that
table wait behind it: every heartbeat, claim and completion. So each change
goes through the database's own :class:`~celery_lease.store.database.OnlineDDL`
(PostgreSQL: concurrent index builds, a short ``lock_timeout`` on the rest;
MySQL/MariaDB: InnoDB online DDL under a short ``lock_wait_timeout``; SQLite:
plain DDL inside the file's write lock), bounded by the shortest lease in use
(:class:`~celery_lease.store.bounds.MigrationBounds`, which ``lease migrate``
computes and ``env.py`` hands to the scripts).
"""

from __future__ import annotations

from alembic import op
from alembic.operations import Operations

from ..store.bounds import DEFAULT_LEASE_SECONDS, MigrationBounds
from ..store.database import OnlineDDL, PlainDDL
from ..store.databases import database_for

#: The context option (and ``Config.attributes`` key) that carries the migration's bounds.
BOUNDS_OPTION = "celery_lease_bounds"


def ddl() -> OnlineDDL:
    """The lease-safe DDL for the database the running migration targets."""
    context = op.get_context()
    bounds = context.opts.get(BOUNDS_OPTION)
    if not isinstance(bounds, MigrationBounds):
        bounds = MigrationBounds.for_lease(DEFAULT_LEASE_SECONDS)
    operations = Operations(context)
    if context.as_sql:  # a printed script: plain DDL, the operator runs it
        return PlainDDL(operations, bounds)
    return database_for(context.dialect.name).online_ddl(operations, bounds)
