"""One place where lease events are logged (and counted, when metrics are on).

Every record carries ``extra={"lease_event": ..., "run_id": ...}`` so log
pipelines can filter on it without parsing messages.

Changes of a lease's own state (held, completing, completed, lost, cancel
requested, cancelled) are typed: :class:`~celery_lease.Lease` makes each one
and publishes one :class:`Transition` (:meth:`EventLog.publish`). The other
events (claims, busy deliveries, sweeps, database errors) are emitted by name
with :meth:`EventLog.emit`.

Listeners are per app: each app's :class:`~celery_lease.runtime.AppRuntime`
holds one :class:`EventBus` (``app_runtime(app).events``), which the task, the
heartbeat, the leases and the sweeper of that app emit to. Objects made without
an app (a bare ``Lease`` or ``Heartbeat``, the CLI) get :data:`LOG_ONLY`, which
only logs and takes no listener.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, Final

logger = logging.getLogger("celery_lease")

Listener = Callable[["Event", dict[str, Any]], None]


class Event(str, enum.Enum):
    """Every lease event, declared once: ``extra={"lease_event": ...}`` on its log record,
    the name :meth:`EventLog.emit` takes and the one listeners (metrics, tracing) match.

    A ``str`` enum: a log pipeline compares ``record.lease_event`` with the plain
    string, and formats it as the string (``str()`` is the value).
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    # -- the changes of a lease's own state (published as Transitions)
    #: A fenced completion rolled back: the lease is held again.
    HELD = "held"
    #: A renewal saw a cancel request.
    CANCEL_SEEN = "cancel_seen"
    #: A success is written, not committed yet.
    COMPLETING = "completing"
    #: The run is recorded succeeded by this owner.
    COMPLETED = "completed"
    #: The lease is lost (taken over, expired, or its local deadline passed).
    LOST = "lost"
    #: The run ended cancelled after a cancel request.
    CANCELLED = "cancelled"
    # -- everything else, emitted by name
    #: A delivery found its run held (another live lease, a full concurrency key, a backoff).
    BUSY = "busy"
    #: The next step of a leased chain could not get its run row before its publish.
    CHAIN_STEP_NOT_KEPT = "chain_step_not_kept"
    #: A checkpoint was saved.
    CHECKPOINT = "checkpoint"
    #: A claim kept losing to concurrent claims of the same run.
    CLAIM_CONTENTION = "claim_contention"
    #: A claim failed on a transient database error; the delivery is retried.
    CLAIM_ERROR = "claim_error"
    #: A claim failed for good; the run ends failed where a row can be written.
    CLAIM_FAILED = "claim_failed"
    #: A claim won the lease: the body starts.
    CLAIMED = "claimed"
    #: The body committed success with fence(complete=True), then raised.
    COMPLETED_THEN_RAISED = "completed_then_raised"
    #: The worker names its lease database at start.
    DATABASE = "database"
    #: The lease database did not answer at worker start.
    DATABASE_UNREACHABLE = "database_unreachable"
    #: A connection waited past its bound and was cut.
    DB_WAIT_BOUND = "db_wait_bound"
    #: A delivery was deferred to its lease_rate_limit slot.
    DEFERRED = "deferred"
    #: A delivery could be neither published nor kept: left to the broker.
    DELIVERY_LOST = "delivery_lost"
    #: A delivery of a finished run was dropped (its outcome reported).
    DUPLICATE_DROPPED = "duplicate_dropped"
    #: The body ended its run as it chose (Ignore, Reject, replace).
    ENDED = "ended"
    #: A failure or retry could not be recorded in the lease database.
    FAIL_ERROR = "fail_error"
    #: An attempt failed and the run is out of attempts.
    FAILED = "failed"
    #: An operator paused a task.
    FLOW_PAUSED = "flow_paused"
    #: A follow-up task can never be published (its message is refused, or it waited
    #: past lease_retention): deleted.
    FOLLOWUP_DROPPED = "followup_dropped"
    #: A follow-up task could not be published now; the sweeper tries again.
    FOLLOWUP_ERROR = "followup_error"
    #: A follow-up task was published after its fenced transaction committed.
    FOLLOWUP_SENT = "followup_sent"
    #: An operator resumed a task.
    FLOW_RESUMED = "flow_resumed"
    #: A worker shutting down handed a delivery on unclaimed.
    HANDED_ON = "handed_on"
    #: One batched renewal statement ran.
    HEARTBEAT = "heartbeat"
    #: A renewal statement failed (the leases' deadlines decide).
    HEARTBEAT_ERROR = "heartbeat_error"
    #: A LeaseScheduler sent ticks that fell due before the catch-up window as one.
    BEAT_COALESCED = "beat_coalesced"
    #: A LeaseScheduler could not send or record a tick.
    BEAT_ERROR = "beat_error"
    #: A LeaseScheduler's record of a tick was refused: it lost its leader lease.
    BEAT_FENCED = "beat_fenced"
    #: A LeaseScheduler sent a tick of an entry.
    BEAT_SENT = "beat_sent"
    #: Lease_interrupt cannot work on this interpreter.
    INTERRUPT_DISABLED = "interrupt_disabled"
    #: An interrupt could not be raised into a body.
    INTERRUPT_ERROR = "interrupt_error"
    #: An interrupt was raised into a body.
    INTERRUPT_SENT = "interrupt_sent"
    #: A delivery could be neither re-published nor kept for the sweeper.
    KEEP_ERROR = "keep_error"
    #: A leader lease statement failed (the local deadline decides).
    LEADER_ERROR = "leader_error"
    #: This process lost a leader lease (refused renewal, local deadline, fenced write).
    LEADER_LOST = "leader_lost"
    #: This process ended its leader lease (shutdown): a standby takes it at once.
    LEADER_RESIGNED = "leader_resigned"
    #: This process took a leader lease (the sweeper of a database, a beat).
    LEADER_TAKEN = "leader_taken"
    #: A lost lease met its lease_lost_policy.
    LOST_HANDLED = "lost_handled"
    #: No sweep was seen on a broker that never redelivers.
    NO_SWEEPER = "no_sweeper"
    #: A delivery of paused work was held until resume.
    PAUSED = "paused"
    #: A renewal wrote the progress a body reported.
    PROGRESS = "progress"
    #: The database refused one run's reported progress: dropped for that run alone.
    PROGRESS_DROPPED = "progress_dropped"
    #: The broker refused a re-publish; the lease database keeps it for the sweeper.
    PUBLISH_DEFERRED = "publish_deferred"
    #: Retention could not delete finished rows.
    PURGE_ERROR = "purge_error"
    #: Retention deleted finished rows.
    PURGED = "purged"
    #: Retention deleted the rate buckets of idle rate keys.
    RATES_PURGED = "rates_purged"
    #: Results kept for a replay were dropped: Celery's result_expires passed.
    RESULTS_EXPIRED = "results_expired"
    #: An attempt failed (or asked to retry) and the run waits for its next one.
    RETRYING = "retrying"
    #: An operator reran the failed or cancelled runs of a task in bulk.
    RERUN_BULK = "rerun_bulk"
    #: A revoke() cancelled (or left) a run.
    REVOKED = "revoked"
    #: A sweep of a lease database was recorded.
    SWEEP_DONE = "sweep_done"
    #: A sweep's write was refused: the sweeper lost its leader lease meanwhile.
    SWEEP_FENCED = "sweep_fenced"
    #: A sweep step failed.
    SWEEP_ERROR = "sweep_error"
    #: A sweep could not be recorded.
    SWEEP_RECORD_ERROR = "sweep_record_error"
    #: A worker read the last sweep of a lease database.
    SWEEP_SEEN = "sweep_seen"
    #: The sweeper acted on a run.
    SWEPT = "swept"
    #: A fenced completion could not be verified.
    VERIFY_ERROR = "verify_error"
    #: A watchdog tick failed.
    WATCHDOG_ERROR = "watchdog_error"


