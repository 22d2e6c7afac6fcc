"""External effects with real workers: idempotency keys across a crash, and follow-up
tasks sent exactly once, only on commit (celery_lease/followups.py, Lease.idempotency_key).

The payment task (``workerapp.pay``) charges a fake provider that deduplicates on its
idempotency key (``test_provider_charges``), then commits the payment and the run's
success together, with its follow-ups (``workerapp.receipt``, a LeasedTask, and
``workerapp.plain_receipt``, a plain task).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert, select

from celery_lease import LeaseStore
from celery_lease.followups import sweep
from celery_lease.requeue import SweepReport
from celery_lease.runtime import app_runtime
from celery_lease.schema import outbox
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import REPO, wait_for
from tests.workerapp import provider_charges

#: SQLite + filesystem broker (only the sweeper recovers a killed worker there) and
#: PostgreSQL + Redis.
TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
TIMING = {"CL_LEASE_SECONDS": "2", "CL_HEARTBEAT": "0.5"}
FAST = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0}
SWEEP = {"lease_sweep_interval": 1.0, **FAST}


def charges(cluster: Cluster, order_id: str) -> list[Any]:
    """The provider's charges of ``order_id``."""
    query = select(provider_charges).where(provider_charges.c.order_id == order_id)
    with cluster.engine.connect() as conn:
        return list(conn.execute(query).all())


def kinds(cluster: Cluster, run_id: str, prefix: str) -> list[str]:
    """The effects of ``run_id`` whose kind starts with ``prefix``, in order."""
    return [e.kind for e in cluster.effects(run_id) if e.kind.startswith(prefix)]


def order() -> str:
    return f"o{uuid.uuid4().hex[:10]}"


def killing(cluster: Cluster, point: str) -> dict[str, str]:
    """The environment of a worker that kills itself -9 once at ``point``."""
    folder = cluster.tmp_path / "kills"
    folder.mkdir(exist_ok=True)
    return {"CL_KILL_AT": point, "CL_KILL_DIR": str(folder)}


def lease_cli(cluster: Cluster, *args: str) -> str:
    """``celery -A tests.workerapp lease ARGS`` as an operator runs it, on the cluster."""
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "lease", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **cluster.env, "CL_CONF": json.dumps(FAST)},
        cwd=cluster.tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_kill9_between_the_provider_reply_and_the_commit_charges_once(cluster: Cluster) -> None:
    """The worker dies after the provider charged and before the lease committed: the
    sweeper hands the run to another worker, whose attempt derives the same key, and the
    provider charges once."""
    w1 = cluster.start("w1", **TIMING, **killing(cluster, "before_commit"))
    order_id = order()
    cluster.send("pay", order_id)
    run_id = f"workerapp.pay:{order_id}"
    wait_for(lambda: w1.proc.poll() is not None, 30, what="w1 to die before its commit")
    assert kinds(cluster, run_id, "commit") == []
    assert len(charges(cluster, order_id)) == 1
    cluster.start("w2", **TIMING)
    cluster.start_beat(SWEEP)
    wait_for(lambda: cluster.status(run_id) == "succeeded", 60, what="recovery")
    keys = [k.removeprefix("key:") for k in kinds(cluster, run_id, "key:")]
    assert keys == [f"{run_id}:charge:0"] * 2
    assert [e.attempt for e in cluster.effects(run_id, "commit")] == [2]
    assert [(c.idempotency_key, c.attempt) for c in charges(cluster, order_id)] == [(keys[0], 1)]


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_followups_published_after_the_commit_under_ids_derived_from_the_run(
    cluster: Cluster,
) -> None:
    """fence(send=) and send_on_commit(): each follow-up runs once, under the run's derived
    task ids, right after the commit (no sweeper runs); the outbox is empty afterwards."""
    cluster.start("w1", **TIMING)
    order_id = order()
    cluster.send("pay", order_id, "receipt+plain+later")
    run_id = f"workerapp.pay:{order_id}"
    wait_for(lambda: cluster.status(run_id) == "succeeded", 30, what="the payment")
    expected = [f"{run_id}:followup:1.{n}" for n in range(3)]
    # The body records what fence()/send_on_commit() returned after its commit.
    wait_for(lambda: len(kinds(cluster, run_id, "sent:")) == 3, 10, what="the body's records")
    assert kinds(cluster, run_id, "sent:") == [f"sent:{i}" for i in expected]
    wait_for(
        lambda: (
            len(cluster.effects_of_kind(f"receipt:{order_id}")) == 2
            and cluster.effects_of_kind(f"plain_receipt:{order_id}")
        ),
        20,
        what="the follow-ups",
    )
    receipts = cluster.effects_of_kind(f"receipt:{order_id}")
    assert sorted(r.run_id for r in receipts) == [expected[0], expected[2]]
    assert [r.run_id for r in cluster.effects_of_kind(f"plain_receipt:{order_id}")] == [expected[1]]
    wait_for(lambda: cluster.store.outbox.count() == 0, 10, what="the outbox to empty")
    time.sleep(1.0)
    assert len(cluster.effects_of_kind(f"receipt:{order_id}")) == 2
    assert len(cluster.effects_of_kind(f"plain_receipt:{order_id}")) == 1


