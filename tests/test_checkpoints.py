"""Checkpoints and progress: the store's statements on every database, then real workers."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from sqlalchemy import text

from celery_lease import LeasedTask, LeaseLost, LeaseStore
from celery_lease.errors import LeaseDatabaseError, LeaseInputError, LeaseUsageError
from celery_lease.lease.lease import Lease, Standalone
from celery_lease.runtime import store_for
from celery_lease.schema import MAX_CHECKPOINT_BYTES, runs
from celery_lease.store.records import Progress

from . import test_rerun_top as rerun_top
from .cluster import SETUP_IDS, SETUPS, TWO_SETUPS_AND_MARIADB, Cluster
from .helpers import Worker, driver_statements, wait_for


def claim(store: LeaseStore, run_id: str, owner: str, lease_ms: int = 5000, **kw: Any) -> Any:
    return store.claim(
        run_id, owner, task_name="t", lease_ms=lease_ms, max_attempts=kw.pop("max_attempts", 5)
    )


def lease_for(store: LeaseStore, result: Any) -> Lease:
    return Lease(
        Standalone(store),
        result.run_id,
        result.owner,
        result.attempt,
        lease_seconds=30,
        heartbeat_interval=10,
        checkpoint=result.checkpoint,
    )


def on_runs(seen: list[tuple[int, str]]) -> list[str]:
    return [sql for _, sql in seen if runs.name in sql]


@pytest.mark.timeout(60)
def test_claim_returns_the_checkpoint_in_its_own_statements(store: LeaseStore) -> None:
    """A takeover's claim returns the checkpoint an earlier attempt saved, with no
    statement more than a claim without one; a fresh run reads None."""
    first = claim(store, "r1", "A")
    assert first.checkpoint is None and lease_for(store, first).last_checkpoint is None
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        claim(store, "r0", "Z")
        store.expire("r0")
        seen.clear()
        claim(store, "r0", "Y")
    without = len(on_runs(seen))
    lease_for(store, first).checkpoint({"next": 10, "s": "é😀"})
    store.expire("r1")
    with driver_statements(store.engines) as seen:
        second = claim(store, "r1", "B")
    assert second.outcome == "claimed" and second.attempt == 2
    assert len(on_runs(seen)) == without
    assert lease_for(store, second).last_checkpoint == {"next": 10, "s": "é😀"}


@pytest.mark.timeout(60)
def test_checkpoint_is_one_guarded_update(store: LeaseStore) -> None:
    """checkpoint() runs one UPDATE naming id, owner and attempt; the row holds the
    compact JSON and when it was saved (DB clock)."""
    lease = lease_for(store, claim(store, "r1", "A"))
    store.now_ms()
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        lease.checkpoint([1, {"a": None}])
    statements = on_runs(seen)
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("UPDATE")
    row = store.get("r1")
    assert row is not None and row.checkpoint == '[1,{"a":null}]'
    assert row.checkpoint_at is not None and abs(row.checkpoint_at - store.now_ms()) < 5000
    assert lease.last_checkpoint == [1, {"a": None}]


@pytest.mark.timeout(60)
def test_stale_owner_cannot_overwrite_a_newer_checkpoint(store: LeaseStore) -> None:
    """After a takeover the old owner's checkpoint raises LeaseLost and changes nothing."""
    old = lease_for(store, claim(store, "r1", "A"))
    old.checkpoint(1)
    store.expire("r1")
    new = lease_for(store, claim(store, "r1", "B"))
    assert new.last_checkpoint == 1
    new.checkpoint(2)
    with pytest.raises(LeaseLost):
        old.checkpoint(99)
    assert old.lost
    row = store.get("r1")
    assert row is not None and row.checkpoint == "2" and row.lease_owner == "B"


