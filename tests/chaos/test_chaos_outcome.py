"""Chaos scenarios for the outcome of a run reaching Celery's caller (PostgreSQL + Redis).

- kill -9 between the lease commit and Celery's result store, 100 times, over
  chords and chains: every AsyncResult resolves, every chord body runs once;
- the sweeper ending runs with ``lease_max_attempts=1``: every caller gets
  FAILURE (``RunFailed``) and ``link_error`` runs once;
- kill -9, three times, of workers running a task with its own lease database
  (SQLite + filesystem): every run is recovered by the sweep of that database.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord

from celery_lease.errors import RunFailed
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for

pytestmark = pytest.mark.chaos
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)

TIMING = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 2.0}


def sig(cluster: Cluster, name: str, *args: Any, **kwargs: Any) -> Any:
    return cluster.producer.signature(f"workerapp.{name}", args=args, kwargs=kwargs)


@ON_PG
@pytest.mark.timeout(240)
def test_kill9_after_commit_100_times_over_chords_and_chains(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """20 chords of 3 crashing steps and 20 chains of 2: each step's pool process is
    killed -9 once, right after its completion committed and before Celery stored its
    result or sent its continuation (acks_late, reject on worker lost: the message comes
    back). Every step's body runs once, every caller resolves with the right value and
    every chord body fires exactly once."""
    marks = tmp_path / "killed"
    marks.mkdir()
    env = {**TIMING, "CL_ACKS_LATE": "1", "CL_KILL_AFTER_COMMIT": str(marks)}
    conf = {**CONF, "task_reject_on_worker_lost": True}
    for i in range(2):
        cluster.start(f"w{i}", conf=conf, concurrency=2, **env)
    tags = [f"chord-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    chords = [
        chord(
            [sig(cluster, "crash_step", 10 * i + j) for j in range(3)],
            sig(cluster, "tsum", tag=tag),
        ).apply_async()
        for i, tag in enumerate(tags)
    ]
    chains = [
        chain(sig(cluster, "crash_step", i), sig(cluster, "crash_step")).apply_async()
        for i in range(20)
    ]
    started = time.monotonic()
    wait_for(
        lambda: all(r.ready() for r in chords + chains),
        200,
        interval=1.0,
        what="every chord and chain to resolve",
    )
    unresolved = []
    for i, res in enumerate(chords):
        expected = sum(10 * i + j + 1 for j in range(3))
        if res.get(timeout=10) != expected:
            unresolved.append(res.id)
    for i, res in enumerate(chains):
        if res.get(timeout=10) != i + 2:
            unresolved.append(res.id)
    time.sleep(2.0)  # a second chord firing would land here
    fired = {tag: len(cluster.effects(tag, "fired")) for tag in tags}
    kills = len(list(marks.iterdir()))
    starts = cluster.effects_of_kind("start")
    step_ids = {e.run_id for e in starts}
    with capsys.disabled():
        print(
            f"\nkill9 after commit x{kills}: 20 chords x 3 + 20 chains x 2 resolved in "
            f"{time.monotonic() - started:.0f}s"
        )
    assert kills == 100
    assert unresolved == []
    assert set(fired.values()) == {1}, fired
    assert len(starts) == len(step_ids) == 100  # each body ran once: the outcome replayed


@ON_PG
@pytest.mark.timeout(180)
def test_sweeper_ends_runs_with_one_attempt_every_caller_gets_failure(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """lease_max_attempts=1: 20 runs whose workers are killed -9 mid-body are ended by
    the sweeper; every caller gets FAILURE with RunFailed(lease_expired) and each
    link_error runs exactly once."""
    conf = {**CONF, "lease_max_attempts": 1}
    tags = [f"err-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    results = []
    for round_ in range(5):  # 5 rounds of a worker with 4 processes, killed mid-body
        worker = cluster.start(f"w{round_}", conf=conf, concurrency=4, **TIMING)
        sent = [
            sig(cluster, "work", 60.0).apply_async(link_error=sig(cluster, "on_error", tag=tag))
            for tag in tags[4 * round_ : 4 * round_ + 4]
        ]
        results += sent
        wait_for(
            lambda sent=sent: all(cluster.status(r.id) == "running" for r in sent),
            60,
            what="the round's bodies to start",
        )
        worker.kill9()
    cluster.start("w-after", conf=conf, **TIMING)
    cluster.start_beat({"lease_sweep_interval": 0.5, **conf})
    started = time.monotonic()
    codes = []
    for res in results:
        with pytest.raises(RunFailed) as failed:
            res.get(timeout=max(5.0, 90 - (time.monotonic() - started)))
        codes.append(failed.value.failure_code)
    wait_for(
        lambda: all(cluster.effects(tag, "errback") for tag in tags),
        30,
        what="every link_error",
    )
    time.sleep(2.0)  # later sweeps must not record them again
    errbacks = {tag: len(cluster.effects(tag, "errback")) for tag in tags}
    with capsys.disabled():
        print(f"\nsweeper ended 20 runs: FAILURE in {time.monotonic() - started:.0f}s")
    assert set(codes) == {"lease_expired"}
    assert set(errbacks.values()) == {1}, errbacks


SQLITE_FS = pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)


@SQLITE_FS
@pytest.mark.timeout(240)
def test_kill9_repeatedly_on_a_task_with_its_own_database_recovered(cluster: Cluster) -> None:
    """Runs of a task with its own lease_database_url, on a broker that never redelivers:
    the worker running them is killed -9 three times in a row; beat's sweep, which
    sweeps that database too, brings every run to succeeded with one commit each."""
    from celery_lease import LeaseStore

    task_db = f"sqlite:///{cluster.tmp_path / 'task-leases.sqlite3'}"
    cluster.env["CL_TASK_DB"] = task_db
    task_store = LeaseStore.from_url(task_db)
    task_store.create_schema()
    # acks_late: a process holds no message beyond the one it runs.
    timing = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5", "CL_ACKS_LATE": "1"}
    try:
        run_ids = [cluster.send("workerapp.own_db", 2.0) for _ in range(6)]
        for round_ in range(3):
            # One process, prefetching one message: the killed worker holds only the
            # run it started, whose row the sweep finds (the broker never redelivers).
            worker = cluster.start(f"k{round_}", concurrency=1, **timing)
            wait_for(
                lambda started=round_ + 1: len(cluster.effects_of_kind("start")) >= started,
                60,
                what="a body to start",
            )
            worker.kill9()
        cluster.start("survivor", **timing)
        cluster.start_beat({"lease_sweep_interval": 1.0})

        def done() -> bool:
            rows = [task_store.get(run_id) for run_id in run_ids]
            return all(row is not None and row.status == "succeeded" for row in rows)

        wait_for(done, 150, what="every run recovered on the task's own database")
        time.sleep(1.0)
        for run_id in run_ids:
            assert len(cluster.effects(run_id, "commit")) == 1, run_id
            assert cluster.store.get(run_id) is None  # never in the app's database
    finally:
        task_store.dispose()