@TWO_SETUPS
@pytest.mark.timeout(150)
def test_followup_published_once_across_a_kill9_after_the_commit(cluster: Cluster) -> None:
    """The worker dies after the commit, holding the follow-ups it was about to publish:
    the sweeper publishes them once the take is stale; each runs once, the leased one and
    the plain one."""
    w1 = cluster.start("w1", **TIMING, **killing(cluster, "before_publish"))
    order_id = order()
    run_id = f"workerapp.pay:{order_id}"
    cluster.send("pay", order_id, "receipt+plain")
    wait_for(lambda: w1.proc.poll() is not None, 30, what="w1 to die before its publish")
    assert cluster.status(run_id) == "succeeded"
    assert cluster.store.outbox.count() == 2
    assert cluster.effects_of_kind(f"receipt:{order_id}") == []
    cluster.start("w2", **TIMING)
    cluster.start_beat(SWEEP)
    wait_for(
        lambda: (
            cluster.effects_of_kind(f"receipt:{order_id}")
            and cluster.effects_of_kind(f"plain_receipt:{order_id}")
        ),
        60,
        what="the sweeper to publish the follow-ups",
    )
    wait_for(lambda: cluster.store.outbox.count() == 0, 10, what="the outbox to empty")
    time.sleep(2.0)  # two more sweeps: nothing is sent again
    receipts = cluster.effects_of_kind(f"receipt:{order_id}")
    assert [r.run_id for r in receipts] == [f"{run_id}:followup:1.0"]
    plain = cluster.effects_of_kind(f"plain_receipt:{order_id}")
    assert [p.run_id for p in plain] == [f"{run_id}:followup:1.1"]
    assert len(charges(cluster, order_id)) == 1


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_leased_followup_lost_by_the_broker_before_its_claim_is_sent_again(
    cluster: Cluster, tmp_path: Any
) -> None:
    """The worker that takes the receipt off the broker is killed before the broker records
    it as unacknowledged (kombu Redis between BRPOP and its save to ``unacked``; the
    filesystem transport once the file was read), after its publisher deleted the outbox
    row: the receipt's ``queued`` run row, written at the publish, lets the sweeper send it
    again; it runs once, under its derived task id."""
    victim = cluster.start(
        "w1",
        **TIMING,
        CL_DIE_AT_POP="workerapp.receipt",
        CL_DIE_AT_POP_ONCE=str(tmp_path / "died"),
    )
    order_id = order()
    run_id = f"workerapp.pay:{order_id}"
    cluster.send("pay", order_id, "receipt")
    wait_for(lambda: victim.proc.poll() is not None, 30, what="w1 to die taking the receipt")
    assert (tmp_path / "died").exists()
    assert cluster.status(run_id) == "succeeded"
    assert cluster.store.outbox.count() == 0
    followup = f"{run_id}:followup:1.0"
    record = cluster.store.get(followup)
    assert record is not None and (record.status, record.attempt) == ("queued", 0)
    cluster.start("w2", **TIMING, conf=SWEEP)
    wait_for(
        lambda: cluster.effects_of_kind(f"receipt:{order_id}"),
        60,
        what="the sweeper to send the lost receipt again",
    )
    wait_for(lambda: cluster.status(followup) == "succeeded", 10, what="the receipt's run")
    time.sleep(2.0)  # more sweeps: nothing is sent again
    assert [r.run_id for r in cluster.effects_of_kind(f"receipt:{order_id}")] == [followup]
    assert len(charges(cluster, order_id)) == 1


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_no_followup_when_the_transaction_rolls_back_or_the_lease_is_lost(
    cluster: Cluster,
) -> None:
    """A fenced transaction that rolls back sends nothing; a fence refused because the
    lease was lost records nothing; no follow-up ever runs, the outbox stays empty."""
    cluster.start("w1", **TIMING, conf=FAST)
    rolled = order()
    rolled_run = cluster.send("send_or_not", rolled, "rollback")
    gate = cluster.tmp_path / "gate"
    lost = order()
    lost_run = cluster.send("send_or_not", lost, "lost", str(gate))
    wait_for(lambda: cluster.status(rolled_run) == "succeeded", 30, what="the rollback run")
    assert kinds(cluster, rolled_run, "") == ["rolled_back"]
    wait_for(lambda: cluster.effects(lost_run, "waiting"), 30, what="the body to wait")
    assert cluster.store.expire(lost_run)
    gate.touch()
    wait_for(lambda: cluster.status(lost_run) == "succeeded", 30, what="the lost run's next try")
    assert kinds(cluster, lost_run, "") == ["waiting", "refused", "again"]
    time.sleep(1.5)
    assert cluster.effects_of_kind(f"receipt:{rolled}") == []
    assert cluster.effects_of_kind(f"receipt:{lost}") == []
    assert cluster.store.outbox.count() == 0


