"""Failure, recovery and control with real worker processes (issue: recovery)."""

from __future__ import annotations

import json
import signal
import sqlite3
import time

import pytest
from sqlalchemy import text

from celery_lease.store import LeaseStore
from tests.cluster import (
    AMQP_ID,
    AMQP_SETUP,
    MARIADB_ID,
    MARIADB_SETUP,
    SETUP_IDS,
    SETUPS,
    TWO_SETUPS_AND_MARIADB,
    Cluster,
)
from tests.helpers import wait_for

FAST_RETRY = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}
SQLITE_FS = pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
TWO_SETUPS_AND_AMQP = pytest.mark.parametrize(
    "cluster",
    [SETUPS[0], SETUPS[2], AMQP_SETUP, MARIADB_SETUP],
    ids=[SETUP_IDS[0], SETUP_IDS[2], AMQP_ID, MARIADB_ID],
    indirect=True,
)


@pytest.mark.timeout(90)
def test_failures_retry_with_backoff_then_succeed(cluster: Cluster) -> None:
    """A body failing twice is retried with backoff and succeeds on attempt 3."""
    cluster.start("w1", conf=FAST_RETRY)
    run_id = cluster.send("workerapp.flaky", 2)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 40, what="the third attempt")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 3
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2, 3]
    assert len(cluster.effects(run_id, "commit")) == 1


@pytest.mark.timeout(90)
def test_attempts_exhausted_end_failed_with_sanitized_error(cluster: Cluster) -> None:
    """After lease_max_attempts failures the run is failed; last_error keeps no secrets."""
    w1 = cluster.start("w1", conf={**FAST_RETRY, "lease_max_attempts": 3})
    run_id = cluster.send("workerapp.flaky", 99)
    wait_for(lambda: cluster.status(run_id) == "failed", 40, what="the run to fail")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 3
    assert row.failure_code == "exception:ConnectionError"
    assert row.last_error is not None and row.last_error.startswith("ConnectionError: ")
    for secret in ("s3cr3t-pw", "eyJhbGciOiJIUzI1NiJ9.payload.sig"):
        assert secret not in row.last_error
    assert "db.internal" in row.last_error  # the useful part survives
    time.sleep(0.5)
    assert len(cluster.effects(run_id, "start")) == 3
    lease_lines = [line for line in w1.log().splitlines() if "celery_lease" in line]
    assert not any("s3cr3t-pw" in line for line in lease_lines)


@TWO_SETUPS_AND_AMQP
@pytest.mark.timeout(120)
def test_kill9_worker_run_recovered_by_sweeper(cluster: Cluster) -> None:
    """kill -9 a worker mid-run: beat's sweeper re-enqueues it after expiry; one commit."""
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_ACKS_LATE": "1"}
    if "CL_FS_DIR" not in cluster.env:
        timing["CL_VISIBILITY_TIMEOUT"] = "4"
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.work", 3.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w1.kill9()
    killed_at = time.monotonic()
    cluster.start("w2", **timing)
    cluster.start_beat({"lease_sweep_interval": 1.0})
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="recovery")
    recovered_in = time.monotonic() - killed_at
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 2 and row.lease_owner.startswith("w2@")
    time.sleep(1.0)
    assert len(cluster.effects(run_id, "commit")) == 1
    assert recovered_in < 30


@SQLITE_FS
@pytest.mark.timeout(120)
def test_task_with_its_own_private_names_runs_leased_and_recovers_after_kill9(
    cluster: Cluster,
) -> None:
    """A task class defining _payload, _on_retry and _complete for its own use still runs
    leased: kill -9 its worker mid-run, expire the lease, and the sweeper sends the stored
    message to another worker, which commits once (attempt 2)."""
    timing = {"CL_LEASE_SECONDS": "30", "CL_HEARTBEAT": "1", "CL_ACKS_LATE": "1"}
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.audited", 30.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    row = cluster.store.get(run_id)
    assert row is not None and row.status == "running" and row.payload is not None
    w1.kill9()
    assert cluster.store.expire(run_id)
    cluster.start("w2", **timing)
    cluster.start_beat({"lease_sweep_interval": 1.0})
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="recovery")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 2 and row.lease_owner.startswith("w2@")
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2]
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]


