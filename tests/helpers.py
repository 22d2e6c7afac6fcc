"""Test helpers: real ``celery worker`` subprocesses and bounded waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent


def wait_for(
    predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def scratch_database(admin_url: str, prefix: str = "cl_") -> Iterator[str]:
    """Create a fresh PostgreSQL or MySQL/MariaDB database, yield its URL, drop it afterwards.

    Shared by the test fixtures and the benchmark scripts.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    if engine.dialect.name == "postgresql":
        create, drop = f'CREATE DATABASE "{name}"', f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
    else:
        create, drop = f"CREATE DATABASE `{name}`", f"DROP DATABASE IF EXISTS `{name}`"
    with engine.connect() as conn:
        conn.execute(text(create))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with engine.connect() as conn:
            conn.execute(text(drop))
        engine.dispose()


def plain_engine(url: str) -> Any:
    """An application's own engine on ``url``, safe behind a transaction pooler and across
    a server restart, as docs/deployment.md advises.

    psycopg prepares a statement after its fifth run; behind PgBouncer in
    transaction mode that prepared name is missing on the next server
    connection. Any engine of your own there needs ``prepare_threshold=None``.
    ``pool_pre_ping`` replaces a pooled connection the server dropped.
    """
    from sqlalchemy import create_engine

    if url.startswith("postgresql+psycopg:"):
        return create_engine(url, connect_args={"prepare_threshold": None}, pool_pre_ping=True)
    return create_engine(url, pool_pre_ping=True)


@contextlib.contextmanager
def driver_statements(engines: Any) -> Iterator[list[tuple[int, str]]]:
    """Record ``(thread id, SQL)`` for every statement the database driver executes.

    Recorded below SQLAlchemy, so statements celery-lease runs on the raw
    DBAPI cursor count too. SQLite: the connection's trace callback (pooled
    connections are dropped first so new ones get it). psycopg and PyMySQL:
    their cursor's ``execute`` is wrapped for the duration, and on psycopg so
    is the one call that sends a hot-path statement through libpq
    (``LibpqStatement._exec``; its ``PREPARE``, once per connection, is not
    counted). What runs while the pool opens a connection (pragmas, session
    settings, the backend's pid) is not recorded: it is paid once per pooled
    connection, not per task, and a loaded machine opens a second one whenever
    a heartbeat tick and a task's statement overlap. Shared by the tests and
    ``benchmarks/sql.py``. The ``set_config`` call that bounds each psycopg
    statement is not counted: it travels in the statement's own round trip (the
    same query, or pipeline).
    """
    from sqlalchemy import event

    engines = list(engines)
    seen: list[tuple[int, str]] = []

    connecting = threading.local()

    def record(sql: Any) -> None:
        if getattr(connecting, "on", False):
            return
        text = sql.decode() if isinstance(sql, bytes) else str(sql)
        if text.startswith("SELECT set_config('statement_timeout'"):
            _, sent_with, text = text.partition("; ")
            if not sent_with:
                return  # pipelined ahead of the statement it bounds
        seen.append((threading.get_ident(), text))

    def opening(dbapi_connection: Any, record_: Any) -> None:
        connecting.on = True

    def opened(dbapi_connection: Any, record_: Any) -> None:
        connecting.on = False

    dialect = engines[0].dialect.name
    restore: list[tuple[Any, str, Any]] = []
    listeners: list[tuple[Any, Any]] = []
    for engine in engines:
        # First and last of the pool's connect listeners: the store's session settings
        # run between them.
        event.listen(engine, "connect", opening, insert=True)
        event.listen(engine, "connect", opened)
        listeners += [(engine, opening), (engine, opened)]
    if dialect == "sqlite":

        def on_connect(dbapi_connection: Any, record_: Any) -> None:
            dbapi_connection.set_trace_callback(record)

        for engine in engines:
            event.listen(engine, "connect", on_connect)
            listeners.append((engine, on_connect))
            engine.dispose()
    else:
        if dialect == "postgresql":
            import psycopg

            cursor_class: Any = psycopg.Cursor
        else:
            import pymysql.cursors

            cursor_class = pymysql.cursors.Cursor
        original = cursor_class.execute

        def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            record(query)
            return original(self, query, *args, **kwargs)

        restore.append((cursor_class, "execute", original))
        cursor_class.execute = execute
        if dialect == "postgresql":
            # The hot path's statements skip psycopg's cursor (LibpqStatement).
            from celery_lease.store.postgresql import LibpqStatement

            send = LibpqStatement._exec

            def libpq(self: Any, pgconn: Any, values: Any) -> Any:
                record(self.sql)
                return send(self, pgconn, values)

            restore.append((LibpqStatement, "_exec", send))
            LibpqStatement._exec = libpq  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        for owner, name, value in restore:
            setattr(owner, name, value)
        for engine, listener in listeners:
            event.remove(engine, "connect", listener)
            engine.dispose()  # no connection keeps the trace callback


