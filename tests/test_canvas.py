"""Celery-faithful runs with real workers: canvas, retry, replace, keys, duplicates.

Each test runs on the embedded default (SQLite leases, filesystem broker, a
database result backend: chords use ``chord_unlock``) and on PostgreSQL +
Redis (Redis result backend: native chord counters).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from celery_lease.run.outcome import encode_result
from celery_lease.sweeper import sweep
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for

TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
pytestmark = TWO_SETUPS

FAST = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}
#: Short leases so a killed worker's runs expire quickly; no acks_late, so only
#: the sweeper recovers (a broker redelivery would hide what the sweeper sends).
SHORT = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}


def sig(cluster: Cluster, name: str, *args: Any, **kwargs: Any) -> Any:
    """A signature of a worker task, by name (the producer does not import the tasks)."""
    return cluster.producer.signature(f"workerapp.{name}", args=args, kwargs=kwargs)


def result(cluster: Cluster, task_id: str) -> AsyncResult:
    return cluster.producer.AsyncResult(task_id)


def commits(cluster: Cluster, run_id: str) -> list[int]:
    return [e.attempt for e in cluster.effects(run_id, "commit")]


@pytest.mark.timeout(150)
def test_chain_continues_after_kill9_and_sweep(cluster: Cluster) -> None:
    """kill -9 during a chain's first step: the sweeper re-sends the step with its chain;
    every step commits once and the caller's result of the last step resolves."""
    w1 = cluster.start("w1", conf=FAST, **SHORT)
    res = chain(
        sig(cluster, "step", 1, seconds=4.0), sig(cluster, "step"), sig(cluster, "step")
    ).apply_async()
    first = res.parent.parent.id
    wait_for(lambda: cluster.effects(first, "start"), 30, what="step 1 to start")
    w1.kill9()
    cluster.start("w2", conf=FAST, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    assert res.get(timeout=60) == 4
    assert commits(cluster, first) == [2]
    assert commits(cluster, res.parent.id) == [1] and commits(cluster, res.id) == [1]


@pytest.mark.timeout(150)
def test_chain_step_lost_by_the_broker_before_its_claim_is_sent_again(
    cluster: Cluster, tmp_path: Any
) -> None:
    """The worker that takes a chain's second step off the broker is killed before the
    broker records it as unacknowledged (kombu Redis between BRPOP and its save to
    ``unacked``; the filesystem transport once it read the file): the step's ``queued``
    run row, written before its publish by the worker that ran step 1, lets the sweeper
    send it again; the chain runs to its end, each step committing once."""
    ids = [uuid.uuid4().hex for _ in range(3)]
    w1 = cluster.start(
        "w1",
        conf=FAST,
        **SHORT,
        CL_DIE_AT_POP="workerapp.step",
        CL_DIE_AT_POP_ID=ids[1],
        CL_DIE_AT_POP_ONCE=str(tmp_path / "died"),
    )
    steps = [sig(cluster, "step", 1), sig(cluster, "step"), sig(cluster, "step")]
    res = chain(*(s.set(task_id=i) for s, i in zip(steps, ids, strict=True))).apply_async()
    wait_for(lambda: w1.proc.poll() is not None, 30, what="w1 to die taking step 2")
    assert (tmp_path / "died").exists()
    assert cluster.status(ids[0]) == "succeeded"
    kept = cluster.store.get(ids[1])
    assert kept is not None and (kept.status, kept.attempt) == ("queued", 0)
    sweeping = {"lease_sweep_interval": 0.5, **FAST}
    cluster.start("w2", conf=sweeping, **SHORT)
    cluster.start_beat(sweeping)
    assert res.get(timeout=60) == 4
    assert [commits(cluster, i) for i in ids] == [[1], [1], [1]]


@pytest.mark.timeout(150)
def test_chain_continues_through_warm_shutdown(cluster: Cluster) -> None:
    """SIGTERM (warm shutdown) during a chain's step: the chain still completes, once."""
    w1 = cluster.start("w1", conf=FAST, **SHORT)
    res = chain(sig(cluster, "step", 1, seconds=2.0), sig(cluster, "step")).apply_async()
    first = res.parent.id
    wait_for(lambda: cluster.effects(first, "start"), 30, what="step 1 to start")
    cluster.start("w2", conf=FAST, **SHORT)
    w1.proc.terminate()
    assert res.get(timeout=60) == 3
    assert len(commits(cluster, first)) == 1 and commits(cluster, res.id) == [1]


@pytest.mark.timeout(180)
def test_chord_fires_once_after_kill9_of_header_steps(cluster: Cluster) -> None:
    """kill -9 while chord header steps run: they are recovered with their chord, and
    the body fires exactly once with every header result.

    The steps have a queue of their own, so the killed worker holds only leased
    steps: Celery's own ``chord_unlock`` (database backend) stays on a worker that
    lives, since a broker that does not redeliver loses what a killed worker held.
    """
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    steps = f"{cluster.queue}-steps"
    routes = {"task_routes": {"workerapp.step": {"queue": steps}}}
    cluster.producer.conf.task_routes = routes["task_routes"]
    conf = {**FAST, **routes}
    # Three pool processes: every header step has started (claimed) when w1 is
    # killed. A message prefetched but not started dies with it when there is no
    # acks_late redelivery: Celery's at-most-once, with no row to recover from.
    w1 = cluster.start("w1", conf=conf, queues=[steps], concurrency=3, **SHORT)
    cluster.start("w2", conf=conf, queues=[cluster.queue], **SHORT)
    header = [sig(cluster, "step", i, seconds=3.0) for i in range(3)]
    res = chord(header, sig(cluster, "tsum", tag=tag)).apply_async()
    wait_for(lambda: len(cluster.effects_of_kind("start")) >= 3, 30, what="header steps")
    w1.kill9()
    cluster.start("w3", conf=conf, queues=[steps], **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **conf})
    assert res.get(timeout=90) == 1 + 2 + 3
    time.sleep(2.0)  # a second firing would land here
    assert len(cluster.effects(tag, "fired")) == 1


