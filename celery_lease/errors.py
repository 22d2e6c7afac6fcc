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
        # No hint where there is no wait to give (a pause lasts until its resume).
        hint = f" (retry in {retry_in:.1f}s)" if retry_in > 0 else ""
        super().__init__(f"{self.code}: run {run_id}: {reason}{hint}")

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


class InvalidLeaseKey(LeaseError, ValueError):
    """A task's ``lease_key`` returned something that cannot name a run.

    Raised when the task is called (``delay``/``apply_async``) and again in the
    worker: the key must be a non-empty ``str`` or an ``int``, never ``None``.
    """

    code = "invalid_lease_key"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self) -> tuple[type[InvalidLeaseKey], tuple[str]]:
        return (type(self), (self.message,))


class RunFailed(LeaseError):
    """The run this delivery belongs to already ended ``failed``.

    What a duplicate delivery (another task id, same run) reports as its own
    failure, when Celery's stored exception of the run is not available.
    Carries the run's ``failure_code`` and sanitized ``last_error``.
    """

    code = "run_failed"

    def __init__(self, run_id: str, failure_code: str | None, last_error: str | None) -> None:
        self.run_id = run_id
        self.failure_code = failure_code
        self.last_error = last_error
        # Its arguments are its args: Celery's result backends rebuild an exception
        # as ``cls(*args)`` (json), so the caller gets a RunFailed back.
        super().__init__(run_id, failure_code, last_error)

    def __str__(self) -> str:
        return (
            f"{self.code}: run {self.run_id} failed ({self.failure_code or 'unknown'}): "
            f"{self.last_error or 'no error recorded'}"
        )

    def __reduce__(self) -> tuple[type[RunFailed], tuple[str, str | None, str | None]]:
        return (type(self), (self.run_id, self.failure_code, self.last_error))


DB_UNAVAILABLE_CODE = "lease_db_unavailable"
DB_ERROR_CODE = "lease_db_error"


class LeaseDatabaseError(LeaseError):
    """The lease database refused or failed a statement; see :mod:`celery_lease.dberrors`.

    ``transient`` says whether the same statement may succeed later (a
    disconnect, a timeout, a deadlock) or never will (a value too long, a
    missing table). ``cause`` is a short stable name such as ``deadlock`` or
    ``data_too_long``. ``failure_code`` is what a run ended by this error
    records: ``lease_db_unavailable`` for transient errors once their retries
    are spent, ``lease_db_error:<cause>`` for permanent ones. The driver's
    exception is ``__cause__``.
    """

    code = DB_ERROR_CODE

    def __init__(self, message: str, transient: bool = False, cause: str = "unknown") -> None:
        self.transient = transient
        self.cause = cause
        self.detail = message
        # args are the constructor's, so Celery's result backend rebuilds it whole.
        super().__init__(message, transient, cause)

    @property
    def failure_code(self) -> str:
        """``lease_db_unavailable`` (transient) or ``lease_db_error:<cause>`` (permanent)."""
        return DB_UNAVAILABLE_CODE if self.transient else f"{DB_ERROR_CODE}:{self.cause}"[:64]

    def __str__(self) -> str:
        return f"{self.failure_code}: {self.detail}"

    @property
    def migrate_hint(self) -> str:
        """`` (run `lease migrate`?)`` when a migration would fix this (a missing table or
        column), else nothing: the text to follow a log line's subject."""
        return (
            " (run `lease migrate`?)" if self.cause in ("missing_table", "missing_column") else ""
        )


def migrate_hint(exc: BaseException) -> str:
    """:attr:`LeaseDatabaseError.migrate_hint` of ``exc``, nothing for another error."""
    return exc.migrate_hint if isinstance(exc, LeaseDatabaseError) else ""


class LeaseInputError(LeaseError, ValueError):
    """A value cannot be stored in the run row (too long, too large, out of range).

    Raised before any SQL runs. ``field`` names the value (``run_id``,
    ``payload``, ``lease_ms``...); ``failure_code`` is ``lease_input_invalid:<field>``.
    """

    code = "lease_input_invalid"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(field, message)

    def __str__(self) -> str:
        return f"{self.code}: {self.field}: {self.detail}"

    @property
    def failure_code(self) -> str:
        """``lease_input_invalid:<field>``."""
        return f"{self.code}:{self.field}"[:64]


class LeaseUsageError(LeaseError):
    """The lease API was used in a way that cannot work, e.g. ``fence()`` on another database.

    Not a lost lease: the lease may still be held. The message says what to change.
    """

    code = "lease_usage_error"


class RunNotFound(LeaseError):
    """No run row has this id."""

    code = "run_not_found"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"{self.code}: no run with id {run_id!r}")

    def __reduce__(self) -> tuple[type[RunNotFound], tuple[str]]:
        return (type(self), (self.run_id,))


class RunNotRerunnable(LeaseError):
    """``celery lease rerun`` refused: the run is live, or succeeded without ``force``."""

    code = "run_not_rerunnable"

    def __init__(self, run_id: str, status: str) -> None:
        self.run_id = run_id
        self.status = status
        super().__init__(f"{self.code}: run {run_id!r} is {status}")

    def __reduce__(self) -> tuple[type[RunNotRerunnable], tuple[str, str]]:
        return (type(self), (self.run_id, self.status))


class ActionFailed(LeaseError):
    """An operator's action on a run (``lease cancel``, ``rerun``, the web view's buttons)
    was refused or could not be carried out; ``str()`` is the one line to show them.
    ``run_id`` is ``""`` for an action on a task or on many runs."""

    code = "action_failed"

    def __init__(self, run_id: str, message: str) -> None:
        self.run_id = run_id
        self.message = " ".join(message.split())
        super().__init__(self.message)

    def __reduce__(self) -> tuple[type[ActionFailed], tuple[str, str]]:
        return (type(self), (self.run_id, self.message))


class LeadershipLost(LeaseError):
    """A leader's fenced write was refused: its leader lease (``name``) is no longer held by
    ``owner`` in ``term`` (it expired, or a standby took over). Nothing was written."""

    code = "lease_leadership_lost"

    def __init__(self, name: str, owner: str, term: int) -> None:
        self.name = name
        self.owner = owner
        self.term = term
        super().__init__(f"{self.code}: {name} is no longer held by {owner} (term {term})")

    def __reduce__(self) -> tuple[type[LeadershipLost], tuple[str, str, int]]:
        return (type(self), (self.name, self.owner, self.term))
