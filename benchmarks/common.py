"""Shared plumbing: service URLs, throwaway databases, worker processes, bounded waits."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers import wait_for  # shared with the test suite

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent

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


class Proc:
    """A ``celery`` subprocess in its own session (PID = group id), stopped by that PID."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, name: str) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", *args],
            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
        self.pid = self.proc.pid

    @classmethod
    def worker(
        cls,
        env: dict[str, str],
        log_path: Path,
        name: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        loglevel: str = "WARNING",
    ) -> Proc:
        """``celery -A benchmarks.benchapp worker`` with the given pool."""
        args = [
            "-A",
            "benchmarks.benchapp",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "-l",
            loglevel,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ]
        return cls(args, env, log_path, name)

    def log(self) -> str:
        """What the process has logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> Proc:
        """Block until the worker logs ``ready.`` (needs ``-l INFO``)."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log()[-3000:]}")
            return " ready." in self.log()

        wait_for(ready, timeout, 0.05, f"{self.name} to be ready")
        return self

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group this object created."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill9(self) -> None:
        """SIGKILL the whole group and reap the main process."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (warm shutdown), then SIGKILL the group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self._log.close()


def read_marks(folder: Path) -> list[tuple[str, list[str]]]:
    """Every mark line the worker processes wrote into ``folder`` (``KIND field...``)."""
    marks: list[tuple[str, list[str]]] = []
    for path in sorted(folder.glob("marks-*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts:
                marks.append((parts[0], parts[1:]))
    return marks


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
