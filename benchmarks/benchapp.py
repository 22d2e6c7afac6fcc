"""The Celery app the benchmark workers run, configured from ``BENCH_*`` environment variables.

One trivial task, ``bench.noop``, whose base class depends on ``BENCH_MODE``
(``plain``: Celery's ``Task``; ``leased``: ``LeasedTask``; ``once``:
celery-once's ``QueueOnce``; ``BENCH_BODY`` = ``cpu10`` makes it spin for 10 ms
of CPU, ``sleep50`` makes it sleep 50 ms), and ``bench.hold`` (always leased) for the
takeover measurements. Worker processes append timestamps to
``$BENCH_MARKS/marks-<pid>.log``: ``S t`` at their first task's start and ``E t``
after every task (``task_postrun``, i.e. after the lease completion or the
celery-once unlock), ``H run_id attempt t`` when ``bench.hold`` starts.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from celery import Celery, Task, signals

from celery_lease import LeasedTask


def make_app(env: dict[str, str]) -> Celery:
    """A Celery app for the given ``BENCH_*`` settings (the workers' and the producer's)."""
    mode = env.get("BENCH_MODE", "plain")
    app = Celery("bench")
    conf: dict[str, Any] = {
        "broker_url": env.get("BENCH_BROKER", "memory://"),
        "task_default_queue": env.get("BENCH_QUEUE", "bench"),
        "task_ignore_result": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": True,
        # Plain and celery-once runs use no lease, but the app installs celery-lease,
        # whose worker refuses the per-host default behind a network broker: name one.
        "lease_database_url": env.get("BENCH_LEASE_DB")
        or "sqlite:///" + os.path.join(env.get("BENCH_MARKS") or tempfile.gettempdir(), "x.db"),
        "lease_seconds": float(env.get("BENCH_LEASE_SECONDS", "30")),
    }
    if env.get("BENCH_HEARTBEAT"):
        conf["lease_heartbeat_interval"] = float(env["BENCH_HEARTBEAT"])
    if env.get("BENCH_SWEEP"):
        conf["lease_sweep_interval"] = float(env["BENCH_SWEEP"])
    if env.get("BENCH_FS_DIR"):
        folder = env["BENCH_FS_DIR"]
        # Every set-up (plain, leased, celery-once) uses the same atomic-publish
        # transport, so the comparison stays like for like.
        conf["broker_transport"] = "celery_lease.contrib.fs_transport:Transport"
        conf["broker_transport_options"] = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": os.path.join(folder, "control"),
        }
    if mode == "once":
        conf["ONCE"] = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": env["BENCH_ONCE_URL"], "default_timeout": 3600},
        }
    app.conf.update(conf)

    base: type[Task] = Task
    if mode == "leased":
        base = LeasedTask
    elif mode == "once":
        from celery_once import QueueOnce

        base = QueueOnce

    body = env.get("BENCH_BODY", "noop")

    @app.task(base=base, name="bench.noop", shared=False)  # type: ignore[untyped-decorator]
    def noop(i: int) -> None:
        if body == "cpu10":  # about 10 ms of CPU in the body, in Python
            end = time.thread_time() + 0.010
            spun = 0
            while time.thread_time() < end:  # a system call: one per ~50 µs of work
                for _ in range(2000):
                    spun += 1
        elif body == "sleep50":  # waits 50 ms, as on I/O
            time.sleep(0.050)
        return None

    @app.task(base=LeasedTask, bind=True, name="bench.hold", shared=False)  # type: ignore[untyped-decorator]
    def hold(self: LeasedTask, seconds: float) -> str:
        lease = self.lease
        mark(f"H {lease.run_id} {lease.attempt} {time.time():.6f}")
        if lease.attempt > 1:
            return "taken over"
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
        return "held"

    return app


_out: Any = None
_started = False


def mark(line: str) -> None:
    """Append one line to this process's marks file (flushed: the driver polls it)."""
    global _out
    folder = os.environ.get("BENCH_MARKS")
    if not folder:
        return
    if _out is None or _out[0] != os.getpid():
        handle = open(os.path.join(folder, f"marks-{os.getpid()}.log"), "a")  # noqa: SIM115
        _out = (os.getpid(), handle)
    _out[1].write(line + "\n")
    _out[1].flush()


def _on_prerun(**kwargs: Any) -> None:
    global _started
    if not _started:
        _started = True
        mark(f"S {time.time():.6f}")


def _on_postrun(task: Any = None, **kwargs: Any) -> None:
    if task is not None and task.name == "bench.noop":
        mark(f"E {time.time():.6f}")


signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="bench.prerun")
signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="bench.postrun")

app = make_app(dict(os.environ))
