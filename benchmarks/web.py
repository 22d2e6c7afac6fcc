"""The web view at a million rows: server time of its pages on SQLite and PostgreSQL.

Usage: ``python -m benchmarks.web [--rows N] [--requests N] [--backend pg|sqlite|both]``.
PostgreSQL comes from ``CELERY_LEASE_BENCH_PG_URL`` (else ``CELERY_LEASE_TEST_PG_URL``;
an admin URL: a scratch database is created and dropped); SQLite is a file in a
temporary directory.

The table is made by ``celery lease migrate`` and filled in one ``INSERT .. SELECT``:
``--rows`` runs (default 1,000,000) over 10 task names, created over the last 14 days
(90 % succeeded, 6 % failed, 2 % cancelled, the rest queued, retrying or running with a
live lease); an ended run's ``lease_expires_at`` and ``finished_at`` are its end, as the
store writes them. PostgreSQL then gets ``VACUUM ANALYZE`` (what autovacuum does after a bulk
load); SQLite gets nothing.

Each page is requested ``--requests`` times (default 50) through Starlette's TestClient
in this process (routing, the SQL, Jinja2 rendering; no network), after 3 warm-up
requests: median and p95 in ms, target <= 200 ms. The statements one request of each page
sends are captured and printed with their plans (PostgreSQL ``EXPLAIN (ANALYZE,
BUFFERS)``, rolled back; SQLite ``EXPLAIN QUERY PLAN``); a plan that scans the table
itself (not an index) is counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import create_engine, text

from celery_lease.migrations import upgrade
from celery_lease.store import LeaseStore
from celery_lease.web import create_app
from tests.helpers import scratch_database

from .common import REPO, check_loopback, pg_admin_url
from .retention import COLUMNS, SEQ_SCAN, captured, explain

DAY_MS = 86_400_000
DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- web:begin -->", "<!-- web:end -->"

#: The pages measured: label -> path (the deep page is filled in from the data).
PAGES = {
    "overview": "/",
    "runs, newest": "/runs",
    "runs, status failed": "/runs?status=failed",
    "runs, task": "/runs?task=bench.task3",
    "runs, task + status": "/runs?task=bench.task3&status=cancelled",
    "runs, key prefix": "/runs?key=bench.task7:run-12",
    "runs, last hour": "/runs?age=1h",
    "runs, page 1,000 (keyset)": "",
    "task page": "/task?name=bench.task3",
    "bulk rerun confirmation (a task's failed runs)": (
        "/confirm?action=rerun-runs&task=bench.task3&status=failed"
    ),
}
#: The write token the view runs with (the bulk rerun's confirmation needs one).
TOKEN = "bench-token-0123456789abcdef"


def _select(series: str, n: int, now: int) -> str:
    """SELECT of ``n`` runs from ``series`` (a column ``g``), created over 14 days."""
    step = 14 * DAY_MS // n
    created = f"({now} - g * {step})"
    status = (
        "CASE WHEN g % 100 < 90 THEN 'succeeded' WHEN g % 100 < 96 THEN 'failed' "
        "WHEN g % 100 < 98 THEN 'cancelled' WHEN g % 500 = 98 THEN 'running' "
        "WHEN g % 500 = 99 THEN 'retrying' WHEN g % 100 = 98 THEN 'succeeded' "
        "ELSE 'queued' END"
    )
    task = "'bench.task' || (g % 10)"
    return (
        f"SELECT {task} || ':run-' || g, {task}, {status}, 'host:1:' || g, "
        f"{created} + 1000, 30000, {created}, 1, 5, {created}, NULL, {created}, "
        f"{created} + 1000, CASE WHEN g % 100 >= 90 AND g % 100 < 96 THEN "
        "'ValueError: boom' END, CASE WHEN g % 100 >= 90 AND g % 100 < 96 THEN "
        "'task_error' WHEN g % 100 >= 96 AND g % 100 < 98 THEN 'cancelled' END, "
        f"NULL, 'task-' || g, NULL, NULL, {created}, {created} + 1000 FROM {series}"
    )


def fill(store: LeaseStore, url: str, rows: int) -> float:
    """Bulk-load the rows (then fix the live ones' lease and end times); seconds taken."""
    now = store.now_ms()
    started = time.perf_counter()
    fix = (
        "UPDATE celery_lease_runs SET finished_at = NULL, lease_expires_at = "
        f"{now} + 600000 WHERE status IN ('queued', 'running', 'retrying')"
    )
    if store.db.dialect == "postgresql":
        engine = create_engine(url)
        with engine.begin() as conn:
            series = f"generate_series(1, {rows}) AS s(g)"
            insert = f"INSERT INTO celery_lease_runs ({COLUMNS}) {_select(series, rows, now)}"
            conn.execute(text(insert.replace(":run-", r"\:run-")))  # not a bind parameter
            conn.execute(text(fix))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE celery_lease_runs"))
        engine.dispose()
    else:
        raw = store.engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("BEGIN")
            cursor.execute(
                "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?) "
                f"INSERT INTO celery_lease_runs ({COLUMNS}) {_select('s', rows, now)}",
                (rows,),
            )
            cursor.execute(fix)
            cursor.execute("COMMIT")
        finally:
            raw.close()
    return time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def deep_page(client: Any, pages: int) -> str:
    """The path of the runs page ``pages`` pages down, followed by its ``older`` links."""
    path = "/api/runs"
    for _ in range(pages - 1):
        path = "/api/runs?" + client.get(path).json()["next"]
    return path.replace("/api/runs", "/runs")


def measure(name: str, url: str, rows: int, requests: int) -> dict[str, Any]:
    """Load the table, then time every page and capture its plans."""
    from starlette.testclient import TestClient

    upgrade(url)
    store = LeaseStore.from_url(url)
    out: dict[str, Any] = {"name": name, "fill_s": fill(store, url, rows), "pages": {}}
    app = Celery("bench", set_as_current=False)
    app.conf.update(lease_database_url=url, broker_url="memory://")
    client = TestClient(create_app(app, store=store, token=TOKEN), base_url="http://localhost")
    pages = dict(PAGES)
    pages["runs, page 1,000 (keyset)"] = deep_page(client, 1000)
    plans: list[tuple[str, str, str]] = []
    for label, path in pages.items():
        for _ in range(3):
            assert client.get(path).status_code == 200, path
        times = []
        for _ in range(requests):
            started = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, path
        out["pages"][label] = (statistics.median(times), _pct(times, 0.95))
        with captured(store) as seen:
            client.get(path)
        for statement, params in seen:
            if statement.lstrip().upper().startswith(("SELECT", "WITH")):
                plans.append((label, statement, explain(store, url, statement, params)))
    out["plans"] = plans
    out["seq_scans"] = [label for label, _, plan in plans if SEQ_SCAN.search(plan)]
    store.dispose()
    return out


def report(results: list[dict[str, Any]], rows: int, requests: int) -> str:
    """The figures as Markdown, then every plan."""
    lines = [
        f"{rows:,} runs; {requests} requests per page, server time in ms (median / p95); "
        "target <= 200 ms.",
        "",
        "| page | " + " | ".join(r["name"] for r in results) + " |",
        "| --- | " + " | ".join("---" for _ in results) + " |",
    ]
    for label in PAGES:
        cells = [f"{r['pages'][label][0]:.1f} / {r['pages'][label][1]:.1f}" for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        "| plans scanning the table | "
        + " | ".join(str(len(r["seq_scans"])) for r in results)
        + " |"
    )
    lines.append("| bulk load (s) | " + " | ".join(f"{r['fill_s']:.0f}" for r in results) + " |")
    for r in results:
        worst = max(p95 for _, p95 in r["pages"].values())
        verdict = "met" if worst <= 200 and not r["seq_scans"] else "missed"
        lines.append(f"\n{r['name']}: worst p95 {worst:.1f} ms: target **{verdict}**.")
    for r in results:
        lines += ["", f"### Plans on {r['name']}", ""]
        for label, statement, plan in r["plans"]:
            lines += [f"{label}:", "```", " ".join(statement.split()), "--", plan, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.web", description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--backend", choices=("pg", "sqlite", "both"), default="both")
    args = parser.parse_args(argv)
    results = []
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as folder:
            url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
            results.append(measure("SQLite", url, args.rows, args.requests))
    if args.backend in ("pg", "both"):
        admin = pg_admin_url()
        if admin is None:
            raise SystemExit("set CELERY_LEASE_BENCH_PG_URL (or CELERY_LEASE_TEST_PG_URL)")
        check_loopback(admin)
        with scratch_database(admin, prefix="clbench_") as url:
            results.append(measure("PostgreSQL", url, args.rows, args.requests))
    print(report(results, args.rows, args.requests))
    return 0 if all(not r["seq_scans"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
