"""Leader election over the lease database: :class:`Leadership`, one candidacy per process.

Leadership is a lease: one row of ``celery_lease_leaders`` per name, taken by one
process at a time (:class:`~celery_lease.store.leaders.Leaders`). Each process that
wants to lead (every worker for its databases' sweeper, every
:class:`~celery_lease.beat.LeaseScheduler` beat) has one :class:`Leadership` per
name and database. It sends one statement every ``lease_seconds / 3``: the leader
renews, a standby tries to take the lease, which a dead or stalled leader stops
renewing. The lease lasts two thirds of ``lease_seconds``, so a standby takes over
within ``lease_seconds`` of the leader's death.

Never trust a thread (STYLE.md 14): the leader counts as leader only until a local
monotonic deadline, moved by confirmed renewals only, and every write it makes as
leader is fenced in its own transaction by its ``(owner, term)``, which the
database refuses once another process took over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .errors import LeaseError
from .events import LOG_ONLY, Event, EventLog
from .lease.lease import safety_margin
from .lease.watchdog import block_signals_in_side_thread
from .owner import Owner
from .sanitize import describe_exception
from .store import LeaseStore
from .store.leaders import LeaderTerm

logger = logging.getLogger(__name__)

#: The leader lease's length, as a fraction of ``lease_seconds``: renewed every third,
#: it survives one missed renewal, and a standby trying every third takes it over
#: within ``lease_seconds`` of the last renewal.
TTL_FRACTION = 2 / 3
#: After a failed statement, try again this soon (or at the normal interval, if shorter).
ERROR_RETRY_SECONDS = 1.0


class Leadership:
    """This process's candidacy for the leader lease ``name`` on one lease database.

    :meth:`step` is one try (tests and the beat call it; :meth:`start` runs it in a
    daemon thread every :attr:`interval` seconds). :meth:`current` says whether this
    process leads now, and in which term: the token its fenced writes carry.

    Args:
        store: the lease database's store.
        name: the leader lease (``sweeper``, ``beat:<app>``).
        lease_seconds: the length the timings derive from (see the module).
        hostname: written in the owner (a worker's node name; default: the host).
        worker: the worker id written in the owner, if any.
        clock: the monotonic clock of the local deadline.
        events: where takeovers and losses are reported (the app's bus).
        database: the database as shown in events (password masked).
    """

    def __init__(
        self,
        store: LeaseStore,
        name: str,
        *,
        lease_seconds: float,
        hostname: str | None = None,
        worker: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: EventLog = LOG_ONLY,
        database: str = "",
    ) -> None:
        self.store = store
        self.name = name
        #: Seconds the leader lease lasts from a renewal (DB clock).
        self.ttl = lease_seconds * TTL_FRACTION
        #: Seconds between two tries (renewals, or takeover attempts).
        self.interval = lease_seconds / 3
        self.events = events
        self.database = database
        self._margin = safety_margin(self.ttl)
        self._hostname = hostname
        self._worker = worker
        self._clock = clock
        self._lock = threading.Lock()
        self._term: LeaderTerm | None = None
        self._deadline = 0.0
        self._row_exists = False
        #: Tries in a row the database refused (an outage logs its first and its end).
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ttl_ms(self) -> int:
        """:attr:`ttl` in milliseconds."""
        return max(1, round(self.ttl * 1000))

    def current(self) -> LeaderTerm | None:
        """The term this process leads in, or None. Past the local deadline (no renewal
        confirmed in time) the lead is dropped here, whatever the database says."""
        with self._lock:
            term = self._term
            if term is None:
                return None
            if self._clock() < self._deadline:
                return term
        self._drop(term, "local deadline passed without a confirmed renewal")
        return None

    def step(self) -> float:
        """One try: renew the lease this process holds, else take it if it is free. One
        statement (two when a takeover wins: the new term is read back). Returns the
        seconds until the next try is due. A database error is reported, never raised."""
        term = self.current()
        sent_at = self._clock()
        try:
            if term is not None:
                if self.store.leaders.renew(term, self.ttl_ms):
                    with self._lock:
                        if self._term == term:
                            self._deadline = sent_at + self.ttl - self._margin
                    self._worked()
                    return self.interval
                self._drop(term, "renewal refused: the lease expired or was taken over")
            self._take(sent_at)
        except LeaseError as exc:
            self._failures += 1
            error = describe_exception(exc)
            # An outage is tried again each second: its first failure is a WARNING, the
            # repeats DEBUG (still counted by the metrics), its end one INFO line.
            first = self._failures == 1
            self.events.emit(
                Event.LEADER_ERROR,
                None,
                "celery-lease: %s leader lease on %s: %s%s",
                self.name,
                self.database,
                error,
                " (tried again every second; repeats are logged at DEBUG until it works)"
                if first
                else f" (failed try {self._failures})",
                level=logging.WARNING if first else logging.DEBUG,
                role=self.name,
                database=self.database,
                error=error,
            )
            return min(self.interval, ERROR_RETRY_SECONDS)
        self._worked()
        return self.interval

    def _worked(self) -> None:
        """A try the database answered: end an outage's run of failures with one line."""
        failures, self._failures = self._failures, 0
        if failures:
            logger.info(
                "celery-lease: %s leader lease on %s works again after %d failed %s",
                self.name,
                self.database,
                failures,
                "try" if failures == 1 else "tries",
            )

    def _take(self, sent_at: float) -> None:
        """Try to take the lease with a new owner; on success this process leads."""
        owner = Owner.new(self._hostname, self._worker).format()
        leaders = self.store.leaders
        term_number: int | None = None
        if not self._row_exists:
            if leaders.create(self.name, owner, self.ttl_ms):
                term_number = 1
            self._row_exists = True
        if term_number is None:
            if not leaders.take(self.name, owner, self.ttl_ms):
                return
            term_number = leaders.term_of(self.name, owner)
            if term_number is None:
                return  # taken over again at once
        term = LeaderTerm(self.name, owner, term_number)
        with self._lock:
            self._term = term
            self._deadline = sent_at + self.ttl - self._margin
        self.events.emit(
            Event.LEADER_TAKEN,
            None,
            "celery-lease: this process leads %s on %s (term %d)",
            self.name,
            self.database,
            term.term,
            role=self.name,
            database=self.database,
            term=term.term,
        )

    def refused(self, term: LeaderTerm) -> None:
        """The database refused a write fenced by ``term``: this process leads no more."""
        self._drop(term, "a fenced write was refused: another process took over")

    def resign(self) -> None:
        """End the lease now if this process holds it (a shutdown), so a standby takes over
        at its next try instead of after expiry. A failure is logged, never raised."""
        with self._lock:
            term, self._term = self._term, None
        if term is None:
            return
        try:
            self.store.leaders.resign(term)
        except LeaseError as exc:
            logger.warning(
                "celery-lease: could not resign the %s leader lease: %s",
                self.name,
                describe_exception(exc),
            )
            return
        self.events.emit(
            Event.LEADER_RESIGNED,
            None,
            "celery-lease: this process resigned %s on %s (term %d)",
            self.name,
            self.database,
            term.term,
            role=self.name,
            database=self.database,
            term=term.term,
        )

    def _drop(self, term: LeaderTerm, reason: str) -> None:
        with self._lock:
            if self._term != term:
                return  # dropped already
            self._term = None
        self.events.emit(
            Event.LEADER_LOST,
            None,
            "celery-lease: this process no longer leads %s on %s (term %d): %s",
            self.name,
            self.database,
            term.term,
            reason,
            level=logging.WARNING,
            role=self.name,
            database=self.database,
            term=term.term,
            reason=reason,
        )

    # -- the optional side thread -------------------------------------------------------

    def start(self) -> None:
        """Try now, in the caller's thread, then every :attr:`interval` seconds in a daemon
        thread until :meth:`stop`."""
        if self._thread is not None:
            return
        wait = self.step()
        self._thread = threading.Thread(
            target=self._run, args=(wait,), name=f"celery-lease-leader-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (waiting at most ``timeout`` s), then :meth:`resign`."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.resign()

    def _run(self, wait: float) -> None:
        block_signals_in_side_thread()
        while not self._stop.wait(wait):
            try:
                wait = self.step()
            except Exception:  # never let the candidacy die silently
                logger.exception(
                    "celery-lease: %s leader step crashed",
                    self.name,
                    extra={"lease_event": Event.LEADER_ERROR, "run_id": None},
                )
                wait = ERROR_RETRY_SECONDS
