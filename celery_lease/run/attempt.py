"""One delivery of a leased task: claim -> body -> outcome.

An :class:`Attempt` is made by ``LeasedTask.__call__`` for each delivery and
owns what that delivery changes: its claim, its lease, its outcome, and
Celery's retry handshake. What the delivery is (task, request, settings, run
id, hooks) is its :class:`~celery_lease.run.delivery.Delivery`, worked out
once. Nothing of it lives on the task class (Celery keeps its per-run
machinery off ``Task`` the same way: its ``Request`` and ``app/trace.py``).

The features a task uses (rate limit, pause, tracing, ...) are its hooks
(:mod:`celery_lease.hooks`); this module names none of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

from celery.exceptions import Ignore, Reject, Retry, TaskPredicate

from ..config import LeaseConfig
from ..errors import (
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
    LeaseLost,
    LeaseUsageError,
    RunCancelled,
)
from ..events import Event
from ..lease.interrupt import LeaseInterrupt
from ..lease.lease import Lease, bind_current
from ..requeue import COPY, COPY_HEADER
from ..runtime import app_runtime, shutting_down
from ..sanitize import describe_exception
from ..schema import CANCELLED, FAILED, SUCCEEDED
from ..store import ClaimResult
from . import duplicates, republish
from .delivery import Delivery, DeliveryHooks

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a completion may keep retrying a database error, at most.
COMPLETE_RETRY_SECONDS = 5.0

#: The attempt running in this thread (one per delivery); Celery's retry handshake reads it.
_current: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "celery_lease_attempt", default=None
)


def current_attempt() -> Attempt | None:
    """The attempt running in this thread, or None."""
    return _current.get()


def _call(point: Callable[..., T], *args: Any) -> T | None:
    """``point(*args)``, a hook; a hook that fails otherwise than by ending the delivery
    (Celery's ``Ignore``/``Reject``/``Retry``) or a lease error fails only itself."""
    try:
        return point(*args)
    except (TaskPredicate, LeaseError):
        raise
    except Exception:
        logger.exception("celery-lease: hook %r failed; the delivery goes on without it", point)
        return None


class Replaced(Ignore):  # type: ignore[misc]
    """``self.replace()`` handed the run's continuation to the replacement."""


#: The header of what an attempt sends again after its claim: a copy of a delivery
#: that claimed the run (a later one under its task id is a duplicate).
COPIED = {COPY_HEADER: COPY}

#: Errors of the lease's API used wrongly (``fence()`` on another database, a value
#: that cannot be stored): the same on every attempt, so never retried by the lease.
USAGE_ERRORS = (LeaseUsageError, LeaseInputError)


def failure_code(exc: BaseException) -> str:
    """The ``failure_code`` a run ended by the body's ``exc`` records: a usage error's own
    code (``lease_usage_error``, ``lease_input_invalid:<field>``), else
    ``exception:<class name>``; never the error's text."""
    if isinstance(exc, LeaseInputError):
        return exc.failure_code
    if isinstance(exc, LeaseUsageError):
        return exc.code
    return f"exception:{type(exc).__name__}"[:64]


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


class Attempt:
    """One delivery of a ``LeasedTask``: its claim, its body under the lease, its outcome.

    Attributes:
        delivery: what the delivery is (task, request, settings, run id, hooks).
        claim: the claim's result, once claimed.
        lease: the lease the body runs under, once the claim took the run.
    """

    def __init__(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: LeaseConfig,
        hooks: DeliveryHooks,
    ) -> None:
        self.delivery = Delivery(task, args, kwargs, config, hooks)
        self.claim: ClaimResult | None = None
        self.lease: Lease | None = None
        # Celery's retry() publishing this delivery's retry, and what the broker said.
        self._publishing_retry = False
        self._refused_retry: BaseException | None = None
        # What a before_claim hook made of the delivery, when one took it away.
        self._stopped: str | None = None
        # Celery's retry() found its max_retries spent: a failure now ends the run.
        self._retries_spent = False

    @property
    def config(self) -> LeaseConfig:
        """The task's lease settings."""
        return self.delivery.config

    @property
    def direct(self) -> bool:
        """True for a plain function call or an eager ``apply()``: no worker delivery."""
        return self.delivery.direct

    # -- Celery's retry handshake ----------------------------------------------------

    @contextlib.contextmanager
    def publishing_retry(self) -> Iterator[None]:
        """Around Celery's ``retry()`` of this delivery: a refused publish is kept.

        Celery turns a refused retry publish into ``Reject(requeue=False)``, which
        would end the run ``failed``. Inside this block ``LeasedTask.apply_async``
        records the error instead (:meth:`retry_refused`) and Celery raises its
        ``Retry``; the attempt then records the run ``retrying`` with the retry
        message, available at the retry's ETA, and the sweeper sends it.
        """
        self._refused_retry = None
        self._publishing_retry = True
        try:
            yield
        finally:
            self._publishing_retry = False

    @property
    def publishing(self) -> bool:
        """True inside :meth:`publishing_retry`: the publish being made is Celery's retry."""
        return self._publishing_retry

    def retry_refused(self, error: BaseException) -> None:
        """The broker refused the retry being published (see :meth:`publishing_retry`)."""
        self._refused_retry = error

    def retries_spent(self) -> None:
        """Celery's ``retry()`` found ``max_retries`` spent and raised: the body's failure
        ends the run (``failed``), as Celery ends the task, whatever attempts are left."""
        self._retries_spent = True

    def _take_refused_retry(self) -> BaseException | None:
        error, self._refused_retry = self._refused_retry, None
        return error

    # -- claim --------------------------------------------------------------------

    def run(self) -> Any:
        """Claim the run, run the body under its lease, record the outcome; the body's result."""
        token = _current.set(self)
        try:
            return self._run()
        finally:
            _current.reset(token)

    def _run(self) -> Any:
        delivery = self.delivery
        hooks = delivery.hooks
        if not hooks.begin:
            return self._claim_and_run()
        finished = "error"
        try:
            result = self._claim_and_run()
            finished = "succeeded"
            return result
        except Ignore:
            finished = self._outcome("ended")
            raise
        except Retry:
            finished = "retrying"
            raise
        except BaseException:
            finished = self._outcome("failed")
            raise
        finally:
            for hook in hooks.finished:
                with contextlib.suppress(TaskPredicate, LeaseError):
                    _call(hook.finished, delivery, finished)

    def _outcome(self, default: str) -> str:
        """How the delivery ended, for the hooks' ``finished``."""
        if self._stopped is not None:
            return self._stopped
        claim = self.claim
        if claim is None:
            return default
        if claim.outcome != "claimed":
            return "duplicate" if claim.outcome == "finished" else str(claim.outcome)
        lease = self.lease
        if lease is not None and lease.lost:
            return "lost"
        if lease is not None and lease.cancel_requested:
            return "cancelled"
        return default

    def _claim_and_run(self) -> Any:
        delivery = self.delivery
        task, request, run_id = delivery.task, delivery.request, delivery.run_id
        config = delivery.config
        if not self.direct and shutting_down(task.app):
            # A worker that is shutting down claims nothing new: hand the
            # delivery to a worker that stays (a prefetched message, say).
            delivery.events.emit(
                Event.HANDED_ON,
                run_id,
                "run %s: worker shutting down, delivery handed on",
                run_id,
            )
            republish.reschedule(delivery, 0.0, LeaseBusy(run_id, 0.0, "worker shutting down"))
        hooks = delivery.hooks
        try:
            for hook in hooks.before_claim:
                stopped = _call(hook.before_claim, delivery)
                if stopped is not None:
                    self._stopped = stopped
                    raise Ignore()
            started_at = time.monotonic()  # before the claim is sent: the lease's local deadline
            claim = delivery.store.claim(
                run_id,
                delivery.owner,
                task_name=task.name,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                concurrency_key=delivery.concurrency_key,
                max_concurrency=config.max_concurrency,
                task_id=request.id,
                **delivery.stored_message(),
                **delivery.claim_values,
            )
        except (LeaseDatabaseError, LeaseInputError) as exc:
            for hook in hooks.claim_failed:
                _call(hook.claim_failed, delivery, exc)
            # Fail closed: without a lease the body must not run.
            republish.on_claim_error(delivery, exc)
        self.claim = claim
        if claim.outcome != "claimed":
            for hook in hooks.refused:
                _call(hook.refused, delivery, claim)
            if claim.outcome == "finished":
                if request.called_directly:
                    return None  # a plain call of a finished run: nothing to do
                return duplicates.on_finished(delivery, claim)
            if claim.outcome == "stale":
                duplicates.on_stale(delivery, claim)
            republish.on_busy(delivery, claim)
        for hook in hooks.claimed:
            _call(hook.claimed, delivery, claim)
        delivery.events.emit(
            Event.CLAIMED,
            run_id,
            "run %s: claimed attempt %d",
            run_id,
            claim.attempt,
            attempt=claim.attempt,
        )
        self.lease = Lease(
            delivery,
            run_id,
            claim.owner,
            claim.attempt,
            lease_seconds=config.lease_seconds,
            heartbeat_interval=config.heartbeat_interval,
            started_at=started_at,
            interrupt=config.interrupt and not app_runtime(task.app).green_pool,
            max_attempts=claim.max_attempts,
            checkpoint=claim.checkpoint,
            generation=claim.generation,
        )
        return self._run_body(self.lease)

    # -- body -----------------------------------------------------------------------

    def _run_body(self, lease: Lease) -> Any:
        heartbeat = self.delivery.runtime.heartbeat
        heartbeat.register(lease)
        with bind_current(lease):
            try:
                return self._body_and_outcome(lease)
            finally:
                heartbeat.unregister(lease)

    def _body_and_outcome(self, lease: Lease) -> Any:
        try:
            try:
                try:
                    delivery = self.delivery
                    result = lease.run_interruptible(
                        delivery.task.run, *delivery.args, **delivery.kwargs
                    )
                except LeaseInterrupt:
                    error = lease.error()
                    if error is None:  # cannot happen: interrupts follow a recorded cause
                        error = LeaseLost(lease.run_id, lease.owner, lease.attempt, "interrupted")
                    raise error from None
            except BaseException:
                if self._completed_by_body(lease):
                    # fence(complete=True) committed: the run succeeded, whatever came after.
                    lease.events.emit(
                        Event.COMPLETED_THEN_RAISED,
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
        self._complete(lease, self.delivery.kept_result(result))
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
            row = self.delivery.store.get(lease.run_id)
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
            Event.LOST_HANDLED,
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
        republish.reschedule(self.delivery, republish.backoff_delay(config, 1), exc, headers=COPIED)

    def _on_cancelled(self, lease: Lease) -> NoReturn:
        try:
            lease.mark_cancelled()
        except LeaseLost as exc:
            self._on_lost(lease, exc)
        duplicates.mark_revoked(self.delivery)
        raise Ignore()

    def _on_retry(self, lease: Lease, exc: Retry) -> None:
        """The body called ``self.retry()``: the run waits until the retry's ETA.

        Celery has already published the retry; the row records it (``retrying``,
        ``available_at`` = its ETA, the retry as the stored message), so no sweep
        sends the run before then.
        """
        refused = self._take_refused_retry()
        delay = 0.0 if self.delivery.request.is_eager else seconds_until(exc.when)
        cause = exc.exc if isinstance(exc.exc, BaseException) else None
        message = None
        if exc.sig is not None and not self.direct:
            sig = dict(exc.sig)
            retries = (sig.get("options") or {}).get("retries", self.delivery.request.retries + 1)
            message = (*self.delivery.encode(sig), int(retries))
        lease.ending()
        try:
            self.delivery.store.fail(
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
                Event.LOST_HANDLED,
                lease.run_id,
                "%s",
                lost,
                level=logging.WARNING,
                attempt=lease.attempt,
            )
            raise Ignore() from lost
        except LeaseDatabaseError as db_exc:
            lease.events.emit(
                Event.FAIL_ERROR,
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
                    self.delivery.request.id,
                    describe_exception(refused),
                    extra={"lease_event": Event.DELIVERY_LOST},
                )
                raise Reject(requeue=True) from refused
        if refused is not None:
            lease.events.emit(
                Event.PUBLISH_DEFERRED,
                lease.run_id,
                "run %s: the broker refused the retry of %s (%s); kept in the lease "
                "database, the sweeper sends it",
                lease.run_id,
                self.delivery.request.id,
                describe_exception(refused),
                level=logging.WARNING,
            )
        lease.events.emit(
            Event.RETRYING,
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
        max_retries = self.delivery.task.max_retries
        spent = (
            self._retries_spent
            or lease.attempt >= last
            or (max_retries is not None and failures > max_retries)
        )
        # A direct call has nobody to run it again; a usage error would fail the same way
        # on every attempt; lease_retry_errors = False is Celery's own rule.
        usage = isinstance(exc, USAGE_ERRORS)
        if self.direct or usage or not config.retry_errors:
            spent = True
        retry_in = None if spent else republish.backoff_delay(config, failures)
        lease.ending()
        try:
            status = self.delivery.store.fail(
                lease.run_id,
                lease.owner,
                lease.attempt,
                error=describe_exception(exc),
                failure_code=failure_code(exc),
                retry_in=retry_in,
            )
        except LeaseLost as lost:
            self._on_lost(lease, lost)
        except LeaseDatabaseError as db_exc:
            # The failure cannot be recorded; the lease will expire and the run
            # is claimed again then.
            lease.events.emit(
                Event.FAIL_ERROR,
                lease.run_id,
                "run %s attempt %d raised %s; could not record the failure either (%s): "
                "the run runs again once its lease expires (delivery sent again in %.0fs)",
                lease.run_id,
                lease.attempt,
                describe_exception(exc),
                describe_exception(db_exc),
                config.lease_seconds,
                level=logging.WARNING,
                attempt=lease.attempt,
            )
            republish.reschedule(self.delivery, config.lease_seconds, exc, headers=COPIED)
        lease.events.emit(
            Event.FAILED if retry_in is None else Event.RETRYING,
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
        if retry_in is None:
            raise exc
        republish.publish_again(self.delivery, retry_in, headers=COPIED)
        raise Retry(exc=exc, when=retry_in)

    def _release_quietly(self, lease: Lease) -> None:
        lease.ending()
        try:
            self.delivery.store.release(lease.run_id, lease.owner, lease.attempt)
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
        lease.ending()
        try:
            self._write(
                lambda: self.delivery.store.end(
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
            Event.ENDED,
            lease.run_id,
            "run %s: %s (%s)",
            lease.run_id,
            status,
            failure_code,
            attempt=lease.attempt,
            status=status,
        )
