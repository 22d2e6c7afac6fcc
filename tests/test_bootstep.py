"""The worker's lease services start and stop with the bootstep, under ``celery worker``
and under ``celery.contrib.testing`` (the ``celery_worker`` fixture), which sends no
``worker_ready`` or ``worker_shutting_down`` signal."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_lease import LeasedTask, testing
from celery_lease.runtime import store_for

from .helpers import wait_for

pytestmark = pytest.mark.timeout(60)


def _threads() -> set[str]:
    return {thread.name for thread in threading.enumerate()}


@pytest.fixture
def celery_app(tmp_path: Path) -> Iterator[Celery]:
    """Overrides celery.contrib.pytest's fixture: a leased app on a SQLite file, as a user's
    own conftest.py would (the ``celery_worker`` fixture then starts a worker of it)."""
    app = Celery("bootstep", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        broker_connection_retry_on_startup=True,
    )

    @app.task(base=LeasedTask, bind=True, shared=False, name="bootstep.add")
    def add(self: LeasedTask, a: int, b: int) -> int:
        return a + b

    import celery.contrib.testing.tasks  # noqa: F401 - the fixture's ping task

    store = testing.use_lease_database(
        app, tmp_path / "leases.sqlite3", eager=False, lease_seconds=3, lease_sweep_interval=0.2
    )
    yield app
    store.dispose()
    testing.shutdown_leases(app)


def test_celery_worker_fixture_runs_the_sweeper_and_resigns_it(
    celery_app: Celery, celery_worker: Any
) -> None:
    """Under the celery_worker fixture the in-worker sweeper starts with the bootstep (it
    leads the database's sweeper and records sweeps) and the leased task runs under a
    lease."""
    store = store_for(celery_app)
    assert celery_app.tasks["bootstep.add"].delay(2, 3).get(timeout=20) == 5
    (leader,) = store.leaders.list_all()
    assert leader.name == "sweeper" and leader.live
    last = wait_for(store.reads.last_sweep, 10, what="the in-worker sweeper's first sweep")
    assert last["name"] == "worker"
    assert "celery-lease-worker-sweeper" in _threads()


def test_start_worker_stops_the_services_and_hands_back_cold(tmp_path: Path) -> None:
    """Leaving start_worker (a cold stop, from the bootstep's point of view) stops the
    sweeper's threads, resigns its lead (a standby takes it at once), and hands back a
    lease the worker still holds; no signal receiver is involved."""
    app = Celery("bootstep_cold", set_as_current=False)
    app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)

    @app.task(base=LeasedTask, bind=True, shared=False, name="bootstep.noop")
    def noop(self: LeasedTask) -> None:
        return None

    store = testing.use_lease_database(app, tmp_path / "leases.sqlite3", eager=False)
    from celery_lease.runtime import app_runtime, worker_id

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert store.leaders.list_all()[0].live
        # A run this worker holds (as if a body were running when the worker stopped).
        owner = f"h:1:x.{worker_id(app)}"
        claim = store.claim("held", owner, task_name="bootstep.noop", lease_ms=60_000,
                            max_attempts=5)  # fmt: skip
        assert claim.outcome == "claimed"
        assert app_runtime(app).worker is not None
    wait_for(lambda: "celery-lease-worker-sweeper" not in _threads(), 5, what="threads to end")
    (leader,) = store.leaders.list_all()
    assert not leader.live  # resigned, not left to expire
    row = store.get("held")
    assert row is not None and row.status == "retrying"  # handed back, available now
    testing.shutdown_leases(app)
