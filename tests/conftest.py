"""Fixtures: lease databases (SQLite always, PostgreSQL when available), Redis, workers.

PostgreSQL and Redis come from ``CELERY_LEASE_TEST_PG_URL`` (an admin URL such as
``postgresql+psycopg://postgres@127.0.0.1:5433/postgres``) and
``CELERY_LEASE_TEST_REDIS_URL``; MySQL/MariaDB from ``CELERY_LEASE_TEST_MYSQL_URL``
(e.g. ``mysql+pymysql://root@127.0.0.1:3306/mysql``). Without them those tests skip, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_lease.store import LeaseStore
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, require, scratch_database

PG_ENV = "CELERY_LEASE_TEST_PG_URL"
REDIS_ENV = "CELERY_LEASE_TEST_REDIS_URL"
MYSQL_ENV = "CELERY_LEASE_TEST_MYSQL_URL"


def _pg_admin_url() -> str | None:
    return os.environ.get(PG_ENV) or None


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test, dropped afterwards."""
    admin = require(_pg_admin_url(), f"PostgreSQL ({PG_ENV})")
    with scratch_database(admin) as url:
        yield url


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A fresh MySQL/MariaDB database for this test, dropped afterwards."""
    admin = require(os.environ.get(MYSQL_ENV), f"MySQL ({MYSQL_ENV})")
    with scratch_database(admin) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file in the test's temp dir."""
    return f"sqlite:///{tmp_path / 'leases.sqlite3'}"


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The lease database URL, once per backend."""
    return str(request.getfixturevalue(f"{request.param.replace('postgresql', 'pg')}_url"))


@pytest.fixture
def store(db_url: str) -> Iterator[LeaseStore]:
    """A LeaseStore with its schema created."""
    lease_store = LeaseStore.from_url(db_url)
    lease_store.create_schema()
    yield lease_store
    lease_store.dispose()


@pytest.fixture
def redis_url() -> str:
    """The Redis URL for broker tests."""
    return str(require(os.environ.get(REDIS_ENV), f"Redis ({REDIS_ENV})"))


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    """Workers a test starts; each is stopped by PID at teardown."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture(params=SETUPS, ids=SETUP_IDS)
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, workers: list[Worker]
) -> Iterator[Cluster]:
    """A cluster per set-up: SQLite + filesystem broker, SQLite + Redis, PostgreSQL + Redis."""
    db, broker = request.param
    db_url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    if broker == "redis":
        redis = request.getfixturevalue("redis_url")
        broker_env = {"CL_BROKER_URL": redis, "CL_RESULT_BACKEND": redis}
    else:
        folder = tmp_path / "broker"
        (folder / "control").mkdir(parents=True)
        # The embedded default: a database result backend (chords use chord_unlock).
        broker_env = {
            "CL_BROKER_URL": "filesystem://",
            "CL_FS_DIR": str(folder),
            "CL_RESULT_BACKEND": f"db+sqlite:///{tmp_path / 'results.sqlite3'}",
        }
    c = Cluster(str(db_url), broker_env, tmp_path, workers)
    yield c
    c.close()
