"""The handle a running task holds: ``self.lease`` / :func:`current_lease`.

:class:`Lease` is the one owner of a lease's state: one class, one lock. Every
change (held -> completing -> completed, lost, cancel requested, cancelled) is
made here and published once as a typed :class:`~celery_lease.events.Transition`;
the heartbeat, the watchdog and the task only report what they learned by
calling its methods.

Safety never rests on the heartbeat thread alone: each lease keeps a local
monotonic deadline (see :func:`safety_margin`), and a per-process
:class:`~celery_lease.lease.watchdog.Watchdog` thread, which never touches the
network, acts on it even while the heartbeat thread is stuck in a socket read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, event

from ..errors import LeaseError, LeaseLost, LeaseUsageError, RunCancelled
from ..events import LOG_ONLY, Event, EventLog, LeaseState, Transition
from ..schema import encode_checkpoint
from ..store import LeaseStore
from ..store.records import FollowupMessage, Progress
from . import keys
from .interrupt import ASYNC_INTERRUPT_SUPPORTED, Interrupter, LeaseInterrupt
from .progress import ProgressReport
from .watchdog import Watchdog, process_watchdog

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Share of ``lease_seconds`` kept in reserve: the local deadline falls this much
#: before the earliest moment the database can consider the lease expired.
SAFETY_FRACTION = 0.1
#: Worst relative rate difference assumed between this host's monotonic clock and
#: the database server's clock (NTP slews a clock by at most 500 ppm; doubled).
CLOCK_RATE_SLACK = 0.001

#: The states in which the body is interrupted (when it runs armed).
_INTERRUPTING = (LeaseState.LOST, LeaseState.CANCEL_REQUESTED)
#: The states in which the local deadline can still make the lease lost.
_DEADLINE_APPLIES = (LeaseState.HELD, LeaseState.CANCEL_REQUESTED)

#: How the reason of a loss found by the local deadline begins.
DEADLINE_PASSED = "local deadline passed"

#: What a lease opens around an operation no hook wraps: nothing.
_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class LeaseHolder(Protocol):
    """What a lease takes from the delivery that holds it
    (:class:`~celery_lease.run.delivery.Delivery`; :class:`Standalone` outside a task)."""

    @property
    def store(self) -> LeaseStore:
        """The store of the lease's database."""
        ...

    @property
    def events(self) -> EventLog:
        """Where the lease publishes its transitions and events."""
        ...

    @property
    def task_name(self) -> str:
        """The task the lease runs (in its events)."""
        ...

    @property
    def followups(self) -> FollowupSender | None:
        """What records and publishes the follow-up tasks a body hands over (None: none)."""
        ...

    def around(
        self, operation: str, outcome: str
    ) -> contextlib.AbstractContextManager[None] | None:
        """What to wrap the lease's ``operation`` in (the run hooks' ``around``), or None."""
        ...

    def kept_result(self, value: Any) -> tuple[bytes, str] | None:
        """``value``, the body's return value, as the run's success keeps it for a replay
        of the outcome (``(bytes, content type)``), or None where it is not kept."""
        ...


@dataclasses.dataclass(frozen=True)
class Standalone:
    """The holder of a lease taken outside a task (tools, tests): a store, events that
    are only logged unless given, no task name, nothing around its operations."""

    store: LeaseStore
    events: EventLog = LOG_ONLY
    task_name: str = ""
    followups: FollowupSender | None = None

    def around(
        self, operation: str, outcome: str
    ) -> contextlib.AbstractContextManager[None] | None:
        """Nothing."""
        return None

    def kept_result(self, value: Any) -> tuple[bytes, str] | None:
        """Nothing: no Celery caller asks for the outcome of a lease taken outside a task."""
        return None