@pytest.mark.timeout(150)
def test_keyed_callers_result_resolves_after_recovery(cluster: Cluster) -> None:
    """A keyed run recovered by the sweeper is re-sent under the task id delay() returned."""
    w1 = cluster.start("w1", conf=FAST, **SHORT)
    task_id = cluster.send("keyed", 7, 3.0)
    wait_for(lambda: cluster.effects("workerapp.keyed:7", "start"), 30, what="the run to start")
    w1.kill9()
    cluster.start("w2", conf=FAST, **SHORT)
    cluster.start_beat({"lease_sweep_interval": 0.5, **FAST})
    assert result(cluster, task_id).get(timeout=60) == 70
    assert commits(cluster, "workerapp.keyed:7") == [2]


@pytest.mark.timeout(120)
def test_retry_countdown_is_not_resurrected_by_a_sweep(cluster: Cluster) -> None:
    """self.retry(countdown=5): the row waits until that ETA; a sweep in between sends
    nothing, and the retry runs once, when Celery delivers it."""
    cluster.start("w1", conf=FAST)
    task_id = cluster.send("retry_later", 5.0)
    wait_for(lambda: cluster.status(task_id) == "retrying", 30, what="the retry to be recorded")
    row = cluster.store.get(task_id)
    assert row is not None and row.available_at - cluster.store.now_ms() > 3_000
    report = sweep(cluster.producer, cluster.store, stale_after=0)
    assert task_id not in report.requeued
    assert result(cluster, task_id).get(timeout=60) == "retried"
    assert [e.attempt for e in cluster.effects(task_id, "start")] == [1, 2]


