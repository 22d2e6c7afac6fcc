"""The per-process watchdog: acts on every running lease's local deadline, without I/O."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..events import Event

logger = logging.getLogger(__name__)

#: Process-directed signals a side thread must never be the one to receive.
_SIDE_THREAD_BLOCKED = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM")
    if hasattr(signal, name)
)


def block_signals_in_side_thread() -> None:
    """Leave this thread out of process-directed signal delivery (call it first in the thread).

    A pool child masks ``SIGTERM`` in its main thread while it reports its exit
    through a shared pipe lock (billiard). If the signal, by then at its
    default action, were delivered to a side thread instead, the process would
    die holding that lock and freeze every other child of the pool. Signals
    then go to the main thread, which handles them anyway.
    """
    if not hasattr(signal, "pthread_sigmask") or not _SIDE_THREAD_BLOCKED:
        return
    if _green_threads() or threading.get_native_id() == os.getpid():
        # The process's main OS thread: under gevent or eventlet a "thread" is a
        # greenlet on it, and the mask would shut the whole worker off from SIGTERM.
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIDE_THREAD_BLOCKED)


def _green_threads() -> bool:
    """True when gevent or eventlet patched ``threading``: threads are greenlets."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    return eventlet is not None and bool(eventlet.is_monkey_patched("thread"))


class Watched(Protocol):
    """What the watchdog needs of a lease: its local deadline, and a way to act on it."""

    @property
    def deadline(self) -> float:
        """The local deadline, on the watchdog's monotonic clock."""
        ...

    def poll_deadline(self, now: float | None = None) -> float | None:
        """Act on the deadline at ``now``; return when to poll again (None: no need)."""
        ...


class Watchdog:
    """One daemon thread per process that acts on the local deadline of every watched lease.

    It does no I/O, so it fires when the heartbeat thread is stuck in a socket
    read. Each lease is watched while its body runs. :meth:`poll` runs one
    pass without the thread (for tests and tools).
    """

    #: The longest the thread sleeps when nothing is due.
    IDLE_SECONDS = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: set[Watched] = set()
        self._cond = threading.Condition()
        self._generation = 0
        self._polling = False
        self._wake_at = float("-inf")  # when the sleeping thread wakes up next
        # The earliest deadline among leases watched since the thread last planned
        # its sleep, whether still watched or not: it sleeps no later than this.
        self._seen_min = float("inf")
        self._thread: threading.Thread | None = None

    def watch(self, lease: Watched) -> None:
        """Start watching ``lease`` (and start the thread if needed).

        The thread is woken only when this lease's deadline comes before its
        planned wake-up. It plans that wake-up from every lease watched since
        it last did, even one already unwatched, so a steady flow of short
        tasks (each deadline later than the last) wakes it about twice per
        lease period, not once per task: a watch then costs a lock and a set
        insertion.
        """
        with self._cond:
            self._leases.add(lease)
            deadline = lease.deadline
            if deadline < self._seen_min:
                self._seen_min = deadline
            if not self._polling and deadline < self._wake_at:
                # A pass in progress plans its sleep with _seen_min: no wake-up.
                self._generation += 1
                self._cond.notify()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-watchdog", daemon=True
                )
                self._thread.start()

    def nudge(self) -> None:
        """Make the thread recompute its next wake-up (a lease needs it sooner)."""
        if threading.current_thread() is self._thread:
            return  # its own pass: it computes the wake-up from the result
        with self._cond:
            self._generation += 1
            self._cond.notify()

    def unwatch(self, lease: Watched) -> None:
        """Stop watching ``lease``."""
        with self._cond:
            self._leases.discard(lease)

    def poll(self, now: float | None = None) -> float | None:
        """One pass over the watched leases; the next time one needs a pass, or None."""
        with self._cond:
            leases = list(self._leases)
        wakes = [lease.poll_deadline(now) for lease in leases]
        return min((w for w in wakes if w is not None), default=None)

    def _run(self) -> None:
        block_signals_in_side_thread()
        while True:
            with self._cond:
                generation = self._generation
                self._polling = True
            try:
                wake = self.poll()
            except Exception:  # never let the watchdog die silently
                logger.exception(
                    "celery-lease watchdog pass crashed",
                    extra={"lease_event": Event.WATCHDOG_ERROR, "run_id": None},
                )
                wake = self._clock() + 1.0
            with self._cond:
                self._polling = False
                if self._generation != generation:
                    continue  # nudged during the pass
                if self._seen_min < float("inf"):
                    # Watched since the last plan, maybe after this pass's snapshot.
                    wake = self._seen_min if wake is None else min(wake, self._seen_min)
                    self._seen_min = float("inf")
                timeout = self.IDLE_SECONDS if wake is None else wake - self._clock()
                timeout = min(max(timeout, 0.001), self.IDLE_SECONDS)
                self._wake_at = self._clock() + timeout
                self._cond.wait(timeout)


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def process_watchdog() -> Watchdog:
    """This process's :class:`Watchdog` (a forked child gets its own)."""
    global _watchdog
    watchdog = _watchdog
    if watchdog is not None:
        return watchdog  # the hot path: one per task, no lock once it exists
    with _watchdog_lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog


def _forget_watchdog_in_child() -> None:
    global _watchdog, _watchdog_lock
    _watchdog = None
    _watchdog_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watchdog_in_child)