class LeaseState(str, enum.Enum):
    """Where a :class:`~celery_lease.Lease` stands; only the lease changes it."""

    HELD = "held"
    #: A renewal saw ``cancel_requested_at``; the body is to stop.
    CANCEL_REQUESTED = "cancel_requested"
    #: The success is written but not committed yet (``fence(complete=True)`` in an
    #: open transaction, or the guarded completion in flight).
    COMPLETING = "completing"
    COMPLETED = "completed"
    LOST = "lost"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class Transition:
    """One change of one lease's state, as :func:`publish` hands it to listeners."""

    run_id: str
    owner: str
    attempt: int
    previous: LeaseState
    state: LeaseState
    #: Why (for ``LOST``: what detected the loss); empty when there is nothing to add.
    reason: str = ""


TransitionListener = Callable[[Transition], None]

#: The ``lease_event`` each state is logged under (kept from the string events).
_EVENT_NAMES = {
    LeaseState.HELD: Event.HELD,
    LeaseState.CANCEL_REQUESTED: Event.CANCEL_SEEN,
    LeaseState.COMPLETING: Event.COMPLETING,
    LeaseState.COMPLETED: Event.COMPLETED,
    LeaseState.LOST: Event.LOST,
    LeaseState.CANCELLED: Event.CANCELLED,
}
_LEVELS = {
    LeaseState.HELD: logging.INFO,
    LeaseState.CANCEL_REQUESTED: logging.INFO,
    LeaseState.COMPLETING: logging.DEBUG,
    LeaseState.COMPLETED: logging.INFO,
    LeaseState.LOST: logging.WARNING,
    LeaseState.CANCELLED: logging.INFO,
}


