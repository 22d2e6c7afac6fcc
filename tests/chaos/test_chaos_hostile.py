"""Chaos: one run hands its lease hostile values while others run (issue 28).

A threads worker (PostgreSQL + Redis) runs 16 innocent runs (progress every 50 ms, a
checkpoint every 10 steps, one fenced commit) beside runs that hand progress() and
checkpoint() every hostile value (NUL, lone surrogates, huge, 5,000 deep, 10**400), once
checked at the call and once with the check bypassed so the database itself refuses
them. Asserted: 0 leases lost by the others, 0 double commits, every run succeeds.
"""

from __future__ import annotations

import pytest

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import wait_for
from tests.workerapp import hostile_values

pytestmark = pytest.mark.chaos
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
TIMING = {"CL_LEASE_SECONDS": "1.5", "CL_HEARTBEAT": "0.3"}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 0.5}


@ON_PG
@pytest.mark.timeout(180)
@pytest.mark.parametrize("unchecked", [False, True], ids=["checked", "db-refuses"])
def test_hostile_values_cost_the_other_runs_nothing(
    cluster: Cluster, unchecked: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hostile values from 4 runs beside 16 innocent ones: 0 leases lost, 0 double commits."""
    env = {**TIMING, **({"CL_UNCHECKED_PROGRESS": "1"} if unchecked else {})}
    cluster.start("w1", pool="threads", concurrency=20, conf=CONF, **env)
    kinds = sorted(hostile_values())
    hostile = [cluster.send("hostile", kinds, 3.0, True) for _ in range(4)]
    innocent = [cluster.send("reporter", 3.0) for _ in range(16)]
    every = [*hostile, *innocent]
    wait_for(
        lambda: all(cluster.status(r) in ("succeeded", "failed") for r in every),
        120,
        interval=0.5,
        what="every run",
    )
    lost = [r for r in every if [e.attempt for e in cluster.effects(r, "start")] != [1]]
    doubles = [r for r in every if len(cluster.effects(r, "commit")) != 1]
    failed = [r for r in every if cluster.status(r) != "succeeded"]
    refused = sum(len(cluster.effects(r)) for r in hostile) - 2 * len(hostile)
    with capsys.disabled():
        print(
            f"\nchaos[hostile {'db-refuses' if unchecked else 'checked'}]: runs={len(every)} "
            f"values_handed={refused} leases_lost={len(lost)} double_commits={len(doubles)} "
            f"failed={len(failed)}"
        )
    assert lost == [] and doubles == [] and failed == []
