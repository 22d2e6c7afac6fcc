"""Chaos: resumable runs under kill -9 at random moments (PostgreSQL + Redis, acks_late).

100 runs of ``workerapp.resumable`` (half with plain checkpoints, half fenced) over
two workers while a driver kill -9s a random worker every 1-2.5 s and starts a fresh
one. Asserted per run, from the effects each attempt recorded: it succeeded with
every item done; checkpoints never go backwards (each attempt resumes at or past
every checkpoint an earlier attempt saw return, and at most one checkpoint past);
the checkpoint an attempt resumes from was saved by the latest attempt that saved
any (no stale owner's checkpoint landed); fenced items are written exactly once.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import select

from tests.cluster import SETUP_IDS, SETUPS, Cluster
from tests.helpers import Worker, wait_for
from tests.workerapp import effects

pytestmark = pytest.mark.chaos
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)

TIMING = {
    "CL_LEASE_SECONDS": "1.5",
    "CL_HEARTBEAT": "0.3",
    "CL_ACKS_LATE": "1",
    "CL_VISIBILITY_TIMEOUT": "4",
}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 1.0, "lease_max_attempts": 30}
SWEEP = {"lease_sweep_interval": 0.5, **CONF}
ITEMS, EVERY, STEP = 40, 5, 0.04


def kill_while_running(
    cluster: Cluster, workers: list[Worker], rng: random.Random, run_ids: list[str]
) -> int:
    """kill -9 a random worker every 1-2.5 s (a fresh one takes its place) while runs are
    unfinished, at most 12 times; returns the number of kills."""
    kills = 0
    while kills < 12 and not all_done(cluster, run_ids):
        time.sleep(rng.uniform(1.0, 2.5))
        victim = rng.randrange(len(workers))
        workers[victim].kill9()
        kills += 1
        workers[victim] = cluster.start(f"w{victim}-r{kills}", conf=CONF, concurrency=4, **TIMING)
    return kills


def all_done(cluster: Cluster, run_ids: list[str]) -> bool:
    return all(cluster.status(r) in ("succeeded", "failed", "cancelled") for r in run_ids)


def problems_of(run_id: str, fenced: bool, rows: list[Any]) -> list[str]:
    """What is wrong with one run's recorded history (empty: nothing)."""
    found: list[str] = []
    items = [int(r.kind.split(":")[1]) for r in rows if r.kind.startswith("item:")]
    if sorted(set(items)) != list(range(ITEMS)):
        found.append(f"{run_id}: items missing {sorted(set(range(ITEMS)) - set(items))}")
    if fenced and len(items) != ITEMS:
        found.append(f"{run_id}: {len(items) - ITEMS} duplicate fenced items")
    saw_return: dict[int, int] = defaultdict(int)  # attempt -> highest checkpoint returned
    previous = 0
    for r in rows:
        kind, _, rest = r.kind.partition(":")
        if kind == "ckpt":
            saw_return[r.attempt] = max(saw_return[r.attempt], int(rest))
        elif kind == "item" and fenced:
            saw_return[r.attempt] = max(saw_return[r.attempt], int(rest) + 1)
        elif kind == "resume":
            at, saved_by = (int(x) for x in rest.split(":"))
            earlier = [a for a, n in saw_return.items() if a < r.attempt and n]
            floor = max((saw_return[a] for a in earlier), default=0)
            if at < previous or at < floor:
                found.append(f"{run_id}: attempt {r.attempt} resumed at {at}, behind {floor}")
            if at > floor + (0 if fenced else EVERY):
                found.append(f"{run_id}: attempt {r.attempt} resumed at {at}, past {floor}")
            if saved_by >= r.attempt or (earlier and saved_by < max(earlier)):
                found.append(f"{run_id}: attempt {r.attempt} read attempt {saved_by}'s checkpoint")
            previous = at
    return found


@ON_PG
@pytest.mark.timeout(240)
def test_kill9_random_moments_during_100_resumable_runs(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 resumable runs under repeated kill -9: no checkpoint goes backwards, no stale
    checkpoint lands, 0 duplicate fenced items, every run succeeds."""
    rng = random.Random(20261204)
    workers = [cluster.start(f"w{i}", conf=CONF, concurrency=4, **TIMING) for i in range(2)]
    cluster.start_beat(SWEEP)
    fenced = {
        cluster.send("workerapp.resumable", ITEMS, EVERY, STEP, mode): mode == "fenced"
        for mode in ["plain", "fenced"] * 50
    }
    run_ids = list(fenced)
    kills = kill_while_running(cluster, workers, rng, run_ids)
    wait_for(lambda: all_done(cluster, run_ids), 150, interval=1.0, what="all 100 runs")
    with cluster.engine.connect() as conn:
        rows = conn.execute(select(effects).order_by(effects.c.id)).all()
    by_run: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        by_run[row.run_id].append(row)
    problems = [p for r in run_ids for p in problems_of(r, fenced[r], by_run[r])]
    problems += [f"{r}: {cluster.status(r)}" for r in run_ids if cluster.status(r) != "succeeded"]
    resumed = sum(1 for r in run_ids if sum(e.kind.startswith("resume:") for e in by_run[r]) > 1)
    duplicates = sum(
        len([e for e in by_run[r] if e.kind.startswith("item:")]) - ITEMS
        for r in run_ids
        if fenced[r]
    )
    with capsys.disabled():
        print(
            f"\nchaos[checkpoints kill9 x{kills}]: runs=100 resumed={resumed} "
            f"duplicate_fenced_items={duplicates} problems={len(problems)}"
        )
    assert kills >= 3 and resumed >= 5
    assert problems == []
