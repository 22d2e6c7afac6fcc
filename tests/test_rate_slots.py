"""A rate slot belongs to one delivery, and a paused task takes none (issue 28, 2 and 9)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from celery_lease import LeaseStore
from celery_lease.flow import SLOT_HEADER
from celery_lease.schema import rates
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
TWO_SETUPS = pytest.mark.parametrize(
    "cluster", [SETUPS[0], SETUPS[2]], ids=[SETUP_IDS[0], SETUP_IDS[2]], indirect=True
)
FAST = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 0.5}


def rate_of(starts: list[float]) -> float:
    """Starts per second over the span of ``starts`` (sorted), after the first."""
    return (len(starts) - 1) / max(starts[-1] - starts[0], 1e-3)


def test_a_recorded_slot_is_taken_once_by_its_own_delivery(store: LeaseStore) -> None:
    """record_slot/use_slot: the delivery it was recorded for takes it once; another task
    id, a second take, or a forged seq get none; give_back_rate moves the bucket back one
    period; the sweep's retention drops slots no delivery came for."""
    flow = store.flow
    seq = flow.record_slot(task_name="t", flow_key="", run_id="r", task_id="tid", due_ms=0)
    other = flow.record_slot(task_name="t", flow_key="", run_id="r2", task_id="t2", due_ms=0)
    assert seq != other
    assert not flow.use_slot(seq, "someone-else")
    assert flow.use_slot(seq, "tid")
    assert not flow.use_slot(seq, "tid")
    assert not flow.use_slot(seq + 1000, "tid")
    counts = flow.flow_counts()
    assert counts.paused == {} and counts.deferred == {}  # a slot is no held delivery
    assert flow.take_held(horizon_ms=10**9) == []
    assert flow.drop_stale_slots(1000) == 1 and not flow.use_slot(other, "t2")
    waits = [flow.reserve_rate("t", "", 100, 1)[0] for _ in range(3)]
    assert waits[0] == 0 and waits[2] > waits[1] > 0
    flow.give_back_rate("t", "", 100)
    flow.give_back_rate("t", "", 100)
    assert 0 < flow.reserve_rate("t", "", 100, 1)[0] <= waits[1] + 50


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_a_retry_takes_a_slot_of_its_own_and_waiting_is_no_retry(cluster: Cluster) -> None:
    """1/s, burst 1, two runs whose first attempt asks Celery for a retry (no countdown):
    the body starts keep to 1/s over their span (before: the deferred run's
    retry started 20 ms after its first attempt, carrying the copied slot header), and
    the deferred delivery's body sees request.retries 0 (before: 1)."""
    cluster.start("w1", concurrency=2, conf=FAST)
    ids = [cluster.send("rated_retry", n) for n in range(2)]
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 60, what="both runs")
    starts = sorted(e.at for i in ids for e in cluster.effects(i))
    assert len(starts) == 4
    assert rate_of(starts) <= 1.15, starts
    for run_id in ids:
        assert [e.kind for e in cluster.effects(run_id)] == ["start:0", "start:1"]


@TWO_SETUPS
@pytest.mark.timeout(120)
def test_a_forged_slot_header_takes_no_slot(cluster: Cluster) -> None:
    """Deliveries published with a made-up slot header are limited like any other: at
    1/s, burst 1, four of them keep to 1/s over their span (before: all at once)."""
    cluster.start("w1", concurrency=4, conf=FAST)
    ids = []
    for n in range(4):
        task_id = uuid.uuid4().hex
        cluster.producer.send_task(
            "workerapp.rated_retry",
            args=(n,),
            kwargs={"retry": False},
            task_id=task_id,
            queue=cluster.queue,
            headers={SLOT_HEADER: n + 1},
        )
        ids.append(task_id)
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 60, what="4 runs")
    starts = sorted(e.at for i in ids for e in cluster.effects(i))
    assert len(starts) == 4
    assert rate_of(starts) <= 1.15, starts


def _lease_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp", "lease", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **cluster.env},
        cwd=cluster.tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@TWO_SETUPS
@pytest.mark.timeout(150)
def test_a_paused_rate_limited_task_takes_no_slots_and_resumes_in_arrival_order(
    cluster: Cluster,
) -> None:
    """A rate-limited task (2/s) paused: its 6 deliveries are held without taking a slot
    (the bucket is not ahead of now; before: 3 s ahead), and resume runs them in the
    order they came (on Redis), at the limit. `lease pause TASK --key K` for a task without a
    concurrency key is refused with a clear error."""
    refused = _lease_cli(cluster, "pause", "workerapp.rated_seq", "--key", "acct-1")
    assert refused.returncode != 0
    assert "has no lease_concurrency_key" in refused.stdout + refused.stderr
    assert cluster.store.flow.list_pauses() == []
    assert _lease_cli(cluster, "pause", "workerapp.rated_seq").returncode == 0
    cluster.start("w1", concurrency=1, conf=FAST)
    ids = []
    for n in range(6):
        ids.append(cluster.send("rated_seq", n))
        time.sleep(0.05)
    wait_for(
        lambda: sum(cluster.store.flow.flow_counts().paused.values()) == 6,
        40,
        what="6 held deliveries",
    )
    with cluster.engine.connect() as conn:
        tat = conn.execute(select(rates.c.tat).where(rates.c.task_name == "workerapp.rated_seq"))
        ahead = [int(t) - cluster.store.now_ms() for (t,) in tat.all()]
    assert all(a <= 500 for a in ahead), ahead
    assert all(cluster.store.get(i) is None for i in ids)
    resumed = _lease_cli(cluster, "resume", "workerapp.rated_seq")
    assert resumed.returncode == 0 and "6 held deliveries published" in resumed.stdout
    wait_for(lambda: all(cluster.status(i) == "succeeded" for i in ids), 60, what="6 runs")
    order = sorted((e for i in ids for e in cluster.effects(i)), key=lambda e: e.at)
    assert rate_of([e.at for e in order]) <= 2.3
    if "CL_FS_DIR" not in cluster.env:
        # (A polling broker may hand two deferred deliveries over out of their slots'
        # order; Redis and the worker's ETA timer keep it.)
        assert [e.kind for e in order] == [f"seq:{n}" for n in range(6)]
