"""Recovery without beat: every worker sweeps, one at a time per lease database, fenced.

Real ``celery worker`` processes on the embedded default (SQLite + filesystem broker)
and on PostgreSQL + Redis, none of them with ``acks_late``: a killed worker's
message is gone, so only a sweep brings its run back. No beat runs in these tests.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for

TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
TIMING = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
SWEEP_INTERVAL = 1.0
CONF = {"lease_sweep_interval": SWEEP_INTERVAL}


def _leader(cluster: Cluster) -> str | None:
    """The node name (``w1@host``) of the worker leading the sweeper now, if any."""
    for record in cluster.store.leaders.list_all():
        if record.name == "sweeper" and record.live:
            return record.owner.split(":")[0]
    return None


def _republished(workers: list[Worker], run_id: str, why: str = "") -> dict[str, int]:
    """How many times each worker's sweeper re-enqueued ``run_id`` (from their logs), for
    any reason or for ``why`` (``expired``: its lease ran out)."""
    line = re.compile(rf"run {re.escape(run_id)}: re-enqueued \({why}")
    return {w.name: len(line.findall(w.log())) for w in workers}


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_kill9_worker_recovered_by_another_worker_with_no_beat(cluster: Cluster) -> None:
    """kill -9 the worker running a run (and leading the sweeper): with no beat at all,
    the other worker takes the sweeper's lead and re-enqueues the run within two sweep
    intervals of its lease's expiry; it commits once, on attempt 2."""
    # The file transport hands w2 the message w1 held when w1 dies; busy, that copy would
    # be sent again to run at the lease's expiry, racing the sweep it is here to show. With
    # "skip" it is dropped: the sweeper alone recovers the run.
    conf = {**CONF, "lease_busy_policy": "skip"}
    w1 = cluster.start("w1", conf=conf, **TIMING)
    assert wait_for(lambda: _leader(cluster), 10, what="a sweeper leader").startswith("w1@")
    run_id = cluster.send("workerapp.work", 30.0)
    wait_for(lambda: cluster.effects(run_id, "start"), 30, what="w1 to start the run")
    w2 = cluster.start("w2", conf=conf, **TIMING)
    w1.kill9()
    row = cluster.store.get(run_id)
    assert row is not None and row.lease_owner.startswith("w1@") and row.attempt == 1
    expires_at = time.monotonic() + (row.lease_expires_at - cluster.store.now_ms()) / 1000

    def moved() -> bool:
        found = cluster.store.get(run_id)
        return found is not None and (found.status, found.attempt) != ("running", 1)

    wait_for(moved, 30, interval=0.02, what="a sweep to re-enqueue the run")
    recovered_in = time.monotonic() - expires_at
    print(f"\nrecovered {recovered_in:.2f} s after the lease expired")
    assert recovered_in <= 2 * SWEEP_INTERVAL
    assert _leader(cluster).startswith("w2@")  # type: ignore[union-attr]
    # The expired lease's re-enqueue, once. (Under load w2 may claim the re-sent run later
    # than stale_after, and its sweeper then sends it again as stranded: a second line.)
    wait_for(
        lambda: _republished([w2], run_id, "expired") == {"w2": 1},
        10,
        what=f"w2's re-enqueue line (w2 log: {w2.log_path})",
    )
    wait_for(lambda: cluster.effects(run_id, "commit"), 60, what="the run to commit on w2")
    row = cluster.store.get(run_id)
    assert row is not None and row.attempt == 2 and row.lease_owner.startswith("w2@")
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]
    last = cluster.store.reads.last_sweep()
    assert last is not None and last["name"] == "worker"


