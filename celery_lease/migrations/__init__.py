"""Alembic migrations for ``celery_lease_runs``, shipped inside the package.

Apply them with ``celery -A proj lease migrate`` or :func:`upgrade`. No
``alembic.ini`` is needed: the script directory is this package. History is
kept in its own table, ``celery_lease_alembic_version``, so it never collides
with the application's own Alembic history, and autogenerate here only ever
looks at celery-lease's table.

A table created without migrations (the SQLite default creates it on first
use with ``metadata.create_all``) is *adopted*: when ``celery_lease_runs``
exists but the version table does not, :func:`upgrade` compares the table with
this version's schema; if they match it stamps ``head``, otherwise it stops
with :class:`MigrationError` listing the differences and changes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, inspect

from ..errors import LeaseError
from ..schema import TABLE_NAME, metadata
from .lock import DEFAULT_LOCK_TIMEOUT, MigrationLockTimeout, migration_lock

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "VERSION_TABLE",
    "MigrationError",
    "MigrationLockTimeout",
    "MigrationResult",
    "alembic_config",
    "current",
    "head",
    "include_name",
    "schema_differences",
    "upgrade",
]

VERSION_TABLE = "celery_lease_alembic_version"
SCRIPT_LOCATION = str(Path(__file__).resolve().parent)


class MigrationError(LeaseError):
    """The lease schema cannot be migrated safely as it stands."""

    code = "migration_error"


@dataclasses.dataclass(frozen=True)
class MigrationResult:
    """What :func:`upgrade` did: revisions before and after, and whether it adopted a table."""

    before: str | None
    after: str | None
    adopted: bool = False

    @property
    def changed(self) -> bool:
        """True when a migration ran or the table was adopted."""
        return self.adopted or self.before != self.after


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Autogenerate filter: only celery-lease's own tables, never the application's."""
    if type_ == "table":
        return name in metadata.tables
    return True


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An Alembic ``Config`` for these migrations, without any ini file.

    Pass an open ``connection`` (used as is, inside the caller's transaction)
    or a ``url`` (``env.py`` then opens its own engine).
    """
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if url is not None:
        # ConfigParser interpolation would choke on a '%' in a password.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head() -> str:
    """The newest revision this package ships."""
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if revision is None:  # pragma: no cover - the package always ships 0001
        raise MigrationError("no migrations found in celery_lease/migrations/versions")
    return revision


def current(connection: Connection) -> str | None:
    """The revision the database is at (None before any migration)."""
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def schema_differences(connection: Connection) -> list[Any]:
    """Alembic's diff between the live ``celery_lease_runs`` and this package's schema."""
    context = MigrationContext.configure(
        connection, opts={"include_name": include_name, "compare_type": True}
    )
    return list(compare_metadata(context, metadata))


def upgrade(
    target: str | Engine, revision: str = "head", *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT
) -> MigrationResult:
    """Migrate the lease database at ``target`` (a URL or an engine) to ``revision``.

    Runs under the database's migration lock (see
    :mod:`celery_lease.migrations.lock`): a run started while another one
    migrates waits for it (at most ``lock_timeout`` seconds, then
    :class:`MigrationLockTimeout`), then finds the schema current. Each
    revision commits on its own (SQLite: all in one transaction), and no
    statement queues lease writes for long (see
    :mod:`celery_lease.migrations.online`). Adopts a
    table that ``create_all`` made (see the module docs); raises
    :class:`MigrationError` when such a table differs from this version's
    schema. Driver errors propagate as SQLAlchemy errors.
    """
    engine = create_engine(target) if isinstance(target, str) else target
    try:
        with (
            engine.connect() as connection,
            migration_lock(connection).held(connection, lock_timeout) as migrating,
        ):
            return _upgrade(migrating, revision)
    finally:
        if isinstance(target, str):
            engine.dispose()


def _upgrade(connection: Connection, revision: str) -> MigrationResult:
    # Alembic owns the transactions (one per revision) unless the lock already
    # opened one (SQLite), which then holds the whole migration.
    own_transactions = not connection.in_transaction()
    inspector = inspect(connection)
    has_runs = inspector.has_table(TABLE_NAME)
    has_history = inspector.has_table(VERSION_TABLE)
    before = current(connection) if has_history else None
    config = alembic_config(connection)
    adopted = False
    if has_runs and before is None:
        differences = schema_differences(connection)
        if differences:
            raise MigrationError(
                f"{TABLE_NAME} exists without migration history and differs from this "
                f"version's schema ({_summarize(differences)}); align it by hand, then run "
                f"`alembic stamp` with version_table={VERSION_TABLE}"
            )
        if own_transactions:
            connection.commit()
        command.stamp(config, head())
        adopted = True
    if own_transactions and connection.in_transaction():
        connection.commit()
    command.upgrade(config, revision)
    return MigrationResult(before, current(connection), adopted)


def _summarize(differences: list[Any], limit: int = 5) -> str:
    parts = []
    for diff in differences[:limit]:
        item = diff[0] if isinstance(diff, list) and diff else diff
        parts.append(str(item[0]) if isinstance(item, tuple) and item else str(item))
    more = len(differences) - limit
    return ", ".join(parts) + (f", and {more} more" if more > 0 else "")
