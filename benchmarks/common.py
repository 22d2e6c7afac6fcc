"""Shared plumbing: service URLs, throwaway databases, worker processes, bounded waits."""

from __future__ import annotations

import os
import statistics
import uuid
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers import Worker  # one process wrapper, shared with the test suite
from tests.helpers import wait_for as wait_for  # re-exported for the benchmarks

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
BENCH_APP = "benchmarks.benchapp"

#: Admin URL of a PostgreSQL server; each run creates its own database and drops it.
PG_ENV = "CELERY_LEASE_BENCH_PG_URL"
#: A Redis URL (with its own db number); only keys named after this run are touched.
REDIS_ENV = "CELERY_LEASE_BENCH_REDIS_URL"


def pg_admin_url() -> str | None:
    """The PostgreSQL admin URL (falls back to the test suite's variable)."""
    return os.environ.get(PG_ENV) or os.environ.get("CELERY_LEASE_TEST_PG_URL") or None


PGBOUNCER_ENV = "CELERY_LEASE_BENCH_PGBOUNCER_URL"


def pgbouncer_url() -> str | None:
    """A PgBouncer (transaction mode, wildcard database) in front of the benchmark PostgreSQL."""
    return (
        os.environ.get(PGBOUNCER_ENV) or os.environ.get("CELERY_LEASE_TEST_PGBOUNCER_URL") or None
    )


#: A RabbitMQ URL; only the queue and exchange named after each run are touched.
AMQP_ENV = "CELERY_LEASE_BENCH_AMQP_URL"


def amqp_url() -> str | None:
    """The RabbitMQ URL (falls back to the test suite's variable)."""
    return os.environ.get(AMQP_ENV) or os.environ.get("CELERY_LEASE_TEST_AMQP_URL") or None


def redis_url() -> str | None:
    """The Redis URL (falls back to the test suite's variable)."""
    return os.environ.get(REDIS_ENV) or os.environ.get("CELERY_LEASE_TEST_REDIS_URL") or None


def check_loopback(url: str) -> None:
    """Refuse to benchmark against anything but this machine."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host not in (None, "127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"benchmarks use loopback services only, not {host!r}")


def unique(prefix: str) -> str:
    """A short unique name for a database, queue or directory."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def worker(
    env: dict[str, str],
    log_path: Path,
    name: str,
    *,
    pool: str = "prefork",
    concurrency: int = 2,
    loglevel: str = "WARNING",
) -> Worker:
    """``celery -A benchmarks.benchapp worker`` with the given pool, run from the log's folder."""
    return Worker(
        env,
        log_path,
        name=name,
        app=BENCH_APP,
        pool=pool,
        concurrency=concurrency,
        loglevel=loglevel,
        cwd=log_path.parent,
    )


def celery_process(command: list[str], env: dict[str, str], log_path: Path, name: str) -> Worker:
    """``celery -A benchmarks.benchapp <command...>`` (beat, say), run from the log's folder."""
    return Worker(env, log_path, name=name, app=BENCH_APP, command=command, cwd=log_path.parent)


def read_marks(folder: Path) -> list[tuple[str, list[str]]]:
    """Every mark line the worker processes wrote into ``folder`` (``KIND field...``)."""
    marks: list[tuple[str, list[str]]] = []
    for path in sorted(folder.glob("marks-*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts:
                marks.append((parts[0], parts[1:]))
    return marks


def marked_section(page: str, begin: str, end: str) -> str:
    """The part of ``page`` from the ``begin`` marker to the ``end`` marker, both kept
    ("" when either is missing): a section of ``docs/benchmarks.md`` measured apart."""
    if begin in page and end in page:
        return page[page.index(begin) : page.index(end) + len(end)]
    return ""


def median(values: list[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def fmt(value: Any, digits: int = 1) -> str:
    """A number for a table cell."""
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:,.{digits}f}"
    return str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def empty_lease_table(url: str) -> None:
    """Create the lease table at ``url`` if missing, and empty it (a fresh drain)."""
    from sqlalchemy import text

    from celery_lease import LeaseStore

    store = LeaseStore.from_url(url)
    store.create_schema()
    with store.engine.begin() as conn:
        conn.execute(text("TRUNCATE celery_lease_runs"))
    store.dispose()


def pg_settings(url: str) -> str:
    """The server's durability settings, as stated on the page."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    names = ("fsync", "synchronous_commit", "full_page_writes", "wal_level", "shared_buffers")
    with engine.connect() as conn:
        values = {n: str(conn.execute(text(f"SHOW {n}")).scalar()) for n in names}
    engine.dispose()
    return ", ".join(f"`{n} = {v}`" for n, v in values.items())
