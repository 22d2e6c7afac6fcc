"""Chaos: payments with follow-ups under random kill -9 (PostgreSQL + Redis, acks_late).

200 runs of ``workerapp.pay`` over three workers, each charging a fake provider that
deduplicates on its idempotency key, waiting 0.3 s between the provider's reply and
its fenced commit (the window the old advice, ``self.lease.attempt`` as the key,
double-charged in), then committing the payment, the run's success and a
``workerapp.receipt`` follow-up together; the follow-up is published 0.2 s after the
commit (the window in which only the sweeper can send it). A driver kill -9s a random worker every
1-2.5 s and starts a fresh one. Asserted per order: the provider charged it exactly
once, under the run's key; one payment committed, by the run's last attempt; its
receipt ran exactly once, under the task id derived from that attempt; the outbox
is empty at the end. A receipt the broker lost with a killed worker is sent again by the
sweeper (its run row is written at the publish); a payment it lost before any claim has
no row, and the harness sends it again, as a shop resubmits its stalled orders.
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.chaos.test_chaos import wait_all_terminal_resending
from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for
from tests.workerapp import effects, provider_charges

pytestmark = pytest.mark.chaos
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)

TIMING = {
    "CL_LEASE_SECONDS": "1.5",
    "CL_HEARTBEAT": "0.3",
    "CL_ACKS_LATE": "1",
    "CL_VISIBILITY_TIMEOUT": "4",
    # Between the commit and the publish of each follow-up: random kills land there too.
    "CL_PUBLISH_DELAY": "0.2",
}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0, "lease_max_attempts": 30}
SWEEP = {"lease_sweep_interval": 0.5, **CONF}
ORDERS = 200


def all_done(cluster: Cluster, run_ids: list[str]) -> bool:
    return all(cluster.status(r) in ("succeeded", "failed", "cancelled") for r in run_ids)


def kill_while_running(
    cluster: Cluster, workers: list[Worker], rng: random.Random, run_ids: list[str]
) -> int:
    """kill -9 a random worker every 1-2.5 s (a fresh one takes its place) while payments
    are unfinished, at most 12 times; returns the number of kills."""
    kills = 0
    while kills < 12 and not all_done(cluster, run_ids):
        time.sleep(rng.uniform(1.0, 2.5))
        victim = rng.randrange(len(workers))
        workers[victim].kill9()
        kills += 1
        workers[victim] = cluster.start(f"w{victim}-r{kills}", conf=CONF, **TIMING)
    return kills


def problems_of(cluster: Cluster, order_id: str, rows: list[Any], charged: list[Any]) -> list[str]:
    """What is wrong with one order (empty: nothing)."""
    run_id = f"workerapp.pay:{order_id}"
    record = cluster.store.get(run_id)
    if record is None or record.status != "succeeded":
        return [f"{order_id}: run {None if record is None else record.status}"]
    found = []
    key = f"{run_id}:charge:0"
    if [c.idempotency_key for c in charged] != [key]:
        found.append(f"{order_id}: charged {[c.idempotency_key for c in charged]}")
    keys = {r.kind for r in rows if r.run_id == run_id and r.kind.startswith("key:")}
    if keys != {f"key:{key}"}:
        found.append(f"{order_id}: attempts used keys {sorted(keys)}")
    commits = [r.attempt for r in rows if r.run_id == run_id and r.kind == "commit"]
    if commits != [record.attempt]:
        found.append(f"{order_id}: commits by attempts {commits}, row at {record.attempt}")
    receipts = [r.run_id for r in rows if r.kind == f"receipt:{order_id}"]
    if receipts != [f"{run_id}:followup:{record.attempt}.0"]:
        found.append(f"{order_id}: receipts {receipts}")
    return found


@ON_PG
@pytest.mark.timeout(300)
def test_kill9_random_moments_during_200_payments_with_followups(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 payments under repeated kill -9: each order charged once at the provider, one
    payment committed, its receipt run once; the outbox ends empty."""
    rng = random.Random(20261205)
    workers = [cluster.start(f"w{i}", conf=CONF, **TIMING) for i in range(3)]
    cluster.start_beat(SWEEP)
    orders = [f"c{uuid.uuid4().hex[:8]}-{n:03d}" for n in range(ORDERS)]
    for order_id in orders:
        cluster.send("pay", order_id, "receipt+slow")
    run_ids = [f"workerapp.pay:{order_id}" for order_id in orders]
    kills = kill_while_running(cluster, workers, rng, run_ids)
    resend = {
        run_id: functools.partial(cluster.send, "pay", order_id, "receipt+slow")
        for run_id, order_id in zip(run_ids, orders, strict=True)
    }
    resent = wait_all_terminal_resending(cluster, resend, 150, "all 200 payments")
    wait_for(lambda: cluster.store.outbox.count() == 0, 60, interval=0.5, what="the outbox")
    # A receipt a killed worker had fetched comes back after the visibility timeout.
    wait_for(lambda: _receipts(cluster) >= ORDERS, 60, interval=0.5, what="every receipt")
    time.sleep(2.0)  # a few more sweeps and redeliveries: nothing runs again
    with cluster.engine.connect() as conn:
        rows = conn.execute(select(effects).order_by(effects.c.id)).all()
        charges = conn.execute(select(provider_charges)).all()
    charged: dict[str, list[Any]] = defaultdict(list)
    for charge in charges:
        charged[charge.order_id].append(charge)
    problems = [p for o in orders for p in problems_of(cluster, o, rows, charged[o])]
    attempts = {o: _attempt(cluster, o) for o in orders}
    retried = sum(1 for a in attempts.values() if a > 1)
    # Charged by an attempt that did not commit: the second attempt found its charge.
    kept = sum(1 for o in orders for c in charged[o] if c.attempt < attempts[o])
    swept = sum(log.count("sent by the sweeper") for log in _logs(cluster))
    doubles = sum(max(0, len(charged[o]) - 1) for o in orders)
    with capsys.disabled():
        print(
            f"\nchaos[payments kill9 x{kills}]: orders={ORDERS} retried={retried} "
            f"charge_kept_across_attempts={kept} followups_swept={swept} "
            f"double_charges={doubles} resent={resent} problems={len(problems)}"
        )
    assert kills >= 3 and retried >= 5
    assert problems == []


def _receipts(cluster: Cluster) -> int:
    """Receipts committed so far, over all orders."""
    query = select(func.count()).where(effects.c.kind.startswith("receipt:"))
    with cluster.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def _attempt(cluster: Cluster, order_id: str) -> int:
    record = cluster.store.get(f"workerapp.pay:{order_id}")
    return 0 if record is None else record.attempt


def _logs(cluster: Cluster) -> list[str]:
    """The logs of every worker the cluster started (killed ones included)."""
    return [w.log() for w in cluster._workers]
