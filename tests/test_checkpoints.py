"""Checkpoints and progress: the store's statements on every database, then real workers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text

from celery_lease import LeaseLost, LeaseStore
from celery_lease.errors import LeaseInputError
from celery_lease.lease.lease import Lease
from celery_lease.schema import MAX_CHECKPOINT_BYTES, runs
from celery_lease.store.records import Progress

from .helpers import driver_statements


def claim(store: LeaseStore, run_id: str, owner: str, lease_ms: int = 5000, **kw: Any) -> Any:
    return store.claim(
        run_id, owner, task_name="t", lease_ms=lease_ms, max_attempts=kw.pop("max_attempts", 5)
    )


def lease_for(store: LeaseStore, result: Any) -> Lease:
    return Lease(
        store,
        result.run_id,
        result.owner,
        result.attempt,
        lease_seconds=30,
        heartbeat_interval=10,
        checkpoint=result.checkpoint,
    )


def on_runs(seen: list[tuple[int, str]]) -> list[str]:
    return [sql for _, sql in seen if runs.name in sql]


@pytest.mark.timeout(60)
def test_claim_returns_the_checkpoint_in_its_own_statements(store: LeaseStore) -> None:
    """A takeover's claim returns the checkpoint an earlier attempt saved, with no
    statement more than a claim without one; a fresh run reads None."""
    first = claim(store, "r1", "A")
    assert first.checkpoint is None and lease_for(store, first).last_checkpoint is None
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        claim(store, "r0", "Z")
        store.expire("r0")
        seen.clear()
        claim(store, "r0", "Y")
    without = len(on_runs(seen))
    lease_for(store, first).checkpoint({"next": 10, "s": "é"})
    store.expire("r1")
    with driver_statements(store.engines) as seen:
        second = claim(store, "r1", "B")
    assert second.outcome == "claimed" and second.attempt == 2
    assert len(on_runs(seen)) == without
    assert lease_for(store, second).last_checkpoint == {"next": 10, "s": "é"}


@pytest.mark.timeout(60)
def test_checkpoint_is_one_guarded_update(store: LeaseStore) -> None:
    """checkpoint() runs one UPDATE naming id, owner and attempt; the row holds the
    compact JSON and when it was saved (DB clock)."""
    lease = lease_for(store, claim(store, "r1", "A"))
    store.now_ms()
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        lease.checkpoint([1, {"a": None}])
    statements = on_runs(seen)
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("UPDATE")
    row = store.get("r1")
    assert row is not None and row.checkpoint == '[1,{"a":null}]'
    assert row.checkpoint_at is not None and abs(row.checkpoint_at - store.now_ms()) < 5000
    assert lease.last_checkpoint == [1, {"a": None}]


@pytest.mark.timeout(60)
def test_stale_owner_cannot_overwrite_a_newer_checkpoint(store: LeaseStore) -> None:
    """After a takeover the old owner's checkpoint raises LeaseLost and changes nothing."""
    old = lease_for(store, claim(store, "r1", "A"))
    old.checkpoint(1)
    store.expire("r1")
    new = lease_for(store, claim(store, "r1", "B"))
    assert new.last_checkpoint == 1
    new.checkpoint(2)
    with pytest.raises(LeaseLost):
        old.checkpoint(99)
    assert old.lost
    row = store.get("r1")
    assert row is not None and row.checkpoint == "2" and row.lease_owner == "B"


