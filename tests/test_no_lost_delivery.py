"""A delivery whose re-publish the broker refuses is never lost, even without ``acks_late``.

Real processes: a ``celery worker`` and ``celery beat`` on a private ``redis-server``
that the test stops and starts again by PID, and a PostgreSQL lease database.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.cluster import Cluster
from tests.conftest import PG_ENV
from tests.helpers import Worker, require, wait_for

#: Nothing survives a stop: a broker that comes back has lost every message.
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


class PrivateRedis:
    """A ``redis-server`` of this test on a free 127.0.0.1 port, without persistence."""

    def __init__(self, tmp_path: Path) -> None:
        self.binary = require(shutil.which("redis-server"), "redis-server")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = tmp_path / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server (empty: nothing survives a stop) and wait until it answers."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", *NO_PERSISTENCE],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def answers() -> bool:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn,
            ):
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
            return False

        wait_for(answers, 10, what="redis-server to answer")

    def stop(self) -> None:
        """Kill the server by its PID and reap it: the broker is gone, with its data."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def drop_lease_connections(db_url: str) -> None:
    """Terminate the server connections that last ran lease SQL on the scratch database.

    The next lease statement on such a pooled connection fails as a disconnect
    (transient): the lease database was unreachable for that statement. The
    connections of the test tasks' own effects table are left alone.
    """
    admin = create_engine(require(os.environ.get(PG_ENV), PG_ENV), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid() "
                    "AND query LIKE '%celery_lease_runs%'"
                ),
                {"name": make_url(db_url).database},
            )
    finally:
        admin.dispose()


@contextlib.contextmanager
def key_lock_held(db_url: str, key: str) -> Iterator[None]:
    """Hold the advisory lock a claim on concurrency ``key`` try-locks (PostgreSQL).

    Each claim on the key then reports busy without writing anything, as when
    another claim of the key is inside its short transaction.
    """
    engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
    lock = text("SELECT pg_advisory_lock(hashtextextended(:key, 0))")
    try:
        with engine.connect() as conn:
            conn.execute(lock, {"key": key})
            yield
    finally:
        engine.dispose()  # closing the session releases its lock


#: The sweep (run by the worker) re-sends a queued run left unclaimed for
#: lease_sweep_interval + lease_seconds = 3 s.
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0, "lease_sweep_interval": 1.0}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cause", ["claim_error", "key_locked"])
def test_republish_refused_without_acks_late_is_kept_for_the_sweeper(
    cause: str,
    pg_url: str,
    private_redis: PrivateRedis,
    tmp_path: Path,
    workers: list[Worker],
) -> None:
    """A delivery whose run has no row yet re-publishes itself while the broker is down;
    without acks_late its message was acknowledged on receipt. ``claim_error``: its
    claim failed (the lease database connection dropped). ``key_locked``: its
    concurrency key's lock was taken by another claim (busy, nothing written). The
    delivery is kept in the lease database as a queued run, and once the broker is back
    (empty) beat's sweeper sends it: the run succeeds, with one commit."""
    cluster = Cluster(pg_url, {"CL_BROKER_URL": private_redis.url}, tmp_path, workers)
    conf = CONF if cause == "claim_error" else {**CONF, "lease_max_concurrency": 1}
    try:
        gate = tmp_path / "gate"
        gate.mkdir()
        worker = cluster.start(
            "w1",
            conf=conf,
            concurrency=1,
            CL_LEASE_SECONDS="2",
            CL_HEARTBEAT="0.5",
            CL_PUBLISH_GATE=str(gate),
        )
        with contextlib.ExitStack() as stack:
            if cause == "claim_error":
                warm = cluster.send("work", 0.0)  # the pool process holds pooled connections
                wait_for(lambda: cluster.status(warm) == "succeeded", 30, what="a warm-up run")
                drop_lease_connections(pg_url)
                cluster.store.dispose()  # the test's own connections were dropped too
                (gate / "armed").touch()
                run_id = cluster.send("work", 0.0)
            else:
                stack.enter_context(key_lock_held(pg_url, "account-7"))
                (gate / "armed").touch()
                run_id = cluster.send("limited", 7, 0.0)
            # The claim failed or was busy; the re-publish is held at the gate.
            wait_for((gate / "reached").exists, 30, what="the delivery's re-publish")
            private_redis.stop()
            (gate / "go").touch()
            # Kept for the sweeper (the fix), or rejected and lost (without acks_late).
            wait_for(lambda: "re-publish" in worker.log(), 20, what="the refused re-publish")

        private_redis.start()  # empty: the broker lost every message it had
        cluster.start_beat(conf)
        wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the sweeper's re-send")
        row = cluster.store.get(run_id)
        assert row is not None and row.attempt == 1
        kind = "commit" if cause == "claim_error" else "end"
        assert len(cluster.effects(run_id, kind)) == 1
        assert "kept in the lease database" in worker.log()
    finally:
        cluster.close()


