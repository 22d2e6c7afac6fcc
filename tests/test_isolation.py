"""Features ride the guard, never its fate: what one run hands its lease is checked at the
call, and one run's refused write never fails another run's renewal (issue 28, 1 and 9)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_lease import LeaseStore
from celery_lease.errors import LeaseInputError
from celery_lease.lease.heartbeat import Heartbeat
from celery_lease.store.records import Progress

from .cluster import PG_AND_MARIADB, SETUP_IDS, SETUPS, Cluster
from .helpers import driver_statements, held, wait_for
from .workerapp import hostile_values

PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
SQLITE_FS_AND_PG = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
SHORT = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 0.5}


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Any:
    store = LeaseStore.from_url(f"sqlite:///{tmp_path / 'leases.sqlite3'}")
    store.create_schema()
    yield store
    store.dispose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(hostile_values()))
def test_hostile_value_raises_lease_input_error_at_the_call(sqlite_store: Any, kind: str) -> None:
    """NUL, lone surrogates, huge sizes, 5,000-deep nesting, 10**400, NaN, non-JSON: each
    raises LeaseInputError naming the value in the body, at the call, before any SQL
    (before: RecursionError, OverflowError, or accepted and refused by the heartbeat)."""
    from .workerapp import hand_over

    field = hostile_values()[kind][0]
    lease = held(sqlite_store, "r1", 30.0)
    with driver_statements(sqlite_store.engines) as seen, pytest.raises(LeaseInputError) as err:
        hand_over(lease, kind)
    assert err.value.field == field
    assert seen == []
    assert lease.report.pending() is None


@pytest.mark.timeout(60)
def test_checkpoint_depth_bound_and_text_kept() -> None:
    """A checkpoint nested MAX_CHECKPOINT_DEPTH deep is kept; one level more is refused; a
    NUL inside a checkpoint string is kept (the JSON escapes it), a 4-byte character too."""
    from celery_lease.schema import MAX_CHECKPOINT_DEPTH, check_progress, encode_checkpoint

    value: Any = 0
    for _ in range(MAX_CHECKPOINT_DEPTH):
        value = [value]
    assert encode_checkpoint(value).count("[") == MAX_CHECKPOINT_DEPTH
    with pytest.raises(LeaseInputError, match="nested more than"):
        encode_checkpoint([value])
    assert encode_checkpoint({"a": "x\x00y😀"}) == '{"a":"x\\u0000y\\ud83d\\ude00"}'
    assert check_progress(1, 2, "ok é😀") == (1.0, 2.0, "ok é😀")
    assert check_progress(2**60, None, None) == (float(2**60), None, None)


@pytest.mark.timeout(60)
def test_one_runs_refused_progress_never_fails_another_runs_renewal(store: LeaseStore) -> None:
    """A progress note the database refuses (a lone surrogate no driver encodes), put past
    the hand-over check, is dropped for its run alone: every lease is renewed, the others'
    progress is written, the next tick is a plain one again (before: the batched renewal
    failed for every lease on every tick)."""
    leases = [held(store, f"r{i}", 30.0) for i in range(3)]
    heartbeat = Heartbeat(store, 10.0)
    for lease in leases:
        heartbeat.register(lease, start=False)
    assert heartbeat.beat_once() is not None  # the renewal's engine connects (MySQL: autocommit)
    with driver_statements(store.engines) as seen:
        assert heartbeat.beat_once() is not None
    plain = len(seen)
    leases[0].report.report(1, 10, "fine")
    leases[1].report._latest = Progress(2.0, None, "bad \udc80")  # past the check
    leases[2].report.report(3, 10, "fine too")
    before = {lease.key: store.get(lease.run_id).lease_expires_at for lease in leases}  # type: ignore[union-attr]
    time.sleep(0.01)
    result = heartbeat.beat_once()
    assert result is not None and result.renewed == {lease.key for lease in leases}
    for lease in leases:
        row = store.get(lease.run_id)
        assert row is not None and row.lease_expires_at > before[lease.key]
    rows = [store.get(lease.run_id) for lease in leases]
    assert [(r.progress_done, r.progress_note) for r in rows if r is not None] == [
        (1.0, "fine"),
        (None, None),
        (3.0, "fine too"),
    ]
    assert all(lease.report.pending() is None for lease in leases)
    with driver_statements(store.engines) as seen:
        assert heartbeat.beat_once() is not None
    assert len(seen) == plain


def _lost_or_double(cluster: Cluster, run_ids: list[str]) -> list[str]:
    """What went wrong with innocent runs: a second start (lease lost), not one commit."""
    found = []
    for run_id in run_ids:
        starts = [e.attempt for e in cluster.effects(run_id, "start")]
        commits = cluster.effects(run_id, "commit")
        if starts != [1] or len(commits) != 1 or cluster.status(run_id) != "succeeded":
            found.append(f"{run_id}: starts {starts}, commits {len(commits)}")
    return found


@SQLITE_FS_AND_PG
@pytest.mark.timeout(120)
def test_poisoned_run_fails_at_its_call_and_innocent_runs_keep_their_leases(
    cluster: Cluster,
) -> None:
    """A threads worker running 4 innocent runs (progress every 50 ms) and one whose body
    hands progress() a NUL note: the poisoned body gets LeaseInputError at its call and
    its run fails naming the note; every innocent run keeps its lease, runs once and
    commits once (before: the heartbeat failed for all, an innocent body ran 3 times,
    the poisoned run ended "attempts exhausted")."""
    worker = cluster.start(
        "w1", pool="threads", concurrency=6, conf={**CONF, "lease_max_attempts": 3}, **SHORT
    )
    innocent = [cluster.send("reporter", 4.0) for _ in range(4)]
    poisoned = cluster.send("hostile", ["nul_note"], 4.0)
    wait_for(
        lambda: all(cluster.status(r) in ("succeeded", "failed") for r in [*innocent, poisoned]),
        60,
        what="every run to finish",
    )
    assert _lost_or_double(cluster, innocent) == []
    row = cluster.store.get(poisoned)
    assert row is not None and row.status == "failed"
    assert row.failure_code == "lease_input_invalid:progress_note"
    assert "progress_note" in (row.last_error or "") and "NUL" in (row.last_error or "")
    assert "heartbeat failed" not in worker.log()


@PG_REDIS
@pytest.mark.timeout(120)
def test_database_refused_progress_is_dropped_for_its_run_alone_in_a_worker(
    cluster: Cluster,
) -> None:
    """With the hand-over check bypassed (a value the database refuses that no check
    foresaw: a NUL note on PostgreSQL), the heartbeat drops that run's progress alone: the
    innocent runs and the poisoned run itself keep their leases and commit once."""
    worker = cluster.start(
        "w1", pool="threads", concurrency=6, conf=CONF, CL_UNCHECKED_PROGRESS="1", **SHORT
    )
    innocent = [cluster.send("reporter", 4.0) for _ in range(4)]
    poisoned = cluster.send("hostile", ["nul_note"], 4.0)
    wait_for(
        lambda: all(cluster.status(r) in ("succeeded", "failed") for r in [*innocent, poisoned]),
        60,
        what="every run to finish",
    )
    assert _lost_or_double(cluster, [*innocent, poisoned]) == []
    assert cluster.effects(poisoned, "accepted:nul_note")
    log = worker.log()
    assert f"run {poisoned}: progress dropped" in log
    assert "heartbeat failed" not in log


@PG_AND_MARIADB
@pytest.mark.timeout(120)
def test_a_run_holding_its_fenced_transactions_open_costs_no_other_run_its_lease(
    cluster: Cluster,
) -> None:
    """A threads worker running 3 innocent runs beside one whose body holds fenced
    transactions open for 1.2 s of its 2 s lease, back to back: every run keeps its
    lease, runs once and commits once. Before, each renewal of the process's leases
    waited for that run's row lock, gave up after its lock wait (a sixth of the lease) and
    failed for every lease: the innocent runs lost theirs and ran again."""
    worker = cluster.start(
        "w1", pool="threads", concurrency=4, conf={**CONF, "lease_max_attempts": 3}, **SHORT
    )
    innocent = [cluster.send("reporter", 4.0) for _ in range(3)]
    fencing = cluster.send("fences_long", 1.2, 4)
    wait_for(
        lambda: all(cluster.status(r) in ("succeeded", "failed") for r in [*innocent, fencing]),
        60,
        what="every run to finish",
    )
    assert _lost_or_double(cluster, [*innocent, fencing]) == []
    log = worker.log()
    assert "heartbeat failed" not in log and "held -> lost" not in log


@pytest.mark.timeout(60)
def test_last_checkpoint_follows_a_savepoint_rollback(store: LeaseStore) -> None:
    """fence(conn, checkpoint=) inside a savepoint that rolls back, the transaction then
    committing: last_checkpoint in memory is the database's, the one before (before: the
    rolled-back state)."""
    lease = held(store, "r1", 30.0)
    lease.checkpoint({"n": 1})
    with lease.transaction() as conn:
        savepoint = conn.begin_nested()
        lease.fence(conn, checkpoint={"n": 2})
        savepoint.rollback()
        lease.fence(conn)
    row = store.get("r1")
    assert row is not None and row.checkpoint == '{"n":1}'
    assert lease.last_checkpoint == {"n": 1}
    with lease.transaction() as conn:
        savepoint = conn.begin_nested()
        lease.fence(conn, checkpoint={"n": 3})
        savepoint.commit()
    assert lease.last_checkpoint == {"n": 3}
    row = store.get("r1")
    assert row is not None and row.checkpoint == '{"n":3}'
