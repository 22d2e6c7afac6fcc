"""The Celery app the worker tests start in real ``celery worker`` processes.

Configured from environment variables so every test gets its own database,
broker queue and lease timings. Each task records what its body did in the
``test_effects`` table of the lease database, so tests can count effects.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import time
from typing import Any

from celery import Celery
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, insert

from celery_lease import LeasedTask, LeaseLost, RunCancelled
from celery_lease.errors import LeaseInputError
from celery_lease.runtime import shutting_down
from celery_lease.store import WaitBounds, create_lease_engine
from tests.helpers import plain_engine, queue_for

if os.environ.get("CL_CLOCK_SKEW"):
    # Chaos: this process's wall clock is wrong by CL_CLOCK_SKEW seconds. Leases
    # must not care: expiry is computed with the database clock only.
    _real_time = time.time
    _skew = float(os.environ["CL_CLOCK_SKEW"])
    time.time = lambda: _real_time() + _skew

if os.environ.get("CL_SLOW_TEARDOWN"):
    # Test-only: this process's teardown takes CL_SLOW_TEARDOWN seconds, as an exporter
    # flushing at exit does, or the interpreter's own teardown on a loaded machine.
    import atexit

    atexit.register(time.sleep, float(os.environ["CL_SLOW_TEARDOWN"]))

if os.environ.get("CL_STALL_HEARTBEAT"):
    # Test-only: every heartbeat statement blocks forever, like a read on a
    # blackholed socket. Only the lease's local deadline can save the day.
    import threading

    from celery_lease.store import LeaseStore

    def _stalled_heartbeat(self: LeaseStore, leases: Any, progress: Any = None) -> Any:
        threading.Event().wait()

    LeaseStore.heartbeat = _stalled_heartbeat  # type: ignore[method-assign,assignment]

if os.environ.get("CL_STALL_SWEEP"):
    # Test-only: once the file CL_STALL_SWEEP.arm exists, this worker's next fenced sweep
    # (the in-worker sweeper's) writes the file CL_STALL_SWEEP names, then waits a second
    # before its first write, so a test can SIGSTOP the worker inside its sweep, after it
    # confirmed its lead.
    from pathlib import Path

    from celery_lease.store import LeaseStore as _Store

    _sweep_expired = _Store.sweep_expired
    _stalled: list[int] = []

    def _stalling_sweep_expired(self: _Store, limit: int = 500, *, leader: Any = None) -> Any:
        armed = Path(os.environ["CL_STALL_SWEEP"] + ".arm").exists()
        if leader is not None and armed and not _stalled:
            _stalled.append(os.getpid())
            Path(os.environ["CL_STALL_SWEEP"]).write_text(f"{leader.term}\n")
            time.sleep(1.0)
        return _sweep_expired(self, limit, leader=leader)

    _Store.sweep_expired = _stalling_sweep_expired  # type: ignore[method-assign]

if os.environ.get("CL_STALL_RENEWAL"):
    # Test-only: once the file CL_STALL_RENEWAL.arm exists, right after this worker's next
    # heartbeat statement that renews leases (before the renewal's next round trip), write
    # the file CL_STALL_RENEWAL names, then wait a second, so a test can SIGSTOP the worker
    # there, as a frozen VM or a long pause would stop it.
    import threading
    from pathlib import Path

    from sqlalchemy import event as _event
    from sqlalchemy.engine import Engine as _Engine

    _renewal_stalled: list[int] = []

    @_event.listens_for(_Engine, "after_cursor_execute")
    def _stall_after_renewal(*args: Any) -> None:
        statement = str(args[2])
        if (
            not _renewal_stalled
            and threading.current_thread().name == "celery-lease-heartbeat"
            and statement.startswith("UPDATE")
            and Path(os.environ["CL_STALL_RENEWAL"] + ".arm").exists()
        ):
            _renewal_stalled.append(os.getpid())
            Path(os.environ["CL_STALL_RENEWAL"]).write_text("stalled\n")
            time.sleep(1.0)


if os.environ.get("CL_UNCHECKED_PROGRESS"):
    # Test-only: progress() keeps what it is handed without the hand-over check, so the
    # database itself refuses a bad value in the heartbeat's renewal (as a value no
    # check foresees would be): the renewal of every other run must go on.
    from celery_lease.lease import progress as _progress
    from celery_lease.store.records import Progress as _Progress

    def _unchecked_report(self: Any, done: Any, total: Any = None, note: Any = None) -> None:
        self._latest = _Progress(done, total, note)

    _progress.ProgressReport.report = _unchecked_report  # type: ignore[method-assign]

if os.environ.get("CL_DIE_AT_POP"):
    # Test-only: the first time this worker takes a message of the task CL_DIE_AT_POP off
    # the broker (the first worker of all to do so: the file CL_DIE_AT_POP_ONCE is the
    # token), it is killed before the broker records the message as unacknowledged, as a
    # kill -9 between kombu Redis's BRPOP and its save to ``unacked`` (or after the
    # filesystem transport read the file) loses it. It waits, up to 10 s, until the
    # message's publisher deleted its outbox row, then SIGKILLs itself.
    from kombu.transport import redis as _kombu_redis
    from kombu.transport.virtual import base as _kombu_virtual

    def _dying(original: Any) -> Any:
        def append(self: Any, message: Any, delivery_tag: Any) -> Any:
            headers = getattr(message, "headers", None) or {}
            only = os.environ.get("CL_DIE_AT_POP_ID")  # this task id alone, when set
            if headers.get("task") == os.environ["CL_DIE_AT_POP"] and (
                not only or headers.get("id") == only
            ):
                try:
                    fd = os.open(os.environ["CL_DIE_AT_POP_ONCE"], os.O_CREAT | os.O_EXCL)
                except FileExistsError:
                    return original(self, message, delivery_tag)
                os.close(fd)
                _wait_outbox_gone(str(headers.get("id")))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, message, delivery_tag)

        return append

    def _wait_outbox_gone(task_id: str) -> None:
        from sqlalchemy import select as _select

        from celery_lease.runtime import store_for as _store_for
        from celery_lease.schema import outbox as _outbox

        query = _select(_outbox.c.task_id).where(_outbox.c.task_id == task_id)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with _store_for(app).engine.connect() as conn:
                if conn.execute(query).first() is None:
                    return
            time.sleep(0.05)

    _kombu_redis.QoS.append = _dying(_kombu_redis.QoS.append)  # type: ignore[method-assign]
    _kombu_virtual.QoS.append = _dying(_kombu_virtual.QoS.append)  # type: ignore[method-assign]

# Every thread's stack into the worker's log on SIGUSR2 (Celery takes SIGUSR1), written by
# the C handler even when no Python thread can run: a test that times out asks for them.
faulthandler.register(signal.SIGUSR2, all_threads=True)

app = Celery("workerapp")
app.conf.update(
    broker_url=os.environ.get("CL_BROKER_URL", "memory://"),
    broker_transport_options={},
    task_default_queue=os.environ.get("CL_QUEUE", "celery"),
    task_acks_late=os.environ.get("CL_ACKS_LATE", "0") == "1",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ.get("CL_LEASE_DB") or None,
    lease_seconds=float(os.environ.get("CL_LEASE_SECONDS", "30")),
)
if os.environ.get("CL_HEARTBEAT"):
    app.conf.lease_heartbeat_interval = float(os.environ["CL_HEARTBEAT"])
if os.environ.get("CL_LOST_POLICY"):
    app.conf.lease_lost_policy = os.environ["CL_LOST_POLICY"]
if os.environ.get("CL_BAD_SETTING"):
    key, _, value = os.environ["CL_BAD_SETTING"].partition("=")
    app.conf[key] = float(value) if value.lstrip("-").replace(".", "").isdigit() else value
if app.conf.broker_url.startswith("amqp"):
    # The tests share one RabbitMQ vhost: remote control on this test's own exchange.
    app.conf.control_exchange = f"{app.conf.task_default_queue}.ctl"
if os.environ.get("CL_QUEUE_ARGS"):
    # The test's queue declared with arguments, e.g. a RabbitMQ quorum queue.
    app.conf.task_queues = [
        queue_for(
            app.conf.task_default_queue,
            json.loads(os.environ["CL_QUEUE_ARGS"]),
            os.environ.get("CL_QUEUE_EXCHANGE_TYPE", "direct"),
        )
    ]
if os.environ.get("CL_RESULT_BACKEND"):
    app.conf.result_backend = os.environ["CL_RESULT_BACKEND"]
if os.environ.get("CL_CONF"):
    # Extra settings as JSON, e.g. {"lease_retry_backoff": 0.2}.
    app.conf.update(json.loads(os.environ["CL_CONF"]))
if os.environ.get("CL_OTEL_DIR"):
    # Tracing as a user sets it up with prefork: the SDK and the Celery
    # instrumentation in each pool child. Every finished span is written as one
    # JSON line to a file of that process's own (tests/test_tracing.py reads them).
    from celery import signals

    @signals.worker_process_init.connect(weak=False)
    def _trace_to_file(**kwargs: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

        out = open(  # noqa: SIM115 - the process's lifetime
            os.path.join(os.environ["CL_OTEL_DIR"], f"{os.getpid()}.jsonl"), "a"
        )
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(
                ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(None) + "\n")
            )
        )
        trace.set_tracer_provider(provider)
        CeleryInstrumentor().instrument()


if os.environ.get("CL_FS_DIR"):
    folder = os.environ["CL_FS_DIR"]
    # kombu's own transport can hand a consumer a half-written message file.
    app.conf.broker_transport = "celery_lease.contrib.fs_transport:Transport"
    app.conf.broker_transport_options = {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": os.path.join(folder, "control"),
    }
if os.environ.get("CL_VISIBILITY_TIMEOUT") and app.conf.broker_url.startswith("redis"):
    # A short visibility timeout makes Redis redeliver unacked (acks_late)
    # messages quickly, reproducing Celery's duplicate deliveries.
    # kombu keeps unacked messages under keys global to the Redis database, shared
    # by every test and every run on this server: a worker killed -9 inside its
    # restore holds the one "unacked_mutex" for 300 s, and no worker anywhere
    # restores a message meanwhile (seen: runs waiting 120 s for a redelivery).
    # Each test's queue gets its own keys and a mutex that expires in seconds.
    _queue = os.environ.get("CL_QUEUE", "celery")
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CL_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_key": f"{_queue}.unacked",
        "unacked_index_key": f"{_queue}.unacked_index",
        "unacked_mutex_key": f"{_queue}.unacked_mutex",
        "unacked_mutex_expire": 10,
    }

effects_metadata = MetaData()
effects = Table(
    "test_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(255), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("kind", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("at", Float(precision=53), nullable=False),  # a double: MySQL FLOAT has 4 bytes
)

_engine: Any = None
_lease_db_engine: Any = None


def effects_engine() -> Any:
    """An engine for the effects table (one per process): on ``CL_EFFECTS_DB`` when set
    (the same database reached another way), else on the lease database."""
    global _engine
    if _engine is None or _engine.pid != os.getpid():
        _engine = plain_engine(os.environ.get("CL_EFFECTS_DB") or app.conf.lease_database_url)
        _engine.pid = os.getpid()
    return _engine


def lease_db_engine() -> Any:
    """An application engine on the lease database with the library's bounded waits."""
    global _lease_db_engine
    if _lease_db_engine is None or _lease_db_engine.pid != os.getpid():
        bounds = WaitBounds.for_lease(app.conf.lease_seconds)
        _lease_db_engine = create_lease_engine(app.conf.lease_database_url, bounds=bounds)
        _lease_db_engine.pid = os.getpid()
    return _lease_db_engine


