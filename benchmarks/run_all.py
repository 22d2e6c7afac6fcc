"""Run every benchmark in one go, print the tables and write ``docs/benchmarks.md``.

Usage: ``python -m benchmarks.run_all [--quick] [--rounds N] [--tasks N] [--no-write]``.
PostgreSQL and Redis come from ``CELERY_LEASE_BENCH_PG_URL`` (an admin URL: a
throwaway database is created and dropped) and ``CELERY_LEASE_BENCH_REDIS_URL``;
``CELERY_LEASE_BENCH_PGBOUNCER_URL`` names a PgBouncer in transaction mode in front
of that PostgreSQL (wildcard database entry) for the PgBouncer row
(falling back to the test suite's ``CELERY_LEASE_TEST_*`` variables); without
them the sections that need them are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import celery
import sqlalchemy
from sqlalchemy import create_engine, text

from tests.helpers import scratch_database

from . import checkpoint, contention, retention, sql, takeover, throughput, web
from .common import (
    REPO,
    amqp_url,
    check_loopback,
    marked_section,
    pg_admin_url,
    pg_settings,
    pgbouncer_url,
    redis_url,
)

DOC = REPO / "docs" / "benchmarks.md"


def _pg_version(url: str) -> str:
    engine = create_engine(url)
    with engine.connect() as conn:
        version = str(conn.execute(text("SHOW server_version")).scalar())
    engine.dispose()
    return version.split()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small N, one round, one trial")
    parser.add_argument("--rounds", type=int, help="throughput rounds (default 5, quick 1)")
    parser.add_argument("--tasks", type=int, help="tasks per throughput run (default 2000)")
    parser.add_argument("--trials", type=int, help="takeover trials (default 3, quick 1)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    tasks = args.tasks or (300 if args.quick else 2000)
    trials = args.trials or (1 if args.quick else 3)
    command = " ".join(["python -m benchmarks.run_all", *(argv or sys.argv[1:])])

    admin, redis, bouncer, amqp = pg_admin_url(), redis_url(), pgbouncer_url(), amqp_url()
    for url in (admin, redis, bouncer, amqp):
        if url:
            check_loopback(url)
    work = Path(tempfile.mkdtemp(prefix="celery-lease-bench-"))
    sections: dict[str, str] = {}
    began = time.monotonic()
    try:
        with scratch_database(admin, "clbench_") if admin else contextlib.nullcontext() as pg_url:
            print(f"throughput: {tasks} tasks x {rounds} round(s)", flush=True)
            sections["throughput"], _ = throughput.run(
                tasks, rounds, work, redis, pg_url, bouncer_url=bouncer, amqp_url=amqp
            )
            print(sections["throughput"], flush=True)
            print("SQL per task and per heartbeat tick", flush=True)
            sections["sql_task"], sections["sql_tick"], _ = sql.run(pg_url, args.quick, work)
            print(sections["sql_task"] + "\n\n" + sections["sql_tick"], flush=True)
            print(f"takeover: {trials} trial(s)", flush=True)
            sections["takeover"], _ = takeover.run(trials, work)
            print(sections["takeover"], flush=True)
            if pg_url:
                print("claim contention on PostgreSQL", flush=True)
                sections["contention"], _ = contention.run(pg_url, args.quick)
                print(sections["contention"], flush=True)
            versions = {
                "python": platform.python_version(),
                "celery": celery.__version__,
                "sqlalchemy": sqlalchemy.__version__,
                "postgresql": _pg_version(pg_url) if pg_url else "not used",
            }
            settings = pg_settings(pg_url) if pg_url else "not used"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    minutes = (time.monotonic() - began) / 60
    if not args.no_write:
        page = render(command, sections, versions, tasks, rounds, trials, minutes, settings)
        DOC.write_text(page)
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


def render(
    command: str,
    sections: dict[str, str],
    versions: dict[str, str],
    tasks: int,
    rounds: int,
    trials: int,
    minutes: float,
    settings: str = "not recorded",
) -> str:
    """The page: how it was made, the tables, and what limits the figures."""
    from . import flow, worker_cpu  # their sections are kept as they are

    today = datetime.date.today().isoformat()
    env = ", ".join(f"{k} {v}" for k, v in versions.items())
    page = DOC.read_text() if DOC.exists() else ""
    parts: list[Any] = [
        "# Benchmarks",
        "",
        "What a lease costs, measured with the scripts in `benchmarks/` (see "
        "`benchmarks/README.md`) on one shared 2-core machine, PostgreSQL and Redis on "
        "loopback:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Run on {today}, {os.cpu_count()} CPUs, {env}; {minutes:.0f} minutes. Other "
        "test suites shared the machine, so figures are medians of interleaved rounds: "
        "compare rows within one table, not with another machine. PostgreSQL: "
        f"{settings}. SQLite: `journal_mode = WAL`, `synchronous = NORMAL`.",
        "",
        "## SQL per task and per heartbeat tick",
        "",
        "Statements counted at the database driver, on the calling thread. Per task: a "
        "`LeasedTask` run in-process through Celery's tracer; *added* is its time minus a "
        "plain task's (the database server's CPU is not in it).",
        "",
        sections.get("sql_task", "(not run)"),
        "",
        "Per tick: one `Heartbeat` holding N leases, ticked with `beat_once()`.",
        "",
        sections.get("sql_tick", "(not run)"),
        "",
        "## Takeover latency",
        "",
        f"SQLite lease file, `filesystem://` broker, `lease_seconds = "
        f"{takeover.LEASE_SECONDS:.0f}`, heartbeat every {takeover.HEARTBEAT:.0f} s, beat "
        f"sweeping every {takeover.SWEEP:.0f} s, two workers. Worker A holding a run gets "
        "`kill -9` or `SIGQUIT`; the figure is the time from the signal to attempt 2 "
        f"starting on worker B ({trials} trial(s)).",
        "",
        sections.get("takeover", "(not run)"),
        "",
        ANALYSIS,
        "",
        "## Appendix: throughput of a trivial task",
        "",
        f"{tasks} no-op messages enqueued, then one `celery worker -P prefork -c 2` timed "
        "from the first task's start to the last one's end; set-ups shuffled in each of "
        f"{rounds} round(s). *End-to-end ratio* adds the publishing time (celery-once "
        "locks there). *CPU ms / task* counts the worker and the local database and "
        "broker servers. Targets: 0.9 of plain Celery on SQLite, 0.8 on PostgreSQL.",
        "",
        sections.get("throughput", "(not run)"),
        "",
        "## Appendix: claims under contention (PostgreSQL)",
        "",
        f"{contention.PROCESSES} processes call `LeaseStore.claim` at once on run ids "
        "drawn from a set of 1, 10 or 1,000; a won run stays held.",
        "",
        sections.get("contention", "(not run)"),
        "",
        # Measured apart (python -m benchmarks.checkpoint): kept as it is.
        marked_section(page, checkpoint.BEGIN, checkpoint.END),
        "",
        # Measured apart (python -m benchmarks.retention, a million rows): kept as it is.
        marked_section(page, retention.BEGIN, retention.END),
        "",
        # Measured apart (python -m benchmarks.web, a million rows): kept as it is.
        marked_section(page, web.BEGIN, web.END),
        "",
        # The CPU accounting (benchmarks.worker_cpu, benchmarks.hotpath): kept as it is.
        marked_section(page, worker_cpu.BEGIN, worker_cpu.END),
        "",
        # Flow control (python -m benchmarks.flow): kept as it is.
        marked_section(page, flow.BEGIN, flow.END),
    ]
    return "\n".join(str(p) for p in parts).rstrip() + "\n"


ANALYSIS = """## What limits the figures

