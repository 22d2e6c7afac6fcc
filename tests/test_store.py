"""LeaseStore against real SQL: SQLite always, PostgreSQL when available."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from celery_lease import LeaseLost, LeaseStore
from celery_lease.errors import LeaseDatabaseError, LeaseInputError
from celery_lease.migrations import upgrade
from celery_lease.schema import runs
from celery_lease.store import OTHER_DELIVERY, RunNotFound
from celery_lease.store.driver import held_for

from .helpers import driver_statements


def claim(store: LeaseStore, run_id: str, owner: str, lease_ms: int = 2000, **kw: Any) -> Any:
    return store.claim(
        run_id,
        owner,
        task_name="t",
        lease_ms=lease_ms,
        max_attempts=kw.pop("max_attempts", 5),
        **kw,
    )


def test_db_clock_is_epoch_milliseconds(store: LeaseStore) -> None:
    """The database clock reads epoch milliseconds close to this machine's clock."""
    readings = []
    for _ in range(3):
        readings.append(store.now_ms())
        time.sleep(0.004)
    assert abs(readings[0] - time.time() * 1000) < 5000
    assert readings == sorted(readings)
    # Readings at least 4 ms apart: at most one of them can fall on a whole second (five
    # back-to-back readings all did once in about a thousand runs, failing a CI run).
    assert readings[0] < readings[1] < readings[2], readings
    assert sum(1 for r in readings if r % 1000 == 0) <= 1, "expected sub-second resolution"


def test_claim_renew_complete(store: LeaseStore) -> None:
    """A claim inserts a running row at attempt 1; heartbeat renews it; complete ends it."""
    result = claim(store, "r1", "A")
    assert (result.outcome, result.attempt) == ("claimed", 1)
    row = store.get("r1")
    assert row is not None and row.status == "running" and row.lease_owner == "A"
    before = row.lease_expires_at
    assert before is not None
    time.sleep(0.02)
    beat = store.heartbeat([("r1", "A", 1)])
    assert beat.renewed == {("r1", "A", 1)} and not beat.lost
    after = store.get("r1")
    assert after is not None and after.lease_expires_at is not None
    assert after.lease_expires_at > before
    store.complete("r1", "A", 1)
    done = store.get("r1")
    assert done is not None and done.status == "succeeded" and done.finished_at is not None


def test_second_owner_refused_while_lease_live(store: LeaseStore) -> None:
    """While A's lease is live, B's claim is busy and reports the time left."""
    claim(store, "r1", "A", lease_ms=5000)
    result = claim(store, "r1", "B", lease_ms=5000)
    assert result.outcome == "busy"
    assert 3.0 < result.retry_in <= 5.0
    row = store.get("r1")
    assert row is not None and row.lease_owner == "A" and row.attempt == 1


def test_takeover_after_expiry_increments_attempt(store: LeaseStore) -> None:
    """Once A's lease expires, B takes the run over with attempt 2."""
    claim(store, "r1", "A", lease_ms=200)
    assert store.expire("r1")
    result = claim(store, "r1", "B")
    assert (result.outcome, result.attempt) == ("claimed", 2)
    row = store.get("r1")
    assert row is not None and row.lease_owner == "B" and row.attempt == 2


def test_stale_owner_is_refused_everywhere(store: LeaseStore) -> None:
    """After a takeover, the old owner's heartbeat, complete, fail and fence are refused."""
    claim(store, "r1", "A", lease_ms=200)
    assert store.expire("r1")
    claim(store, "r1", "B")
    beat = store.heartbeat([("r1", "A", 1)])
    assert beat.lost == {("r1", "A", 1)} and not beat.renewed
    with pytest.raises(LeaseLost) as lost:
        store.complete("r1", "A", 1)
    assert lost.value.code == "automation_run_lease_lost"
    assert str(lost.value).startswith("automation_run_lease_lost")
    assert (lost.value.run_id, lost.value.owner, lost.value.attempt) == ("r1", "A", 1)
    assert "attempt 2" in lost.value.reason
    with pytest.raises(LeaseLost):
        store.fail("r1", "A", 1, error="x", failure_code="exception:X", retry_in=1.0)
    with pytest.raises(LeaseLost), store.engine.begin() as conn:
        store.fence(conn, "r1", "A", 1)
    row = store.get("r1")
    assert row is not None and row.status == "running" and row.lease_owner == "B"
    store.complete("r1", "B", 2)


def test_expired_but_not_taken_over_cannot_renew(store: LeaseStore) -> None:
    """A lease past its expiry is not renewed, even if nobody took it over."""
    claim(store, "r1", "A", lease_ms=100)
    assert store.expire("r1")
    assert store.heartbeat([("r1", "A", 1)]).lost == {("r1", "A", 1)}


