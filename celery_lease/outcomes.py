"""How a body's end is recorded: success, failure, retry, cancel, a lost lease."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, NoReturn

from celery.exceptions import Ignore, Retry

from .config import LeaseConfig
from .duplicates import DuplicateOutcomes
from .errors import (
    LeaseDatabaseError,
    LeaseError,
    LeaseLost,
)
from .lease.lease import Lease
from .republish import backoff_delay
from .runtime import Runtime
from .sanitize import describe_exception
from .schema import SUCCEEDED

logger = logging.getLogger(__name__)

#: How long a completion may keep retrying a database error, at most.
COMPLETE_RETRY_SECONDS = 5.0


class _Replaced(Ignore):  # type: ignore[misc]
    """``self.replace()`` handed the run's continuation to the replacement."""


def _ceiling(config: LeaseConfig, lease: Lease) -> int:
    """The attempt at which ``lease``'s run is out of attempts (raised by ``lease rerun``)."""
    return max(config.max_attempts, lease.max_attempts)


def _seconds_until(when: Any) -> float:
    """Seconds from now until a Retry's ``when``: a countdown in seconds, or an ETA."""
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return 0.0
    if isinstance(when, datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, float((when - datetime.now(timezone.utc)).total_seconds()))
    return 0.0


class RunOutcomes(DuplicateOutcomes):
    """Recording the outcome of a body that ran (a layer of ``LeasedTask``)."""

    def _complete(self, config: LeaseConfig, runtime: Runtime, lease: Lease) -> None:
        """The guarded completion; database errors are retried while the lease may hold."""
        deadline = time.monotonic() + min(COMPLETE_RETRY_SECONDS, config.lease_seconds)
        delay = 0.05
        while True:
            try:
                lease.complete()
                return
            except LeaseLost as exc:
                self._on_lost(config, lease, exc)
            except LeaseDatabaseError as exc:
                if not exc.transient or time.monotonic() + delay >= deadline:
                    lost = LeaseLost(
                        lease.run_id,
                        lease.owner,
                        lease.attempt,
                        f"complete failed: {describe_exception(exc, 300)}",
                    )
                    self._on_lost(config, lease, lost)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _completed_by_body(self, runtime: Runtime, lease: Lease) -> bool:
        """True when this owner's ``fence(complete=True)`` committed the run's success."""
        if not lease.completed_pending:
            return False
        try:
            row = runtime.store.get(lease.run_id)
        except LeaseDatabaseError:
            return False
        return (
            row is not None
            and row.status == SUCCEEDED
            and row.lease_owner == lease.owner
            and row.attempt == lease.attempt
        )

    def _on_lost(self, config: LeaseConfig, lease: Lease, exc: LeaseLost) -> NoReturn:
        # The heartbeat logs the loss it detects; here only what this call
        # learned (e.g. the refused completion) and the policy applied.
        lease.mark_lost(exc.reason)
        lease.events.emit(
            "lost_handled",
            lease.run_id,
            "%s (policy %s)",
            exc,
            config.lost_policy,
            level=logging.WARNING,
            attempt=lease.attempt,
            policy=config.lost_policy,
        )
        if config.lost_policy == "abort":
            raise exc
        # Whoever holds the run now owns its result: write nothing, and let the
        # next claim see the truth (finished: dropped; expired: run again).
        self._reschedule(backoff_delay(config, 1), exc)

    def _on_cancelled(self, config: LeaseConfig, runtime: Runtime, lease: Lease) -> NoReturn:
        try:
            lease.mark_cancelled()
        except LeaseLost as exc:
            self._on_lost(config, lease, exc)
        self._mark_revoked(lease.run_id)
        raise Ignore()

    def _on_retry(self, config: LeaseConfig, runtime: Runtime, lease: Lease, exc: Retry) -> None:
        """The body called ``self.retry()``: the run waits until the retry's ETA.

        Celery has already published the retry; the row records it (``retrying``,
        ``available_at`` = its ETA, the retry as the stored message), so no sweep
        sends the run before then.
        """
        delay = 0.0 if self.request.is_eager else _seconds_until(exc.when)
        cause = exc.exc if isinstance(exc.exc, BaseException) else None
        message = None
        if exc.sig is not None and not self._direct():
            message = self._encode(dict(exc.sig))
        try:
            runtime.store.fail(
                lease.run_id,
                lease.owner,
                lease.attempt,
                error=describe_exception(cause) if cause is not None else "retry requested",
                failure_code=(
                    f"exception:{type(cause).__name__}"[:64] if cause is not None else "retry"
                ),
                retry_in=delay,
                message=message,
            )
        except LeaseLost as lost:
            # Whoever holds the run now owns its state; the retry already sent
            # claims it (or is dropped) like any other delivery.
            lease.mark_lost(lost.reason)
            lease.events.emit(
                "lost_handled",
                lease.run_id,
                "%s",
                lost,
                level=logging.WARNING,
                attempt=lease.attempt,
            )
            raise Ignore() from lost
        except LeaseDatabaseError as db_exc:
            lease.events.emit(
                "fail_error",
                lease.run_id,
                "run %s: could not record the retry: %s",
                lease.run_id,
                describe_exception(db_exc),
                level=logging.WARNING,
            )
        lease.events.emit(
            "retrying",
            lease.run_id,
            "run %s attempt %d: retry requested, due in %.1fs",
            lease.run_id,
            lease.attempt,
            delay,
            attempt=lease.attempt,
        )

    def _on_failure(
        self, config: LeaseConfig, runtime: Runtime, lease: Lease, exc: Exception
    ) -> NoReturn:
        ceiling = _ceiling(config, lease)
        # After a rerun the backoff starts over: count this series' failures only.
        failures = lease.attempt - (ceiling - config.max_attempts)
        retry_in = None if lease.attempt >= ceiling else backoff_delay(config, failures)
        try:
            status = runtime.store.fail(
                lease.run_id,
                lease.owner,
                lease.attempt,
                error=describe_exception(exc),
                failure_code=f"exception:{type(exc).__name__}"[:64],
                retry_in=retry_in,
            )
        except LeaseLost as lost:
            self._on_lost(config, lease, lost)
        except LeaseDatabaseError as db_exc:
            # The failure cannot be recorded; the lease will expire and the run
            # is claimed again then.
            lease.events.emit(
                "fail_error",
                lease.run_id,
                "run %s: could not record failure: %s",
                lease.run_id,
                describe_exception(db_exc),
                level=logging.WARNING,
            )
            self._reschedule(config.lease_seconds, exc)
        lease.events.emit(
            "failed" if retry_in is None else "retrying",
            lease.run_id,
            "run %s attempt %d/%d raised %s -> %s",
            lease.run_id,
            lease.attempt,
            _ceiling(config, lease),
            type(exc).__name__,
            status,
            level=logging.WARNING,
            attempt=lease.attempt,
        )
        if retry_in is None or self._direct():
            raise exc
        self._publish_again(retry_in)
        raise Retry(exc=exc, when=retry_in)

    def _release_quietly(self, runtime: Runtime, lease: Lease) -> None:
        try:
            runtime.store.release(lease.run_id, lease.owner, lease.attempt)
        except LeaseError as exc:
            logger.info(
                "celery-lease: release of %s skipped: %s", lease.run_id, describe_exception(exc)
            )

    def _end_quietly(
        self,
        runtime: Runtime,
        lease: Lease,
        status: str,
        failure_code: str,
        cause: BaseException | None = None,
    ) -> None:
        """End the run as the body chose (Ignore, Reject, replace); a lost lease is logged."""
        try:
            runtime.store.end(
                lease.run_id,
                lease.owner,
                lease.attempt,
                status=status,
                failure_code=failure_code,
                error=describe_exception(cause) if cause is not None else None,
            )
        except LeaseError as exc:
            logger.warning(
                "celery-lease: could not end run %s as %s: %s",
                lease.run_id,
                failure_code,
                describe_exception(exc),
            )
            return
        lease.events.emit(
            "ended",
            lease.run_id,
            "run %s: %s (%s)",
            lease.run_id,
            status,
            failure_code,
            attempt=lease.attempt,
            status=status,
        )
