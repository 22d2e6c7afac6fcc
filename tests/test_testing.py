"""``celery_lease.testing``: the helpers users test their own leased tasks with."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_lease import LeaseBusy, LeasedTask, LeaseError, LeaseLost, LeaseStore, testing
from celery_lease.runtime import store_for
from celery_lease.store import RunNotFound
from celery_lease.testing import lease_database_url, lease_store  # noqa: F401 - fixtures


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    """An app whose leases live in a temp SQLite file, tasks run eagerly."""
    app = Celery("usersuite", set_as_current=False)
    app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)
    testing.use_lease_database(app, tmp_path / "leases.sqlite3")
    yield app
    testing.shutdown_leases(app)


def test_lease_store_at_creates_the_table(tmp_path: Path) -> None:
    """lease_store_at gives a working store on a new SQLite file."""
    store = testing.lease_store_at(tmp_path / "x.sqlite3")
    assert store.has_schema() and (tmp_path / "x.sqlite3").exists()
    store.dispose()


def test_temporary_lease_store_is_removed_afterwards() -> None:
    """temporary_lease_store works inside the block and leaves no file behind."""
    with testing.temporary_lease_store() as store:
        assert store.has_schema()
        path = Path(str(store.engine.url.database))
        assert path.exists()
    assert not path.exists()


def test_fixtures_give_a_fresh_store(lease_store: LeaseStore, lease_database_url: str) -> None:  # noqa: F811
    """The lease_store fixture is empty, has its table, and sits at lease_database_url."""
    assert lease_store.has_schema() and lease_store.reads.list_runs() == []
    assert lease_store.engine.url.render_as_string() == lease_database_url


def test_a_misspelled_setting_is_refused_as_the_worker_refuses_it(tmp_path: Path) -> None:
    """use_lease_database(app, path, lease_max_attempt=1): refused with the close match (the
    typo was accepted, and the run got the default 5 attempts)."""
    app = Celery("usersuite", set_as_current=False)
    with pytest.raises(ImproperlyConfigured, match="did you mean lease_max_attempts"):
        testing.use_lease_database(app, tmp_path / "leases.sqlite3", lease_max_attempt=1)
    testing.shutdown_leases(app)


def test_eager_delay_runs_under_a_lease(app: Celery) -> None:
    """After use_lease_database, .delay() runs in process and the run ends succeeded."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="usersuite.add")
    def add(self: LeasedTask, a: int, b: int) -> int:
        assert self.lease.attempt == 1
        return a + b

    result = add.delay(2, 3)
    assert result.get() == 5
    record = testing.run_record(store_for(app), result.id)
    assert record.status == "succeeded"


def test_steal_lease_drives_the_lease_lost_path(app: Celery) -> None:
    """A lease stolen mid-body makes completion fail with automation_run_lease_lost."""
    store = store_for(app)
    thieves: list[str] = []

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="usersuite.charge",
        lease_lost_policy="abort",
        lease_key=lambda order_id: f"charge-{order_id}",
    )
    def charge(self: LeasedTask, order_id: int) -> str:
        thieves.append(testing.steal_lease(store, self.lease.run_id).owner)
        return "charged"

    with pytest.raises(LeaseLost) as caught:
        charge.delay(7)
    assert str(caught.value).startswith("automation_run_lease_lost")
    record = testing.run_record(store, "usersuite.charge:charge-7")
    assert record.status == "running" and record.attempt == 2
    assert record.lease_owner == thieves[0]


def test_heartbeat_now_surfaces_a_stolen_lease_to_check(app: Celery) -> None:
    """heartbeat_now from another thread makes self.lease.check() raise after a steal."""
    store = store_for(app)

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="usersuite.watch",
        lease_interrupt=False,
        lease_lost_policy="abort",
    )
    def watch(self: LeasedTask) -> str:
        self.lease.check()  # still ours
        testing.steal_lease(store, self.lease.run_id)
        ticker = threading.Thread(target=testing.heartbeat_now, args=(app,))
        ticker.start()
        ticker.join(10)
        self.lease.check()  # raises: the heartbeat saw the takeover
        return "unreachable"

    with pytest.raises(LeaseLost, match="heartbeat refused"):
        watch.delay()


