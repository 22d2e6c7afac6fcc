"""The handle a running task holds: ``self.lease`` / :func:`current_lease`."""

from __future__ import annotations

import contextvars
import ctypes
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection

from .errors import LeaseError, LeaseLost, RunCancelled

if TYPE_CHECKING:
    from .store import LeaseStore

T = TypeVar("T")

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_lease_current", default=None
)


class LeaseInterrupt(BaseException):
    """Raised asynchronously inside a body whose lease was lost or cancelled.

    A ``BaseException`` so that a body's ``except Exception`` does not swallow
    it. :class:`~celery_lease.LeasedTask` turns it into the lease's
    :class:`LeaseLost` or :class:`RunCancelled`.
    """


def current_lease() -> Lease:
    """The lease held by the task running in this thread.

    Raises:
        LeaseError: when no leased task is running here.
    """
    lease = _current.get()
    if lease is None:
        raise LeaseError("no lease is held here: call this inside a LeasedTask body")
    return lease


class Lease:
    """Ownership of one run by this worker, renewed by the heartbeat thread.

    Attributes:
        run_id: the run's id (the task id, or the task's ``lease_key``).
        owner: this claim's unique owner string.
        attempt: the fencing token; hand it to external systems.
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
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.owner = owner
        self.attempt = attempt
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval
        self.interrupt = interrupt
        self._lock = threading.Lock()
        self._lost: LeaseLost | None = None
        self._cancel_requested = False
        # Local, conservative expiry: the renewal was sent no earlier than this,
        # so the database's expiry is at least this late.
        self._deadline = time.monotonic() + lease_seconds
        self._thread_id: int | None = None
        #: Set by ``fence(complete=True)``: the run may already be recorded succeeded.
        self.completed_pending = False

    @property
    def key(self) -> tuple[str, str, int]:
        """``(run_id, owner, attempt)``: what every guarded statement names."""
        return (self.run_id, self.owner, self.attempt)

    @property
    def lost(self) -> bool:
        """True once the heartbeat has seen this lease lost."""
        return self._lost is not None

    @property
    def cancel_requested(self) -> bool:
        """True once the heartbeat has seen a cancel request for this run."""
        return self._cancel_requested

    def check(self) -> None:
        """Raise if the lease is gone or the run was cancelled; else return at once.

        Raises:
            LeaseLost: the heartbeat saw the lease taken over or expired.
            RunCancelled: cancellation was requested for this run.
        """
        error = self.error()
        if error is not None:
            raise error

    def error(self) -> LeaseLost | RunCancelled | None:
        """The error :meth:`check` would raise, or None."""
        if self._lost is not None:
            return self._lost
        if self._cancel_requested:
            return RunCancelled(self.run_id, self.owner, self.attempt)
        return None

    def fence(self, connection: Connection, *, complete: bool = False) -> None:
        """Prove, inside ``connection``'s open transaction, that this lease still holds.

        Locks the run row until that transaction ends, so writes made in it
        commit only while this worker owns the run. ``connection`` must be on
        the lease database. With ``complete=True`` the run is also recorded as
        succeeded in the same transaction, so the writes and the completion
        commit together or not at all (exactly-once effects on that database).

        Raises:
            LeaseLost: the lease is no longer held (the transaction should roll back).
        """
        self.check()
        try:
            self.store.fence(connection, self.run_id, self.owner, self.attempt, complete=complete)
        except LeaseLost as exc:
            self.mark_lost(exc.reason)
            raise
        if complete:
            # Renewals stop matching once that transaction commits; that is
            # success, not a lost lease.
            self.completed_pending = True

    # -- used by the heartbeat thread ---------------------------------------------

    def renewed(self, sent_at: float) -> None:
        """Record a confirmed renewal sent at monotonic time ``sent_at``."""
        self._deadline = sent_at + self.lease_seconds

    def expired_locally(self, now: float) -> bool:
        """True when the last confirmed expiry has passed."""
        return now >= self._deadline

    def mark_lost(self, reason: str) -> bool:
        """Record the loss (first reason wins) and interrupt the body if asked to.

        Returns True the first time.
        """
        with self._lock:
            if self._lost is not None:
                return False
            self._lost = LeaseLost(self.run_id, self.owner, self.attempt, reason)
            self._interrupt_locked()
            return True

    def mark_cancel_requested(self) -> bool:
        """Record a cancel request; interrupt the body if asked to. True the first time."""
        with self._lock:
            if self._cancel_requested:
                return False
            self._cancel_requested = True
            self._interrupt_locked()
            return True

    def run_interruptible(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn``; with ``interrupt`` on, a lost or cancelled lease raises in it.

        The interrupt is :class:`LeaseInterrupt`, delivered to this thread at its
        next Python instruction (a blocking C call such as ``time.sleep`` finishes
        first). Once ``fn`` has returned or raised, no interrupt can arrive.
        """
        if not self.interrupt:
            return fn(*args, **kwargs)
        with self._lock:
            if self._lost is not None or self._cancel_requested:
                raise LeaseInterrupt()
            self._thread_id = threading.get_ident()
        try:
            return fn(*args, **kwargs)
        finally:
            # An interrupt sent just as fn ended may land inside this loop: it is
            # swallowed, and the loop repeats until this thread is disarmed.
            while True:
                try:
                    self._disarm()
                    break
                except LeaseInterrupt:
                    continue

    def _disarm(self) -> None:
        with self._lock:
            tid, self._thread_id = self._thread_id, None
            if tid is not None:
                # Withdraw an interrupt that was sent but not yet delivered.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)

    def _interrupt_locked(self) -> None:
        if self._thread_id is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread_id), ctypes.py_object(LeaseInterrupt)
            )

    def __repr__(self) -> str:
        return f"<Lease run_id={self.run_id!r} attempt={self.attempt} owner={self.owner!r}>"
