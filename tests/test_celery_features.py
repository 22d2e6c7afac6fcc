"""One test per row of docs/celery-features.md that tests/test_canvas.py does not cover.

Real ``celery worker`` processes; the embedded default (SQLite leases,
filesystem broker, database result backend) unless a row needs Redis.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for

SQLITE_FS = pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)

FAST = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}
SHORT = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}


def sig(cluster: Cluster, name: str, *args: Any, **kwargs: Any) -> Any:
    return cluster.producer.signature(f"workerapp.{name}", args=args, kwargs=kwargs)


@SQLITE_FS
@pytest.mark.timeout(90)
def test_link_error_runs_once_after_the_last_attempt(cluster: Cluster) -> None:
    """link_error: called once, when the lease attempts are spent, not per attempt."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 2})
    tag = f"err-{uuid.uuid4().hex[:8]}"
    res = sig(cluster, "boom").apply_async(link_error=sig(cluster, "on_error", tag=tag))
    with pytest.raises(RuntimeError, match="boom"):
        res.get(timeout=40)
    wait_for(lambda: cluster.effects(tag, "errback"), 20, what="the errback")
    time.sleep(1.0)
    assert len(cluster.effects(tag, "errback")) == 1
    assert [e.attempt for e in cluster.effects(res.id, "start")] == [1, 2]


@SQLITE_FS
@pytest.mark.timeout(90)
def test_countdown_claims_only_when_the_message_is_due(cluster: Cluster) -> None:
    """countdown/eta: the run is claimed when Celery executes it, not when it arrives."""
    cluster.start("w1", conf=FAST)
    sent = time.time()
    res = sig(cluster, "work", 0.0).apply_async(countdown=3)
    time.sleep(1.0)
    assert cluster.status(res.id) is None  # held by the worker, no lease yet
    assert res.get(timeout=30) == "done"
    assert cluster.effects(res.id, "start")[0].at - sent >= 2.5


@SQLITE_FS
@pytest.mark.timeout(90)
def test_expired_message_never_claims(cluster: Cluster) -> None:
    """expires: a message that expired before it ran is REVOKED by Celery; no run row."""
    cluster.start("w1", conf=FAST)
    res = sig(cluster, "work", 0.0).apply_async(
        expires=datetime.now(timezone.utc) - timedelta(minutes=1)
    )
    wait_for(lambda: res.state == "REVOKED", 30, what="REVOKED")
    assert cluster.status(res.id) is None and cluster.effects(res.id) == []


@SQLITE_FS
@pytest.mark.timeout(120)
def test_soft_time_limit_is_a_failed_attempt(cluster: Cluster) -> None:
    """soft_time_limit: SoftTimeLimitExceeded in the body is a failed attempt, retried
    with backoff until the lease attempts are spent."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 2})
    res = sig(cluster, "spin", 30.0).apply_async(soft_time_limit=1)
    with pytest.raises(Exception, match=r"SoftTimeLimitExceeded|soft time limit"):
        res.get(timeout=60)
    row = cluster.store.get(res.id)
    assert row is not None and (row.status, row.attempt) == ("failed", 2)
    assert row.failure_code == "exception:SoftTimeLimitExceeded"


@SQLITE_FS
@pytest.mark.timeout(150)
def test_hard_time_limit_attempts_are_recovered_then_fail(cluster: Cluster) -> None:
    """time_limit: the killed attempt is recovered like a killed worker, bounded by the
    lease attempts; the run ends failed (lease_expired), never re-sent after that."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 2}, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    res = sig(cluster, "spin", 30.0).apply_async(time_limit=1)
    wait_for(lambda: cluster.status(res.id) == "failed", 60, what="the run to fail")
    row = cluster.store.get(res.id)
    assert row is not None and (row.attempt, row.failure_code) == (2, "lease_expired")
    assert res.state == "FAILURE"
    time.sleep(2.0)
    assert len(cluster.effects(res.id, "start")) == 2


@SQLITE_FS
@pytest.mark.timeout(90)
def test_rate_limit_applies_to_leased_runs(cluster: Cluster) -> None:
    """rate_limit: Celery spaces the bodies; every run is claimed once and succeeds."""
    cluster.start("w1", conf=FAST)
    ids = [cluster.send("rated") for _ in range(4)]
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 40, what="4 runs")
    starts = sorted(cluster.effects(i, "start")[0].at for i in ids)
    # 60/m: about one a second. kombu's token bucket before 5.7 lets the first two through
    # together after an idle period (plain Celery too), so four runs span at least 2 s.
    assert starts[-1] - starts[0] >= 1.5


