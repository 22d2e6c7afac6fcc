"""Throughput of a trivial task: plain Celery vs LeasedTask vs celery-once, real workers.

Method: enqueue N ``bench.noop`` messages, then start one ``celery worker -P
prefork -c 2`` and time from the first task's start (``task_prerun`` in any
pool process) to the last ``task_postrun``, so worker boot is excluded and
the lease completion / celery-once unlock are included. Configurations run
interleaved, round after round; each figure is the median over rounds and
each ratio the median of per-round ratios to plain Celery on the same broker.

On RabbitMQ (``CELERY_LEASE_BENCH_AMQP_URL``) plain Celery and LeasedTask on
PostgreSQL are compared the same way.

Two more columns per set-up: *end to end*, N over the publishing time plus the
worker's time (celery-once takes its lock while publishing), and *CPU ms per
task*: the CPU time of the worker's processes and of the local database and
Redis (or RabbitMQ) servers while the worker drained the queue, per task. CPU time is less
disturbed by a busy neighbour than wall time.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as redis_client
from sqlalchemy.engine import make_url

from .benchapp import make_app
from .common import empty_lease_table, median, read_marks, unique, wait_for, worker

POOL = "prefork"
CONCURRENCY = 2


@dataclass(frozen=True)
class Setup:
    """One column of the comparison: a broker, a mode and (for leased) a lease database."""

    label: str
    broker: str  # "filesystem", "redis" or "amqp"
    mode: str  # "plain", "leased", "once"
    lease_db: str = ""  # "sqlite", "postgresql" or "pgbouncer" (the same PostgreSQL through it)


SETUPS = [
    Setup("plain Celery", "filesystem", "plain"),
    Setup("LeasedTask, SQLite", "filesystem", "leased", "sqlite"),
    Setup("celery-once (Redis lock)", "filesystem", "once"),
    Setup("plain Celery", "redis", "plain"),
    Setup("LeasedTask, PostgreSQL", "redis", "leased", "postgresql"),
    Setup("LeasedTask, PostgreSQL via PgBouncer", "redis", "leased", "pgbouncer"),
    Setup("celery-once (Redis lock)", "redis", "once"),
    Setup("plain Celery", "amqp", "plain"),
    Setup("LeasedTask, PostgreSQL", "amqp", "leased", "postgresql"),
]
#: How each broker is named in the table.
BROKER_LABELS = {"filesystem": "filesystem://", "redis": "Redis", "amqp": "RabbitMQ"}
#: The server processes whose CPU time each broker adds (RabbitMQ: the Erlang VM).
BROKER_SERVERS = {"filesystem": (), "redis": ("redis-server",), "amqp": ("beam.smp",)}


@dataclass
class Result:
    setup: Setup
    rate: float  # tasks/s, first start -> last finish
    enqueue_rate: float  # messages/s published by the producer
    end_to_end: float  # tasks/s over publishing time + worker time
    cpu_ms: float  # CPU ms per task: worker processes + local servers


_TICK = os.sysconf("SC_CLK_TCK")


def _processes() -> list[tuple[int, int, str, float]]:
    """``(pid, ppid, name, cpu seconds)`` of every process this machine shows."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                head, _, rest = handle.read().rpartition(")")
        except OSError:
            continue  # it ended meanwhile
        fields = rest.split()
        name = head.partition("(")[2]
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
        found.append((int(entry), int(fields[1]), name, cpu))
    return found


def cpu_seconds(worker_pid: int, servers: tuple[str, ...]) -> float:
    """CPU seconds so far of the worker, its pool children and the ``servers`` processes."""
    total = 0.0
    for pid, ppid, name, cpu in _processes():
        if pid == worker_pid or ppid == worker_pid or name in servers:
            total += cpu
    return total


