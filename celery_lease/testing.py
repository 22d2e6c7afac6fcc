"""Helpers for testing your own leased tasks (with pytest or anything else).

Everything here runs against a real SQLite file, never a fake of the store.
Typical use in a test suite::

    from celery_lease import testing

    def test_charge_refuses_stale_commit(tmp_path):
        store = testing.use_lease_database(app, tmp_path / "leases.sqlite3")

        @app.task(base=LeasedTask, bind=True, lease_lost_policy="abort")
        def charge(self, order_id):
            testing.steal_lease(store, self.lease.run_id)  # another worker takes over
            return "charged"

        with pytest.raises(LeaseLost):
            charge(7)

Or add ``pytest_plugins = ["celery_lease.testing"]`` to your ``conftest.py``
for the ``lease_store`` and ``lease_database_url`` fixtures. A ``conftest.py``
may import this module before it lists it: the module has no ``assert`` of its
own, and its docstring says PYTEST_DONT_REWRITE, so pytest does not warn that it
cannot rewrite it.

:func:`use_lease_database` points an app at a fresh database (and, by default,
runs tasks eagerly, in process). :func:`expire_lease` ends a running lease as if
its worker had died; :func:`steal_lease` also claims it as another worker, so
the original owner's heartbeat and guarded completion are refused: the
lease-lost path. :func:`hold_lease` makes a run look busy on another worker.
:func:`heartbeat_now` runs one heartbeat tick without waiting for the thread.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery

from .config import check_setting_names, sqlite_url
from .errors import LeaseError
from .owner import Owner
from .runtime import app_config, app_runtime, runtime_for, store_for
from .store import ClaimResult, HeartbeatResult, LeaseStore, RunNotFound, RunRecord

__all__ = [
    "expire_lease",
    "heartbeat_now",
    "hold_lease",
    "lease_store_at",
    "run_record",
    "shutdown_leases",
    "sqlite_url",
    "steal_lease",
    "temporary_lease_store",
    "use_lease_database",
]


def lease_store_at(path: str | os.PathLike[str]) -> LeaseStore:
    """A store on the SQLite file ``path``, with its table created. Dispose its engine after."""
    store = LeaseStore.from_url(sqlite_url(path))
    store.create_schema()
    return store


@contextmanager
def temporary_lease_store() -> Iterator[LeaseStore]:
    """A store on a SQLite file in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="celery-lease-") as folder:
        store = lease_store_at(Path(folder) / "leases.sqlite3")
        try:
            yield store
        finally:
            store.dispose()


def use_lease_database(
    app: Celery,
    path_or_url: str | os.PathLike[str],
    *,
    eager: bool = True,
    **settings: Any,
) -> LeaseStore:
    """Point ``app`` at a lease database and return the store its tasks will use.

    ``path_or_url`` is a SQLite file path or any lease database URL. Extra
    ``lease_*`` settings are applied too (e.g. ``lease_max_attempts=1``); a key
    celery-lease does not know raises ``ImproperlyConfigured``. With
    ``eager`` (default) ``task_always_eager`` and ``task_eager_propagates`` are
    set, so ``.delay()`` runs in process and raises what the task raises.
    Cached settings on the app and its tasks are dropped so the change applies.
    Call :func:`shutdown_leases` at teardown.
    """
    raw = os.fspath(path_or_url)
    url = raw if "://" in raw else sqlite_url(raw)
    app.conf.update(lease_database_url=url, **settings)
    check_setting_names(app)  # a misspelled setting is refused, as by the worker
    if eager:
        app.conf.update(task_always_eager=True, task_eager_propagates=True)
    app_runtime(app).forget_settings()
    store = store_for(app)
    store.create_schema()
    return store


def shutdown_leases(app: Celery) -> None:
    """Stop the app's heartbeat threads and close its lease database connections."""
    app_runtime(app).reset()


def run_record(store: LeaseStore, run_id: str) -> RunRecord:
    """The run row; raises :class:`~celery_lease.store.RunNotFound` when there is none."""
    record = store.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    return record


def expire_lease(store: LeaseStore, run_id: str) -> None:
    """End the running lease of ``run_id`` now, as if its worker had died.

    Its holder keeps running until its heartbeat or a guarded write notices;
    any worker may now take the run over. Raises :class:`LeaseError` when the
    run is not running.
    """
    if not store.expire(run_id):
        status = run_record(store, run_id).status
        raise LeaseError(f"run {run_id!r} is {status}, not running: no lease to expire")


def steal_lease(store: LeaseStore, run_id: str, owner: str | None = None) -> ClaimResult:
    """Expire the lease of ``run_id`` and claim it as another worker (``owner``).

    Afterwards the original holder's heartbeat, ``fence`` and completion are
    refused with ``automation_run_lease_lost``. The thief's attempt is one
    higher; if the run had no attempts left, its ``max_attempts`` is raised by
    one so the takeover can happen. Returns the thief's claim.
    """
    record = run_record(store, run_id)
    expire_lease(store, run_id)
    result = store.claim(
        run_id,
        owner or Owner.new("thief").format(),
        task_name=record.task_name,
        lease_ms=record.lease_ms,
        max_attempts=max(record.max_attempts, record.attempt + 1),
        concurrency_key=record.concurrency_key,
        payload=record.payload,
        payload_content_type=record.payload_content_type,
    )
    if result.outcome != "claimed":
        raise LeaseError(f"could not steal run {run_id!r}: claim was {result.outcome}")
    return result


def hold_lease(
    store: LeaseStore,
    run_id: str,
    *,
    task_name: str,
    lease_seconds: float = 60.0,
    max_attempts: int = 5,
    owner: str | None = None,
) -> ClaimResult:
    """Claim ``run_id`` as another worker, so a delivery of it finds the run busy."""
    result = store.claim(
        run_id,
        owner or Owner.new("other-worker").format(),
        task_name=task_name,
        lease_ms=max(1, round(lease_seconds * 1000)),
        max_attempts=max_attempts,
    )
    if result.outcome != "claimed":
        raise LeaseError(f"could not hold run {run_id!r}: claim was {result.outcome}")
    return result


def heartbeat_now(app: Celery) -> HeartbeatResult | None:
    """Run one heartbeat tick for the app's leases in this process, without waiting.

    Call it from a thread other than the task body when ``lease_interrupt`` is
    on: a tick that finds the lease lost interrupts the body.
    """
    return runtime_for(app, app_config(app)).heartbeat.beat_once()


try:
    import pytest
except ImportError:  # pragma: no cover - the helpers above work without pytest
    pass
else:

    @pytest.fixture
    def lease_database_url(tmp_path: Path) -> str:
        """A SQLite lease database URL in the test's temporary directory."""
        return sqlite_url(tmp_path / "leases.sqlite3")

    @pytest.fixture
    def lease_store(lease_database_url: str) -> Iterator[LeaseStore]:
        """A :class:`LeaseStore` on ``lease_database_url``, table created, disposed after."""
        store = LeaseStore.from_url(lease_database_url)
        store.create_schema()
        yield store
        store.dispose()
