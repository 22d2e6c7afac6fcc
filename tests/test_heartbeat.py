"""The heartbeat thread against a real database."""

from __future__ import annotations

import time

import pytest

from celery_lease import Lease, LeaseLost, LeaseStore, RunCancelled
from celery_lease.heartbeat import Heartbeat
from tests.helpers import wait_for

DEAD_URL = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=1"


def held(store: LeaseStore, run_id: str, seconds: float = 2.0, interval: float = 0.2) -> Lease:
    result = store.claim(
        run_id, f"owner-{run_id}", task_name="t", lease_ms=int(seconds * 1000), max_attempts=5
    )
    assert result.outcome == "claimed"
    return Lease(
        store,
        run_id,
        result.owner,
        result.attempt,
        lease_seconds=seconds,
        heartbeat_interval=interval,
    )


def test_beat_once_renews_and_reports_loss(store: LeaseStore) -> None:
    """One tick renews held leases; a stolen lease is marked lost and check() raises."""
    keep, steal = held(store, "keep"), held(store, "steal")
    heartbeat = Heartbeat(store, interval=10)
    heartbeat.register(keep, start=False)
    heartbeat.register(steal, start=False)
    assert store.expire("steal")
    store.claim("steal", "thief", task_name="t", lease_ms=5000, max_attempts=5)
    result = heartbeat.beat_once()
    assert result is not None and keep.key in result.renewed
    assert not keep.lost and steal.lost
    with pytest.raises(LeaseLost, match="automation_run_lease_lost"):
        steal.check()


def test_thread_sees_a_stolen_lease_within_an_interval(store: LeaseStore) -> None:
    """The running thread (started by register) marks a stolen lease lost promptly."""
    lease = held(store, "r1", seconds=3.0, interval=0.2)
    heartbeat = Heartbeat(store, interval=0.2)
    heartbeat.register(lease)
    try:
        time.sleep(0.5)
        assert not lease.lost  # renewed, not lost
        store.expire("r1")
        store.claim("r1", "thief", task_name="t", lease_ms=5000, max_attempts=5)
        stolen_at = time.monotonic()
        wait_for(lambda: lease.lost, 3.0, what="the loss to be seen")
        assert time.monotonic() - stolen_at < 0.2 + 0.5
    finally:
        heartbeat.stop()


def test_cancel_request_is_seen_by_a_renewal(store: LeaseStore) -> None:
    """A renewal reads cancel_requested_at; check() then raises RunCancelled."""
    lease = held(store, "r1")
    heartbeat = Heartbeat(store, interval=10)
    heartbeat.register(lease, start=False)
    store.cancel("r1")
    heartbeat.beat_once()
    with pytest.raises(RunCancelled):
        lease.check()


def test_unreachable_database_is_retried_until_the_confirmed_expiry(sqlite_url: str) -> None:
    """Errors are retried; only once the last confirmed expiry passes is the lease lost."""
    good = LeaseStore.from_url(sqlite_url)
    good.create_schema()
    lease = held(good, "r1", seconds=1.5)
    dead = Heartbeat(LeaseStore.from_url(DEAD_URL), interval=0.1)
    dead.register(lease, start=False)
    assert dead.beat_once() is None
    assert not lease.lost  # a failed tick alone loses nothing
    time.sleep(1.6)
    assert dead.beat_once() is None
    assert lease.lost
    with pytest.raises(LeaseLost, match="without renewal"):
        lease.check()