class EventLog:
    """Logs lease events; has no listeners (see :class:`EventBus` for one that does).

    Every record goes to the ``celery_lease`` logger with the event in
    ``extra``. The listener tuples are replaced, never changed in place, so an
    emit reads them without a lock or a copy.
    """

    __slots__ = ("_listeners", "_transition_listeners")

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._transition_listeners: tuple[TransitionListener, ...] = ()

    def emit(
        self,
        event: Event,
        run_id: str | None,
        message: str,
        *args: Any,
        level: int = logging.INFO,
        **fields: Any,
    ) -> None:
        """Log ``message % args`` once with the event in ``extra`` and notify listeners.

        A failing listener is logged and skipped: observability never breaks a task.
        """
        listeners = self._listeners
        if not listeners and not logger.isEnabledFor(level):
            return  # the hot path: two events per task, usually below the log level
        extra = {
            "lease_event": event,
            "run_id": run_id,
            **{f"lease_{k}": v for k, v in fields.items()},
        }
        logger.log(level, message, *args, extra=extra)
        data = {"run_id": run_id, **fields}
        for listener in listeners:
            try:
                listener(event, data)
            except Exception:
                logger.exception("celery-lease event listener %r failed", listener)

    def publish(self, transition: Transition) -> None:
        """Log one lease transition and hand it to the transition listeners.

        Called by :class:`~celery_lease.Lease` only, once per change. A failing
        listener is logged and skipped.
        """
        listeners = self._transition_listeners
        level = _LEVELS[transition.state]
        if not listeners and not logger.isEnabledFor(level):
            return
        logger.log(
            level,
            "run %s attempt %d: %s -> %s%s",
            transition.run_id,
            transition.attempt,
            transition.previous.value,
            transition.state.value,
            f" ({transition.reason})" if transition.reason else "",
            extra={
                "lease_event": _EVENT_NAMES[transition.state],
                "run_id": transition.run_id,
                "lease_attempt": transition.attempt,
                "lease_previous": transition.previous.value,
                "lease_reason": transition.reason,
            },
        )
        for listener in listeners:
            try:
                listener(transition)
            except Exception:
                logger.exception("celery-lease transition listener %r failed", listener)


class EventBus(EventLog):
    """One app's lease events: logged, and handed to the listeners added here."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, fields)`` for every lease event (metrics hook here)."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        with self._lock:
            self._listeners = tuple(found for found in self._listeners if found != listener)

    def add_transition_listener(self, listener: TransitionListener) -> None:
        """Call ``listener(transition)`` for every lease state change (metrics hook here)."""
        with self._lock:
            if listener not in self._transition_listeners:
                self._transition_listeners = (*self._transition_listeners, listener)

    def remove_transition_listener(self, listener: TransitionListener) -> None:
        """Stop calling ``listener``."""
        with self._lock:
            self._transition_listeners = tuple(
                found for found in self._transition_listeners if found != listener
            )

    def clear(self) -> None:
        """Drop every listener."""
        with self._lock:
            self._listeners = ()
            self._transition_listeners = ()


#: The events of objects made without an app: logged, never handed to a listener.
LOG_ONLY: Final = EventLog()
