"""What an idle fleet costs the lease database: statements per second per worker and per beat.

``python -m benchmarks.idle [--seconds 300] [--workers 3] [--beats 2] [--lease-seconds 30]
[--sweep-interval 60]``: real ``celery worker`` processes (prefork, 1 child) and
``celery beat -S celery_lease.beat:LeaseScheduler`` processes on a scratch PostgreSQL
database and Redis, none of them given any task. After a warm-up, every statement
each process sends through SQLAlchemy is counted for ``--seconds``
(``benchmarks.idleapp``), and PostgreSQL's own count of committed transactions on the
database is read as a cross-check. Printed only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text

from benchmarks.common import check_loopback, pg_admin_url, redis_url, table, unique
from celery_lease import LeaseStore
from tests.helpers import Worker, scratch_database, wait_for


def _counts(folder: Path) -> dict[int, int]:
    found = {}
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found[int(data["pid"])] = int(data["statements"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--beats", type=int, default=2)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    parser.add_argument("--sweep-interval", type=float, default=60.0)
    args = parser.parse_args()
    admin, broker = pg_admin_url(), redis_url()
    if not admin or not broker:
        raise SystemExit("needs CELERY_LEASE_BENCH_PG_URL and CELERY_LEASE_BENCH_REDIS_URL")
    check_loopback(admin)
    check_loopback(broker)
    with scratch_database(admin, "clidle_") as url, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "counts").mkdir()
        store = LeaseStore.from_url(url)
        store.create_schema()
        env = {
            "IDLE_BROKER": broker,
            "IDLE_QUEUE": unique("idle"),
            "IDLE_LEASE_DB": url,
            "IDLE_COUNTS": str(folder / "counts"),
        }
        conf = f"lease_seconds={args.lease_seconds}; sweep={args.sweep_interval}"
        env_conf = dict(env)
        processes: list[Worker] = []
        try:
            for i in range(args.workers):
                processes.append(
                    Worker(
                        {**env_conf, **_settings(args)},
                        folder / f"w{i}.log",
                        name=f"w{i}",
                        app="benchmarks.idleapp",
                        concurrency=1,
                        loglevel="INFO",
                    ).wait_ready(60)
                )
            for i in range(args.beats):
                processes.append(
                    Worker(
                        {**env_conf, **_settings(args)},
                        folder / f"b{i}.log",
                        name=f"b{i}",
                        app="benchmarks.idleapp",
                        command=["beat", "-S", "celery_lease.beat:LeaseScheduler", "-l", "WARNING"],
                    )
                )
            time.sleep(15.0)  # warm-up: every process has stood for its leads
            wait_for(lambda: len(_counts(folder / "counts")) >= len(processes), 30)
            engine = create_engine(admin, isolation_level="AUTOCOMMIT")
            database = url.rsplit("/", 1)[1]
            xacts = text(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :d"
            )
            with engine.connect() as conn:
                before_x = conn.execute(xacts, {"d": database}).scalar_one()
            before = _counts(folder / "counts")
            started = time.monotonic()
            time.sleep(args.seconds)
            after = _counts(folder / "counts")
            elapsed = time.monotonic() - started
            with engine.connect() as conn:
                after_x = conn.execute(xacts, {"d": database}).scalar_one()
            engine.dispose()
            leaders = {r.name: int(r.owner.split(":")[1]) for r in store.leaders.list_all()}
            parents = {pid: _parent(pid) for pid in after}
        finally:
            for process in processes:
                process.stop()
            store.dispose()
    rows = []
    total = 0
    for process in processes:
        pids = [pid for pid in after if process.pid in (pid, parents.get(pid))]
        count = sum(after.get(pid, 0) - before.get(pid, 0) for pid in pids)
        total += count
        kind = "beat" if process.name.startswith("b") else "worker"
        role = [name for name, pid in leaders.items() if pid == process.pid]
        children = sum(after.get(pid, 0) - before.get(pid, 0) for pid in pids if pid != process.pid)
        rows.append(
            [process.name, kind, ", ".join(role) or "standby", count, children, count / elapsed]
        )
    print(f"idle for {elapsed:.0f} s ({conf}); PostgreSQL, Redis")
    headers = ["process", "kind", "leads", "statements", "of which pool children", "per second"]
    print(table(headers, rows))
    committed = after_x - before_x
    print(
        f"all processes: {total} statements, {total / elapsed:.3f}/s; PostgreSQL committed "
        f"{committed} transactions on the database ({committed / elapsed:.3f}/s)"
    )


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _settings(args: argparse.Namespace) -> dict[str, str]:
    return {
        "IDLE_LEASE_SECONDS": str(args.lease_seconds),
        "IDLE_SWEEP_INTERVAL": str(args.sweep_interval),
    }


if __name__ == "__main__":
    main()
