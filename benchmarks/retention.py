"""Retention at scale: 1,000,000 finished rows plus 10,000 live ones, on PostgreSQL and SQLite.

Usage: ``python -m benchmarks.retention [--finished N] [--live N] [--claims N]
[--backend pg|sqlite|both] [--write]``. PostgreSQL comes from
``CELERY_LEASE_BENCH_PG_URL`` (an admin URL: a throwaway database is created
and dropped); SQLite is a file in a temporary directory.

The table is made by ``celery lease migrate`` (``celery_lease.migrations.upgrade``)
and filled in one ``INSERT .. SELECT`` over a generated series: finished rows
(90 % succeeded, 7 % failed, 3 % cancelled) whose ``finished_at`` is spread
evenly over the last 14 days, so that with ``lease_retention`` = 7 days half of
them are due, plus live rows (running with unexpired leases, some retrying).
PostgreSQL then gets ``VACUUM ANALYZE`` (what autovacuum does after a bulk load);
SQLite gets nothing (the library never runs ``ANALYZE``).

Measured, each the median of several calls unless said otherwise:

- one sweep (``celery_lease.sweeper.sweep``: expired leases, stranded runs, then
  retention) with nothing due (``lease_retention`` = 15 days), with one batch
  due (the per-sweep limit set to one batch), and facing a backlog with its
  defaults (at most 10 batches, none started past its 25 ms time budget);
- one purge batch (``LeaseStore.purge_finished``, 1,000 rows): ms and rows/s;
- ``celery lease stats`` (``LeaseStore.stats``) and a dry-run count;
- a claim's latency (new run id, ``LeaseStore.claim``) while another process
  purges every due row, in blocks of 100 claims alternating with blocks where
  that purge is paused between batches (idle); p50/p95/p99 and the p50 ratio,
  for ``celery lease purge`` as it runs by default (throttled) and with
  ``--no-throttle``.

The statements are captured as the store sends them (SQLAlchemy's
``before_cursor_execute``) and printed with ``EXPLAIN`` (PostgreSQL: ``EXPLAIN
(ANALYZE, BUFFERS)`` inside a transaction that is rolled back; SQLite:
``EXPLAIN QUERY PLAN``).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import create_engine, event, text

from celery_lease import retention
from celery_lease.migrations import upgrade
from celery_lease.store import PURGE_BATCH, LeaseStore
from celery_lease.sweeper import sweep
from tests.helpers import scratch_database

from .common import REPO, check_loopback, marked_section, pg_admin_url, pg_settings

DAY_MS = 86_400_000
RETENTION_S = 7 * 86_400.0
DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- retention:begin -->", "<!-- retention:end -->"

COLUMNS = (
    "id, task_name, status, lease_owner, lease_expires_at, lease_ms, heartbeat_at, attempt, "
    "max_attempts, available_at, cancel_requested_at, started_at, finished_at, last_error, "
    "failure_code, concurrency_key, task_id, payload, payload_content_type, created_at, updated_at"
)


def _finished_select(series: str, n: int, now: int) -> str:
    """SELECT of ``n`` finished rows from ``series`` (a column ``g``), spread over 14 days."""
    step = 14 * DAY_MS // n
    status = (
        "CASE WHEN g % 100 < 90 THEN 'succeeded' WHEN g % 100 < 97 THEN 'failed' "
        "ELSE 'cancelled' END"
    )
    fin = f"({now} - g * {step})"
    return (
        f"SELECT 'done-' || g, 'bench.task', {status}, 'host:1:' || g, {fin}, 30000, {fin} - 5, "
        f"1, 5, {fin} - 1000, NULL, {fin} - 1000, {fin}, "
        "CASE WHEN g % 100 >= 90 AND g % 100 < 97 THEN 'ValueError: boom' END, "
        "CASE WHEN g % 100 >= 90 AND g % 100 < 97 THEN "
        "CASE WHEN g % 7 = 0 THEN 'lease_expired' ELSE 'task_error' END "
        "WHEN g % 100 >= 97 THEN 'cancelled' END, "
        f"NULL, 'done-' || g, NULL, NULL, {fin} - 1000, {fin} FROM {series}"
    )


def _live_select(series: str, now: int) -> str:
    """SELECT of live rows: running with a lease 10 minutes long, every tenth retrying."""
    status = "CASE WHEN g % 10 = 0 THEN 'retrying' ELSE 'running' END"
    return (
        f"SELECT 'live-' || g, 'bench.task', {status}, 'host:2:' || g, {now} + 600000, 600000, "
        f"{now}, 1, 5, {now} + 600000, NULL, {now}, NULL, NULL, NULL, NULL, 'live-' || g, "
        f"NULL, NULL, {now}, {now} FROM {series}"
    )


def fill(store: LeaseStore, url: str, finished: int, live: int) -> float:
    """Bulk-load the rows; seconds taken."""
    now = store.now_ms()
    started = time.perf_counter()
    if store.db.dialect == "postgresql":
        series = "generate_series(1, {n}) AS s(g)"
        # A plain engine: the lease engine's waits are bounded for lease traffic.
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO celery_lease_runs ({COLUMNS}) "
                    + _finished_select(series.format(n=finished), finished, now)
                )
            )
            conn.execute(
                text(
                    f"INSERT INTO celery_lease_runs ({COLUMNS}) "
                    + _live_select(series.format(n=live), now)
                )
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE celery_lease_runs"))
        engine.dispose()
    else:
        raw = store.engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("BEGIN")
            for n, select in (
                (finished, _finished_select("s", finished, now)),
                (live, _live_select("s", now)),
            ):
                cursor.execute(
                    "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?) "
                    f"INSERT INTO celery_lease_runs ({COLUMNS}) {select}",
                    (n,),
                )
            cursor.execute("COMMIT")
        finally:
            raw.close()
    return time.perf_counter() - started


@contextmanager
def captured(store: LeaseStore) -> Iterator[list[tuple[str, Any]]]:
    """The statements ``store`` sends inside the block, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def listen(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: Any
    ) -> None:
        seen.append((statement, params))

    engines = {id(e): e for e in store.engines}.values()
    for engine in engines:
        event.listen(engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", listen)


def explain(store: LeaseStore, url: str, statement: str, params: Any) -> str:
    """The plan of one captured statement (executed and rolled back on PostgreSQL)."""
    if store.db.dialect == "postgresql":
        import psycopg

        conninfo = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo) as conn, conn.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {statement}", params)
            plan = "\n".join(str(row[0]) for row in cursor.fetchall())
            conn.rollback()
        return plan
    raw = store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute(f"EXPLAIN QUERY PLAN {statement}", params)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())
    finally:
        raw.close()


