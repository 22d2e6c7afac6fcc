"""The handle a running task holds: ``self.lease`` / :func:`current_lease`.

:class:`Lease` is the one owner of a lease's state. Every change (held ->
completing -> completed, lost, cancel requested, cancelled) is made here and
published once as a typed :class:`~celery_lease.events.Transition`; the
heartbeat and the task only report what they learned by calling its methods.

Safety never rests on the heartbeat thread alone: each lease keeps a local
monotonic deadline (see :func:`safety_margin`), and a per-process
:class:`Watchdog` thread, which never touches the network, acts on it even
while the heartbeat thread is stuck in a socket read.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import Connection

from .deadline import CLOCK_RATE_SLACK, SAFETY_FRACTION, DeadlineReports, safety_margin
from .errors import LeaseError, LeaseLost, RunCancelled
from .events import LOG_ONLY, EventLog, LeaseState
from .interrupt import ASYNC_INTERRUPT_SUPPORTED, LeaseInterrupt, _set_async_exc
from .leasestate import _DEADLINE_APPLIES, _INTERRUPTING
from .watchdog import Watchdog, block_signals_in_side_thread, process_watchdog

if TYPE_CHECKING:
    from .store import LeaseStore

T = TypeVar("T")

logger = logging.getLogger(__name__)

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_lease_current", default=None
)

_warned_no_interrupt = False


def current_lease() -> Lease:
    """The lease held by the task running in this thread.

    Raises:
        LeaseError: when no leased task is running here.
    """
    lease = _current.get()
    if lease is None:
        raise LeaseError("no lease is held here: call this inside a LeasedTask body")
    return lease


def current_or_none() -> Lease | None:
    """The lease held by the task running in this thread, or None outside a leased body."""
    return _current.get()


@contextlib.contextmanager
def bind_current(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` the current lease (:func:`current_lease`) inside the block."""
    token = _current.set(lease)
    try:
        yield lease
    finally:
        _current.reset(token)