@TWO_SETUPS
@pytest.mark.timeout(150)
def test_forced_rerun_of_a_succeeded_run_gets_a_new_key_a_rerun_of_a_failed_one_keeps_it(
    cluster: Cluster,
) -> None:
    """`lease rerun --force` of a succeeded payment charges again under a new key
    (generation 1); `lease rerun` of a payment that failed after its charge derives the
    same key, and the provider charges once."""
    cluster.start("w1", **TIMING, conf={**FAST, "lease_max_attempts": 1})
    paid = order()
    paid_run = f"workerapp.pay:{paid}"
    cluster.send("pay", paid)
    wait_for(lambda: cluster.status(paid_run) == "succeeded", 30, what="the payment")
    lease_cli(cluster, "rerun", paid_run, "--force", "--args", json.dumps([paid]))
    wait_for(lambda: len(cluster.effects(paid_run, "commit")) == 2, 30, what="the forced rerun")
    assert kinds(cluster, paid_run, "key:") == [
        f"key:{paid_run}:charge:0",
        f"key:{paid_run}:charge:1",
    ]
    assert len(charges(cluster, paid)) == 2

    failed = order()
    failed_run = f"workerapp.pay:{failed}"
    cluster.send("pay", failed, "fail")
    wait_for(lambda: cluster.status(failed_run) == "failed", 30, what="the failed payment")
    lease_cli(cluster, "rerun", failed_run)
    wait_for(lambda: cluster.status(failed_run) == "succeeded", 30, what="the rerun")
    assert kinds(cluster, failed_run, "key:") == [f"key:{failed_run}:charge:0"] * 2
    assert len(charges(cluster, failed)) == 1


# -- the sweeper's step (in-process, every database) ------------------------------------


@pytest.fixture
def app(store: LeaseStore) -> Iterator[Celery]:
    """An app on the store's database, publishing to an in-memory broker queue of its own,
    with 5 s leases and a one-hour retention."""
    app = Celery("followup_sweeps", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"q{uuid.uuid4().hex[:8]}",
        lease_database_url=str(store.engine.url),
        lease_seconds=5,
        lease_retention=3600,
    )
    yield app
    app_runtime(app).reset()


@pytest.mark.timeout(60)
def test_sweep_publishes_what_no_sender_did_and_deletes_what_never_can_go(
    app: Celery, store: LeaseStore
) -> None:
    """The sweeper publishes committed follow-ups older than a lease length that nobody
    took (or whose take is stale), deletes one whose message the app refuses, leaves a
    young one to its sender, and deletes what waited past lease_retention."""
    now = store.now_ms()
    body = json.dumps({"task": "shop.mail", "args": [1], "kwargs": {}, "options": {}}).encode()
    rows = [
        ("orphan", "application/json", now - 10_000, None),
        ("stale", "application/json", now - 10_000, now - 6_000),
        ("refused", "application/x-python-serialize", now - 10_000, None),
        ("young", "application/json", now - 1_000, None),
        ("ancient", "application/json", now - 2 * 3_600_000, now - 1_000),  # being sent
    ]
    with store.transaction() as conn:
        conn.execute(
            insert(outbox),
            [
                {
                    "task_id": task_id,
                    "run_id": "r",
                    "task_name": "shop.mail",
                    "payload": body,
                    "payload_content_type": content_type,
                    "created_at": created,
                    "taken_at": taken,
                }
                for task_id, content_type, created, taken in rows
            ],
        )
    report = SweepReport()
    sweep(app, store, report)
    assert sorted(report.followups) == ["orphan", "stale"]
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        ids = sorted(queue.get(timeout=5).headers["id"] for _ in range(2))
        assert queue.qsize() == 0
        queue.close()
    assert ids == ["orphan", "stale"]
    assert [r.task_id for r in store.outbox.take(stale_ms=60_000)] == ["young"]
    assert store.outbox.count() == 1
