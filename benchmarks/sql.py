"""SQL per uncontended task and per heartbeat tick, counted at the database driver.

Per task: a ``LeasedTask`` run in-process with ``Task.apply`` (the worker's
tracer, without a broker), after a warm-up, on a SQLite file and on
PostgreSQL. Statements are recorded below SQLAlchemy (SQLite's trace
callback; psycopg's ``Cursor.execute``), since the claim and the completion
run on the raw DBAPI cursor; the pool's ``checkout`` event counts connection
checkouts. *Added ms* is wall time over a plain task, *added CPU ms* this
process's CPU time over a plain task (the database's own CPU is not in it).

Per heartbeat tick: N runs claimed by one owner (among filler rows of finished
runs), N ``Lease`` objects registered with one ``Heartbeat``, and
``Heartbeat.beat_once()`` called repeatedly; statements counted as above,
latency is the median tick.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Engine, event, insert

from celery_lease import LeasedTask, LeaseStore
from celery_lease.lease.heartbeat import Heartbeat
from celery_lease.lease.lease import Lease, Standalone
from celery_lease.runtime import store_for
from celery_lease.schema import runs
from tests.helpers import driver_statements

from .common import median, table


class Counter:
    """Statements executed by the driver, and pool checkouts, on a store's engines.

    Statements are recorded below SQLAlchemy (``tests.helpers.driver_statements``),
    because the claim and the completion run on the raw DBAPI cursor; only
    those of the calling thread count (the heartbeat thread has its own).
    """

    def __init__(self, *engines: Engine) -> None:
        self._stack = ExitStack()
        self._seen = self._stack.enter_context(driver_statements(engines))
        self._thread = threading.get_ident()
        self.checkouts = 0
        self.engines = engines
        for engine in engines:
            event.listen(engine.pool, "checkout", self._on_checkout)

    @property
    def statements(self) -> int:
        return sum(1 for thread, _ in self._seen if thread == self._thread)

    def _on_checkout(self, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() == self._thread:
            self.checkouts += 1

    def reset(self) -> None:
        self._seen.clear()
        self.checkouts = 0

    def close(self) -> None:
        self._stack.close()


def per_task(url: str, n: int) -> dict[str, float]:
    """Statements, checkouts and added milliseconds per uncontended ``LeasedTask`` run."""
    app = Celery("sqlbench", broker="memory://")
    app.conf.update(lease_database_url=url, task_ignore_result=True)

    @app.task(base=LeasedTask, name="sqlbench.noop", shared=False)  # type: ignore[untyped-decorator]
    def leased(i: int) -> None:
        return None

    @app.task(name="sqlbench.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(i: int) -> None:
        return None

    store = store_for(app)
    store.create_schema()
    counter = Counter(*store.engines)
    for i in range(min(50, n)):
        leased.apply(args=(i,))
    times: dict[str, list[float]] = {"plain": [], "leased": []}
    cpu: dict[str, list[float]] = {"plain": [], "leased": []}
    for _ in range(3):
        for name, task in (("plain", plain), ("leased", leased)):
            counter.reset()
            started, cpu_started = time.perf_counter(), time.process_time()
            for i in range(n):
                task.apply(args=(i,))
            times[name].append((time.perf_counter() - started) / n * 1000)
            cpu[name].append((time.process_time() - cpu_started) / n * 1000)
    counter.reset()
    for i in range(n):
        leased.apply(args=(i,))
    result = {
        "statements": counter.statements / n,
        "checkouts": counter.checkouts / n,
        "added_ms": median(times["leased"]) - median(times["plain"]),
        "added_cpu_ms": median(cpu["leased"]) - median(cpu["plain"]),
    }
    counter.close()
    runtime_heartbeat_stop(app)
    store.dispose()
    return result


def runtime_heartbeat_stop(app: Celery) -> None:
    for runtime in app.__dict__.get("_celery_lease_runtimes", {}).values():
        runtime.heartbeat.stop(timeout=2.0)


@contextmanager
def held_leases(store: LeaseStore, count: int, filler: int) -> Iterator[Heartbeat]:
    """A heartbeat holding ``count`` live leases, among ``filler`` finished rows."""
    with store.engine.begin() as conn:
        conn.execute(runs.delete())
        if filler:
            now = store.now_ms()
            conn.execute(
                insert(runs),
                [
                    {
                        "id": f"filler-{i}",
                        "task_name": "bench",
                        "status": "succeeded",
                        "lease_ms": 30_000,
                        "attempt": 1,
                        "max_attempts": 5,
                        "available_at": now,
                        "created_at": now,
                        "updated_at": now,
                    }
                    for i in range(filler)
                ],
            )
    owner = f"bench:{uuid.uuid4().hex}"
    # Intervals far beyond the measurement, so the thread never ticks by itself.
    heartbeat = Heartbeat(store, 3600.0)
    for i in range(count):
        run_id = f"run-{i}"
        claim = store.claim(run_id, owner, task_name="bench", lease_ms=7_200_000, max_attempts=5)
        heartbeat.register(
            Lease(
                Standalone(store),
                run_id,
                owner,
                claim.attempt,
                lease_seconds=7200.0,
                heartbeat_interval=3600.0,
            )
        )
    try:
        yield heartbeat
    finally:
        heartbeat.stop(timeout=2.0)


def per_tick(url: str, counts: list[int], ticks: int, filler: int) -> list[dict[str, Any]]:
    """Statements and median latency of one heartbeat tick per held-lease count."""
    store = LeaseStore.from_url(url)
    store.create_schema()
    counter = Counter(*store.engines)
    out = []
    for count in counts:
        with held_leases(store, count, filler) as heartbeat:
            heartbeat.beat_once()  # warm the statement cache for this size
            counter.reset()
            latencies = []
            renewed = 0
            for _ in range(ticks):
                started = time.perf_counter()
                result = heartbeat.beat_once()
                latencies.append((time.perf_counter() - started) * 1000)
                renewed = len(result.renewed) if result else 0
            out.append(
                {
                    "leases": count,
                    "statements": counter.statements / ticks,
                    "checkouts": counter.checkouts / ticks,
                    "ms": median(latencies),
                    "renewed": renewed,
                }
            )
    counter.close()
    store.dispose()
    return out


def run(
    pg_url: str | None, quick: bool, work: Path, log: Any = print
) -> tuple[str, str, dict[str, Any]]:
    """Both measurements on SQLite (and PostgreSQL); two Markdown tables and raw figures."""
    n = 200 if quick else 1000
    ticks = 5 if quick else 20
    filler = 2_000 if quick else 10_000
    counts = [1, 100, 1000]
    urls = [("SQLite", f"sqlite:///{Path(tempfile.mkdtemp(dir=work)) / 'sql.sqlite3'}")]
    if pg_url:
        urls.append(("PostgreSQL", pg_url))
    task_rows, tick_rows = [], []
    raw: dict[str, Any] = {}
    for name, url in urls:
        t = per_task(url, n)
        log(f"  per task {name}: {t}")
        raw[f"task/{name}"] = t
        task_rows.append(
            [
                name,
                t["statements"],
                "met" if t["statements"] <= 2 else "missed",
                t["checkouts"],
                f"{t['added_ms']:.2f}",
                f"{t['added_cpu_ms']:.2f}",
            ]
        )
        for tick in per_tick(url, counts, ticks, filler):
            log(f"  tick {name}: {tick}")
            raw[f"tick/{name}/{tick['leases']}"] = tick
            tick_rows.append(
                [
                    name,
                    tick["leases"],
                    tick["statements"],
                    "met" if tick["statements"] <= 1 else "missed",
                    tick["checkouts"],
                    f"{tick['ms']:.2f}",
                    tick["renewed"],
                ]
            )
    task_table = table(
        [
            "lease database",
            "SQL statements / task",
            "target 2",
            "pool checkouts / task",
            "added ms / task (in-process, wall)",
            "added CPU ms / task (in-process)",
        ],
        task_rows,
    )
    tick_table = table(
        [
            "lease database",
            "leases held",
            "SQL statements / tick",
            "target 1",
            "pool checkouts / tick",
            "tick latency ms (median)",
            "renewed",
        ],
        tick_rows,
    )
    return task_table, tick_table, raw