def queue_for(
    name: str, arguments: dict[str, Any] | None = None, exchange_type: str = "direct"
) -> Any:
    """The task queue ``name`` on its own exchange (of ``exchange_type``), declared with
    ``arguments``."""
    from kombu import Exchange, Queue

    exchange = Exchange(name, type=exchange_type)
    return Queue(name, exchange, routing_key=name, queue_arguments=arguments)


class Worker:
    """One ``celery worker`` (or, with ``command``, any ``celery``) process group, stopped by
    its PID. The test suite and the benchmarks (``benchmarks/common.py``) both use it."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        name: str = "w",
        pool: str = "prefork",
        concurrency: int = 2,
        app: str = "tests.workerapp",
        extra_args: tuple[str, ...] = (),
        command: list[str] | None = None,
        node: str | None = None,
        cwd: Path | None = None,
        loglevel: str = "INFO",
        path: Path = REPO,
    ) -> None:
        self.log_path = log_path
        self.name = name
        # ``path``: where the app and celery_lease are imported from (another release's
        # checkout for a rolling-deploy test).
        full_env = {**os.environ, **env, "PYTHONPATH": str(path)}
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            node or f"{name}@%h",
            "-l",
            loglevel,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            *extra_args,
        ]
        if command is not None:
            cmd = [sys.executable, "-m", "celery", "-A", app, *command]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # A new session makes this PID the group id, so the pool children can be
        # signalled with the group the test itself created.
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(cwd or path),
        )
        self.pid = self.proc.pid

    def log(self) -> str:
        """Everything the worker has logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> Worker:
        """Block until the worker logs that it is ready (or fail, with its log)."""

        def ready() -> bool:
            # Poll, then read: a worker its first task kills (a kill -9 hook) was ready
            # if it said so before it exited.
            exited = self.proc.poll() is not None
            log = self.log()
            if " ready." in log:
                return True
            if exited:
                raise AssertionError(f"worker {self.name} exited early:\n{log[-4000:]}")
            return False

        wait_for(ready, timeout, 0.1, f"worker {self.name} to be ready")
        return self

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker and its pool children (the group we created)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole worker (main process and pool children)."""
        self.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole worker."""
        self.signal_group(signal.SIGCONT)

    def kill9(self) -> None:
        """kill -9 the worker and its children, and reap it."""
        self.signal_group(signal.SIGKILL)
        self.proc.wait(10)

    def discard(self) -> None:
        """SIGKILL the group at once and reap it: for a worker whose test is over. A warm
        shutdown takes 2.5-6 s a worker (Redis, RabbitMQ) and tells a finished test nothing."""
        if self._log.closed:
            return  # stopped or discarded already: its group id may be another's by now
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL the group if it lingers."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


def env_flag(name: str) -> bool:
    """True when the environment variable is set to a true-ish value."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def require(value: Any, what: str) -> Any:
    """``value`` if set; else skip the test, or fail it under ``CI=true``."""
    import pytest

    if value:
        return value
    if env_flag("CI"):
        pytest.fail(f"{what} is required when CI=true")
    pytest.skip(f"{what} not available")


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held(
    store: Any,
    run_id: str,
    seconds: float = 2.0,
    *,
    clock: Callable[[], float] = time.monotonic,
    **kwargs: Any,
) -> Any:
    """Claim ``run_id`` as ``owner-<run_id>`` and return its :class:`~celery_lease.Lease`.

    The lease's clock starts before the claim, as in a worker; ``kwargs`` go to
    ``Lease`` (``heartbeat_interval`` defaults to a quarter of the lease).
    """
    from celery_lease import Lease
    from celery_lease.lease.lease import Standalone

    started_at = clock()
    result = store.claim(
        run_id, f"owner-{run_id}", task_name="t", lease_ms=int(seconds * 1000), max_attempts=5
    )
    assert result.outcome == "claimed"
    kwargs.setdefault("heartbeat_interval", seconds / 4)
    holder = Standalone(
        store, **{name: kwargs.pop(name) for name in ("events", "followups") if name in kwargs}
    )
    return Lease(
        holder,
        run_id,
        result.owner,
        result.attempt,
        lease_seconds=seconds,
        started_at=started_at,
        clock=clock,
        **kwargs,
    )
