"""One delivery of a leased task: claim -> body -> outcome.

An :class:`Attempt` is made by ``LeasedTask.__call__`` for each delivery and
owns everything that delivery needs: the task, its request, config, runtime,
run id, arguments, the claim and the lease. Nothing of it lives on the task
class (Celery keeps its per-run machinery off ``Task`` the same way: its
``Request`` and ``app/trace.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from .. import flow
from ..config import LeaseConfig
from ..errors import (
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
    LeaseLost,
    RunCancelled,
)
from ..events import EventBus
from ..lease.interrupt import LeaseInterrupt
from ..lease.lease import Lease, bind_current
from ..owner import new_owner
from ..runtime import Runtime, Traced, app_runtime, runtime_for, shutting_down, worker_id
from ..sanitize import describe_exception
from ..schema import CANCELLED, FAILED, SUCCEEDED
from ..store import ClaimResult
from . import duplicates, outcome, republish, runids

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a completion may keep retrying a database error, at most.
COMPLETE_RETRY_SECONDS = 5.0


class Replaced(Ignore):  # type: ignore[misc]
    """``self.replace()`` handed the run's continuation to the replacement."""


def ceiling(config: LeaseConfig, lease: Lease) -> int:
    """The attempt at which ``lease``'s run is out of attempts (raised by ``lease rerun``)."""
    return max(config.max_attempts, lease.max_attempts)


def seconds_until(when: Any) -> float:
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


class _Unset:
    """The type of :data:`_UNSET`: a value not worked out yet."""


_UNSET = _Unset()


