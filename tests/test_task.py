"""LeasedTask in an in-process worker: statement counts and the lease handle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_lease import InvalidLeaseKey, LeasedTask, LeaseError, current_lease
from celery_lease.runtime import store_for

from .helpers import driver_statements


@pytest.fixture
def app(lease_db_url: str) -> Iterator[Celery]:
    app = Celery("inproc", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        lease_database_url=lease_db_url,
        broker_connection_retry_on_startup=True,
    )
    store_for(app).create_schema()
    yield app
    store_for(app).engine.dispose()


def test_uncontended_run_issues_two_statements(app: Celery) -> None:
    """An uncontended run issues exactly 2 SQL statements: claim and complete."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="inproc.add")
    def add(self: LeasedTask, a: int, b: int) -> int:
        assert self.lease.attempt == 1
        return a + b

    store = store_for(app)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert store_for(app) is store  # the same store the worker uses
        # Counted at the driver, below SQLAlchemy: the claim and the completion
        # run on the raw DBAPI cursor. A warm-up run opens the connections.
        with driver_statements(store.engines) as seen:
            assert add.delay(1, 1).get(timeout=20) == 2
            seen.clear()
            result = add.delay(2, 3)
            assert result.get(timeout=20) == 5
    task_thread = {tid for tid, stmt in seen if stmt.lstrip().upper().startswith("INSERT")}
    statements = [stmt for tid, stmt in seen if tid in task_thread]
    kinds = [stmt.split()[0].upper() for stmt in statements]
    if store.db.dialect == "mysql":
        # No INSERT .. ON CONFLICT .. RETURNING: the claim is a short locked transaction.
        assert kinds == ["SELECT", "INSERT", "SELECT", "UPDATE"], statements
    else:
        assert kinds == ["INSERT", "UPDATE"], statements
    row = store.get(result.id)
    assert row is not None and row.status == "succeeded" and row.attempt == 1


def test_direct_call_runs_under_a_lease(app: Celery) -> None:
    """Calling the task like a function still claims and completes a run."""

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="inproc.direct", lease_key=lambda x: f"k-{x}"
    )
    def direct(self: LeasedTask, x: int) -> str:
        return self.lease.run_id

    assert direct(4) == "inproc.direct:k-4"
    row = store_for(app).get("inproc.direct:k-4")
    assert row is not None and row.status == "succeeded"
    assert direct(4) is None  # a finished run does not run again


def test_current_lease_outside_a_task_raises() -> None:
    """current_lease() outside a leased body is a clear LeaseError."""
    with pytest.raises(LeaseError, match="no lease"):
        current_lease()


def test_body_error_is_recorded_sanitized(app: Celery, tmp_path: Path) -> None:
    """A failing body leaves a sanitized last_error and an exception failure code."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="inproc.boom", lease_max_attempts=1)
    def boom(self: LeasedTask) -> None:
        raise RuntimeError("cannot reach postgresql://app:hunter2@db.internal/prod")

    result = boom.apply()
    assert result.failed()
    row = store_for(app).get(result.id)
    assert row is not None and row.status == "failed"
    assert row.failure_code == "exception:RuntimeError"
    assert row.last_error is not None and "hunter2" not in row.last_error
    assert "RuntimeError" in row.last_error


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_transient_claim_errors_end_the_run_failed_when_spent(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim failing with a transient database error is re-published CLAIM_DB_RETRIES times,
    then, the database being writable again, the run ends failed with lease_db_unavailable
    and the delivery FAILURE; the body never runs."""
    from celery_lease.errors import LeaseDatabaseError
    from celery_lease.run import republish as task_module

    monkeypatch.setattr(task_module, "CLAIM_DB_RETRIES", 3)
    app.conf.update(lease_retry_backoff=0.01, lease_retry_backoff_max=0.02)
    ran: list[int] = []

    @app.task(base=LeasedTask, bind=True, shared=False, name="inproc.unlucky")
    def unlucky(self: LeasedTask) -> None:
        ran.append(1)

    store = store_for(app)
    claims: list[str] = []

    def refuse(run_id: str, *args: object, **kwargs: object) -> None:
        claims.append(run_id)
        raise LeaseDatabaseError("postgresql deadlock: injected", True, "deadlock")

    monkeypatch.setattr(store, "claim", refuse)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = unlucky.delay()
        with pytest.raises(LeaseDatabaseError, match=r"^lease_db_unavailable"):
            result.get(timeout=30)
    assert len(claims) == 4 and ran == []  # the first try and 3 re-publications
    row = store.get(result.id)
    assert row is not None and (row.status, row.failure_code) == ("failed", "lease_db_unavailable")


@pytest.mark.timeout(10)
def test_leased_task_adds_only_the_public_lease_api_to_task_classes() -> None:
    """``LeasedTask`` adds to ``celery.Task`` exactly its documented public API (``lease``,
    ``lease_config``, ``lease_run_id``) and no private name a user's task could collide with;
    its docstring names them."""
    import celery

    added = set(dir(LeasedTask)) - set(dir(celery.Task))
    assert added == {"lease", "lease_config", "lease_run_id"}
    doc = LeasedTask.__doc__ or ""
    assert all(f"``{name}" in doc for name in added)


def test_key_check_at_call_time_covers_kwargs_and_signature_mismatch(app: Celery) -> None:
    """delay()/apply_async() check lease_key with the call's arguments: also when they are
    given as kwargs only (the check used to run only when args was not None), and a key
    whose signature does not match the call is InvalidLeaseKey naming the task and the
    mismatch, while a TypeError raised inside the key function is the key's own error."""

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="inproc.none_key", lease_key=lambda x: None
    )
    def none_key(self: LeasedTask, x: int) -> int:
        return x

    @app.task(base=LeasedTask, bind=True, shared=False, name="inproc.narrow", lease_key=lambda n: n)
    def narrow(self: LeasedTask, n: int, secs: float = 0.0) -> int:
        return n

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="inproc.buggy",
        lease_key=lambda n: len(n),
    )
    def buggy(self: LeasedTask, n: int) -> int:
        return n

    with pytest.raises(InvalidLeaseKey, match="NoneType"):
        none_key.apply_async(kwargs={"x": 1})
    with pytest.raises(InvalidLeaseKey, match=r"inproc\.narrow: lease_key\(n\) does not match"):
        narrow.delay(2, secs=3)
    with pytest.raises(InvalidLeaseKey, match=r"inproc\.narrow"):
        narrow.apply_async(kwargs={"n": 2, "secs": 3})
    with pytest.raises(TypeError) as raised:
        buggy.delay(2)  # len(2): the key function's own bug, not a mismatch
    assert not isinstance(raised.value, InvalidLeaseKey)
    assert narrow.lease_run_id(2) == "inproc.narrow:2"
