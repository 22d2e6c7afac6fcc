"""A run's outcome reaches Celery's caller on every path (celery_lease/run/outcome.py),
with real workers: a crash between the lease commit and Celery's result store, runs
ended by the sweeper, ``lease cancel``, and duplicates whose result Celery lost."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord
from celery.result import AsyncResult
from sqlalchemy import update

from celery_lease.errors import RunFailed
from celery_lease.schema import runs
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


def keep_a_worker(
    cluster: Cluster, workers: list[Worker], concurrency: int = 2, **env: str
) -> None:
    """Start a new worker when the last one died (a kill -9 after a commit)."""
    if not workers or workers[-1].proc.poll() is not None:
        name = f"w{len(workers) + 1}"
        workers.append(cluster.start(name, concurrency=concurrency, **env))


@PG_REDIS
@pytest.mark.timeout(180)
def test_crash_after_commit_resolves_chain_and_chord(cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 of the whole worker after the run's completion committed, before Celery
    stored SUCCESS (acks_late, Redis): the redelivery replays the kept result, so the
    chain goes on, the chord body runs once and every AsyncResult resolves (before: the
    redelivery was dropped with Ignore and the callers stayed PENDING).

    One body at a time per worker: with two, the first kill (of the main process, whose
    death SIGKILLs every pool child: Celery's PDEATHSIG) could end the other crash step
    before its commit, and that run would rightly run again at attempt 2."""
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
    keep_a_worker(cluster, workers, concurrency=1, **env)
    chained = chain(sig(cluster, "crash_step", 1), sig(cluster, "step")).apply_async()
    chorded = chord(
        [sig(cluster, "crash_step", 10), sig(cluster, "step", 20)], sig(cluster, "tsum", tag=tag)
    ).apply_async()
    first = chained.parent.id

    def resolved() -> bool:
        keep_a_worker(cluster, workers, concurrency=1, **env)
        return chained.ready() and chorded.ready()

    wait_for(resolved, 120, interval=0.5, what="every caller to resolve")
    crashed = sorted(mark.name for mark in marks.iterdir())
    assert len(crashed) == 2 and first in crashed  # both killed after their commit
    assert result(cluster, first).get(timeout=5) == 2
    assert chained.get(timeout=5) == 3
    assert chorded.get(timeout=5) == 11 + 21
    time.sleep(1.5)  # a second firing would land here
    assert len(cluster.effects(tag, "fired")) == 1
    for run_id in crashed:
        trail = [(e.attempt, e.kind, e.pid, round(e.at, 3)) for e in cluster.effects(run_id)]
        row = cluster.store.get(run_id)
        assert row is not None and (row.status, row.attempt) == ("succeeded", 1), trail
        # The body ran once: the redelivery after the commit replayed the kept result.
        assert len(cluster.effects(run_id, "start")) == 1, trail
    row = cluster.store.get(first)
    assert row is not None and row.result == b"2"


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


# -- issue 28: a kept result is decoded under result_accept_content; one too large to
# keep never leaves a chord waiting (real workers) ---------------------------------------

FS_AND_PG = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)


class _Planted:
    """Pickles to a call of ``os.mkdir(path)``: code that runs if anyone unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.path,))


@FS_AND_PG
@pytest.mark.timeout(150)
def test_replayed_result_is_decoded_under_result_accept_content_only(
    cluster: Cluster, tmp_path: Path
) -> None:
    """accept_content allows pickle (for messages), result_accept_content only JSON: a
    pickle planted in a succeeded row's result is refused when a redelivery would replay
    it, and the caller gets RunFailed(result_not_accepted) (before: the redelivery
    unpickled it, running its code, and stored its return value as SUCCESS)."""
    conf = {"accept_content": ["json", "pickle"], "result_accept_content": ["json"]}
    # The tests run as root here; Celery refuses pickle under root without this.
    cluster.start("w1", conf=conf, C_FORCE_ROOT="1")
    first = sig(cluster, "step", 1).apply_async()
    assert first.get(timeout=60) == 2
    row = cluster.store.get(first.id)
    assert row is not None and row.result == b"2"  # JSON: kept, and decodable
    marker = tmp_path / "unpickled"
    with cluster.engine.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id == first.id)
            .values(
                result=pickle.dumps(_Planted(str(marker))),
                result_content_type="application/x-python-serialize",
            )
        )
    first.forget()  # Celery has no result for it: a redelivery would replay the row's
    cluster.send("step", 1, task_id=first.id)
    again = result(cluster, first.id)
    wait_for(lambda: again.state in ("SUCCESS", "FAILURE"), 60, what="the redelivery's outcome")
    assert not marker.exists(), "the planted pickle ran"
    with pytest.raises(RunFailed) as failed:
        again.get(timeout=5)
    assert failed.value.failure_code == "result_not_accepted"
    assert len(cluster.effects(first.id, "start")) == 1


def _messages(folder: Path, task: str | None = None) -> list[Path]:
    """The filesystem broker's message files (of ``task`` only, when given)."""
    found = []
    for path in sorted(folder.glob("*.msg")):
        headers = json.loads(path.read_text()).get("headers") or {}
        if task is None or headers.get("task") == task:
            found.append(path)
    return found


