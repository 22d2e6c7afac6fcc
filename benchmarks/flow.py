"""Flow control: achieved rate against ``lease_rate_limit``, worker memory with 10,000
messages waiting for a 1/s limit, and the claim statements of unlimited tasks.

PostgreSQL + Redis, 2 workers x 4 prefork processes (8 processes), real ``celery
worker``s running ``tests.workerapp``. Printed only::

    python -m benchmarks.flow [--memory-messages 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil
from celery import Celery
from celery.contrib.testing.worker import start_worker

from benchmarks.common import check_loopback, pg_admin_url, redis_url, table, wait_for
from celery_lease import LeasedTask
from celery_lease.runtime import store_for
from tests.cluster import Cluster
from tests.helpers import Worker, driver_statements, scratch_database

#: Markers of the section of ``docs/benchmarks.md`` written by hand from this script's
#: output; ``benchmarks.run_all`` keeps it as it is.
BEGIN, END = "<!-- flow:begin -->", "<!-- flow:end -->"


#: (limit, tasks): each run lasts about ten seconds of slots (1/s: 15 s); "none" is the
#: same set-up unlimited (a task of the same body): the machine's ceiling.
RATES = [("1/s", 16), ("10/s", 101), ("100/s", 1001), ("none", 1001)]


def rss_mb(worker: Worker) -> tuple[float, float]:
    """Resident memory of a worker's main process (which holds ETA messages) and of its
    pool children, MiB."""
    main = psutil.Process(worker.pid)
    children = sum(p.memory_info().rss for p in main.children(recursive=True))
    return main.memory_info().rss / 2**20, children / 2**20


def fleet_rss(workers: list[Worker]) -> tuple[float, float]:
    """:func:`rss_mb` summed over ``workers``."""
    found = [rss_mb(w) for w in workers]
    return sum(m for m, _ in found), sum(c for _, c in found)


def achieved(admin: str, redis: str, limit: str, tasks: int) -> list[object]:
    """Run ``tasks`` runs of a task limited to ``limit`` on 2 workers x 4 processes."""
    with tempfile.TemporaryDirectory() as tmp, scratch_database(admin, "clbench_") as db:
        workers: list[Worker] = []
        cluster = Cluster(
            db, {"CL_BROKER_URL": redis, "CL_RESULT_BACKEND": redis}, Path(tmp), workers
        )
        try:
            env = {} if limit == "none" else {"CL_RATE_LIMIT": limit}
            for name in ("w1", "w2"):
                cluster.start(name, concurrency=4, **env)
            if limit == "none":
                ids = [cluster.send("per_account", "x") for _ in range(tasks)]
            else:
                ids = [cluster.send("rate_env", n) for n in range(tasks)]
            wait_for(
                lambda: len(cluster.effects_of_kind("start")) >= tasks,
                tasks * 1.5 + 60,
                0.2,
                what=f"{tasks} runs at {limit}",
            )
            at = sorted(row.at for row in cluster.effects_of_kind("start"))
            rate = (len(at) - 1) / (at[-1] - at[0])
            once = len({row.run_id for row in cluster.effects_of_kind("start")}) == len(ids)
            ratio = "-" if limit == "none" else f"{rate / float(limit.split('/')[0]):.3f}"
            return [limit, tasks, f"{rate:.2f}/s", ratio, "yes" if once else "NO"]
        finally:
            for worker in workers:
                worker.stop()
            cluster.close()


def memory(admin: str, redis: str, messages: int) -> list[object]:
    """RSS of 2 workers x 4 processes before and after ``messages`` reach a 1/s task."""
    with tempfile.TemporaryDirectory() as tmp, scratch_database(admin, "clbench_") as db:
        workers: list[Worker] = []
        cluster = Cluster(
            db, {"CL_BROKER_URL": redis, "CL_RESULT_BACKEND": redis}, Path(tmp), workers
        )
        try:
            started = [
                cluster.start(name, concurrency=4, CL_RATE_LIMIT="1/s") for name in ("w1", "w2")
            ]
            time.sleep(2)
            before = fleet_rss(started)
            cluster.producer.conf.task_default_queue = cluster.queue
            with cluster.producer.connection_for_write() as conn:
                producer = cluster.producer.amqp.Producer(conn)
                for n in range(messages):
                    cluster.producer.send_task(
                        "workerapp.rate_env", args=(n,), queue=cluster.queue, producer=producer
                    )
            t0 = time.monotonic()
            peak = [before]

            def settled() -> bool:
                # Every message reached a worker once: deferred into the database, or run
                # (a few are between the two: published with their countdown).
                peak.append(fleet_rss(started))
                deferred = sum(cluster.store.flow.flow_counts().deferred.values())
                ran = sum(cluster.store.reads.stats()["counts"].values())
                return deferred + ran >= messages - 5

            wait_for(settled, messages / 5 + 120, 2.0, what="every delivery deferred or run")
            took = time.monotonic() - t0
            held = sum(cluster.store.flow.flow_counts().deferred.values())
            main = max(m for m, _ in peak)
            children = max(c for _, c in peak)
            return [
                messages,
                f"{before[0]:.0f} -> {main:.0f}",
                f"{before[1]:.0f} -> {children:.0f}",
                held,
                f"{took:.0f}",
            ]
        finally:
            for worker in workers:
                worker.stop()
            cluster.close()


def statements(admin: str) -> list[list[object]]:
    """Driver statements of one run: unlimited, and limited (in-process worker, PostgreSQL)."""
    with scratch_database(admin, "clbench_") as db:
        app = Celery("flowbench", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_backend="cache+memory://",
            lease_database_url=db,
            broker_connection_retry_on_startup=True,
        )

        @app.task(base=LeasedTask, bind=True, shared=False, name="flowbench.free")
        def free(self: LeasedTask, n: int) -> int:
            return n

        @app.task(base=LeasedTask, bind=True, shared=False, name="flowbench.limited")
        def limited(self: LeasedTask, n: int) -> int:
            return n

        limited.lease_rate_limit = "1000/s"
        store = store_for(app)
        store.create_schema()
        rows: list[list[object]] = []
        worker = start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10)
        with worker, driver_statements(store.engines) as seen:
            for task in (free, limited):
                task.delay(0).get(timeout=20)
                seen.clear()
                task.delay(1).get(timeout=20)
                kinds = [stmt.split()[0].upper() for _, stmt in seen if "celery_lease_" in stmt]
                rows.append([task.name, len(kinds), " ".join(kinds)])
        store.dispose()
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory-messages", type=int, default=10_000)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    options = parser.parse_args()
    admin, redis = pg_admin_url(), redis_url()
    if not admin or not redis:
        raise SystemExit("set CELERY_LEASE_BENCH_PG_URL and CELERY_LEASE_BENCH_REDIS_URL")
    check_loopback(admin)
    check_loopback(redis)
    if not options.memory_only:
        print(table(["task", "statements per run", "kinds"], statements(admin)))
        print()
        rows = [achieved(admin, redis, limit, tasks) for limit, tasks in RATES]
        print(table(["limit", "tasks", "achieved", "achieved / configured", "each once"], rows))
    if not options.skip_memory:
        print()
        print(
            table(
                [
                    "messages",
                    "main processes MiB (before -> peak)",
                    "pool children MiB (before -> peak)",
                    "held in DB",
                    "intake s",
                ],
                [memory(admin, redis, options.memory_messages)],
            )
        )


if __name__ == "__main__":
    main()