@SQLITE_FS
@pytest.mark.timeout(120)
def test_kill9_run_on_a_task_database_recovered_by_sweeper(cluster: Cluster) -> None:
    """kill -9 a worker running a task with its own lease_database_url: beat's sweep
    sweeps that database too (not only the app's), so the run is re-enqueued and
    succeeds on attempt 2; each database records the sweep."""
    task_db = f"sqlite:///{cluster.tmp_path / 'task-leases.sqlite3'}"
    cluster.env["CL_TASK_DB"] = task_db
    task_store = LeaseStore.from_url(task_db)
    task_store.create_schema()
    try:
        timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_ACKS_LATE": "1"}
        w1 = cluster.start("w1", **timing)
        run_id = cluster.send("workerapp.own_db", 3.0)
        wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
        w1.kill9()
        w2 = cluster.start("w2", **timing)
        cluster.start_beat({"lease_sweep_interval": 1.0})

        def status() -> str | None:
            row = task_store.get(run_id)
            return None if row is None else row.status

        wait_for(lambda: status() == "succeeded", 60, what="recovery on the task's database")
        row = task_store.get(run_id)
        assert row is not None and row.attempt == 2 and row.lease_owner.startswith("w2@")
        assert cluster.store.get(run_id) is None  # never in the app's database
        assert len(cluster.effects(run_id, "commit")) == 1
        # A sweep records itself last, and a record that fails (SQLite busy under load) is
        # logged, never raised: the next beat sweep records it (beat sends one a second).

        def beat_swept(store: LeaseStore) -> bool:
            last = store.reads.last_sweep()
            return last is not None and last["name"] == "beat"

        for store in (cluster.store, task_store):
            wait_for(
                lambda store=store: beat_swept(store),
                30,
                what=f"beat's sweep recorded on {store.engine.url} (w2 log: {w2.log_path})",
            )
    finally:
        task_store.dispose()


@SQLITE_FS
@pytest.mark.timeout(120)
def test_sweeper_ends_a_run_it_cannot_deliver(cluster: Cluster) -> None:
    """A stranded run whose task no worker has registered: the sweeper publishes it at
    most max_attempts times, five at least (the workers drop each message as
    unregistered), then ends it failed with failure_code undeliverable instead of
    publishing it forever. Each re-send waits twice as long as the one before: the test
    moves the run's ``available_at`` back an hour after each, as time passing would."""
    run_id = "gone-1"
    message = json.dumps(
        {"task": "workerapp.gone", "args": [], "kwargs": {}, "options": {"task_id": run_id}}
    ).encode()
    assert cluster.store.keep_delivery(
        run_id,
        task_name="workerapp.gone",
        task_id=run_id,
        payload=message,
        payload_content_type="application/json",
        lease_ms=1000,
        max_attempts=2,
    )
    often = {"lease_sweep_interval": 0.5}  # stranded after 0.5 s + the 1 s lease
    w1 = cluster.start("w1", conf=often, CL_LEASE_SECONDS="1", CL_HEARTBEAT="0.3")
    cluster.start_beat(often)

    def given_up() -> bool:
        with cluster.engine.begin() as conn:  # an hour passes for the waiting run
            conn.execute(
                text(
                    "UPDATE celery_lease_runs SET available_at = available_at - 3600000"
                    " WHERE id = :id AND status = 'queued'"
                ),
                {"id": run_id},
            )
        return cluster.status(run_id) == "failed"

    wait_for(given_up, 60, interval=0.5, what="the run to be given up")
    row = cluster.store.get(run_id)
    assert row is not None and row.failure_code == "undeliverable"
    assert row.requeues == 5 and row.payload is not None  # kept for `lease rerun`
    assert row.last_error is not None and "never claimed" in row.last_error
    time.sleep(2.0)  # no further publish: the workers saw it exactly five times
    assert w1.log().count("Received unregistered task of type 'workerapp.gone'") == 5