@PG_REDIS
@pytest.mark.timeout(150)
@pytest.mark.parametrize("keep", [True, False], ids=["result-kept", "no-result"])
def test_a_kill_after_fence_complete_replays_the_result_kept_with_it(
    cluster: Cluster, tmp_path: Path, keep: bool
) -> None:
    """A chain step commits its effect and its success with ``fence(complete=True)``, and
    its whole worker is killed -9 before the body returns (Celery stored nothing, sent no
    next step); Redis delivers the step again. With ``result=`` the success kept the
    result: the redelivery replays it, the chain goes on, and the step committed once.
    Without it the success has no result to replay: the step, and so the chain, fail with
    ``RunFailed`` (``result_not_kept``) instead of waiting forever."""
    marks = tmp_path / "killed"
    marks.mkdir()
    timing = {**SHORT, "CL_ACKS_LATE": "1", "CL_VISIBILITY_TIMEOUT": "3"}
    w1 = cluster.start("w1", CL_KILL_AFTER_FENCE=str(marks), **timing)
    res = chain(sig(cluster, "fenced_step", 1, keep), sig(cluster, "step")).apply_async()
    first = res.parent.id
    wait_for(lambda: w1.proc.poll() is not None, 60, what="w1 to die after the fenced commit")
    assert cluster.status(first) == "succeeded"
    assert result(cluster, first).state == "PENDING"  # Celery stored nothing
    cluster.start("w2", CL_KILL_AFTER_FENCE=str(marks), **timing)
    if keep:
        assert res.get(timeout=60) == 3
    else:
        with pytest.raises(RunFailed) as failed:
            result(cluster, first).get(timeout=60, propagate=True)
        assert failed.value.failure_code == "result_not_kept"
        assert cluster.store.get(res.id) is None  # the next step was never sent
    assert [e.attempt for e in cluster.effects(first, "commit")] == [1]


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(180)
def test_chord_member_too_large_to_keep_fails_its_chord_after_a_crash_not_hangs(
    cluster: Cluster, tmp_path: Path
) -> None:
    """File broker + database results (chord_unlock): a chord member returns 70 000
    characters (over the 64 KiB the row keeps); its worker dies after the commit, before
    Celery stores anything; the message is delivered again. The redelivery stores
    FAILURE(RunFailed result_not_kept), so chord_unlock fails the chord with a ChordError
    and the body never runs (before: the redelivery was dropped, chord_unlock retried
    forever and the caller waited forever). The body ran once."""
    folder = Path(cluster.env["CL_FS_DIR"])
    stash = tmp_path / "stash"
    stash.mkdir()
    marks = tmp_path / "killed"
    marks.mkdir()
    tag = f"big-{uuid.uuid4().hex[:8]}"
    chorded = chord([sig(cluster, "big_crash_step", 70_000)], sig(cluster, "tsum", tag=tag))
    body = chorded.apply_async()
    member = body.parent.results[0]
    wait_for(lambda: _messages(folder, "workerapp.big_crash_step"), 10, what="the message")
    (sent,) = _messages(folder, "workerapp.big_crash_step")
    # The broker's second delivery of the same message (the file broker never redelivers
    # by itself), and everything else kept away from the worker that will die.
    copy = f"{sent.name.split('_', 1)[0]}9_copy.{cluster.queue}.msg"
    shutil.copy(sent, stash / copy)
    for other in _messages(folder):
        if other != sent:
            other.rename(stash / other.name)
    sent.rename(tmp_path / sent.name)  # the worker gets it once it is ready
    w1 = cluster.start("w1", CL_KILL_AFTER_COMMIT=str(marks), CL_KILL_WHOLE_WORKER="1", **SHORT)
    (tmp_path / sent.name).rename(sent)
    wait_for(lambda: w1.proc.poll() is not None, 60, what="the worker to die after the commit")
    assert cluster.status(member.id) == "succeeded"
    row = cluster.store.get(member.id)
    assert row is not None and row.result is None  # too large to keep
    assert member.state == "PENDING"  # Celery stored nothing
    for kept in stash.iterdir():
        kept.rename(folder / kept.name)
    cluster.start("w2", CL_KILL_AFTER_COMMIT=str(marks), **SHORT)
    wait_for(lambda: body.ready(), 90, interval=0.5, what="the chord to resolve")
    with pytest.raises(RunFailed) as failed:
        member.get(timeout=5, propagate=True)
    assert failed.value.failure_code == "result_not_kept"
    assert body.state == "FAILURE"
    assert len(cluster.effects(member.id, "start")) == 1
    assert not cluster.effects(tag, "fired")


