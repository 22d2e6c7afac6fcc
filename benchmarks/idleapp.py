"""The app of ``benchmarks.idle``: one leased task that never runs, and a statement counter.

Every statement a process sends through SQLAlchemy (what an idle worker and beat send:
leader leases, sweeps, beat's schedule) is counted, and each process writes its count,
once a second, to ``$IDLE_COUNTS/<pid>.json``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import Celery
from sqlalchemy import event
from sqlalchemy.engine import Engine

from celery_lease import LeasedTask

app = Celery("idle")
app.conf.update(
    broker_url=os.environ["IDLE_BROKER"],
    task_default_queue=os.environ["IDLE_QUEUE"],
    broker_connection_retry_on_startup=True,
    lease_database_url=os.environ["IDLE_LEASE_DB"],
    lease_seconds=float(os.environ.get("IDLE_LEASE_SECONDS", "30")),
    lease_sweep_interval=float(os.environ.get("IDLE_SWEEP_INTERVAL", "60")),
)

_counts = {"statements": 0}
_writer: dict[int, threading.Thread] = {}


def _write_forever() -> None:
    path = os.path.join(os.environ["IDLE_COUNTS"], f"{os.getpid()}.json")
    while True:
        with open(path + ".tmp", "w") as out:
            json.dump(
                {"pid": os.getpid(), "statements": _counts["statements"], "at": time.time()}, out
            )
        os.replace(path + ".tmp", path)
        time.sleep(1.0)


@event.listens_for(Engine, "before_cursor_execute")
def _count(*args: Any, **kwargs: Any) -> None:
    pid = os.getpid()
    if pid not in _writer:
        _counts["statements"] = 0  # a forked child starts its own count
        _writer[pid] = threading.Thread(target=_write_forever, daemon=True)
        _writer[pid].start()
    _counts["statements"] += 1


@app.task(base=LeasedTask, bind=True, name="idle.never")
def never(self: LeasedTask) -> None:
    """Never sent: it makes the app a celery-lease app."""