@pytest.mark.timeout(60)
def test_expired_lease_cannot_checkpoint(store: LeaseStore) -> None:
    """A lease expired on the database's clock (not yet taken over) saves nothing."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint("a")
    store.expire("r1")
    with pytest.raises(LeaseLost):
        lease.checkpoint("b")
    row = store.get("r1")
    assert row is not None and row.checkpoint == '"a"'


@pytest.mark.timeout(60)
def test_checkpoint_bound_and_json_checked_before_any_sql(store: LeaseStore) -> None:
    """A state over 64 KiB of compact JSON, or not JSON, is LeaseInputError before any SQL."""
    lease = lease_for(store, claim(store, "r1", "A"))
    fits = "x" * (MAX_CHECKPOINT_BYTES - 2)  # plus its two quotes
    lease.checkpoint(fits)
    store.now_ms()
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        for bad in ("x" * (MAX_CHECKPOINT_BYTES - 1), "é" * (MAX_CHECKPOINT_BYTES // 2), object()):
            with pytest.raises(LeaseInputError) as caught:
                lease.checkpoint(bad)
            assert caught.value.field == "checkpoint"
        with pytest.raises(LeaseInputError):
            lease.checkpoint(float("nan"))
    assert seen == []
    row = store.get("r1")
    assert row is not None and row.checkpoint is not None
    assert json.loads(row.checkpoint) == fits
    assert lease.last_checkpoint == fits


@pytest.mark.timeout(30)
def test_a_checkpoint_sharing_big_parts_is_refused_at_once(store: LeaseStore) -> None:
    """A list holding one 60,000-item list 60,000 times (or one 60,000-character string):
    refused in well under a second. The check walked every copy, pinning the worker's
    process for minutes on its way to 21 GB of JSON."""
    lease = lease_for(store, claim(store, "r1", "A"))
    shared = list(range(60_000))
    for bad in ([shared] * 60_000, ["x" * 60_000] * 60_000, {"a": [shared, shared]}):
        started = time.monotonic()
        with pytest.raises(LeaseInputError, match="its compact JSON is over 65536 bytes"):
            lease.checkpoint(bad)
        assert time.monotonic() - started < 1.0
    row = store.get("r1")
    assert row is not None and row.checkpoint is None


@pytest.mark.timeout(60)
def test_progress_rides_the_renewal_statement(store: LeaseStore) -> None:
    """Progress is written by the heartbeat's renewal: the same statements as a tick
    without progress, only for the lease that reported it."""
    keys = []
    for i in range(5):
        claim(store, f"r{i}", f"A{i}")
        keys.append((f"r{i}", f"A{i}", 1))
    with driver_statements(store.engines) as seen:
        store.now_ms()
        seen.clear()
        store.heartbeat(keys)
        plain = len(seen)
        seen.clear()
        beat = store.heartbeat(
            keys, {keys[1]: Progress(40, 100, "batch 4"), keys[3]: Progress(7.5)}
        )
    assert len(seen) == plain and beat.renewed == set(keys)
    one = store.get("r1")
    three = store.get("r3")
    other = store.get("r0")
    assert one is not None and three is not None and other is not None
    assert (one.progress_done, one.progress_total, one.progress_note) == (40, 100, "batch 4")
    assert (three.progress_done, three.progress_total, three.progress_note) == (7.5, None, None)
    assert one.progress_at is not None and other.progress_at is None
    assert other.progress_done is None


@pytest.mark.timeout(60)
def test_progress_input_checked(store: LeaseStore) -> None:
    """progress() takes finite numbers and a note of at most 200 characters."""
    lease = lease_for(store, claim(store, "r1", "A"))
    for args in (("3",), (1, "x"), (float("inf"),), (True,), (1, 2, "n" * 201), (1, 2, 3)):
        with pytest.raises(LeaseInputError):
            lease.progress(*args)
    lease.progress(1, 2, "n" * 200)
    assert lease.report.pending() == Progress(1.0, 2.0, "n" * 200)


@pytest.mark.timeout(60)
def test_fenced_checkpoint_commits_with_the_writes(store: LeaseStore) -> None:
    """fence(conn, checkpoint=...) saves the checkpoint in the caller's transaction: a
    rollback keeps the one before, a commit lands it with the writes."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint(0)
    with pytest.raises(RuntimeError), lease.transaction() as conn:
        lease.fence(conn, checkpoint=5)
        raise RuntimeError("rolled back")
    row = store.get("r1")
    assert row is not None and row.checkpoint == "0" and lease.last_checkpoint == 0
    with lease.transaction() as conn:
        lease.fence(conn, checkpoint={"next": 6})
        assert conn.execute(text("SELECT 1")).scalar() == 1
    row = store.get("r1")
    assert row is not None and row.checkpoint == '{"next":6}'
    assert lease.last_checkpoint == {"next": 6}