@SQLITE_FS
@pytest.mark.timeout(120)
def test_a_retry_the_sweepers_copy_ran_fires_link_error_once(cluster: Cluster) -> None:
    """A retry falls due while its worker's only process is busy: the sweeper sends the run
    again as stranded, another worker runs that copy, and the run ends failed. The busy
    worker then reaches Celery's own retry message: a delivery of a run that ended, not a
    caller applying its task id again, so ``link_error`` runs once (it ran twice)."""
    timing = {"conf": {**FAST, "lease_sweep_interval": 0.5}, "concurrency": 1, **SHORT}
    w1 = cluster.start("w1", **timing)  # type: ignore[arg-type]
    tag = uuid.uuid4().hex
    failing = sig(cluster, "capped_after", 3.0).apply_async(
        link_error=sig(cluster, "on_error", tag=tag)
    )
    wait_for(lambda: "retry requested" in w1.log(), 30, what="the retry")
    busy = cluster.send("spin", 10.0)  # holds w1's only process past the retry's due time
    wait_for(lambda: cluster.effects(busy, "start"), 30, what="w1 to be busy")
    cluster.start("w2", **timing)  # type: ignore[arg-type]
    wait_for(lambda: cluster.status(failing.id) == "failed", 60, what="the copy to end the run")
    wait_for(lambda: f"run {failing.id} is already failed" in w1.log(), 60, what="w1's retry")
    time.sleep(1.0)  # a second errback would be sent by now
    assert len(cluster.effects(tag, "errback")) == 1
    assert len(cluster.effects(failing.id, "start")) == 2


@SQLITE_FS
@pytest.mark.timeout(90)
def test_revoke_terminate_cancels_the_run(cluster: Cluster) -> None:
    """revoke(terminate=True): the body is killed, the run ends cancelled, never re-run;
    revoke() before it starts: the run never claims."""
    cluster.start("w1", conf=FAST, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    running = cluster.send("spin", 30.0)
    wait_for(lambda: cluster.effects(running, "start"), 30, what="the body to start")
    cluster.producer.control.revoke(running, terminate=True, signal="SIGKILL")
    wait_for(lambda: cluster.status(running) == "cancelled", 30, what="cancelled")
    time.sleep(2.0)
    assert len(cluster.effects(running, "start")) == 1
    later = sig(cluster, "work", 0.0).apply_async(countdown=3)
    cluster.producer.control.revoke(later.id)
    wait_for(lambda: later.state == "REVOKED", 30, what="REVOKED")
    assert cluster.status(later.id) is None


@pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
@pytest.mark.timeout(90)
def test_revoke_terminate_ends_the_run_at_once(cluster: Cluster) -> None:
    """revoke(terminate=True) with Celery's default signal and a long lease: the run ends
    ``cancelled`` as soon as the body is killed. It stayed ``running`` (cancel requested)
    until its lease expired and a sweep ended it: a minute or more with the defaults."""
    worker = cluster.start(
        "w1", conf={**FAST, "lease_sweep_interval": 300.0}, CL_LEASE_SECONDS="60"
    )
    running = cluster.send("spin", 60.0)
    other = cluster.send("spin", 2.0)
    wait_for(lambda: cluster.effects(running, "start"), 30, what="the body to start")
    cluster.producer.control.revoke(running, terminate=True)
    wait_for(lambda: cluster.status(running) == "cancelled", 10, what="cancelled")
    row = cluster.store.get(running)
    assert row is not None and row.failure_code == "cancelled" and row.finished_at
    wait_for(lambda: cluster.status(other) == "succeeded", 30, what="the other run")
    time.sleep(1.0)
    assert len(cluster.effects(running, "start")) == 1
    assert f"run {running} is cancelled" in worker.log()


@SQLITE_FS
@pytest.mark.timeout(90)
def test_revoke_by_stamped_headers_with_terminate_cancels_the_run(cluster: Cluster) -> None:
    """revoke_by_stamped_headers(terminate=True) names the run as revoke(terminate=True)
    does: the body is killed and the run ends cancelled (a body Celery ends by itself,
    as in a cold shutdown, is handed back instead)."""
    cluster.start("w1", conf=FAST, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    batch = uuid.uuid4().hex
    running = sig(cluster, "spin", 30.0).apply_async(stamped_headers=["batch"], batch=batch).id
    wait_for(lambda: cluster.effects(running, "start"), 30, what="the body to start")
    cluster.producer.control.revoke_by_stamped_headers(
        {"batch": batch}, terminate=True, signal="SIGKILL"
    )
    wait_for(lambda: cluster.status(running) == "cancelled", 30, what="cancelled")
    assert len(cluster.effects(running, "start")) == 1


@SQLITE_FS
@pytest.mark.timeout(90)
def test_revoking_a_duplicate_leaves_the_run_alone_and_says_so(cluster: Cluster) -> None:
    """revoke() of a duplicate's task id: the run goes on and succeeds, and the log says it
    was left alone (it said the run "is cancel-requested")."""
    worker = cluster.start("w1", conf=FAST)
    x = uuid.uuid4().int % 10**9
    own = sig(cluster, "keyed", x, 3.0).apply_async()
    run_id = f"workerapp.keyed:{x}"
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the body to start")
    duplicate = sig(cluster, "keyed", x).apply_async(countdown=1)
    cluster.producer.control.revoke(duplicate.id)
    wait_for(lambda: f"task {duplicate.id} revoked" in worker.log(), 30, what="the revoke")
    assert own.get(timeout=30) == x * 10
    line = next(ln for ln in worker.log().splitlines() if f"task {duplicate.id} revoked" in ln)
    assert f"run {run_id} is left alone (not its own delivery)" in line, line
    row = cluster.store.get(run_id)
    assert row is not None and row.status == "succeeded" and row.cancel_requested_at is None
    assert len(cluster.effects(run_id, "start")) == 1


@PG_REDIS
@pytest.mark.timeout(150)
def test_acks_late_reject_on_worker_lost_runs_once(cluster: Cluster) -> None:
    """acks_late + task_reject_on_worker_lost: a pool child killed mid-run is requeued
    by Celery; the redelivery waits for the lease, then runs; one commit."""
    conf = {**FAST, "task_reject_on_worker_lost": True}
    cluster.start("w1", conf=conf, CL_ACKS_LATE="1", CL_VISIBILITY_TIMEOUT="30", **SHORT)
    run_id = cluster.send("work", 2.0)
    (start,) = wait_for(lambda: cluster.effects(run_id, "start"), 30, what="the body")
    os.kill(start.pid, signal.SIGKILL)  # the pool child only: the worker lives
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="the requeued run")
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]
    assert cluster.producer.AsyncResult(run_id).get(timeout=10) == "done"


