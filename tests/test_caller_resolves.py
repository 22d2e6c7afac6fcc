"""Every caller resolves and no run is lost (issue: every caller resolves), with real workers."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for

PG_REDIS = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)


@PG_REDIS
@pytest.mark.timeout(120)
def test_expired_redelivery_does_not_cancel_the_running_run(cluster: Cluster) -> None:
    """A Redis visibility-timeout redelivery of a message whose ``expires`` has passed is
    revoked by Celery on arrival; the run still running under the first delivery goes on
    and succeeds (before: our revoke receiver cancelled it by task id)."""
    timing = {
        "CL_LEASE_SECONDS": "10",
        "CL_HEARTBEAT": "1",
        "CL_ACKS_LATE": "1",
        "CL_VISIBILITY_TIMEOUT": "2",
    }
    w1 = cluster.start("w1", **timing)
    task_id = uuid.uuid4().hex
    cluster.producer.send_task(
        "workerapp.work", args=(6.0,), task_id=task_id, queue=cluster.queue, expires=1.5
    )
    wait_for(lambda: cluster.effects(task_id, "start"), 30, what="the first delivery to start")
    wait_for(
        lambda: "expired" in w1.log().lower() or "revoked" in w1.log().lower(),
        30,
        what="the redelivery to arrive expired",
    )
    wait_for(lambda: cluster.status(task_id) in ("succeeded", "cancelled"), 30, what="the end")
    time.sleep(0.5)
    row = cluster.store.get(task_id)
    assert row is not None and row.status == "succeeded", (row, w1.log()[-3000:])
    assert len(cluster.effects(task_id, "commit")) == 1
