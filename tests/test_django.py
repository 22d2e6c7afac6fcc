"""Django: ``CELERY_LEASE_*`` settings, the lease table in the project's database, fenced_atomic.

The worker tests start real ``celery -A tests.django_site worker`` processes on
the example project (SQLite file + filesystem broker; PostgreSQL when
available). The ``fenced_atomic`` tests run Django in this process, one
database alias per test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_lease import LeaseDatabaseError, LeaseError, LeaseLost, LeaseStore
from celery_lease.contrib.django import fenced_atomic, lease_database_url
from celery_lease.events import LeaseState
from tests.helpers import REPO, Worker, held, wait_for

pytest.importorskip("django")

TASK = "tests.django_site.orders.tasks.place_order"


def _pg_entry(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }


@pytest.fixture(params=["sqlite", "postgresql"])
def django_db(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A ``DATABASES`` entry for a fresh database: a SQLite file, or PostgreSQL."""
    if request.param == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "site.sqlite3")}
    return _pg_entry(request.getfixturevalue("pg_url"))


# -- lease_database_url ------------------------------------------------------------


def test_lease_database_url_from_django_databases() -> None:
    """SQLite names its file; PostgreSQL gets psycopg, the password escaped, sslmode kept."""
    assert (
        lease_database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/app/db.sqlite3"})
        == "sqlite:////srv/app/db.sqlite3"
    )
    url = lease_database_url(
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "shop",
            "USER": "app",
            "PASSWORD": "p@ss:w/rd",
            "HOST": "db.internal",
            "PORT": "5432",
            "OPTIONS": {"sslmode": "require", "server_side_binding": True},
        }
    )
    assert url == "postgresql+psycopg://app:p%40ss%3Aw%2Frd@db.internal:5432/shop?sslmode=require"
    assert make_url(url).password == "p@ss:w/rd"
    assert lease_database_url(
        {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "root", "HOST": "h"}
    ) == ("mysql+pymysql://root@h/shop")