@SQLITE_FS
@pytest.mark.timeout(90)
@pytest.mark.parametrize("task", ["capped", "auto_capped"])
def test_max_retries_bounds_the_run_next_to_lease_max_attempts(cluster: Cluster, task: str) -> None:
    """A task with Celery's max_retries=1 and lease_max_attempts=5 runs its failing body
    twice, then ends failed: whichever bound comes first wins (the body used to run 5
    times when it raised)."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 5})
    res = sig(cluster, task).apply_async()
    with pytest.raises((RuntimeError, ValueError), match="attempt 2"):
        res.get(timeout=40)
    row = cluster.store.get(res.id)
    assert row is not None and (row.status, row.attempt) == ("failed", 2)
    time.sleep(1.0)
    assert [e.attempt for e in cluster.effects(res.id, "start")] == [1, 2]


@SQLITE_FS
@pytest.mark.timeout(90)
def test_lease_key_signature_mismatch_is_invalid_lease_key_in_the_worker(
    cluster: Cluster,
) -> None:
    """lease_key=lambda n: n on a task called with (n, secs): the delivery fails for good
    with InvalidLeaseKey naming the task and the mismatch, never a bare TypeError."""
    cluster.start("w1", conf=FAST)
    res = cluster.producer.AsyncResult(cluster.send("narrow_key", 2, 3.0))  # no call-time check
    with pytest.raises(Exception, match="invalid_lease_key") as failed:
        res.get(timeout=30)
    assert "workerapp.narrow_key" in str(failed.value)
    assert "lease_key(n)" in str(failed.value)
    assert res.state == "FAILURE"
    assert cluster.effects_of_kind("start") == []


@SQLITE_FS
@pytest.mark.timeout(90)
@pytest.mark.parametrize("task", ["auto_kw_capped", "call_capped"])
def test_per_call_max_retries_bounds_the_run_as_celery_does(cluster: Cluster, task: str) -> None:
    """autoretry_for with retry_kwargs={"max_retries": 1}, and self.retry(max_retries=1):
    the body runs twice, as in Celery, and the run ends failed with the body's error
    (before: lease_max_attempts, 5 runs)."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 5})
    res = sig(cluster, task).apply_async()
    with pytest.raises((KeyError, ValueError), match="attempt 2"):
        res.get(timeout=40)
    row = cluster.store.get(res.id)
    assert row is not None and (row.status, row.attempt) == ("failed", 2)
    time.sleep(1.5)
    assert [e.attempt for e in cluster.effects(res.id, "start")] == [1, 2]


@pytest.mark.parametrize("cluster", SETUPS[:3], ids=SETUP_IDS[:3], indirect=True)
@pytest.mark.timeout(120)
def test_a_retry_due_as_its_backoff_ends_runs_as_the_next_retry(cluster: Cluster) -> None:
    """autoretry_for(countdown=0.5, max_retries=2) on a body that fails twice: the body sees
    retries 0, 1, 2 and the task succeeds, as in plain Celery. Celery's ETA is counted from
    the retry's publish, the row's backoff from the write after it, so a retry is often
    delivered a few milliseconds before its backoff ends (on Redis about half the time):
    it was sent again as a new retry, which showed the body retries 0, 2 and spent
    max_retries."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 5})
    runs = [sig(cluster, "fails_twice").apply_async() for _ in range(6)]
    for res in runs:
        assert res.get(timeout=60) == "third time"
    for res in runs:
        seen = [e.kind for e in cluster.effects(res.id) if e.kind.startswith("start:")]
        assert seen == ["start:0", "start:1", "start:2"], seen
        row = cluster.store.get(res.id)
        assert row is not None and (row.status, row.attempt) == ("succeeded", 3)