def run_one(
    setup: Setup,
    n: int,
    work: Path,
    redis_url: str | None,
    pg_url: str | None,
    bouncer_url: str | None = None,
    amqp_url: str | None = None,
) -> Result:
    """Enqueue ``n`` tasks, start a worker, time it until all ``n`` finished."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    marks = run_dir / "marks"
    marks.mkdir()
    env = {
        "BENCH_MODE": setup.mode,
        "BENCH_MARKS": str(marks),
        "BENCH_QUEUE": unique("bq"),
    }
    if setup.broker == "filesystem":
        folder = run_dir / "broker"
        (folder / "control").mkdir(parents=True)
        env.update(BENCH_BROKER="filesystem://", BENCH_FS_DIR=str(folder))
    elif setup.broker == "amqp":
        assert amqp_url
        env["BENCH_BROKER"] = amqp_url
    else:
        assert redis_url
        env["BENCH_BROKER"] = redis_url
    if setup.mode == "once":
        assert redis_url
        env["BENCH_ONCE_URL"] = redis_url
    if setup.lease_db == "sqlite":
        env["BENCH_LEASE_DB"] = f"sqlite:///{run_dir / 'leases.sqlite3'}"
    elif setup.lease_db in ("postgresql", "pgbouncer"):
        assert pg_url
        env["BENCH_LEASE_DB"] = (
            pg_url if setup.lease_db == "postgresql" else via(pg_url, bouncer_url)
        )
        empty_lease_table(pg_url)
    producer = make_app(env)
    noop = producer.tasks["bench.noop"]
    offset = random.randrange(10**9)  # fresh celery-once lock keys every run
    started = time.perf_counter()
    for i in range(n):
        noop.apply_async(args=(offset + i,))
    enqueue_rate = n / (time.perf_counter() - started)
    producer.close()

    servers = BROKER_SERVERS[setup.broker]
    if setup.lease_db == "postgresql":
        servers += ("postgres",)
    elif setup.lease_db == "pgbouncer":
        servers += ("postgres", "pgbouncer")
    worker_proc = worker(env, run_dir / "worker.log", unique("bw"), concurrency=CONCURRENCY)
    try:

        def finished() -> int:
            if worker_proc.proc.poll() is not None:
                raise RuntimeError(f"worker exited:\n{worker_proc.log()[-3000:]}")
            return sum(1 for kind, _ in read_marks(marks) if kind == "E")

        # CPU is counted from the first finished task to the last, so that
        # worker start-up is left out like it is from the rate.
        wait_for(lambda: finished() >= 1, 60, 0.01, f"the first task ({setup.label})")
        cpu_start, done_start = cpu_seconds(worker_proc.pid, servers), finished()
        wait_for(lambda: finished() >= n, 60 + n / 20, 0.05, f"{n} tasks ({setup.label})")
        cpu_used, done_during = cpu_seconds(worker_proc.pid, servers) - cpu_start, n - done_start
    finally:
        worker_proc.stop(20.0)
        if setup.broker == "redis" and redis_url:
            _clean_redis(redis_url, env["BENCH_QUEUE"])
        if setup.broker == "amqp" and amqp_url:
            _clean_amqp(amqp_url, env["BENCH_QUEUE"])
    got = read_marks(marks)
    first = min(float(f[0]) for kind, f in got if kind == "S")
    last = max(float(f[0]) for kind, f in got if kind == "E")
    shutil.rmtree(run_dir, ignore_errors=True)
    rate = n / (last - first)
    end_to_end = n / (n / enqueue_rate + n / rate)
    return Result(setup, rate, enqueue_rate, end_to_end, cpu_used * 1000 / max(done_during, 1))


def via(pg_url: str, bouncer_url: str | None) -> str:
    """``pg_url``'s database reached through the PgBouncer at ``bouncer_url``'s host and port."""
    assert bouncer_url
    bouncer = make_url(bouncer_url)
    return (
        make_url(pg_url)
        .set(host=bouncer.host, port=bouncer.port)
        .render_as_string(hide_password=False)
    )


def _clean_redis(url: str, queue: str) -> None:
    client = redis_client.Redis.from_url(url)
    keys = [queue, f"_kombu.binding.{queue}"]
    keys += list(client.scan_iter(f"{queue}*", count=1000))
    client.delete(*keys)
    client.close()


def _clean_amqp(url: str, queue: str) -> None:
    """Delete the run's queue and its exchange (named after the queue)."""
    from kombu import Connection

    with Connection(url) as conn:
        channel = conn.default_channel
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