def record(run_id: str, attempt: int, kind: str, conn: Any = None) -> None:
    """Write one effect row: in ``conn``'s transaction if given, else on its own."""
    stmt = insert(effects).values(
        run_id=run_id, attempt=attempt, kind=kind, pid=os.getpid(), at=time.time()
    )
    if conn is not None:
        conn.execute(stmt)
        return
    with effects_engine().begin() as own:
        own.execute(stmt)


@app.task(base=LeasedTask, bind=True, name="workerapp.work")
def work(self: LeasedTask, seconds: float = 0.0) -> str:
    """Sleep in small steps (checking the lease), then commit one fenced effect."""
    record(self.lease.run_id, self.lease.attempt, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.05)
    with effects_engine().begin() as conn:
        self.lease.fence(conn)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    return "done"


@app.task(base=LeasedTask, bind=True, name="workerapp.sleepy", lease_interrupt=False)
def sleepy(self: LeasedTask, seconds: float) -> str:
    """Sleep without checking the lease, record the body's end, then let completion decide."""
    record(self.lease.run_id, self.lease.attempt, "start")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
    record(self.lease.run_id, self.lease.attempt, "body_end")
    return "slept"


@app.task(base=LeasedTask, bind=True, name="workerapp.watch", lease_interrupt=False)
def watch(self: LeasedTask, seconds: float) -> str:
    """Poll ``self.lease.check()`` and record when it first raises."""
    record(self.lease.run_id, self.lease.attempt, "start")
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            self.lease.check()
            time.sleep(0.02)
    except LeaseLost:
        record(self.lease.run_id, self.lease.attempt, "saw_lost")
        raise
    except RunCancelled:
        record(self.lease.run_id, self.lease.attempt, "saw_cancel")
        raise
    return "watched"


