"""The typed state changes of a lease, and the end of a fenced completion's transaction."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from sqlalchemy import Connection, event

from .errors import LeaseLost
from .events import LeaseState, Transition
from .interrupt import Interrupts

logger = logging.getLogger(__name__)


class Transitions(Interrupts):
    """Each state change of a lease (a layer of :class:`~celery_lease.lease.Lease`)."""

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
        self._publish(transition)

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
        self._publish(transition)

    def _detach_hooks(self) -> None:
        # Never from a hook: SQLAlchemy's dispatch loop cannot lose a listener
        # while it runs. Spent hooks are no-ops until removed here.
        hooks, self._hooks = self._hooks, []
        for connection, name, fn in hooks:
            with contextlib.suppress(Exception):
                event.remove(connection, name, fn)