def run(
    n: int,
    rounds: int,
    work: Path,
    redis_url: str | None,
    pg_url: str | None,
    log: Any = print,
    bouncer_url: str | None = None,
    brokers: tuple[str, ...] = ("filesystem", "redis", "amqp"),
    amqp_url: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """All set-ups, interleaved, ``rounds`` times; a Markdown table and the raw figures.

    ``bouncer_url`` is a PgBouncer (transaction mode) in front of ``pg_url``'s
    server, with a wildcard database entry; without it that row is left out.
    Without ``amqp_url`` the RabbitMQ rows are left out.
    """
    setups = [
        s
        for s in SETUPS
        if (s.broker == "filesystem" and s.mode != "once")
        or (s.broker == "amqp" and amqp_url)
        or (s.broker != "amqp" and redis_url)
    ]
    setups = [s for s in setups if s.lease_db != "postgresql" or pg_url]
    setups = [s for s in setups if s.lease_db != "pgbouncer" or (pg_url and bouncer_url)]
    setups = [s for s in setups if s.broker in brokers]
    results: dict[Setup, list[Result]] = {s: [] for s in setups}
    ratios: dict[Setup, list[float]] = {s: [] for s in setups}
    e2e_ratios: dict[Setup, list[float]] = {s: [] for s in setups}
    for r in range(rounds):
        order = setups[:]
        random.shuffle(order)  # no set-up always runs first (page cache, a busy neighbour)
        this_round: dict[Setup, Result] = {}
        for setup in order:
            res = run_one(setup, n, work, redis_url, pg_url, bouncer_url, amqp_url)
            this_round[setup] = res
            results[setup].append(res)
            log(
                f"  round {r + 1} {setup.broker:10} {setup.label:26} {res.rate:8.1f} tasks/s "
                f"(enqueue {res.enqueue_rate:7.1f}/s, end to end {res.end_to_end:7.1f}/s, "
                f"{res.cpu_ms:.2f} CPU ms/task)"
            )
        for setup in setups:
            plain = next(s for s in setups if s.broker == setup.broker and s.mode == "plain")
            ratios[setup].append(this_round[setup].rate / this_round[plain].rate)
            e2e_ratios[setup].append(this_round[setup].end_to_end / this_round[plain].end_to_end)
    from .common import table

    targets = {"sqlite": 0.9, "postgresql": 0.8, "pgbouncer": 0.8}
    rows = []
    raw: dict[str, Any] = {}
    once_ratio = {s.broker: median(ratios[s]) for s in setups if s.mode == "once"}
    once_e2e = {s.broker: median(e2e_ratios[s]) for s in setups if s.mode == "once"}
    for setup in setups:
        rate = median([x.rate for x in results[setup]])
        ratio = median(ratios[setup])
        e2e = median(e2e_ratios[setup])
        verdict = ""
        if setup.mode == "leased":
            goal = targets[setup.lease_db]
            verdict = f"{'met' if ratio >= goal else 'missed'} (>= {goal})"
            peer, peer_e2e = once_ratio.get(setup.broker), once_e2e.get(setup.broker)
            if peer is not None and peer_e2e is not None:
                verdict += (
                    f"; vs celery-once: worker side {_versus(ratio, peer)}, "
                    f"end to end {_versus(e2e, peer_e2e)}"
                )
        broker = BROKER_LABELS[setup.broker]
        rows.append(
            [
                broker,
                setup.label,
                rate,
                f"{ratio:.2f}",
                " / ".join(f"{x.rate:.0f}" for x in results[setup]),
                median([x.enqueue_rate for x in results[setup]]),
                f"{e2e:.2f}",
                f"{median([x.cpu_ms for x in results[setup]]):.2f}",
                verdict,
            ]
        )
        raw[f"{setup.broker}/{setup.label}"] = {
            "rate": rate,
            "ratio": ratio,
            "end_to_end_ratio": e2e,
            "cpu_ms": median([x.cpu_ms for x in results[setup]]),
        }
    headers = [
        "broker",
        "task base",
        "tasks/s (median)",
        "ratio to plain",
        "each round",
        "enqueue msgs/s",
        "end-to-end ratio",
        "CPU ms / task",
        "target",
    ]
    return table(headers, rows), raw


def _versus(ours: float, peer: float) -> str:
    """``not behind (0.91 vs 0.88)`` or ``behind (...)``."""
    return f"{'not behind' if ours >= peer else 'behind'} ({ours:.2f} vs {peer:.2f})"


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.throughput``: this table alone (e.g. a reduced run)."""
    import argparse
    import contextlib
    import tempfile

    from tests.helpers import scratch_database

    from .common import amqp_url, pg_admin_url, pgbouncer_url, redis_url

    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis-only", action="store_true", help="leave out filesystem://")
    parser.add_argument(
        "--brokers",
        default="filesystem,redis,amqp",
        help="comma-separated brokers to run (filesystem, redis, amqp); default all",
    )
    args = parser.parse_args(argv)
    admin, redis, bouncer, amqp = pg_admin_url(), redis_url(), pgbouncer_url(), amqp_url()
    work = Path(tempfile.mkdtemp(prefix="celery-lease-bench-"))
    brokers = ("redis",) if args.redis_only else tuple(args.brokers.split(","))
    try:
        with scratch_database(admin, "clbench_") if admin else contextlib.nullcontext() as pg:
            rendered, _ = run(
                args.tasks,
                args.rounds,
                work,
                redis,
                pg,
                bouncer_url=bouncer,
                brokers=brokers,
                amqp_url=amqp,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(rendered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