@app.task(base=LeasedTask, bind=True, name="workerapp.flaky")
def flaky(self: LeasedTask, fail_until_attempt: int, pause: float = 0.0) -> str:
    """Raise on attempts up to ``fail_until_attempt`` (after ``pause`` s), then commit."""
    record(self.lease.run_id, self.lease.attempt, "start")
    if self.lease.attempt <= fail_until_attempt:
        time.sleep(pause)
        raise ConnectionError(
            "upstream refused: postgresql://billing:s3cr3t-pw@db.internal:5432/pay "
            "with Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig"
        )
    record(self.lease.run_id, self.lease.attempt, "commit")
    return "ok"


@app.task(base=LeasedTask, bind=True, name="workerapp.spin")
def spin(self: LeasedTask, seconds: float) -> str:
    """Busy body that never calls check(): only the interrupt can stop it early."""
    record(self.lease.run_id, self.lease.attempt, "start")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    record(self.lease.run_id, self.lease.attempt, "body_end")
    return "spun"


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.limited",
    lease_concurrency_key=lambda account, seconds: f"account-{account}",
)
def limited(self: LeasedTask, account: int, seconds: float) -> str:
    """Record the body's interval, for the per-key concurrency test."""
    record(self.lease.run_id, self.lease.attempt, "start")
    time.sleep(seconds)
    record(self.lease.run_id, self.lease.attempt, "end")
    return "limited"


@app.task(base=LeasedTask, bind=True, name="workerapp.effect")
def effect(self: LeasedTask, seconds: float) -> str:
    """The chaos task: work (checking the lease), then commit one effect and the
    run's success in one transaction through ``fence(complete=True)``."""
    record(self.lease.run_id, self.lease.attempt, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.02)
    with effects_engine().begin() as conn:
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    return "committed"


class AuditedTask(LeasedTask):
    """A user's task class with private helpers of its own, under names the library's
    task class once used for its own machinery (issue 18)."""

    def _payload(self) -> dict[str, str]:
        """What this application attaches to its audit records."""
        return {"audited_by": str(self.name)}

    def _on_retry(self, reason: str) -> str:
        """The application's own retry note."""
        return f"retry: {reason}"

    def _complete(self, conn: Any, kind: str) -> None:
        """Commit the application's effect and the run's success together."""
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, kind, conn)


@app.task(base=AuditedTask, bind=True, name="workerapp.audited")
def audited(self: AuditedTask, seconds: float) -> str:
    """Work ``seconds`` on the first attempt only (checking the lease), using the class's
    own ``_payload``/``_on_retry``, then commit one effect through its own ``_complete``."""
    record(self.lease.run_id, self.lease.attempt, "start")
    if self._payload() != {"audited_by": "workerapp.audited"} or self._on_retry("x") != "retry: x":
        raise AssertionError("the task's own helpers were shadowed")
    deadline = time.monotonic() + (seconds if self.lease.attempt == 1 else 0.0)
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.02)
    with effects_engine().begin() as conn:
        self._complete(conn, "commit")
    return "audited"


#: The worker's main process (a prefork pool child inherits it from the fork).
_MAIN_PID = os.getpid()


class CrashAfterCommit(LeasedTask):
    """Test-only: with ``CL_KILL_AFTER_COMMIT`` (a folder), the process running the task
    is killed -9 right after the run's guarded completion committed, before Celery
    stores the result or sends the continuation; once per task id (a marker file).
    With ``CL_KILL_WHOLE_WORKER=1`` the worker's main process is killed first."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        folder, task_id = os.environ.get("CL_KILL_AFTER_COMMIT"), self.request.id
        if folder and task_id and not self.request.called_directly:
            try:
                os.close(os.open(os.path.join(folder, task_id), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return result  # killed once already: this delivery replays
            record(task_id, 0, "killed")
            if os.environ.get("CL_KILL_WHOLE_WORKER") == "1" and os.getpid() != _MAIN_PID:
                os.kill(_MAIN_PID, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return result


@app.task(base=CrashAfterCommit, bind=True, name="workerapp.crash_step")
def crash_step(self: LeasedTask, x: int) -> int:
    """A canvas step whose worker dies after its completion committed (see CrashAfterCommit):
    records one start, returns x + 1 (kept in the row by the completion)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return x + 1


@app.task(base=CrashAfterCommit, bind=True, name="workerapp.big_crash_step")
def big_crash_step(self: LeasedTask, size: int) -> str:
    """A chord member whose worker dies after its completion committed (CrashAfterCommit),
    returning ``size`` characters: over 64 KiB, a result the row does not keep."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return "x" * size


@app.task(base=LeasedTask, bind=True, name="workerapp.quiet", ignore_result=True)
def quiet(self: LeasedTask, x: int) -> int:
    """A task with ``ignore_result``: records its start, returns x + 1 (kept nowhere)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return x + 1


