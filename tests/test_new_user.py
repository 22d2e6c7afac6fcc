"""What a new user runs into first (issue 28, finding 10), with real workers.

``fence()`` on an engine of their own (another database than the lease's) fails at
once with a usage error saying so, never retried and never pointing at ``migrate``;
a direct call that raises leaves its row ``failed``; a worker with no rate-limited
task runs no flow pump, so a database outage is not logged every second; a missing
extra stops the worker with one line naming it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from celery_lease import LeasedTask
from celery_lease.config import sqlite_url
from celery_lease.errors import LeaseDatabaseError
from celery_lease.runtime import store_for
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.conftest import PG_ENV
from tests.helpers import Worker, require, scratch_database, wait_for
from tests.test_canvas import sig
from tests.test_worker import _start_refused

TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
FAST = {"lease_retry_backoff": 0.1, "lease_retry_backoff_max": 0.2}


def assert_usage_error_at_once(cluster: Cluster, url: str) -> None:
    """``fence_other(url)``: FAILURE on the first attempt, ``lease_usage_error``."""
    result = sig(cluster, "fence_other", url).apply_async()
    result.get(timeout=60, propagate=False)
    assert result.state == "FAILURE"
    error = result.result
    assert type(error).__name__ == "LeaseUsageError", repr(error)
    assert "not on the lease database" in str(error) and "migrate" not in str(error)
    row = cluster.store.get(result.id)
    assert row is not None and row.status == "failed", row
    assert row.attempt == 1 and row.failure_code == "lease_usage_error", row
    assert len(cluster.effects(result.id, "start")) == 1


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_fence_on_a_sqlite_file_of_its_own_is_a_usage_error_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``fence()`` on an engine of the user's own SQLite file (another file than the lease
    database's, or another database kind): ``LeaseUsageError`` before any SQL, attempt 1,
    not ``missing_table`` retried ``lease_max_attempts`` times nor "postgresql unavailable"."""
    cluster.start("w1", conf=FAST)
    assert_usage_error_at_once(cluster, sqlite_url(tmp_path / "app.sqlite3"))


@PG_REDIS
@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["same", "spelled-otherwise"])
def test_fence_on_another_postgresql_database_is_a_usage_error_at_once(
    cluster: Cluster, host: str
) -> None:
    """``fence()`` on another database of the lease database's server (told apart by its
    URL, or, reached by another host name, by the run table it lacks): a usage error on
    the first attempt."""
    admin = require(os.environ.get(PG_ENV), f"PostgreSQL ({PG_ENV})")
    cluster.start("w1", conf=FAST)
    with scratch_database(admin, prefix="cl_app_") as other:
        url = make_url(other)
        if host != "same":
            url = url.set(host="localhost")
        assert_usage_error_at_once(cluster, url.render_as_string(hide_password=False))


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("direct", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        lease_database_url=sqlite_url(tmp_path / "leases.sqlite3"),
        broker_connection_retry_on_startup=True,
    )
    store_for(app).create_schema()
    yield app
    store_for(app).engine.dispose()


def test_direct_call_that_raises_leaves_its_row_failed(app: Celery) -> None:
    """A direct call (``task(...)``) and an eager ``apply()`` that raise end their run
    ``failed``, not ``retrying`` for good (counted live by ``top``, ``stats``, the web)."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="direct.fails", lease_key=lambda n: n)
    def fails(self: LeasedTask, n: int) -> None:
        raise ValueError(f"bad input {n}")

    with pytest.raises(ValueError):
        fails(1)
    row = store_for(app).get("direct.fails:1")
    assert row is not None and row.status == "failed", row
    assert row.failure_code == "exception:ValueError"
    result = fails.apply((2,))
    assert result.failed()
    row = store_for(app).get("direct.fails:2")
    assert row is not None and row.status == "failed", row


@pytest.mark.timeout(90)
def test_worker_without_rate_limited_task_runs_no_flow_pump_in_an_outage(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """A worker whose tasks have no rate limit, started while its lease database refuses
    connections: no flow pump runs, so nothing logs "flow pump" once a second."""
    url = "postgresql+psycopg://app:pw@127.0.0.1:9/app?connect_timeout=1"
    folder = tmp_path / "broker"
    (folder / "control").mkdir(parents=True)
    env = {"CL_LEASE_DB": url, "CL_BROKER_URL": "filesystem://", "CL_FS_DIR": str(folder)}
    worker = Worker(env, tmp_path / "w.log", name="w", app="tests.plainapp")
    workers.append(worker)
    worker.wait_ready(60)
    time.sleep(3.5)  # three pump ticks would log here
    assert "flow pump" not in worker.log(), worker.log()[-3000:]


def test_flow_pump_logs_an_outage_once_and_its_end(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pump whose database is down logs the outage once, then once when it answers."""
    from celery_lease import flow

    monkeypatch.setattr(flow, "PUMP_TICK", 0.01)
    pump = flow.FlowPump(app, store_for(app))
    ticks: list[int] = []
    done = threading.Event()

    def tick() -> Any:
        ticks.append(1)
        if len(ticks) <= 5:
            raise LeaseDatabaseError("postgresql unavailable: refused", True, "unavailable")
        done.set()
        return None

    monkeypatch.setattr(pump, "tick", tick)
    with caplog.at_level(logging.WARNING, logger="celery_lease.flow"):
        pump.wake()
        assert done.wait(10)
        wait_for(lambda: pump._thread is None, 10, what="the pump to end")
    lines = [r.getMessage() for r in caplog.records if "flow pump" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "unavailable" in lines[0] and "answers again" in lines[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("setting", "module", "extra"),
    [
        ("lease_metrics", "prometheus_client", "celery-lease[prometheus]"),
        ("lease_tracing", "opentelemetry", "celery-lease[otel]"),
    ],
)
def test_missing_extra_stops_the_worker_in_one_line(
    sqlite_url: str, setting: str, module: str, extra: str
) -> None:
    """``lease_metrics``/``lease_tracing`` = True without the extra: ``celery worker``
    exits 1 with one line naming the extra, no traceback (it was 72 lines)."""
    line = _start_refused(
        {
            "CL_LEASE_DB": sqlite_url,
            "CL_CONF": f'{{"{setting}": true}}',
            "CL_SHIM_HIDE_MODULE": module,
        },
        shims=True,
    )
    assert f"pip install '{extra}'" in line, line