@pytest.mark.timeout(60)
def test_expired_lease_cannot_checkpoint(store: LeaseStore) -> None:
    """A lease expired on the database's clock (not yet taken over) saves nothing."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint("a")
    store.expire("r1")
    with pytest.raises(LeaseLost):
        lease.checkpoint("b")
    row = store.get("r1")
    assert row is not None and row.checkpoint == '"a"'


@pytest.mark.timeout(60)
def test_checkpoint_bound_and_json_checked_before_any_sql(store: LeaseStore) -> None:
    """A state over 64 KiB of compact JSON, or not JSON, is LeaseInputError before any SQL."""
    lease = lease_for(store, claim(store, "r1", "A"))
    fits = "x" * (MAX_CHECKPOINT_BYTES - 2)  # plus its two quotes
    lease.checkpoint(fits)
    store.now_ms()
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        for bad in ("x" * (MAX_CHECKPOINT_BYTES - 1), "é" * (MAX_CHECKPOINT_BYTES // 2), object()):
            with pytest.raises(LeaseInputError) as caught:
                lease.checkpoint(bad)
            assert caught.value.field == "checkpoint"
        with pytest.raises(LeaseInputError):
            lease.checkpoint(float("nan"))
    assert seen == []
    row = store.get("r1")
    assert row is not None and row.checkpoint is not None
    assert json.loads(row.checkpoint) == fits
    assert lease.last_checkpoint == fits


@pytest.mark.timeout(60)
def test_progress_rides_the_renewal_statement(store: LeaseStore) -> None:
    """Progress is written by the heartbeat's renewal: the same statements as a tick
    without progress, only for the lease that reported it."""
    keys = []
    for i in range(5):
        claim(store, f"r{i}", f"A{i}")
        keys.append((f"r{i}", f"A{i}", 1))
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        store.heartbeat(keys)
        plain = len(seen)
        seen.clear()
        beat = store.heartbeat(
            keys, {keys[1]: Progress(40, 100, "batch 4"), keys[3]: Progress(7.5)}
        )
    assert len(seen) == plain and beat.renewed == set(keys)
    one = store.get("r1")
    three = store.get("r3")
    other = store.get("r0")
    assert one is not None and three is not None and other is not None
    assert (one.progress_done, one.progress_total, one.progress_note) == (40, 100, "batch 4")
    assert (three.progress_done, three.progress_total, three.progress_note) == (7.5, None, None)
    assert one.progress_at is not None and other.progress_at is None
    assert other.progress_done is None


@pytest.mark.timeout(60)
def test_progress_input_checked(store: LeaseStore) -> None:
    """progress() takes finite numbers and a note of at most 200 characters."""
    lease = lease_for(store, claim(store, "r1", "A"))
    for args in (("3",), (1, "x"), (float("inf"),), (True,), (1, 2, "n" * 201), (1, 2, 3)):
        with pytest.raises(LeaseInputError):
            lease.progress(*args)
    lease.progress(1, 2, "n" * 200)
    assert lease.pending_progress() == Progress(1.0, 2.0, "n" * 200)


@pytest.mark.timeout(60)
def test_fenced_checkpoint_commits_with_the_writes(store: LeaseStore) -> None:
    """fence(conn, checkpoint=...) saves the checkpoint in the caller's transaction: a
    rollback keeps the one before, a commit lands it with the writes."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint(0)
    with pytest.raises(RuntimeError), lease.transaction() as conn:
        lease.fence(conn, checkpoint=5)
        raise RuntimeError("rolled back")
    row = store.get("r1")
    assert row is not None and row.checkpoint == "0" and lease.last_checkpoint == 0
    with lease.transaction() as conn:
        lease.fence(conn, checkpoint={"next": 6})
        assert conn.execute(text("SELECT 1")).scalar() == 1
    row = store.get("r1")
    assert row is not None and row.checkpoint == '{"next":6}'
    assert lease.last_checkpoint == {"next": 6}


@pytest.mark.timeout(60)
def test_success_clears_the_checkpoint_failure_keeps_it(store: LeaseStore) -> None:
    """Success clears the checkpoint (also fence(complete=True)); failed and cancelled
    rows keep it; rerun keeps it, rerun(from_scratch=True) clears it and the progress."""
    done = lease_for(store, claim(store, "ok", "A"))
    done.checkpoint(3)
    done.complete()
    fenced = lease_for(store, claim(store, "fenced", "A"))
    fenced.checkpoint(3)
    with fenced.transaction() as conn:
        fenced.fence(conn, checkpoint=4, complete=True)
    for run_id in ("ok", "fenced"):
        row = store.get(run_id)
        assert row is not None and row.status == "succeeded"
        assert row.checkpoint is None and row.checkpoint_at is None
    failed = lease_for(store, claim(store, "bad", "A", max_attempts=1))
    failed.checkpoint({"at": 7})
    store.heartbeat([failed.key], {failed.key: Progress(7, 10)})
    store.fail("bad", "A", 1, error="E", failure_code="exception:E", retry_in=None)
    row = store.get("bad")
    assert row is not None and row.status == "failed" and row.checkpoint == '{"at":7}'
    store.rerun("bad", attempts=1)
    again = claim(store, "bad", "B", max_attempts=1)
    assert again.outcome == "claimed" and json.loads(again.checkpoint) == {"at": 7}
    store.mark_cancelled("bad", "B", again.attempt)
    row = store.get("bad")
    assert row is not None and row.status == "cancelled" and row.checkpoint == '{"at":7}'
    fresh = store.rerun("bad", attempts=1, from_scratch=True)
    assert fresh.checkpoint is None and fresh.checkpoint_at is None
    assert fresh.progress_done is None and fresh.progress_total is None
    assert claim(store, "bad", "C", max_attempts=1).checkpoint is None


@pytest.mark.timeout(60)
def test_checkpoint_survives_release_retry_and_sweep(store: LeaseStore) -> None:
    """Every path to a next attempt keeps the checkpoint: a hand-back, a retry, a sweep."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint(1)
    store.release("r1", "A", 1)
    second = claim(store, "r1", "B")
    assert second.checkpoint == "1"
    store.fail("r1", "B", 2, error="E", failure_code="exception:E", retry_in=0)
    third = claim(store, "r1", "C")
    assert third.checkpoint == "1"
    lease_for(store, third).checkpoint(2)
    store.expire("r1")
    assert [status for _, status in store.sweep_expired()] == ["retrying"]
    assert claim(store, "r1", "D").checkpoint == "2"
