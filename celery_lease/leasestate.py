"""What the parts of a :class:`~celery_lease.lease.Lease` share: its fields and state sets.

:class:`~celery_lease.lease.Lease` is assembled from small layers, each one
concern: :mod:`.interrupt` (raising into the body thread),
:mod:`.transitions` (the typed state changes), :mod:`.deadline` (what the
heartbeat and the watchdog report), and the public API in :mod:`.lease`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from .errors import LeaseLost
from .events import EventLog, LeaseState, Transition

if TYPE_CHECKING:
    from .store import LeaseStore
    from .watchdog import Watchdog

_INTERRUPTING = (LeaseState.LOST, LeaseState.CANCEL_REQUESTED)
_DEADLINE_APPLIES = (LeaseState.HELD, LeaseState.CANCEL_REQUESTED)


class LeaseFields:
    """The state every layer of a lease reads and writes, under ``_lock``."""

    store: LeaseStore
    #: Where this lease's transitions are published (its app's bus, or log only).
    events: EventLog
    run_id: str
    owner: str
    attempt: int
    lease_seconds: float
    heartbeat_interval: float
    margin: float
    interrupt: bool
    _clock: Callable[[], float]
    _watchdog: Watchdog | None
    _lock: threading.Lock
    _state: LeaseState
    _lost: LeaseLost | None
    _cancel_seen: bool
    _deadline: float
    _fenced_at: float | None
    _verified: bool
    _hooks: list[tuple[Connection, str, Callable[..., None]]]
    _thread_id: int | None
    _depth: int
    _sent: bool
    _due: bool
    _quiet_until: float

    def _publish(self, transition: Transition | None) -> None:
        if transition is not None:
            self.events.publish(transition)