# -- Celery features (tests/test_canvas.py) -----------------------------------


@app.task(base=LeasedTask, bind=True, name="workerapp.step")
def step(self: LeasedTask, x: int, seconds: float = 0.0) -> int:
    """A canvas step: work (checking the lease), commit one fenced effect with the run's
    success and its result (``fence(complete=True, result=...)``), return x + 1."""
    record(self.lease.run_id, self.lease.attempt, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.02)
    with effects_engine().begin() as conn:
        self.lease.fence(conn, complete=True, result=x + 1)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    return x + 1


@app.task(base=LeasedTask, bind=True, name="workerapp.fenced_step")
def fenced_step(self: LeasedTask, x: int, keep: bool) -> int:
    """A chain step that commits its effect and success with ``fence(complete=True)``
    (``result=x + 1`` when ``keep``), then returns x + 1. With ``CL_KILL_AFTER_FENCE`` (a
    folder), its whole worker is killed -9 right after that commit, before the body
    returns; once per task id (a marker file)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    with effects_engine().begin() as conn:
        if keep:
            self.lease.fence(conn, complete=True, result=x + 1)
        else:
            self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    folder, task_id = os.environ.get("CL_KILL_AFTER_FENCE"), self.request.id
    if folder and task_id:
        with contextlib.suppress(FileExistsError):
            os.close(os.open(os.path.join(folder, task_id), os.O_CREAT | os.O_EXCL))
            if os.getpid() != _MAIN_PID:
                os.kill(_MAIN_PID, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    return x + 1


@app.task(name="workerapp.add")
def add(x: int, y: int) -> int:
    """A plain (unleased) task."""
    return x + y


@app.task(name="workerapp.tsum")
def tsum(values: list[int], tag: str = "") -> int:
    """A plain chord body: records that it fired (under ``tag``), returns the sum."""
    record(tag or "tsum", 0, "fired")
    return sum(values)


@app.task(name="workerapp.mark")
def mark(result: Any, tag: str) -> Any:
    """A plain link callback: records that it ran."""
    record(tag, 0, "linked")
    return result


@app.task(base=LeasedTask, bind=True, name="workerapp.keyed", lease_key=lambda x, seconds=0.0: x)
def keyed(self: LeasedTask, x: int, seconds: float = 0.0) -> int:
    """Keyed by ``x`` (an idempotency key): runs once per x, returns x * 10."""
    record(self.lease.run_id, self.lease.attempt, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.02)
    record(self.lease.run_id, self.lease.attempt, "commit")
    return x * 10


@app.task(base=LeasedTask, bind=True, name="workerapp.refund", lease_key=lambda x: x)
def refund(self: LeasedTask, x: int) -> int:
    """Keyed by the same values as ``keyed``: a different task, so a different run."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return -x


@app.task(base=LeasedTask, bind=True, name="workerapp.bad_key", lease_key=lambda x: None)
def bad_key(self: LeasedTask, x: int) -> int:
    """A key function returning None: a clear error, never the run id "None"."""
    return x


@app.task(base=LeasedTask, bind=True, name="workerapp.retry_later")
def retry_later(self: LeasedTask, countdown: float) -> str:
    """Asks Celery to retry in ``countdown`` s on its first attempt, then succeeds."""
    record(self.lease.run_id, self.lease.attempt, "start")
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return "retried"


@app.task(base=LeasedTask, bind=True, name="workerapp.outcome")
def outcome(self: LeasedTask, what: str) -> Any:
    """Ends the run as the body chooses: Ignore, Reject or replace()."""
    from celery.exceptions import Ignore, Reject

    record(self.lease.run_id, self.lease.attempt, "start")
    if what == "ignore":
        raise Ignore()
    if what == "reject":
        raise Reject("not for us", requeue=False)
    return self.replace(step.s(100))


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.auto_fail",
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0.1},
)
def auto_fail(self: LeasedTask) -> None:
    """Always raises ValueError; autoretry_for retries it until the lease attempts run out."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise ValueError(f"real boom on attempt {self.lease.attempt}")


@app.task(base=LeasedTask, bind=True, name="workerapp.complete_then_raise")
def complete_then_raise(self: LeasedTask) -> None:
    """Commits its effect and the run's success, then raises."""
    with effects_engine().begin() as conn:
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    raise RuntimeError("raised after the run was recorded succeeded")


@app.task(base=LeasedTask, bind=True, name="workerapp.fenced_then_slow")
def fenced_then_slow(self: LeasedTask, seconds: float) -> str:
    """Commit an effect and the run's success in one fenced transaction, then work on for
    ``seconds``: Celery stores the result that long after the run's row says succeeded."""
    with self.lease.transaction() as conn:
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    time.sleep(seconds)
    return "done"


@app.task(base=LeasedTask, bind=True, name="workerapp.slow_commit")
def slow_commit(self: LeasedTask, seconds: float) -> str:
    """The README's payment shape: a transaction on the lease database held open around
    ``seconds`` of the caller's own work (a provider call), then fenced and committed."""
    with self.lease.transaction() as conn:
        record(self.lease.run_id, self.lease.attempt, "start", conn)
        time.sleep(seconds)
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    return "committed"


@app.task(base=LeasedTask, bind=True, name="workerapp.loud_failure", lease_max_attempts=1)
def loud_failure(self: LeasedTask, size: int) -> None:
    """Fail with a long message that starts with a secret (an HTTP error carrying the
    response body, a base64 blob in it, say)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise RuntimeError("upstream said token=s3cr3t-value; body: " + "A" * size)


@app.task(base=LeasedTask, bind=True, name="workerapp.boom")
def boom(self: LeasedTask) -> None:
    """Always fails (for link_error and time-limit rows)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise RuntimeError("boom")


