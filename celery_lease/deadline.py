"""A lease's local deadline, and what the heartbeat and the watchdog report about it."""

from __future__ import annotations

from .events import LeaseState, Transition
from .leasestate import _DEADLINE_APPLIES
from .transitions import Transitions

#: Share of ``lease_seconds`` kept in reserve: the local deadline falls this much
#: before the earliest moment the database can consider the lease expired.
SAFETY_FRACTION = 0.1
#: Worst relative rate difference assumed between this host's monotonic clock and
#: the database server's clock (NTP slews a clock by at most 500 ppm; doubled).
CLOCK_RATE_SLACK = 0.001


def safety_margin(lease_seconds: float) -> float:
    """How long before the database's expiry a lease counts as lost locally.

    ``lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)``: 10.1 % of the
    lease (3.03 s of a 30 s lease). The fraction covers the time between the
    database computing an expiry and this process acting on its own deadline
    (a check in flight, a scheduling delay); the slack covers clock rates.
    """
    return lease_seconds * (SAFETY_FRACTION + CLOCK_RATE_SLACK)


class DeadlineReports(Transitions):
    """What the heartbeat and the watchdog report: a layer of :class:`~celery_lease.Lease`."""

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
            self._publish(transition)

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
            if self._state in _DEADLINE_APPLIES and now >= self._deadline:
                transition = self._lose_locked(
                    f"local deadline passed: no renewal confirmed within "
                    f"{self.lease_seconds - self.margin:.3g}s (heartbeat stalled or "
                    "database unreachable)"
                )
            else:
                self._deliver_due_locked(now)
            wake = self._next_wake_locked()
        self._publish(transition)
        return wake