@SQLITE_FS
@pytest.mark.timeout(90)
def test_worker_without_a_sweeper_on_a_broker_that_never_redelivers_warns_once(
    cluster: Cluster,
) -> None:
    """filesystem:// never redelivers: a worker whose own sweeper is off
    (lease_worker_sweeper = False) that sees no sweep within 2 x lease_sweep_interval
    logs ONE warning saying how to sweep; with beat running, a worker sees its sweeps
    and says nothing."""
    warning = "no sweep seen"
    often = {"lease_sweep_interval": 0.5, "lease_worker_sweeper": False}
    w1 = cluster.start("w1", conf=often)
    wait_for(lambda: warning in w1.log(), 20, what="the warning")
    time.sleep(2.0)  # four more ticks of the watch
    log = w1.log()
    assert log.count(warning) == 1
    assert "`celery -A tests.workerapp beat`" in log and "lease_worker_sweeper" in log
    cluster.start_beat(often)
    wait_for(lambda: cluster.store.reads.last_sweep() is not None, 30, what="beat's first sweep")
    # w2 watches with a 2 s interval (a 4 s window) while beat sweeps every 0.5 s: a
    # loaded machine that delays one sweep by a second cannot make w2 warn.
    w2 = cluster.start("w2", conf={"lease_sweep_interval": 2.0, "lease_worker_sweeper": False})
    time.sleep(5.0)  # past w2's 4 s window: two ticks of its watch, each seeing sweeps
    assert warning not in w2.log()


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_warm_shutdown_lets_the_running_body_finish_under_its_lease(cluster: Cluster) -> None:
    """SIGTERM (warm shutdown) while a body runs: the body finishes on the stopping worker
    under its lease, attempt 1, and no other worker runs it again; the pool process saw
    the shutdown (so it would claim nothing new)."""
    timing = {"CL_LEASE_SECONDS": "20", "CL_HEARTBEAT": "1"}
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.drain", 30.0)  # ends 1 s after it sees the shutdown
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    cluster.start("w2", **timing)
    w1.proc.terminate()  # SIGTERM to the main process only: a warm shutdown
    wait_for(lambda: cluster.effects(run_id, "saw_shutdown"), 30, what="the child to see it")
    w1.proc.wait(30)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 10, what="the run to succeed")
    time.sleep(1.0)  # a wrongly handed-back run would be claimed by w2 by now
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1]
    assert [e.attempt for e in cluster.effects(run_id, "body_end")] == [1]
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1 and row.lease_owner.startswith("w1@")


@SQLITE_FS
@pytest.mark.timeout(120)
def test_warm_shutdown_claims_no_new_run(cluster: Cluster) -> None:
    """A delivery the pool starts during a warm shutdown (kombu's filesystem transport
    hands the pool a prefetched message) is not claimed by the stopping worker; another
    worker runs it."""
    timing = {"CL_LEASE_SECONDS": "20", "CL_HEARTBEAT": "1"}
    w1 = cluster.start("w1", concurrency=1, **timing)
    first = cluster.send("workerapp.drain", 3.0)
    wait_for(lambda: cluster.effects(first, "start"), 30, what="w1 to start the first run")
    second = cluster.send("workerapp.work", 0.0)
    time.sleep(1.0)  # w1 prefetches the second message
    w1.proc.terminate()
    w1.proc.wait(30)
    cluster.start("w2", **timing)
    wait_for(lambda: cluster.status(second) == "succeeded", 30, what="the second run")
    row = cluster.store.get(second)
    assert row is not None and row.lease_owner.startswith("w2@")
    assert f"run {second}: claimed" not in w1.log()