@pytest.mark.parametrize(
    "entry",
    [
        {"ENGINE": "django.db.backends.oracle", "NAME": "x"},
        {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    ],
)
def test_lease_database_url_refuses_what_workers_cannot_share(entry: dict[str, Any]) -> None:
    """An unsupported engine, or an in-memory SQLite database, is a clear error."""
    with pytest.raises(ImproperlyConfigured):
        lease_database_url(entry)


# -- the example project under real workers -------------------------------------------


class Site:
    """The example Django project on one database and one broker folder."""

    def __init__(self, database: dict[str, Any], tmp_path: Path) -> None:
        self.folder = tmp_path / "broker"
        (self.folder / "control").mkdir(parents=True)
        self.tmp_path = tmp_path
        self.env = {
            "DJ_DATABASE": json.dumps(database),
            "DJ_FS_DIR": str(self.folder),
            "DJANGO_SETTINGS_MODULE": "tests.django_site.settings",
        }
        self.url = lease_database_url(database)

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``python -m ARGS`` with the site's environment."""
        return subprocess.run(
            [sys.executable, "-m", *args],
            env={**os.environ, **self.env, **env, "PYTHONPATH": str(REPO)},
            cwd=str(REPO),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def worker(self, name: str = "w1", **env: str) -> Worker:
        """A ``celery -A tests.django_site worker`` (not yet waited for)."""
        return Worker(
            {**self.env, **env},
            self.tmp_path / f"{name}.log",
            name=name,
            app="tests.django_site",
            pool="prefork",
            concurrency=2,
        )

    def send(self, number: str) -> str:
        """Publish ``place_order(number)`` on the site's broker; the task id."""
        client = Celery("client", broker="filesystem://")
        client.conf.broker_transport = "celery_lease.contrib.fs_transport:Transport"
        client.conf.broker_transport_options = {
            "data_folder_in": str(self.folder),
            "data_folder_out": str(self.folder),
            "control_folder": str(self.folder / "control"),
        }
        task_id = client.send_task(TASK, args=[number]).id
        client.close()
        return str(task_id)

    def orders(self) -> list[tuple[str, int]]:
        """The rows of Django's ``orders_order`` table."""
        engine = create_engine(self.url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT number, attempt FROM orders_order")).all()
        finally:
            engine.dispose()
        return [(str(number), int(attempt)) for number, attempt in rows]


@pytest.fixture
def site(django_db: dict[str, Any], tmp_path: Path) -> Site:
    """The example project, its Django tables and lease tables migrated side by side."""
    s = Site(django_db, tmp_path)
    done = s.run("django", "migrate", "--noinput")
    assert done.returncode == 0, done.stderr
    done = s.run("celery", "-A", "tests.django_site", "lease", "migrate")
    assert done.returncode == 0, done.stderr
    assert "migrated (empty) -> " in done.stdout
    return s


def test_lease_migrate_puts_the_run_table_beside_djangos(site: Site) -> None:
    """`celery lease migrate` creates the lease tables in the project's own database."""
    engine = create_engine(site.url)
    try:
        from sqlalchemy import inspect

        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"django_migrations", "orders_order", "celery_lease_runs"} <= tables
    assert "celery_lease_alembic_version" in tables


@pytest.mark.timeout(120)
def test_leased_task_writes_model_once_under_a_django_worker(
    site: Site, workers: list[Worker]
) -> None:
    """A real worker runs the leased task: the order row and the run's success commit
    together; the same order sent again is dropped (the body does not run twice)."""
    worker = site.worker()
    workers.append(worker)
    worker.wait_ready(60)
    assert "lease database" in worker.log()
    store = LeaseStore.from_url(site.url)
    try:
        site.send("A-1")
        run_id = f"{TASK}:order:A-1"  # keys are scoped to the task name

        def status() -> str | None:
            row = store.get(run_id)
            return None if row is None else row.status

        wait_for(lambda: status() == "succeeded", 60, what="the run to succeed")
        assert site.orders() == [("A-1", 1)]
        site.send("A-1")  # a duplicate delivery of the same order
        wait_for(
            lambda: worker.log().count(" received") >= 2 and "is already succeeded" in worker.log(),
            60,
            what="the duplicate delivery to be dropped",
        )
        assert site.orders() == [("A-1", 1)]
        row = store.get(run_id)
        assert row is not None and row.status == "succeeded" and row.attempt == 1
    finally:
        store.dispose()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"CELERY_LEASE_SECONDS": -1},
            "ImproperlyConfigured: CELERY_LEASE_SECONDS must be a positive, finite number, "
            "got -1.0",
        ),
        (
            {"CELERY_LEASE_SECONDZ": 10},
            "ImproperlyConfigured: unknown setting CELERY_LEASE_SECONDZ; "
            "did you mean CELERY_LEASE_SECONDS?",
        ),
    ],
    ids=["bad-value", "typo"],
)
def test_django_worker_refuses_bad_lease_setting(
    extra: dict[str, Any], message: str, tmp_path: Path, workers: list[Worker]
) -> None:
    """CELERY_LEASE_* from Django settings are validated at worker start: one line, exit 1."""
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
    site = Site(database, tmp_path)
    worker = site.worker(DJ_EXTRA=json.dumps(extra))
    workers.append(worker)
    code = worker.proc.wait(60)
    assert code == 1
    assert f"celery-lease: worker not started: {message}" in worker.log()
    assert " ready." not in worker.log()


# -- fenced_atomic, in this process ----------------------------------------------------


@pytest.fixture(scope="module")
def django_setup() -> None:
    """Django configured in this process with the example app and no database yet."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["tests.django_site.orders"],
            DATABASES={},
            USE_TZ=True,
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        )
        django.setup()


@pytest.fixture
def alias(django_setup: None, django_db: dict[str, Any]) -> Iterator[str]:
    """A Django database alias on a fresh database, with the orders table."""
    from django.db import connections

    from tests.django_site.orders.models import Order

    name = f"t_{uuid.uuid4().hex[:8]}"
    configured = connections.configure_settings(
        {"default": connections.settings["default"], name: dict(django_db)}
    )
    connections.settings[name] = configured[name]
    with connections[name].schema_editor() as editor:
        editor.create_model(Order)
    yield name
    connections[name].close()
    del connections.settings[name]


@pytest.fixture
def lease_store(alias: str) -> Iterator[LeaseStore]:
    """The lease store on the alias's database, its schema created."""
    from django.db import connections

    store = LeaseStore.from_url(lease_database_url(connections[alias].settings_dict))
    store.create_schema()
    yield store
    store.dispose()


