"""What checkpoints and progress cost: one ``checkpoint()`` call, and nothing otherwise.

- One ``Lease.checkpoint(state)`` call on a held lease (a small state and a 4 KiB
  one): statements counted at the driver, and the median wall time per call in µs
  over interleaved rounds.
- A ``LeasedTask`` that never checkpoints, run in-process through Celery's tracer,
  with and without a ``progress()`` call in its body: statements per task.
- One ``Heartbeat`` holding 100 leases, ticked with ``beat_once()``, with and
  without every lease reporting ``progress()`` before each tick: statements per tick.

On a SQLite file and on PostgreSQL (a scratch database on the admin URL of
``CELERY_LEASE_BENCH_PG_URL``, or ``CELERY_LEASE_TEST_PG_URL``)::

    python -m benchmarks.checkpoint [--calls N] [--rounds N] [--write]

``--write`` puts the section into ``docs/benchmarks.md`` (``run_all`` keeps it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lease import LeasedTask, LeaseStore
from celery_lease.lease.lease import Lease, Standalone
from celery_lease.runtime import store_for
from tests.helpers import scratch_database

from .common import (
    REPO,
    check_loopback,
    marked_section,
    median,
    pg_admin_url,
    pg_settings,
    table,
)
from .sql import Counter, held_leases, runtime_heartbeat_stop

DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- checkpoint:begin -->", "<!-- checkpoint:end -->"

#: The states timed: a cursor, and a 4 KiB one (well under the 64 KiB bound).
STATES: dict[str, Any] = {
    "small (40 B)": {"next": 123456, "batch": "2026-12-04", "n": 0},
    "4 KiB": {"next": 123456, "seen": "x" * 4070},
}


def checkpoint_calls(url: str, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """Statements and median µs per ``checkpoint()`` call, per state."""
    store = LeaseStore.from_url(url)
    store.create_schema()
    owner = f"bench:{uuid.uuid4().hex}"
    run_id = f"ckpt-{uuid.uuid4().hex[:8]}"
    claim = store.claim(run_id, owner, task_name="bench", lease_ms=3_600_000, max_attempts=5)
    lease = Lease(
        Standalone(store), run_id, owner, claim.attempt, lease_seconds=3600, heartbeat_interval=1200
    )
    counter = Counter(*store.engines)
    for _ in range(50):
        lease.checkpoint(STATES["small (40 B)"])
    times: dict[str, list[float]] = {name: [] for name in STATES}
    statements: dict[str, float] = {}
    for _ in range(rounds):
        for name, state in STATES.items():
            counter.reset()
            started = time.perf_counter()
            for _ in range(calls):
                lease.checkpoint(state)
            times[name].append((time.perf_counter() - started) / calls * 1e6)
            statements[name] = counter.statements / calls
    counter.close()
    store.dispose()
    return {name: {"us": median(times[name]), "statements": statements[name]} for name in STATES}


def per_task(url: str, n: int) -> dict[str, float]:
    """Statements per uncontended task that never checkpoints, with and without progress()."""
    app = Celery("ckptbench", broker="memory://")
    app.conf.update(lease_database_url=url, task_ignore_result=True)

    @app.task(base=LeasedTask, bind=True, name="ckptbench.quiet", shared=False)  # type: ignore[untyped-decorator]
    def quiet(self: LeasedTask, i: int) -> None:
        return None

    @app.task(base=LeasedTask, bind=True, name="ckptbench.reporting", shared=False)  # type: ignore[untyped-decorator]
    def reporting(self: LeasedTask, i: int) -> None:
        self.lease.progress(i, n, "rows")

    store = store_for(app)
    store.create_schema()
    counter = Counter(*store.engines)
    out: dict[str, float] = {}
    for name, task in (("without progress()", quiet), ("with progress()", reporting)):
        for i in range(20):
            task.apply(args=(i,))
        counter.reset()
        for i in range(n):
            task.apply(args=(i,))
        out[name] = counter.statements / n
    counter.close()
    runtime_heartbeat_stop(app)
    store.dispose()
    return out


def per_tick(url: str, leases: int, ticks: int) -> dict[str, float]:
    """Statements and median ms per heartbeat tick, with and without progress to write."""
    store = LeaseStore.from_url(url)
    store.create_schema()
    counter = Counter(*store.engines)
    out: dict[str, float] = {}
    with held_leases(store, leases, 0) as heartbeat:
        held = heartbeat.held()
        heartbeat.beat_once()
        for name, report in (("without progress()", False), ("with progress()", True)):
            counter.reset()
            latencies = []
            for tick in range(ticks):
                if report:
                    for lease in held:
                        lease.progress(tick, ticks, "rows")
                started = time.perf_counter()
                heartbeat.beat_once()
                latencies.append((time.perf_counter() - started) * 1000)
            out[name] = counter.statements / ticks
            out[f"{name} ms"] = median(latencies)
    counter.close()
    store.dispose()
    return out


def measure(name: str, url: str, calls: int, rounds: int, log: Any = print) -> dict[str, Any]:
    calls_ = checkpoint_calls(url, calls, rounds)
    log(f"  checkpoint() {name}: {calls_}")
    task = per_task(url, max(100, calls // 2))
    log(f"  per task {name}: {task}")
    tick = per_tick(url, 100, 20)
    log(f"  per tick {name}: {tick}")
    return {"name": name, "calls": calls_, "task": task, "tick": tick}


def report(results: list[dict[str, Any]]) -> str:
    """Two Markdown tables: the checkpoint() call, and what a task that never calls it pays."""
    call_rows = [
        [r["name"], state, f"{v['statements']:.1f}", f"{v['us']:.0f}"]
        for r in results
        for state, v in r["calls"].items()
    ]
    cost_rows = [
        [
            r["name"],
            mode,
            f"{r['task'][mode]:.1f}",
            f"{r['tick'][mode]:.1f}",
            f"{r['tick'][f'{mode} ms']:.2f}",
        ]
        for r in results
        for mode in ("without progress()", "with progress()")
    ]
    return (
        table(
            ["lease database", "state", "SQL statements / call", "µs / call (median)"],
            call_rows,
        )
        + "\n\n"
        + table(
            [
                "lease database",
                "body (never checkpoints)",
                "SQL statements / task",
                "SQL statements / tick (100 leases)",
                "tick ms (median)",
            ],
            cost_rows,
        )
    )


def section(body: str, command: str, settings: str) -> str:
    return "\n".join(
        [
            BEGIN,
            "## Appendix: checkpoints and progress",
            "",
            "```bash",
            command,
            "```",
            "",
            "One `self.lease.checkpoint(state)` on a held lease, statements counted at the "
            "driver, wall time per call (median of interleaved rounds); then what a task "
            "that never checkpoints pays, with and without `progress()` (the renewal "
            "writes it; in the tick rows every one of the 100 leases reported before every "
            f"tick). PostgreSQL: {settings}."
            + (
                " With `fsync = off` no commit waits for the disk: the PostgreSQL call time "
                "is a rough figure, to be measured again on a durable server."
                if "fsync = off" in settings
                else ""
            ),
            "",
            body,
            END,
        ]
    )


def write_section(text_: str) -> None:
    """Put the section into ``docs/benchmarks.md`` (replacing an older one)."""
    page = DOC.read_text()
    old = marked_section(page, BEGIN, END)
    if old:
        page = page.replace(old, text_)
    else:
        anchor = "<!-- retention:begin -->"
        if anchor in page:
            page = page.replace(anchor, text_ + "\n\n" + anchor, 1)
        else:
            page = page.rstrip() + "\n\n" + text_ + "\n"
    DOC.write_text(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__)
    parser.add_argument("--calls", type=int, default=1000, help="checkpoint() calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
        results.append(measure("SQLite", url, args.calls, args.rounds))
    settings = "not used"
    admin = pg_admin_url()
    if admin:
        check_loopback(admin)
        with scratch_database(admin, prefix="clbench_") as url:
            settings = pg_settings(url)
            results.append(measure("PostgreSQL", url, args.calls, args.rounds))
    body = report(results)
    print(body, flush=True)
    if args.write:
        command = "python -m benchmarks.checkpoint " + " ".join(argv or sys.argv[1:])
        write_section(section(body, command.strip(), settings))
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        os.environ.setdefault("PYTHONHASHSEED", "0")
        raise SystemExit(main())