@TWO_SETUPS_AND_MARIADB
@pytest.mark.timeout(120)
def test_cold_shutdown_hands_lease_back_well_before_expiry(cluster: Cluster) -> None:
    """SIGQUIT (cold shutdown) stops the body; its lease is handed back at once, so another
    worker takes over far sooner than lease_seconds, even when the node name is longer
    than the 120 characters of it that the owner keeps."""
    timing = {"CL_LEASE_SECONDS": "40", "CL_HEARTBEAT": "1"}
    long_node = "w1-" + "x" * 130 + "@%h"
    w1 = cluster.start("w1", node=long_node, **timing)
    run_id = cluster.send("workerapp.spin", 6.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    cluster.start("w2", **timing)
    stopped_at = time.time()
    w1.proc.send_signal(signal.SIGQUIT)  # the main process only: a cold shutdown
    takeover = wait_for(
        lambda: [e for e in cluster.effects(run_id, "start") if e.attempt == 2],
        30,
        what="w2 to take the run over",
    )
    assert takeover[0].at - stopped_at < 20.0  # versus a 40 s lease (slack for a busy CI)
    w1.proc.wait(30)
    # w1 stopped consuming before handing the run back (Celery 5.4 did not do it for us):
    # the run never came back to it.
    assert "delivery handed on" not in w1.log()
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="w2 to finish")
    assert [e.attempt for e in cluster.effects(run_id, "body_end")] == [2]


@SQLITE_FS
@pytest.mark.timeout(120)
def test_messages_a_killed_worker_held_unstarted_run_on_another(cluster: Cluster) -> None:
    """On the embedded default (``filesystem://``, which never redelivers) a ``kill -9`` of a
    worker lost the messages it had taken and not started yet: no lease row, nothing for
    the sweeper. They go back to their queue when their worker dies, and another worker
    runs each once."""
    timing = {"CL_LEASE_SECONDS": "3", "CL_HEARTBEAT": "1"}
    w1 = cluster.start("w1", concurrency=1, **timing)
    busy = cluster.send("spin", 60.0)
    wait_for(lambda: cluster.effects(busy, "start"), 30, what="w1's only process to be busy")
    sent = [cluster.send("work", 0.0) for _ in range(3)]
    held = wait_for(
        lambda: [task_id for task_id in sent if f"[{task_id}] received" in w1.log()],
        30,
        what="w1 to take a message it cannot start",
    )
    w1.kill9()
    w2 = cluster.start("w2", **timing)
    wait_for(
        lambda: all(cluster.status(task_id) == "succeeded" for task_id in sent),
        60,
        what="the runs elsewhere",
    )
    assert all(len(cluster.effects(task_id, "start")) == 1 for task_id in sent)
    assert all(f"[{task_id}] received" in w2.log() for task_id in held)


@SQLITE_FS
@pytest.mark.timeout(120)
def test_a_retry_waiting_behind_a_busy_worker_is_not_ended_undeliverable(cluster: Cluster) -> None:
    """A retry falls due while the worker's only process stays busy longer than the sweeper's
    re-sends used to take (one per ``lease_sweep_interval + lease_seconds``, as many as the
    run's attempts, here two): it ended ``failed (undeliverable)`` and never ran again.
    Each re-send now waits twice as long as the one before, and a run is re-sent five times
    at least; once the process is free the retry runs and the run succeeds."""
    w1 = cluster.start(
        "w1",
        conf={**FAST_RETRY, "lease_sweep_interval": 0.5, "lease_max_attempts": 2},
        concurrency=1,
        CL_LEASE_SECONDS="2",
        CL_HEARTBEAT="0.5",
    )
    run_id = cluster.send("retry_later", 3.0)
    wait_for(lambda: "retry requested" in w1.log(), 30, what="the retry")
    busy = cluster.send("spin", 25.0)  # holds the only process past the old five re-sends
    wait_for(lambda: cluster.effects(busy, "start"), 30, what="the process to be busy")
    wait_for(lambda: cluster.status(busy) == "succeeded", 60, what="the busy task")
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the retry to run")
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2]
    row = cluster.store.get(run_id)
    assert row is not None and row.republishes <= 4, row.republishes


