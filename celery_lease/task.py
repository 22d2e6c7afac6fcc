"""``LeasedTask``: the Celery task base class that runs each body under a lease."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import random
import socket
import time
import uuid
from datetime import datetime, timezone
from typing import Any, NoReturn

from celery import Celery, Task, states
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.serialization import raise_with_context
from kombu.serialization import dumps
from sqlalchemy.exc import SQLAlchemyError

from . import dberrors
from .app import install
from .config import SETTING_NAMES, LeaseConfig
from .errors import (
    InvalidLeaseKey,
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
    LeaseLost,
    RunCancelled,
    RunFailed,
)
from .events import emit
from .lease import Lease, LeaseInterrupt, _current, current_lease
from .runtime import Runtime, app_config, app_runtime, runtime_for, shutting_down, worker_id
from .sanitize import describe_exception
from .schema import CANCELLED, FAILED, RUNNING, SUCCEEDED
from .store import ClaimResult

logger = logging.getLogger(__name__)

#: How long a completion may keep retrying a database error, at most.
COMPLETE_RETRY_SECONDS = 5.0
#: How many times a delivery is re-published after a transient database error
#: on its claim before the run ends ``failed`` (``lease_db_unavailable``). With
#: the default backoff (2 s doubling, capped at 600 s, full jitter) that rides
#: out about 13 minutes of outage on average, 27 at most.
CLAIM_DB_RETRIES = 10
#: Message header counting those re-publications (Celery's ``retries`` also
#: counts busy and lease-lost re-publications, which are not failures).
DB_ERRORS_HEADER = "celery_lease_db_errors"

#: The longest run id the ``id`` column holds; longer ids are hashed (see run_id_for).
MAX_RUN_ID_LENGTH = 255

#: How long a refused re-publish is retried before the delivery is left to the sweeper.
PUBLISH_RETRY_SECONDS = 3.0

#: How many times a duplicate of a finished run waits for that run's result to be
#: stored by Celery before it gives up and reports ``None``.
RESULT_WAIT_TRIES = 8


def scoped_run_id(namespace: str, key: Any) -> str:
    """The run id of ``key`` in ``namespace``: ``namespace:key``, hashed when too long.

    Raises:
        InvalidLeaseKey: ``key`` is None, a bool, not a str or int, or empty.
    """
    if key is None or isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidLeaseKey(
            f"lease_key must return a str or an int, got {type(key).__name__} {key!r}"
        )
    if key == "":
        raise InvalidLeaseKey("lease_key returned an empty string")
    return fit_run_id(f"{namespace}:{key}")


def fit_run_id(run_id: str) -> str:
    """``run_id`` itself, or ``prefix:sha256:<hex>`` when it is longer than the column."""
    if len(run_id) <= MAX_RUN_ID_LENGTH:
        return run_id
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()
    return f"{run_id[:100]}:sha256:{digest}"


class _Replaced(Ignore):  # type: ignore[misc]
    """``self.replace()`` handed the run's continuation to the replacement."""


def new_owner(hostname: str | None = None, worker: str | None = None) -> str:
    """A fresh, unguessable owner: ``host:pid:uuid4`` (``host:pid:uuid4.worker-id`` in a worker)."""
    host = hostname or socket.gethostname()
    owner = f"{host[:120]}:{os.getpid()}:{uuid.uuid4().hex}"
    return f"{owner}.{worker}" if worker else owner


def backoff_delay(config: LeaseConfig, attempt: int) -> float:
    """Exponential backoff with full jitter for the ``attempt``-th failure (1-based)."""
    ceiling = min(
        config.retry_backoff_max, config.retry_backoff * 2 ** min(max(attempt - 1, 0), 30)
    )
    return float(random.uniform(0, ceiling))


def busy_delay(config: LeaseConfig, time_left: float, tries: int) -> float:
    """Countdown for a busy duplicate: the lease's time left, growing with each try."""
    grown = max(time_left, 0.05) + config.retry_backoff * (2 ** min(tries, 30) - 1)
    return float(min(config.retry_backoff_max, grown))


