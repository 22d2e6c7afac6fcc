"""What the app's runtime keeps per database: one store and heartbeat for every task on it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeasedTask
from celery_lease.errors import LeaseDatabaseError
from celery_lease.runtime import app_runtime, runtime_for
from celery_lease.store import WaitBounds
from tests.proxy import Proxy


def _app(url: str) -> Celery:
    """An app with a long-lease (300 s) and a short-lease (3 s) task on the database ``url``."""
    app = Celery("runtime", set_as_current=False)
    app.conf.update(broker_url="memory://", lease_database_url=url, lease_seconds=300)

    @app.task(base=LeasedTask, bind=True, shared=False, name="runtime.long")
    def long(self: LeasedTask) -> None:
        return None

    @app.task(base=LeasedTask, bind=True, shared=False, name="runtime.short", lease_seconds=3)
    def short(self: LeasedTask) -> None:
        return None

    return app


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Iterator[Celery]:
    app = _app(f"sqlite:///{tmp_path / 'runtime.db'}")
    yield app
    app_runtime(app).reset()


@pytest.mark.timeout(30)
def test_bounds_and_heartbeat_follow_the_shortest_lease_whichever_task_runs_first(
    sqlite_app: Celery,
) -> None:
    """The first use of a database by a long-lease task still gives its store the bounds,
    and its heartbeat the interval, of the shortest lease of the app's tasks on it."""
    long, short = sqlite_app.tasks["runtime.long"], sqlite_app.tasks["runtime.short"]
    first = runtime_for(sqlite_app, long.lease_config())  # a 300 s lease uses it first
    then = runtime_for(sqlite_app, short.lease_config())
    assert then is first  # one store and one heartbeat per database
    assert then.store.db.bounds == WaitBounds.for_lease(3.0)
    assert then.heartbeat.interval == short.lease_config().heartbeat_interval == 1.0


@pytest.mark.timeout(60)
def test_short_lease_renewal_through_a_partition_fails_within_its_third(pg_url: str) -> None:
    """A long-lease task used the database first: a short-lease (3 s) task's renewal through
    a partition still gives up within a third of its own lease, not of the long one."""
    proxy, via = Proxy.for_url(pg_url)
    app = _app(via)
    try:
        long, short = app.tasks["runtime.long"], app.tasks["runtime.short"]
        store = runtime_for(app, long.lease_config()).store
        store.create_schema()
        store = runtime_for(app, short.lease_config()).store
        claim = store.claim("r1", "A", task_name="runtime.short", lease_ms=3000, max_attempts=5)
        key = ("r1", "A", claim.attempt)
        assert store.heartbeat([key]).renewed == {key}
        proxy.partition()
        started = time.monotonic()
        with pytest.raises(LeaseDatabaseError):
            store.heartbeat([key])
        waited = time.monotonic() - started
        assert waited < 3.0 / 3 + 1.0, waited
    finally:
        app_runtime(app).reset()
        proxy.close()
