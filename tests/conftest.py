"""Fixtures: lease databases (SQLite always, PostgreSQL when available), Redis, workers.

PostgreSQL and Redis come from ``CELERY_LEASE_TEST_PG_URL`` (an admin URL such as
``postgresql+psycopg://postgres@127.0.0.1:5433/postgres``) and
``CELERY_LEASE_TEST_REDIS_URL``; MySQL/MariaDB from ``CELERY_LEASE_TEST_MYSQL_URL``
(e.g. ``mysql+pymysql://root@127.0.0.1:3306/mysql``); PgBouncer from
``CELERY_LEASE_TEST_PGBOUNCER_URL`` (e.g. ``postgresql+psycopg://postgres@127.0.0.1:6432/postgres``:
a PgBouncer in ``pool_mode = transaction`` in front of that PostgreSQL, with a wildcard
``* = host=... port=...`` database entry so each test's scratch database is reachable through it).
RabbitMQ from ``CELERY_LEASE_TEST_AMQP_URL`` (e.g. ``amqp://guest:guest@127.0.0.1:5672//``):
each test gets its own uniquely named queue, exchange and control exchange on that vhost,
deleted afterwards, so tests running in parallel never see each other's messages (Celery's
native delayed delivery, used by one quorum-queue test, declares its shared
``celery_delayed_*`` exchanges and queues on the vhost; they stay, as in production).
Without them those tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.backends.database.models import ResultModelBase
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from celery_lease.config import sqlite_url as sqlite_file_url
from celery_lease.store import LeaseStore
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, require, scratch_database

PG_ENV = "CELERY_LEASE_TEST_PG_URL"
REDIS_ENV = "CELERY_LEASE_TEST_REDIS_URL"
MYSQL_ENV = "CELERY_LEASE_TEST_MYSQL_URL"
PGBOUNCER_ENV = "CELERY_LEASE_TEST_PGBOUNCER_URL"
AMQP_ENV = "CELERY_LEASE_TEST_AMQP_URL"


def _pg_admin_url() -> str | None:
    return os.environ.get(PG_ENV) or None


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test, dropped afterwards."""
    admin = require(_pg_admin_url(), f"PostgreSQL ({PG_ENV})")
    with scratch_database(admin) as url:
        yield url


@pytest.fixture
def pgbouncer_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test, reached through PgBouncer (transaction mode)."""
    bouncer = make_url(require(os.environ.get(PGBOUNCER_ENV), f"PgBouncer ({PGBOUNCER_ENV})"))
    admin = require(_pg_admin_url(), f"PostgreSQL ({PG_ENV})")
    with scratch_database(admin) as direct:
        pooled = make_url(direct).set(host=bouncer.host, port=bouncer.port)
        yield pooled.render_as_string(hide_password=False)


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A fresh MySQL/MariaDB database for this test, dropped afterwards."""
    admin = require(os.environ.get(MYSQL_ENV), f"MySQL ({MYSQL_ENV})")
    with scratch_database(admin) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file in the test's temp dir."""
    return sqlite_file_url(tmp_path / "leases.sqlite3")


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The lease database URL, once per backend."""
    return str(request.getfixturevalue(f"{request.param.replace('postgresql', 'pg')}_url"))


@pytest.fixture(params=["sqlite", "postgresql", "mysql", "pgbouncer"])
def lease_db_url(request: pytest.FixtureRequest) -> str:
    """The lease database URL for store and task tests: each backend, and PgBouncer."""
    return str(request.getfixturevalue(f"{request.param.replace('postgresql', 'pg')}_url"))


@pytest.fixture
def store(lease_db_url: str) -> Iterator[LeaseStore]:
    """A LeaseStore with its schema created (each backend, and through PgBouncer)."""
    lease_store = LeaseStore.from_url(lease_db_url)
    lease_store.create_schema()
    yield lease_store
    lease_store.dispose()


@pytest.fixture
def redis_url() -> str:
    """The Redis URL for broker tests."""
    return str(require(os.environ.get(REDIS_ENV), f"Redis ({REDIS_ENV})"))


@pytest.fixture
def amqp_url() -> str:
    """The RabbitMQ URL for broker tests (isolation: see :class:`tests.cluster.Cluster`)."""
    return str(require(os.environ.get(AMQP_ENV), f"RabbitMQ ({AMQP_ENV})"))


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    """Workers a test starts; each is killed by PID at teardown (the test is over: no warm
    shutdown, see :meth:`Worker.discard`)."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.discard()


@pytest.fixture(params=SETUPS, ids=SETUP_IDS)
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, workers: list[Worker]
) -> Iterator[Cluster]:
    """A cluster per set-up: SQLite + filesystem broker, SQLite + Redis, PostgreSQL + Redis
    (and PgBouncer + Redis where a test asks for ``PGBOUNCER_SETUP``, PostgreSQL +
    RabbitMQ where it asks for ``AMQP_SETUP``)."""
    db, broker = request.param
    db_url = request.getfixturevalue({"postgresql": "pg_url"}.get(db, f"{db}_url"))
    if broker == "redis":
        redis = request.getfixturevalue("redis_url")
        broker_env = {"CL_BROKER_URL": redis, "CL_RESULT_BACKEND": redis}
    elif broker == "amqp":
        # No result backend: RabbitMQ is the broker only, as in most deployments.
        broker_env = {"CL_BROKER_URL": request.getfixturevalue("amqp_url")}
    else:
        folder = tmp_path / "broker"
        (folder / "control").mkdir(parents=True)
        # The embedded default: a database result backend (chords use chord_unlock).
        results = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
        broker_env = {
            "CL_BROKER_URL": "filesystem://",
            "CL_FS_DIR": str(folder),
            "CL_RESULT_BACKEND": results,
        }
        # Celery < 5.5 creates the result tables once per process, in the first
        # database it opens: this test process, which reads results from a new
        # file per test, needs them made here.
        engine = create_engine(results.removeprefix("db+"))
        ResultModelBase.metadata.create_all(engine)
        engine.dispose()
    c = Cluster(str(db_url), broker_env, tmp_path, workers)
    yield c
    c.close()
