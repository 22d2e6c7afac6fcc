"""CPU per task of a real worker, split by process: main, pool children, local servers.

The same method as ``throughput.py`` (N messages enqueued first, one ``celery
worker -P prefork -c 2``, timed from the first task's start to the last
task's end), but the CPU time read from ``/proc`` is kept apart: the worker's
main process, its pool children, and this run's servers (the PostgreSQL
postmaster and its children, the Redis server, found by process id: other
servers on the machine do not count), each as user and sys time. Plain Celery and ``LeasedTask`` run
interleaved, round after round, on the same broker; figures are medians.

``--body`` picks what the task does: ``noop`` (returns at once), ``cpu10``
(10 ms of CPU) or ``sleep50`` (sleeps 50 ms, as a body waiting on I/O).

::

    python -m benchmarks.worker_cpu [--tasks N] [--rounds N] [--body noop|cpu10|sleep50]
                                    [--set-up sqlite|postgresql|both]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import redis as redis_client
from sqlalchemy import text

from celery_lease import LeaseStore

from .benchapp import make_app
from .common import empty_lease_table, median, read_marks, table, unique, wait_for
from .common import worker as bench_worker
from .throughput import _TICK, _clean_redis

#: docs/benchmarks.md's section on the CPU accounting (written by hand from
#: this script's, hotpath's and the profilers' output; run_all keeps it).
BEGIN = "<!-- cpu:begin -->"
END = "<!-- cpu:end -->"


SET_UPS = {
    # name: (broker, lease database)
    "sqlite": ("filesystem", "sqlite"),
    "postgresql": ("redis", "postgresql"),
}


def split(worker_pid: int, servers: set[int]) -> dict[str, float]:
    """CPU seconds so far, ``{main,children,servers}_{user,sys}``.

    ``servers`` are the process ids of this run's Redis and of this run's
    PostgreSQL postmaster: the postmaster and its children (backends, WAL
    writer, checkpointer) count, other servers on the machine do not.
    """
    out = dict.fromkeys(
        ("main_user", "main_sys", "children_user", "children_sys", "servers_user", "servers_sys"),
        0.0,
    )
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                rest = handle.read().rpartition(")")[2]
        except OSError:
            continue
        fields = rest.split()
        pid, ppid = int(entry), int(fields[1])
        user, sys_ = int(fields[11]) / _TICK, int(fields[12]) / _TICK
        if pid == worker_pid:
            kind = "main"
        elif ppid == worker_pid:
            kind = "children"
        elif pid in servers or ppid in servers:
            kind = "servers"
        else:
            continue
        out[f"{kind}_user"] += user
        out[f"{kind}_sys"] += sys_
        if kind == "children":
            out["children_switches"] = out.get("children_switches", 0.0) + _switches(pid)
    return out


def _postmaster(url: str) -> int:
    """The process id of the PostgreSQL postmaster serving ``url`` (its backend's parent).

    Read while the connection is open: once it closes, its backend exits."""
    store = LeaseStore.from_url(url)
    try:
        with store.engine.connect() as conn:
            backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            with open(f"/proc/{backend}/stat") as handle:
                return int(handle.read().rpartition(")")[2].split()[1])
    finally:
        store.dispose()


def _switches(pid: int) -> float:
    """Voluntary + involuntary context switches of ``pid`` so far (all its threads)."""
    total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as handle:
                for line in handle:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
    except OSError:
        pass
    return total


def run_one(
    mode: str, set_up: str, body: str, n: int, work: Path, redis: str | None, pg: str | None
) -> dict[str, float]:
    """One drain of ``n`` tasks; CPU ms per task by process kind, and tasks/s."""
    broker, lease_db = SET_UPS[set_up]
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    marks = run_dir / "marks"
    marks.mkdir()
    env = {
        "BENCH_MODE": mode,
        "BENCH_MARKS": str(marks),
        "BENCH_QUEUE": unique("bq"),
        "BENCH_BODY": body,
    }
    servers: set[int] = set()
    if broker == "filesystem":
        folder = run_dir / "broker"
        (folder / "control").mkdir(parents=True)
        env.update(BENCH_BROKER="filesystem://", BENCH_FS_DIR=str(folder))
    else:
        assert redis
        env["BENCH_BROKER"] = redis
        servers.add(int(redis_client.Redis.from_url(redis).info("server")["process_id"]))
    if lease_db == "sqlite":
        env["BENCH_LEASE_DB"] = f"sqlite:///{run_dir / 'leases.sqlite3'}"
    else:
        assert pg
        env["BENCH_LEASE_DB"] = pg
        servers.add(_postmaster(pg))
        empty_lease_table(pg)
    producer = make_app(env)
    noop = producer.tasks["bench.noop"]
    for i in range(n):
        noop.apply_async(args=(i,))
    producer.close()
    worker = bench_worker(env, run_dir / "worker.log", unique("bw"))
    try:

        def finished() -> int:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited:\n{worker.log()[-3000:]}")
            return sum(1 for kind, _ in read_marks(marks) if kind == "E")

        wait_for(lambda: finished() >= 1, 60, 0.01, "the first task")
        before, done_before = split(worker.pid, servers), finished()
        wait_for(lambda: finished() >= n, 120 + n / 5, 0.05, f"{n} tasks")
        after = split(worker.pid, servers)
        done = n - done_before
    finally:
        worker.stop(20)
        if broker == "redis" and redis:
            _clean_redis(redis, env["BENCH_QUEUE"])
    got = read_marks(marks)
    first = min(float(f[0]) for kind, f in got if kind == "S")
    last = max(float(f[0]) for kind, f in got if kind == "E")
    shutil.rmtree(run_dir, ignore_errors=True)
    out = {k: (after[k] - before[k]) * 1000 / max(done, 1) for k in after}
    switches = out.pop("children_switches", 0.0) / 1000  # per task, not per 1000
    out["rate"] = n / (last - first)
    out["switches"] = switches
    return out


def main(argv: list[str] | None = None) -> int:
    """Print plain vs leased CPU per task by process, and the added CPU."""
    from tests.helpers import scratch_database

    from .common import pg_admin_url, redis_url

    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker_cpu")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--body", choices=("noop", "cpu10", "sleep50"), default="noop")
    parser.add_argument("--set-up", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args(argv)
    admin, redis = pg_admin_url(), redis_url()
    set_ups = ["sqlite", "postgresql"] if args.set_up == "both" else [args.set_up]
    if not (admin and redis):
        set_ups = [s for s in set_ups if s != "postgresql"]
    work = Path(tempfile.mkdtemp(prefix="celery-lease-wcpu-"))
    try:
        with scratch_database(admin, "clwcpu_") if admin else contextlib.nullcontext() as pg:
            for set_up in set_ups:
                res: dict[str, list[dict[str, float]]] = {"plain": [], "leased": []}
                for r in range(args.rounds):
                    order = ["plain", "leased"]
                    random.shuffle(order)
                    for mode in order:
                        one = run_one(mode, set_up, args.body, args.tasks, work, redis, pg)
                        res[mode].append(one)
                        print(
                            f"  round {r + 1} {set_up} {mode}: {one['rate']:.0f} tasks/s, "
                            + ", ".join(f"{k} {v:.3f}" for k, v in one.items() if k != "rate"),
                            flush=True,
                        )
                keys = [k for k in res["plain"][0] if k not in ("rate", "switches")]
                med = {
                    m: {k: median([x[k] for x in res[m]]) for k in [*keys, "rate", "switches"]}
                    for m in res
                }
                ratios = [
                    lease["rate"] / plain["rate"]
                    for plain, lease in zip(res["plain"], res["leased"], strict=True)
                ]
                rows = []
                for k in keys:
                    rows.append(
                        [
                            k.replace("_", " "),
                            f"{med['plain'][k]:.3f}",
                            f"{med['leased'][k]:.3f}",
                            f"{(med['leased'][k] - med['plain'][k]) * 1000:.0f}",
                        ]
                    )
                total = {m: sum(med[m][k] for k in keys) for m in med}
                rows.append(
                    [
                        "**total**",
                        f"{total['plain']:.3f}",
                        f"{total['leased']:.3f}",
                        f"{(total['leased'] - total['plain']) * 1000:.0f}",
                    ]
                )
                print(
                    f"\n### {set_up}, body {args.body}: {args.tasks} tasks x {args.rounds} rounds "
                    f"({time.strftime('%Y-%m-%d')}); tasks/s plain {med['plain']['rate']:.0f}, "
                    f"leased {med['leased']['rate']:.0f}, ratio (median of rounds) "
                    f"{median(ratios):.3f}, CPU ratio plain/leased "
                    f"{total['plain'] / total['leased']:.3f}\n"
                )
                rows.append(
                    [
                        "pool children's context switches / task",
                        f"{med['plain']['switches']:.1f}",
                        f"{med['leased']['switches']:.1f}",
                        "",
                    ]
                )
                print(table(["CPU ms / task", "plain", "leased", "added µs"], rows))
                print(flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