@app.task(base=LeasedTask, bind=True, name="workerapp.rated", rate_limit="60/m")
def rated(self: LeasedTask) -> str:
    """Rate-limited to one a second per worker."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return "rated"


@app.task(name="workerapp.on_error")
def on_error(request: Any, exc: Any, traceback: Any, tag: str) -> None:
    """A link_error callback: records that it ran."""
    record(tag, 0, "errback")


@app.task(base=LeasedTask, bind=True, name="workerapp.drain", lease_interrupt=False)
def drain(self: LeasedTask, seconds: float) -> str:
    """Run ``seconds`` without checking the lease; record when this process first sees
    its worker shutting down (the body then ends a second later), then the body's end."""
    record(self.lease.run_id, self.lease.attempt, "start")
    end = time.monotonic() + seconds
    seen = False
    while time.monotonic() < end:
        if not seen and shutting_down(app):
            seen = True
            record(self.lease.run_id, self.lease.attempt, "saw_shutdown")
            end = min(end, time.monotonic() + 1.0)
        time.sleep(0.02)
    record(self.lease.run_id, self.lease.attempt, "body_end")
    return "drained"


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.refused",
    lease_concurrency_key=lambda card_number: f"card-{card_number}",
)
def refused(self: LeasedTask, card_number: str) -> str:
    """A task whose claim the log-scan test makes the database refuse (a trigger); its
    arguments reach the claim's SQL parameters (payload and concurrency key)."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return "unreachable"


@app.task(base=LeasedTask, bind=True, name="workerapp.partitioned")
def partitioned(self: LeasedTask, seconds: float) -> str:
    """The partition chaos task: work (checking the lease), make one side effect guarded
    by ``check()`` alone (on ``CL_EFFECTS_DB``, which the partition does not cut), then
    commit one effect with the run's success through ``fence(complete=True)`` on the
    lease database."""
    record(self.lease.run_id, self.lease.attempt, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        self.lease.check()
        time.sleep(0.02)
    self.lease.check()
    record(self.lease.run_id, self.lease.attempt, "guarded")
    with lease_db_engine().begin() as conn:
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, "commit", conn)
    return "committed"


@app.task(base=LeasedTask, bind=True, name="workerapp.capped", max_retries=1)
def capped(self: LeasedTask) -> None:
    """Always fails; Celery's ``max_retries=1`` bounds it next to ``lease_max_attempts``."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise RuntimeError(f"capped attempt {self.lease.attempt}")


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.auto_capped",
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0.1},
    max_retries=1,
)
def auto_capped(self: LeasedTask) -> None:
    """autoretry_for with ``max_retries=1``: the body runs twice at most."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise ValueError(f"auto capped attempt {self.lease.attempt}")


@app.task(base=LeasedTask, bind=True, name="workerapp.narrow_key", lease_key=lambda n: n)
def narrow_key(self: LeasedTask, n: int, secs: float = 0.0) -> int:
    """A key function that takes fewer arguments than the task: a misuse."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return n


def _started_then_gated(task: LeasedTask, gate: str) -> None:
    """Record the body's start, then wait (bounded) until the file ``gate`` exists."""
    from pathlib import Path

    record(task.lease.run_id, task.lease.attempt, "start")
    deadline = time.monotonic() + 30
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task(base=LeasedTask, bind=True, name="workerapp.gated_ignore")
def gated_ignore(self: LeasedTask, gate: str) -> None:
    """Waits (bounded) until the file ``gate`` exists, then ends the run with Ignore."""
    from celery.exceptions import Ignore

    _started_then_gated(self, gate)
    raise Ignore()


@app.task(base=LeasedTask, bind=True, name="workerapp.gated_boom")
def gated_boom(self: LeasedTask, gate: str) -> None:
    """Waits (bounded) until the file ``gate`` exists, then raises ValueError."""
    _started_then_gated(self, gate)
    raise ValueError(f"boom after the gate, attempt {self.lease.attempt}")


if os.environ.get("CL_PUBLISH_GATE"):
    # Broker-outage tests: hold the first publish of a workerapp task made after the
    # test creates ``<gate>/armed``, until it creates ``<gate>/go`` (bounded), so the
    # test can stop the broker at exactly that moment.
    from pathlib import Path

    from celery.signals import before_task_publish

    @before_task_publish.connect(weak=False)
    def _publish_gate(sender: Any = None, **_: Any) -> None:
        gate = Path(os.environ["CL_PUBLISH_GATE"])
        if not str(sender).startswith("workerapp."):
            return
        try:
            (gate / "armed").rename(gate / "reached")
        except FileNotFoundError:
            return
        deadline = time.monotonic() + 30
        while not (gate / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


@app.task(base=LeasedTask, bind=True, name="workerapp.resumable", lease_interrupt=False)
def resumable(self: LeasedTask, items: int, every: int, step: float, mode: str = "plain") -> int:
    """Process items from the last checkpoint on, ``step`` s each, reporting progress.

    Effects: ``resume:<next>:<attempt that saved it>`` at the start; ``item:<i>`` per
    item; ``ckpt:<next>`` once a checkpoint returned (``refused:<next>`` if it raised
    LeaseLost). ``plain``: a checkpoint every ``every`` items. ``fenced``: each item's
    effect and its checkpoint commit in one fenced transaction. ``retry``: plain, and
    ``self.retry()`` after attempt 1's first checkpoint.
    """
    lease = self.lease
    state = lease.last_checkpoint
    start = 0 if state is None else int(state["next"])
    saved_by = 0 if state is None else int(state["attempt"])
    record(lease.run_id, lease.attempt, f"resume:{start}:{saved_by}")
    for i in range(start, items):
        time.sleep(step)
        if mode == "fenced":
            with lease.transaction() as conn:
                lease.fence(conn, checkpoint={"next": i + 1, "attempt": lease.attempt})
                record(lease.run_id, lease.attempt, f"item:{i}", conn)
        else:
            record(lease.run_id, lease.attempt, f"item:{i}")
        lease.progress(i + 1, items, f"item {i}")
        if mode != "fenced" and (i + 1) % every == 0:
            try:
                lease.checkpoint({"next": i + 1, "attempt": lease.attempt})
            except LeaseLost:
                record(lease.run_id, lease.attempt, f"refused:{i + 1}")
                raise
            record(lease.run_id, lease.attempt, f"ckpt:{i + 1}")
            if mode == "retry" and lease.attempt == 1:
                raise self.retry(countdown=0.2)
    return items


@app.task(base=LeasedTask, bind=True, name="workerapp.big_checkpoint")
def big_checkpoint(self: LeasedTask, size: int) -> str:
    """Checkpoint a string of ``size`` characters: ``too_big`` or ``saved`` (an effect)."""
    try:
        self.lease.checkpoint("x" * size)
    except LeaseInputError:
        record(self.lease.run_id, self.lease.attempt, "too_big")
        return "too_big"
    record(self.lease.run_id, self.lease.attempt, "saved")
    return "saved"


if os.environ.get("CL_TASK_DB"):

    @app.task(
        base=LeasedTask,
        bind=True,
        name="workerapp.own_db",
        lease_database_url=os.environ["CL_TASK_DB"],
    )
    def own_db(self: LeasedTask, seconds: float) -> str:
        """A task whose runs live in its own lease database (``CL_TASK_DB``): work (checking
        the lease), then record one effect (in the app's lease database)."""
        record(self.lease.run_id, self.lease.attempt, "start")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.lease.check()
            time.sleep(0.05)
        record(self.lease.run_id, self.lease.attempt, "commit")
        return "own"


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.per_account",
    lease_concurrency_key=lambda account, seconds=0.0: f"acct-{account}",
)
def per_account(self: LeasedTask, account: str, seconds: float = 0.0) -> str:
    """Flow control by key: record the body's start, sleep, return the account."""
    record(self.lease.run_id, self.lease.attempt, "start")
    time.sleep(seconds)
    return account


