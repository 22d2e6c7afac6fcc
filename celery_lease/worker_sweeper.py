"""Recovery without beat: :class:`WorkerSweeper`, the in-worker sweeper of one lease database.

Every worker's main process has one per lease database its app uses (unless
``lease_worker_sweeper = False``). All of them stand for the ``sweeper`` leader
lease of that database (:class:`~celery_lease.leadership.Leadership`); the one
that holds it sweeps every ``lease_sweep_interval`` seconds, each step that
changes runs fenced by its leader term, so a worker paused past its lease and
woken cannot sweep. The others only try to take the lease, one statement every
``lease_seconds / 3``. beat's ``celery_lease.sweep`` entry and ``celery lease
sweep`` still work beside it (every sweep step is guarded on its own rows).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import Celery

from .config import LeaseConfig
from .errors import LeadershipLost, LeaseError
from .events import Event
from .leadership import Leadership
from .lease.watchdog import block_signals_in_side_thread
from .requeue import SweepReport
from .runtime import database_settings, runtime_for
from .sanitize import describe_exception, safe_url
from .sweeper import sweep

logger = logging.getLogger(__name__)

#: The leader lease the in-worker sweepers of a database stand for.
SWEEPER_LEADER = "sweeper"
#: The name under which in-worker sweeps are recorded (``celery_lease_sweeps``).
WORKER_SWEEPER = "worker"


class WorkerSweeper:
    """The in-worker sweeper of one lease database, in one worker's main process.

    :meth:`start` runs the leader candidacy in one daemon thread and the sweeps in
    another (a long sweep never delays a renewal); :meth:`sweep_once` is one sweep
    (tests drive it); :meth:`stop` ends both and resigns the lead, so another
    worker takes it at its next try.

    Args:
        app: the Celery app.
        config: the settings of the database to sweep (one of ``lease_databases(app)``).
        hostname: the worker's node name, written in the leader lease's owner.
        worker: the worker's id, written in the owner too.
        clock: the monotonic clock of the leader lease's local deadline.
    """

    def __init__(
        self,
        app: Celery,
        config: LeaseConfig,
        *,
        hostname: str | None = None,
        worker: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        runtime = runtime_for(app, config)
        lease_seconds, _ = database_settings(app, config)
        self.app = app
        self.store = runtime.store
        self.events = runtime.events
        self.database = safe_url(config.database_url)
        #: Seconds between two sweeps of the leader.
        self.interval = config.sweep_interval
        self.leadership = Leadership(
            self.store,
            SWEEPER_LEADER,
            lease_seconds=lease_seconds,
            hostname=hostname,
            worker=worker,
            clock=clock,
            events=runtime.events,
            database=self.database,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_once(self) -> SweepReport | None:
        """Sweep the database once if this process leads its sweeper (else None).

        A step refused because another worker took the lead meanwhile ends the
        sweep there (event ``sweep_fenced``) and this process stands again as a
        standby; any other failure is logged, never raised.
        """
        term = self.leadership.current()
        if term is None:
            return None
        try:
            return sweep(self.app, self.store, name=WORKER_SWEEPER, leader=term)
        except LeadershipLost as exc:
            self.events.emit(
                Event.SWEEP_FENCED,
                None,
                "celery-lease: sweep of %s refused: this worker no longer leads its sweeper "
                "(term %d); another worker sweeps",
                self.database,
                exc.term,
                level=logging.WARNING,
                database=self.database,
                term=exc.term,
            )
            self.leadership.refused(term)
        except LeaseError as exc:
            logger.warning(
                "celery-lease: could not sweep %s: %s",
                self.database,
                describe_exception(exc),
                extra={"lease_event": Event.SWEEP_ERROR, "run_id": None},
            )
        return None

    def start(self) -> None:
        """Stand for the lead now, and sweep every :attr:`interval` s while leading."""
        if self._thread is not None:
            return
        self.leadership.start()
        self._thread = threading.Thread(
            target=self._run, name="celery-lease-worker-sweeper", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sweeping (a sweep under way finishes first, for at most ``timeout`` s) and
        resign the lead."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.leadership.stop(timeout)

    def _run(self) -> None:
        block_signals_in_side_thread()
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except Exception:  # logged, and the loop goes on
                logger.exception(
                    "celery-lease: in-worker sweep of %s crashed",
                    self.database,
                    extra={"lease_event": Event.SWEEP_ERROR, "run_id": None},
                )
