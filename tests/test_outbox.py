"""The outbox of follow-up tasks (celery_lease/store/outbox.py) on every database, and the
lease's part in filling it: rows exist only once their fenced transaction commits, are
taken by one publisher at a time, and are bounded."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert

from celery_lease import LeaseStore
from celery_lease.errors import LeaseInputError, LeaseLost, LeaseUsageError
from celery_lease.followups import Followups
from celery_lease.runtime import app_runtime
from celery_lease.schema import outbox
from celery_lease.store import FollowupMessage
from tests.helpers import driver_statements, held, wait_for


def message(task_id: str) -> FollowupMessage:
    return FollowupMessage(task_id, "shop.receipt", b'{"args": []}', "application/json")


@pytest.mark.timeout(60)
def test_rows_exist_only_once_their_transaction_commits(store: LeaseStore) -> None:
    """record() writes in the caller's transaction: a rollback leaves nothing to take."""
    with pytest.raises(RuntimeError), store.transaction() as conn:
        store.outbox.record(conn, "r", [message("r:followup:1.0")])
        raise RuntimeError("roll back")
    assert store.outbox.take(["r:followup:1.0"], stale_ms=60_000) == []
    with store.transaction() as conn:
        store.outbox.record(conn, "r", [message("r:followup:1.1"), message("r:followup:1.2")])
    taken = store.outbox.take(["r:followup:1.1", "r:followup:1.2"], stale_ms=60_000)
    assert [(row.task_id, row.run_id, row.payload) for row in taken] == [
        ("r:followup:1.1", "r", b'{"args": []}'),
        ("r:followup:1.2", "r", b'{"args": []}'),
    ]
    assert store.outbox.count() == 2


@pytest.mark.timeout(60)
def test_a_row_is_taken_once_until_its_take_is_stale(store: LeaseStore) -> None:
    """A taken row is not taken again, by id or by the sweeper's age, until ``stale_ms``
    passed; drop() deletes it for good."""
    with store.transaction() as conn:
        store.outbox.record(conn, "r", [message("t1")])
    assert [row.task_id for row in store.outbox.take(["t1"], stale_ms=60_000)] == ["t1"]
    assert store.outbox.take(["t1"], stale_ms=60_000) == []
    assert store.outbox.take(stale_ms=60_000) == []
    time.sleep(0.05)
    assert [row.task_id for row in store.outbox.take(stale_ms=10)] == ["t1"]
    store.outbox.drop("t1")
    time.sleep(0.05)
    assert store.outbox.take(stale_ms=10) == []
    assert store.outbox.count() == 0


@pytest.mark.timeout(60)
def test_rows_a_publish_keeps_failing_on_do_not_starve_the_rest(store: LeaseStore) -> None:
    """The sweeper takes rows never taken first, then those taken longest ago: with more
    failing rows than one take holds, a later row is still reached (it took the oldest
    by creation each time, so 500 rows that never publish kept the rest waiting)."""
    with store.transaction() as conn:
        store.outbox.record(conn, "r", [message(f"bad{i}") for i in range(3)])
    time.sleep(0.01)
    with store.transaction() as conn:
        store.outbox.record(conn, "r", [message("good")])
    time.sleep(0.05)
    first = [row.task_id for row in store.outbox.take(stale_ms=10, limit=3)]
    assert first == ["bad0", "bad1", "bad2"]  # their publish fails: they stay taken
    time.sleep(0.05)
    assert next(row.task_id for row in store.outbox.take(stale_ms=10, limit=3)) == "good"


@pytest.mark.timeout(60)
def test_the_sweeper_takes_only_rows_older_than_its_age(store: LeaseStore) -> None:
    """take() without ids: only rows recorded at least ``older_than_ms`` ago."""
    with store.transaction() as conn:
        store.outbox.record(conn, "r", [message("young")])
    assert store.outbox.take(older_than_ms=60_000, stale_ms=60_000) == []
    time.sleep(0.05)
    assert [r.task_id for r in store.outbox.take(older_than_ms=20, stale_ms=60_000)] == ["young"]


@pytest.mark.timeout(60)
def test_purge_deletes_old_rows_in_batches(store: LeaseStore) -> None:
    """purge() deletes at most ``limit`` rows older than its age; count() sees the rest."""
    now = store.now_ms()
    rows = [
        {
            "task_id": f"old{i}",
            "run_id": "r",
            "task_name": "t",
            "payload": b"{}",
            "payload_content_type": "application/json",
            "created_at": now - 10_000 - i,
        }
        for i in range(5)
    ]
    with store.transaction() as conn:
        conn.execute(insert(outbox), rows)
        store.outbox.record(conn, "r", [message("new")])
    assert store.outbox.count(older_than_ms=5_000) == 5
    assert sorted(store.outbox.purge(5_000, limit=3)) == ["old2", "old3", "old4"]
    assert sorted(store.outbox.purge(5_000, limit=3)) == ["old0", "old1"]
    assert store.outbox.purge(5_000, limit=3) == []
    assert store.outbox.count() == 1


# -- the lease fills it -----------------------------------------------------------------


@pytest.fixture
def app(store: LeaseStore) -> Iterator[Celery]:
    """An app with a follow-up task, publishing to an in-memory broker queue of its own."""
    app = Celery("outbox_tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"q{uuid.uuid4().hex[:8]}",
        lease_database_url=str(store.engine.url),
    )

    @app.task(name="shop.receipt", shared=False)
    def receipt(order_id: str, copies: int = 1) -> str:
        return order_id

    yield app
    app_runtime(app).reset()


def sender(app: Celery, store: LeaseStore) -> Followups:
    return Followups(app, store)


