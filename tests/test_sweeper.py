"""The sweeper in process: what it refuses to publish, and what it leaves alone."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import dumps

from celery_lease import InvalidLeaseKey, LeasedTask, LeaseStore
from celery_lease.runtime import store_for
from celery_lease.sweeper import sweep


class _Planted:
    """A pickle that creates a file when it is unpickled (the attack)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    """A JSON-only app (Celery's default accept_content) with eager tasks."""
    app = Celery("sweeper", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        lease_database_url=db_url,
        task_always_eager=True,
        broker_connection_retry_on_startup=True,
    )
    store_for(app).create_schema()
    yield app
    store_for(app).dispose()


def _plant(store: LeaseStore, run_id: str, payload: bytes, content_type: str) -> None:
    claim = store.claim(
        run_id,
        "ghost:1:x",
        task_name="sweeper.victim",
        lease_ms=60_000,
        max_attempts=5,
        payload=payload,
        payload_content_type=content_type,
    )
    assert claim.outcome == "claimed"
    assert store.expire(run_id)


def test_pickle_row_is_refused_never_deserialized(app: Celery, tmp_path: Path) -> None:
    """A row holding a pickle under a JSON-only app: nothing is unpickled, nothing
    runs; the run ends failed with payload_not_accepted."""
    store = store_for(app)
    marker = tmp_path / "pwned"
    _plant(store, "planted", pickle.dumps(_Planted(marker)), "application/x-python-serialize")
    report = sweep(app, store)
    assert not marker.exists()
    assert report.failed == ["planted"] and report.requeued == []
    row = store.get("planted")
    assert row is not None and (row.status, row.failure_code) == ("failed", "payload_not_accepted")
    assert row.payload is None


def test_expired_message_is_cancelled_not_published(app: Celery) -> None:
    """A recovered run whose message carries a past ``expires`` ends cancelled."""
    store = store_for(app)
    past = (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat()
    message = {"task": "sweeper.victim", "args": [], "kwargs": {}, "options": {"expires": past}}
    content_type, _enc, data = dumps(message, serializer="json")
    _plant(store, "late", data.encode() if isinstance(data, str) else data, content_type)
    report = sweep(app, store)
    assert report.requeued == [] and report.cancelled == ["late"]
    row = store.get("late")
    assert row is not None and (row.status, row.failure_code) == ("cancelled", "expired")


def test_eager_failure_leaves_nothing_for_the_sweeper(app: Celery) -> None:
    """An eager apply() (or a direct call) that fails records the run failed at once (nobody
    would run it again) and without a message: no sweep ever sends it to real workers."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="sweeper.eager_boom")
    def boom(self: LeasedTask) -> None:
        raise RuntimeError("eager failure")

    result = boom.apply()
    assert result.failed()
    store = store_for(app)
    row = store.get(result.id)
    assert row is not None and row.status == "failed" and row.payload is None
    with pytest.raises(RuntimeError):
        boom()
    report = sweep(app, store, stale_after=0)
    assert report.requeued == [] and report.errors == []


def test_bad_lease_key_is_refused_when_the_task_is_called(app: Celery) -> None:
    """A key function returning None (or a non-str/int) fails at delay() time."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="sweeper.keyed", lease_key=lambda x: x)
    def keyed(self: LeasedTask, x: Any) -> Any:
        return x

    for bad in (None, 1.5, True, ""):
        with pytest.raises(InvalidLeaseKey):
            keyed.delay(bad)
    assert store_for(app).get("None") is None
    assert keyed.delay(3).get() == 3
    assert store_for(app).get("sweeper.keyed:3") is not None


def test_long_keys_are_hashed_to_fit_the_column(app: Celery) -> None:
    """A key longer than the id column becomes ``prefix:sha256:<hex>``, stable per key."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="sweeper.long", lease_key=lambda x: x)
    def long_key(self: LeasedTask, x: str) -> str:
        return str(self.lease.run_id)

    run_id = long_key.delay("k" * 400).get()
    assert len(run_id) <= 255 and ":sha256:" in run_id
    assert long_key.lease_run_id("k" * 400) == run_id
    assert store_for(app).get(run_id) is not None


def test_sweeper_counts_its_republishes_and_a_claim_resets_them(app: Celery) -> None:
    """Each sweeper publish of a run counts in ``requeues`` (in the statement that marks it);
    a worker's claim resets it; at max_attempts unclaimed publishes the run ends failed
    (undeliverable) and is not published again; `lease rerun` starts the count over."""
    store = store_for(app)
    message = dumps({"args": [], "kwargs": {}, "options": {}}, serializer="json")
    _plant(store, "r", message[2].encode(), message[0])  # running, lease expired (attempt 1)
    moved = store.sweep_expired()
    assert [(r.id, status) for r, status in moved] == [("r", "retrying")]
    assert store.get("r").requeues == 1  # type: ignore[union-attr]
    claim = store.claim("r", "w:1:y", task_name="sweeper.victim", lease_ms=60_000,
                        max_attempts=3, payload=message[2].encode(),
                        payload_content_type=message[0])  # fmt: skip
    assert claim.outcome == "claimed" and store.get("r").requeues == 0  # type: ignore[union-attr]
    store.fail("r", "w:1:y", claim.attempt, error="x", failure_code="e", retry_in=0.0)
    for count in (1, 2, 3, 4, 5):  # stranded: published again, max_attempts times
        assert [status for _, status in store.reclaim_stale(0)] == ["retrying"]
        assert store.get("r").requeues == count  # type: ignore[union-attr]
    assert [status for _, status in store.reclaim_stale(0)] == ["failed"]
    row = store.get("r")
    assert row is not None and (row.status, row.failure_code) == ("failed", "undeliverable")
    assert row.payload is not None and store.reclaim_stale(0) == []
    assert store.rerun("r", attempts=2).requeues == 0


def test_one_sweep_recovers_more_expired_runs_than_its_batch(app: Celery) -> None:
    """Seven expired leases, a batch limit of 3: one sweep re-enqueues all seven, batch
    after batch (it stopped at the limit: 2,000 runs of a killed worker took four sweeps,
    while the docs promise recovery within one sweep interval after the lease)."""
    store = store_for(app)
    message = dumps({"args": [], "kwargs": {}, "options": {}}, serializer="json")
    runs = [f"r{i}" for i in range(7)]
    for run_id in runs:
        _plant(store, run_id, message[2].encode(), message[0])
    report = sweep(app, store, limit=3)
    assert sorted(report.requeued) == runs
    assert all(store.get(run_id).status == "retrying" for run_id in runs)  # type: ignore[union-attr]