@PG_REDIS
@pytest.mark.timeout(180)
def test_chord_member_too_large_to_keep_fails_its_chord_after_a_crash_on_redis(
    cluster: Cluster, tmp_path: Path
) -> None:
    """PostgreSQL + Redis (native chord counter), acks_late: a chord member over 64 KiB
    whose whole worker dies after the commit is redelivered; the redelivery stores
    FAILURE(RunFailed result_not_kept), so the chord fails instead of waiting forever."""
    marks = tmp_path / "killed"
    marks.mkdir()
    env = {
        **SHORT,
        "CL_ACKS_LATE": "1",
        "CL_VISIBILITY_TIMEOUT": "2",
        "CL_KILL_AFTER_COMMIT": str(marks),
        "CL_KILL_WHOLE_WORKER": "1",
    }
    tag = f"big-{uuid.uuid4().hex[:8]}"
    workers: list[Worker] = []
    keep_a_worker(cluster, workers, **env)
    body = chord(
        [sig(cluster, "big_crash_step", 70_000), sig(cluster, "step", 20)],
        sig(cluster, "tsum", tag=tag),
    ).apply_async()
    member = body.parent.results[0]

    def resolved() -> bool:
        keep_a_worker(cluster, workers, **env)
        return bool(body.ready())

    wait_for(resolved, 120, interval=0.5, what="the chord to resolve")
    assert len(list(marks.iterdir())) == 1  # the big member's worker was killed after the commit
    with pytest.raises(RunFailed) as failed:
        member.get(timeout=5)
    assert failed.value.failure_code == "result_not_kept"
    assert body.state == "FAILURE"
    assert len(cluster.effects(member.id, "start")) == 1
    assert not cluster.effects(tag, "fired")


@pytest.mark.parametrize("cluster", [SETUPS[0]], ids=[SETUP_IDS[0]], indirect=True)
@pytest.mark.timeout(120)
def test_a_redelivery_while_the_owner_returns_a_fenced_success_reports_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The body commits its success with ``fence(complete=True)`` and returns 4 s later;
    2.5 s after the commit a second delivery of its message arrives (a broker's
    redelivery) and finds the row succeeded with no result kept, and nothing in Celery.
    Its owner is alive and about to store the result: the redelivery looks again later
    instead of storing FAILURE(RunFailed result_not_kept) and firing ``link_error``
    (before: it did, 2 s after the row's end time). The caller gets the body's result."""
    folder = Path(cluster.env["CL_FS_DIR"])
    stash = tmp_path / "stash"
    stash.mkdir()
    sent_result = sig(cluster, "fenced_then_slow", 4.0).apply_async()
    wait_for(lambda: _messages(folder, "workerapp.fenced_then_slow"), 10, what="the message")
    (sent,) = _messages(folder, "workerapp.fenced_then_slow")
    copy = f"{sent.name.split('_', 1)[0]}9_copy.{cluster.queue}.msg"
    shutil.copy(sent, stash / copy)
    worker = cluster.start("w1", concurrency=2)
    run_id = sent_result.id
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the fenced commit")
    time.sleep(2.5)  # past the old 2 s grace, well before the body returns
    (stash / copy).rename(folder / copy)
    assert sent_result.get(timeout=30) == "done"
    wait_for(lambda: "delivery dropped" in worker.log(), 10, what="the redelivery")
    time.sleep(1.0)  # what the redelivery does next
    assert "reporting RunFailed" not in worker.log()
    assert result(cluster, run_id).state == "SUCCESS"
    assert len(cluster.effects(run_id, "commit")) == 1
