"""Alembic environment for celery-lease's own migrations.

Run through :func:`celery_lease.migrations.upgrade` (``celery lease migrate``),
which hands over an open connection in ``config.attributes["connection"]``.
History lives in ``celery_lease_alembic_version``, never in the application's
own ``alembic_version``, and autogenerate only looks at celery-lease's table.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from celery_lease.migrations import VERSION_TABLE, include_name, migration_bounds
from celery_lease.migrations.online import BOUNDS_OPTION
from celery_lease.schema import metadata

config = context.config


def _configure(connection: Connection) -> None:
    # Given by `lease migrate`, else read from the runs running or recently ended
    # (before this run's own transactions begin).
    bounds = config.attributes.get(BOUNDS_OPTION) or migration_bounds(connection)
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
        # One transaction per revision: an online index build must run outside any.
        transaction_per_migration=True,
        # Whether migrations may commit and step outside a transaction (see
        # celery_lease.migrations.online); not inside a caller's own transaction.
        celery_lease_own_transactions=not connection.in_transaction(),
        # How long a change may hold lease writes back (celery_lease.migrations.online).
        celery_lease_bounds=bounds,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade --sql``) instead of running it."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    """Run on the caller's connection, or on a new engine for ``sqlalchemy.url``."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("celery-lease migrations need a connection or sqlalchemy.url")
    engine = create_engine(url)
    try:
        with engine.connect() as conn:  # Alembic begins and commits each revision
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