@TWO_SETUPS
@pytest.mark.timeout(150)
def test_sweeping_workers_never_republish_a_run_twice(cluster: Cluster) -> None:
    """Four workers sweeping every 0.3 s while the lead moves between them (its holder
    stopped, twice, between two batches of expired leases): each of eight runs of a
    killed worker is re-enqueued for its expired lease exactly once, and commits once.

    The sweepers consume a queue nobody sends to; the runs are re-run by a worker that
    does not sweep (lease_worker_sweeper = False), so every re-enqueue is a sweeper's.
    """
    fast = {"lease_sweep_interval": 0.3}
    runs_queue = f"{cluster.queue}-runs"
    sweepers = [
        cluster.start(f"s{i}", conf=fast, queues=[f"{cluster.queue}-idle"], **TIMING)
        for i in range(4)
    ]
    # The victim's leases outlive the test: they expire when the test expires them.
    victim = cluster.start(
        "victim", conf=fast, concurrency=8, queues=[runs_queue], CL_LEASE_SECONDS="60"
    )
    runs = [uuid.uuid4().hex for _ in range(8)]
    for run_id in runs:
        cluster.producer.send_task("workerapp.work", args=(20.0,), task_id=run_id, queue=runs_queue)
    wait_for(lambda: all(cluster.effects(r, "start") for r in runs), 40, what="the victim's runs")
    cluster.start(
        "runner",
        conf={**fast, "lease_worker_sweeper": False},
        concurrency=8,
        queues=[runs_queue],
        **TIMING,
    )
    victim.kill9()
    stopped: list[Worker] = []

    def holder() -> Worker | None:
        leader = _leader(cluster) or ""
        return next((w for w in sweepers if leader.startswith(f"{w.name}@")), None)

    for batch in (runs[:4], runs[4:]):
        for run_id in batch:
            assert cluster.store.expire(run_id)
        time.sleep(0.5)  # a sweep or two
        found = wait_for(holder, 10, what="a sweeping worker to lead")
        found.stop()  # the lead moves to another sweeper (resigned: at its next try)
        sweepers.remove(found)
        stopped.append(found)
    for run_id in runs:
        wait_for(lambda r=run_id: cluster.effects(r, "commit"), 60, what=f"{run_id} to commit")
    time.sleep(1.5)  # a few more sweeps: nothing is re-enqueued again
    for run_id in runs:
        # For its expired lease: on a loaded machine a re-enqueued run the runner did not
        # claim within lease_sweep_interval + lease_seconds is also re-sent as stranded,
        # as documented (a clean-clone CI run beside other load saw one).
        counts = _republished(sweepers + stopped, run_id, "expired")
        assert sum(counts.values()) == 1, (run_id, counts)
        assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_a_stopped_sweeper_leader_is_refused_after_takeover(
    cluster: Cluster, tmp_path: Path
) -> None:
    """SIGSTOP the sweeper's leader inside its sweep (after it confirmed its lead), let
    another worker take the lead, then wake it: its sweep's first write is refused by the
    database (its term is fenced), and the run it would have swept is left alone."""
    marker = tmp_path / "stalled"
    w1 = cluster.start(
        "w1", conf={"lease_sweep_interval": 1.0}, CL_STALL_SWEEP=str(marker), **TIMING
    )
    assert wait_for(lambda: _leader(cluster), 10, what="w1 to lead").startswith("w1@")
    # w2 stands by and would sweep only in a minute: whatever is swept next is w1's doing.
    w2 = cluster.start("w2", conf={"lease_sweep_interval": 60.0}, **TIMING)
    assert (_leader(cluster) or "").startswith("w1@")
    Path(f"{marker}.arm").touch()  # w1's next sweep stalls before its first write
    wait_for(marker.exists, 20, interval=0.01, what="w1 to stall inside its sweep")
    w1.pause()
    wait_for(lambda: (_leader(cluster) or "").startswith("w2@"), 20, what="w2 to take the lead")
    claim = cluster.store.claim(
        "r-expired", "ghost:1:x", task_name="workerapp.work", lease_ms=60_000, max_attempts=5
    )
    assert claim.outcome == "claimed" and cluster.store.expire("r-expired")
    w1.resume()
    wait_for(lambda: "refused" in w1.log() and "sweep of" in w1.log(), 20, what="the refusal")
    time.sleep(1.5)  # w1's sweeper tries again as a standby: it never sweeps
    row = cluster.store.get("r-expired")
    assert row is not None and (row.status, row.attempt, row.requeues) == ("running", 1, 0)
    assert "this worker no longer leads its sweeper" in w1.log()
    assert (_leader(cluster) or "").startswith("w2@")
    assert w2.proc.poll() is None