class FollowupSender(Protocol):
    """What turns a body's follow-up tasks into outbox rows and publishes them once their
    transaction committed (:class:`celery_lease.followups.Followups`)."""

    def encode(self, run_id: str, attempt: int, first: int, send: Any) -> list[FollowupMessage]:
        """``send`` (a signature or several) as messages whose task ids start at position
        ``first``; :class:`~celery_lease.errors.LeaseInputError` before any SQL."""
        ...

    def committed(self, task_ids: list[str]) -> None:
        """The transaction that recorded ``task_ids`` is committing: publish them once it
        has (rows it did not commit are never seen)."""
        ...


_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_lease_current", default=None
)

_warned_no_interrupt = False

#: ``fence()``'s default: no checkpoint given (``checkpoint=None`` saves JSON null).
_NO_CHECKPOINT: Any = object()
#: ``fence()``'s default: no result given (``result=None`` keeps ``None``).
_NO_RESULT: Any = object()


def safety_margin(lease_seconds: float) -> float:
    """How long before the database's expiry a lease counts as lost locally.

    ``lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)``: 10.1 % of the
    lease (3.03 s of a 30 s lease). The fraction covers the time between the
    database computing an expiry and this process acting on its own deadline
    (a check in flight, a scheduling delay); the slack covers clock rates.
    """
    return lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)


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
    """The lease held by the task running in this thread, or None."""
    return _current.get()


def bind_current(lease: Lease) -> _Bound:
    """A context manager: ``lease`` is the current lease (:func:`current_lease`) inside it."""
    return _Bound(lease)


class _Bound:
    """What :func:`bind_current` returns (a class: cheaper than a generator, once per task)."""

    __slots__ = ("_lease", "_token")

    def __init__(self, lease: Lease) -> None:
        self._lease = lease

    def __enter__(self) -> Lease:
        self._token = _current.set(self._lease)
        return self._lease

    def __exit__(self, *exc_info: object) -> None:
        _current.reset(self._token)


