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

Listener = Callable[[str, dict[str, Any]], None]


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
    LeaseState.HELD: "held",
    LeaseState.CANCEL_REQUESTED: "cancel_seen",
    LeaseState.COMPLETING: "completing",
    LeaseState.COMPLETED: "completed",
    LeaseState.LOST: "lost",
    LeaseState.CANCELLED: "cancelled",
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
        event: str,
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