class Lease(DeadlineReports):
    """Ownership of one run by this worker, renewed by the heartbeat thread.

    The lease is treated as lost locally once its deadline passes: ``started_at``
    (taken before the claim statement was sent) + ``lease_seconds`` - the
    :func:`safety_margin`, moved only by a confirmed renewal (its send time +
    ``lease_seconds`` - margin). The database computes every expiry later than
    that, so this process gives the lease up before anyone can take it over.

    Attributes:
        run_id: the run's id (the task id, or the task's ``lease_key``).
        owner: this claim's unique owner string.
        attempt: the fencing token; hand it to external systems.
        max_attempts: the attempt at which the run is out of attempts, as the
            claim read it from the row (0 when not known: the setting decides).
        events: where its transitions are published: its app's
            :class:`~celery_lease.events.EventBus` (given by the task), else
            :data:`~celery_lease.events.LOG_ONLY`.
    """

    def __init__(
        self,
        store: LeaseStore,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        lease_seconds: float,
        heartbeat_interval: float,
        interrupt: bool = False,
        started_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        watchdog: Watchdog | None = None,
        max_attempts: int = 0,
        events: EventLog = LOG_ONLY,
    ) -> None:
        self.store = store
        self.events = events
        self.run_id = run_id
        self.owner = owner
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval
        self.margin = safety_margin(lease_seconds)
        if interrupt and not ASYNC_INTERRUPT_SUPPORTED:
            _warn_no_interrupt()
            interrupt = False
        self.interrupt = interrupt
        self._clock = clock
        self._watchdog = watchdog
        self._lock = threading.Lock()
        self._state = LeaseState.HELD
        self._lost: LeaseLost | None = None
        self._cancel_seen = False
        start = clock() if started_at is None else started_at
        self._deadline = start + lease_seconds - self.margin
        # COMPLETING / COMPLETED bookkeeping.
        self._fenced_at: float | None = None  # when fence(complete=True) wrote success
        self._verified = False  # the database confirmed this owner's success
        self._hooks: list[tuple[Connection, str, Callable[..., None]]] = []
        # The body thread, and interrupts withheld from it.
        self._thread_id: int | None = None
        self._depth = 0  # nesting of uninterruptible()
        self._sent = False  # an interrupt was raised in the thread, maybe not delivered yet
        self._due = False  # an interrupt is owed, withheld until it is safe
        self._quiet_until = float("-inf")

    # -- what the body sees ------------------------------------------------------

    @property
    def key(self) -> tuple[str, str, int]:
        """``(run_id, owner, attempt)``: what every guarded statement names."""
        return (self.run_id, self.owner, self.attempt)

    @property
    def state(self) -> LeaseState:
        """Where this lease stands now."""
        return self._state

    @property
    def deadline(self) -> float:
        """The local deadline, on this lease's monotonic clock."""
        return self._deadline

    @property
    def lost(self) -> bool:
        """True once this lease is known (or locally presumed) lost."""
        return self._state is LeaseState.LOST

    @property
    def cancel_requested(self) -> bool:
        """True once a renewal has seen a cancel request for this run."""
        return self._cancel_seen

    @property
    def completed_pending(self) -> bool:
        """True once ``fence(complete=True)`` wrote this owner's success and it did not roll back.

        The run may then be recorded succeeded (``completing``: not committed
        yet; ``completed``: committed).
        """
        return self._state in (LeaseState.COMPLETING, LeaseState.COMPLETED)

    @property
    def renewable(self) -> bool:
        """Whether the heartbeat should still renew this lease."""
        state = self._state
        if state is LeaseState.COMPLETED:
            return not self._verified
        return state in (LeaseState.HELD, LeaseState.CANCEL_REQUESTED, LeaseState.COMPLETING)

    def check(self) -> None:
        """Raise if the lease is gone or the run was cancelled; else return at once.

        Raises:
            LeaseLost: the lease was taken over or expired, or its local
                deadline passed without a confirmed renewal.
            RunCancelled: cancellation was requested for this run.
        """
        error = self.error()
        if error is not None:
            raise error

    def error(self) -> LeaseLost | RunCancelled | None:
        """The error :meth:`check` would raise, or None."""
        self.poll_deadline()
        state = self._state
        if state is LeaseState.LOST:
            return self._lost
        if state in (LeaseState.CANCEL_REQUESTED, LeaseState.CANCELLED):
            return RunCancelled(self.run_id, self.owner, self.attempt)
        return None

    def fence(self, connection: Connection, *, complete: bool = False) -> None:
        """Prove, inside ``connection``'s open transaction, that this lease still holds.

        Locks the run row until that transaction ends, so writes made in it
        commit only while this worker owns the run. ``connection`` must be on
        the lease database. With ``complete=True`` the run is also recorded as
        succeeded in the same transaction, so the writes and the completion
        commit together or not at all (exactly-once effects on that database);
        if that transaction rolls back, the lease is held again and watched as
        before.

        Raises:
            LeaseLost: the lease is no longer held, or its local deadline passed
                (the transaction should roll back).
        """
        with self.uninterruptible():
            if self._state is not LeaseState.COMPLETING:
                self._detach_hooks()
            self.check()
            try:
                self.store.fence(
                    connection, self.run_id, self.owner, self.attempt, complete=complete
                )
            except LeaseLost as exc:
                self.mark_lost(exc.reason)
                raise
            if complete:
                self._completing(connection)

    def complete(self) -> None:
        """Record success with the guarded completion (idempotent after ``fence(complete=True)``).

        Raises:
            LeaseLost: another owner holds the run, or it ended otherwise.
            LeaseDatabaseError: the database did not answer; the lease is as
                before and the call may be repeated.
        """
        transition = None
        with self._lock:
            if self._state is LeaseState.COMPLETED and self._verified:
                return
            if self._state in _DEADLINE_APPLIES:
                self._fenced_at = None
                transition = self._move_locked(LeaseState.COMPLETING)
        self._publish(transition)
        try:
            with self.uninterruptible():
                self.store.complete(self.run_id, self.owner, self.attempt)
        except LeaseLost as exc:
            self.mark_lost(exc.reason)
            raise
        except BaseException:
            with self._lock:
                back = None
                if transition is not None and self._state is LeaseState.COMPLETING:
                    back = self._move_locked(transition.previous, "completion not confirmed")
            self._publish(back)
            raise
        with self._lock:
            self._verified = True
            done = None
            if self._state is not LeaseState.COMPLETED:
                done = self._move_locked(LeaseState.COMPLETED)
        self._publish(done)
        self._detach_hooks()

    def mark_cancelled(self) -> None:
        """End the run ``cancelled`` (guarded) after a cancel request.

        Raises:
            LeaseLost: this owner no longer holds the run.
        """
        try:
            with self.uninterruptible():
                self.store.mark_cancelled(self.run_id, self.owner, self.attempt)
        except LeaseLost as exc:
            self.mark_lost(exc.reason)
            raise
        with self._lock:
            transition = self._move_locked(LeaseState.CANCELLED)
        self._publish(transition)

    def mark_lost(self, reason: str) -> bool:
        """Record that this lease is lost (the first reason wins); interrupt the body.

        For whoever learned it: a refused guarded write, the heartbeat, the
        deadline. A lease already completed or cancelled stays so. Returns
        True the first time.
        """
        with self._lock:
            if self._state in (LeaseState.LOST, LeaseState.COMPLETED, LeaseState.CANCELLED):
                return False
            transition = self._lose_locked(reason)
        self._publish(transition)
        return True

    def __repr__(self) -> str:
        return (
            f"<Lease run_id={self.run_id!r} attempt={self.attempt} owner={self.owner!r} "
            f"state={self._state.value}>"
        )


def _warn_no_interrupt() -> None:
    global _warned_no_interrupt
    if not _warned_no_interrupt:
        _warned_no_interrupt = True
        logger.warning(
            "celery-lease: lease_interrupt needs CPython (this is %s): bodies are not "
            "interrupted; call self.lease.check()",
            platform.python_implementation(),
            extra={"lease_event": "interrupt_disabled", "run_id": None},
        )


__all__ = [
    "ASYNC_INTERRUPT_SUPPORTED",
    "CLOCK_RATE_SLACK",
    "SAFETY_FRACTION",
    "_DEADLINE_APPLIES",
    "_INTERRUPTING",
    "Lease",
    "LeaseInterrupt",
    "Watchdog",
    "_current",
    "_set_async_exc",
    "bind_current",
    "block_signals_in_side_thread",
    "current_lease",
    "current_or_none",
    "process_watchdog",
    "safety_margin",
]
