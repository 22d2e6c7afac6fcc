"""Where a leased task's added CPU goes: the pool child's hot path, piece by piece.

Runs a no-op task through Celery's worker tracer (``build_tracer``, not
eager: the same code a prefork pool child runs for a delivery, message
serialization included) in this process, plain vs ``LeasedTask``, and
reports the CPU time per task (user and sys, from ``getrusage``, all threads
of this process: the heartbeat and watchdog threads count). Then each piece
of the lease's hot path is timed alone, with the same request pushed, so the
added CPU can be accounted for cause by cause::

    python -m benchmarks.hotpath [--tasks N] [--rounds N] [--db sqlite|pg|both]
    python -m benchmarks.hotpath --profile   # cProfile of the leased run, top 40

The database server's own CPU is not in these figures (``throughput.py``
counts it); SQLite has no server.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import shutil
import socket
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer

from celery_lease import LeasedTask, schema
from celery_lease.lease.lease import Lease, Standalone, bind_current
from celery_lease.lease.watchdog import process_watchdog
from celery_lease.owner import new_owner
from celery_lease.run import runids
from celery_lease.run.delivery import Delivery
from celery_lease.run.task import task_hooks
from celery_lease.runtime import runtime_for, shutting_down, worker_id

from .common import median, table


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def make(url: str) -> tuple[Celery, Any, Any]:
    """An app with a plain and a leased no-op task on the lease database ``url``."""
    app = Celery("hotpath", broker="memory://")
    app.conf.update(lease_database_url=url, task_ignore_result=True)

    @app.task(base=LeasedTask, name="hotpath.leased", shared=False)  # type: ignore[untyped-decorator]
    def leased(i: int) -> None:
        return None

    @app.task(name="hotpath.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(i: int) -> None:
        return None

    app.finalize()
    runtime_for(app, leased.lease_config()).store.create_schema()
    return app, plain, leased


def request_for(app: Celery, task: Any, i: int) -> tuple[str, dict[str, Any]]:
    """A worker-like request dict for one delivery of ``task`` (message headers and all)."""
    task_id = uuid.uuid4().hex
    message = app.amqp.as_task_v2(task_id, task.name, args=(i,), kwargs={})
    request = dict(message.headers)
    request.update(
        {
            "hostname": f"bench@{socket.gethostname()}",
            "delivery_info": {
                "exchange": "",
                "routing_key": "celery",
                "priority": 0,
                "redelivered": False,
            },
            "reply_to": message.properties.get("reply_to"),
            "correlation_id": task_id,
            "is_eager": False,
            "args": (i,),
            "kwargs": {},
        }
    )
    return task_id, request


def drain(app: Celery, task: Any, n: int) -> tuple[float, float]:
    """Run ``n`` deliveries through the worker tracer; (user, sys) CPU ms per task."""
    tracer = build_tracer(task.name, task, app=app, hostname="bench@host", eager=False)
    deliveries = [request_for(app, task, i) for i in range(n)]
    u0, s0 = _cpu()
    for task_id, request in deliveries:
        result = tracer(task_id, request["args"], request["kwargs"], request)
        if result.info is not None and result.info.state != "SUCCESS":
            raise RuntimeError(f"{task.name} ended {result.info.state}: {result.retval!r}")
    u1, s1 = _cpu()
    return (u1 - u0) * 1000 / n, (s1 - s0) * 1000 / n


def per_task(url: str, n: int, rounds: int) -> dict[str, Any]:
    """Plain vs leased CPU per task through the tracer, alternating, medians."""
    app, plain, leased = make(url)
    drain(app, leased, 200)  # warm: engine, statement caches, threads
    drain(app, plain, 200)
    got: dict[str, list[tuple[float, float]]] = {"plain": [], "leased": []}
    for _ in range(rounds):
        for name, task in (("plain", plain), ("leased", leased)):
            got[name].append(drain(app, task, n))
    out: dict[str, Any] = {}
    for name in got:
        out[name] = (median([u for u, _ in got[name]]), median([s for _, s in got[name]]))
    out["pieces"] = pieces(app, leased, n)
    _stop(app)
    return out


def _timeit(fn: Callable[[], Any], n: int) -> float:
    """CPU µs per call of ``fn`` (user + sys), over ``n`` calls after 20 warm-up calls."""
    for _ in range(20):
        fn()
    u0, s0 = _cpu()
    for _ in range(n):
        fn()
    u1, s1 = _cpu()
    return ((u1 - u0) + (s1 - s0)) * 1e6 / n


def pieces(app: Celery, task: Any, n: int) -> list[tuple[str, float]]:
    """CPU µs per call of each piece of the leased hot path, each timed alone."""
    config = task.lease_config()
    runtime = runtime_for(app, config)
    store = runtime.store
    task_id, request = request_for(app, task, 1)
    request = {**request, "called_directly": False}
    task.push_request(**request)
    out: list[tuple[str, float]] = []
    try:
        args, kwargs = (1,), {}
        out.append(("lease_config() (cached)", _timeit(task.lease_config, n)))
        out.append(
            (
                "run_id_of()",
                _timeit(lambda: runids.run_id_of(task.name, config, task.request, args, kwargs), n),
            )
        )
        out.append(("shutting_down()", _timeit(lambda: shutting_down(app), n)))
        out.append(("runtime_for()", _timeit(lambda: runtime_for(app, config), n)))
        out.append(
            (
                "new_owner()",
                _timeit(lambda: new_owner(request["hostname"], worker_id(app)), n),
            )
        )
        hooks = task_hooks(task, config)
        out.append(("task_hooks() (cached)", _timeit(lambda: task_hooks(task, config), n)))
        out.append(("Delivery()", _timeit(lambda: Delivery(task, args, kwargs, config, hooks), n)))
        delivery = Delivery(task, args, kwargs, config, hooks)
        out.append(("payload() (message + serialize)", _timeit(delivery.stored_message, n)))
        payload = delivery.stored_message()
        ids = iter(range(10**9))

        def claim_complete() -> None:
            run_id = f"piece-{uuid.uuid4().hex}-{next(ids)}"
            owner = new_owner("h", "w")
            claim = store.claim(
                run_id,
                owner,
                task_name=task.name,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                task_id=task_id,
                **payload,
            )
            store.complete(run_id, owner, claim.attempt)

        out.append(("claim + complete (store, with payload)", _timeit(claim_complete, n)))

        def claim_complete_bare() -> None:
            run_id = f"piece-{uuid.uuid4().hex}-{next(ids)}"
            owner = "o"
            claim = store.claim(
                run_id, owner, task_name=task.name, lease_ms=30000, max_attempts=5, task_id=task_id
            )
            store.complete(run_id, owner, claim.attempt)

        out.append(("claim + complete (store, no payload)", _timeit(claim_complete_bare, n)))
        out.append(
            (
                "uuid4 run id + owner strings (harness overhead)",
                _timeit(lambda: (f"piece-{uuid.uuid4().hex}", new_owner("h", "w")), n),
            )
        )
        out.append(
            (
                "emit('claimed') below log level",
                _timeit(
                    lambda: runtime.events.emit(
                        "claimed", "r", "run %s: claimed attempt %d", "r", 1, attempt=1
                    ),
                    n,
                ),
            )
        )

        def new_lease() -> Lease:
            return Lease(
                Standalone(store, events=runtime.events),
                "r",
                "o",
                1,
                lease_seconds=config.lease_seconds,
                heartbeat_interval=config.heartbeat_interval,
                started_at=time.monotonic(),
                interrupt=config.interrupt,
                max_attempts=5,
            )

        def lease_cycle() -> None:
            lease = new_lease()
            runtime.heartbeat.register(lease)
            with bind_current(lease):
                lease.run_interruptible(lambda: None)
                runtime.heartbeat.unregister(lease)

        out.append(
            (
                "Lease() + register + contextvar + run_interruptible (watchdog)",
                _timeit(lease_cycle, n),
            )
        )

        out.append(("  of which Lease()", _timeit(new_lease, n)))
        lease = Lease(
            Standalone(store),
            "r",
            "o",
            1,
            lease_seconds=config.lease_seconds,
            heartbeat_interval=config.heartbeat_interval,
            interrupt=config.interrupt,
        )

        def reg() -> None:
            runtime.heartbeat.register(lease)
            runtime.heartbeat.unregister(lease)

        out.append(("  of which heartbeat register + unregister", _timeit(reg, n)))
        watchdog = process_watchdog()

        def watch() -> None:
            watchdog.watch(lease)
            watchdog.unwatch(lease)

        out.append(("  of which watchdog watch + unwatch", _timeit(watch, n)))
        if store.engine.dialect.name == "sqlite":
            out.append(
                (
                    "floor: the sqlite3 module alone, INSERT + guarded UPDATE, PK-only table",
                    _sqlite_floor(n),
                )
            )
        # Last, as it changes the table: what the runs table's secondary indexes (sweeper,
        # per-key concurrency, retention, the web view's pages) cost the two statements.
        for index in schema.runs.indexes:
            index.drop(store.engine)
        out.append(
            (
                "claim + complete (store, no payload), runs without its secondary indexes",
                _timeit(claim_complete_bare, n),
            )
        )
    finally:
        task.pop_request()
    return out


def _sqlite_floor(n: int) -> float:
    """CPU µs per task of the least two durable SQLite writes a leased task could make:
    Python's ``sqlite3`` alone (no SQLAlchemy, no celery-lease), a fresh WAL file with the
    store's settings (``synchronous = NORMAL``), a table with its primary key only, each
    statement its own transaction: an ``INSERT`` of the claim and the guarded ``UPDATE`` of
    the completion. No design that claims before the body and completes after it can go
    below this."""
    folder = tempfile.mkdtemp(prefix="celery-lease-floor-")
    conn = sqlite3.connect(str(Path(folder) / "floor.sqlite3"), isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(
            "CREATE TABLE runs (id TEXT PRIMARY KEY, status TEXT, lease_owner TEXT, "
            "attempt INTEGER, lease_expires_at INTEGER)"
        )
        ids = iter(range(10**9))

        def claim_complete() -> None:
            run_id = f"floor-{next(ids)}"
            conn.execute("INSERT INTO runs VALUES (?, 'running', 'o', 1, 0)", (run_id,))
            conn.execute(
                "UPDATE runs SET status = 'succeeded', lease_owner = NULL WHERE id = ? "
                "AND lease_owner = 'o' AND attempt = 1 AND status = 'running'",
                (run_id,),
            )

        return _timeit(claim_complete, n)
    finally:
        conn.close()
        shutil.rmtree(folder, ignore_errors=True)


def _stop(app: Celery) -> None:
    for runtime in app.__dict__.get("_celery_lease_runtimes", {}).values():
        runtime.heartbeat.stop(timeout=2.0)
        runtime.store.dispose()


def profile(url: str, n: int) -> None:
    """cProfile of ``n`` leased deliveries through the tracer (top 40 by own time)."""
    app, _plain, leased = make(url)
    drain(app, leased, 200)
    profiler = cProfile.Profile()
    profiler.enable()
    drain(app, leased, n)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
    _stop(app)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.hotpath``: the per-piece CPU accounting, printed."""
    from tests.helpers import scratch_database

    from .common import pg_admin_url

    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db", choices=("sqlite", "pg", "both"), default="both")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="celery-lease-hotpath-"))
    try:
        urls: list[tuple[str, Any]] = []
        if args.db in ("sqlite", "both"):
            urls.append(("SQLite", lambda: _sqlite(work)))
        admin = pg_admin_url()
        if args.db in ("pg", "both") and admin:
            urls.append(("PostgreSQL", lambda: scratch_database(admin, "clhot_")))
        for label, make_url in urls:
            with make_url() as url:
                if args.profile:
                    print(f"## {label}")
                    profile(url, args.tasks)
                    continue
                got = per_task(url, args.tasks, args.rounds)
                (pu, ps), (lu, ls) = got["plain"], got["leased"]
                print(f"## {label}: {args.tasks} tasks x {args.rounds} rounds")
                print(
                    table(
                        ["task", "user µs / task", "sys µs / task", "total µs / task"],
                        [
                            [
                                "plain",
                                f"{pu * 1000:.0f}",
                                f"{ps * 1000:.0f}",
                                f"{(pu + ps) * 1000:.0f}",
                            ],
                            [
                                "leased",
                                f"{lu * 1000:.0f}",
                                f"{ls * 1000:.0f}",
                                f"{(lu + ls) * 1000:.0f}",
                            ],
                            [
                                "added",
                                f"{(lu - pu) * 1000:.0f}",
                                f"{(ls - ps) * 1000:.0f}",
                                f"{(lu + ls - pu - ps) * 1000:.0f}",
                            ],
                        ],
                    )
                )
                print()
                print(
                    table(["piece", "CPU µs / call"], [[k, f"{v:.1f}"] for k, v in got["pieces"]])
                )
                print()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


class _sqlite:
    def __init__(self, work: Path) -> None:
        self.url = f"sqlite:///{work / f'{uuid.uuid4().hex}.sqlite3'}"

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
