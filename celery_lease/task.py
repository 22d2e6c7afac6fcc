"""``LeasedTask``: the Celery task base class that runs each body under a lease.

``LeasedTask`` is a stack of layers, each one concern, so this class stays the
call flow: :class:`~celery_lease.runids.TaskSettings` (settings, run ids, the
stored message) < :class:`~celery_lease.republish.Republishing` (busy, claim
errors, re-publish, the sweeper's copy) <
:class:`~celery_lease.duplicates.DuplicateOutcomes` (a finished run's outcome) <
:class:`~celery_lease.outcomes.RunOutcomes` (recording a body's end) < ``LeasedTask``.

Celery internals we rely on, and why (none of them has a public equivalent):

- ``request.replaced_task_nesting``: tells a replacement made by ``self.replace()``
  from the run it replaces (it keeps the task id); see ``TaskSettings.run_id_of``.
- ``Task.signature_from_request``: rebuilds the delivery's message as Celery
  re-sends it (retry), for the re-publish and the sweeper's stored copy.
- ``celery.utils.quorum_queues.detect_quorum_queues`` (Celery 5.5+): whether a
  sub-second countdown would be refused by native delayed delivery.
- ``celery.utils.serialization.raise_with_context``: raise ``exc`` as Celery's own
  ``retry`` does once retries are spent.
- ``Task.on_replace``: overridden (a documented hook) so the
  replacement is published outside any interrupt.

Elsewhere: :mod:`celery_lease.contrib.fs_transport` overrides kombu's private
``filesystem.Channel._put`` (an atomic publish; kombu has no hook for it), and
the worker bootstep reads the pool class's ``is_green`` and ``app.tasks`` only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.serialization import raise_with_context

from .app import install
from .config import LeaseConfig
from .duplicates import RESULT_WAIT_TRIES, DuplicateOutcomes
from .errors import (
    LeaseBusy,
    LeaseDatabaseError,
    LeaseInputError,
    LeaseLost,
    RunCancelled,
)
from .lease.interrupt import LeaseInterrupt
from .lease.lease import Lease, _current, current_lease
from .outcomes import COMPLETE_RETRY_SECONDS, RunOutcomes, _ceiling, _Replaced, _seconds_until
from .owner import Owner, new_owner
from .republish import (
    CLAIM_DB_RETRIES,
    DB_ERRORS_HEADER,
    PUBLISH_RETRY_SECONDS,
    Republishing,
    backoff_delay,
    busy_delay,
    native_delay_countdown,
)
from .runids import MAX_RUN_ID_LENGTH, TaskSettings, fit_run_id, scoped_run_id
from .runtime import Runtime, app_runtime, runtime_for, shutting_down, worker_id
from .schema import CANCELLED, FAILED, SUCCEEDED

logger = logging.getLogger(__name__)


class LeasedTask(RunOutcomes):
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
    def on_bound(cls, app: Celery) -> None:
        """Celery's hook once this task class is bound to ``app``: :func:`install` celery-lease."""
        super().on_bound(app)
        install(app)

    @property
    def lease(self) -> Lease:
        """The lease this task holds right now (inside the body)."""
        return current_lease()

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
            self._events.emit(
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
        if claim.outcome == "finished":
            if self.request.called_directly:
                return None  # a plain call of a finished run: nothing to do
            return self._on_finished(config, runtime, claim)
        if claim.outcome == "busy":
            self._on_busy(config, claim)
        runtime.events.emit(
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
            events=runtime.events,
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


__all__ = [
    "CLAIM_DB_RETRIES",
    "COMPLETE_RETRY_SECONDS",
    "DB_ERRORS_HEADER",
    "MAX_RUN_ID_LENGTH",
    "PUBLISH_RETRY_SECONDS",
    "RESULT_WAIT_TRIES",
    "DuplicateOutcomes",
    "LeasedTask",
    "Owner",
    "Republishing",
    "RunOutcomes",
    "TaskSettings",
    "_Replaced",
    "_ceiling",
    "_seconds_until",
    "backoff_delay",
    "busy_delay",
    "fit_run_id",
    "native_delay_countdown",
    "new_owner",
    "scoped_run_id",
]