def _orders(alias: str) -> list[tuple[str, int]]:
    from tests.django_site.orders.models import Order

    return list(Order.objects.using(alias).values_list("number", "attempt"))


def test_fenced_atomic_commits_the_write_and_the_completion_together(
    alias: str, lease_store: LeaseStore
) -> None:
    """The ORM row and the run's success commit in one transaction; the lease is completed."""
    from tests.django_site.orders.models import Order

    lease = held(lease_store, "r1", 10.0)
    with fenced_atomic(lease, using=alias):
        Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
    row = lease_store.get("r1")
    assert row is not None and row.status == "succeeded"
    assert lease.state is LeaseState.COMPLETED
    assert _orders(alias) == [("n1", 1)]
    lease.complete()  # what LeasedTask does after the body: quietly idempotent
    # Django's connection is still Django's, in autocommit mode, and usable.
    Order.objects.using(alias).create(number="n2", attempt=0)
    assert len(_orders(alias)) == 2


def test_fenced_atomic_rolls_back_both_when_the_block_raises(
    alias: str, lease_store: LeaseStore
) -> None:
    """An error in the block rolls back the row and leaves the run running and held."""
    from tests.django_site.orders.models import Order

    lease = held(lease_store, "r1", 10.0)
    with pytest.raises(RuntimeError), fenced_atomic(lease, using=alias):
        Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
        raise RuntimeError("boom")
    row = lease_store.get("r1")
    assert row is not None and row.status == "running"
    assert lease.state is LeaseState.HELD
    assert _orders(alias) == []


def test_fenced_atomic_sends_followups_only_once_django_committed(
    alias: str, lease_store: LeaseStore
) -> None:
    """send= records the follow-ups in Django's transaction: a block that raises sends
    nothing; a committed one is published under the run's derived task id."""
    from celery import Celery

    from celery_lease.followups import Followups
    from celery_lease.runtime import app_runtime
    from tests.django_site.orders.models import Order

    app = Celery("django_followups", set_as_current=False)
    app.conf.update(broker_url="memory://", task_default_queue=f"q{uuid.uuid4().hex[:8]}")
    mail = app.signature("orders.mail", args=("n1",))
    lease = held(lease_store, "r1", 10.0, followups=Followups(app, lease_store))
    try:
        with pytest.raises(RuntimeError), fenced_atomic(lease, using=alias, send=[mail]):
            Order.objects.using(alias).create(number="n0", attempt=lease.attempt)
            raise RuntimeError("boom")
        with fenced_atomic(lease, using=alias, send=[mail]):
            Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
        with app.connection_for_read() as conn:
            queue = conn.SimpleQueue(app.conf.task_default_queue)
            message = queue.get(timeout=10)
            assert message.headers["id"] == "r1:followup:1.0"  # the first was never handed over
            assert queue.qsize() == 0
            queue.close()
        assert _orders(alias) == [("n1", 1)]
    finally:
        app_runtime(app).reset()


def test_fenced_atomic_after_a_takeover_writes_nothing(alias: str, lease_store: LeaseStore) -> None:
    """A stale owner's block is refused by the fence: LeaseLost, and the row rolls back."""
    from tests.django_site.orders.models import Order

    lease = held(lease_store, "r1", 10.0)
    lease_store.expire("r1")
    taken = lease_store.claim("r1", "other", task_name="t", lease_ms=10_000, max_attempts=5)
    assert taken.outcome == "claimed"
    with pytest.raises(LeaseLost), fenced_atomic(lease, using=alias):
        Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
    assert _orders(alias) == []
    row = lease_store.get("r1")
    assert row is not None and row.status == "running" and row.lease_owner == "other"


