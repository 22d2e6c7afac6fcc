"""The shipped Alembic migrations, on SQLite, PostgreSQL and MySQL/MariaDB."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from celery_lease.migrations import VERSION_TABLE, MigrationError, head, upgrade
from celery_lease.schema import TABLE_NAME, metadata
from celery_lease.store import LeaseStore


def _not_version_table(name: str | None, type_: str, parent_names: object) -> bool:
    return not (type_ == "table" and name == VERSION_TABLE)


def _differences(url: str) -> list[object]:
    """Alembic's diff of the whole database (bar our version table) against the metadata."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"include_name": _not_version_table, "compare_type": True}
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_matches_package_metadata(db_url: str) -> None:
    """After upgrade head, compare_metadata against celery_lease.schema.metadata is empty."""
    result = upgrade(db_url)
    assert (result.before, result.after, result.adopted) == (None, head(), False)
    assert _differences(db_url) == []
    assert _tables(db_url) == {TABLE_NAME, VERSION_TABLE}


def test_upgrade_twice_is_a_no_op(db_url: str) -> None:
    """A second upgrade finds the database at head and changes nothing."""
    upgrade(db_url)
    again = upgrade(db_url)
    assert again.before == again.after == head() and not again.changed


def test_own_version_table_leaves_application_history_alone(db_url: str) -> None:
    """The application's alembic_version row survives; ours lives in its own table."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('app_rev_42')"))
    upgrade(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [
            "app_rev_42"
        ]
        assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one() == (
            head()
        )
    engine.dispose()


def test_table_made_by_create_all_is_adopted(db_url: str) -> None:
    """A table the store auto-created is stamped at head instead of failing to re-create."""
    store = LeaseStore.from_url(db_url)
    store.create_schema()
    store.claim("r1", "o:1:x", task_name="t", lease_ms=1000, max_attempts=3)
    result = upgrade(db_url)
    assert result.adopted and result.after == head()
    assert _differences(db_url) == []
    row = store.get("r1")
    assert row is not None and row.status == "running"  # existing rows are untouched
    store.dispose()


def test_foreign_table_with_our_name_is_refused(db_url: str) -> None:
    """A celery_lease_runs table that differs from the schema stops migrate; nothing is stamped."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {TABLE_NAME} (id VARCHAR(255) PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(MigrationError, match="differs from this version's schema"):
        upgrade(db_url)
    assert VERSION_TABLE not in _tables(db_url)


def test_migrated_database_serves_the_store(db_url: str) -> None:
    """A store on a migrated database claims and completes a run."""
    upgrade(db_url)
    store = LeaseStore.from_url(db_url)
    claim = store.claim("r1", "o:1:x", task_name="t", lease_ms=5000, max_attempts=3)
    assert claim.outcome == "claimed"
    store.complete("r1", "o:1:x", claim.attempt)
    row = store.get("r1")
    assert row is not None and row.status == "succeeded"
    store.dispose()


def test_upgrade_from_0001_widens_the_payload(db_url: str) -> None:
    """A database made by 0001 holds arguments over 64 KiB after upgrade head (MySQL: LONGBLOB)."""
    upgrade(db_url, "0001")
    upgrade(db_url)
    assert _differences(db_url) == []
    store = LeaseStore.from_url(db_url)
    payload = b"\x00\xff" * (50 * 1024)
    claim = store.claim(
        "r1", "o:1:x", task_name="t", lease_ms=5000, max_attempts=3, payload=payload
    )
    assert claim.outcome == "claimed"
    row = store.get("r1")
    assert row is not None and row.payload == payload
    store.dispose()
