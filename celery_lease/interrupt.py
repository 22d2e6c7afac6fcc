"""Raising :class:`LeaseInterrupt` in a body thread whose lease was lost or cancelled."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .leasestate import _DEADLINE_APPLIES, _INTERRUPTING, LeaseFields
from .watchdog import process_watchdog

T = TypeVar("T")

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
    :class:`LeaseLost` or :class:`RunCancelled`.
    """


class Interrupts(LeaseFields):
    """The interrupt machinery of a lease (a layer of :class:`~celery_lease.lease.Lease`)."""

    @contextlib.contextmanager
    def uninterruptible(self) -> Iterator[None]:
        """Withhold the interrupt inside this block; deliver it right after.

        Wrap library work the body thread does on the lease's behalf (a commit,
        a publish, a database call): an exception raised at an arbitrary
        instruction there could break shared connection state. Outside the
        armed body thread this does nothing.
        """
        tid = self._thread_id
        if tid is None or tid != threading.get_ident():
            yield
            return
        with self._lock:
            if self._sent:
                # Raised but maybe not delivered yet: take it back, deliver after.
                _set_async_exc(tid, None)
                self._sent = False
                self._due = True
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                self._deliver_due_locked()

    def run_interruptible(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn`` with this lease watched; with ``interrupt`` on, a loss raises in it.

        The interrupt is :class:`LeaseInterrupt`, delivered to this thread at its
        next Python instruction (a blocking C call such as ``time.sleep`` finishes
        first), also when the local deadline passes while the heartbeat thread is
        stuck. Once ``fn`` has returned or raised, no interrupt can arrive.
        """
        watchdog = self._watchdog = self._watchdog or process_watchdog()
        watchdog.watch(self)  # type: ignore[arg-type]  # only ever a layer of Lease
        try:
            if not self.interrupt:
                return fn(*args, **kwargs)
            with self._lock:
                if self._state in _INTERRUPTING:
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
        finally:
            watchdog.unwatch(self)  # type: ignore[arg-type]

    def _disarm(self) -> None:
        with self._lock:
            tid, self._thread_id = self._thread_id, None
            self._due = False
            if tid is not None and self._sent:
                # Withdraw an interrupt that was sent but not yet delivered.
                _set_async_exc(tid, None)
            self._sent = False

    def _interrupt_locked(self) -> None:
        if self._thread_id is None or self._thread_id == threading.get_ident():
            return  # no body to interrupt, or the body found out itself and raises
        self._due = True
        self._deliver_due_locked()

    def _deliver_due_locked(self, now: float | None = None) -> None:
        if not self._due or self._depth or self._thread_id is None:
            return
        if self._state not in _INTERRUPTING:
            self._due = False
            return
        if (self._clock() if now is None else now) < self._quiet_until:
            if self._watchdog is not None:
                self._watchdog.nudge()  # it delivers once the quiet period ends
            return
        self._due = False
        tid = self._thread_id
        count = _set_async_exc(tid, LeaseInterrupt)
        if count == 1:
            self._sent = True
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

    def _next_wake_locked(self) -> float | None:
        if self._state in _DEADLINE_APPLIES:
            return self._deadline
        if self._due and self._thread_id is not None:
            return max(self._quiet_until, self._clock())
        return None
