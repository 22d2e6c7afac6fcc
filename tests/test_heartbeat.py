"""The heartbeat thread against a real database."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from celery_lease import Lease, LeaseLost, LeaseStore, RunCancelled
from celery_lease.lease.heartbeat import Heartbeat
from tests import helpers
from tests.helpers import FakeClock, wait_for

DEAD_URL = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=1"


def held(
    store: LeaseStore,
    run_id: str,
    seconds: float = 2.0,
    interval: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
) -> Lease:
    """A held lease renewed every ``interval`` seconds (see ``tests.helpers.held``)."""
    lease: Lease = helpers.held(store, run_id, seconds, clock=clock, heartbeat_interval=interval)
    return lease


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
        wait_for(lambda: heartbeat.last_tick_seconds is not None, 3.0, what="a renewal")
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
    clock = FakeClock()
    lease = held(good, "r1", seconds=1.5, clock=clock)
    dead = Heartbeat(LeaseStore.from_url(DEAD_URL), interval=0.1, clock=clock)
    dead.register(lease, start=False)
    assert dead.beat_once() is None
    assert not lease.lost  # a failed tick alone loses nothing
    clock.now += 1.5 - lease.margin - 0.01
    assert dead.beat_once() is None
    assert not lease.lost  # still before the local deadline
    clock.now += 0.02
    assert dead.beat_once() is None
    assert lease.lost
    with pytest.raises(LeaseLost, match="local deadline passed"):
        lease.check()


def test_confirmed_renewal_moves_the_deadline_from_its_send_time(store: LeaseStore) -> None:
    """A confirmed renewal moves the local deadline to its send time + lease - margin."""
    clock = FakeClock()
    lease = held(store, "r1", seconds=2.0, clock=clock)
    assert lease.deadline == pytest.approx(1000.0 + 2.0 - lease.margin)
    heartbeat = Heartbeat(store, interval=10, clock=clock)
    heartbeat.register(lease, start=False)
    clock.now += 1.0
    assert heartbeat.beat_once() is not None
    assert lease.deadline == pytest.approx(1001.0 + 2.0 - lease.margin)
    clock.now += 2.0 - lease.margin  # exactly at the moved deadline
    with pytest.raises(LeaseLost, match="local deadline passed"):
        lease.check()


def test_refused_renewal_while_completing_is_not_a_loss(store: LeaseStore) -> None:
    """A renewal refused while fence(complete=True)'s transaction commits is success, not loss."""
    lease = held(store, "r1")
    heartbeat = Heartbeat(store, interval=10)
    heartbeat.register(lease, start=False)
    with store.engine.begin() as conn:
        lease.fence(conn, complete=True)
    result = heartbeat.beat_once()
    assert result is not None and lease.key in result.lost
    assert lease.state.value == "completed" and not lease.lost
    lease.check()
    assert heartbeat.beat_once() is None  # verified: no longer renewed