@pytest.mark.timeout(60)
def test_success_clears_the_checkpoint_failure_keeps_it(store: LeaseStore) -> None:
    """Success clears the checkpoint (also fence(complete=True)); failed and cancelled
    rows keep it; rerun keeps it, rerun(from_scratch=True) clears it and the progress."""
    done = lease_for(store, claim(store, "ok", "A"))
    done.checkpoint(3)
    done.complete()
    fenced = lease_for(store, claim(store, "fenced", "A"))
    fenced.checkpoint(3)
    with fenced.transaction() as conn:
        fenced.fence(conn, checkpoint=4, complete=True)
    with pytest.raises(LeaseUsageError):
        fenced.checkpoint(5)  # after the recorded success: nothing to resume
    for run_id in ("ok", "fenced"):
        row = store.get(run_id)
        assert row is not None and row.status == "succeeded"
        assert row.checkpoint is None and row.checkpoint_at is None
    failed = lease_for(store, claim(store, "bad", "A", max_attempts=1))
    failed.checkpoint({"at": 7})
    store.heartbeat([failed.key], {failed.key: Progress(7, 10)})
    store.fail("bad", "A", 1, error="E", failure_code="exception:E", retry_in=None)
    row = store.get("bad")
    assert row is not None and row.status == "failed" and row.checkpoint == '{"at":7}'
    store.rerun("bad", attempts=1)
    again = claim(store, "bad", "B", max_attempts=1)
    assert again.outcome == "claimed" and json.loads(again.checkpoint) == {"at": 7}
    store.mark_cancelled("bad", "B", again.attempt)
    row = store.get("bad")
    assert row is not None and row.status == "cancelled" and row.checkpoint == '{"at":7}'
    fresh = store.rerun("bad", attempts=1, from_scratch=True)
    assert fresh.checkpoint is None and fresh.checkpoint_at is None
    assert fresh.progress_done is None and fresh.progress_total is None
    assert claim(store, "bad", "C", max_attempts=1).checkpoint is None


@pytest.mark.timeout(60)
def test_checkpoint_survives_release_retry_and_sweep(store: LeaseStore) -> None:
    """Every path to a next attempt keeps the checkpoint: a hand-back, a retry, a sweep."""
    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint(1)
    store.release("r1", "A", 1)
    second = claim(store, "r1", "B")
    assert second.checkpoint == "1"
    store.fail("r1", "B", 2, error="E", failure_code="exception:E", retry_in=0)
    third = claim(store, "r1", "C")
    assert third.checkpoint == "1"
    lease_for(store, third).checkpoint(2)
    store.expire("r1")
    assert [status for _, status in store.sweep_expired()] == ["retrying"]
    assert claim(store, "r1", "D").checkpoint == "2"


# -- real workers ------------------------------------------------------------------------

TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
#: A lease long enough that only LeaseStore.expire() ends it.
LONG_LEASE = {"CL_LEASE_SECONDS": "30", "CL_HEARTBEAT": "1"}
SWEEP = {"lease_sweep_interval": 0.5}


def kinds(cluster: Cluster, run_id: str, prefix: str) -> list[tuple[int, str]]:
    """``(attempt, rest)`` of each effect of ``run_id`` whose kind starts with ``prefix:``."""
    return [
        (e.attempt, e.kind.partition(":")[2])
        for e in cluster.effects(run_id)
        if e.kind.startswith(prefix + ":")
    ]


def items_done(cluster: Cluster, run_id: str) -> list[int]:
    return sorted(int(rest) for _, rest in kinds(cluster, run_id, "item"))


def kill_and_recover(cluster: Cluster, worker: Any, run_id: str) -> None:
    """kill -9 the worker, expire its lease, and let another worker and the sweeper go on."""
    worker.kill9()
    assert cluster.store.expire(run_id)
    cluster.start("w2", **LONG_LEASE)
    cluster.start_beat(SWEEP)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="the resumed run")