@SQLITE_FS
@pytest.mark.timeout(120)
def test_a_cold_shutdown_while_the_result_backend_is_busy_hands_the_run_on(
    cluster: Cluster,
) -> None:
    """A cold shutdown cancels the body and records a retry in the result backend before it
    counts as shutting down. Behind a busy backend (here: SQLite, its file locked by another
    writer), the pool's own thread reports the killed body as terminated in the meantime;
    that is no revoke(), and the run is handed on, not cancelled."""
    timing = {"CL_LEASE_SECONDS": "40", "CL_HEARTBEAT": "1"}
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.spin", 6.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w2 = cluster.start("w2", **timing)
    results = sqlite3.connect(cluster.tmp_path / "results.sqlite3", isolation_level=None)
    try:
        results.execute("BEGIN IMMEDIATE")  # another writer holds the results file
        w1.proc.send_signal(signal.SIGQUIT)
        # The pool reports the body it killed well within this (it checks every 0.1 s).
        # Celery 5.5+ prints the first before it cancels the bodies; 5.4 only the second.
        wait_for(
            lambda: "Ctrl+C again" in w1.log() or "Cold shutdown" in w1.log(),
            30,
            what="w1 to start its cold shutdown",
        )
        time.sleep(1.5)
    finally:
        results.execute("ROLLBACK")
        results.close()
    w1.proc.wait(30)
    assert "revoked" not in w1.log()
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="w2 to finish the run")
    assert [e.attempt for e in cluster.effects(run_id, "body_end")] == [2]
    assert f"run {run_id}: claimed attempt 2" in w2.log()


@SQLITE_FS
@pytest.mark.timeout(120)
def test_workers_sharing_a_node_name_never_release_each_others_leases(
    cluster: Cluster,
) -> None:
    """Two workers started with the same -n: the cold shutdown of one hands back nothing
    the other holds; the other's body finishes as attempt 1."""
    timing = {"CL_LEASE_SECONDS": "20", "CL_HEARTBEAT": "1"}
    cluster.start("w1", node="same@%h", **timing)
    run_id = cluster.send("workerapp.drain", 4.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w2 = cluster.start("w2", node="same@%h", **timing)
    w2.proc.send_signal(signal.SIGQUIT)
    w2.proc.wait(30)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="w1 to finish")
    assert [e.attempt for e in cluster.effects(run_id, "start")] == [1]
    assert [e.attempt for e in cluster.effects(run_id, "body_end")] == [1]
    assert "handoff" not in w2.log()