SEQ_SCAN = re.compile(r"Seq Scan on celery_lease_runs|SCAN celery_lease_runs(?! USING)")


def timed(fun: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median milliseconds of ``repeat`` calls, and the last call's result."""
    times: list[float] = []
    result: Any = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fun()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def _app(url: str, retention_s: float) -> Celery:
    app = Celery("bench", set_as_current=False)
    app.conf.update(lease_database_url=url, lease_retention=retention_s, broker_url="memory://")
    return app


def _purger(url: str, done: Any, older_than: float, throttle: bool, go: Any) -> None:
    """A forked ``celery lease purge --older-than ...``: every due row, in batches.

    Between batches it waits while ``go`` is clear: the parent's idle blocks.
    """
    store = LeaseStore.from_url(url)
    report = retention.purge(store, older_than, throttle=throttle, progress=lambda _: go.wait())
    done.put(report.total)
    store.dispose()


def _claims(store: LeaseStore, n: int, alive: Callable[[], bool] = lambda: True) -> list[float]:
    latencies: list[float] = []
    for _ in range(n):
        if not alive():
            break
        run_id = f"lat-{uuid.uuid4().hex}"
        started = time.perf_counter()
        store.claim(run_id, "bench:1:x", task_name="bench.task", lease_ms=60_000, max_attempts=5)
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def _lat(values: list[float]) -> str:
    return " / ".join(f"{_pct(values, q):.2f}" for q in (0.5, 0.95, 0.99))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def claim_latency(store: LeaseStore, url: str, claims: int) -> dict[str, Any]:
    """Claims while a purge runs in another process, and idle, in alternating blocks.

    Blocks of 100 claims alternate between the purge running and the purge
    paused between two batches, so load from elsewhere on the machine falls on
    both sides alike. Two purges, one after the other: ``--no-throttle`` over
    the rows older than 10.5 days, then the default (throttled) one over the
    rest of the due rows.
    """
    _claims(store, 200)  # warm: connections, prepared statements
    block = 100
    out: dict[str, Any] = {}
    for label, older_than, throttle in (
        ("fast", 1.5 * RETENTION_S, False),
        ("throttled", RETENTION_S, True),
    ):
        ctx = multiprocessing.get_context("fork")
        done, go = ctx.Queue(), ctx.Event()
        store.dispose()  # the child must not share pooled connections
        child = ctx.Process(target=_purger, args=(url, done, older_than, throttle, go))
        go.set()
        child.start()
        time.sleep(0.3)  # the purge is under way
        idle: list[float] = []
        during: list[float] = []
        busy = 0.0
        while child.is_alive() and len(during) < claims:
            go.set()
            started = time.perf_counter()
            during += _claims(store, block, child.is_alive)
            busy += time.perf_counter() - started
            go.clear()
            time.sleep(0.1)  # the batch in flight ends; the purge waits
            idle += _claims(store, block)
        started = time.perf_counter()
        go.set()  # the rest of the purge, unmeasured claims aside
        child.join(900)
        busy += time.perf_counter() - started
        out[label] = {
            "idle": idle,
            "during": during,
            "purged": done.get(timeout=10),
            "purge_seconds": busy,
        }
    return out


def run_backend(name: str, url: str, finished: int, live: int, claims: int) -> dict[str, Any]:
    """Every measurement on one database; the figures and the plans."""
    upgrade(url)
    store = LeaseStore.from_url(url)
    fill_s = fill(store, url, finished, live)
    out: dict[str, Any] = {"name": name, "fill_s": fill_s, "plans": []}
    week_ms = round(RETENTION_S * 1000)

    # Plans of the statements as the store sends them.
    with captured(store) as seen:
        sweep(_app(url, RETENTION_S), store, purge_limit=PURGE_BATCH)
        store.reads.stats()
        store.reads.count_finished("succeeded", week_ms)
    for statement, params in seen:
        if statement.lstrip().upper().startswith(("SELECT", "DELETE", "UPDATE", "WITH")):
            plan = explain(store, url, statement, params)
            out["plans"].append((statement, plan))
    out["seq_scans"] = sum(bool(SEQ_SCAN.search(p)) for _, p in out["plans"])

    out["stats_ms"], _ = timed(store.stats, 5)
    out["count_ms"], _ = timed(lambda: retention.count(store, RETENTION_S), 3)
    far = _app(url, 15 * 86_400.0)
    out["sweep_idle_ms"], _ = timed(lambda: sweep(far, store), 5)
    app = _app(url, RETENTION_S)
    out["sweep_batch_ms"], report = timed(lambda: sweep(app, store, purge_limit=PURGE_BATCH), 5)
    out["sweep_batch_rows"] = sum(report.purged.values())
    out["sweep_full_ms"], report = timed(lambda: sweep(app, store), 3)
    out["sweep_full_rows"] = sum(report.purged.values())
    batch_ms, removed = timed(lambda: store.purge_finished("succeeded", week_ms, PURGE_BATCH), 20)
    out["batch_ms"], out["batch_rows"] = batch_ms, removed
    out["batch_rows_s"] = removed / (batch_ms / 1000)
    out["latency"] = claim_latency(store, url, claims)
    store.dispose()
    return out


def report(results: list[dict[str, Any]], finished: int, live: int) -> str:
    """The figures as Markdown: one table, the claim latencies, the plans."""
    lines = [
        f"{finished:,} finished rows (finished over the last 14 days, half of them older "
        f"than `lease_retention` = 7 days) + {live:,} live ones; batches of {PURGE_BATCH:,} "
        f"rows; a sweep deletes at most {retention.SWEEP_PURGE_LIMIT:,} rows and starts no "
        f"batch past {retention.SWEEP_PURGE_BUDGET * 1000:.0f} ms of deleting.",
        "",
        "| measure | " + " | ".join(r["name"] for r in results) + " | target |",
        "| --- | " + " | ".join("---" for _ in results) + " | --- |",
    ]

    def row(label: str, key: str, fmt: str, target: str = "") -> None:
        cells = [fmt.format(r[key]) for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")

    row("bulk load (s)", "fill_s", "{:.1f}")
    row("sweep, nothing due (ms)", "sweep_idle_ms", "{:.1f}", "<= 50 ms")
    row("sweep deleting one batch (ms)", "sweep_batch_ms", "{:.1f}", "<= 50 ms")
    row("sweep facing a backlog (ms)", "sweep_full_ms", "{:.1f}", "<= 50 ms")
    row("rows deleted by that sweep", "sweep_full_rows", "{:,}")
    row("purge batch (ms)", "batch_ms", "{:.1f}")
    row("purge rows/s (one batch)", "batch_rows_s", "{:,.0f}")
    row("`lease stats` (ms)", "stats_ms", "{:.1f}")
    row("`lease purge --dry-run` count (ms)", "count_ms", "{:.1f}")
    row("plans with a seq scan of the table", "seq_scans", "{}", "0")
    for r in results:
        lat = r["latency"]
        for label in ("throttled", "fast"):
            idle, during = lat[label]["idle"], lat[label]["during"]
            r[f"{label}_idle"] = _lat(idle)
            r[f"{label}_lat"] = _lat(during)
            r[f"{label}_ratio"] = _pct(during, 0.5) / _pct(idle, 0.5) if idle and during else 0.0
            r[f"{label}_claims"] = len(during)
            r[f"{label}_purged"] = lat[label]["purged"]
            r[f"{label}_rate"] = lat[label]["purged"] / max(lat[label]["purge_seconds"], 1e-9)
        r["ratio"] = r["throttled_ratio"]
    row("`lease purge`: claim ms idle, p50 / p95 / p99", "throttled_idle", "{}")
    row("`lease purge`: claim ms during, p50 / p95 / p99", "throttled_lat", "{}")
    row("claim p50 during `lease purge` / idle", "throttled_ratio", "{:.2f}", "<= 2")
    row("claims measured during it", "throttled_claims", "{}")
    row("rows that purge deleted", "throttled_purged", "{:,}")
    row("its rows/s while running", "throttled_rate", "{:,.0f}")
    row("`--no-throttle`: claim ms idle, p50 / p95 / p99", "fast_idle", "{}")
    row("`--no-throttle`: claim ms during, p50 / p95 / p99", "fast_lat", "{}")
    row("claim p50 during `--no-throttle` / idle", "fast_ratio", "{:.2f}")
    row("claims measured during it", "fast_claims", "{}")
    row("rows that purge deleted", "fast_purged", "{:,}")
    row("its rows/s while running", "fast_rate", "{:,.0f}")
    for r in results:
        lines += ["", f"### Plans on {r['name']}", ""]
        for statement, plan in r["plans"]:
            lines += ["```", " ".join(statement.split()), "--", plan, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    """Met or missed, per target and database."""
    lines = []
    for r in results:
        checks = [
            ("sweep <= 50 ms (nothing due)", r["sweep_idle_ms"] <= 50),
            ("sweep <= 50 ms (one batch due)", r["sweep_batch_ms"] <= 50),
            ("sweep <= 50 ms (backlog)", r["sweep_full_ms"] <= 50),
            ("claim p50 during `lease purge` <= 2x idle", r["ratio"] <= 2),
            ("no seq scan of the table in any plan", r["seq_scans"] == 0),
        ]
        text_ = "; ".join(f"{name}: **{'met' if ok else 'missed'}**" for name, ok in checks)
        lines.append(f"- {r['name']}: {text_}.")
    return lines


def section(body: str, results: list[dict[str, Any]], command: str, settings: str) -> str:
    """The page section, between the markers ``run_all`` keeps."""
    parts = [
        BEGIN,
        "## Appendix: retention at a million rows",
        "",
        "Measured apart (it loads a million rows), with:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"On {datetime.date.today().isoformat()}, the same machine. PostgreSQL: "
        f"{settings}. What each row measures is in `benchmarks/retention.py`'s "
        "docstring. Claim latency is measured in blocks of 100 claims alternating "
        "between another process purging and that purge paused (*idle*).",
        "",
        *verdicts(results),
        "",
        body.split("\n### Plans", 1)[0].rstrip(),
        "",
        "A sweep deletes batches until its 25 ms budget or 10,000 rows, so its time "
        "stays bounded whatever the backlog; the rest waits for the next sweep. Faster "
        "deployments shorten `lease_sweep_interval` or run `celery lease purge` from "
        "cron. `--no-throttle` can cost PostgreSQL claims more than 2x, which is why "
        "`celery lease purge` throttles by default. The script prints the query plans "
        "of every statement a sweep, a purge and `lease stats` send.",
        "",
        END,
    ]
    return "\n".join(parts)


def write_section(text_: str) -> None:
    """Put the section into ``docs/benchmarks.md`` (replacing an older one)."""
    page = DOC.read_text()
    old = marked_section(page, BEGIN, END)
    if old:
        page = page.replace(old, text_)
    else:
        anchor = "<!-- cpu:begin -->"  # the appendix: before the CPU accounting, or last
        if anchor in page:
            page = page.replace(anchor, text_ + "\n\n" + anchor, 1)
        else:
            page = page.rstrip() + "\n\n" + text_ + "\n"
    DOC.write_text(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retention", description=__doc__)
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--backend", choices=("pg", "sqlite", "both"), default="both")
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args(argv)
    settings = "not used"
    results: list[dict[str, Any]] = []
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as folder:
            url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
            results.append(run_backend("SQLite", url, args.finished, args.live, args.claims))
    if args.backend in ("pg", "both"):
        admin = pg_admin_url()
        if not admin:
            raise SystemExit("set CELERY_LEASE_BENCH_PG_URL (or CELERY_LEASE_TEST_PG_URL)")
        check_loopback(admin)
        with scratch_database(admin, prefix="clbench_") as url:
            settings = pg_settings(url)
            results.append(run_backend("PostgreSQL", url, args.finished, args.live, args.claims))
    body = report(results, args.finished, args.live)
    print(body, flush=True)
    if args.write:
        command = "python -m benchmarks.retention " + " ".join(argv or sys.argv[1:])
        write_section(section(body, results, command.strip(), settings))
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