class Attempt:
    """One delivery of a ``LeasedTask``: its claim, its body under the lease, its outcome.

    Attributes:
        task: the bound task.
        request: the delivery's Celery request context.
        config: the task's lease settings (``task.lease_config()``).
        run_id: the run this delivery claims.
        args: the body's positional arguments.
        kwargs: the body's keyword arguments.
        claim: the claim's result, once claimed.
        lease: the lease the body runs under, once the claim took the run.
        trace: the delivery's spans (``celery-lease[otel]``), or None.
    """

    def __init__(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.task = task
        self.request = task.request
        self.config: LeaseConfig = task.lease_config()
        self.args = args
        self.kwargs = kwargs
        self.run_id = runids.run_id_of(task, self.request, args, kwargs)
        self.claim: ClaimResult | None = None
        self.lease: Lease | None = None
        self.trace: Traced | None = None
        # Worked out on first use (cheaper than functools.cached_property's lock):
        # runtime_for may raise, and the claim's error handling decides what then.
        self._runtime: Runtime | None = None
        self._concurrency_key: str | _Unset | None = _UNSET

    @property
    def runtime(self) -> Runtime:
        """The store and heartbeat of the task's lease database in this process."""
        runtime = self._runtime
        if runtime is None:
            runtime = self._runtime = runtime_for(self.task.app, self.config)
        return runtime

    @property
    def concurrency_key(self) -> str | None:
        """The claim's concurrency key (see :func:`~celery_lease.run.runids.concurrency_key`)."""
        key = self._concurrency_key
        if isinstance(key, _Unset):
            key = self._concurrency_key = runids.concurrency_key(
                str(self.task.name), self.config, self.args, self.kwargs
            )
        return key

    @property
    def events(self) -> EventBus:
        """The app's event bus (the task's leases and stores use the same one)."""
        return app_runtime(self.task.app).events

    @property
    def direct(self) -> bool:
        """True for a plain function call or an eager ``apply()``: no worker delivery."""
        return bool(self.request.called_directly or self.request.is_eager)

    # -- claim --------------------------------------------------------------------

    def run(self) -> Any:
        """Claim the run, run the body under its lease, record the outcome; the body's result."""
        task, request, run_id = self.task, self.request, self.run_id
        if not self.direct and shutting_down(task.app):
            # A worker that is shutting down claims nothing new: hand the
            # delivery to a worker that stays (a prefetched message, say).
            self.events.emit(
                "handed_on",
                run_id,
                "run %s: worker shutting down, delivery handed on",
                run_id,
            )
            republish.reschedule(self, 0.0, LeaseBusy(run_id, 0.0, "worker shutting down"))
        config = self.config
        app_state = app_runtime(task.app)
        tracing = app_state.tracing
        try:
            runtime = self.runtime
            owner = new_owner(request.hostname, worker_id(task.app))
            if tracing is not None:
                self.trace = tracing.begin(task.name, run_id, owner)
            trace = self.trace
            period = config.rate_period_ms
            if period is not None and not self.direct and not flow.has_slot(request):
                # The fleet-wide rate limit: one more statement, only for a limited task.
                key = runids.rate_key(task.name, config, self.args, self.kwargs)
                wait_ms, due_ms = runtime.store.reserve_rate(
                    task.name, key, period, config.rate_burst
                )
                if wait_ms > 0:
                    if trace is not None:
                        trace.ended("rate_limited")
                    republish.defer(self, key, wait_ms, due_ms)
            started_at = time.monotonic()  # before the claim is sent: the lease's local deadline
            claim = runtime.store.claim(
                run_id,
                owner,
                task_name=task.name,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                concurrency_key=self.concurrency_key,
                max_concurrency=config.max_concurrency,
                task_id=request.id,
                trace_context=None if trace is None else trace.traceparent,
                **runids.payload(self),
            )
        except (LeaseDatabaseError, LeaseInputError) as exc:
            if self.trace is not None:
                self.trace.claim_failed(exc)
            # Fail closed: without a lease the body must not run.
            republish.on_claim_error(self, exc)
        if trace is not None:
            trace.claimed(claim)
        self.claim = claim
        if claim.outcome == "finished":
            if request.called_directly:
                return None  # a plain call of a finished run: nothing to do
            return duplicates.on_finished(self, claim)
        if claim.outcome == "busy":
            republish.on_busy(self, claim)
        if claim.outcome == "paused":
            republish.on_paused(self, claim)
        runtime.events.emit(
            "claimed",
            run_id,
            "run %s: claimed attempt %d",
            run_id,
            claim.attempt,
            attempt=claim.attempt,
        )
        self.lease = Lease(
            runtime.store,
            run_id,
            claim.owner,
            claim.attempt,
            lease_seconds=config.lease_seconds,
            heartbeat_interval=config.heartbeat_interval,
            started_at=started_at,
            interrupt=config.interrupt and not app_state.green_pool,
            max_attempts=claim.max_attempts,
            events=runtime.events,
            checkpoint=claim.checkpoint,
            task_name=task.name,
            trace=trace,
        )
        return self._run_body(self.lease)

    # -- body -----------------------------------------------------------------------

    def _run_body(self, lease: Lease) -> Any:
        runtime = self.runtime
        runtime.heartbeat.register(lease)
        with bind_current(lease):
            try:
                return self._body_and_outcome(lease)
            finally:
                runtime.heartbeat.unregister(lease)
                if self.trace is not None:
                    self.trace.end()

    def _body_and_outcome(self, lease: Lease) -> Any:
        try:
            try:
                try:
                    result = lease.run_interruptible(self.task.run, *self.args, **self.kwargs)
                except LeaseInterrupt:
                    error = lease.error()
                    if error is None:  # cannot happen: interrupts follow a recorded cause
                        error = LeaseLost(lease.run_id, lease.owner, lease.attempt, "interrupted")
                    raise error from None
            except BaseException:
                if self._completed_by_body(lease):
                    # fence(complete=True) committed: the run succeeded, whatever came after.
                    lease.events.emit(
                        "completed_then_raised",
                        lease.run_id,
                        "run %s: succeeded (recorded by the body; it raised afterwards)",
                        lease.run_id,
                        attempt=lease.attempt,
                    )
                    return None
                raise
        except Retry as exc:
            self._on_retry(lease, exc)
            raise
        except Replaced:
            self._end_quietly(lease, SUCCEEDED, "replaced")
            raise
        except Reject as exc:
            if exc.requeue:
                # The broker delivers it again: that delivery claims the run.
                self._release_quietly(lease)
            else:
                self._end_quietly(lease, FAILED, "rejected", exc)
            raise
        except Ignore as exc:
            self._end_quietly(lease, CANCELLED, "ignored", exc)
            raise
        except LeaseLost as exc:
            self._on_lost(lease, exc)
        except RunCancelled:
            self._on_cancelled(lease)
        except Exception as exc:
            self._on_failure(lease, exc)
        self._complete(lease, outcome.encode_result(self.task.app, result))
        return result

    # -- outcome ----------------------------------------------------------------------

    def _write(self, write: Callable[[], T]) -> T:
        """``write()``, a guarded write of the outcome; transient database errors are
        retried for up to ``COMPLETE_RETRY_SECONDS`` (while the lease may hold), then raised."""
        deadline = time.monotonic() + min(COMPLETE_RETRY_SECONDS, self.config.lease_seconds)
        delay = 0.05
        while True:
            try:
                return write()
            except LeaseDatabaseError as exc:
                if not exc.transient or time.monotonic() + delay >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _complete(self, lease: Lease, result: tuple[bytes, str] | None = None) -> None:
        """The guarded completion, keeping ``result`` (the body's, serialized) in the row;
        database errors are retried while the lease may hold."""
        try:
            self._write(lambda: lease.complete(result))
        except LeaseLost as exc:
            self._on_lost(lease, exc)
        except LeaseDatabaseError as exc:
            lost = LeaseLost(
                lease.run_id,
                lease.owner,
                lease.attempt,
                f"complete failed: {describe_exception(exc, 300)}",
            )
            self._on_lost(lease, lost)

    def _completed_by_body(self, lease: Lease) -> bool:
        """True when this owner's ``fence(complete=True)`` committed the run's success."""
        if not lease.completed_pending:
            return False
        try:
            row = self.runtime.store.get(lease.run_id)
        except LeaseDatabaseError:
            return False
        return (
            row is not None
            and row.status == SUCCEEDED
            and row.lease_owner == lease.owner
            and row.attempt == lease.attempt
        )

    def _on_lost(self, lease: Lease, exc: LeaseLost) -> NoReturn:
        # The heartbeat logs the loss it detects; here only what this call
        # learned (e.g. the refused completion) and the policy applied.
        config = self.config
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
        republish.reschedule(self, republish.backoff_delay(config, 1), exc)

    def _on_cancelled(self, lease: Lease) -> NoReturn:
        try:
            lease.mark_cancelled()
        except LeaseLost as exc:
            self._on_lost(lease, exc)
        duplicates.mark_revoked(self)
        raise Ignore()

    def _on_retry(self, lease: Lease, exc: Retry) -> None:
        """The body called ``self.retry()``: the run waits until the retry's ETA.

        Celery has already published the retry; the row records it (``retrying``,
        ``available_at`` = its ETA, the retry as the stored message), so no sweep
        sends the run before then.
        """
        refused = republish.take_refused_retry()
        delay = 0.0 if self.request.is_eager else seconds_until(exc.when)
        cause = exc.exc if isinstance(exc.exc, BaseException) else None
        message = None
        if exc.sig is not None and not self.direct:
            message = runids.encode(self, dict(exc.sig))
        try:
            self.runtime.store.fail(
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
            if refused is not None:
                # Neither the broker nor the lease database took the retry.
                logger.error(
                    "celery-lease: could not publish the retry of %s (%s) nor keep it for "
                    "the sweeper: asking the broker to requeue; without acks_late this "
                    "delivery may be lost",
                    self.request.id,
                    describe_exception(refused),
                    extra={"lease_event": "delivery_lost"},
                )
                raise Reject(requeue=True) from refused
        if refused is not None:
            lease.events.emit(
                "publish_deferred",
                lease.run_id,
                "run %s: the broker refused the retry of %s (%s); kept in the lease "
                "database, the sweeper sends it",
                lease.run_id,
                self.request.id,
                describe_exception(refused),
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

    def _on_failure(self, lease: Lease, exc: Exception) -> NoReturn:
        config = self.config
        last = ceiling(config, lease)
        # After a rerun the backoff starts over: count this series' failures only.
        failures = lease.attempt - (last - config.max_attempts)
        # Celery's max_retries, when the task sets one, bounds the body's runs too:
        # whichever of it and lease_max_attempts is reached first ends the run.
        max_retries = self.task.max_retries
        spent = lease.attempt >= last or (max_retries is not None and failures > max_retries)
        retry_in = None if spent else republish.backoff_delay(config, failures)
        try:
            status = self.runtime.store.fail(
                lease.run_id,
                lease.owner,
                lease.attempt,
                error=describe_exception(exc),
                failure_code=f"exception:{type(exc).__name__}"[:64],
                retry_in=retry_in,
            )
        except LeaseLost as lost:
            self._on_lost(lease, lost)
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
            republish.reschedule(self, config.lease_seconds, exc)
        lease.events.emit(
            "failed" if retry_in is None else "retrying",
            lease.run_id,
            "run %s attempt %d/%d raised %s -> %s",
            lease.run_id,
            lease.attempt,
            ceiling(config, lease),
            type(exc).__name__,
            status,
            level=logging.WARNING,
            attempt=lease.attempt,
        )
        if retry_in is None or self.direct:
            raise exc
        republish.publish_again(self, retry_in)
        raise Retry(exc=exc, when=retry_in)

    def _release_quietly(self, lease: Lease) -> None:
        try:
            self.runtime.store.release(lease.run_id, lease.owner, lease.attempt)
        except LeaseError as exc:
            logger.info(
                "celery-lease: release of %s skipped: %s", lease.run_id, describe_exception(exc)
            )

    def _end_quietly(
        self,
        lease: Lease,
        status: str,
        failure_code: str,
        cause: BaseException | None = None,
    ) -> None:
        """End the run as the body chose (Ignore, Reject, replace); a lost lease is logged.

        Database errors are retried as the completion's are: a run that chose to end
        must not be left for the sweeper to run again after one lock timeout.
        """
        try:
            self._write(
                lambda: self.runtime.store.end(
                    lease.run_id,
                    lease.owner,
                    lease.attempt,
                    status=status,
                    failure_code=failure_code,
                    error=describe_exception(cause) if cause is not None else None,
                )
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
