"""A run's outcome reaches Celery's caller on every path (celery_lease/run/outcome.py),
with real workers: a crash between the lease commit and Celery's result store, runs
ended by the sweeper, ``lease cancel``, and duplicates whose result Celery lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord
from celery.result import AsyncResult

from celery_lease.errors import RunFailed
from tests.cluster import (
    AMQP_ID,
    AMQP_SETUP,
    PG_AND_MARIADB,
    SETUP_IDS,
    SETUPS,
    Cluster,
)
from tests.helpers import Worker, wait_for

REPO = Path(__file__).resolve().parent.parent
PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
AMQP = pytest.mark.parametrize("cluster", [AMQP_SETUP], ids=[AMQP_ID], indirect=True)
FAST = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}
SHORT = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}


def sig(cluster: Cluster, name: str, *args: Any, **kwargs: Any) -> Any:
    """A signature of a worker task, by name (the producer does not import the tasks)."""
    return cluster.producer.signature(f"workerapp.{name}", args=args, kwargs=kwargs)


def result(cluster: Cluster, task_id: str) -> AsyncResult:
    return cluster.producer.AsyncResult(task_id)


def keep_a_worker(cluster: Cluster, workers: list[Worker], **env: str) -> None:
    """Start a new worker when the last one died (a kill -9 after a commit)."""
    if not workers or workers[-1].proc.poll() is not None:
        workers.append(cluster.start(f"w{len(workers) + 1}", **env))


@PG_REDIS
@pytest.mark.timeout(180)
def test_crash_after_commit_resolves_chain_and_chord(cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 of the whole worker after the run's completion committed, before Celery
    stored SUCCESS (acks_late, Redis): the redelivery replays the kept result, so the
    chain goes on, the chord body runs once and every AsyncResult resolves (before: the
    redelivery was dropped with Ignore and the callers stayed PENDING)."""
    marks = tmp_path / "killed"
    marks.mkdir()
    env = {
        **SHORT,
        "CL_ACKS_LATE": "1",
        "CL_VISIBILITY_TIMEOUT": "2",
        "CL_KILL_AFTER_COMMIT": str(marks),
        "CL_KILL_WHOLE_WORKER": "1",
    }
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    workers: list[Worker] = []
    keep_a_worker(cluster, workers, **env)
    chained = chain(sig(cluster, "crash_step", 1), sig(cluster, "step")).apply_async()
    chorded = chord(
        [sig(cluster, "crash_step", 10), sig(cluster, "step", 20)], sig(cluster, "tsum", tag=tag)
    ).apply_async()
    first = chained.parent.id

    def resolved() -> bool:
        keep_a_worker(cluster, workers, **env)
        return chained.ready() and chorded.ready()

    wait_for(resolved, 120, interval=0.5, what="every caller to resolve")
    assert len(list(marks.iterdir())) == 2  # both crash steps were killed after the commit
    assert result(cluster, first).get(timeout=5) == 2
    assert chained.get(timeout=5) == 3
    assert chorded.get(timeout=5) == 11 + 21
    time.sleep(1.5)  # a second firing would land here
    assert len(cluster.effects(tag, "fired")) == 1
    assert len(cluster.effects(first, "start")) == 1  # the body ran once: the outcome replayed
    row = cluster.store.get(first)
    assert row is not None and row.status == "succeeded" and row.result == b"2"