@pytest.mark.timeout(120)
def test_ignore_reject_and_replace_end_the_run(cluster: Cluster) -> None:
    """Ignore, Reject and self.replace() end the leased run: no sweep runs it again, and
    the replacement (same task id) runs once and owns the caller's result."""
    cluster.start("w1", conf=FAST)
    ids = {what: cluster.send("outcome", what) for what in ("ignore", "reject", "replace")}
    expected = {"ignore": "cancelled", "reject": "failed", "replace": "succeeded"}
    for what, task_id in ids.items():
        wait_for(lambda t=task_id, w=what: cluster.status(t) == expected[w], 30, what=what)
    assert result(cluster, ids["replace"]).get(timeout=30) == 101
    assert commits(cluster, f"{ids['replace']}~replaced-1") == [1]
    report = sweep(cluster.producer, cluster.store, stale_after=0)
    assert not set(ids.values()) & set(report.requeued)
    time.sleep(1.0)
    for task_id in ids.values():
        assert len(cluster.effects(task_id, "start")) == 1
    codes = {w: cluster.store.get(t).failure_code for w, t in ids.items()}  # type: ignore[union-attr]
    assert codes == {"ignore": "ignored", "reject": "rejected", "replace": "replaced"}


@pytest.mark.timeout(90)
def test_two_tasks_with_the_same_key_value_both_run(cluster: Cluster) -> None:
    """Keys are scoped to the task name: keyed(42) does not swallow refund(42)."""
    cluster.start("w1", conf=FAST)
    a = cluster.send("keyed", 42)
    assert result(cluster, a).get(timeout=30) == 420
    b = cluster.send("refund", 42)
    assert result(cluster, b).get(timeout=30) == -42
    assert cluster.status("workerapp.keyed:42") == "succeeded"
    assert cluster.status("workerapp.refund:42") == "succeeded"


@pytest.mark.timeout(120)
def test_keyed_duplicates_callers_group_and_chain_get_the_outcome(cluster: Cluster) -> None:
    """A keyed duplicate under another task id gets the run's result as its own; a group
    of two same-key tasks and a chain through an already-finished key both complete."""
    cluster.start("w1", conf=FAST)
    first = cluster.send("keyed", 5, 1.0)
    second = cluster.send("keyed", 5, 1.0)
    assert result(cluster, first).get(timeout=30) == 50
    assert result(cluster, second).get(timeout=30) == 50
    assert len(cluster.effects("workerapp.keyed:5", "start")) == 1
    grouped = group(sig(cluster, "keyed", 6), sig(cluster, "keyed", 6)).apply_async()
    assert grouped.get(timeout=30) == [60, 60]
    assert result(cluster, cluster.send("keyed", 2)).get(timeout=30) == 20
    chained = chain(sig(cluster, "add", 1, 1), sig(cluster, "keyed"), sig(cluster, "add", 5))
    assert chained.apply_async().get(timeout=30) == 25
    assert len(cluster.effects("workerapp.keyed:2", "start")) == 1


@pytest.mark.timeout(90)
def test_keyed_run_finished_without_a_task_id_does_not_hang_later_calls(cluster: Cluster) -> None:
    """A keyed run finished by a direct call ``task(...)`` (or written before migration
    0002) has no task id: a later delay() of that key is a duplicate under another task
    id, so its caller gets an outcome. A NULL task id used to count as "the same
    delivery": the duplicate was dropped silently and its caller waited forever."""
    run_id = "workerapp.keyed:9"
    claim = cluster.store.claim(
        run_id, "direct:1:x", task_name="workerapp.keyed", lease_ms=5000, max_attempts=5
    )
    # As a direct call completes it: the body's result kept in the row.
    kept = encode_result(cluster.producer, 9)
    cluster.store.complete(run_id, claim.owner, claim.attempt, result=kept)
    row = cluster.store.get(run_id)
    assert row is not None and row.task_id is None and row.status == "succeeded"
    cluster.start("w1", conf=FAST)
    task_id = cluster.send("keyed", 9)
    assert result(cluster, task_id).get(timeout=30) == 9
    assert result(cluster, task_id).state == "SUCCESS"
    assert cluster.effects(run_id, "start") == []  # the body did not run again


@pytest.mark.timeout(120)
def test_autoretry_ends_in_failure_with_the_real_error(cluster: Cluster) -> None:
    """autoretry_for with Celery's default max_retries (None on LeasedTask): once the
    lease attempts are spent, the state is FAILURE with the body's own error."""
    cluster.start("w1", conf={**FAST, "lease_max_attempts": 3})
    task_id = cluster.send("auto_fail")
    with pytest.raises(ValueError, match="real boom on attempt 3"):
        result(cluster, task_id).get(timeout=60)
    assert result(cluster, task_id).state == "FAILURE"
    row = cluster.store.get(task_id)
    assert row is not None and (row.status, row.attempt) == ("failed", 3)
    assert row.last_error is not None and "real boom on attempt 3" in row.last_error


