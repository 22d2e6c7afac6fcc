"""Sweeper liveness, seen from a worker: :class:`SweepWatch`.

On a broker that never redelivers (``filesystem://``, ``memory://``,
``sqla+...``) nothing but the sweeper recovers a run whose worker died. Every
worker takes part in sweeping (:mod:`celery_lease.worker_sweeper`) unless
``lease_worker_sweeper = False``; only then does it watch. A worker there that
sees no sweep recorded (``celery_lease_sweeps``) within twice
``lease_sweep_interval`` logs one WARNING saying how to run beat. The check is
one read per lease database every ``lease_sweep_interval`` seconds, in one
daemon thread of the worker's main process; never a statement per task. Every
read also reports the last sweep's time on the app's event bus (event
``sweep_seen``), which the metrics export.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Celery

from .config import celery_command
from .events import Event
from .runtime import app_config, app_runtime, lease_databases, runtime_for
from .sanitize import describe_exception, safe_url

logger = logging.getLogger(__name__)

#: kombu transports (``driver_type``) that never deliver a message again once a
#: worker took it: after a kill -9, only the sweeper recovers the run.
NON_REDELIVERING = frozenset({"filesystem", "memory", "sql"})


def broker_redelivers(app: Celery) -> bool:
    """False when the app's broker transport never redelivers an unacknowledged message."""
    try:
        driver = app.connection_for_read().transport.driver_type
    except Exception:  # an unknown transport: assume it redelivers, warn about nothing
        return True
    return driver not in NON_REDELIVERING


class SweepWatch:
    """Watches for sweeps of every lease database of one app, from a worker's main process.

    :meth:`check_once` is one tick (tests drive it); :meth:`start` runs it every
    ``lease_sweep_interval`` seconds in a daemon thread until :meth:`stop`.
    """

    def __init__(self, app: Celery, *, warn: bool) -> None:
        """``warn``: log the missing-sweeper WARNING (on a broker that never redelivers)."""
        self.app = app
        self.warn = warn
        self.interval = app_config(app).sweep_interval
        self.started = time.monotonic()
        self.warned = False
        # Read here, in the thread of Celery's command line: it names the -A it was given.
        self.command = celery_command(app)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> bool:
        """Read the last sweep of each lease database; True when one was seen within
        twice ``lease_sweep_interval``. Logs the WARNING once, at most, once that long
        has passed since the watch started with no such sweep."""
        window_ms = 2 * self.interval * 1000
        events = app_runtime(self.app).events
        recent = False
        for config in lease_databases(self.app):
            shown = safe_url(config.database_url)
            try:
                last = runtime_for(self.app, config).store.reads.last_sweep()
            except Exception as exc:  # a hook never takes the worker down
                logger.debug("celery-lease: sweep watch: %s: %s", shown, describe_exception(exc))
                continue
            if last is None:
                continue
            age_ms = max(0, int(last["now"]) - int(last["swept_at"]))
            recent = recent or age_ms <= window_ms
            events.emit(
                Event.SWEEP_SEEN,
                None,
                "celery-lease: last sweep of %s %.1f s ago",
                shown,
                age_ms / 1000,
                level=logging.DEBUG,
                database=shown,
                swept_at=time.time() - age_ms / 1000,
            )
        waited = time.monotonic() - self.started >= 2 * self.interval
        if self.warn and waited and not recent and not self.warned:
            self.warned = True
            command = self.command
            logger.warning(
                "celery-lease: no sweep seen in %.0f s (2 x lease_sweep_interval) and this "
                "broker never redelivers: a run whose worker dies is not recovered until a "
                "sweep runs. Turn the workers' own sweeper back on (lease_worker_sweeper = "
                "True, the default), or run beat: `%s beat`",
                2 * self.interval,
                command,
                extra={"lease_event": Event.NO_SWEEPER, "run_id": None},
            )
        return recent

    def start(self) -> None:
        """Tick every ``lease_sweep_interval`` seconds in a daemon thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name="celery-lease-sweep-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking (the thread ends at its next wake-up)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception as exc:  # logged, and the loop goes on
                logger.warning("celery-lease: sweep watch failed: %s", describe_exception(exc))


def watch_sweeps(app: Celery, **kwargs: Any) -> SweepWatch:
    """Start a :class:`SweepWatch` for ``app`` (warning only on a non-redelivering broker)."""
    watch = SweepWatch(app, warn=not broker_redelivers(app), **kwargs)
    watch.start()
    return watch
