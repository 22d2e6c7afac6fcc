"""The Celery app the worker tests start in real ``celery worker`` processes.

Configured from environment variables so every test gets its own database,
broker queue and lease timings. Each task records what its body did in the
``test_effects`` table of the lease database, so tests can count effects.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine, insert

from celery_lease import LeasedTask, LeaseLost, RunCancelled

if os.environ.get("CL_CLOCK_SKEW"):
    # Chaos: this process's wall clock is wrong by CL_CLOCK_SKEW seconds. Leases
    # must not care: expiry is computed with the database clock only.
    _real_time = time.time
    _skew = float(os.environ["CL_CLOCK_SKEW"])
    time.time = lambda: _real_time() + _skew

if os.environ.get("CL_STALL_HEARTBEAT"):
    # Test-only: every heartbeat statement blocks forever, like a read on a
    # blackholed socket. Only the lease's local deadline can save the day.
    import threading

    from celery_lease.store import LeaseStore

    def _stalled_heartbeat(self: LeaseStore, leases: Any) -> Any:
        threading.Event().wait()

    LeaseStore.heartbeat = _stalled_heartbeat  # type: ignore[method-assign,assignment]

app = Celery("workerapp")
app.conf.update(
    broker_url=os.environ.get("CL_BROKER_URL", "memory://"),
    broker_transport_options={},
    task_default_queue=os.environ.get("CL_QUEUE", "celery"),
    task_acks_late=os.environ.get("CL_ACKS_LATE", "0") == "1",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ.get("CL_LEASE_DB"),
    lease_seconds=float(os.environ.get("CL_LEASE_SECONDS", "30")),
)
if os.environ.get("CL_HEARTBEAT"):
    app.conf.lease_heartbeat_interval = float(os.environ["CL_HEARTBEAT"])
if os.environ.get("CL_LOST_POLICY"):
    app.conf.lease_lost_policy = os.environ["CL_LOST_POLICY"]
if os.environ.get("CL_BAD_SETTING"):
    key, _, value = os.environ["CL_BAD_SETTING"].partition("=")
    app.conf[key] = float(value) if value.lstrip("-").replace(".", "").isdigit() else value
if os.environ.get("CL_RESULT_BACKEND"):
    app.conf.result_backend = os.environ["CL_RESULT_BACKEND"]
if os.environ.get("CL_CONF"):
    # Extra settings as JSON, e.g. {"lease_retry_backoff": 0.2}.
    app.conf.update(json.loads(os.environ["CL_CONF"]))
if os.environ.get("CL_FS_DIR"):
    folder = os.environ["CL_FS_DIR"]
    # kombu's own transport can hand a consumer a half-written message file.
    app.conf.broker_transport = "celery_lease.fs_transport:Transport"
    app.conf.broker_transport_options = {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": os.path.join(folder, "control"),
    }
if os.environ.get("CL_VISIBILITY_TIMEOUT"):
    # A short visibility timeout makes Redis redeliver unacked (acks_late)
    # messages quickly, reproducing Celery's duplicate deliveries.
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CL_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

effects_metadata = MetaData()
effects = Table(
    "test_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(255), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("at", Float, nullable=False),
)

_engine: Any = None


def effects_engine() -> Any:
    """An engine on the lease database for the effects table (one per process)."""
    global _engine
    if _engine is None or _engine.pid != os.getpid():
        _engine = create_engine(app.conf.lease_database_url)
        _engine.pid = os.getpid()
    return _engine


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
def flaky(self: LeasedTask, fail_until_attempt: int) -> str:
    """Raise on attempts up to ``fail_until_attempt``, then commit."""
    record(self.lease.run_id, self.lease.attempt, "start")
    if self.lease.attempt <= fail_until_attempt:
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