def published(app: Celery, count: int) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """The next ``count`` messages on the app's queue: (task id, args, kwargs)."""
    found = []
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        for _ in range(count):
            message = queue.get(timeout=10)
            args, kwargs, _embed = message.decode()
            found.append((message.headers["id"], args, kwargs))
            message.ack()
        queue.close()
    return found


@pytest.mark.timeout(60)
def test_fenced_followups_are_published_once_after_the_commit_under_derived_ids(
    app: Celery, store: LeaseStore
) -> None:
    """fence(send=[...]) and send_on_commit() return the derived task ids; the rows are not
    visible before the commit; after it this process publishes each once and deletes it.
    Positions go on across transactions of the attempt; a rollback sends nothing."""
    lease = held(store, "pay:1", followups=sender(app, store))
    receipt = app.tasks["shop.receipt"]
    with store.transaction() as conn:
        ids = lease.fence(conn, send=[receipt.s("1"), receipt.si("1", copies=2)])
        ids += lease.send_on_commit(conn, receipt.s("1"))
        assert store.outbox.count() == 0  # not committed: nobody sees them
    assert ids == ["pay:1:followup:1.0", "pay:1:followup:1.1", "pay:1:followup:1.2"]
    with pytest.raises(RuntimeError), store.transaction() as conn:
        assert lease.fence(conn, send=receipt.s("9")) == ["pay:1:followup:1.3"]
        raise RuntimeError("roll back")
    with store.transaction() as conn:
        assert lease.fence(conn, send=receipt.s("1")) == ["pay:1:followup:1.4"]
        assert lease.fence(conn) == []  # a second fence keeps the first one's follow-ups
    sent = published(app, 4)
    assert sent == [
        ("pay:1:followup:1.0", ["1"], {}),
        ("pay:1:followup:1.1", ["1"], {"copies": 2}),
        ("pay:1:followup:1.2", ["1"], {}),
        ("pay:1:followup:1.4", ["1"], {}),
    ]
    wait_for(lambda: store.outbox.count() == 0, 10, what="the rows to be deleted")


@pytest.mark.timeout(60)
def test_send_on_commit_needs_a_transaction_this_lease_fenced(
    app: Celery, store: LeaseStore
) -> None:
    """Follow-ups commit only while the lease holds: send_on_commit() outside a fenced
    transaction is a usage error; once the lease is lost it raises LeaseLost."""
    lease = held(store, "pay:2", followups=sender(app, store))
    receipt = app.tasks["shop.receipt"]
    with store.transaction() as conn, pytest.raises(LeaseUsageError, match="call fence"):
        lease.send_on_commit(conn, receipt.s("2"))
    with store.transaction() as conn:
        lease.fence(conn)
    # Fenced: an earlier transaction, not this one.
    with store.transaction() as conn, pytest.raises(LeaseUsageError, match="call fence"):
        lease.send_on_commit(conn, receipt.s("2"))
    with store.transaction() as conn:
        lease.fence(conn)
        lease.mark_lost("test")
        with pytest.raises(LeaseLost):
            lease.send_on_commit(conn, receipt.s("2"))
    assert store.outbox.count() == 0
    bare = held(store, "pay:3")  # a lease made without an app
    with store.transaction() as conn, pytest.raises(LeaseUsageError, match="no app"):
        bare.fence(conn, send=[receipt.s("3")])


def _chain(app: Celery) -> Any:
    receipt = app.tasks["shop.receipt"]
    return receipt.s("1") | receipt.s()


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda app: ["shop.receipt"], "is a str, not a Celery signature"),
        (lambda app: "shop.receipt", "is a str, not a Celery signature"),
        (lambda app: [{"task": "shop.receipt"}], "is a dict, not a Celery signature"),
        (lambda app: 7, "must be a signature or a list of them, got int"),
        (_chain, "is a chain: send each task"),
        (lambda app: app.tasks["shop.receipt"].s("1").set(task_id="mine"), "sets its own task_id"),
        (lambda app: app.tasks["shop.receipt"].s(), "missing 1 required positional argument"),
        (lambda app: app.tasks["shop.receipt"].s("x" * 70_000), "at most 65536 are kept"),
        (lambda app: app.tasks["shop.receipt"].s(object()), "cannot be serialized with 'json'"),
        (lambda app: [app.tasks["shop.receipt"].s("1")] * 101, "101 follow-ups at once"),
        # Options Celery's publish would refuse: the row could never be sent.
        (
            lambda app: app.tasks["shop.receipt"].s("1").set(countdown=-1e30),
            "Celery cannot publish it with countdown=-1e+30",
        ),
        (
            lambda app: app.tasks["shop.receipt"].s("1").set(eta="tomorrow"),
            "Celery cannot publish it with eta='tomorrow'",
        ),
        (
            lambda app: app.tasks["shop.receipt"].s("1").set(expires=float("nan")),
            "Celery cannot publish it with expires=nan",
        ),
    ],
)
@pytest.mark.timeout(60)
def test_what_a_body_hands_over_is_checked_before_any_sql(
    app: Celery, store: LeaseStore, make: Any, says: str
) -> None:
    """LeaseInputError (field ``send``) naming the follow-up and what is wrong, before any
    statement: the fence is not even sent, and the lease still holds."""
    lease = held(store, "pay:4", followups=sender(app, store))
    with (
        driver_statements(store.engines) as seen,
        store.transaction() as conn,
        pytest.raises(LeaseInputError) as raised,
    ):
        lease.fence(conn, send=make(app))
    assert [sql for _, sql in seen if "celery_lease" in sql] == []
    assert raised.value.field == "send" and says in str(raised.value)
    assert not lease.lost and store.outbox.count() == 0