@TWO_SETUPS_AND_MARIADB
@pytest.mark.timeout(120)
def test_resume_after_kill9_from_the_last_checkpoint_that_returned(cluster: Cluster) -> None:
    """A 100-item job checkpointing every 10 is killed with kill -9; the next attempt's
    last_checkpoint is the last checkpoint that returned, and at most the 10 items since
    it are done again."""
    w1 = cluster.start("w1", **LONG_LEASE)
    run_id = cluster.send("workerapp.resumable", 100, 10, 0.05)

    def saved_and_reported() -> bool:
        row = cluster.store.get(run_id)  # progress is written by the 1 s heartbeat tick
        checkpointed = any(int(n) >= 40 for _, n in kinds(cluster, run_id, "ckpt"))
        return checkpointed and row is not None and row.progress_done is not None

    wait_for(saved_and_reported, 30, what="attempt 1 to checkpoint 40 items and report")
    w1.kill9()
    row = cluster.store.get(run_id)
    assert row is not None and row.checkpoint is not None and row.progress_done is not None
    saved = json.loads(row.checkpoint)
    returned = max(int(n) for _, n in kinds(cluster, run_id, "ckpt"))
    # The effect is recorded right after checkpoint() returns: the kill may fall between.
    assert saved["next"] in (returned, returned + 10) and saved["attempt"] == 1
    assert cluster.store.expire(run_id)
    cluster.start("w2", **LONG_LEASE)
    cluster.start_beat(SWEEP)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="the resumed run")
    assert kinds(cluster, run_id, "resume") == [(1, "0:0"), (2, f"{saved['next']}:1")]
    done = items_done(cluster, run_id)
    assert sorted(set(done)) == list(range(100))
    assert len(done) - 100 <= 10  # only the items after the last checkpoint are redone
    final = cluster.store.get(run_id)
    assert final is not None and final.attempt == 2
    assert final.checkpoint is None  # cleared on success
    assert final.progress_total == 100


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_fenced_checkpoints_do_each_item_exactly_once(cluster: Cluster) -> None:
    """With fence(conn, checkpoint=...) each item's effect commits with its checkpoint:
    across a kill -9 and the next attempt every item is written exactly once."""
    w1 = cluster.start("w1", **LONG_LEASE)
    run_id = cluster.send("workerapp.resumable", 100, 1, 0.02, "fenced")
    wait_for(lambda: len(items_done(cluster, run_id)) >= 30, 30, what="30 fenced items")
    kill_and_recover(cluster, w1, run_id)
    assert items_done(cluster, run_id) == list(range(100))
    resumes = kinds(cluster, run_id, "resume")
    assert len(resumes) == 2 and resumes[1][0] == 2
    first = {int(rest) for attempt, rest in kinds(cluster, run_id, "item") if attempt == 1}
    assert resumes[1][1] == f"{max(first) + 1}:1"  # the next item after the last committed


def stop_and_expire(cluster: Cluster, worker: Worker, run_id: str) -> None:
    """SIGSTOP ``worker`` and expire the run's lease. On SQLite a process stopped inside a
    write keeps the file's write lock: continue it and stop it again (a few tries)."""
    for _ in range(5):
        worker.pause()
        try:
            assert cluster.store.expire(run_id)
            return
        except LeaseDatabaseError:
            worker.resume()
            time.sleep(0.05)
    raise AssertionError("the stopped worker held the database's write lock every time")


