"""Claim errors in real ``celery worker`` processes end terminal, never loop (PostgreSQL + Redis).

A permanent error (here a CHECK constraint the claim's insert violates) ends the
run ``failed`` at once with ``lease_db_error:<cause>``; a transient one (the
database stops accepting connections) is retried a bounded number of times and
then the delivery ends ``FAILURE`` with ``lease_db_unavailable``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_lease.run.republish import CLAIM_DB_RETRIES
from celery_lease.store import LeaseStore
from tests.cluster import Cluster
from tests.conftest import PG_ENV
from tests.helpers import Worker, require, wait_for

FAST_BACKOFF = {"lease_retry_backoff": 0.01, "lease_retry_backoff_max": 0.05}


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a server until :meth:`stop` refuses every connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # stopped
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Close the port (new connections are refused) and cut every open one."""
        # shutdown() wakes the thread blocked in accept(); close() alone would
        # leave the port listening until that call returns.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@contextlib.contextmanager
def _row_locked(cluster: Cluster, run_id: str) -> Iterator[None]:
    """Another session holds ``run_id``'s row lock (``FOR UPDATE``) inside the block."""
    locker = create_engine(cluster.db_url)
    try:
        with locker.connect() as conn, conn.begin():
            conn.execute(
                text("SELECT id FROM celery_lease_runs WHERE id = :id FOR UPDATE"), {"id": run_id}
            )
            yield
    finally:
        locker.dispose()


@pytest.fixture
def pg_redis(
    pg_url: str, redis_url: str, tmp_path: Path, workers: list[Worker]
) -> Iterator[Cluster]:
    """A PostgreSQL lease database behind Redis (broker and result backend)."""
    broker_env = {"CL_BROKER_URL": redis_url, "CL_RESULT_BACKEND": redis_url}
    cluster = Cluster(pg_url, broker_env, tmp_path, workers)
    yield cluster
    cluster.close()


@pytest.mark.timeout(90)
def test_permanent_claim_error_ends_the_run_at_once(pg_redis: Cluster) -> None:
    """The claim's insert violates a CHECK constraint (permanent): the run ends failed with
    lease_db_error:integrity, the delivery FAILURE, after one claim; it used to be
    re-published forever as 'lease database unreachable'."""
    with pg_redis.engine.begin() as conn:
        conn.execute(
            text(
                "ALTER TABLE celery_lease_runs ADD CONSTRAINT small_payload "
                "CHECK (payload IS NULL OR octet_length(payload) < 2000)"
            )
        )
    worker = pg_redis.start("w1", conf=FAST_BACKOFF)
    run_id = pg_redis.send("workerapp.sleepy", "x" * 5000)
    wait_for(lambda: pg_redis.status(run_id) == "failed", 30, what="the run to end failed")
    row = pg_redis.store.get(run_id)
    assert row is not None and row.failure_code == "lease_db_error:integrity"
    assert row.payload is None and row.attempt == 0
    result = pg_redis.producer.AsyncResult(run_id)
    wait_for(lambda: result.state == "FAILURE", 20, what="the delivery to end FAILURE")
    assert str(result.result).startswith("lease_db_error:integrity")
    assert pg_redis.effects(run_id) == []  # the body never ran
    assert "retrying in" not in worker.log()


@pytest.mark.timeout(120)
def test_unreachable_database_ends_failure_after_bounded_retries(pg_redis: Cluster) -> None:
    """The lease database refuses connections after the worker started: the claim is
    re-published CLAIM_DB_RETRIES times with backoff, then the delivery ends FAILURE
    with lease_db_unavailable (it used to be re-published forever)."""
    url = make_url(pg_redis.db_url)
    proxy = TcpProxy((str(url.host), int(url.port or 5432)))
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    worker = pg_redis.start("w1", conf=FAST_BACKOFF, CL_LEASE_DB=proxied)
    proxy.stop()
    run_id = pg_redis.send("workerapp.work", 0.1)
    result = pg_redis.producer.AsyncResult(run_id)
    wait_for(lambda: result.state == "FAILURE", 60, what="the delivery to end FAILURE")
    assert str(result.result).startswith("lease_db_unavailable")
    log = worker.log()
    assert f"try {CLAIM_DB_RETRIES} of {CLAIM_DB_RETRIES}" in log
    assert f"try {CLAIM_DB_RETRIES + 1} of" not in log
    assert "claim failed for good (lease_db_unavailable)" in log
    direct = LeaseStore(create_engine(pg_redis.db_url))
    try:
        assert direct.get(run_id) is None  # no row could be written: Celery holds the outcome
    finally:
        direct.dispose()


