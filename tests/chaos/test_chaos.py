"""Chaos scenarios on PostgreSQL + Redis (acks_late, short visibility timeout); the
kill -9 scenario also on PostgreSQL + RabbitMQ (acks_late: redelivery on connection close).

Each scenario prints one summary line and asserts, per run: succeeded, exactly
one committed effect (written with ``fence(complete=True)``), and an attempt
consistent with its history. Marked ``chaos``; CI runs them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from celery_lease.schema import runs
from tests.chaos.history import History, check, guarded_overlaps
from tests.cluster import (
    AMQP_ID,
    AMQP_SETUP,
    MARIADB_ID,
    MARIADB_SETUP,
    PG_AND_MARIADB,
    PGBOUNCER_ID,
    PGBOUNCER_SETUP,
    SETUP_IDS,
    SETUPS,
    Cluster,
)
from tests.helpers import Worker, wait_for
from tests.proxy import Proxy

pytestmark = pytest.mark.chaos
#: PostgreSQL + Redis; and the same through PgBouncer in transaction mode.
ON_PG = pytest.mark.parametrize("cluster", [SETUPS[2]], ids=[SETUP_IDS[2]], indirect=True)
ON_PG_AND_PGBOUNCER = pytest.mark.parametrize(
    "cluster", [SETUPS[2], PGBOUNCER_SETUP], ids=[SETUP_IDS[2], PGBOUNCER_ID], indirect=True
)
#: The same, PostgreSQL + RabbitMQ and MariaDB + Redis.
ON_EVERY_SERVER = pytest.mark.parametrize(
    "cluster",
    [SETUPS[2], PGBOUNCER_SETUP, AMQP_SETUP, MARIADB_SETUP],
    ids=[SETUP_IDS[2], PGBOUNCER_ID, AMQP_ID, MARIADB_ID],
    indirect=True,
)

TIMING = {
    "CL_LEASE_SECONDS": "2",
    "CL_HEARTBEAT": "0.5",
    "CL_ACKS_LATE": "1",
    "CL_VISIBILITY_TIMEOUT": "5",
}
CONF = {"lease_retry_backoff": 0.2, "lease_retry_backoff_max": 2.0, "lease_max_attempts": 20}
SWEEP = {"lease_sweep_interval": 1.0, **CONF}


def kill_randomly(
    cluster: Cluster, workers: list[Worker], rng: random.Random, count: int = 6
) -> int:
    """``count`` times, kill -9 a random worker after 2-4 s and start a fresh one in its
    place (bounded at 120 s, however slowly workers start); returns how many were killed."""
    kills = 0
    stop_killing = time.monotonic() + 120.0
    while kills < count and time.monotonic() < stop_killing:
        time.sleep(rng.uniform(2.0, 4.0))
        victim = rng.randrange(len(workers))
        workers[victim].kill9()
        kills += 1
        workers[victim] = cluster.start(f"w{victim}-r{kills}", conf=CONF, **TIMING)
    return kills


def report(capsys: pytest.CaptureFixture[str], name: str, history: History) -> None:
    """Print the scenario's summary line past pytest's capture, then assert it."""
    with capsys.disabled():
        print("\n" + history.line(name))
    assert history.ok, history.problems[:20]


def all_terminal(cluster: Cluster, run_ids: list[str]) -> bool:
    statuses = [cluster.status(r) for r in run_ids]
    return all(s in ("succeeded", "failed", "cancelled") for s in statuses)


def wait_all_terminal_resending(
    cluster: Cluster, resend: dict[str, Callable[[], Any]], timeout: float, what: str
) -> int:
    """Wait up to ``timeout`` s until every run of ``resend`` (run id -> how to send it
    again) ended, sending again, as a shop resubmits its stalled orders
    (``example_project``'s ``resubmit_stalled_captures``), a run that still has no row 10 s
    after it was first seen without one: the broker lost its message before any worker
    claimed it (kombu Redis loses the one a worker is killed with between its BRPOP and its
    save to ``unacked``), and only its sender knows of it. Safe: a copy of a run that did
    start is a duplicate, dropped. Returns how many were sent again; on a timeout, names the
    runs that did not end (:func:`wait_all_terminal`)."""
    run_ids = list(resend)
    missing_since: dict[str, float] = {}
    resent = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all_terminal(cluster, run_ids):
        with cluster.engine.connect() as conn:
            query = select(runs.c.id).where(runs.c.id.in_(run_ids))
            found = set(conn.execute(query).scalars())
        now = time.monotonic()
        for run_id in run_ids:
            if run_id in found:
                missing_since.pop(run_id, None)
            elif now - missing_since.setdefault(run_id, now) > 10.0:
                resend[run_id]()
                missing_since[run_id] = now
                resent += 1
        time.sleep(1.0)
    wait_all_terminal(cluster, run_ids, 1, what)
    return resent


def wait_all_terminal(cluster: Cluster, run_ids: list[str], timeout: float, what: str) -> None:
    """Wait until every run ended; on timeout, name the runs that did not (status, attempt,
    owner, lease expiry, availability) and count those with no row at all."""
    try:
        wait_for(lambda: all_terminal(cluster, run_ids), timeout, interval=1.0, what=what)
    except AssertionError as exc:
        rows = [cluster.store.get(r) for r in run_ids]
        stuck = [
            (r.id, r.status, r.attempt, r.lease_owner, r.lease_expires_at, r.available_at)
            for r in rows
            if r is not None and r.status not in ("succeeded", "failed", "cancelled")
        ]
        missing = [run_id for run_id, r in zip(run_ids, rows, strict=True) if r is None]
        raise AssertionError(
            f"{exc}: {len(stuck)} not ended {stuck[:10]}, {len(missing)} no row {missing[:10]}"
        ) from None


@ON_EVERY_SERVER
@pytest.mark.timeout(400)
def test_kill9_random_workers_during_300_runs(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 runs over 3 workers while a driver kill -9s a random worker every few
    seconds and restarts it: every run commits exactly once.

    On RabbitMQ no sweeper runs: its redelivery on connection close alone must bring
    every killed run back, claimed only once the dead worker's lease has expired."""
    rng = random.Random(20261202)
    workers = [cluster.start(f"w{i}", conf=CONF, **TIMING) for i in range(3)]
    if not cluster.amqp:
        cluster.start_beat(SWEEP)
    sent = {}
    for _ in range(300):
        seconds = rng.uniform(0.2, 0.5)
        sent[cluster.send("workerapp.effect", seconds)] = seconds
    run_ids = list(sent)
    kills = kill_randomly(cluster, workers, rng)
    resend = {
        run_id: functools.partial(cluster.send, "workerapp.effect", seconds, task_id=run_id)
        for run_id, seconds in sent.items()
    }
    resent = wait_all_terminal_resending(cluster, resend, 240, "all 300 runs")
    history = check(cluster, run_ids)
    assert kills >= 5
    busy = sum(log.count("held by another worker") for log in _logs(cluster))
    report(
        capsys,
        f"kill9 x{kills} resent={resent}" + (f" busy_redeliveries={busy}" if cluster.amqp else ""),
        history,
    )


@PG_AND_MARIADB
@pytest.mark.timeout(240)
def test_sigstop_stale_worker_commits_nothing(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rounds of 20 runs: a worker holds the batch mid-body, is SIGSTOPped past the
    lease while another worker takes every run over, then SIGCONT: the stale worker
    commits nothing (its check() and fence() refuse at once). At least 100 runs are
    paused past their lease and taken over."""
    timing = {**TIMING, "CL_LEASE_SECONDS": "1.5", "CL_HEARTBEAT": "0.3"}
    batch, wanted = 20, 100
    victim = cluster.start("victim", conf=CONF, pool="threads", concurrency=batch, **timing)
    rescuer = cluster.start("rescuer", conf=CONF, pool="threads", concurrency=batch, **timing)
    cluster.start_beat(SWEEP)
    run_ids: list[str] = []
    paused: dict[str, int] = {}  # run -> the attempt the paused victim held
    frozen: list[str] = []  # runs a transaction of the paused victim held locked
    with _stacks_and_locks_on_timeout(cluster, [victim, rescuer]):
        _sigstop_rounds(cluster, victim, rescuer, batch, wanted, run_ids, paused, frozen)
    time.sleep(1.0)  # the last resumed bodies try (and fail) to commit
    history = check(cluster, run_ids)
    stale = [e for r, a in paused.items() for e in cluster.effects(r, "commit") if e.attempt <= a]
    assert stale == []
    assert len(paused) >= wanted
    assert "automation_run_lease_lost" in victim.log()
    report(capsys, f"sigstop x{len(paused)} frozen_locked={len(frozen)}", history)


def _sigstop_rounds(
    cluster: Cluster,
    victim: Worker,
    rescuer: Worker,
    batch: int,
    wanted: int,
    run_ids: list[str],
    paused: dict[str, int],
    frozen: list[str],
) -> None:
    """The SIGSTOP scenario's rounds, until ``wanted`` runs were paused and taken over;
    ``frozen`` gets the runs left out because the paused victim held their row locked."""
    for round_no in range(2 * wanted // batch):
        if len(paused) >= wanted:
            break
        # Only the victim takes this batch (a paused worker's pending BRPOP may
        # still catch a message or two: those runs start after the rescuer resumes).
        rescuer.pause()
        try:
            batch_ids = [cluster.send("workerapp.effect", BODY_SECONDS) for _ in range(batch)]
            run_ids += batch_ids
            wait_for(
                lambda ids=batch_ids: len(_started(cluster, ids)) >= len(ids) - 3,
                30,
                what=f"round {round_no}: the victim to start its batch",
            )
            victim.pause()
            # All the victim's (the rescuer is paused), and only those surely mid-body: under
            # load the pause can come after an early body's fenced commit (that run is done,
            # nothing takes it over) or while it is inside it (the open fenced transaction
            # holds the run until the victim resumes, as documented).
            held = _mid_body(cluster, batch_ids, time.time() - BODY_SECONDS + FENCE_MARGIN)
            # Nor a run whose row a transaction of the paused victim holds locked: a claim
            # of a redelivered copy, paused between its locking read and its commit, holds
            # the run until the victim resumes, as an open fenced transaction does. Only
            # paused processes hold locks now, so the rows a SKIP LOCKED read cannot take
            # are exactly those.
            locked = _locked_rows(cluster, list(held))
            frozen += locked
            held = {r: a for r, a in held.items() if r not in locked}
        finally:
            rescuer.resume()
        try:
            wait_for(
                lambda held=held: all(
                    _started(cluster, [r]).get(r, 0) > a for r, a in held.items()
                ),
                40,
                what=f"round {round_no}: every held run taken over while the victim is paused",
            )
        except AssertionError as exc:  # what the paused victim's transactions hold
            waiting = [r for r, a in held.items() if _started(cluster, [r]).get(r, 0) <= a]
            raise AssertionError(
                f"{exc}\nnot taken over: {_rows(cluster, waiting)}\n{_open_transactions(cluster)}"
            ) from exc
        finally:
            victim.resume()
        paused.update(held)
        wait_for(lambda ids=batch_ids: all_terminal(cluster, ids), 40, what=f"round {round_no}")


#: The SIGSTOP scenario's body length, and how long before its end a body may be in its fence.
BODY_SECONDS, FENCE_MARGIN = 2.0, 0.5


def _mid_body(cluster: Cluster, run_ids: list[str], since: float) -> dict[str, int]:
    """The runs whose latest attempt started after ``since`` (time.time()) and still runs."""
    held = {}
    for run_id in run_ids:
        starts = cluster.effects(run_id, "start")
        if starts and starts[-1].at >= since and cluster.status(run_id) == "running":
            held[run_id] = starts[-1].attempt
    return held


def _locked_rows(cluster: Cluster, run_ids: list[str]) -> set[str]:
    """The runs among ``run_ids`` whose row another transaction holds locked now (read
    ``FOR UPDATE SKIP LOCKED``, then rolled back)."""
    if not run_ids:
        return set()
    with cluster.engine.connect() as conn, conn.begin() as tx:
        free = conn.execute(
            select(runs.c.id).where(runs.c.id.in_(run_ids)).with_for_update(skip_locked=True)
        ).scalars()
        locked = set(run_ids) - set(free)
        tx.rollback()
    return locked


def _rows(cluster: Cluster, run_ids: list[str]) -> list[tuple[Any, ...]]:
    """Each run's status, attempt, owner, expiry left (ms) and re-sends, for a failure."""
    now = round(time.time() * 1000)
    found = [r for r in (cluster.store.get(run_id) for run_id in run_ids) if r is not None]
    return [
        (r.id, r.status, r.attempt, r.lease_owner, (r.lease_expires_at or now) - now, r.requeues)
        for r in found
    ]


def _started(cluster: Cluster, run_ids: list[str]) -> dict[str, int]:
    """The highest started attempt of each run that started one."""
    latest: dict[str, int] = {}
    for run_id in run_ids:
        attempts = [e.attempt for e in cluster.effects(run_id, "start")]
        if attempts:
            latest[run_id] = max(attempts)
    return latest


@ON_PG_AND_PGBOUNCER
@pytest.mark.timeout(240)
def test_duplicate_storm(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """20 runs, each task id published 50 more times while it runs (1,000 duplicates):
    one body per attempt, one committed effect per run, every duplicate drained."""
    runs, copies = 20, 50
    workers = [
        cluster.start(f"w{i}", conf=CONF, pool="threads", concurrency=runs, **TIMING)
        for i in range(2)
    ]
    run_ids = [cluster.send("workerapp.effect", 4.0) for _ in range(runs)]
    wait_for(
        lambda: all(cluster.effects(r, "start") for r in run_ids), 30, what="the runs to start"
    )
    for _ in range(copies):
        for run_id in run_ids:
            cluster.send("workerapp.effect", 4.0, task_id=run_id)
    wait_for(lambda: all_terminal(cluster, run_ids), 90, what="the runs")
    deliveries = wait_for(
        lambda: _drained(workers), 120, interval=1.0, what="the duplicates to drain"
    )
    assert deliveries >= runs * (copies + 1)
    history = check(cluster, run_ids)
    for run_id in run_ids:
        attempts = [e.attempt for e in cluster.effects(run_id, "start")]
        assert len(attempts) == len(set(attempts)), f"{run_id}: a body ran twice: {attempts}"
    report(capsys, f"duplicate-storm {runs}x{copies}", history)


_TASK_LINE = re.compile(r"Task workerapp\.effect\[[0-9a-f]+\] (\w+)")
_last_drain: dict[int, tuple[int, int]] = {}


def _drained(workers: list[Worker]) -> int:
    """Deliveries received, once every one has ended and none arrived for a poll; else 0."""
    received = ended = 0
    for worker in workers:
        for outcome in _TASK_LINE.findall(worker.log()):
            if outcome == "received":
                received += 1
            else:
                ended += 1
    key = id(workers)
    previous, _last_drain[key] = _last_drain.get(key), (received, ended)
    return received if received == ended and previous == (received, ended) else 0


@ON_PG
@pytest.mark.timeout(200)
def test_worker_clock_skew(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Workers whose time.time() is off by +-5 minutes hold and lose leases correctly:
    only the database clock counts."""
    fast = cluster.start("fast", conf=CONF, CL_CLOCK_SKEW="300", **TIMING)
    cluster.start("slow", conf=CONF, CL_CLOCK_SKEW="-300", **TIMING)
    cluster.start_beat(SWEEP)
    run_ids = [cluster.send("workerapp.effect", 0.3) for _ in range(40)]
    wait_for(lambda: all_terminal(cluster, run_ids), 90, what="the skewed batch")
    # A run held across several lease lengths survives on renewals alone ...
    long_run = cluster.send("workerapp.effect", 5.0)
    wait_for(lambda: all_terminal(cluster, [long_run]), 40, what="the long run")
    long_row = cluster.store.get(long_run)
    assert long_row is not None and long_row.attempt == 1
    # ... and a stalled skewed worker still loses its lease on time.
    stall = cluster.send("workerapp.effect", 3.0)
    holder = wait_for(lambda: cluster.effects(stall, "start"), 30, what="the stall run")
    victim: Worker = fast if holder[0].pid in _pids(fast) else _other(cluster, fast)
    victim.pause()
    try:
        wait_for(
            lambda: len(cluster.effects(stall, "start")) >= 2, 40, what="a takeover of the stall"
        )
    finally:
        victim.resume()
    wait_for(lambda: all_terminal(cluster, [stall]), 40, what="the stall run")
    history = check(cluster, [*run_ids, long_run, stall])
    report(capsys, "clock-skew +-300s", history)


@ON_PG
@pytest.mark.timeout(420)
def test_kill9_during_100_chains_of_3_leased_steps(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 chains of 3 leased steps while a driver kill -9s a random worker every few
    seconds: every step commits once, every chain's last step runs exactly once, and
    every caller's AsyncResult resolves with the chain's result."""
    from celery import chain

    rng = random.Random(20261203)
    workers = [cluster.start(f"w{i}", conf=CONF, **TIMING) for i in range(3)]
    cluster.start_beat(SWEEP)

    def step(*args: Any) -> Any:
        return cluster.producer.signature("workerapp.step", args=args)

    results = [
        chain(step(i, rng.uniform(0.1, 0.3)), step(), step()).apply_async() for i in range(100)
    ]
    kills = kill_randomly(cluster, workers, rng)
    step_ids = [r.id for res in results for r in (res, res.parent, res.parent.parent)]
    before = {r.id: r.parent.id for res in results for r in (res, res.parent)}
    try:
        wait_all_terminal(cluster, step_ids, 300, "all 300 steps")
    except AssertionError as exc:  # what became of each step with no row's predecessor
        lines = []
        for step_id in (s for s in step_ids if s in before and cluster.store.get(s) is None):
            prev = cluster.store.get(before[step_id])
            said = [
                line
                for log in _logs(cluster)
                for line in log.splitlines()
                if before[step_id] in line
            ]
            lines.append(f"{step_id} after {before[step_id]}: {prev}\n  " + "\n  ".join(said))
        raise AssertionError(f"{exc}\n" + "\n".join(lines)) from None
    unresolved = []
    for i, res in enumerate(results):
        try:
            if res.get(timeout=30) != i + 3:
                unresolved.append(res.id)
        except Exception as exc:
            unresolved.append(f"{res.id}: {exc!r}")
    history = check(cluster, step_ids)
    assert kills >= 5
    assert unresolved == []
    report(capsys, f"canvas kill9 x{kills}: 100 chains x 3", history)


def _logs(cluster: Cluster) -> list[str]:
    """The logs of every worker the cluster started (killed ones included)."""
    return [w.log() for w in cluster._workers]


def _pids(worker: Worker) -> set[int]:
    """The worker's main PID and its pool children."""
    children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children")
    found = {worker.pid}
    if children.exists():
        found |= {int(p) for p in children.read_text().split()}
    return found


def _other(cluster: Cluster, not_this: Worker) -> Worker:
    return next(w for w in cluster._workers if w is not not_this and w.name != "beat")


@ON_PG
@pytest.mark.timeout(240)
def test_network_partition_while_holding_leases(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each worker reaches PostgreSQL through its own TCP proxy; the driver partitions one
    at a time (packets dropped, not refused) for longer than the lease while it holds
    leases, 100 runs in all: no check()-guarded side effect after a takeover, exactly one
    fenced commit per run, every run terminal, and no worker left hanging after healing."""
    rng = random.Random(20261203)
    proxies = [Proxy.for_url(cluster.db_url) for _ in range(2)]
    try:
        workers = [
            cluster.start(
                f"w{i}", conf=CONF, CL_LEASE_DB=via, CL_EFFECTS_DB=cluster.db_url, **TIMING
            )
            for i, (_, via) in enumerate(proxies)
        ]
        cluster.start_beat(SWEEP)  # the sweeper reaches PostgreSQL directly
        run_ids = [cluster.send("workerapp.partitioned", rng.uniform(0.3, 1.2)) for _ in range(100)]
        partitions = 0
        stop_at = time.monotonic() + 30
        while time.monotonic() < stop_at:
            time.sleep(rng.uniform(1.0, 2.0))
            proxy, _ = proxies[partitions % 2]
            proxy.partition()
            partitions += 1
            time.sleep(rng.uniform(2.5, 3.5))  # past the 2 s lease
            proxy.heal()
        healed_at = time.time()
        wait_for(lambda: all_terminal(cluster, run_ids), 120, interval=1.0, what="all 100 runs")
        # After healing, both workers serve again: no connection is left hung.
        after = [cluster.send("workerapp.partitioned", 0.1) for _ in range(20)]
        wait_for(lambda: all_terminal(cluster, after), 60, interval=0.5, what="runs after healing")
        committers = {e.pid for r in after for e in cluster.effects(r, "commit")}
        assert all(committers & _pids(w) for w in workers), "a worker stayed hung after healing"
        history = check(cluster, run_ids + after)
        overlaps = guarded_overlaps(cluster, run_ids + after)
        cut = sum("no reply from the lease database" in w.log() for w in workers)
        with capsys.disabled():
            print(
                f"\npartitions={partitions} guarded_double_effects={len(overlaps)} "
                f"workers_with_cut_connections={cut} healed_at={healed_at:.0f}"
            )
        assert overlaps == [], overlaps[:10]
        assert partitions >= 6
        report(capsys, f"partition x{partitions}", history)
    finally:
        for proxy, _ in proxies:
            proxy.close()


@contextlib.contextmanager
def _stacks_and_locks_on_timeout(cluster: Cluster, workers: list[Worker]) -> Iterator[None]:
    """On a timed-out wait: every worker's thread stacks into its log (the test app dumps
    them on SIGUSR2) and the lease database's open transactions and lock waits into the
    failure, so an intermittent stall names what each process was waiting for."""
    try:
        yield
    except AssertionError as exc:
        for worker in workers:
            worker.resume()
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGUSR2)
        time.sleep(1.0)  # the dumps are written by each worker's own signal handler
        logs = ", ".join(str(worker.log_path) for worker in workers)
        raise AssertionError(f"{exc}\n{_open_transactions(cluster)}\nstacks: {logs}") from exc


def _open_transactions(cluster: Cluster) -> str:
    """The lease database's open transactions (MySQL/MariaDB: with their row locks and lock
    waits; PostgreSQL: each session's state and any lock it waits for), one per line."""
    if cluster.engine.dialect.name == "mysql":
        queries = [
            "SELECT trx_id, trx_state, trx_started, trx_mysql_thread_id, trx_rows_locked,"
            " trx_rows_modified, LEFT(trx_query, 200) FROM information_schema.INNODB_TRX",
            "SELECT * FROM information_schema.INNODB_LOCK_WAITS",
        ]
    else:
        queries = [
            "SELECT pid, state, xact_start, wait_event_type, wait_event, LEFT(query, 200)"
            " FROM pg_stat_activity WHERE datname = current_database() AND xact_start IS NOT NULL"
            " AND pid <> pg_backend_pid()",
            "SELECT pid, locktype, mode, relation::regclass FROM pg_locks WHERE NOT granted",
        ]
    lines = []
    with cluster.engine.connect() as conn:
        for query in queries:
            lines.append(f"-- {query}")
            lines += [repr(tuple(row)) for row in conn.execute(text(query))]
    return "\n".join(lines)