class LeasedTask(Task):  # type: ignore[misc]
    """A task whose every run is owned by one worker at a time.

    Use as ``@app.task(base=LeasedTask, bind=True)``. Before the body runs the
    worker claims the run's row; the heartbeat thread renews it; the outcome is
    recorded with a statement guarded by owner and attempt, inside the task
    call, before Celery records anything. Any ``lease_*`` setting can be given
    per task as a task option, e.g. ``@app.task(base=LeasedTask, lease_seconds=60)``.
    """

    #: Lease-driven retries are bounded by ``lease_max_attempts``, not Celery's.
    max_retries = None

    @classmethod
    def bind(cls, app: Celery) -> Any:
        """Bind to ``app`` and :func:`install` celery-lease on it."""
        bound = super().bind(app)
        install(app)
        return bound

    # -- settings -------------------------------------------------------------

    def lease_config(self) -> LeaseConfig:
        """The app's lease settings with this task's ``lease_*`` options applied."""
        configs = app_runtime(self.app).task_configs  # kept per app: reset() drops them
        cached = configs.get(self.name)
        if cached is None or cached[0] is not self:
            overrides: dict[str, Any] = {}
            for name in SETTING_NAMES:
                value = inspect.getattr_static(self, name, None)
                if isinstance(value, staticmethod):
                    value = value.__func__
                if value is not None:
                    overrides[name] = value
            cached = (self, app_config(self.app).with_overrides(overrides))
            configs[self.name] = cached
        return cached[1]

    @property
    def lease(self) -> Lease:
        """The lease this task holds right now (inside the body)."""
        return current_lease()

    def lease_run_id(self, *args: Any, **kwargs: Any) -> str:
        """The run id a keyed task uses for these arguments (``namespace:key``).

        Raises:
            InvalidLeaseKey: the task has no ``lease_key``, or it returned a bad key.
        """
        config = self.lease_config()
        if config.key is None:
            raise InvalidLeaseKey(f"{self.name} has no lease_key: its run id is the task id")
        return scoped_run_id(config.namespace or self.name, config.key(*args, **kwargs))

    def run_id_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The run id of this delivery.

        ``namespace:lease_key(*args, **kwargs)`` when the task sets a key (the
        namespace is the task name unless ``lease_namespace`` names a shared
        one), else the task id. A replacement made by ``self.replace()`` inherits
        the task id but is a new run: its id gains ``~replaced-N``.
        """
        return self.run_id_of(self.request, args, kwargs)

    def run_id_of(
        self,
        request: Any,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The run id of the delivery ``request`` (a Celery request context)."""
        if self.lease_config().key is not None:
            if args is None:
                args = tuple(request.args or ())
            if kwargs is None:
                kwargs = dict(request.kwargs or {})
            run_id = self.lease_run_id(*args, **kwargs)
        else:
            task_id = request.id
            run_id = str(task_id) if task_id else uuid.uuid4().hex
        nesting = getattr(request, "replaced_task_nesting", 0) or 0
        if nesting:
            run_id = f"{run_id}~replaced-{nesting}"
        return fit_run_id(run_id)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; a bad ``lease_key`` value is refused here, at call time.

        Raises:
            InvalidLeaseKey: the key function returned None, a non-str/int or "".
        """
        config = self.lease_config()
        if config.key is not None and args is not None:
            try:
                key = config.key(*(args or ()), **(kwargs or {}))
            except TypeError:
                key = ""  # partial arguments (a chain step): checked in the worker
            else:
                scoped_run_id(config.namespace or self.name, key)
        return super().apply_async(
            args,
            kwargs,
            task_id=task_id,
            producer=producer,
            link=link,
            link_error=link_error,
            shadow=shadow,
            **options,
        )

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``retry``, with the lease's attempts as a second bound.

        When this claim was the run's last attempt (``lease_max_attempts``), it
        behaves as Celery does when ``max_retries`` is exceeded: ``exc`` (or
        ``MaxRetriesExceededError``) is raised, so the run ends ``failed`` and
        Celery's state ``FAILURE`` with the real error.
        """
        lease = _current.get()
        if lease is not None and lease.attempt >= _ceiling(self.lease_config(), lease):
            if exc is not None:
                raise_with_context(exc)
            raise self.MaxRetriesExceededError(
                f"Can't retry {self.name}[{self.request.id}]: lease attempts spent "
                f"({lease.attempt} of {_ceiling(self.lease_config(), lease)})"
            )
        # Celery publishes the retry here: no interrupt may land inside kombu.
        with lease.uninterruptible() if lease is not None else contextlib.nullcontext():
            return super().retry(
                args,
                kwargs,
                exc=exc,
                throw=throw,
                eta=eta,
                countdown=countdown,
                max_retries=max_retries,
                **options,
            )

    def on_replace(self, sig: Any) -> Any:
        """Publish the replacement, then end this run: the replacement owns the rest."""
        lease = _current.get()
        if self.request.is_eager or lease is None:
            return super().on_replace(sig)
        with lease.uninterruptible():  # no interrupt inside kombu's publish
            sig.delay()
        raise _Replaced("Replaced by new task")

    # -- the call ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:
            # A plain function call: no worker request exists, so push one the
            # way Task.__call__ does and run leased, raising instead of retrying.
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._run_leased(args, kwargs)
            finally:
                self.pop_request()
        return self._run_leased(args, kwargs)

    def _run_leased(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config = self.lease_config()
        run_id = self.run_id_for(args, kwargs)
        if not self._direct() and shutting_down(self.app):
            # A worker that is shutting down claims nothing new: hand the
            # delivery to a worker that stays (a prefetched message, say).
            emit(
                "handed_on",
                run_id,
                "run %s: worker shutting down, delivery handed on",
                run_id,
            )
            self._reschedule(0.0, LeaseBusy(run_id, 0.0, "worker shutting down"))
        try:
            runtime = runtime_for(self.app, config)
            started_at = time.monotonic()  # before the claim is sent: the lease's local deadline
            claim = runtime.store.claim(
                run_id,
                new_owner(self.request.hostname, worker_id(self.app)),
                task_name=self.name,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                concurrency_key=self._concurrency_key(config, args, kwargs),
                max_concurrency=config.max_concurrency,
                task_id=self.request.id,
                **self._payload(args, kwargs),
            )
        except (LeaseDatabaseError, LeaseInputError) as exc:
            # Fail closed: without a lease the body must not run.
            self._on_claim_error(config, run_id, exc)
        except SQLAlchemyError as exc:  # the engine itself could not be made
            self._on_claim_error(config, run_id, dberrors.wrap(exc, ""))
        if claim.outcome == "finished":
            if self.request.called_directly:
                return None  # a plain call of a finished run: nothing to do
            return self._on_finished(config, runtime, claim)
        if claim.outcome == "busy":
            self._on_busy(config, claim)
        emit(
            "claimed",
            run_id,
            "run %s: claimed attempt %d",
            run_id,
            claim.attempt,
            attempt=claim.attempt,
        )
        lease = Lease(
            runtime.store,
            run_id,
            claim.owner,
            claim.attempt,
            lease_seconds=config.lease_seconds,
            heartbeat_interval=config.heartbeat_interval,
            started_at=started_at,
            interrupt=config.interrupt and not app_runtime(self.app).green_pool,
            max_attempts=claim.max_attempts,
        )
        return self._run_body(config, runtime, lease, args, kwargs)

    def _run_body(
        self,
        config: LeaseConfig,
        runtime: Runtime,
        lease: Lease,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        runtime.heartbeat.register(lease)
        token = _current.set(lease)
        try:
            try:
                try:
                    result = lease.run_interruptible(self.run, *args, **kwargs)
                except LeaseInterrupt:
                    error = lease.error()
                    if error is None:  # cannot happen: interrupts follow a recorded cause
                        error = LeaseLost(lease.run_id, lease.owner, lease.attempt, "interrupted")
                    raise error from None
            except BaseException:
                if self._completed_by_body(runtime, lease):
                    # fence(complete=True) committed: the run succeeded, whatever came after.
                    emit(
                        "completed_then_raised",
                        lease.run_id,
                        "run %s: succeeded (recorded by the body; it raised afterwards)",
                        lease.run_id,
                        attempt=lease.attempt,
                    )
                    return None
                raise
        except Retry as exc:
            self._on_retry(config, runtime, lease, exc)
            raise
        except _Replaced:
            self._end_quietly(runtime, lease, SUCCEEDED, "replaced")
            raise
        except Reject as exc:
            if exc.requeue:
                # The broker delivers it again: that delivery claims the run.
                self._release_quietly(runtime, lease)
            else:
                self._end_quietly(runtime, lease, FAILED, "rejected", exc)
            raise
        except Ignore as exc:
            self._end_quietly(runtime, lease, CANCELLED, "ignored", exc)
            raise
        except LeaseLost as exc:
            self._on_lost(config, lease, exc)
        except RunCancelled:
            self._on_cancelled(config, runtime, lease)
        except Exception as exc:
            self._on_failure(config, runtime, lease, exc)
        else:
            self._complete(config, runtime, lease)
            return result
        finally:
            runtime.heartbeat.unregister(lease)
            _current.reset(token)

    # -- outcomes -------------------------------------------------------------

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
        emit(
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

    def _on_busy(self, config: LeaseConfig, claim: ClaimResult) -> NoReturn:
        reason = {
            "concurrency": "concurrency limit reached",
            "backoff": "waiting for its retry backoff",
        }.get(claim.reason, "held by another worker")
        busy = LeaseBusy(claim.run_id, claim.retry_in, reason)
        if claim.reason == "concurrency":
            # A slot frees when any holder finishes, usually well before its
            # lease would expire: poll with jittered backoff, capped by that.
            delay = min(claim.retry_in, backoff_delay(config, self.request.retries + 1))
            delay = max(delay, 0.05)
        else:
            delay = busy_delay(config, claim.retry_in, self.request.retries)
        # A retry that arrived before its backoff ended is this run's own next
        # attempt, not a duplicate: it always waits, whatever the busy policy.
        policy = "retry" if claim.reason == "backoff" else config.busy_policy
        emit(
            "busy",
            claim.run_id,
            "%s: %s",
            busy,
            f"retrying in {delay:.2f}s" if policy == "retry" else policy,
            retry_in=delay,
            policy=policy,
        )
        if policy == "fail":
            raise busy
        if policy == "skip":
            raise Ignore()
        self._reschedule(delay, busy)

    def _on_claim_error(
        self, config: LeaseConfig, run_id: str, exc: LeaseDatabaseError | LeaseInputError
    ) -> NoReturn:
        """A claim the database (or a check before it) refused; the body never runs.

        Transient errors re-publish the delivery with backoff, at most
        ``CLAIM_DB_RETRIES`` times (counted in the ``DB_ERRORS_HEADER`` header).
        Permanent errors, and transient ones once spent, end the run ``failed``
        with the error's ``failure_code`` where a row can be written, and fail
        this delivery with the error either way. A run another worker holds
        alive is left to it: this delivery is dropped like a busy duplicate.
        """
        request = self.request
        spent = self._db_errors_spent()
        transient = isinstance(exc, LeaseDatabaseError) and exc.transient
        local = request.called_directly or request.is_eager
        if transient and local:
            raise exc  # a plain call: the caller decides; the row is not touched
        if transient and spent < CLAIM_DB_RETRIES:
            delay = backoff_delay(config, spent + 1)
            emit(
                "claim_error",
                run_id,
                "run %s: lease database unavailable (try %d of %d), retrying in %.1fs: %s",
                run_id,
                spent + 1,
                CLAIM_DB_RETRIES,
                delay,
                describe_exception(exc),
                level=logging.WARNING,
            )
            headers = {**(request.headers or {}), DB_ERRORS_HEADER: spent + 1}
            self._reschedule(delay, exc, headers=headers)
        status: str | None = None
        if not isinstance(exc, LeaseInputError) or exc.field != "run_id":
            try:
                status = runtime_for(self.app, config).store.end_unclaimed(
                    run_id,
                    task_name=self.name,
                    max_attempts=config.max_attempts,
                    failure_code=exc.failure_code,
                    error=describe_exception(exc),
                )
            except (LeaseError, SQLAlchemyError) as end_exc:
                emit(
                    "fail_error",
                    run_id,
                    "run %s: could not record failure: %s",
                    run_id,
                    describe_exception(end_exc),
                    level=logging.WARNING,
                )
        emit(
            "claim_failed",
            run_id,
            "run %s: claim failed for good (%s), run is %s: %s",
            run_id,
            exc.failure_code,
            status or "unrecorded",
            describe_exception(exc),
            level=logging.ERROR,
            failure_code=exc.failure_code,
        )
        if status == RUNNING and not local:
            raise Ignore()  # held alive by another worker, which owns the result
        raise exc

    def _db_errors_spent(self) -> int:
        """Transient claim errors this delivery's lineage has retried so far."""
        request = self.request
        value: Any = (request.headers or {}).get(DB_ERRORS_HEADER)
        if value is None:
            value = getattr(request, DB_ERRORS_HEADER, 0)
        try:
            return max(0, int(value))
        except (TypeError, ValueError):
            return 0

    def _on_finished(self, config: LeaseConfig, runtime: Runtime, claim: ClaimResult) -> Any:
        """A delivery of a run that already ended: the body does not run again.

        Under the run's own task id nothing is written (Celery already has the
        outcome), except a ``FAILURE`` a dangling ``RETRY`` still hides. Under
        another task id (a keyed duplicate, a group or chain member) the caller
        gets the run's outcome as this task's own: its result, its failure, or
        ``REVOKED``, and its continuation proceeds with it.
        """
        own_id = self.request.id
        same = claim.task_id is None or own_id is None or own_id == claim.task_id
        emit(
            "duplicate_dropped",
            claim.run_id,
            "run %s is already %s: delivery dropped%s",
            claim.run_id,
            claim.status,
            "" if same else f" (its outcome is reported under {own_id})",
            status=claim.status,
        )
        if claim.status == CANCELLED:
            self._mark_revoked(claim.run_id)
            raise Ignore()
        if claim.status == SUCCEEDED:
            if same:
                raise Ignore()
            return self._result_of(config, runtime, claim)
        if same and self._celery_state(own_id) == states.FAILURE:
            raise Ignore()
        raise self._failure_of(runtime, claim)

    def _result_of(self, config: LeaseConfig, runtime: Runtime, claim: ClaimResult) -> Any:
        """The stored result of the run's own task id; waits (re-published) until Celery has it."""
        meta = self._celery_meta(claim.task_id)
        if meta is not None and meta.get("status") == states.SUCCESS:
            return meta.get("result")
        if (
            meta is not None
            and self.request.retries < RESULT_WAIT_TRIES
            and self._finished_recently(runtime, claim.run_id, config.lease_seconds)
        ):
            # Succeeded in the lease table, not yet stored by Celery (or fenced
            # inside a body that is still running): ask again shortly.
            self._reschedule(busy_delay(config, 0.2, self.request.retries), Ignore())
        logger.warning(
            "celery-lease: run %s succeeded but its result (task %s) is not in the result "
            "backend: reporting None",
            claim.run_id,
            claim.task_id,
        )
        return None

    @staticmethod
    def _finished_recently(runtime: Runtime, run_id: str, window: float) -> bool:
        """True when the run ended less than ``window`` s ago (its result may still come)."""
        try:
            row = runtime.store.get(run_id)
            now = runtime.store.now_ms()
        except LeaseDatabaseError:
            return True
        finished = None if row is None else (row.finished_at or row.updated_at)
        return finished is not None and now - finished < window * 1000

    def _failure_of(self, runtime: Runtime, claim: ClaimResult) -> BaseException:
        """The exception a failed run ended with: Celery's stored one, else :class:`RunFailed`."""
        meta = self._celery_meta(claim.task_id) if claim.task_id else None
        if meta is not None and meta.get("status") == states.FAILURE:
            try:
                error = self.backend.exception_to_python(meta.get("result"))
            except Exception:
                error = None
            if isinstance(error, BaseException):
                return error
        try:
            row = runtime.store.get(claim.run_id)
        except LeaseDatabaseError:
            row = None
        return RunFailed(
            claim.run_id,
            row.failure_code if row is not None else None,
            row.last_error if row is not None else None,
        )

    def _celery_meta(self, task_id: str | None) -> dict[str, Any] | None:
        """Celery's stored state of ``task_id``, or None without a readable result backend."""
        if not task_id or self.ignore_result:
            return None
        try:
            meta: dict[str, Any] = self.backend.get_task_meta(task_id)
        except Exception:  # no result backend (DisabledBackend), or it is down
            return None
        return meta

    def _celery_state(self, task_id: str | None) -> str | None:
        meta = self._celery_meta(task_id)
        return None if meta is None else str(meta.get("status"))

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
            emit(
                "lost_handled",
                lease.run_id,
                "%s",
                lost,
                level=logging.WARNING,
                attempt=lease.attempt,
            )
            raise Ignore() from lost
        except LeaseDatabaseError as db_exc:
            emit(
                "fail_error",
                lease.run_id,
                "run %s: could not record the retry: %s",
                lease.run_id,
                describe_exception(db_exc),
                level=logging.WARNING,
            )
        emit(
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
            emit(
                "fail_error",
                lease.run_id,
                "run %s: could not record failure: %s",
                lease.run_id,
                describe_exception(db_exc),
                level=logging.WARNING,
            )
            self._reschedule(config.lease_seconds, exc)
        emit(
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

    # -- helpers --------------------------------------------------------------

    def _direct(self) -> bool:
        """True for a plain function call or an eager ``apply()``: no worker delivery."""
        return bool(self.request.called_directly or self.request.is_eager)

    def _reschedule(self, countdown: float, cause: BaseException, **options: Any) -> NoReturn:
        """Publish this delivery again after ``countdown`` s and drop this one silently.

        Dropping with ``Ignore`` writes nothing to the result backend, which a
        duplicate shares with the run it duplicates. A delivery the broker
        refuses is kept for the sweeper (see :meth:`_publish_again`); only when
        the lease database refuses it too is it rejected with ``requeue=True``,
        which brings it back only under ``acks_late``.
        """
        if self._direct():
            raise cause
        try:
            self._publish_again(countdown, **options)
        except Exception as exc:
            logger.error(
                "celery-lease: could not re-publish %s (%s) nor keep it for the sweeper: "
                "asking the broker to requeue; without acks_late this delivery may be lost",
                self.request.id,
                describe_exception(exc),
                extra={"lease_event": "delivery_lost"},
            )
            raise Reject(requeue=True) from exc
        raise Ignore()

    def _publish_again(self, countdown: float, **options: Any) -> None:
        """Send this delivery again after ``countdown`` s, or leave it to the sweeper.

        A refused publish is retried with backoff for up to
        ``PUBLISH_RETRY_SECONDS`` (kombu retries each one briefly as well). Then
        the delivery is recorded in the lease database
        (:meth:`~celery_lease.store.LeaseStore.keep_delivery`), and the sweeper
        sends it once the broker is back.

        Raises:
            Exception: the last publish error, when the delivery could not be kept.
        """
        request = self.request
        countdown = native_delay_countdown(self.app, max(0.0, countdown))
        signature = self.signature_from_request(
            request,
            request.args,
            request.kwargs,
            countdown=countdown,
            retries=request.retries + 1,
            **options,
        )
        deadline = time.monotonic() + PUBLISH_RETRY_SECONDS
        delay = 0.25
        while True:
            try:
                signature.clone().apply_async()
                return
            except Exception as exc:
                if time.monotonic() + delay >= deadline:
                    if self._keep_for_sweeper(signature, countdown, exc):
                        return
                    raise
                time.sleep(delay)
                delay *= 2

    def _keep_for_sweeper(self, signature: Any, countdown: float, error: Exception) -> bool:
        """Record the unsent ``signature`` for the sweeper; True when a sweep will send it."""
        request = self.request
        args, kwargs = tuple(request.args or ()), dict(request.kwargs or {})
        run_id = None
        try:
            config = self.lease_config()
            run_id = self.run_id_for(args, kwargs)
            data, content_type = self._encode(dict(signature))
            kept = runtime_for(self.app, config).store.keep_delivery(
                run_id,
                task_name=self.name,
                task_id=str(request.id),
                payload=data,
                payload_content_type=content_type,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                available_in=countdown,
                concurrency_key=self._concurrency_key(config, args, kwargs),
            )
        except Exception as exc:
            emit(
                "keep_error",
                run_id,
                "delivery %s: could not keep it for the sweeper either: %s",
                request.id,
                describe_exception(exc),
                level=logging.WARNING,
            )
            return False
        if kept:
            emit(
                "publish_deferred",
                run_id,
                "run %s: the broker refused the re-publish of %s (%s); kept in the lease "
                "database, the sweeper sends it",
                run_id,
                request.id,
                describe_exception(error),
                level=logging.WARNING,
            )
        return kept

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
        except (LeaseError, SQLAlchemyError) as exc:
            logger.warning(
                "celery-lease: could not end run %s as %s: %s",
                lease.run_id,
                failure_code,
                describe_exception(exc),
            )
            return
        emit(
            "ended",
            lease.run_id,
            "run %s: %s (%s)",
            lease.run_id,
            status,
            failure_code,
            attempt=lease.attempt,
            status=status,
        )

    def _mark_revoked(self, run_id: str) -> None:
        task_id = self.request.id
        if not task_id or self.request.called_directly or self.ignore_result:
            return
        try:
            self.backend.mark_as_revoked(task_id, "cancelled", request=self.request)
        except Exception as exc:
            logger.warning(
                "celery-lease: could not mark %s revoked: %s", task_id, describe_exception(exc)
            )

    def _concurrency_key(
        self, config: LeaseConfig, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        if config.concurrency_key is not None:
            key: Any = config.concurrency_key(*args, **kwargs)
            return None if key is None else str(key)
        if config.max_concurrency is not None:
            return str(self.name)
        return None

    def _payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The delivery's message as Celery would re-send it, for the sweeper.

        What ``signature_from_request`` keeps: task id, chain, chord, group,
        links, parent/root ids, headers, retries, routing, expiry, time limits.
        A plain call or an eager ``apply()`` stores none: no sweep may send it
        to workers.
        """
        if self._direct():
            return {"payload": None, "payload_content_type": None}
        request = self.request
        signature = self.signature_from_request(request, args, kwargs)
        data, content_type = self._encode(dict(signature))
        return {"payload": data, "payload_content_type": content_type}

    def _encode(self, message: dict[str, Any]) -> tuple[bytes, str]:
        """``message`` serialized with the task's serializer: ``(bytes, content type)``."""
        content_type, _encoding, data = dumps(  # type: ignore[no-untyped-call]
            message, serializer=self.serializer or "json"
        )
        if isinstance(data, str):
            data = data.encode("utf-8")
        return data, content_type


def _ceiling(config: LeaseConfig, lease: Lease) -> int:
    """The attempt at which ``lease``'s run is out of attempts (raised by ``lease rerun``)."""
    return max(config.max_attempts, lease.max_attempts)


def native_delay_countdown(app: Celery, countdown: float) -> float:
    """``countdown``, rounded up to 1 s where Celery would refuse it as under a second.

    With RabbitMQ quorum queues, Celery (5.5 and later) sends countdowns through its
    native delayed delivery, which counts whole seconds: a countdown between 0 and 1 s
    raises ``ValueError`` at publish (on a topic or fanout exchange). Other brokers and
    queues keep the exact countdown.
    """
    if not 0.0 < countdown < 1.0:
        return countdown
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # Celery before 5.5: no native delayed delivery
        return countdown
    driver = app.connection_for_write().transport.driver_type
    return 1.0 if detect_quorum_queues(app, driver)[0] else countdown


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