@app.task(base=LeasedTask, bind=True, name="workerapp.rate5", lease_rate_limit="5/s")
def rate5(self: LeasedTask, n: int) -> int:
    """Limited to 5/s across every worker: record the body's start."""
    record(self.lease.run_id, self.lease.attempt, "start")
    return n


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.rate_keyed",
    lease_rate_limit="2/s",
    lease_rate_key=lambda account, n: account,
)
def rate_keyed(self: LeasedTask, account: str, n: int) -> int:
    """Limited to 2/s per account across every worker: record the start, by account."""
    record(self.lease.run_id, self.lease.attempt, f"start-{account}")
    return n


if os.environ.get("CL_RATE_LIMIT"):
    # The flow-control benchmark: a task limited to CL_RATE_LIMIT across every worker.

    @app.task(
        base=LeasedTask,
        bind=True,
        name="workerapp.rate_env",
        lease_rate_limit=os.environ["CL_RATE_LIMIT"],
    )
    def rate_env(self: LeasedTask, n: int) -> int:
        """Record the body's start; nothing else."""
        record(self.lease.run_id, self.lease.attempt, "start")
        return n


@app.task(base=LeasedTask, bind=True, name="workerapp.tick")
def tick(self: LeasedTask, entry: str) -> str:
    """A beat tick: record ``<entry>@<due ms>`` (the slot the tick serves) as its effect."""
    due = self.request.get("celery_lease_beat_due")
    record(f"{entry}@{due}", self.lease.attempt, "tick")
    return str(due)


@app.task(bind=True, name="workerapp.plain_tick")
def plain_tick(self: Any, entry: str) -> str:
    """A beat tick of a task that is not leased: record ``<entry>@<due ms>``."""
    due = self.request.get("celery_lease_beat_due")
    record(f"{entry}@{due}", 0, "tick")
    return str(due)


if os.environ.get("CL_BEAT_SCHEDULE"):
    # The LeaseScheduler tests: a 1 s interval and a crontab (every minute) of a leased
    # task, and a 1 s interval of a plain task, each with a per-entry option.
    from datetime import timedelta

    from celery.schedules import crontab

    app.conf.beat_schedule = {
        "every-second": {
            "task": "workerapp.tick",
            "schedule": 1.0,
            "args": ("every-second",),
            "options": {"expires": 60},
        },
        "every-minute": {
            "task": "workerapp.tick",
            "schedule": crontab(),
            "args": ("every-minute",),
        },
        "plain-every-second": {
            "task": "workerapp.plain_tick",
            "schedule": timedelta(seconds=1),
            "args": ("plain-every-second",),
            "options": {"priority": 5},
        },
    }
# -- external effects (tests/test_followups.py, tests/chaos/test_chaos_payments.py) -----