@pytest.mark.timeout(90)
def test_cancel_running_run(cluster: Cluster) -> None:
    """cancel() on a running run: the body's check() raises RunCancelled within a
    heartbeat, the row ends cancelled, and the Celery state is REVOKED."""
    cluster.start("w1", CL_LEASE_SECONDS="3", CL_HEARTBEAT="0.5")
    run_id = cluster.send("workerapp.watch", 30.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    assert cluster.store.cancel(run_id) == "running"
    wait_for(lambda: cluster.effects(run_id, "saw_cancel"), 10, what="check() to see it")
    wait_for(lambda: cluster.status(run_id) == "cancelled", 10, what="cancelled status")
    if cluster.producer.conf.result_backend:
        result = cluster.producer.AsyncResult(run_id)
        wait_for(lambda: result.state == "REVOKED", 10, what="REVOKED state")


@pytest.mark.timeout(90)
def test_cancel_retrying_run_drops_later_delivery(cluster: Cluster) -> None:
    """A retrying run is cancelled at once; its next delivery is dropped unrun."""
    w1 = cluster.start("w1")
    run_id = "cancel-me"
    cluster.store.claim(
        run_id, "ghost", task_name="workerapp.work", lease_ms=60_000, max_attempts=5
    )
    cluster.store.release(run_id, "ghost", 1, available_in=60)
    assert cluster.store.cancel(run_id) == "cancelled"
    cluster.send("workerapp.work", 0.0, task_id=run_id)
    wait_for(lambda: "is already cancelled" in w1.log(), 30, what="the delivery to be dropped")
    assert cluster.effects(run_id) == []


@SQLITE_FS
@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
@pytest.mark.timeout(90)
def test_interrupt_stops_a_body_that_never_checks(cluster: Cluster, pool: str) -> None:
    """With lease_interrupt on, a lost lease interrupts a body that never calls check(),
    on prefork, solo and threads pools; the worker is then free for other work."""
    w1 = cluster.start("w1", pool=pool, CL_LEASE_SECONDS="3", CL_HEARTBEAT="0.5")
    run_id = cluster.send("workerapp.spin", 20.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    assert cluster.store.expire(run_id)
    thief = cluster.store.claim(run_id, "thief", task_name="t", lease_ms=60_000, max_attempts=5)
    assert thief.outcome == "claimed"
    wait_for(lambda: "automation_run_lease_lost" in w1.log(), 10, what="the interrupt")
    other = cluster.send("workerapp.work", 0.0)
    wait_for(lambda: cluster.status(other) == "succeeded", 20, what="the worker to be free")
    assert cluster.effects(run_id, "body_end") == []
    cluster.store.complete(run_id, "thief", 2)


@TWO_SETUPS_AND_MARIADB
@pytest.mark.timeout(240)
def test_per_key_concurrency_limit_holds_across_eight_processes(cluster: Cluster) -> None:
    """8 worker processes, 40 runs on one key, lease_max_concurrency = 2: bodies never
    overlap more than 2 deep, and all 40 finish."""
    conf = {**FAST_RETRY, "lease_max_concurrency": 2, "lease_retry_backoff_max": 0.5}
    for i in range(4):
        cluster.start(f"w{i}", conf=conf, concurrency=2, CL_LEASE_SECONDS="3")
    # kombu's filesystem transport can lose a message published while another
    # process consumes; waiting runs are recorded, so the sweeper recovers them.
    cluster.start_beat({"lease_sweep_interval": 1.0})
    run_ids = [cluster.send("workerapp.limited", 7, 0.2) for _ in range(40)]
    wait_for(
        lambda: all(cluster.status(r) == "succeeded" for r in run_ids),
        180,
        interval=0.5,
        what="all 40 runs",
    )
    events: list[tuple[float, int]] = []
    for run_id in run_ids:
        (start,) = cluster.effects(run_id, "start")
        (end,) = cluster.effects(run_id, "end")
        events += [(start.at, 1), (end.at, -1)]
    depth = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        depth += step
        peak = max(peak, depth)
    assert peak <= 2
    assert peak == 2  # the limit is used, not just respected


@TWO_SETUPS_AND_MARIADB
@pytest.mark.timeout(120)
def test_a_freed_concurrency_slot_is_taken_at_the_next_poll_not_at_the_lease_end(
    cluster: Cluster,
) -> None:
    """lease_max_concurrency = 1, a 20 s lease, three 0.5 s runs on one key: each waiting
    delivery polls every second at most and claims as soon as the slot is free, so the
    three end within a few seconds. Before, the waiting row was recorded as available only
    at the holder's lease end (about 20 s on), and the poll that found the slot free was
    turned back as "waiting for its retry backoff" until then."""
    conf = {"lease_max_concurrency": 1, "lease_retry_backoff": 0.5, "lease_retry_backoff_max": 1.0}
    cluster.start("w1", conf=conf, concurrency=3, CL_LEASE_SECONDS="20")
    run_ids = [cluster.send("workerapp.limited", 9, 0.5) for _ in range(3)]
    wait_for(
        lambda: all(cluster.status(r) == "succeeded" for r in run_ids),
        60,
        interval=0.2,
        what="the three runs",
    )
    starts = sorted(cluster.effects(r, "start")[0].at for r in run_ids)
    ends = sorted(cluster.effects(r, "end")[0].at for r in run_ids)
    assert all(end <= start for end, start in zip(ends, starts[1:], strict=False))  # one at a time
    assert ends[-1] - starts[0] < 10.0, (starts, ends)


@SQLITE_FS
@pytest.mark.timeout(60)
def test_unreachable_lease_database_fails_closed(cluster: Cluster) -> None:
    """With the lease database down, the body never runs; the delivery is retried."""
    dead = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=1"
    w1 = cluster.start("w1", CL_LEASE_DB=dead, conf=FAST_RETRY)
    run_id = cluster.send("workerapp.work", 0.0)
    wait_for(
        lambda: w1.log().count(f"run {run_id}: lease database unavailable") >= 2,
        30,
        what="the delivery to be retried",
    )
    assert "claimed attempt" not in w1.log()
    assert cluster.effects(run_id) == []
