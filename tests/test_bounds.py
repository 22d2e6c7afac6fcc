"""Bounded waits on lease connections, and the store behind PgBouncer (transaction pooling)."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from celery_lease.errors import LeaseDatabaseError
from celery_lease.store import LeaseStore, WaitBounds
from tests.helpers import plain_engine
from tests.proxy import Proxy


def _claim(store: LeaseStore, run_id: str, owner: str, lease_ms: int = 60_000) -> Any:
    return store.claim(run_id, owner, task_name="t", lease_ms=lease_ms, max_attempts=5)


def test_bounds_derive_from_the_lease() -> None:
    """Every bound is a fixed fraction of lease_seconds; a heartbeat never waits past a third."""
    b = WaitBounds.for_lease(30.0)
    assert (b.statement, b.lock, b.client, b.connect) == (7.5, 5.0, 10.0, 7.5)
    short = WaitBounds.for_lease(2.0)
    assert short.client == pytest.approx(2.0 / 3) and short.connect == 2.0
    long = WaitBounds.for_lease(86_400.0)
    assert (long.statement, long.client, long.connect) == (60.0, 90.0, 30.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("db", ["pg_url", "pgbouncer_url", "mysql_url"])
def test_takeover_behind_frozen_fence_reports_busy_within_lock_bound(
    request: pytest.FixtureRequest, db: str
) -> None:
    """A takeover claim of a run whose row is held by an open fenced transaction (a frozen
    worker) waits at most the lock bound, then reports busy; it is not 'unreachable'."""
    url = request.getfixturevalue(db)
    store = LeaseStore.from_url(url, lease_seconds=4.0)  # lock bound 0.67 s (MySQL: 1 s)
    store.create_schema()
    first = _claim(store, "r1", "A", lease_ms=300)
    live = _claim(store, "r2", "A")
    holder = plain_engine(url)
    try:
        with holder.connect() as conn:
            tx = conn.begin()
            store.fence(conn, "r1", "A", first.attempt)  # row lock held from here
            store.fence(conn, "r2", "A", live.attempt)
            time.sleep(0.6)  # the lease expires by the database clock
            started = time.monotonic()
            taken = _claim(store, "r1", "B")
            waited = time.monotonic() - started
            beat_started = time.monotonic()
            with pytest.raises(LeaseDatabaseError):
                store.heartbeat([("r2", "A", live.attempt)])  # its own frozen fence
            beat_waited = time.monotonic() - beat_started
            tx.rollback()
    finally:
        holder.dispose()
    # MySQL's lock wait is whole seconds, at least one.
    lock = (
        max(1, math.ceil(store.db.bounds.lock))
        if store.db.dialect == "mysql"
        else store.db.bounds.lock
    )
    assert taken.outcome == "busy" and taken.reason == "locked", taken
    assert waited < lock + 1.5, waited
    assert beat_waited < lock + 1.5, beat_waited
    after = _claim(store, "r1", "B")  # the holder is gone: the takeover goes through
    assert after.outcome == "claimed" and after.attempt == first.attempt + 1
    store.dispose()


@pytest.mark.timeout(60)
def test_heartbeat_through_a_partition_fails_within_client_bound(pg_url: str) -> None:
    """A heartbeat whose packets are silently dropped fails after the client bound instead
    of hanging in a socket read; after the partition heals the next one renews."""
    proxy, via = Proxy.for_url(pg_url)
    store = LeaseStore.from_url(via, lease_seconds=3.0)  # client bound 1 s
    try:
        store.create_schema()
        claim = _claim(store, "r1", "A")
        key = ("r1", "A", claim.attempt)
        assert store.heartbeat([key]).renewed == {key}
        proxy.partition()
        started = time.monotonic()
        with pytest.raises(LeaseDatabaseError):
            store.heartbeat([key])
        waited = time.monotonic() - started
        assert waited < store.db.bounds.client + 1.0, waited
        started = time.monotonic()
        with pytest.raises(LeaseDatabaseError):
            store.heartbeat([key])  # a new connection: the connect is bounded too
        assert time.monotonic() - started < store.db.bounds.connect + store.db.bounds.client + 1.0
        proxy.heal()
        assert store.heartbeat([key]).renewed == {key}
    finally:
        store.dispose()
        proxy.close()


def test_no_setting_outlives_its_transaction(pgbouncer_url: str) -> None:
    """Through PgBouncer the timeouts hold inside each lease transaction and are gone after:
    nothing is left on the pooled server session."""
    store = LeaseStore.from_url(pgbouncer_url, lease_seconds=8.0, pool_size=1)
    other = plain_engine(pgbouncer_url)
    try:
        with store.engine.begin() as conn:
            assert conn.execute(text("SHOW lock_timeout")).scalar() in ("1333ms", "1333")
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "2s"
        with other.connect() as conn:
            for _ in range(3):
                assert conn.execute(text("SHOW lock_timeout")).scalar() == "0"
                assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
                conn.rollback()
    finally:
        store.dispose()
        other.dispose()


@pytest.mark.timeout(120)
def test_hot_path_past_prepare_threshold_through_pgbouncer(
    pgbouncer_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Claims, heartbeats and completions through PgBouncer in transaction mode, each run
    far more than psycopg's prepare_threshold (5) times on each pooled connection, from
    several threads at once so they land on different server connections: nothing fails
    and nothing is logged."""
    store = LeaseStore.from_url(pgbouncer_url, pool_size=2, max_overflow=0)
    store.create_schema()
    errors: list[BaseException] = []

    def drive(thread: int) -> None:
        for i in range(25):
            run_id, owner = f"t{thread}-{i}", f"owner-{thread}"
            try:
                claim = _claim(store, run_id, owner)
                assert claim.outcome == "claimed", claim
                store.heartbeat([(run_id, owner, claim.attempt)])
                store.complete(run_id, owner, claim.attempt)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=drive, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
    store.dispose()
    assert errors == [], errors[:3]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(("db", "pooled"), [("pg_url", False), ("pgbouncer_url", True)])
