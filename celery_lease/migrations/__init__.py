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
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, create_engine, inspect

from ..errors import LeaseError
from ..schema import TABLE_NAME, metadata
from ..store.bounds import DEFAULT_LEASE_SECONDS, MigrationBounds, shortest_lease_in_use
from ..store.database import DDLLockTimeout, MigrationLockTimeout
from ..store.databases import database_for
from .online import BOUNDS_OPTION

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "VERSION_TABLE",
    "DDLLockTimeout",
    "MigrationBounds",
    "MigrationError",
    "MigrationLockTimeout",
    "MigrationResult",
    "alembic_config",
    "current",
    "exclude_lease_tables",
    "head",
    "include_name",
    "migration_bounds",
    "schema_differences",
    "upgrade",
]

VERSION_TABLE = "celery_lease_alembic_version"
SCRIPT_LOCATION = str(Path(__file__).resolve().parent)

#: Seconds a ``migrate`` run waits for another one to finish before giving up.
DEFAULT_LOCK_TIMEOUT = 300.0


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


def exclude_lease_tables(name: str | None, type_: str, parent_names: Any) -> bool:
    """Autogenerate filter for the application's own Alembic environment: every table but
    celery-lease's (its tables and its version table), which ``lease migrate`` owns.

    Without it, an application whose models share the lease database sees celery-lease's
    tables as tables to drop (``alembic check`` fails, ``revision --autogenerate`` writes
    ``drop_table`` for each). Pass it as ``include_name`` in ``context.configure()``.
    """
    if type_ == "table":
        return name != VERSION_TABLE and name not in metadata.tables
    return True


def alembic_config(
    connection: Connection | None = None,
    url: str | None = None,
    bounds: MigrationBounds | None = None,
) -> Config:
    """An Alembic ``Config`` for these migrations, without any ini file.

    Pass an open ``connection`` (used as is, inside the caller's transaction)
    or a ``url`` (``env.py`` then opens its own engine). ``bounds`` limit how
    long a schema change may hold lease writes back; without them ``env.py``
    reads the shortest lease in use (:func:`migration_bounds`).
    """
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if url is not None:
        # ConfigParser interpolation would choke on a '%' in a password.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    if bounds is not None:
        config.attributes[BOUNDS_OPTION] = bounds
    return config


def migration_bounds(
    connection: Connection, shortest_lease: float | None = None
) -> MigrationBounds:
    """How long each schema change may hold lease writes back on ``connection``'s database.

    From the shortest lease in use: ``shortest_lease`` (what the caller knows,
    e.g. the app's and its tasks' ``lease_seconds``) or the shortest among the
    runs running now or ended within the hour, whichever release's workers took
    them, if shorter; the
    default 30 s lease when neither is known. A transaction the read began is
    ended (a caller's own is left open).
    """
    began = not connection.in_transaction()
    in_use = shortest_lease_in_use(connection)
    if began and connection.in_transaction():
        connection.rollback()
    known = [value for value in (shortest_lease, in_use) if value is not None]
    return MigrationBounds.for_lease(min(known) if known else DEFAULT_LEASE_SECONDS)


def _known(revision: str) -> None:
    """Refuse a ``revision`` this package does not ship, naming the ones it does."""
    script = ScriptDirectory.from_config(alembic_config())
    try:
        script.get_revisions(revision)
    except CommandError:
        shipped = ", ".join(sorted(r.revision for r in script.walk_revisions()))
        raise MigrationError(
            f"unknown revision {revision!r}: this version ships {shipped} (head: {head()})"
        ) from None


def _ships(revision: str) -> bool:
    """Whether this package ships ``revision``."""
    script = ScriptDirectory.from_config(alembic_config())
    return any(r.revision == revision for r in script.walk_revisions())


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
    target: str | Engine,
    revision: str = "head",
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    shortest_lease: float | None = None,
) -> MigrationResult:
    """Migrate the lease database at ``target`` (a URL or an engine) to ``revision``.

    Runs under the database's migration lock
    (:meth:`~celery_lease.store.database.Database.migration_lock`): a run
    started while another one migrates waits for it (at most ``lock_timeout``
    seconds, then :class:`MigrationLockTimeout`), then finds the schema
    current. Each revision commits on its own (SQLite: all in one
    transaction). No schema change holds lease writes back longer than a tenth
    of the shortest lease in use at a time: ``shortest_lease`` seconds, or the
    shortest lease of a run running now if shorter (see
    :func:`migration_bounds`, :mod:`celery_lease.migrations.online`); a change
    that cannot get its lock within that keeps trying, then raises
    :class:`DDLLockTimeout`. Adopts a table that ``create_all`` made (see the
    module docs); raises :class:`MigrationError` when such a table differs
    from this version's schema. Driver errors propagate as SQLAlchemy errors.
    """
    _known(revision)
    engine = create_engine(target) if isinstance(target, str) else target
    lock = database_for(engine.dialect.name).migration_lock()
    try:
        with engine.connect() as connection:
            bounds = migration_bounds(connection, shortest_lease)
            with lock.held(connection, lock_timeout) as migrating:
                return _upgrade(migrating, revision, bounds)
    finally:
        if isinstance(target, str):
            engine.dispose()


def _upgrade(connection: Connection, revision: str, bounds: MigrationBounds) -> MigrationResult:
    # Alembic owns the transactions (one per revision) unless the lock already
    # opened one (SQLite), which then holds the whole migration.
    own_transactions = not connection.in_transaction()
    inspector = inspect(connection)
    has_runs = inspector.has_table(TABLE_NAME)
    has_history = inspector.has_table(VERSION_TABLE)
    before = current(connection) if has_history else None
    if before is not None and not _ships(before):
        raise MigrationError(
            f"the database is at revision {before!r}, which this version does not ship "
            f"(its newest is {head()}): a newer celery-lease migrated it; run `lease migrate` "
            "of that version, or upgrade this one"
        )
    config = alembic_config(connection, bounds=bounds)
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
    elif (
        has_runs
        and before != head()
        and revision in ("head", head())
        and not schema_differences(connection)
    ):
        # An embedded (SQLite) worker adds what a table lacks when it starts, without
        # recording it: the table already matches head, and the revisions between would
        # add its columns a second time.
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