class Lease:
    """Ownership of one run by this worker, renewed by the heartbeat thread.

    The lease is treated as lost locally once its deadline passes: ``started_at``
    (taken before the claim statement was sent) + ``lease_seconds`` - the
    :func:`safety_margin`, moved only by a confirmed renewal (its send time +
    ``lease_seconds`` - margin). The database computes every expiry later than
    that, so this process gives the lease up before anyone can take it over.

    Every state change happens under one lock, in this class. The heartbeat
    reports through :meth:`renewed` and :meth:`refused`, the watchdog through
    :meth:`poll_deadline`, the body and the task through :meth:`check`,
    :meth:`fence`, :meth:`complete`, :meth:`mark_cancelled` and
    :meth:`mark_lost`. Raising into the body thread is left to the
    :class:`~celery_lease.lease.interrupt.Interrupter` it holds, which is told
    when an interrupt is owed.

    Attributes:
        run_id: the run's id (the task id, or the task's ``lease_key``).
        owner: this claim's unique owner string.
        attempt: the fencing token, for a store that compares it (never an
            idempotency key: see :meth:`idempotency_key`).
        generation: the run's generation, as the claim read it: raised only by
            ``lease rerun --force`` of a succeeded run (:meth:`idempotency_key`).
        max_attempts: the attempt at which the run is out of attempts, as the
            claim read it from the row (0 when not known: the setting decides).
        holder: the delivery holding the lease (:class:`LeaseHolder`): its store,
            its app's event bus, its task, and what its hooks wrap operations in.
        report: the body's progress reports (:class:`ProgressReport`).
    """

    def __init__(
        self,
        holder: LeaseHolder,
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
        checkpoint: str | None = None,
        generation: int = 0,
    ) -> None:
        self.holder = holder
        self.run_id = run_id
        self.owner = owner
        self.attempt = attempt
        self.generation = generation
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
        self._ending = False  # the holder is writing the run's end itself (see ending())
        self._hooks: list[tuple[Connection, str, Callable[..., None]]] = []
        self._interrupter = Interrupter(run_id, clock)
        # The latest saved checkpoint (JSON text): the claim's, then this attempt's.
        self._checkpoint = checkpoint
        #: The body's progress reports, written by the heartbeat's renewals.
        self.report = ProgressReport()
        # Follow-up tasks: who publishes them, the positions used so far (task ids),
        # and the transaction this lease fenced last (send_on_commit needs it).
        self._followups_used = 0
        self._fenced: Any = None
        # A fenced transaction of this lease is open: it holds the run's row lock, which
        # no takeover passes, and which a renewal of the row would wait for.
        self._fence_open = False
        self._passed_over = False  # a tick left it out while its transaction was open
        self._unfenced: Callable[[], None] | None = None

    # -- what the body sees ------------------------------------------------------

    @property
    def store(self) -> LeaseStore:
        """The store of the lease's database (the holder's)."""
        return self.holder.store

    @property
    def events(self) -> EventLog:
        """Where this lease's transitions are published (the holder's)."""
        return self.holder.events

    @property
    def task_name(self) -> str:
        """The task this lease runs (the holder's)."""
        return self.holder.task_name

    @property
    def key(self) -> tuple[str, str, int]:
        """``(run_id, owner, attempt)``: what every guarded statement names."""
        return (self.run_id, self.owner, self.attempt)

    @property
    def state(self) -> LeaseState:
        """Where this lease stands now."""
        return self._state

    def idempotency_key(self, step: str = "") -> str:
        """The key to give an external system for ``step`` of this run (an
        ``Idempotency-Key`` header): the same for every attempt of the run.

        Retries, takeovers, sweeps, hand-backs and ``lease rerun`` of a run that did not
        succeed derive the same key, so a provider that deduplicates on it charges once
        even when a worker dies between the provider's reply and the commit. It differs
        for each ``step`` (one per external call of the body), each run, and after
        ``lease rerun --force`` of a succeeded run (a deliberate second charge). At most
        255 characters of ``[A-Za-z0-9._:-]``: ``<run id>:<step>:<generation>``, with the
        run id's SHA-256 in its place when it holds other characters or is too long.
        No SQL: the generation came with the claim.

        Raises:
            LeaseInputError: ``step`` is not a str of at most 64 characters of
                ``[A-Za-z0-9._-]``.
        """
        return keys.idempotency_key(self.run_id, self.generation, step)

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
    def fencing(self) -> bool:
        """True while a transaction this lease fenced is open (its row lock held): the
        heartbeat leaves it out of its renewals, which would wait for that lock, and
        renews it as soon as the transaction ends (see :meth:`when_unfenced`)."""
        return self._fence_open

    def when_unfenced(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (the heartbeat's wake-up) when a fenced transaction of this
        lease that a tick passed over (:meth:`passed_over`) ends, on the thread that ends
        it. A transaction no tick met costs no renewal of its own."""
        self._unfenced = callback

    def passed_over(self) -> None:
        """The heartbeat left this lease out of a tick: its fenced transaction was open."""
        self._passed_over = True

    @property
    def renewable(self) -> bool:
        """Whether the heartbeat should still renew this lease."""
        state = self._state
        if state is LeaseState.COMPLETED:
            return not self._verified
        return state in (LeaseState.HELD, LeaseState.CANCEL_REQUESTED, LeaseState.COMPLETING)

    @property
    def last_checkpoint(self) -> Any:
        """The state of the latest checkpoint saved for this run, by this attempt or an
        earlier one; None on a fresh run.

        Read by the claim statement itself and decoded with ``json.loads`` only
        (each access returns a fresh copy).
        """
        text = self._checkpoint
        return None if text is None else json.loads(text)

    def checkpoint(self, state: Any) -> None:
        """Save ``state`` (a JSON value) as the run's checkpoint, durable on return.

        The next attempt of this run, whatever started it, reads it as
        :attr:`last_checkpoint`. One guarded UPDATE (id, owner, attempt, running):
        a stale owner can never overwrite a newer checkpoint.

        Raises:
            LeaseInputError: ``state`` is not JSON, or its compact encoding exceeds
                64 KiB (before any SQL runs).
            LeaseLost: the lease is no longer held (or its local deadline passed);
                the row keeps the checkpoint it had.
            RunCancelled: cancellation was requested for this run.
            LeaseUsageError: called after ``fence(complete=True)`` recorded success.
            LeaseDatabaseError: the database did not answer; the call may be repeated.
        """
        text = encode_checkpoint(state)
        if self.completed_pending:
            # The row is locked by that uncommitted transaction, or already succeeded.
            raise LeaseUsageError(
                f"checkpoint() on run {self.run_id} after fence(complete=True): the run is "
                "recorded succeeded, so there is nothing to resume; pass checkpoint= to that "
                "fence() instead"
            )
        with self.uninterruptible(), self._span("checkpoint", "saved"):
            self.check()
            try:
                self.store.checkpoint(self.run_id, self.owner, self.attempt, text)
            except LeaseLost as exc:
                self.mark_lost(exc.reason)
                raise
        self._checkpoint = text
        self._checkpoint_saved(text, fenced=False)

    def _checkpoint_saved(self, text: str, *, fenced: bool) -> None:
        self.events.emit(
            Event.CHECKPOINT,
            self.run_id,
            "run %s: checkpoint saved (%d characters)",
            self.run_id,
            len(text),
            level=logging.DEBUG,
            task=self.task_name,
            fenced=fenced,
        )

    def progress(self, done: float, total: float | None = None, note: str | None = None) -> None:
        """Report progress: kept in memory, written by the next heartbeat renewal.

        No statement of its own, ever: the renewal that keeps the lease alive
        carries it. ``lease show``, ``lease top`` and the metrics show it.

        Raises:
            LeaseInputError: ``done``/``total`` are not finite numbers, or ``note``
                is not a string of at most 200 characters.
        """
        self.report.report(done, total, note)

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

    def fence(
        self,
        connection: Connection,
        *,
        complete: bool = False,
        checkpoint: Any = _NO_CHECKPOINT,
        send: Any = None,
        result: Any = _NO_RESULT,
    ) -> list[str]:
        """Prove, inside ``connection``'s open transaction, that this lease still holds.

        Locks the run row until that transaction ends, so writes made in it
        commit only while this worker owns the run. ``connection`` must be on
        the lease database. With ``complete=True`` the run is also recorded as
        succeeded in the same transaction, so the writes and the completion
        commit together or not at all (exactly-once effects on that database);
        if that transaction rolls back, the lease is held again and watched as
        before. ``checkpoint=state`` saves ``state`` as the run's checkpoint in
        that transaction too: the writes and the checkpoint commit together
        (exactly once per item); :attr:`last_checkpoint` follows on commit. A
        success clears the checkpoint, so with ``complete=True`` it is checked
        and not kept. ``send``: follow-up tasks (a Celery signature or a list of
        them), recorded in that transaction and published once it commits, exactly
        once (see :meth:`send_on_commit`); their task ids are returned.
        ``result=value`` (with ``complete=True``): the value the body will return,
        kept by the same statement. Without it the run is recorded succeeded
        before its result is known: a worker killed between this commit and the
        body's return leaves a success Celery never stored and cannot replay (its
        caller, and the rest of its chain, get ``RunFailed`` with
        ``result_not_kept``). With it, a redelivery replays ``value``.

        Raises:
            LeaseInputError: ``checkpoint`` is not JSON or exceeds 64 KiB, or ``send``
                holds something that is not a single task's signature, or too much
                (before any SQL runs).
            LeaseLost: the lease is no longer held, or its local deadline passed
                (the transaction should roll back).
            LeaseUsageError: ``connection`` is on another database than the
                lease's, which still holds the lease (the lease stays held); or
                ``result`` without ``complete=True``.
        """
        if result is not _NO_RESULT and not complete:
            raise LeaseUsageError(
                f"fence() on run {self.run_id}: result= is kept with the success, so it "
                "needs complete=True"
            )
        kept = None if result is _NO_RESULT else self.holder.kept_result(result)
        text = None if checkpoint is _NO_CHECKPOINT else encode_checkpoint(checkpoint)
        messages = self._followup_messages(send)
        with self.uninterruptible(), self._span("fence", "completing" if complete else "held"):
            again = self._fenced_now(connection)
            if self._state is not LeaseState.COMPLETING and not again:
                # Hooks of earlier transactions are spent; a second fence in the same
                # transaction keeps the hooks of the first.
                self._detach_hooks()
            self.check()
            try:
                self.store.fence(
                    connection,
                    self.run_id,
                    self.owner,
                    self.attempt,
                    complete=complete,
                    checkpoint=text,
                    result=kept,
                )
            except LeaseLost as exc:
                self.mark_lost(exc.reason)
                raise
            self._fenced = connection.get_transaction()
            if not again:
                self._fence_open = True
                self._on_transaction_end(connection, self._fence_ended, savepoints=False)
            if messages:
                self._record_followups(connection, messages)
            if complete:
                self._completing(connection)
            elif text is not None:
                self._checkpoint_on_commit(connection, text)
        return [message.task_id for message in messages]

    def _fenced_now(self, connection: Connection) -> bool:
        """True when ``connection``'s open transaction is the one this lease fenced last."""
        fenced = self._fenced
        return fenced is not None and fenced.is_active and connection.get_transaction() is fenced

    def send_on_commit(self, connection: Connection, *signatures: Any) -> list[str]:
        """Send follow-up tasks once ``connection``'s fenced transaction commits; their
        task ids.

        Each argument is a Celery signature of one task (``receipt.s(order_id)``,
        with options such as ``queue`` or ``countdown``). They are recorded in the
        transaction itself (an outbox row each), so they exist only if its writes
        commit, and this process publishes them right after the commit. If it dies
        first, the sweeper publishes them. Each goes out under a task id derived from
        this run (``<run id>:followup:<attempt>.<n>``), the same on every publish:
        a ``LeasedTask`` follow-up is then one run, and a second publish of it is
        dropped by its own lease. Nothing is sent if the transaction rolls back.
        Call it after ``fence(connection)`` in the same transaction (also after
        ``fence(connection, complete=True)``), e.g. with an id the writes made.

        Raises:
            LeaseInputError: an argument is not a single task's signature (a chain,
                group or chord; a ``task_id`` of its own), does not match its task's
                arguments, cannot be serialized, or is over 64 KiB; more than 100
                at once (before any SQL runs).
            LeaseUsageError: ``connection``'s transaction was not fenced by this lease,
                or the lease has no app to publish with.
            LeaseLost: the lease is no longer held (the transaction should roll back).
        """
        messages = self._followup_messages(signatures)
        if not messages:
            return []
        if not self._fenced_now(connection):
            raise LeaseUsageError(
                f"send_on_commit() on run {self.run_id}: call fence(conn) first, in the same "
                "transaction, so the follow-ups commit only while this lease holds"
            )
        with self.uninterruptible():
            self.check()
            self._record_followups(connection, messages)
        return [message.task_id for message in messages]

    def _followup_messages(self, send: Any) -> list[FollowupMessage]:
        """The follow-ups ``send`` as outbox messages, checked (no SQL): each takes the
        next positions of this attempt, so no two share a task id."""
        if send is None or (isinstance(send, (list, tuple)) and not send):
            return []
        sender = self.holder.followups
        if sender is None:
            raise LeaseUsageError(
                f"run {self.run_id}: this lease has no app to publish follow-up tasks with "
                "(it was not made by a LeasedTask)"
            )
        messages = sender.encode(self.run_id, self.attempt, self._followups_used, send)
        self._followups_used += len(messages)
        return messages

    def _record_followups(self, connection: Connection, messages: list[FollowupMessage]) -> None:
        """Insert ``messages`` in ``connection``'s transaction; hand them to the publisher
        when it commits (a rollback, of it or of a savepoint around them, drops them)."""
        self.store.outbox.record(connection, self.run_id, messages)
        sender = self.holder.followups
        assert sender is not None
        task_ids = [message.task_id for message in messages]
        self._on_transaction_end(
            connection, lambda committed: sender.committed(task_ids) if committed else None
        )

    def transaction(self) -> contextlib.AbstractContextManager[Connection]:
        """``with lease.transaction() as conn:``: the lease database, in a transaction.

        For :meth:`fence`: writes made on ``conn`` after ``fence(conn)`` commit
        only while this lease holds. The transaction commits when the block
        ends and rolls back if it raises. It runs on this lease's store, so it
        follows :func:`celery_lease.testing.use_lease_database` and has the
        store's bounded waits.
        """
        return self.store.transaction()

    def complete(self, result: tuple[bytes, str] | None = None) -> None:
        """Record success with the guarded completion (idempotent after ``fence(complete=True)``).

        ``result``: the body's return value serialized, ``(bytes, content type)``,
        written by the same statement.

        Raises:
            LeaseLost: another owner holds the run, or it ended otherwise.
            LeaseDatabaseError: the database did not answer; the lease is as
                before and the call may be repeated.
        """
        with self._span("complete", "succeeded"):
            self._complete(result)

    def _complete(self, result: tuple[bytes, str] | None) -> None:
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
                self.store.complete(self.run_id, self.owner, self.attempt, result=result)
        except LeaseLost as exc:
            self.mark_lost(exc.reason)
            raise
        except BaseException:
            with self._lock:
                back = None
                if transition is not None and self._state is LeaseState.COMPLETING:
                    back = self._roll_back_locked("completion not confirmed", transition.previous)
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

    def ending(self) -> None:
        """The holder is about to write the run's end itself (a recorded failure or retry,
        an end the body chose, a release): from here on the row stops being this lease's
        to renew, so a refused renewal or a passed local deadline is that write's doing,
        not a loss. A refusal of the write itself still reports the loss (:meth:`mark_lost`).
        """
        with self._lock:
            self._ending = True

    # -- what the heartbeat and the watchdog report --------------------------------

    def renewed(
        self,
        sent_at: float,
        *,
        cancel_requested: bool = False,
        progress: Progress | None = None,
    ) -> None:
        """A renewal sent at ``sent_at`` (this lease's clock) was confirmed by the database;
        it wrote ``progress`` when given."""
        transitions: list[Transition | None] = []
        if progress is not None:
            self.report.written(progress)
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
                transitions.append(self._roll_back_locked("fenced completion did not commit"))
            if cancel_requested and not self._cancel_seen:
                self._cancel_seen = True
                if self._state is LeaseState.HELD:
                    transitions.append(self._move_locked(LeaseState.CANCEL_REQUESTED))
                    self._interrupt_locked()
            self._deliver_due_locked()
        for transition in transitions:
            self._publish(transition)

    def refused(self, reason: str) -> None:
        """The database refused to renew this lease (taken over, expired or ended)."""
        transition = None
        verify = False
        with self._lock:
            state = self._state
            if state is LeaseState.COMPLETED:
                verify = not self._verified
            elif state in _DEADLINE_APPLIES and not self._ending:
                transition = self._lose_locked(reason)
            # COMPLETING: the open transaction that completes the run decides; ending:
            # the holder's own write.
        self._publish(transition)
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
            if self._state in _DEADLINE_APPLIES and not self._ending and now >= self._deadline:
                transition = self._lose_locked(
                    f"{DEADLINE_PASSED}: no renewal confirmed within "
                    f"{self.lease_seconds - self.margin:.3g}s (heartbeat stalled or "
                    "database unreachable)"
                )
            else:
                self._deliver_due_locked(now)
            if self._state in _DEADLINE_APPLIES:
                wake: float | None = self._deadline
            else:
                wake = self._interrupter.next_wake()
        self._publish(transition)
        return wake

    # -- the body ----------------------------------------------------------------

    @contextlib.contextmanager
    def uninterruptible(self) -> Iterator[None]:
        """Withhold the interrupt inside this block; deliver it right after.

        Wrap library work the body thread does on the lease's behalf (a commit,
        a publish, a database call): an exception raised at an arbitrary
        instruction there could break shared connection state. Outside the
        armed body thread this does nothing.
        """
        interrupter = self._interrupter
        if not interrupter.in_body_thread():
            yield
            return
        with self._lock:
            interrupter.hold()
        try:
            yield
        finally:
            with self._lock:
                interrupter.release()
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
                self._interrupter.arm()
            try:
                return fn(*args, **kwargs)
            finally:
                # An interrupt sent just as fn ended may land inside this loop: it is
                # swallowed, and the loop repeats until this thread is disarmed.
                while True:
                    try:
                        with self._lock:
                            self._interrupter.disarm()
                        break
                    except LeaseInterrupt:
                        continue
        finally:
            watchdog.unwatch(self)

    def __repr__(self) -> str:
        return (
            f"<Lease run_id={self.run_id!r} attempt={self.attempt} owner={self.owner!r} "
            f"state={self._state.value}>"
        )

    def _span(self, name: str, outcome: str) -> contextlib.AbstractContextManager[None]:
        """What the holder's hooks wrap the operation ``name`` in (a span), or nothing."""
        found = self.holder.around(name, outcome)
        return _NOTHING if found is None else found

    # -- state changes (under the lock) ------------------------------------------

    def _publish(self, transition: Transition | None) -> None:
        if transition is not None:
            self.events.publish(transition)

    def _move_locked(self, state: LeaseState, reason: str = "") -> Transition:
        previous, self._state = self._state, state
        return Transition(self.run_id, self.owner, self.attempt, previous, state, reason)

    def _lose_locked(self, reason: str) -> Transition:
        self._lost = LeaseLost(self.run_id, self.owner, self.attempt, reason)
        transition = self._move_locked(LeaseState.LOST, reason)
        self._interrupt_locked()
        return transition

    def _roll_back_locked(self, reason: str, to: LeaseState = LeaseState.HELD) -> Transition:
        """A success written but not committed: held again, its deadline applies again."""
        self._fenced_at = None
        return self._move_locked(to, reason)

    def _interrupt_locked(self) -> None:
        if self._interrupter.owe():
            self._deliver_due_locked()

    def _deliver_due_locked(self, now: float | None = None) -> None:
        interrupter = self._interrupter
        sent = interrupter.sent
        withheld = interrupter.deliver(self._state in _INTERRUPTING, now)
        if withheld and self._watchdog is not None:
            self._watchdog.nudge()  # it delivers once the quiet period ends
        elif interrupter.sent > sent:
            self.events.emit(
                Event.INTERRUPT_SENT,
                self.run_id,
                "run %s attempt %d: interrupt raised in the body (%s)",
                self.run_id,
                self.attempt,
                self._state.value,
                level=logging.DEBUG,
                attempt=self.attempt,
            )

    # -- the fenced completion -----------------------------------------------------

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
        self._publish(transition)

    def _hook(self, connection: Connection) -> None:
        """Follow the end of ``connection``'s transaction: commit completes, rollback holds.

        SQLAlchemy calls these before the database does, so the state is right
        before another session can see the row again. A savepoint rollback
        counts when the savepoint was open around the fence.
        """
        self._on_transaction_end(
            connection, lambda committed: self._transaction_ended(committed=committed)
        )

    def _fence_ended(self, committed: bool) -> None:
        """The fenced transaction ended, and with it the row lock: the heartbeat may renew
        this lease again, at once if a tick passed it over. (A savepoint's rollback does
        not count: InnoDB keeps the row lock taken inside it until the transaction ends.)"""
        self._fence_open = False
        wake = self._unfenced
        if self._passed_over and wake is not None:
            self._passed_over = False
            wake()

    def _checkpoint_on_commit(self, connection: Connection, text: str) -> None:
        """After ``fence(conn, checkpoint=...)``: the checkpoint is this lease's latest once
        ``connection``'s transaction commits (a rollback, of it or of a savepoint open
        around the fence, leaves the one before, as in the database)."""

        def ended(committed: bool) -> None:
            if committed:
                self._checkpoint = text
                self._checkpoint_saved(text, fenced=True)

        self._on_transaction_end(connection, ended)

    def _on_transaction_end(
        self, connection: Connection, ended: Callable[[bool], None], *, savepoints: bool = True
    ) -> None:
        """Call ``ended(True)`` when ``connection``'s transaction commits, ``ended(False)``
        when it, or (with ``savepoints``) a savepoint open now around this point, rolls
        back; once."""
        enclosing = _open_savepoints(connection) if savepoints else []
        done = False

        def on_commit(conn: Connection) -> None:
            nonlocal done
            if not done:
                done = True
                ended(True)

        def on_rollback(conn: Connection) -> None:
            nonlocal done
            if not done:
                done = True
                ended(False)

        def on_rollback_savepoint(conn: Connection, name: str, context: Any) -> None:
            nonlocal done
            if not done and any(getattr(t, "_savepoint", None) == name for t in enclosing):
                done = True
                ended(False)

        listeners: list[tuple[str, Callable[..., None]]] = [
            ("commit", on_commit),
            ("rollback", on_rollback),
        ]
        if savepoints:
            listeners.append(("rollback_savepoint", on_rollback_savepoint))
        for name, fn in listeners:
            event.listen(connection, name, fn)
            self._hooks.append((connection, name, fn))

    def _transaction_ended(self, *, committed: bool) -> None:
        # Runs inside SQLAlchemy's commit/rollback, in the body thread: no
        # interrupt may be raised from here, and none for a while after.
        with self._lock:
            if self._state is not LeaseState.COMPLETING:
                return
            if committed:
                transition = self._move_locked(
                    LeaseState.COMPLETED, "fenced transaction commit sent"
                )
            else:
                transition = self._roll_back_locked("fenced transaction rolled back")
                self._interrupter.quiet_for(self.heartbeat_interval)
        self._publish(transition)

    def _verify_completion(self) -> None:
        """A renewal was refused after a fenced commit: did that commit land?"""
        try:
            record = self.store.get(self.run_id)
        except Exception as exc:
            logger.warning(
                "celery-lease: run %s: could not verify the fenced completion: %s",
                self.run_id,
                type(exc).__name__,
                extra={"lease_event": Event.VERIFY_ERROR, "run_id": self.run_id},
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
        self._publish(transition)

    def _detach_hooks(self) -> None:
        # Never from a hook: SQLAlchemy's dispatch loop cannot lose a listener
        # while it runs. Spent hooks are no-ops until removed here.
        self._fenced = None
        self._fence_open = False
        hooks, self._hooks = self._hooks, []
        for connection, name, fn in hooks:
            with contextlib.suppress(Exception):
                event.remove(connection, name, fn)


def _open_savepoints(connection: Connection) -> list[Any]:
    """The savepoints open on ``connection`` now, innermost first: a rollback of any of
    them undoes what is written inside it from here on."""
    enclosing: list[Any] = []
    nested: Any = connection.get_nested_transaction()
    while nested is not None:
        enclosing.append(nested)
        nested = getattr(nested, "_previous_nested", None)
    return enclosing


def _warn_no_interrupt() -> None:
    global _warned_no_interrupt
    if not _warned_no_interrupt:
        _warned_no_interrupt = True
        logger.warning(
            "celery-lease: lease_interrupt needs CPython (this is %s): bodies are not "
            "interrupted; call self.lease.check()",
            platform.python_implementation(),
            extra={"lease_event": Event.INTERRUPT_DISABLED, "run_id": None},
        )