def test_pooler_detected_at_connect(request: pytest.FixtureRequest, db: str, pooled: bool) -> None:
    """Directly connected, psycopg prepares as usual and the timeouts are session settings;
    through PgBouncer nothing is prepared and the timeouts travel with each statement."""
    store = LeaseStore.from_url(request.getfixturevalue(db), lease_seconds=8.0)
    try:
        for engine in store.engines:
            raw = engine.raw_connection()
            try:
                driver = raw.driver_connection
                assert driver is not None
                assert driver.prepare_threshold == (None if pooled else 5)
            finally:
                raw.close()
            with engine.connect() as conn:
                assert conn.execute(text("SHOW lock_timeout")).scalar() == "1333ms"
    finally:
        store.dispose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_a_wait_for_a_pooled_connection_is_bounded_by_the_lease(
    db: str, request: pytest.FixtureRequest
) -> None:
    """Every pooled connection taken (the threads and gevent pools share a process's): the
    next transaction waits at most the connect bound (2 s for an 8 s lease), then fails as
    the transient ``pool_timeout``. It waited SQLAlchemy's 30 s, past such a lease."""
    url = str(request.getfixturevalue(db))
    store = LeaseStore.from_url(url, lease_seconds=8.0, pool_size=1, max_overflow=0)
    store.create_schema()
    try:
        with store.transaction() as held:
            held.execute(text("SELECT 1"))
            started = time.monotonic()
            with pytest.raises(LeaseDatabaseError) as waited, store.transaction() as conn:
                conn.execute(text("SELECT 1"))
            took = time.monotonic() - started
        assert waited.value.cause == "pool_timeout" and waited.value.transient
        assert 1.5 < took < 5.0, took
    finally:
        store.dispose()