def _broker_stopped_at_publish(
    cluster: Cluster, private_redis: PrivateRedis, task: str, *args: Any
) -> tuple[Worker, str]:
    """A worker (2 s lease) runs ``task``; the first publish its run makes (a retry) is
    held at the gate until the broker is stopped, then let go: it is refused."""
    gate = cluster.tmp_path / "gate"
    gate.mkdir()
    worker = cluster.start(
        "w1",
        conf=CONF,
        concurrency=1,
        CL_LEASE_SECONDS="2",
        CL_HEARTBEAT="0.5",
        CL_PUBLISH_GATE=str(gate),
    )
    (gate / "armed").touch()
    run_id = cluster.send(task, *args)
    wait_for((gate / "reached").exists, 30, what="the run's publish")
    private_redis.stop()
    (gate / "go").touch()
    return worker, run_id


@pytest.mark.timeout(90)
def test_celery_retry_refused_by_the_broker_is_kept_for_the_sweeper(
    pg_url: str,
    private_redis: PrivateRedis,
    tmp_path: Path,
    workers: list[Worker],
) -> None:
    """The body calls ``self.retry(countdown=1)`` while the broker is down: Celery's own
    retry path turns the refused publish into ``Reject(requeue=False)``, which used to
    end the run ``failed``/``rejected``. The run is recorded ``retrying`` with the retry
    message instead, and once the broker is back (empty) the sweeper sends it: the
    retry runs and the run succeeds."""
    cluster = Cluster(pg_url, {"CL_BROKER_URL": private_redis.url}, tmp_path, workers)
    try:
        worker, run_id = _broker_stopped_at_publish(cluster, private_redis, "retry_later", 1.0)
        wait_for(lambda: "refused the retry" in worker.log(), 30, what="the refused retry")
        row = cluster.store.get(run_id)
        assert row is not None and row.status == "retrying", row
        assert row.payload is not None  # the retry message, for the sweeper

        private_redis.start()  # empty: the broker lost every message it had
        cluster.start_beat(CONF)
        wait_for(lambda: cluster.status(run_id) == "succeeded", 40, what="the sweeper's re-send")
        assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2]
    finally:
        cluster.close()


@pytest.mark.timeout(90)
def test_the_original_of_a_refused_retry_delivered_again_is_dropped_as_an_older_copy(
    pg_url: str,
    private_redis: PrivateRedis,
    tmp_path: Path,
    workers: list[Worker],
) -> None:
    """Under ``acks_late``, a broker outage at a retry's publish fails the original
    message's ack too, and the broker delivers that message again once it is back
    (RabbitMQ does; here the test sends the copy). That copy (``retries`` 0) took the run's
    next attempt: the body ran once more, with ``request.retries`` one lower than the
    retry's. It is dropped as an older copy now; the retry the sweeper sends runs."""
    cluster = Cluster(pg_url, {"CL_BROKER_URL": private_redis.url}, tmp_path, workers)
    try:
        worker, run_id = _broker_stopped_at_publish(cluster, private_redis, "retry_later", 1.0)
        wait_for(lambda: "refused the retry" in worker.log(), 30, what="the refused retry")
        private_redis.start()  # empty, but for the original message delivered again:
        cluster.send("retry_later", 1.0, task_id=run_id)
        wait_for(lambda: "an older copy" in worker.log(), 30, what="the copy dropped")
        cluster.start_beat(CONF)
        wait_for(lambda: cluster.status(run_id) == "succeeded", 40, what="the sweeper's re-send")
        assert [e.attempt for e in cluster.effects(run_id, "start")] == [1, 2]
    finally:
        cluster.close()


@pytest.mark.timeout(90)
def test_a_failure_whose_retry_the_broker_refuses_is_no_lost_lease(
    pg_url: str,
    private_redis: PrivateRedis,
    tmp_path: Path,
    workers: list[Worker],
) -> None:
    """The body raises; the run is recorded ``retrying`` and its retry's publish is refused
    for a few seconds. The worker still holds the lease object meanwhile, but the run is no
    longer its own to renew: the heartbeat's refusals are the recorded failure's doing, not
    a lost lease (no ``held -> lost`` line, nothing for ``lease_lost_total``)."""
    cluster = Cluster(pg_url, {"CL_BROKER_URL": private_redis.url}, tmp_path, workers)
    try:
        worker, run_id = _broker_stopped_at_publish(cluster, private_redis, "boom")
        wait_for(lambda: "kept in the lease database" in worker.log(), 30, what="the kept retry")
        row = cluster.store.get(run_id)
        assert row is not None and row.status == "retrying", row
        assert "-> lost" not in worker.log()
    finally:
        cluster.close()