def set_read_only(db_url: str, on: bool) -> None:
    """Make the database read-only (a standby during a failover) or writable again.

    ``default_transaction_read_only`` applies to new sessions: every other session
    on the database is terminated (SQLSTATE 57P01), so the next one picks it up.
    """
    admin = create_engine(require(os.environ.get(PG_ENV), PG_ENV), isolation_level="AUTOCOMMIT")
    name = make_url(db_url).database
    try:
        with admin.connect() as conn:
            setting = f"default_transaction_read_only = {'on' if on else 'off'}"
            conn.execute(text(f'ALTER DATABASE "{name}" SET {setting}'))
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
    finally:
        admin.dispose()


@pytest.mark.timeout(120)
def test_read_only_database_during_a_failover_loses_no_task(pg_redis: Cluster) -> None:
    """The lease database turns read-only (SQLSTATE 25006, as a primary being switched
    over) and the worker's sessions are terminated (57P01): the claim cannot be written,
    and the delivery is re-published with backoff, never failed nor acked away. Once
    the database is writable again the run succeeds, once (25006 used to be permanent:
    the delivery failed at once and no row was ever written)."""
    worker = pg_redis.start("w1", conf={"lease_retry_backoff": 1.0, "lease_retry_backoff_max": 2.0})
    set_read_only(pg_redis.db_url, True)
    pg_redis.store.dispose()
    run_id = pg_redis.send("workerapp.work", 0.0)
    wait_for(
        lambda: "lease database unavailable (try 2 of" in worker.log(),
        30,
        what="the claim refused twice",
    )
    assert "read_only" in worker.log()
    result = pg_redis.producer.AsyncResult(run_id)
    assert result.state == "PENDING"  # not failed, not dropped
    set_read_only(pg_redis.db_url, False)
    pg_redis.store.dispose()
    pg_redis.engine.dispose()  # the test's own sessions were terminated too
    wait_for(lambda: pg_redis.status(run_id) == "succeeded", 60, what="the run after the failover")
    assert len(pg_redis.effects(run_id, "commit")) == 1
    wait_for(lambda: result.state == "SUCCESS", 20, what="the caller's result")
    assert "claim failed for good" not in worker.log()


@pytest.mark.timeout(90)
def test_ending_quietly_retries_a_database_error(pg_redis: Cluster, tmp_path: Path) -> None:
    """The body ends with Ignore while another session holds the run's row lock past the
    lock bound (lock_not_available, transient): the end is retried as the completion is,
    and the run ends cancelled/ignored once the lock is released. It used to be tried
    once: the run stayed running until its lease expired, and then ran again."""
    worker = pg_redis.start("w1", conf=FAST_BACKOFF, CL_LEASE_SECONDS="6")
    go = tmp_path / "go"
    run_id = pg_redis.send("workerapp.gated_ignore", str(go))
    wait_for(lambda: pg_redis.effects(run_id, "start"), 30, what="the body to start")
    with _row_locked(pg_redis, run_id):
        go.touch()  # the body raises Ignore: the end waits for the row lock

        def end_waits() -> bool:
            with pg_redis.engine.connect() as probe:
                return bool(
                    probe.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                            "current_database() AND wait_event_type = 'Lock' "
                            "AND query LIKE 'UPDATE celery_lease_runs%'"
                        )
                    ).scalar()
                )

        wait_for(end_waits, 20, what="the end to wait for the row lock")
        time.sleep(1.5)  # past the lock bound (1 s for 6 s leases): the first try failed
    wait_for(lambda: pg_redis.status(run_id) == "cancelled", 4, what="the run to end ignored")
    row = pg_redis.store.get(run_id)
    assert row is not None and row.failure_code == "ignored" and row.attempt == 1
    assert "could not end run" not in worker.log()
    assert len(pg_redis.effects(run_id, "start")) == 1