@pytest.mark.timeout(90)
def test_completed_then_raised_reports_success(cluster: Cluster) -> None:
    """A body that committed fence(complete=True) and then raised: Celery sees SUCCESS
    and the link runs, as the row says."""
    cluster.start("w1", conf=FAST)
    tag = f"link-{uuid.uuid4().hex[:8]}"
    res = sig(cluster, "complete_then_raise").apply_async(link=sig(cluster, "mark", tag=tag))
    assert res.get(timeout=30) is None
    assert res.state == "SUCCESS"
    assert cluster.status(res.id) == "succeeded"
    wait_for(lambda: cluster.effects(tag, "linked"), 30, what="the link")
    assert commits(cluster, res.id) == [1]


@pytest.mark.timeout(120)
def test_hostile_task_ids_and_retries_fail_alone_with_the_field_named(cluster: Cluster) -> None:
    """Messages a caller or a forger can send with values no database stores the same way:
    a task id with a NUL (PostgreSQL refused it as bad data, SQLite kept it), ``retries``
    past 2**31 or not an integer (an
    out-of-range error on PostgreSQL, OverflowError on SQLite, a bare ValueError). Each
    fails alone, naming the field, on every database; the worker runs the next task."""
    cluster.start("w1", conf=FAST)
    sent = []
    task_id = "bad\x00id-" + uuid.uuid4().hex[:8]  # (a lone surrogate cannot be sent as JSON)
    cluster.producer.send_task("workerapp.step", args=(1,), task_id=task_id, queue=cluster.queue)
    sent.append((task_id, "lease_input_invalid: run_id: contains a NUL character"))
    for retries in (2**40, "abc"):
        task_id = uuid.uuid4().hex
        cluster.producer.send_task(
            "workerapp.step", args=(1,), task_id=task_id, queue=cluster.queue, retries=retries
        )
        sent.append((task_id, "lease_input_invalid: retries: the message's retries must be"))
    for task_id, error in sent:
        with pytest.raises(Exception) as failed:
            result(cluster, task_id).get(timeout=30)
        assert error in str(failed.value), (task_id, failed.value)
    ok = cluster.send("step", 4)
    assert result(cluster, ok).get(timeout=30) == 5


@pytest.mark.timeout(90)
def test_a_task_id_naming_another_tasks_finished_run_fails_clearly(cluster: Cluster) -> None:
    """An unkeyed task applied with a task id that is a keyed task's run id (a caller
    building ids the same way): it fails naming both tasks. It was dropped as "already
    succeeded" and its caller got the keyed task's result."""
    cluster.start("w1", conf=FAST)
    x = uuid.uuid4().int % 10**9
    keyed = cluster.send("keyed", x)
    assert result(cluster, keyed).get(timeout=30) == x * 10
    clash = f"workerapp.keyed:{x}"
    cluster.producer.send_task("workerapp.step", args=(1,), task_id=clash, queue=cluster.queue)
    with pytest.raises(Exception) as failed:
        result(cluster, clash).get(timeout=30)
    assert "is a run of task 'workerapp.keyed', not of 'workerapp.step'" in str(failed.value)
    assert len(cluster.effects(clash, "start")) == 1  # the keyed body's, none of the step's


@pytest.mark.timeout(90)
def test_bad_key_is_a_clear_error_in_the_worker(cluster: Cluster) -> None:
    """A lease_key returning None fails the task with InvalidLeaseKey; no row "None"."""
    cluster.start("w1", conf=FAST)
    task_id = cluster.send("bad_key", 1)
    with pytest.raises(Exception, match="invalid_lease_key"):
        result(cluster, task_id).get(timeout=30)
    assert cluster.store.get("None") is None
    assert cluster.store.get("workerapp.bad_key:None") is None
