"""Raising :class:`LeaseInterrupt` in a body thread whose lease was lost or cancelled.

An :class:`Interrupter` is the part of a lease that knows the body thread. The
lease tells it when an interrupt is owed, and whether one still is when it may
be delivered; it never reads the lease's state.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Whether this interpreter can raise an exception in another thread
#: (``PyThreadState_SetAsyncExc`` is CPython's C API).
ASYNC_INTERRUPT_SUPPORTED = platform.python_implementation() == "CPython"


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    """CPython's ``PyThreadState_SetAsyncExc``: the number of thread states changed."""
    target = None if exc is None else ctypes.py_object(exc)
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target))


class LeaseInterrupt(BaseException):
    """Raised asynchronously inside a body whose lease was lost or cancelled.

    A ``BaseException`` so that a body's ``except Exception`` does not swallow
    it. :class:`~celery_lease.LeasedTask` turns it into the lease's
    :class:`~celery_lease.errors.LeaseLost` or :class:`~celery_lease.errors.RunCancelled`.
    """


class Interrupter:
    """The body thread of one lease, and the interrupt owed to it.

    It keeps which thread runs the body (armed), how deep the body is in
    ``uninterruptible()`` blocks, whether an interrupt is owed (withheld until
    it is safe) or was sent, and a quiet period after a fenced transaction
    rolled back. It has no lock of its own: its owner calls every method under
    the owner's lock.

    Args:
        run_id: for log messages.
        clock: the owner's monotonic clock.
    """

    def __init__(self, run_id: str, clock: Callable[[], float]) -> None:
        self.run_id = run_id
        self._clock = clock
        self._thread_id: int | None = None  # the armed body thread
        self._depth = 0  # nesting of uninterruptible blocks
        self._sent = False  # raised in the thread, maybe not delivered yet
        self._due = False  # owed, withheld until it is safe
        self._quiet_until = float("-inf")
        #: How many interrupts were raised in the body thread so far.
        self.sent = 0

    @property
    def thread_id(self) -> int | None:
        """The armed body thread, or None."""
        return self._thread_id

    def in_body_thread(self) -> bool:
        """True when called from the armed body thread."""
        tid = self._thread_id
        return tid is not None and tid == threading.get_ident()

    def arm(self, thread_id: int | None = None) -> None:
        """The calling thread (or ``thread_id``) runs the body from now on: interruptible."""
        self._thread_id = threading.get_ident() if thread_id is None else thread_id

    def disarm(self) -> None:
        """The body ended: forget the thread and withdraw an interrupt not yet delivered."""
        tid, self._thread_id = self._thread_id, None
        self._due = False
        if tid is not None and self._sent:
            _set_async_exc(tid, None)
        self._sent = False

    def owe(self) -> bool:
        """An interrupt is owed to the body; True when there is one to deliver it to.

        False without an armed body, or when called from the body thread itself
        (the body found out and raises on its own).
        """
        if self._thread_id is None or self._thread_id == threading.get_ident():
            return False
        self._due = True
        return True

    def hold(self) -> None:
        """Enter an uninterruptible block: take back an interrupt sent, deliver it after."""
        tid = self._thread_id
        if self._sent and tid is not None:
            # Raised but maybe not delivered yet: take it back, deliver after.
            _set_async_exc(tid, None)
            self._sent = False
            self._due = True
        self._depth += 1

    def release(self) -> None:
        """Leave an uninterruptible block (then call :meth:`deliver`)."""
        self._depth -= 1

    def quiet_for(self, seconds: float) -> None:
        """Deliver nothing for ``seconds`` from now."""
        self._quiet_until = self._clock() + seconds

    def deliver(self, owed: bool, now: float | None = None) -> bool:
        """Raise an owed interrupt in the body thread, if it is safe now.

        ``owed`` is the owner's word that the interrupt is still owed; when
        False it is dropped. Returns True when it is withheld only by the quiet
        period: the owner should poll again by :meth:`next_wake`.
        """
        if not self._due or self._depth or self._thread_id is None:
            return False
        if not owed:
            self._due = False
            return False
        if (self._clock() if now is None else now) < self._quiet_until:
            return True
        self._due = False
        tid = self._thread_id
        count = _set_async_exc(tid, LeaseInterrupt)
        if count == 1:
            self._sent = True
            self.sent += 1
        elif count == 0:
            self._thread_id = None
            logger.warning(
                "celery-lease: run %s: the body's thread is gone, nothing to interrupt",
                self.run_id,
                extra={"lease_event": "interrupt_error", "run_id": self.run_id},
            )
        else:
            _set_async_exc(tid, None)
            logger.error(
                "celery-lease: run %s: the interrupt reached %d threads; withdrawn",
                self.run_id,
                count,
                extra={"lease_event": "interrupt_error", "run_id": self.run_id},
            )
        return False

    def next_wake(self) -> float | None:
        """When an owed interrupt can be delivered, or None when none is waiting."""
        if self._due and self._thread_id is not None:
            return max(self._quiet_until, self._clock())
        return None
