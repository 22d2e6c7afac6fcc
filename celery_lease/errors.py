"""The error tree of celery-lease.

Every error carries a stable ``code`` and the facts a caller needs as
attributes, so log search, ``except`` clauses and dashboards never parse text.
"""

from __future__ import annotations

LEASE_LOST_CODE = "automation_run_lease_lost"


class LeaseError(Exception):
    """Base of every celery-lease error."""

    code = "lease_error"


class LeaseLost(LeaseError):
    """This worker no longer holds the lease of ``run_id``.

    Raised when a guarded write changes zero rows, when the heartbeat saw the
    lease taken over, or when the last confirmed expiry passed without renewal.
    ``str()`` starts with ``automation_run_lease_lost``.
    """

    code = LEASE_LOST_CODE

    def __init__(self, run_id: str, owner: str, attempt: int, reason: str) -> None:
        self.run_id = run_id
        self.owner = owner
        self.attempt = attempt
        self.reason = reason
        super().__init__(
            f"{LEASE_LOST_CODE}: run {run_id} attempt {attempt} owner {owner}: {reason}"
        )

    def __reduce__(self) -> tuple[type[LeaseLost], tuple[str, str, int, str]]:
        return (type(self), (self.run_id, self.owner, self.attempt, self.reason))


class LeaseBusy(LeaseError):
    """Another worker holds a live lease on the run, or its concurrency key is full.

    ``retry_in`` is the number of seconds until that lease expires (by the
    database clock), a hint for when to try again.
    """

    code = "lease_busy"

    def __init__(
        self, run_id: str, retry_in: float, reason: str = "held by another worker"
    ) -> None:
        self.run_id = run_id
        self.retry_in = retry_in
        self.reason = reason
        super().__init__(f"{self.code}: run {run_id}: {reason} (retry in {retry_in:.1f}s)")

    def __reduce__(self) -> tuple[type[LeaseBusy], tuple[str, float, str]]:
        return (type(self), (self.run_id, self.retry_in, self.reason))


class RunCancelled(LeaseError):
    """Cancellation was requested for the run this worker holds."""

    code = "cancelled"

    def __init__(self, run_id: str, owner: str = "", attempt: int = 0) -> None:
        self.run_id = run_id
        self.owner = owner
        self.attempt = attempt
        super().__init__(f"{self.code}: run {run_id} was cancelled")

    def __reduce__(self) -> tuple[type[RunCancelled], tuple[str, str, int]]:
        return (type(self), (self.run_id, self.owner, self.attempt))
