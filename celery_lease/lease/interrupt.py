"""Raising :class:`LeaseInterrupt` in a body thread whose lease was lost or cancelled.

An :class:`Interrupter` is the part of a lease that knows the body thread. The
lease tells it when an interrupt is owed, and whether one still is when it may
be delivered; it never reads the lease's state.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import platform
import sys
import threading
from collections.abc import Callable
from types import FrameType

from ..events import Event

logger = logging.getLogger(__name__)

#: Whether this interpreter can raise an exception in another thread
#: (``PyThreadState_SetAsyncExc`` is CPython's C API).
ASYNC_INTERRUPT_SUPPORTED = platform.python_implementation() == "CPython"


#: Modules (and their submodules) whose code the interrupt never lands in: code that
#: changes state shared by the whole process in steps an exception must not split. A
#: connection pool between taking a connection and handing it out (or back), a lock or
#: queue between acquiring and releasing, a logging handler, an import, Celery's and
#: the broker clients' own code. A database driver waiting on the network is not among
#: them: SQLAlchemy invalidates a connection whose statement an exception cut short,
#: as it does for ``KeyboardInterrupt``. While any frame the body's own code called is
#: in one of them, or is a ``__del__`` (where an exception is swallowed), the
#: interrupt waits and is tried again every :data:`SAFE_POINT_RETRY_SECONDS`.
UNSAFE_MODULES = (
    "sqlalchemy.pool",
    "sqlalchemy.event",
    "sqlalchemy.util.queue",
    "sqlalchemy.util._concurrency_py3k",
    "psycopg_pool",
    "redis.connection",
    "urllib3.connectionpool",
    "kombu",
    "amqp",
    "vine",
    "celery",
    "billiard",
    "celery_lease",
    "threading",
    "queue",
    "logging",
    "concurrent",
    "importlib",
    "weakref",
    "_weakrefset",
    "_threading_local",
)
_UNSAFE_TOP = {name.partition(".")[0] for name in UNSAFE_MODULES}
_UNSAFE_DOTTED = tuple(name + "." for name in UNSAFE_MODULES)


def _unsafe(frame: FrameType) -> bool:
    """True when ``frame`` runs code the interrupt must not land in."""
    if frame.f_code.co_name == "__del__":
        return True
    name = frame.f_globals.get("__name__")
    if not isinstance(name, str):
        return True
    if name.partition(".")[0] not in _UNSAFE_TOP:
        return False
    return name in UNSAFE_MODULES or name.startswith(_UNSAFE_DOTTED)


#: How soon to look again when the body was found inside such code.
SAFE_POINT_RETRY_SECONDS = 0.005


def _at_safe_point(frame: FrameType | None, entry: FrameType | None) -> bool:
    """True when the body, whose innermost frame is ``frame``, runs its own code.

    The frames from ``frame`` down to the body's outermost frame of its own must
    all be its own: none may run code of :data:`UNSAFE_MODULES`, which the body
    called (a pool, a driver) or which called back into the body (a pool event
    listener). Frames below the body's own, down to ``entry`` (the caller of the
    body), are wrappers around it (Celery's ``autoretry_for``): an exception passes
    through them as any exception the body raises.
    """
    own = False
    library = False  # seen a frame of UNSAFE_MODULES above the current one
    while frame is not None and frame is not entry:
        if _unsafe(frame):
            library = True
        elif library:
            return False  # library code called by the body's own
        else:
            own = True
        frame = frame.f_back
    return own


def _frame_of(thread_id: int) -> FrameType | None:
    """The innermost frame ``thread_id`` runs, from ``sys._current_frames()`` with the cyclic
    garbage collector held off.

    CPython before 3.12 may collect inside ``sys._current_frames()`` while it holds the
    runtime's thread-list lock; a finalizer run there lets another thread take the GIL,
    and a thread that then waits for that lock with the GIL held (another
    ``sys._current_frames()``, ``PyThreadState_SetAsyncExc``, a thread starting or
    ending) freezes the whole process: CPython issue gh-106883. A worker whose
    heartbeat interrupted its bodies stopped there, every thread with it.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        return sys._current_frames().get(thread_id)
    finally:
        if enabled:
            gc.enable()


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
        self._entry: FrameType | None = None  # the frame that called the body
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
        """The calling thread (or ``thread_id``) runs the body from now on: interruptible.

        Armed from the calling thread, the caller's frame is where the body's own code
        begins: only the frames above it decide whether the body is at a safe point.
        """
        if thread_id is None:
            self._thread_id = threading.get_ident()
            self._entry = sys._getframe(1)
        else:
            self._thread_id = thread_id
            self._entry = None

    def disarm(self) -> None:
        """The body ended: forget the thread and withdraw an interrupt not yet delivered."""
        tid, self._thread_id = self._thread_id, None
        self._entry = None
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
        False it is dropped. Returns True when it is withheld by the quiet period,
        or because the body is not at a safe point (inside code of
        :data:`UNSAFE_MODULES`): the owner should poll again by :meth:`next_wake`.
        """
        if not self._due or self._depth or self._thread_id is None:
            return False
        if not owed:
            self._due = False
            return False
        now = self._clock() if now is None else now
        if now < self._quiet_until:
            return True
        tid = self._thread_id
        top = _frame_of(tid) if self._entry is not None else None
        lasti = -1 if top is None else top.f_lasti
        if top is not None and not _at_safe_point(top, self._entry):
            self._quiet_until = now + SAFE_POINT_RETRY_SECONDS
            return True
        self._due = False
        # Holding the GIL from the look at the stack to the raise, the body cannot
        # move; should the GIL have changed hands in between, look again and take
        # the exception back if the body has since entered such code.
        count = _set_async_exc(tid, LeaseInterrupt)
        if count == 1 and top is not None:
            again = _frame_of(tid)
            if (again is not top or again.f_lasti != lasti) and not _at_safe_point(
                again, self._entry
            ):
                _set_async_exc(tid, None)
                self._due = True
                self._quiet_until = now + SAFE_POINT_RETRY_SECONDS
                return True
        if count == 1:
            self._sent = True
            self.sent += 1
        elif count == 0:
            self._thread_id = None
            logger.warning(
                "celery-lease: run %s: the body's thread is gone, nothing to interrupt",
                self.run_id,
                extra={"lease_event": Event.INTERRUPT_ERROR, "run_id": self.run_id},
            )
        else:
            _set_async_exc(tid, None)
            logger.error(
                "celery-lease: run %s: the interrupt reached %d threads; withdrawn",
                self.run_id,
                count,
                extra={"lease_event": Event.INTERRUPT_ERROR, "run_id": self.run_id},
            )
        return False

    def next_wake(self) -> float | None:
        """When an owed interrupt can be delivered, or None when none is waiting."""
        if self._due and self._thread_id is not None:
            return max(self._quiet_until, self._clock())
        return None