@PG_AND_MARIADB
@pytest.mark.timeout(150)
def test_sweeper_ended_run_records_failure_and_runs_link_error_once(cluster: Cluster) -> None:
    """lease_max_attempts=1 and kill -9: the sweeper ends the run failed and the caller
    gets FAILURE with RunFailed(lease_expired); link_error runs once (before: PENDING
    forever, no errback)."""
    conf = {**FAST, "lease_max_attempts": 1}
    tag = f"err-{uuid.uuid4().hex[:8]}"
    w1 = cluster.start("w1", conf=conf, **SHORT)
    res = sig(cluster, "work", 30.0).apply_async(link_error=sig(cluster, "on_error", tag=tag))
    wait_for(lambda: cluster.effects(res.id, "start"), 30, what="the body to start")
    w1.kill9()
    cluster.start("w2", conf=conf, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **conf})
    with pytest.raises(RunFailed) as failed:
        res.get(timeout=60)
    assert failed.value.failure_code == "lease_expired"
    assert res.state == "FAILURE"
    wait_for(lambda: cluster.effects(tag, "errback"), 30, what="link_error to run")
    time.sleep(2.0)  # a second sweep must not record it again
    assert len(cluster.effects(tag, "errback")) == 1
    assert cluster.status(res.id) == "failed"


@PG_REDIS
@pytest.mark.timeout(120)
def test_lease_cancel_of_a_retrying_run_records_revoked(cluster: Cluster) -> None:
    """`celery lease cancel` of a run waiting for its retry: the caller sees REVOKED
    (before: PENDING, as Celery never heard of the cancel)."""
    cluster.start("w1", conf=FAST, **SHORT)
    task_id = cluster.send("retry_later", 60.0)
    wait_for(lambda: cluster.status(task_id) == "retrying", 30, what="the run to wait")
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "lease", "cancel", task_id],
        env={**os.environ, "PYTHONPATH": str(REPO), **cluster.env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cluster.status(task_id) == "cancelled"
    assert result(cluster, task_id).state == "REVOKED"


@PG_REDIS
@pytest.mark.timeout(120)
def test_keyed_duplicate_gets_the_rows_result_when_celery_lost_it(cluster: Cluster) -> None:
    """A keyed duplicate whose run's result is no longer in the result backend (Celery's
    result_expires shorter than lease_retention) gets the result kept in the row, never
    None (before: SUCCESS(None))."""
    cluster.start("w1", conf=FAST, **SHORT)
    first = sig(cluster, "keyed", 7).apply_async()
    assert first.get(timeout=30) == 70
    first.forget()  # what result_expires does
    dup = sig(cluster, "keyed", 7).apply_async()
    assert dup.get(timeout=30) == 70
    assert len(cluster.effects("workerapp.keyed:7", "start")) == 1


@AMQP
@pytest.mark.timeout(120)
def test_dropped_duplicate_logs_no_warning_without_a_result_backend(cluster: Cluster) -> None:
    """No result backend (RabbitMQ only, as most deployments): a keyed duplicate is
    dropped with an INFO line and reports the run's result; nothing at WARNING (before:
    a WARNING per duplicate, "reporting None")."""
    w1 = cluster.start("w1", conf=FAST, **SHORT)
    cluster.send("keyed", 8)
    wait_for(lambda: cluster.status("workerapp.keyed:8") == "succeeded", 30, what="the run")
    cluster.send("keyed", 8)
    wait_for(lambda: "already succeeded: delivery dropped" in w1.log(), 30, what="the drop")
    time.sleep(0.5)
    warnings = [line for line in w1.log().splitlines() if "WARNING" in line]
    assert not [line for line in warnings if "celery_lease" in line or "run " in line], warnings


@PG_REDIS
@pytest.mark.timeout(150)
def test_sweeper_ended_cancel_records_revoked(cluster: Cluster) -> None:
    """A cancel requested of a running run whose worker then dies: the sweeper ends it
    cancelled and the caller sees REVOKED (before: PENDING forever)."""
    w1 = cluster.start("w1", conf=FAST, **SHORT)
    res = sig(cluster, "sleepy", 30.0).apply_async()
    wait_for(lambda: cluster.effects(res.id, "start"), 30, what="the body to start")
    w1.kill9()
    assert cluster.store.cancel(res.id) == "running"  # requested; nobody acts on it
    cluster.start("w2", conf=FAST, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    wait_for(lambda: cluster.status(res.id) == "cancelled", 60, what="the sweep")
    wait_for(lambda: res.state == "REVOKED", 30, what="REVOKED in the result backend")