@TWO_SETUPS
@pytest.mark.timeout(180)
def test_stale_owner_checkpoint_refused_after_takeover(cluster: Cluster) -> None:
    """A worker stopped (SIGSTOP) while its lease is taken over cannot checkpoint once
    continued: LeaseLost, and the row keeps the new owner's checkpoint."""
    w1 = cluster.start("w1", **LONG_LEASE)
    run_id = cluster.send("workerapp.resumable", 200, 10, 0.03)
    wait_for(lambda: kinds(cluster, run_id, "ckpt"), 30, what="attempt 1's first checkpoint")
    stop_and_expire(cluster, w1, run_id)
    cluster.start("w2", **LONG_LEASE)
    cluster.start_beat(SWEEP)
    wait_for(
        lambda: any(a == 2 for a, _ in kinds(cluster, run_id, "ckpt")),
        60,
        what="attempt 2 to checkpoint",
    )
    w1.resume()
    wait_for(lambda: kinds(cluster, run_id, "refused"), 30, what="attempt 1's refusal")
    assert {a for a, _ in kinds(cluster, run_id, "refused")} == {1}
    row = cluster.store.get(run_id)
    assert row is not None and row.lease_owner is not None
    assert row.lease_owner.startswith("w2@") and row.attempt == 2
    assert row.checkpoint is not None and json.loads(row.checkpoint)["attempt"] == 2
    # Nothing attempt 1 saved after the takeover: attempt 2 resumed from its last one.
    (resumed,) = [int(rest.split(":")[0]) for a, rest in kinds(cluster, run_id, "resume") if a == 2]
    assert max(int(n) for a, n in kinds(cluster, run_id, "ckpt") if a == 1) <= resumed
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="attempt 2 to finish")


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(90)
def test_checkpoint_survives_self_retry_and_bound_checked(cluster: Cluster) -> None:
    """The body's own self.retry() keeps the checkpoint for the next attempt; a state over
    64 KiB is refused in the worker with LeaseInputError."""
    cluster.start("w1", conf={"lease_retry_backoff": 0.1}, **LONG_LEASE)
    run_id = cluster.send("workerapp.resumable", 30, 10, 0.01, "retry")
    big = cluster.send("workerapp.big_checkpoint", MAX_CHECKPOINT_BYTES)
    fits = cluster.send("workerapp.big_checkpoint", MAX_CHECKPOINT_BYTES - 2)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the retried run")
    assert kinds(cluster, run_id, "resume") == [(1, "0:0"), (2, "10:1")]
    assert items_done(cluster, run_id) == list(range(30))
    wait_for(lambda: cluster.status(big) == cluster.status(fits) == "succeeded", 30)
    assert [e.kind for e in cluster.effects(big)] == ["too_big"]
    assert [e.kind for e in cluster.effects(fits)] == ["saved"]


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_cold_shutdown_hand_back_resumes_from_the_checkpoint(cluster: Cluster) -> None:
    """A cold shutdown (SIGQUIT) hands the lease back at once; the worker taking the run
    over resumes from its last checkpoint."""
    workers = {name: cluster.start(name, **LONG_LEASE) for name in ("w1", "w2")}
    # 8 s of work: the cold shutdown stops it long before it ends, even on a loaded machine.
    run_id = cluster.send("workerapp.resumable", 200, 10, 0.04)
    wait_for(lambda: kinds(cluster, run_id, "ckpt"), 30, what="attempt 1's first checkpoint")
    row = cluster.store.get(run_id)
    assert row is not None and row.lease_owner is not None
    holder = workers[row.lease_owner.partition("@")[0]]
    holder.proc.send_signal(signal.SIGQUIT)  # the main process only: a cold shutdown
    holder.proc.wait(30)
    # It stopped consuming before handing the run back: the run never came back to it.
    assert "delivery handed on" not in holder.log()
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="the other to finish")
    resumes = kinds(cluster, run_id, "resume")
    returned = max(int(n) for a, n in kinds(cluster, run_id, "ckpt") if a == 1)
    assert resumes[0] == (1, "0:0") and resumes[1][0] == 2
    assert int(resumes[1][1].split(":")[0]) in (returned, returned + 10)
    done = items_done(cluster, run_id)
    assert sorted(set(done)) == list(range(200)) and len(done) - 200 <= 10


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(90)
def test_rerun_resumes_from_the_checkpoint_or_from_scratch(cluster: Cluster) -> None:
    """A cancelled run keeps its checkpoint: `lease rerun` resumes from it,
    `lease rerun --from-scratch` starts at item 0; `lease show` prints progress and the
    checkpoint's size and age, `--checkpoint` the JSON."""
    w1 = cluster.start("w1", **LONG_LEASE)
    run_id = cluster.send("workerapp.resumable", 40, 10, 0.05)
    wait_for(lambda: kinds(cluster, run_id, "ckpt"), 30, what="a checkpoint")
    cluster.store.cancel(run_id)
    wait_for(lambda: cluster.status(run_id) == "cancelled", 30, what="the cancel")
    row = cluster.store.get(run_id)
    assert row is not None and row.checkpoint is not None
    saved = json.loads(row.checkpoint)["next"]
    shown = lease_cli(cluster, "show", run_id)
    assert f"{len(row.checkpoint)} bytes, saved " in shown and "--checkpoint" in shown
    assert "progress" in shown and "/40 (" in shown
    assert row.checkpoint in lease_cli(cluster, "show", run_id, "--checkpoint").replace(" ", "")
    lease_cli(cluster, "rerun", run_id)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the rerun")
    assert kinds(cluster, run_id, "resume")[-1][1] == f"{saved}:1"
    w1.stop()
    cluster.store.rerun(run_id, attempts=1, force=True)  # succeeded: checkpoint cleared
    again = cluster.store.get(run_id)
    assert again is not None and again.checkpoint is None