def test_fenced_atomic_must_be_the_outermost_transaction(
    alias: str, lease_store: LeaseStore
) -> None:
    """Inside another atomic() block it refuses: that block, not this one, would commit."""
    from django.db import transaction

    lease = held(lease_store, "r1", 10.0)
    with (
        transaction.atomic(using=alias),
        pytest.raises(LeaseError, match="outermost"),
        fenced_atomic(lease, using=alias),
    ):
        pass


def test_fenced_atomic_refuses_another_database(
    alias: str, lease_store: LeaseStore, tmp_path: Path
) -> None:
    """A lease on a different database cannot fence Django's transaction."""
    other = LeaseStore.from_url(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    other.create_schema()
    try:
        lease = held(other, "r1", 10.0)
        with (
            pytest.raises(LeaseError, match="not that Django database"),
            fenced_atomic(lease, using=alias),
        ):
            pass
    finally:
        other.dispose()


def test_fence_on_a_second_connection_is_not_atomic_with_django(
    alias: str, lease_store: LeaseStore
) -> None:
    """Why fenced_atomic exists: fence() on an engine of your own is another transaction.

    PostgreSQL: the completion commits while Django's write rolls back (a run
    succeeded with no order). SQLite: the second connection cannot even write
    while Django's transaction holds the database's write lock.
    """
    from django.db import connections, transaction

    from tests.django_site.orders.models import Order

    lease = held(lease_store, "r1", 10.0)
    url = lease_database_url(connections[alias].settings_dict)
    sqlite = url.startswith("sqlite")
    engine = create_engine(url, connect_args={"timeout": 0.2} if sqlite else {})
    try:
        with (
            pytest.raises(
                LeaseDatabaseError if sqlite else RuntimeError,
                match="locked" if sqlite else "fails",
            ),
            transaction.atomic(using=alias),
        ):
            Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
            with engine.begin() as conn:
                lease.fence(conn, complete=True)
            raise RuntimeError("the body fails after the fence")
    finally:
        engine.dispose()
    assert _orders(alias) == []
    row = lease_store.get("r1")
    assert row is not None
    assert row.status == ("running" if sqlite else "succeeded")


def test_fenced_atomic_without_complete_leaves_the_completion_to_the_task(
    alias: str, lease_store: LeaseStore
) -> None:
    """complete=False: the row commits under the fence; the run is completed afterwards."""
    from tests.django_site.orders.models import Order

    lease = held(lease_store, "r1", 10.0)
    with fenced_atomic(lease, using=alias, complete=False):
        Order.objects.using(alias).create(number="n1", attempt=lease.attempt)
    assert _orders(alias) == [("n1", 1)]
    row = lease_store.get("r1")
    assert row is not None and row.status == "running"
    assert lease.state is LeaseState.HELD
    lease.complete()
    row = lease_store.get("r1")
    assert row is not None and row.status == "succeeded"


def test_fenced_atomic_wraps_each_django_connection_once(
    alias: str, lease_store: LeaseStore
) -> None:
    """Blocks on one Django connection share one wrapper (SQLAlchemy's connect-time work
    runs once); after Django reconnects, the next block wraps the new connection."""
    from django.db import connections

    from tests.django_site.orders.models import Order

    django_connection = connections[alias]
    engines = []
    for number, run_id in (("n1", "r1"), ("n2", "r2"), ("n3", "r3")):
        if number == "n3":
            django_connection.close()
        lease = held(lease_store, run_id, 10.0)
        with fenced_atomic(lease, using=alias):
            Order.objects.using(alias).create(number=number, attempt=lease.attempt)
        engines.append(django_connection._celery_lease_engine[1])
        row = lease_store.get(run_id)
        assert row is not None and row.status == "succeeded"
    assert engines[0] is engines[1] and engines[2] is not engines[0]
    assert len(_orders(alias)) == 3