- **Two durable writes per task.** A `LeasedTask` adds the claim and the guarded
  completion, each its own commit, and a little Python. On a no-op task that is
  0.3 to 0.7 ms of CPU in the worker (more with PostgreSQL, whose server also
  spends CPU and waits for the WAL flush on each commit). With a body that does
  real work the share falls: a task costing *t* ms of CPU runs at least at
  *t* / (*t* + *a*) of plain Celery, *a* being the added CPU.
- **celery-once does less in the worker**: it takes its Redis lock at enqueue
  and deletes one key after the body. It does not fence a paused or killed
  worker, which is what the two writes are for.
- **The embedded default's ratio is a share of a fast plain worker.** Since
  `celery_lease.contrib.fs_transport` lists the folder once per batch, plain
  Celery drains about 3,800 no-op tasks/s on `filesystem://` at about 0.35 ms
  of CPU each (on 2026-12-03, before that change, 705/s: the broker hid the
  lease, hence the 0.93 then). The lease adds about 0.3 ms, half of it the two
  SQLite writes with their index entries; 0.9 of plain would need it to add
  under 40 µs. A side lock between the pool processes, instead of SQLite's busy
  handler (which sleeps at least 1 ms when two writers meet), gained about 8%
  and was left out: nothing but the database coordinates workers.
- **Heartbeat:** one statement per tick whatever the number of leases; at
  1,000 leases it still takes milliseconds.
- **Takeover after kill -9** is lease expiry (up to `lease_seconds` after the
  last renewal) plus up to one sweep interval plus the broker's poll. After a
  cold shutdown the hand-back makes it about one broker poll.
- **Claims under contention** are bound by the client processes, not by row
  locks, and each run is won exactly once.
"""


if __name__ == "__main__":
    raise SystemExit(main())