def lease_cli(cluster: Cluster, *args: str) -> str:
    """Run ``celery -A tests.workerapp lease ...`` against the cluster; its stdout."""
    proc = rerun_top.lease_cli(cluster, *args)
    assert proc.returncode == 0, proc.stderr
    return str(proc.stdout)


@pytest.fixture
def app(lease_db_url: str) -> Iterator[Celery]:
    app = Celery("inproc_progress", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        lease_database_url=lease_db_url,
        # A lease long enough that a loaded machine never loses it mid-task.
        lease_seconds=6,
        lease_heartbeat_interval=0.2,
        broker_connection_retry_on_startup=True,
    )
    store_for(app).create_schema()
    yield app
    store_for(app).engine.dispose()


@pytest.mark.timeout(90)
def test_progress_costs_no_statement_of_its_own(app: Celery) -> None:
    """A task reporting progress hundreds of times pays what one that never does pays:
    2 statements per task (claim, completion) and 1 per heartbeat tick (2 on MySQL: no
    UPDATE .. RETURNING); the renewal writes the latest report."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="inproc.report")
    def report(self: LeasedTask, n: int, seconds: float) -> int:
        for i in range(n):
            if n > 1:
                self.lease.progress(i + 1, n, "rows")
            time.sleep(seconds / n)
        return n

    store = store_for(app)
    per_tick = 2 if store.db.dialect == "mysql" else 1
    per_task = 4 if store.db.dialect == "mysql" else 2
    # Only the run's and the heartbeat's statements: the in-worker sweeper's leader lease
    # and sweeps (benchmarks/idle.py measures them) would land in the heartbeat's count.
    app.conf.lease_worker_sweeper = False
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert report.delay(1, 0.0).get(timeout=20) == 1  # opens the connections
        counts = {}
        for n in (1, 300):
            with driver_statements(store.engines) as seen:
                result = report.delay(n, 1.0)
                assert result.get(timeout=20) == n
            task_thread = {tid for tid, sql in seen if sql.lstrip().startswith("INSERT")}
            if store.db.dialect == "mysql":
                task_thread = {tid for tid, sql in seen if "FOR UPDATE" in sql}
            on_task = [sql for tid, sql in seen if tid in task_thread]
            ticks = [sql for tid, sql in seen if tid not in task_thread]
            assert len(on_task) == per_task, _statements(seen)
            renewals = [sql for sql in ticks if sql.lstrip().upper().startswith("UPDATE")]
            assert renewals and len(ticks) == per_tick * len(renewals), _statements(seen)
            counts[n] = (len(on_task), len(ticks) / len(renewals))
        row = store.get(result.id)
    assert counts[1] == counts[300]
    assert row is not None and row.progress_total == 300 and row.progress_note == "rows"
    assert row.progress_done is not None and row.progress_done >= 200


def _statements(seen: list[tuple[int, str]]) -> str:
    """Every recorded statement, one per line: its thread (numbered in order of first
    appearance) and its first 100 characters."""
    threads: dict[int, int] = {}
    return "\n".join(
        f"thread {threads.setdefault(tid, len(threads))}: {' '.join(sql.split())[:100]}"
        for tid, sql in seen
    )


@pytest.mark.timeout(60)
def test_top_and_show_print_progress(store: LeaseStore) -> None:
    """`lease top` shows done/total and the percentage; `lease show --json` has the
    progress columns and the checkpoint's size, never its content."""
    from celery_lease.cli.common import record_data
    from celery_lease.cli.top import render_top

    lease = lease_for(store, claim(store, "r1", "A"))
    lease.checkpoint({"secret-ish": "cursor"})
    store.heartbeat([lease.key], {lease.key: Progress(120, 300, "orders")})
    frame = render_top(store, "db", 10)
    assert "DONE" in frame and "120/300 (40%)" in frame and "orders" not in frame
    row = store.get("r1")
    assert row is not None
    data = record_data(row, store.now_ms())
    assert data["checkpoint_bytes"] == len('{"secret-ish":"cursor"}')
    assert (data["progress_done"], data["progress_total"], data["progress_note"]) == (
        120,
        300,
        "orders",
    )
    assert "checkpoint" not in data
