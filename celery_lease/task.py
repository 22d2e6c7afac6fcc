"""``LeasedTask``: the Celery task base class that runs each body under a lease."""

from __future__ import annotations

import inspect
import logging
import os
import random
import socket
import time
import uuid
from typing import Any, NoReturn

from celery import Celery, Task
from celery.exceptions import Ignore, Reject, Retry
from kombu.serialization import dumps
from sqlalchemy.exc import SQLAlchemyError

from .app import Runtime, install, runtime_for
from .config import SETTING_NAMES, LeaseConfig
from .errors import LeaseBusy, LeaseError, LeaseLost, RunCancelled
from .events import emit
from .lease import Lease, LeaseInterrupt, _current, current_lease
from .sanitize import describe_exception
from .store import ClaimResult

logger = logging.getLogger(__name__)

#: How long a completion may keep retrying a database error, at most.
COMPLETE_RETRY_SECONDS = 5.0


def new_owner(hostname: str | None = None) -> str:
    """A fresh, unguessable owner string: ``host:pid:uuid4``."""
    host = hostname or socket.gethostname()
    return f"{host[:120]}:{os.getpid()}:{uuid.uuid4().hex}"


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
        cached: LeaseConfig | None = self.__dict__.get("_lease_config")
        if cached is None:
            overrides: dict[str, Any] = {}
            for name in SETTING_NAMES:
                value = inspect.getattr_static(self, name, None)
                if isinstance(value, staticmethod):
                    value = value.__func__
                if value is not None:
                    overrides[name] = value
            cached = LeaseConfig.from_app(self.app).with_overrides(overrides)
            self.__dict__["_lease_config"] = cached
        return cached

    @property
    def lease(self) -> Lease:
        """The lease this task holds right now (inside the body)."""
        return current_lease()

    def run_id_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The run id: ``lease_key(*args, **kwargs)`` if set, else the task id."""
        key = self.lease_config().key
        if key is not None:
            return str(key(*args, **kwargs))
        task_id = self.request.id
        return str(task_id) if task_id else uuid.uuid4().hex

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
        try:
            runtime = runtime_for(self.app, config)
            started_at = time.monotonic()  # before the claim is sent: the lease's local deadline
            claim = runtime.store.claim(
                run_id,
                new_owner(self.request.hostname),
                task_name=self.name,
                lease_ms=config.lease_ms,
                max_attempts=config.max_attempts,
                concurrency_key=self._concurrency_key(config, args, kwargs),
                max_concurrency=config.max_concurrency,
                **self._payload(args, kwargs),
            )
        except SQLAlchemyError as exc:
            # Fail closed: without a lease the body must not run.
            delay = backoff_delay(config, self.request.retries + 1)
            emit(
                "claim_error",
                run_id,
                "run %s: lease database unreachable, retrying in %.1fs: %s",
                run_id,
                delay,
                describe_exception(exc),
                level=logging.WARNING,
            )
            self._reschedule(delay, exc)
        if claim.outcome == "finished":
            if self.request.called_directly:
                return None  # a plain call of a finished run: nothing to do
            self._drop_finished(claim)
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
            interrupt=config.interrupt and not self.app.__dict__.get("_celery_lease_green_pool"),
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
                result = lease.run_interruptible(self.run, *args, **kwargs)
            except LeaseInterrupt:
                error = lease.error()
                if error is None:  # cannot happen: interrupts follow a recorded cause
                    error = LeaseLost(lease.run_id, lease.owner, lease.attempt, "interrupted")
                raise error from None
        except Retry:
            # The body asked Celery to retry: hand the run back so that retry can claim it.
            self._release_quietly(runtime, lease)
            raise
        except (Ignore, Reject):
            self._release_quietly(runtime, lease)
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
            except SQLAlchemyError as exc:
                if time.monotonic() + delay >= deadline:
                    lost = LeaseLost(
                        lease.run_id,
                        lease.owner,
                        lease.attempt,
                        f"complete failed, database unreachable: {describe_exception(exc, 300)}",
                    )
                    self._on_lost(config, lease, lost)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

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

    def _drop_finished(self, claim: ClaimResult) -> NoReturn:
        emit(
            "duplicate_dropped",
            claim.run_id,
            "run %s is already %s: delivery dropped",
            claim.run_id,
            claim.status,
            status=claim.status,
        )
        if claim.status == "cancelled":
            self._mark_revoked(claim.run_id)
        raise Ignore()

    def _on_cancelled(self, config: LeaseConfig, runtime: Runtime, lease: Lease) -> NoReturn:
        try:
            lease.mark_cancelled()
        except LeaseLost as exc:
            self._on_lost(config, lease, exc)
        self._mark_revoked(lease.run_id)
        raise Ignore()

    def _on_failure(
        self, config: LeaseConfig, runtime: Runtime, lease: Lease, exc: Exception
    ) -> NoReturn:
        retry_in = (
            None if lease.attempt >= config.max_attempts else backoff_delay(config, lease.attempt)
        )
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
        except SQLAlchemyError as db_exc:
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
            config.max_attempts,
            type(exc).__name__,
            status,
            level=logging.WARNING,
            attempt=lease.attempt,
        )
        if retry_in is None or self.request.called_directly or self.request.is_eager:
            raise exc
        self._publish_again(retry_in)
        raise Retry(exc=exc, when=retry_in)

    # -- helpers --------------------------------------------------------------

    def _reschedule(self, countdown: float, cause: BaseException) -> NoReturn:
        """Publish this delivery again after ``countdown`` s and drop this one silently.

        Dropping with ``Ignore`` writes nothing to the result backend, which a
        duplicate shares with the run it duplicates.
        """
        if self.request.called_directly or self.request.is_eager:
            raise cause
        try:
            self._publish_again(countdown)
        except Exception as exc:
            logger.error(
                "celery-lease: could not re-publish %s (%s): asking the broker to requeue",
                self.request.id,
                describe_exception(exc),
            )
            raise Reject(requeue=True) from exc
        raise Ignore()

    def _publish_again(self, countdown: float) -> None:
        request = self.request
        self.signature_from_request(
            request,
            request.args,
            request.kwargs,
            countdown=max(0.0, countdown),
            retries=request.retries + 1,
        ).apply_async()

    def _release_quietly(self, runtime: Runtime, lease: Lease) -> None:
        try:
            runtime.store.release(lease.run_id, lease.owner, lease.attempt)
        except (LeaseError, SQLAlchemyError) as exc:
            logger.info("celery-lease: release of %s skipped: %s", lease.run_id, exc)

    def _mark_revoked(self, run_id: str) -> None:
        task_id = self.request.id
        if not task_id or self.request.called_directly or self.ignore_result:
            return
        try:
            self.backend.mark_as_revoked(task_id, "cancelled", request=self.request)
        except Exception as exc:
            logger.warning("celery-lease: could not mark %s revoked: %s", task_id, exc)

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
        """The arguments serialized with the task's serializer, for re-enqueueing."""
        request = self.request
        options = {
            key: value
            for key, value in (request.delivery_info or {}).items()
            if key in ("exchange", "routing_key", "priority") and value is not None
        }
        body = {"args": list(args), "kwargs": kwargs, "options": options}
        content_type, _encoding, data = dumps(  # type: ignore[no-untyped-call]
            body, serializer=self.serializer or "json"
        )
        if isinstance(data, str):
            data = data.encode("utf-8")
        return {"payload": data, "payload_content_type": content_type}
