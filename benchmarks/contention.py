"""Claim throughput under contention: 8 processes racing ``LeaseStore.claim`` on PostgreSQL.

Each process (forked, with its own engine) waits on a barrier, then makes
``attempts`` claims over the run ids ``0..K-1`` in its own random order (cycling
when K is small), with a lease long enough that a won run stays held. Reported:
claim calls per second over all processes (won or refused), wins per process,
and the correctness check that every run tried was won exactly once (one row per
run, all at attempt 1, as many rows as wins).
"""

from __future__ import annotations

import multiprocessing
import random
import time
import uuid
from typing import Any

from sqlalchemy import func, select, text

from celery_lease import LeaseStore
from celery_lease.schema import runs

from .common import table

PROCESSES = 8


def _racer(url: str, ids: int, attempts: int, barrier: Any, queue: Any) -> None:
    store = LeaseStore.from_url(url)
    owner = f"racer:{uuid.uuid4().hex}"
    order: list[int] = []
    while len(order) < attempts:
        chunk = list(range(ids))
        random.shuffle(chunk)
        order += chunk
    store.claim("warm-" + owner, owner, task_name="bench", lease_ms=600_000, max_attempts=5)
    barrier.wait(60)
    started = time.perf_counter()
    wins = 0
    for i in order[:attempts]:
        result = store.claim(
            f"race-{i}", owner, task_name="bench", lease_ms=600_000, max_attempts=5
        )
        wins += result.outcome == "claimed"
    queue.put((wins, started, time.perf_counter()))
    store.dispose()


def race(url: str, ids: int, attempts: int) -> dict[str, Any]:
    """One race; claims/s, wins per process, and whether each run was won once."""
    store = LeaseStore.from_url(url)
    store.create_schema()
    with store.engine.begin() as conn:
        conn.execute(text("TRUNCATE celery_lease_runs"))
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(PROCESSES)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(url, ids, attempts, barrier, queue))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [queue.get(timeout=120 + attempts / 10) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()  # by its own handle: only the processes started here
                proc.join(5)
    begin = min(o[1] for o in outcomes)
    end = max(o[2] for o in outcomes)
    with store.engine.connect() as conn:
        won, max_attempt = conn.execute(
            select(func.count(), func.max(runs.c.attempt)).where(runs.c.id.like("race-%"))
        ).one()
    store.dispose()
    wins = sorted((o[0] for o in outcomes), reverse=True)
    return {
        "ids": ids,
        "claims_per_s": PROCESSES * attempts / (end - begin),
        "wins": wins,
        "total_wins": sum(wins),
        "runs": int(won),
        "exactly_once": sum(wins) == won and max_attempt == 1,
    }


def run(pg_url: str, quick: bool, log: Any = print) -> tuple[str, dict[str, Any]]:
    """Races on 1, 10 and 1,000 run ids; a Markdown table and raw figures."""
    attempts = 250 if quick else 1000
    rows = []
    raw: dict[str, Any] = {}
    for ids in (1, 10, 1000):
        r = race(pg_url, ids, attempts)
        log(f"  {ids} ids: {r}")
        raw[str(ids)] = r
        rows.append(
            [
                ids,
                f"{PROCESSES} x {attempts}",
                r["claims_per_s"],
                r["total_wins"],
                " ".join(str(w) for w in r["wins"]),
                "yes" if r["exactly_once"] else "NO",
                r["runs"],
            ]
        )
    headers = [
        "run ids",
        "claim calls",
        "claims/s (all processes)",
        "wins",
        "wins per process",
        "each run won exactly once",
        "runs tried",
    ]
    return table(headers, rows), raw
