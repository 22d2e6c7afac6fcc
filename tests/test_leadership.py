"""Leader leases against real SQL: take, renew, fence, resign; the Leadership candidacy."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_lease import LeaseStore
from celery_lease.errors import LeadershipLost
from celery_lease.events import Event, EventBus
from celery_lease.leadership import Leadership
from celery_lease.store.leaders import LeaderTerm

from .helpers import FakeClock, driver_statements, wait_for

pytestmark = pytest.mark.timeout(60)


def _take(store: LeaseStore, owner: str, ttl_ms: int) -> LeaderTerm | None:
    """Take the ``sweeper`` lease for ``owner`` (creating its row if needed)."""
    leaders = store.leaders
    if leaders.create("sweeper", owner, ttl_ms):
        return LeaderTerm("sweeper", owner, 1)
    if not leaders.take("sweeper", owner, ttl_ms):
        return None
    term = leaders.term_of("sweeper", owner)
    return None if term is None else LeaderTerm("sweeper", owner, term)


def _expired_run(store: LeaseStore, run_id: str) -> None:
    claim = store.claim(run_id, f"ghost:{run_id}", task_name="t", lease_ms=60_000, max_attempts=5)
    assert claim.outcome == "claimed"
    assert store.expire(run_id)


def test_one_holder_at_a_time_and_terms_grow(store: LeaseStore) -> None:
    """A live leader lease is not taken; once expired a standby takes it in the next term,
    and the former holder's renewal and resignation are refused."""
    a = _take(store, "a", 150)
    assert a == LeaderTerm("sweeper", "a", 1)
    assert _take(store, "b", 150) is None
    assert store.leaders.renew(a, 150)
    wait_for(lambda: _take(store, "b", 60_000), 5, what="the lease to expire and b to take it")
    (record,) = store.leaders.list_all()
    assert (record.owner, record.term, record.live) == ("b", 2, True)
    assert not store.leaders.renew(a, 150)
    assert not store.leaders.resign(a)
    assert store.leaders.list_all()[0].owner == "b"


def test_resign_lets_a_standby_take_over_at_once(store: LeaseStore) -> None:
    """A resigned lease is free now: the next try of a standby takes it."""
    a = _take(store, "a", 60_000)
    assert a is not None and _take(store, "b", 60_000) is None
    assert store.leaders.resign(a)
    b = _take(store, "b", 60_000)
    assert b is not None and b.term == 2


def test_a_stale_leaders_sweep_is_refused_and_changes_nothing(store: LeaseStore) -> None:
    """The sweep's writes fenced by a term that lost the lead raise LeadershipLost and
    leave the expired run as it was; the new leader's sweep moves it."""
    a = _take(store, "a", 150)
    assert a is not None
    b = wait_for(lambda: _take(store, "b", 60_000), 5, what="b to take over")
    _expired_run(store, "r1")
    with pytest.raises(LeadershipLost) as refused:
        store.sweep_expired(leader=a)
    assert (refused.value.name, refused.value.owner, refused.value.term) == ("sweeper", "a", 1)
    with pytest.raises(LeadershipLost):
        store.reclaim_stale(0, leader=a)
    with pytest.raises(LeadershipLost):
        store.record_sweep("worker", sweeper="a", took_ms=1, leader=a)
    row = store.get("r1")
    assert row is not None and row.status == "running" and row.requeues == 0
    assert store.reads.last_sweep() is None
    moved = store.sweep_expired(leader=b)
    assert [(r.id, status) for r, status in moved] == [("r1", "retrying")]
    store.record_sweep("worker", sweeper="b", took_ms=1, leader=b)
    assert store.reads.last_sweep()["sweeper"] == "b"  # type: ignore[index]


def test_fenced_schedule_writes(store: LeaseStore) -> None:
    """Schedule rows are added, advanced (compare and set) and forgotten only under the
    leader's term; a stale term changes nothing."""
    leaders = store.leaders
    a = _take(store, "a", 150)
    assert a is not None
    leaders.add_entries(a, "beat:x", {"e1": 1000, "e2": 2000})
    assert leaders.advance(a, "beat:x", "e1", 1000, 1500)
    assert not leaders.advance(a, "beat:x", "e1", 1000, 1600)  # moved meanwhile
    b = wait_for(lambda: _take(store, "b", 60_000), 5, what="b to take over")
    with pytest.raises(LeadershipLost):
        leaders.advance(a, "beat:x", "e1", 1500, 2500)
    with pytest.raises(LeadershipLost):
        leaders.add_entries(a, "beat:x", {"e3": 1})
    with pytest.raises(LeadershipLost):
        leaders.forget_entries(a, "beat:x", ["e1"])
    rows = leaders.schedule_of("beat:x")
    assert {name: (r.last_run_at, r.total_run_count) for name, r in rows.items()} == {
        "e1": (1500, 1),
        "e2": (2000, 0),
    }
    assert leaders.forget_entries(b, "beat:x", ["e1"]) == 1
    assert set(leaders.schedule_of("beat:x")) == {"e1"}


def _candidate(store: LeaseStore, host: str, clock: Any = time.monotonic, **kw: Any) -> Leadership:
    return Leadership(store, "sweeper", lease_seconds=0.3, hostname=host, clock=clock, **kw)


def test_leadership_steps_one_statement_each(store: LeaseStore) -> None:
    """A candidacy takes the lead once, then renews with one statement per step; a standby
    tries with one statement per step and takes over only after the leader stops."""
    events = EventBus()
    seen: list[tuple[Event, dict[str, Any]]] = []
    events.add_listener(lambda event, fields: seen.append((event, fields)))
    leader = _candidate(store, "h1", events=events, database="db")
    standby = _candidate(store, "h2")
    leader.step()
    term = leader.current()
    assert term is not None and term.owner.startswith("h1:")
    standby.step()  # the row exists: from now on one UPDATE per try
    with driver_statements(store.engines) as statements:
        assert leader.step() == pytest.approx(0.1)
        standby.step()
    assert len(statements) == 2, statements
    assert leader.current() == term and standby.current() is None
    assert (
        Event.LEADER_TAKEN,
        {"run_id": None, "role": "sweeper", "database": "db", "term": 1},
    ) in seen

    def took_over() -> bool:
        standby.step()
        return standby.current() is not None

    wait_for(took_over, 5, what="the standby to take over the lead nobody renews")
    assert leader.step() and leader.current() is None  # its renewal is refused
    assert any(event is Event.LEADER_LOST for event, _ in seen)


def test_leadership_local_deadline_drops_the_lead_without_the_database(store: LeaseStore) -> None:
    """Past the local deadline (no renewal confirmed in time) the lead is dropped, whatever
    the database says: a stalled candidacy never acts as leader."""
    clock = FakeClock()
    candidacy = _candidate(store, "h1", clock=clock)
    candidacy.step()
    assert candidacy.current() is not None
    clock.now += candidacy.ttl * 0.95  # past ttl minus its safety margin (10.1 %)
    assert candidacy.current() is None


def test_resigned_leadership_is_taken_by_the_next_try(store: LeaseStore) -> None:
    """stop() resigns the lead: a standby's next try takes it, before its expiry."""
    leader = Leadership(store, "sweeper", lease_seconds=60.0, hostname="h1")
    standby = Leadership(store, "sweeper", lease_seconds=60.0, hostname="h2")
    leader.step()
    standby.step()
    assert leader.current() is not None and standby.current() is None
    leader.stop()
    standby.step()
    assert leader.current() is None and standby.current() is not None
