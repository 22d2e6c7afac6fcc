"""What the PgBouncer-safe defaults cost on a direct PostgreSQL connection, side by side.

Usage: ``python -m benchmarks.pg_options [--runs N] [--rounds N]``, with
``CELERY_LEASE_BENCH_PG_URL`` (or ``CELERY_LEASE_TEST_PG_URL``) set to an admin
URL: a throwaway database is created and dropped.

One claim and one completion per run, through ``LeaseStore`` (the hot path's
driver-level statements), in four variants that differ only in how the psycopg
connections are set up: as before the bounds (psycopg's defaults: prepared after
5 runs, no timeouts); the library's default on a direct connection (the pooler
check finds none: prepared after 5 runs, timeouts set once per session); what a
connection behind a pooler gets (``?prepare_threshold=none`` forces it here:
nothing prepared, ``set_config`` of both timeouts sent in the same query as each
statement); and that without the timeouts. Rounds interleave the variants; each
figure is the median over rounds of the mean per run: wall microseconds, and this
process's CPU microseconds (the client side). Server CPU is not separated.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import psycopg

from celery_lease.store import LeaseStore
from tests.helpers import scratch_database

from .common import median, pg_admin_url

VARIANTS: list[tuple[str, str | None, bool]] = [
    ("before: prepared, no timeouts", "5", False),
    ("default, direct: prepared, session timeouts", None, True),
    ("pooler-safe: not prepared, timeouts per query", "none", True),
    ("not prepared, no timeouts", "none", False),
]


def measure(url: str, threshold: str | None, bounded: bool, runs: int) -> tuple[float, float]:
    """Mean wall and client-CPU microseconds of one claim + completion."""
    target = url if threshold is None else f"{url}?prepare_threshold={threshold}"
    kwargs: dict[str, Any] = {"pool_size": 1}
    if not bounded:
        kwargs["connect_args"] = {"cursor_factory": psycopg.Cursor}
    store = LeaseStore.from_url(target, **kwargs)
    for i in range(10):  # warm: connections open, statements past the threshold
        store.claim(
            f"warm-{i}-{uuid.uuid4().hex}", "o", task_name="b", lease_ms=60_000, max_attempts=5
        )
    ids = [uuid.uuid4().hex for _ in range(runs)]
    wall, cpu = time.perf_counter(), time.process_time()
    for run_id in ids:
        claim = store.claim(run_id, "o", task_name="b", lease_ms=60_000, max_attempts=5)
        store.complete(run_id, "o", claim.attempt)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    store.dispose()
    return wall / runs * 1e6, cpu / runs * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_options", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    admin = pg_admin_url()
    if not admin:
        raise SystemExit("set CELERY_LEASE_BENCH_PG_URL (or CELERY_LEASE_TEST_PG_URL)")
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in VARIANTS}
    with scratch_database(admin, prefix="bench_") as url:
        LeaseStore.from_url(url).create_schema()
        for _ in range(args.rounds):
            for name, threshold, bounded in VARIANTS:
                figures[name].append(measure(url, threshold, bounded, args.runs))
    base = median([w for w, _ in figures[VARIANTS[0][0]]])
    print(f"{args.runs} runs x {args.rounds} rounds, claim + complete per run, direct connection")
    print(f"{'variant':48} {'wall us/run':>12} {'vs before':>10} {'client CPU us/run':>18}")
    for name, _, _ in VARIANTS:
        wall = median([w for w, _ in figures[name]])
        cpu = median([c for _, c in figures[name]])
        print(f"{name:48} {wall:12.0f} {wall / base:10.2f} {cpu:18.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
