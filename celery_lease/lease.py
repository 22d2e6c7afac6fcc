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
import ctypes
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, event

from .errors import LeaseError, LeaseLost, RunCancelled
from .events import LeaseState, Transition, publish

if TYPE_CHECKING:
    from .store import LeaseStore

T = TypeVar("T")

logger = logging.getLogger(__name__)

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_lease_current", default=None
)

#: Share of ``lease_seconds`` kept in reserve: the local deadline falls this much
#: before the earliest moment the database can consider the lease expired.
SAFETY_FRACTION = 0.1
#: Worst relative rate difference assumed between this host's monotonic clock and
#: the database server's clock (NTP slews a clock by at most 500 ppm; doubled).
CLOCK_RATE_SLACK = 0.001

#: Whether this interpreter can raise an exception in another thread
#: (``PyThreadState_SetAsyncExc`` is CPython's C API).
ASYNC_INTERRUPT_SUPPORTED = platform.python_implementation() == "CPython"

_INTERRUPTING = (LeaseState.LOST, LeaseState.CANCEL_REQUESTED)
_DEADLINE_APPLIES = (LeaseState.HELD, LeaseState.CANCEL_REQUESTED)
_warned_no_interrupt = False


def safety_margin(lease_seconds: float) -> float:
    """How long before the database's expiry a lease counts as lost locally.

    ``lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)``: 10.1 % of the
    lease (3.03 s of a 30 s lease). The fraction covers the time between the
    database computing an expiry and this process acting on its own deadline
    (a check in flight, a scheduling delay); the slack covers clock rates.
    """
    return lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)


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
    if hasattr(signal, "pthread_sigmask") and _SIDE_THREAD_BLOCKED:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIDE_THREAD_BLOCKED)


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
    ) -> None:
        self.store = store
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
            sqlalchemy.exc.SQLAlchemyError: the database did not answer; the
                lease is as before and the call may be repeated.
        """
        transition = None
        with self._lock:
            if self._state is LeaseState.COMPLETED and self._verified:
                return
            if self._state in _DEADLINE_APPLIES:
                self._fenced_at = None
                transition = self._move_locked(LeaseState.COMPLETING)
        _publish(transition)
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
            _publish(back)
            raise
        with self._lock:
            self._verified = True
            done = None
            if self._state is not LeaseState.COMPLETED:
                done = self._move_locked(LeaseState.COMPLETED)
        _publish(done)
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
        _publish(transition)

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
        _publish(transition)
        return True

    # -- what the heartbeat and the watchdog report -------------------------------

    def renewed(self, sent_at: float, *, cancel_requested: bool = False) -> None:
        """A renewal sent at ``sent_at`` (this lease's clock) was confirmed by the database."""
        transitions: list[Transition | None] = []
        with self._lock:
            state = self._state
            if state in (LeaseState.LOST, LeaseState.CANCELLED):
                return
            self._deadline = max(self._deadline, sent_at + self.lease_seconds - self.margin)
            if (
                state in (LeaseState.COMPLETING, LeaseState.COMPLETED)
                and not self._verified
                and self._fenced_at is not None
                and sent_at >= self._fenced_at
            ):
                # Sent after the fenced success was written: had it committed, this
                # renewal would have waited for the row lock and then been refused.
                transitions.append(
                    self._move_locked(LeaseState.HELD, "fenced completion did not commit")
                )
                self._fenced_at = None
            if cancel_requested and not self._cancel_seen:
                self._cancel_seen = True
                if self._state is LeaseState.HELD:
                    transitions.append(self._move_locked(LeaseState.CANCEL_REQUESTED))
                    self._interrupt_locked()
            self._deliver_due_locked()
        for transition in transitions:
            _publish(transition)

    def refused(self, reason: str) -> None:
        """The database refused to renew this lease (taken over, expired or ended)."""
        transition = None
        verify = False
        with self._lock:
            state = self._state
            if state is LeaseState.COMPLETED:
                verify = not self._verified
            elif state in _DEADLINE_APPLIES:
                transition = self._lose_locked(reason)
            # COMPLETING: the open transaction that completes the run decides.
        _publish(transition)
        if verify:
            self._verify_completion()

    def poll_deadline(self, now: float | None = None) -> float | None:
        """Act on the local deadline at ``now``; return when to poll again (None: no need).

        Past the deadline a held lease is lost; an interrupt withheld until
        now is delivered once it is safe.
        """
        now = self._clock() if now is None else now
        transition = None
        with self._lock:
            if self._state in _DEADLINE_APPLIES and now >= self._deadline:
                transition = self._lose_locked(
                    f"local deadline passed: no renewal confirmed within "
                    f"{self.lease_seconds - self.margin:.3g}s (heartbeat stalled or "
                    "database unreachable)"
                )
            else:
                self._deliver_due_locked(now)
            wake = self._next_wake_locked()
        _publish(transition)
        return wake

    # -- interrupts --------------------------------------------------------------

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
        watchdog.watch(self)
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
            watchdog.unwatch(self)

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

    # -- transitions -------------------------------------------------------------

    def _move_locked(self, state: LeaseState, reason: str = "") -> Transition:
        previous, self._state = self._state, state
        return Transition(self.run_id, self.owner, self.attempt, previous, state, reason)

    def _lose_locked(self, reason: str) -> Transition:
        self._lost = LeaseLost(self.run_id, self.owner, self.attempt, reason)
        transition = self._move_locked(LeaseState.LOST, reason)
        self._interrupt_locked()
        return transition

    def _completing(self, connection: Connection) -> None:
        """After ``fence(complete=True)``: completing until that transaction ends."""
        with self._lock:
            if self._state is LeaseState.LOST:
                error = self._lost
            else:
                error = None
                transition = self._move_locked(LeaseState.COMPLETING, "fenced")
                self._fenced_at = self._clock()
                self._verified = False
        if error is not None:
            # Lost while the statement ran (e.g. the deadline): roll back.
            raise error
        self._hook(connection)
        _publish(transition)

    def _hook(self, connection: Connection) -> None:
        """Follow the end of ``connection``'s transaction: commit completes, rollback holds.

        SQLAlchemy calls these before the database does, so the state is right
        before another session can see the row again. A savepoint rollback
        counts when the savepoint was open around the fence.
        """
        enclosing: list[Any] = []
        nested: Any = connection.get_nested_transaction()
        while nested is not None:
            enclosing.append(nested)
            nested = getattr(nested, "_previous_nested", None)
        ended = False

        def on_commit(conn: Connection) -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._transaction_ended(committed=True)

        def on_rollback(conn: Connection) -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._transaction_ended(committed=False)

        def on_rollback_savepoint(conn: Connection, name: str, context: Any) -> None:
            nonlocal ended
            if not ended and any(getattr(t, "_savepoint", None) == name for t in enclosing):
                ended = True
                self._transaction_ended(committed=False)

        for name, fn in (
            ("commit", on_commit),
            ("rollback", on_rollback),
            ("rollback_savepoint", on_rollback_savepoint),
        ):
            event.listen(connection, name, fn)
            self._hooks.append((connection, name, fn))

    def _transaction_ended(self, *, committed: bool) -> None:
        # Runs inside SQLAlchemy's commit/rollback, in the body thread: no
        # interrupt may be raised from here, and none for a while after.
        with self._lock:
            if self._state is not LeaseState.COMPLETING:
                return
            if committed:
                transition = self._move_locked(LeaseState.COMPLETED, "fenced transaction committed")
            else:
                transition = self._move_locked(LeaseState.HELD, "fenced transaction rolled back")
                self._fenced_at = None
                self._quiet_until = self._clock() + self.heartbeat_interval
        _publish(transition)

    def _verify_completion(self) -> None:
        """A renewal was refused after a fenced commit: did that commit land?"""
        try:
            record = self.store.get(self.run_id)
        except Exception as exc:
            logger.warning(
                "celery-lease: run %s: could not verify the fenced completion: %s",
                self.run_id,
                type(exc).__name__,
                extra={"lease_event": "verify_error", "run_id": self.run_id},
            )
            return
        ours = (
            record is not None
            and record.status == "succeeded"
            and record.lease_owner == self.owner
            and record.attempt == self.attempt
        )
        with self._lock:
            if self._state is not LeaseState.COMPLETED:
                return
            if ours:
                self._verified = True
                return
            transition = self._lose_locked("fenced completion did not commit; renewal refused")
        _publish(transition)

    def _detach_hooks(self) -> None:
        # Never from a hook: SQLAlchemy's dispatch loop cannot lose a listener
        # while it runs. Spent hooks are no-ops until removed here.
        hooks, self._hooks = self._hooks, []
        for connection, name, fn in hooks:
            with contextlib.suppress(Exception):
                event.remove(connection, name, fn)

    def __repr__(self) -> str:
        return (
            f"<Lease run_id={self.run_id!r} attempt={self.attempt} owner={self.owner!r} "
            f"state={self._state.value}>"
        )


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
        self._leases: set[Lease] = set()
        self._cond = threading.Condition()
        self._generation = 0
        self._polling = False
        self._wake_at = float("-inf")  # when the sleeping thread wakes up next
        self._thread: threading.Thread | None = None

    def watch(self, lease: Lease) -> None:
        """Start watching ``lease`` (and start the thread if needed)."""
        with self._cond:
            self._leases.add(lease)
            if self._polling or lease.deadline < self._wake_at:
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

    def unwatch(self, lease: Lease) -> None:
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
                    extra={"lease_event": "watchdog_error", "run_id": None},
                )
                wake = self._clock() + 1.0
            with self._cond:
                self._polling = False
                if self._generation != generation:
                    continue  # a lease was added during the pass
                timeout = self.IDLE_SECONDS if wake is None else wake - self._clock()
                timeout = min(max(timeout, 0.001), self.IDLE_SECONDS)
                self._wake_at = self._clock() + timeout
                self._cond.wait(timeout)


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def process_watchdog() -> Watchdog:
    """This process's :class:`Watchdog` (a forked child gets its own)."""
    global _watchdog
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


def _publish(transition: Transition | None) -> None:
    if transition is not None:
        publish(transition)


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