@pytest.mark.timeout(90)
def test_a_failure_that_cannot_be_recorded_says_what_happens_next(
    pg_redis: Cluster, tmp_path: Path
) -> None:
    """The body raises while another session holds the run's row past the lock bound: the
    failure cannot be recorded. The log says what the body raised, why it was not recorded,
    and that the run runs again once its lease expires (it said only "could not record
    failure: <the database error>", then Celery's "ignored"); and it does."""
    # A short sweep interval: the sweeper recovers the run too, should the re-sent copy lag.
    conf = {**FAST_BACKOFF, "lease_sweep_interval": 1.0}
    worker = pg_redis.start("w1", conf=conf, CL_LEASE_SECONDS="6")
    go = tmp_path / "go"
    run_id = pg_redis.send("workerapp.gated_boom", str(go))
    wait_for(lambda: pg_redis.effects(run_id, "start"), 30, what="the body to start")
    with _row_locked(pg_redis, run_id):
        go.touch()  # the body raises: recording the failure waits for the row lock
        wait_for(lambda: "could not record the failure" in worker.log(), 20, what="the log line")
    line = next(ln for ln in worker.log().splitlines() if "could not record the failure" in ln)
    assert f"run {run_id} attempt 1 raised ValueError: boom after the gate" in line, line
    assert "lock_not_available" in line and "runs again once its lease expires" in line, line
    wait_for(lambda: len(pg_redis.effects(run_id, "start")) >= 2, 60, what="attempt 2")


@pytest.mark.timeout(120)
def test_a_database_outage_logs_the_sweeper_leadership_once_not_each_second(
    pg_redis: Cluster,
) -> None:
    """The lease database refuses writes for 6 s (read-only, sessions terminated) under a
    worker that leads its sweeper: the leader lease is tried every second, the first
    failure is one WARNING, the repeats are DEBUG, and the end of the outage is one INFO
    line with the count (before: one WARNING a second for as long as the outage lasts)."""
    worker = pg_redis.start("w1")
    wait_for(lambda: "leads sweeper" in worker.log(), 30, what="the worker to lead its sweeper")
    set_read_only(pg_redis.db_url, True)
    try:
        wait_for(lambda: "leader lease on" in worker.log(), 30, what="the leader lease to fail")
        time.sleep(6)  # the outage: about six more tries, one a second
    finally:
        set_read_only(pg_redis.db_url, False)
        pg_redis.store.dispose()
        pg_redis.engine.dispose()
    found = wait_for(
        lambda: re.search(
            r"leader lease on \S+ works again after (\d+) failed tries", worker.log()
        ),
        30,
        what="the end of the outage",
    )
    assert int(found.group(1)) >= 4
    warnings = [
        line
        for line in worker.log().splitlines()
        if "leader lease on" in line and "WARNING" in line
    ]
    assert len(warnings) == 1, warnings
    assert "repeats are logged at DEBUG" in warnings[0]


@pytest.mark.timeout(90)
def test_a_transaction_idle_around_the_callers_work_is_not_cut(pg_redis: Cluster) -> None:
    """``lease_seconds = 3``: the client bound is 1 s. A body holds its lease transaction
    open for 2 s of its own work between two statements (a provider call), then fences
    and commits. Nothing waited for the server past the bound, so the watchdog cuts
    nothing: attempt 1 commits (before: the idle connection was cut, the commit failed
    with OperationalError and the body ran again)."""
    worker = pg_redis.start("w1", concurrency=1, CL_LEASE_SECONDS="3", CL_HEARTBEAT="1")
    run_id = pg_redis.send("slow_commit", 2.0)
    wait_for(lambda: pg_redis.status(run_id) in {"succeeded", "failed"}, 60, what="the run")
    assert pg_redis.status(run_id) == "succeeded", worker.log()
    assert [e.attempt for e in pg_redis.effects(run_id, "commit")] == [1]
    assert "connection cut" not in worker.log()