def test_terminal_run_is_never_claimed_again(store: LeaseStore) -> None:
    """A claim on a succeeded run reports it finished and changes nothing."""
    claim(store, "r1", "A")
    store.complete("r1", "A", 1)
    result = claim(store, "r1", "B")
    assert (result.outcome, result.status) == ("finished", "succeeded")
    row = store.get("r1")
    assert row is not None and row.attempt == 1 and row.lease_owner == "A"


def test_heartbeat_renews_many_in_one_statement(store: LeaseStore) -> None:
    """One heartbeat call renews every held lease and reports the ones not held."""
    keys = []
    for i in range(50):
        claim(store, f"r{i}", f"A{i}")
        keys.append((f"r{i}", f"A{i}", 1))
    # Counted at the driver: on SQLite that includes any PRAGMA or BEGIN
    # SQLAlchemy would send around the statement.
    with driver_statements(store.engines) as seen:
        store.now_ms()  # SQLite: the recorder re-opens the connections; not counted
        seen.clear()
        beat = store.heartbeat([*keys, ("nope", "X", 1)])
    statements = [sql for _, sql in seen]
    assert beat.renewed == set(keys)
    assert beat.lost == {("nope", "X", 1)}
    # MySQL has no UPDATE .. RETURNING: the renewed rows are read back after the
    # (autocommit) UPDATE, one more statement regardless of the lease count.
    assert len(statements) == (2 if store.db.dialect == "mysql" else 1)


@pytest.mark.parametrize("scheme", ["mysql+pymysql", "mariadb+pymysql"])
def test_mysql_renewal_reads_its_rows_by_primary_key_under_either_url(
    mysql_url: str, scheme: str
) -> None:
    """The renewal's UPDATE carries FORCE INDEX (PRIMARY) under ``mysql+pymysql://`` and
    ``mariadb+pymysql://`` alike (SQLAlchemy names the second dialect "mariadb" and
    renders a hint for one dialect name only: the hint was lost there), so InnoDB never
    locks a range of the status index, other workers' live rows with it."""
    url = make_url(mysql_url).set(drivername=scheme).render_as_string(hide_password=False)
    upgrade(url)
    store = LeaseStore.from_url(url)
    try:
        claim(store, "r1", "A")
        with driver_statements(store.engines) as seen:
            beat = store.heartbeat([("r1", "A", 1)])
        assert beat.renewed == {("r1", "A", 1)}
        (renewal,) = [sql for _, sql in seen if sql.lstrip().upper().startswith("UPDATE")]
        assert "FORCE INDEX (PRIMARY)" in renewal, renewal
    finally:
        store.dispose()


def test_fail_retrying_then_claimable_after_backoff(store: LeaseStore) -> None:
    """fail() with a delay makes the run retrying; it is busy until available_at."""
    claim(store, "r1", "A")
    assert store.fail("r1", "A", 1, error="E: x", failure_code="exception:E", retry_in=0.3) == (
        "retrying"
    )
    early = claim(store, "r1", "B")
    assert early.outcome == "busy" and 0 < early.retry_in <= 0.3
    time.sleep(0.35)
    assert claim(store, "r1", "B").attempt == 2


def test_attempts_exhausted_fails_without_running(store: LeaseStore) -> None:
    """A claimable run with no attempts left becomes failed instead of running."""
    claim(store, "r1", "A", lease_ms=100, max_attempts=1)
    assert store.expire("r1")
    result = claim(store, "r1", "B", max_attempts=1)
    assert (result.outcome, result.status) == ("finished", "failed")
    row = store.get("r1")
    assert row is not None and row.failure_code == "lease_expired" and row.attempt == 1
    # As a sweep words it (a redelivery's claim said "attempts exhausted: 1 of 1 used").
    assert row.last_error == "lease expired on attempt 1 of 1 (worker lost or stalled)"


def test_fence_holds_the_row_inside_the_callers_transaction(store: LeaseStore) -> None:
    """fence() passes for the live owner and fails once the lease expired."""
    claim(store, "r1", "A", lease_ms=300)
    with store.engine.begin() as conn:
        store.fence(conn, "r1", "A", 1)
    assert store.expire("r1")
    with pytest.raises(LeaseLost), store.engine.begin() as conn:
        store.fence(conn, "r1", "A", 1)


def test_release_hands_the_run_back_at_once(store: LeaseStore) -> None:
    """release() makes the run retrying and immediately claimable by another worker."""
    claim(store, "r1", "A", lease_ms=60_000)
    store.release("r1", "A", 1)
    assert claim(store, "r1", "B").attempt == 2


