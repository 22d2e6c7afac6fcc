"""LeasedTask in real ``celery worker -P prefork -c 2`` processes.

Each test runs on three set-ups: SQLite + filesystem broker (the embedded
default), SQLite + Redis, PostgreSQL + Redis. A representative subset (the plain
run, a duplicate delivery, a takeover after SIGSTOP) also runs on PostgreSQL
behind PgBouncer in transaction mode.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import PGBOUNCER_ID, PGBOUNCER_SETUP, SETUP_IDS, SETUPS, Cluster
from tests.helpers import REPO, wait_for

#: The three set-ups plus PostgreSQL behind PgBouncer (transaction pooling).
WITH_PGBOUNCER = pytest.mark.parametrize(
    "cluster", [*SETUPS, PGBOUNCER_SETUP], ids=[*SETUP_IDS, PGBOUNCER_ID], indirect=True
)


@WITH_PGBOUNCER
@pytest.mark.timeout(90)
def test_task_succeeds_with_attempt_one(cluster: Cluster) -> None:
    """A plain run ends succeeded, attempt 1, with one committed effect."""
    cluster.start("w1")
    run_id = cluster.send("workerapp.work", 0.1)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="run to succeed")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1 and row.lease_owner.startswith("w1@")
    assert len(cluster.effects(run_id, "commit")) == 1


@WITH_PGBOUNCER
@pytest.mark.timeout(120)
def test_duplicate_delivery_runs_body_once(cluster: Cluster) -> None:
    """The same task id delivered twice while the first runs: the body runs once."""
    w1 = cluster.start("w1", CL_LEASE_SECONDS="3")
    w2 = cluster.start("w2", CL_LEASE_SECONDS="3")
    run_id = cluster.send("workerapp.work", 2.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="first delivery to start")
    cluster.send("workerapp.work", 2.0, task_id=run_id)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="run to succeed")
    wait_for(
        lambda: "is already succeeded" in w1.log() + w2.log(),
        40,
        what="the duplicate delivery to be dropped",
    )
    assert len(cluster.effects(run_id, "start")) == 1
    assert len(cluster.effects(run_id, "commit")) == 1
    assert "lease_busy" in w1.log() + w2.log()
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 1


@WITH_PGBOUNCER
@pytest.mark.timeout(150)
def test_paused_worker_completion_refused_after_takeover(cluster: Cluster) -> None:
    """SIGSTOP a worker past its lease; another takes over; after SIGCONT its completion
    is refused with automation_run_lease_lost and the row keeps the second outcome."""
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
    w1 = cluster.start("w1", **timing)
    run_id = cluster.send("workerapp.sleepy", 4.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w1.pause()
    try:
        time.sleep(2.5)  # past the 2 s lease, by the database clock too
        cluster.start("w2", **timing)
        cluster.send("workerapp.sleepy", 4.0, task_id=run_id)
        wait_for(lambda: len(cluster.effects(run_id, "start")) == 2, 30, what="w2 takeover")
    finally:
        w1.resume()
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="w2 to succeed")
    wait_for(lambda: "complete refused" in w1.log(), 30, what="w1's completion to be refused")
    log1 = w1.log()
    assert "automation_run_lease_lost" in log1
    row = cluster.store.get(run_id)
    assert row is not None
    assert row.status == "succeeded" and row.attempt == 2
    assert row.lease_owner is not None and row.lease_owner.startswith("w2@")
    starts = cluster.effects(run_id, "start")
    assert [e.attempt for e in starts] == [1, 2]
    assert f"Task workerapp.sleepy[{run_id}] succeeded" not in log1


@pytest.mark.timeout(90)
def test_stolen_lease_seen_by_check_within_one_heartbeat(cluster: Cluster) -> None:
    """A lease stolen mid-run makes self.lease.check() raise LeaseLost within one tick."""
    cluster.start("w1", CL_LEASE_SECONDS="3", CL_HEARTBEAT="1")
    run_id = cluster.send("workerapp.watch", 30.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the run to start")
    assert cluster.store.expire(run_id)
    stolen_at = time.time()
    thief = cluster.store.claim(run_id, "thief", task_name="t", lease_ms=60_000, max_attempts=5)
    assert thief.outcome == "claimed" and thief.attempt == 2
    seen = wait_for(lambda: cluster.effects(run_id, "saw_lost"), 10, what="check() to raise")
    assert seen[0].at - stolen_at <= 1.0 + 0.75
    cluster.store.complete(run_id, "thief", 2)


def test_invalid_setting_refuses_to_start_worker(sqlite_url: str, tmp_path: Path) -> None:
    """A worker with lease_seconds = -1 exits non-zero, naming the key, before forking."""
    env = {
        "CL_LEASE_DB": sqlite_url,
        "CL_BROKER_URL": "memory://",
        "CL_BAD_SETTING": "lease_seconds=-1",
        "PYTHONPATH": str(REPO),
    }
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "worker", "-P", "prefork"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "lease_seconds" in output and "ImproperlyConfigured" in output
    assert "ForkPoolWorker" not in output
