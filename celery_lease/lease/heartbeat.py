"""The per-process heartbeat: one daemon thread renews every lease the process holds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..events import LOG_ONLY, Event, EventLog
from ..sanitize import describe_exception
from ..store import HeartbeatResult, LeaseKey, LeaseStore
from ..store.records import Progress
from .lease import Lease
from .watchdog import block_signals_in_side_thread

logger = logging.getLogger(__name__)

#: After a failed tick, retry this soon (or at the normal interval, if shorter).
ERROR_RETRY_SECONDS = 1.0


class Heartbeat:
    """Renews all registered leases in one statement per tick.

    The same statement writes the progress each lease's body reported since
    the last tick (never a statement of its own). Should the database refuse
    that statement while it carries progress, the tick renews every lease
    without it and writes each run's progress alone, dropping what is still
    refused for that run only: one run's value never costs another its lease.

    A lease whose fenced transaction is open is left out of the tick: its run's row
    lock, held by that transaction, keeps every takeover out, and the renewal would
    wait for it (and, batched, fail with every other lease of the process). It is
    renewed by a tick the end of that transaction starts at once (only when a tick
    passed it over: a short transaction costs no statement).

    The thread starts on the first :meth:`register`. Each tick waits the
    shortest ``heartbeat_interval`` among the registered leases. A database
    error is logged and retried. What a tick learns is reported to each
    :class:`Lease`, which decides: a confirmed renewal moves its deadline, a
    refused one loses it (unless its completion is being committed), a failed
    tick lets its local deadline decide. Safety does not depend on this
    thread: a stuck tick only stops renewals, and each lease's deadline (acted
    on by the watchdog) still passes.

    Args:
        store: the lease store.
        interval: the longest wait between ticks.
        clock: the monotonic clock renewals are timed with (the leases' clock).
        events: where ticks are reported (the app's bus; by default only logged).
    """

    def __init__(
        self,
        store: LeaseStore,
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        events: EventLog = LOG_ONLY,
    ) -> None:
        self.store = store
        self.events = events
        self.interval = interval
        self._clock = clock
        self._leases: dict[tuple[str, str, int], Lease] = {}
        self._lock = threading.Lock()
        self._tick = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.last_tick_seconds: float | None = None

    def register(self, lease: Lease, *, start: bool = True) -> None:
        """Start renewing ``lease`` (and start the thread if needed).

        With ``start=False`` no thread is started: ticks happen only through
        :meth:`beat_once` (for tests and tools).
        """
        lease.when_unfenced(self._wake.set)
        with self._lock:
            self._leases[lease.key] = lease
            if lease.heartbeat_interval < self.interval and lease.heartbeat_interval < (
                self._wait_locked(exclude=lease)
            ):
                self._wake.set()  # the current wait is too long for this lease
            if start and (self._thread is None or not self._thread.is_alive()):
                self._start_locked()

    def unregister(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
        with self._lock:
            self._leases.pop(lease.key, None)

    def held(self) -> list[Lease]:
        """The leases currently registered."""
        with self._lock:
            return list(self._leases.values())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (up to ``timeout`` seconds)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def beat_once(self) -> HeartbeatResult | None:
        """Run one tick now: renew, and report the outcome to each lease. None on error.

        One tick at a time: a tick asked for from another thread (a test's
        ``heartbeat_now``) waits for the thread's, so no progress is written twice.
        """
        with self._tick:
            return self._beat()

    def _beat(self) -> HeartbeatResult | None:
        leases = []
        for lease in self.held():
            if lease.fencing:
                lease.passed_over()
            elif lease.renewable:
                leases.append(lease)
        if not leases:
            return None
        progress = {
            lease.key: reported
            for lease in leases
            if (reported := lease.report.pending()) is not None
        }
        sent_at = self._clock()
        try:
            result, progress = self._renew(leases, progress)
        except Exception as exc:
            if not any(lease.fencing for lease in leases):
                self._failed(leases, exc)
                return None
            # A body fenced as the tick was sent: its row lock held the statement back.
            # Renew the others without it.
            leases = [lease for lease in leases if not lease.fencing]
            if not leases:
                return None
            kept = {lease.key for lease in leases}
            progress = {key: p for key, p in progress.items() if key in kept}
            sent_at = self._clock()
            try:
                result, progress = self._renew(leases, progress)
            except Exception as again:
                self._failed(leases, again)
                return None
        return self._report(leases, result, progress, sent_at)

    def _failed(self, leases: list[Lease], exc: Exception) -> None:
        """A tick that renewed nothing: log it; each lease's local deadline decides."""
        self._failing = True
        error = describe_exception(exc)
        self.events.emit(
            Event.HEARTBEAT_ERROR,
            None,
            "celery-lease heartbeat failed for %d lease(s): %s",
            len(leases),
            error,
            level=logging.WARNING,
            error=error,
            keys=[lease.key for lease in leases],
        )
        now = self._clock()
        for lease in leases:
            lease.poll_deadline(now)

    def _renew(
        self, leases: list[Lease], progress: dict[LeaseKey, Progress]
    ) -> tuple[HeartbeatResult, dict[LeaseKey, Progress]]:
        """Renew ``leases`` in one statement with their ``progress``; the result, and the
        progress written (each run's alone when the batch with it was refused)."""
        try:
            return self.store.heartbeat((lease.key for lease in leases), progress), progress
        except Exception:
            if not progress:
                raise
        # One run's progress may be what the database refused: renew every
        # lease without it, then write each run's progress alone.
        result = self.store.heartbeat(lease.key for lease in leases)
        return result, self._isolate(leases, progress)

    def _report(
        self,
        leases: list[Lease],
        result: HeartbeatResult,
        progress: dict[LeaseKey, Progress],
        sent_at: float,
    ) -> HeartbeatResult:
        """Tell each lease what the tick sent at ``sent_at`` learned."""
        self._failing = False
        self.last_tick_seconds = self._clock() - sent_at
        self.events.emit(
            Event.HEARTBEAT,
            None,
            "renewed %d lease(s) in %.1f ms",
            len(result.renewed),
            self.last_tick_seconds * 1000,
            level=logging.DEBUG,
            leases=len(leases),
            seconds=self.last_tick_seconds,
        )
        for lease in leases:
            if lease.key in result.renewed:
                written = progress.get(lease.key)
                lease.renewed(
                    sent_at,
                    cancel_requested=lease.key in result.cancel_requested,
                    progress=written,
                )
                if written is not None:
                    self.events.emit(
                        Event.PROGRESS,
                        lease.run_id,
                        "run %s: progress %g/%s written",
                        lease.run_id,
                        written.done,
                        "-" if written.total is None else f"{written.total:g}",
                        level=logging.DEBUG,
                        task=lease.task_name,
                        done=written.done,
                        total=written.total,
                    )
            else:
                lease.refused("heartbeat refused: lease taken over, expired or ended")
        return result

    def _isolate(
        self, leases: list[Lease], progress: dict[LeaseKey, Progress]
    ) -> dict[LeaseKey, Progress]:
        """After a batched renewal carrying ``progress`` failed and one without it
        succeeded: write each run's progress in a statement of its own (a renewal of
        that lease alone); the progress the database refuses is dropped for its run,
        which keeps its lease. The progress written, per lease."""
        written: dict[LeaseKey, Progress] = {}
        for lease in leases:
            reported = progress.get(lease.key)
            if reported is None:
                continue
            try:
                self.store.heartbeat([lease.key], {lease.key: reported})
            except Exception as exc:
                lease.report.written(reported)  # never offered again; the next report is
                error = describe_exception(exc)
                self.events.emit(
                    Event.PROGRESS_DROPPED,
                    lease.run_id,
                    "run %s: progress dropped, the database refused it: %s",
                    lease.run_id,
                    error,
                    level=logging.WARNING,
                    task=lease.task_name,
                    error=error,
                )
                continue
            written[lease.key] = reported
        return written

    def _wait_locked(self, exclude: Lease | None = None) -> float:
        intervals = [
            lease.heartbeat_interval for lease in self._leases.values() if lease is not exclude
        ]
        wait = min([self.interval, *intervals])
        if self._failing:
            wait = min(wait, ERROR_RETRY_SECONDS)
        return wait

    def _start_locked(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="celery-lease-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        block_signals_in_side_thread()
        while not self._stop.is_set():
            with self._lock:
                wait = self._wait_locked()
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.beat_once()
            except Exception:  # never let the renewer die silently
                logger.exception(
                    "celery-lease heartbeat tick crashed",
                    extra={"lease_event": Event.HEARTBEAT_ERROR, "run_id": None},
                )