def test_hold_lease_makes_a_delivery_busy(app: Celery) -> None:
    """A run held by another worker is refused: the body does not run."""
    store = store_for(app)
    ran: list[int] = []

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="usersuite.once",
        lease_busy_policy="fail",
        lease_key=lambda n: f"once-{n}",
    )
    def once(self: LeasedTask, n: int) -> int:
        ran.append(n)
        return n

    testing.hold_lease(store, "usersuite.once:once-1", task_name="usersuite.once", lease_seconds=60)
    with pytest.raises(LeaseBusy):
        once.delay(1)
    assert ran == []


def test_expire_lease_rejects_runs_without_a_lease(lease_store: LeaseStore) -> None:  # noqa: F811
    """expire_lease raises for unknown and finished runs, and expires a running one."""
    with pytest.raises(RunNotFound):
        testing.expire_lease(lease_store, "nope")
    claim = testing.hold_lease(lease_store, "r1", task_name="t")
    lease_store.complete("r1", claim.owner, claim.attempt)
    with pytest.raises(LeaseError, match="succeeded, not running"):
        testing.expire_lease(lease_store, "r1")
    testing.hold_lease(lease_store, "r2", task_name="t")
    testing.expire_lease(lease_store, "r2")
    record = testing.run_record(lease_store, "r2")
    assert record.lease_expires_at is not None
    assert record.lease_expires_at <= lease_store.now_ms()


def test_steal_lease_works_when_attempts_are_spent(lease_store: LeaseStore) -> None:  # noqa: F811
    """A run on its last attempt can still be stolen (max_attempts grows by one)."""
    testing.hold_lease(lease_store, "r1", task_name="t", max_attempts=1)
    stolen = testing.steal_lease(lease_store, "r1", owner="thief:1:x")
    assert (stolen.outcome, stolen.attempt) == ("claimed", 2)
    record = testing.run_record(lease_store, "r1")
    assert record.lease_owner == "thief:1:x" and record.max_attempts == 2


def test_fence_on_the_lease_transaction_follows_use_lease_database(
    app: Celery, tmp_path: Path
) -> None:
    """The quickstart then the testing page: ``self.lease.transaction()`` is on the database
    use_lease_database chose, so ``fence(conn)`` holds; an engine built at import time on the
    old URL is another database, and fence() on it says so (LeaseUsageError), not LeaseLost."""
    from sqlalchemy import create_engine, text

    from celery_lease import LeaseUsageError

    old = testing.lease_store_at(tmp_path / "before.sqlite3")  # the import-time database
    import_time_engine = create_engine(old.engine.url)
    seen: list[str] = []

    @app.task(base=LeasedTask, bind=True, shared=False, name="usersuite.capture")
    def capture(self: LeasedTask, order_id: int) -> str:
        with self.lease.transaction() as conn:
            self.lease.fence(conn)
            conn.execute(text("CREATE TABLE IF NOT EXISTS captures (order_id INTEGER)"))
            conn.execute(text("INSERT INTO captures VALUES (:o)"), {"o": order_id})
        try:
            with import_time_engine.begin() as conn:
                self.lease.fence(conn)
        except LeaseUsageError as exc:
            seen.append(str(exc))
        self.lease.check()  # the lease is still held
        return "captured"

    assert capture.delay(42).get() == "captured"
    assert len(seen) == 1 and "not on the lease database" in seen[0]
    store = store_for(app)
    assert [run.status for run in store.reads.list_runs()] == ["succeeded"]
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT order_id FROM captures")).scalars().all() == [42]
    import_time_engine.dispose()
    old.dispose()