def test_cancel(store: LeaseStore) -> None:
    """cancel(): running gets a request seen by heartbeat; retrying ends at once."""
    claim(store, "r1", "A")
    assert store.cancel("r1") == "running"
    assert store.heartbeat([("r1", "A", 1)]).cancel_requested == {("r1", "A", 1)}
    store.mark_cancelled("r1", "A", 1)
    assert claim(store, "r1", "B").status == "cancelled"
    claim(store, "r2", "A")
    store.release("r2", "A", 1, available_in=60)
    assert store.cancel("r2") == "cancelled"
    with pytest.raises(RunNotFound):
        store.cancel("missing")


def test_cancel_terminated_in_a_worker_ends_the_run_its_process_held(store: LeaseStore) -> None:
    """cancel(terminated_in=worker id): a running run a process of that worker holds under
    the task id ends cancelled at once; one held in another worker, or under another task
    id, only gets a request (a worker id that is a LIKE pattern matches only itself)."""
    claim(store, "r1", "h:1:t1.w_1", task_id="t-1")
    claim(store, "r2", "h:2:t2.w%1", task_id="t-2")
    claim(store, "r3", "h:1:t3.w_1", task_id="t-3")
    assert store.cancel("r1", task_id="t-1", terminated_in="w_1") == "cancelled"
    row = store.get("r1")
    assert row is not None and row.failure_code == "cancelled" and row.finished_at is not None
    assert store.cancel("r2", task_id="t-2", terminated_in="w_1") == "running"
    assert store.cancel("r3", task_id="t-x", terminated_in="w_1") == OTHER_DELIVERY
    assert [store.get(r).status for r in ("r2", "r3")] == ["running", "running"]  # type: ignore[union-attr]


def _racer(url: str, barrier: Any, rounds: int, results: Any, index: int) -> None:
    store = LeaseStore.from_url(url, pool_size=1)
    for round_no in range(rounds):
        barrier.wait(30)
        result = store.claim(
            f"race-{round_no}", f"p{index}", task_name="t", lease_ms=60_000, max_attempts=5
        )
        results.put((round_no, index, result.outcome, result.attempt))
    store.dispose()


@pytest.mark.timeout(300)
def test_eight_processes_race_one_winner_each_round(pg_url: str) -> None:
    """8 processes claim the same run at once, 50 rounds: exactly one wins every round."""
    LeaseStore.from_url(pg_url).create_schema()
    rounds, procs = 50, 8
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_racer, args=(pg_url, barrier, rounds, results, i)) for i in range(procs)
    ]
    for proc in workers:
        proc.start()
    try:
        outcomes = [results.get(timeout=120) for _ in range(rounds * procs)]
    finally:
        for proc in workers:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for round_no in range(rounds):
        these = [o for o in outcomes if o[0] == round_no]
        winners = [o for o in these if o[2] == "claimed"]
        assert len(these) == procs
        assert len(winners) == 1, these
        assert winners[0][3] == 1
        assert all(o[2] == "busy" for o in these if o not in winners)
    store = LeaseStore.from_url(pg_url)
    with store.engine.connect() as conn:
        attempts = conn.execute(select(runs.c.attempt)).scalars().all()
    assert sorted(attempts) == [1] * rounds


def test_fence_complete_commits_with_the_callers_writes(store: LeaseStore) -> None:
    """fence(complete=True) marks the run succeeded in the caller's transaction; a
    rollback undoes it; complete() afterwards is idempotent for the same owner."""
    claim(store, "r1", "A")
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        store.fence(conn, "r1", "A", 1, complete=True)
        raise RuntimeError("roll back")
    row = store.get("r1")
    assert row is not None and row.status == "running"
    with store.engine.begin() as conn:
        store.fence(conn, "r1", "A", 1, complete=True)
    row = store.get("r1")
    assert row is not None and row.status == "succeeded"
    store.complete("r1", "A", 1)  # idempotent for its owner
    with pytest.raises(LeaseLost):
        store.complete("r1", "B", 2)


def _sweeper(url: str, barrier: Any, results: Any) -> None:
    store = LeaseStore.from_url(url, pool_size=1)
    barrier.wait(30)
    results.put([record.id for record, _status in store.sweep_expired(limit=1000)])
    store.dispose()


