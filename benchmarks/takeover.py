"""Takeover latency: how long until another worker runs a run whose worker died or stopped.

Set-up: the embedded default (SQLite lease file, ``filesystem://`` broker, no
``acks_late``, so nothing is redelivered), ``celery beat`` scheduling the
sweeper every ``lease_sweep_interval``, two ``-P prefork -c 1`` workers. Worker
A runs ``bench.hold`` (attempt 1); worker B is idle. After a random pause of up
to one heartbeat interval, A is stopped:

* ``kill -9`` of A's whole process group: the lease must expire, the sweeper
  hands the run back and re-enqueues it, B claims it (attempt 2);
* ``SIGQUIT`` to A's main process (cold shutdown: Celery cancels the running
  body): celery-lease hands A's leases back and re-enqueues them at once; B
  claims the run. (A warm shutdown, ``SIGTERM``, lets the body finish under its
  lease instead, as Celery promises, so it hands nothing over.)

Latency = time from the signal to attempt 2's body starting on B (wall clocks of
one machine).
"""

from __future__ import annotations

import random
import signal
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from celery_lease import LeaseStore

from .benchapp import make_app
from .common import Worker, celery_process, median, read_marks, table, unique, wait_for, worker

LEASE_SECONDS = 6.0
HEARTBEAT = 2.0
SWEEP = 1.0


def _hold_started(marks: Path, run_id: str, attempt: int) -> float | None:
    for kind, fields in read_marks(marks):
        if kind == "H" and fields[0] == run_id and int(fields[1]) == attempt:
            return float(fields[2])
    return None


def run(trials: int, work: Path, log: Any = print) -> tuple[str, dict[str, Any]]:
    """``trials`` kill -9 and SIGQUIT (cold shutdown) takeovers: a Markdown table, raw figures."""
    base = Path(tempfile.mkdtemp(prefix="takeover-", dir=work))
    marks = base / "marks"
    marks.mkdir()
    folder = base / "broker"
    (folder / "control").mkdir(parents=True)
    db_url = f"sqlite:///{base / 'leases.sqlite3'}"
    env = {
        "BENCH_MODE": "plain",
        "BENCH_MARKS": str(marks),
        "BENCH_QUEUE": unique("tq"),
        "BENCH_BROKER": "filesystem://",
        "BENCH_FS_DIR": str(folder),
        "BENCH_LEASE_DB": db_url,
        "BENCH_LEASE_SECONDS": str(LEASE_SECONDS),
        "BENCH_HEARTBEAT": str(HEARTBEAT),
        "BENCH_SWEEP": str(SWEEP),
    }
    store = LeaseStore.from_url(db_url)
    store.create_schema()
    producer = make_app(env)
    procs: list[Worker] = []

    def start(name: str) -> Worker:
        proc = worker(env, base / f"{name}.log", name, concurrency=1, loglevel="INFO")
        procs.append(proc)
        return proc.wait_ready(60.0)

    results: dict[str, list[tuple[float, float]]] = {"kill -9": [], "SIGQUIT": []}
    try:
        beat_args = ["beat", "-s", str(base / "beat-schedule"), "-l", "INFO"]
        procs.append(celery_process(beat_args, env, base / "beat.log", "beat"))
        for trial in range(trials):
            for how in ("kill -9", "SIGQUIT"):
                a = start(unique("a"))
                run_id = uuid.uuid4().hex
                producer.send_task("bench.hold", args=(120.0,), task_id=run_id)
                wait_for(partial(_hold_started, marks, run_id, 1), 30, 0.05, "attempt 1")
                b = start(unique("b"))
                time.sleep(random.uniform(0, HEARTBEAT))
                stopped_at = time.time()
                if how == "kill -9":
                    a.kill9()
                else:
                    a.proc.send_signal(signal.SIGQUIT)
                row = store.get(run_id)
                left = 0.0
                if row is not None and row.lease_expires_at is not None:
                    left = max(0.0, (row.lease_expires_at - store.now_ms()) / 1000)
                started = wait_for(
                    partial(_hold_started, marks, run_id, 2),
                    LEASE_SECONDS + 60,
                    0.02,
                    f"takeover after {how}",
                )
                latency = started - stopped_at
                results[how].append((latency, left))
                log(
                    f"  trial {trial + 1} {how:8}: taken over after {latency:.2f}s "
                    f"(lease had {left:.2f}s left)"
                )
                for proc in (a, b):
                    proc.stop(20.0)
                    procs.remove(proc)
    finally:
        for proc in procs:
            proc.stop(20.0)
        producer.close()
        store.dispose()
    bound = LEASE_SECONDS + HEARTBEAT + 1
    rows = []
    raw: dict[str, Any] = {}
    for how, values in results.items():
        latencies = [v[0] for v in values]
        worst = max(latencies)
        if how == "kill -9":
            target = f"<= {bound:.0f} s"
            ok = worst <= bound
        else:
            target = f"well under {LEASE_SECONDS:.0f} s (< {LEASE_SECONDS / 3:.0f} s)"
            ok = worst < LEASE_SECONDS / 3
        rows.append(
            [
                how,
                f"{median(latencies):.2f}",
                f"{worst:.2f}",
                " / ".join(f"{v:.2f}" for v in latencies),
                " / ".join(f"{v[1]:.2f}" for v in values),
                target,
                "met" if ok else "missed",
            ]
        )
        raw[how] = latencies
    headers = [
        "worker stopped by",
        "takeover s (median)",
        "worst s",
        "each trial s",
        "lease left at the signal s",
        "target",
        "result",
    ]
    return table(headers, rows), raw