provider_charges = Table(
    "test_provider_charges",
    effects_metadata,
    Column("idempotency_key", String(255), primary_key=True),
    Column("order_id", String(64), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("at", Float(precision=53), nullable=False),
)


def provider_charge(key: str, order_id: str, attempt: int) -> str:
    """A payment provider that deduplicates on its idempotency key: the first call with a
    key charges (one row), a later one with the same key returns that charge. It commits
    on its own, outside any lease transaction, as an external system does."""
    from sqlalchemy.exc import IntegrityError

    try:
        with effects_engine().begin() as conn:
            conn.execute(
                insert(provider_charges).values(
                    idempotency_key=key, order_id=order_id, attempt=attempt, at=time.time()
                )
            )
    except IntegrityError:
        pass  # seen before: the first charge stands
    return f"ch_{key}"


def _kill_once(point: str, name: str) -> None:
    """Test-only: with ``CL_KILL_AT=<point>`` (and ``CL_KILL_DIR``, a folder), kill -9 this
    whole worker the first time ``point`` is reached for ``name`` (a marker file)."""
    folder = os.environ.get("CL_KILL_DIR")
    if os.environ.get("CL_KILL_AT") != point or not folder:
        return
    try:
        marker = os.path.join(folder, f"{point}-{name}".replace("/", "_"))
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    record(name, 0, f"killed:{point}")
    if os.getpid() != _MAIN_PID:
        os.kill(_MAIN_PID, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("CL_KILL_AT") == "before_publish" or os.environ.get("CL_PUBLISH_DELAY"):
    # Kill the worker after the follow-ups' transaction committed and the pump took
    # them, just before the broker would get the first one; or (chaos) wait
    # CL_PUBLISH_DELAY seconds there, so that random kills land in that window too.
    from celery_lease import followups as _followups

    _real_publish = _followups.publish
    _publish_delay = float(os.environ.get("CL_PUBLISH_DELAY") or 0)

    def _publish_or_die(app: Any, row: Any) -> Any:
        _kill_once("before_publish", row.run_id)
        time.sleep(_publish_delay)
        return _real_publish(app, row)

    _followups.publish = _publish_or_die


@app.task(
    base=LeasedTask, bind=True, name="workerapp.pay", lease_key=lambda order_id, mode="": order_id
)
def pay(self: LeasedTask, order_id: str, mode: str = "") -> str:
    """Charge an order at the provider with the run's idempotency key, then commit the
    payment and the run's success together. ``mode`` (``+``-separated): ``receipt`` sends
    ``receipt`` through ``fence(send=)``, ``later`` through ``send_on_commit()`` after the
    write, ``plain`` sends ``plain_receipt``; ``fail`` raises after the charge on attempt 1.
    ``CL_KILL_AT=before_commit`` kills the worker between the provider's reply and the
    commit."""
    lease = self.lease
    flags = set(mode.split("+"))
    key = lease.idempotency_key("charge")
    record(lease.run_id, lease.attempt, f"key:{key}")
    provider_charge(key, order_id, lease.attempt)
    _kill_once("before_commit", lease.run_id)
    if "slow" in flags:
        time.sleep(0.3)  # between the provider's reply and the commit (chaos)
    if "fail" in flags and lease.attempt == 1:
        raise RuntimeError("failed after the charge")
    send = [receipt.s(order_id)] if "receipt" in flags else []
    if "plain" in flags:
        send.append(plain_receipt.s(order_id))
    with effects_engine().begin() as conn:
        sent = lease.fence(conn, complete=True, send=send)
        record(lease.run_id, lease.attempt, "commit", conn)
        if "later" in flags:
            sent += lease.send_on_commit(conn, receipt.s(order_id))
    for task_id in sent:
        record(lease.run_id, lease.attempt, f"sent:{task_id}")
    return key


@app.task(base=LeasedTask, bind=True, name="workerapp.receipt")
def receipt(self: LeasedTask, order_id: str) -> str:
    """A leased follow-up: records ``receipt:<order id>`` with its run's success (its run
    id is the task id the follow-up was published under)."""
    with effects_engine().begin() as conn:
        self.lease.fence(conn, complete=True)
        record(self.lease.run_id, self.lease.attempt, f"receipt:{order_id}", conn)
    return order_id


@app.task(bind=True, name="workerapp.plain_receipt")
def plain_receipt(self: Any, order_id: str) -> str:
    """A plain (unleased) follow-up: records ``plain_receipt:<order id>`` under its task id."""
    record(str(self.request.id), 0, f"plain_receipt:{order_id}")
    return order_id


class _Abort(Exception):
    """Raised inside a transaction to roll it back."""


@app.task(base=LeasedTask, bind=True, name="workerapp.send_or_not", lease_interrupt=False)
def send_or_not(self: LeasedTask, order_id: str, how: str, gate: str = "") -> str:
    """Hand a ``receipt`` to a fenced transaction that does not commit. ``rollback``: the
    transaction raises after the fence. ``lost``: wait (bounded, without checking the lease)
    until the file ``gate`` exists, then fence (the test expired the lease meanwhile).
    Later attempts do nothing."""
    from pathlib import Path

    lease = self.lease
    if lease.attempt > 1:
        record(lease.run_id, lease.attempt, "again")
        return "again"
    if how == "rollback":
        try:
            with effects_engine().begin() as conn:
                lease.fence(conn, send=[receipt.s(order_id)])
                record(lease.run_id, lease.attempt, "written", conn)
                raise _Abort()
        except _Abort:
            record(lease.run_id, lease.attempt, "rolled_back")
        return "rolled_back"
    record(lease.run_id, lease.attempt, "waiting")
    deadline = time.monotonic() + 30
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        with effects_engine().begin() as conn:
            lease.fence(conn, send=[receipt.s(order_id)])
            record(lease.run_id, lease.attempt, "written", conn)
    except LeaseLost:
        record(lease.run_id, lease.attempt, "refused")
        raise
    return "sent"


def hostile_values() -> dict[str, tuple[str, Any]]:
    """What a careless or hostile body hands ``progress()`` and ``checkpoint()``: per name,
    (``progress_note`` / ``progress_done`` / ``checkpoint``, the value)."""
    deep: list[Any] = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    return {
        "nul_note": ("progress_note", "half\x00way"),
        "surrogate_note": ("progress_note", "bad \udc80 text"),
        "huge_note": ("progress_note", "n" * 1_000_000),
        "huge_done": ("progress_done", 10**400),
        "nan_done": ("progress_done", float("nan")),
        "deep_checkpoint": ("checkpoint", deep),
        "surrogate_checkpoint": ("checkpoint", {"k": "\ud800"}),
        "surrogate_key_checkpoint": ("checkpoint", {"\udfff": 1}),
        "huge_checkpoint": ("checkpoint", "c" * 10_000_000),
        "huge_int_checkpoint": ("checkpoint", 10**5000),
        "object_checkpoint": ("checkpoint", {"when": object()}),
    }


def hand_over(lease: Any, kind: str) -> None:
    """Hand ``lease`` the hostile value ``kind`` (see :func:`hostile_values`)."""
    field, value = hostile_values()[kind]
    if field == "checkpoint":
        lease.checkpoint(value)
    elif field == "progress_note":
        lease.progress(1, 2, value)
    else:
        lease.progress(value)


@app.task(base=LeasedTask, bind=True, name="workerapp.fences_long", lease_interrupt=False)
def fences_long(self: LeasedTask, seconds: float, rounds: int) -> str:
    """``rounds`` fenced transactions (each saving a checkpoint) held open ``seconds`` each,
    back to back, then a fenced success: the run's row stays locked most of the time."""
    lease = self.lease
    record(lease.run_id, lease.attempt, "start")
    for i in range(rounds):
        with lease.transaction() as conn:
            lease.fence(conn, checkpoint={"round": i})
            time.sleep(seconds)
        time.sleep(0.05)
    with lease.transaction() as conn:
        lease.fence(conn, complete=True)
        record(lease.run_id, lease.attempt, "commit", conn)
    return "fenced"


@app.task(base=LeasedTask, bind=True, name="workerapp.reporter", lease_interrupt=False)
def reporter(self: LeasedTask, seconds: float, step: float = 0.05) -> str:
    """An innocent run: report progress (and checkpoint) every ``step`` s for ``seconds``
    while checking its lease, then commit one fenced effect."""
    lease = self.lease
    record(lease.run_id, lease.attempt, "start")
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        lease.progress(i, None, f"step {i} é😀")
        if i % 10 == 0:
            lease.checkpoint({"i": i})
        lease.check()
        time.sleep(step)
        i += 1
    with lease_db_engine().begin() as conn:
        lease.fence(conn, complete=True)
        record(lease.run_id, lease.attempt, "commit", conn)
    return "done"


@app.task(base=LeasedTask, bind=True, name="workerapp.hostile", lease_interrupt=False)
def hostile(self: LeasedTask, kinds: list[str], seconds: float, catch: bool = False) -> str:
    """Hand each hostile value of ``kinds`` over (recording ``refused:<field>`` when the
    lease refuses it: re-raised unless ``catch``), keep the lease ``seconds`` more (the
    heartbeat renews meanwhile), then commit one fenced effect."""
    lease = self.lease
    record(lease.run_id, lease.attempt, "start")
    for kind in kinds:
        try:
            hand_over(lease, kind)
        except LeaseInputError as exc:
            record(lease.run_id, lease.attempt, f"refused:{exc.field}")
            if not catch:
                raise
        else:
            record(lease.run_id, lease.attempt, f"accepted:{kind}")
        lease.check()
        time.sleep(0.02)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lease.check()
        time.sleep(0.05)
    with lease_db_engine().begin() as conn:
        lease.fence(conn, complete=True)
        record(lease.run_id, lease.attempt, "commit", conn)
    return "done"


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.auto_kw_capped",
    autoretry_for=(ValueError,),
    retry_kwargs={"max_retries": 1, "countdown": 0.1},
)
def auto_kw_capped(self: LeasedTask) -> None:
    """autoretry_for with ``retry_kwargs={"max_retries": 1}``: Celery runs it twice."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise ValueError(f"auto kw capped attempt {self.lease.attempt}")


@app.task(
    base=LeasedTask,
    bind=True,
    name="workerapp.fails_twice",
    autoretry_for=(KeyError,),
    retry_kwargs={"max_retries": 2, "countdown": 0.5},
    lease_retry_errors=False,
)
def fails_twice(self: LeasedTask) -> str:
    """autoretry_for with a 0.5 s countdown and ``max_retries=2``: raises on its first two
    runs, records the ``retries`` each run sees, and succeeds on the third."""
    record(self.lease.run_id, self.lease.attempt, f"start:{self.request.retries}")
    if self.request.retries < 2:
        raise KeyError(f"fails twice, run {self.request.retries + 1}")
    return "third time"


@app.task(base=LeasedTask, bind=True, name="workerapp.call_capped")
def call_capped(self: LeasedTask) -> None:
    """``self.retry(max_retries=1)``: Celery runs it twice."""
    record(self.lease.run_id, self.lease.attempt, "start")
    try:
        raise KeyError(f"call capped attempt {self.lease.attempt}")
    except KeyError as exc:
        raise self.retry(exc=exc, max_retries=1, countdown=0.1) from exc


@app.task(base=LeasedTask, bind=True, name="workerapp.capped_after")
def capped_after(self: LeasedTask, countdown: float) -> None:
    """``self.retry(max_retries=1, countdown=countdown)``: fails after its retry."""
    record(self.lease.run_id, self.lease.attempt, "start")
    try:
        raise KeyError(f"capped after attempt {self.lease.attempt}")
    except KeyError as exc:
        raise self.retry(exc=exc, max_retries=1, countdown=countdown) from exc


@app.task(base=LeasedTask, bind=True, name="workerapp.rated_retry", lease_rate_limit="1/s")
def rated_retry(self: LeasedTask, n: int, retry: bool = True) -> int:
    """1/s across every worker: record the start with the retries the body sees, and ask
    Celery for one retry (no countdown) on the first attempt (when ``retry``)."""
    lease = self.lease
    record(lease.run_id, lease.attempt, f"start:{self.request.retries}")
    if retry and lease.attempt == 1:
        raise self.retry(countdown=0)
    return n


@app.task(base=LeasedTask, bind=True, name="workerapp.rated_seq", lease_rate_limit="2/s")
def rated_seq(self: LeasedTask, n: int) -> int:
    """2/s across every worker: record ``seq:<n>`` at the start."""
    record(self.lease.run_id, self.lease.attempt, f"seq:{n}")
    return n


@app.task(base=LeasedTask, bind=True, name="workerapp.fence_other")
def fence_other(self: LeasedTask, url: str) -> str:
    """What a new user writes first: ``fence()`` on an engine of their own, here on the
    database ``url`` (not the lease database)."""
    from sqlalchemy import create_engine

    record(self.lease.run_id, self.lease.attempt, "start")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            self.lease.fence(conn)
    finally:
        engine.dispose()
    return "fenced"


@app.task(base=LeasedTask, bind=True, name="workerapp.raises")
def raises(self: LeasedTask, tag: str = "") -> str:
    """Record a start, then raise ValueError naming ``tag``, on every attempt."""
    record(self.lease.run_id, self.lease.attempt, "start")
    raise ValueError(f"boom {tag}")