def test_sweep_leaves_renewed_and_taken_over_runs_alone(store: LeaseStore) -> None:
    """sweep_expired moves only expired leases, and its guarded write refuses a run
    that was taken over after the sweeper read it."""
    claim(store, "live", "A", lease_ms=60_000)
    claim(store, "dead", "A", lease_ms=100)
    claim(store, "raced", "A", lease_ms=100)
    assert store.expire("dead") and store.expire("raced")
    record = store.get("raced")
    assert record is not None
    claim(store, "raced", "B", lease_ms=60_000)  # a takeover between read and write
    with store.engine.begin() as conn:  # the sweep's own transaction, as sweep_expired runs it
        assert store._sweep_one(record, conn) is None
    moved = {r.id: status for r, status in store.sweep_expired()}
    assert moved == {"dead": "retrying"}
    row = store.get("dead")
    assert row is not None and row.failure_code == "lease_expired"
    assert store.get("live").status == "running"  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_two_concurrent_sweepers_never_take_the_same_run(pg_url: str) -> None:
    """Two sweepers racing over 200 expired runs on PostgreSQL split them disjointly."""
    store = LeaseStore.from_url(pg_url)
    store.create_schema()
    for i in range(200):
        claim(store, f"x{i}", "A", lease_ms=50)
        assert store.expire(f"x{i}")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_sweeper, args=(pg_url, barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        first, second = results.get(timeout=60), results.get(timeout=60)
    finally:
        for proc in procs:
            proc.join(30)
    assert not set(first) & set(second)
    assert set(first) | set(second) == {f"x{i}" for i in range(200)}
    store.dispose()


@pytest.mark.timeout(60)
def test_sweep_skips_a_row_locked_by_a_stalled_transaction(store: LeaseStore) -> None:
    """A stalled transaction holding an expired run's row lock does not stall the
    sweeper: that row is skipped this time, the others are swept (PostgreSQL, MySQL)."""
    if store.db.dialect == "sqlite":
        pytest.skip("SQLite has one writer at a time: there are no row locks to skip")
    claim(store, "stuck", "A", lease_ms=100)
    claim(store, "free", "A", lease_ms=100)
    assert store.expire("stuck") and store.expire("free")
    with store.engine.connect() as stalled:
        stalled.begin()
        stalled.execute(select(runs.c.id).where(runs.c.id == "stuck").with_for_update())
        started = time.monotonic()
        moved = {r.id for r, _ in store.sweep_expired()}
        assert time.monotonic() - started < 5
        stalled.rollback()
    assert moved == {"free"}
    assert {r.id for r, _ in store.sweep_expired()} == {"stuck"}


def _kill_other_sessions(store: LeaseStore) -> int:
    """Terminate every other server session on the store's database (its pooled connections)."""
    from sqlalchemy import create_engine, text

    admin = create_engine(store.engine.url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if store.db.dialect == "postgresql":
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar()
                return int(killed or 0)
            ids = conn.execute(
                text(
                    "SELECT id FROM information_schema.processlist"
                    " WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
            ).scalars()
            count = 0
            for session in ids:
                conn.execute(text(f"KILL {int(session)}"))
                count += 1
            return count
    finally:
        admin.dispose()


def test_hot_path_after_the_server_dropped_its_connections(
    store: LeaseStore, request: pytest.FixtureRequest
) -> None:
    """Claim and completion run on the raw driver: a dead connection fails one call as a
    transient LeaseDatabaseError (from SQLAlchemy's invalidated DBAPIError), and the next
    call reconnects."""
    from sqlalchemy.exc import DBAPIError

    if store.db.dialect == "sqlite":
        pytest.skip("an embedded database has no server to drop connections")
    if request.node.callspec.params.get("lease_db_url") == "pgbouncer":
        pytest.skip("PgBouncer keeps its clients' connections when a server connection drops")
    claim(store, "r1", "A", lease_ms=60_000)
    assert store.get("r1") is not None  # every pool holds a connection now
    assert _kill_other_sessions(store) >= 1
    with pytest.raises(LeaseDatabaseError) as failed:
        store.complete("r1", "A", 1)
    assert failed.value.transient and failed.value.failure_code == "lease_db_unavailable"
    assert isinstance(failed.value.__cause__, DBAPIError)
    assert failed.value.__cause__.connection_invalidated
    store.complete("r1", "A", 1)  # a fresh connection; the first call changed nothing
    row = store.get("r1")
    assert row is not None and row.status == "succeeded"
    assert _kill_other_sessions(store) >= 1
    with pytest.raises(LeaseDatabaseError) as failed:
        claim(store, "r2", "A")
    assert failed.value.transient
    assert claim(store, "r2", "A").outcome == "claimed"


def test_over_long_run_id_is_refused_before_any_sql(store: LeaseStore) -> None:
    """A run id longer than the column is a LeaseInputError raised before any statement
    (PostgreSQL used to answer 'value too long', retried forever as unreachable)."""
    with (
        driver_statements(store.engines) as seen,
        pytest.raises(LeaseInputError, match="run_id: is 300 characters") as refused,
    ):
        claim(store, "x" * 300, "A")
    assert refused.value.failure_code == "lease_input_invalid:run_id"
    assert seen == []
    assert claim(store, "r1", "A").outcome == "claimed"  # the store is still usable


def test_sqlite_hot_path_commits_after_someone_switched_to_autocommit(sqlite_url: str) -> None:
    """Another user of the engine switching a connection to AUTOCOMMIT (SQLAlchemy then resets
    pysqlite to implicit transactions) does not make the claim or completion roll back."""
    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    with store.engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(select(runs.c.id)).all()
    claim(store, "r1", "A")
    store.complete("r1", "A", 1)
    store.dispose()
    fresh = LeaseStore.from_url(sqlite_url)
    row = fresh.get("r1")
    fresh.dispose()
    assert row is not None and row.status == "succeeded"


def keep(store: LeaseStore, run_id: str, task_id: str, message: bytes = b"{}") -> bool:
    return store.keep_delivery(
        run_id,
        task_name="t",
        task_id=task_id,
        payload=message,
        payload_content_type="application/json",
        lease_ms=2000,
        max_attempts=5,
    )


@pytest.mark.timeout(60)
def test_keep_delivery_leaves_each_refused_publish_to_the_sweeper(store: LeaseStore) -> None:
    """keep_delivery: no row -> a queued row with the message, which reclaim_stale returns;
    a live run of the same delivery is kept as it is; a finished run, or a run whose
    own delivery has another task id, cannot keep it."""
    assert keep(store, "new", "new", b'{"m": 1}')
    row = store.get("new")
    assert row is not None and (row.status, row.attempt, row.task_id) == ("queued", 0, "new")
    assert (row.payload, row.payload_content_type) == (b'{"m": 1}', "application/json")
    assert [r.id for r, _ in store.reclaim_stale(0)] == ["new"]
    assert claim(store, "new", "A", task_id="new").attempt == 1  # a normal first claim

    claim(store, "held", "A", task_id="held", payload=b"own", payload_content_type="x/y")
    assert keep(store, "held", "held", b"dup")  # a running run: sweep_expired covers it
    row = store.get("held")
    assert row is not None and (row.status, row.payload, row.lease_owner) == (
        "running",
        b"own",
        "A",
    )
    assert not keep(store, "held", "other-task")  # not this run's own delivery

    claim(store, "direct", "A")  # a direct call: no message, no task id
    store.fail("direct", "A", 1, error="e", failure_code="x", retry_in=0.0)
    assert keep(store, "direct", "t-direct", b"adopted")
    row = store.get("direct")
    assert row is not None and (row.status, row.payload, row.task_id) == (
        "retrying",
        b"adopted",
        "t-direct",
    )

    claim(store, "done", "A", task_id="done", payload=b"own", payload_content_type="x/y")
    store.complete("done", "A", 1)
    assert not keep(store, "done", "done")
    row = store.get("done")
    assert row is not None and row.status == "succeeded" and row.payload is None


def test_completion_keeps_the_result_in_the_same_statement(store: LeaseStore) -> None:
    """The completion writes the body's serialized result with the success, in one
    statement; after fence(complete=True) the completion keeps it instead of reading."""
    claim(store, "r1", "A")
    with driver_statements(store.engines) as seen:
        store.complete("r1", "A", 1, result=(b'{"n": 1}', "application/json"))
    on_runs = [sql for _, sql in seen if runs.name in sql]
    assert len(on_runs) == 1 and on_runs[0].lstrip().upper().startswith("UPDATE"), on_runs
    row = store.get("r1")
    assert row is not None and row.status == "succeeded"
    assert (row.result, row.result_content_type) == (b'{"n": 1}', "application/json")
    claim(store, "r2", "A")
    with store.engine.begin() as conn:
        store.fence(conn, "r2", "A", 1, complete=True)
    store.complete("r2", "A", 1, result=(b"2", "application/json"))
    kept = store.get("r2")
    assert kept is not None and kept.result == b"2"


def test_result_is_kept_only_when_bounded_and_accepted() -> None:
    """encode_result: the app's result_serializer, at most MAX_RESULT_BYTES, a content
    type in accept_content; decode_result refuses any other content type."""
    from celery import Celery

    from celery_lease.requeue import MessageNotAccepted
    from celery_lease.run.outcome import decode_result, encode_result
    from celery_lease.schema import MAX_RESULT_BYTES

    app = Celery("t", set_as_current=False)
    assert encode_result(app, {"a": [1, 2]}) == (b'{"a": [1, 2]}', "application/json")
    assert encode_result(app, None) == (b"null", "application/json")
    assert encode_result(app, "x" * MAX_RESULT_BYTES) is None
    assert encode_result(app, object()) is None
    pickling = Celery("p", set_as_current=False)  # the format is read once per app
    pickling.conf.result_serializer = "pickle"
    assert encode_result(pickling, 1) is None  # pickle is not in accept_content
    with pytest.raises(MessageNotAccepted):
        decode_result(app, b"\x80\x04K\x01.", "application/x-python-serialize")
    assert decode_result(app, b"[1]", "application/json") == [1]
    # Pickle accepted for messages only: a stored result is decoded under
    # result_accept_content, as Celery's result backends decode theirs.
    split = Celery("s", set_as_current=False)
    split.conf.update(accept_content=["json", "pickle"], result_accept_content=["json"])
    with pytest.raises(MessageNotAccepted):
        decode_result(split, b"\x80\x04K\x01.", "application/x-python-serialize")
    unreplayable = Celery("u", set_as_current=False)
    unreplayable.conf.update(
        accept_content=["json", "pickle"],
        result_accept_content=["json"],
        result_serializer="pickle",
    )
    assert encode_result(unreplayable, 1) is None  # it could never be replayed: not kept


def test_recovery_history_counts_takeovers_and_sweeps_and_no_claim_resets_it(
    store: LeaseStore,
) -> None:
    """``takeovers`` grows only when a claim takes a run over from an expired lease (not on
    an insert, nor on a claim of a retrying run); ``republishes`` grows with each sweeper
    publish (expired lease, stranded message) and, unlike ``requeues``, no claim or rerun
    resets either; each keeps the time of its last change (DB clock); every database (MySQL
    assigns SET left to right: the takeover must read the status before the claim sets it)."""
    message = (b'{"args": [], "kwargs": {}, "options": {}}', "application/json")
    first = claim(store, "r", "A", payload=message[0], payload_content_type=message[1])
    row = store.get("r")
    assert row is not None and (row.takeovers, row.taken_over_at) == (0, None)
    assert store.expire("r")
    before = store.now_ms()
    taken = claim(store, "r", "B", payload=message[0], payload_content_type=message[1])
    assert (first.attempt, taken.attempt) == (1, 2)
    row = store.get("r")
    assert row is not None and row.takeovers == 1
    assert row.taken_over_at is not None and row.taken_over_at >= before
    assert store.expire("r")
    assert [status for _, status in store.sweep_expired()] == ["retrying"]
    row = store.get("r")
    assert row is not None and (row.republishes, row.requeues) == (1, 1)
    assert row.republished_at is not None and row.republished_at >= before
    # A claim of a retrying run: no takeover.
    third = claim(store, "r", "C", payload=message[0], payload_content_type=message[1])
    row = store.get("r")
    assert row is not None and third.attempt == 3
    assert (row.takeovers, row.republishes, row.requeues) == (1, 1, 0)
    store.fail("r", "C", 3, error="x", failure_code="e", retry_in=0.0)
    assert [status for _, status in store.reclaim_stale(0)] == ["retrying"]
    row = store.get("r")
    assert row is not None and (row.takeovers, row.republishes, row.requeues) == (1, 2, 1)
    fourth = claim(store, "r", "D")
    store.fail("r", "D", fourth.attempt, error="x", failure_code="e", retry_in=None)
    rerun = store.rerun("r", attempts=2)
    assert (rerun.takeovers, rerun.republishes, rerun.requeues) == (1, 2, 0)


def test_rerun_many_takes_only_runs_still_in_the_status_with_a_message(
    store: LeaseStore,
) -> None:
    """One bulk step puts the named runs that are still failed (with a stored message) back
    to queued under their new task ids, with fresh attempts; a live run, a run in another
    status and a run without a message are left alone and not returned."""
    from celery_lease.store import RunPageQuery

    message = (b'{"args": [], "kwargs": {}, "options": {}}', "application/json")
    for run_id in ("f1", "f2", "bare", "live", "c1"):
        kw = {} if run_id == "bare" else {"payload": message[0], "payload_content_type": message[1]}
        result = claim(store, run_id, f"o-{run_id}", max_attempts=1, **kw)
        if run_id == "c1":
            store.mark_cancelled(run_id, result.owner, 1)
        elif run_id != "live":
            store.fail(run_id, result.owner, 1, error="x", failure_code="e", retry_in=None)
    query = RunPageQuery(status="failed", task_name="t")
    assert store.reads.count_runs(query) == (3, 2)
    assert store.reads.count_runs(query, cap=2)[0] == 2
    new = {run_id: f"new-{run_id}" for run_id in ("f1", "f2", "bare", "live", "c1")}
    changed = store.rerun_many(new, status="failed", attempts=3)
    assert sorted((r.id, r.status, r.task_id, r.max_attempts) for r in changed) == [
        ("f1", "queued", "new-f1", 4),
        ("f2", "queued", "new-f2", 4),
    ]
    assert store.get("bare").status == "failed"  # type: ignore[union-attr]
    assert store.get("live").status == "running"  # type: ignore[union-attr]
    assert store.get("c1").status == "cancelled"  # type: ignore[union-attr]
    assert store.rerun_many({"f1": "again"}, status="failed", attempts=3) == []
    with pytest.raises(ValueError, match="failed or cancelled"):
        store.rerun_many(new, status="succeeded", attempts=3)


def test_hot_statements_fit_psycopgs_query_cache() -> None:
    """The claim, completion and checkpoint statements stay within psycopg's query cache
    (at most 4,096 bytes and 50 parameters): a longer one has its placeholders parsed again
    on every execution, about 0.1 ms of CPU per claim (measured when the claim reached
    4,102 bytes)."""
    from psycopg import _queries
    from sqlalchemy.dialects import postgresql

    from celery_lease.store.sql import checkpoint_by_binds, claim_upsert, complete_by_binds

    dialect = postgresql.psycopg.dialect()  # type: ignore[attr-defined]
    for name, statement in (
        ("claim", claim_upsert(postgresql.insert)),
        ("complete", complete_by_binds()),
        ("checkpoint", checkpoint_by_binds()),
    ):
        compiled = statement.compile(dialect=dialect)
        size = len(str(compiled).encode())
        assert size <= _queries.MAX_CACHED_STATEMENT_LENGTH, (name, size)
        assert len(compiled.params) <= _queries.MAX_CACHED_STATEMENT_PARAMS, name


@pytest.mark.timeout(60)
def test_sqlite_hot_path_keeps_one_connection_per_task_thread(sqlite_url: str) -> None:
    """On SQLite the claim and the completion run on a connection the task thread keeps
    (a pool check-out and check-in cost about 10 µs of CPU a statement): no check-out per
    task. Another thread checks out of the pool as before; dispose() gives the kept one
    up; a connection found dead is replaced."""
    from sqlalchemy import event

    store = LeaseStore.from_url(sqlite_url)
    store.create_schema()
    checkouts: list[int] = []
    event.listen(store.db.engine.pool, "checkout", lambda *a: checkouts.append(1))

    def run(run_id: str) -> None:
        claim = store.claim(run_id, "o", task_name="t", lease_ms=30_000, max_attempts=5)
        assert claim.outcome == "claimed"
        store.complete(run_id, "o", claim.attempt)

    try:
        for i in range(50):
            run(f"r{i}")
        assert len(checkouts) <= 1, len(checkouts)
        errors: list[BaseException] = []

        def other() -> None:
            try:
                for i in range(5):
                    run(f"t{i}")
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        assert not errors and not thread.is_alive()
        assert 1 < len(checkouts) <= 11  # the other thread: the pool, twice per run
        status = store.db.engine.pool.checkedout()
        assert status == 1, status  # the task thread's, kept
        store.dispose()  # the new pool keeps the old one's listeners
        assert store.db.engine.pool.checkedout() == 0
        checkouts.clear()
        run("after-dispose")
        assert len(checkouts) == 1 and store.db.engine.pool.checkedout() == 1
        held = held_for(store.db.auto)
        assert held is not None
        held.take(store.db.auto).dbapi_connection.close()  # as if the file went away
        with pytest.raises(LeaseDatabaseError):
            run("dead")
        run("after-dead")
        assert len(checkouts) == 2 and store.db.engine.pool.checkedout() == 1
        with store.db.engine.connect() as conn:
            done = conn.execute(select(runs.c.status).where(runs.c.id.like("%"))).scalars().all()
        assert done.count("succeeded") == 57
    finally:
        store.dispose()


def test_postgresql_hot_path_runs_through_libpq_not_psycopgs_cursor(
    pg_url: str, pgbouncer_url: str
) -> None:
    """On a connection that reaches PostgreSQL directly, the claim and the completion skip
    psycopg's cursor (about 16 µs of CPU a statement) and run as statements prepared once
    per connection: bytes, text and integers go and come back as they were, a prepared
    statement the server dropped or a plan a schema change made stale is prepared again,
    and a dead connection fails one statement and is replaced. Behind PgBouncer, where
    nothing may be prepared, they keep the cursor."""
    import psycopg

    from celery_lease.store.postgresql import LibpqStatement

    cursor_calls: list[Any] = []
    sent: list[int] = []
    counting = threading.local()
    original_execute, original_exec = psycopg.Cursor.execute, LibpqStatement._exec

    def counted_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(counting, "on", False):
            cursor_calls.append(args[0])
        return original_execute(self, *args, **kwargs)

    def counted_exec(self: Any, pgconn: Any, values: Any) -> Any:
        sent.append(1)
        return original_exec(self, pgconn, values)

    def run(store: LeaseStore, run_id: str, owner: str = "ø-owner") -> None:
        counting.on = True  # the claim and the completion (a new connection's set-up aside)
        claim = store.claim(
            run_id,
            owner,
            task_name="tâche ✓",
            lease_ms=30_000,
            max_attempts=5,
            payload=b"\x00\xff\x00 body",
            payload_content_type="application/x-test",
            task_id=f"task-{run_id}",
        )
        assert claim.outcome == "claimed", claim
        store.complete(run_id, owner, claim.attempt, result=(b"\x00\x01", "x/y"))
        counting.on = False
        row = store.get(run_id)
        assert row is not None and row.status == "succeeded"
        assert (row.task_name, row.lease_owner, row.result) == ("tâche ✓", owner, b"\x00\x01")

    store = LeaseStore.from_url(pg_url)
    store.create_schema()
    with store.db.auto.connect():
        pass  # the pooled connection is opened (and set up) before counting
    psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]
    LibpqStatement._exec = counted_exec  # type: ignore[method-assign]
    try:
        for i in range(20):
            run(store, f"r{i}")
        assert (len(cursor_calls), len(sent)) == (0, 40), cursor_calls

        # A takeover reads back the checkpoint (JSON text, even one that reads as a
        # number), the trace context and the counters, with their types.
        first = store.claim("t", "A", task_name="t", lease_ms=30_000, max_attempts=5)
        store.checkpoint("t", "A", first.attempt, "5")
        assert store.expire("t")
        again = store.claim(
            "t", "B", task_name="t", lease_ms=30_000, max_attempts=7, trace_context="tp"
        )
        assert (again.outcome, again.attempt, again.max_attempts) == ("claimed", 2, 7)
        assert again.checkpoint == "5" and isinstance(again.checkpoint, str)

        # The server forgot the prepared statements (DEALLOCATE ALL, a pooler's reset).
        with store.db.auto.connect() as conn:
            conn.exec_driver_sql("DEALLOCATE ALL")
        run(store, "after-deallocate")
        # A column type changed under the prepared claim: its cached plan is stale.
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                "ALTER TABLE celery_lease_runs ALTER COLUMN trace_context TYPE text"
            )
        run(store, "after-alter")

        # The server ends the connection: one statement fails, the next has a new one.
        with store.db.auto.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with store.engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
        with pytest.raises(LeaseDatabaseError) as failed:
            run(store, "dead")
        assert failed.value.transient, failed.value
        counting.on = False
        run(store, "after-dead")
    finally:
        psycopg.Cursor.execute = original_execute  # type: ignore[method-assign]
        LibpqStatement._exec = original_exec  # type: ignore[method-assign]
        store.dispose()

    pooled = LeaseStore.from_url(pgbouncer_url)
    pooled.create_schema()
    sent.clear()
    LibpqStatement._exec = counted_exec  # type: ignore[method-assign]
    try:
        for i in range(5):
            run(pooled, f"p{i}")
        assert sent == []
    finally:
        LibpqStatement._exec = original_exec  # type: ignore[method-assign]
        pooled.dispose()


def test_postgresql_libpq_path_refuses_text_it_cannot_send_as_psycopg_does(pg_url: str) -> None:
    """A NUL would end a text parameter early in libpq, and a lone surrogate has no UTF-8:
    such a value goes to psycopg's cursor, which refuses it, and nothing is written."""
    store = LeaseStore.from_url(pg_url)
    store.create_schema()
    try:
        claim = store.claim("r", "A", task_name="t", lease_ms=30_000, max_attempts=5)
        # psycopg: DataError for the NUL, UnicodeEncodeError for the surrogate.
        for hostile in ("A\x00B", "A\ud800"):
            with pytest.raises((LeaseDatabaseError, UnicodeEncodeError)):
                store.complete("r", hostile, claim.attempt)
        row = store.get("r")
        assert row is not None and (row.status, row.lease_owner) == ("running", "A")
        store.complete("r", "A", claim.attempt)
    finally:
        store.dispose()
