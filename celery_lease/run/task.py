"""``LeasedTask``: the Celery task base class that runs each body under a lease.

The class keeps Celery's hooks (``on_bound``, ``apply_async``, ``retry``,
``on_replace``, ``__call__``) and the public lease API only. Each delivery is
run by its own :class:`~celery_lease.run.attempt.Attempt` (claim -> body ->
outcome); nothing per run lives on the task.

Celery internals we rely on, and why (none of them has a public equivalent):

- ``request.replaced_task_nesting``: tells a replacement made by ``self.replace()``
  from the run it replaces (it keeps the task id); see
  :func:`~celery_lease.run.runids.run_id_of`.
- ``Task.signature_from_request``: rebuilds the delivery's message as Celery
  re-sends it (retry), for the re-publish and the sweeper's stored copy.
- ``celery.utils.quorum_queues.detect_quorum_queues`` (Celery 5.5+): whether a
  sub-second countdown would be refused by native delayed delivery.
- ``celery.utils.serialization.raise_with_context``: raise ``exc`` as Celery's own
  ``retry`` does once retries are spent.
- ``Task.retry`` publishes its retry through the task's own ``apply_async`` (its
  signature's ``type``), and turns a refused publish into ``Reject(requeue=False)``:
  ``apply_async`` records the refusal instead while ``retry`` runs.
- ``Task.on_replace``: overridden (a documented hook) so the
  replacement is published outside any interrupt.

Elsewhere: :mod:`celery_lease.contrib.fs_transport` overrides kombu's private
``filesystem.Channel._put`` (an atomic publish; kombu has no hook for it), and
the worker bootstep reads the pool class's ``is_green`` and ``app.tasks`` only.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from celery import Celery, Task
from celery.exceptions import ImproperlyConfigured, Reject, Retry
from celery.utils.serialization import raise_with_context
from kombu.exceptions import OperationalError

from ..app import install
from ..config import SETTING_NAMES, LeaseConfig
from ..errors import InvalidLeaseKey
from ..hooks import Hooks, RunHook
from ..lease.lease import Lease, current_lease
from ..runtime import app_config, app_runtime
from .attempt import Attempt, Replaced, ceiling, current_attempt
from .delivery import Delivery, DeliveryHooks
from .pausing import PausedWork
from .ratelimit import RateLimit
from .runids import key_value, scoped_run_id, takes

#: The run path's own features, after the app's (tracing first: its claim span
#: begins before a rate slot is taken). The rate limit's refusal hook (its slot given
#: back) runs before the pause's, which ends the delivery.
RUN_FEATURES: tuple[RunHook[Delivery], ...] = (RateLimit(), PausedWork())


def task_hooks(task: Any, config: LeaseConfig) -> DeliveryHooks:
    """The run hooks of ``task`` with settings ``config``: the app's features and the run
    path's own, each asked whether the task uses it; kept per app and task."""
    state = app_runtime(task.app)
    cached = state.task_hooks.get(task.name)
    if cached is not None and cached[0] is config:
        found: DeliveryHooks = cached[1]
        return found
    hooks: DeliveryHooks = Hooks.for_task((*state.features, *RUN_FEATURES), task.name, config)
    state.task_hooks[task.name] = (config, hooks)
    return hooks


class LeasedTask(Task):  # type: ignore[misc]
    """A task whose every run is owned by one worker at a time.

    Use as ``@app.task(base=LeasedTask, bind=True)``. Before the body runs the
    worker claims the run's row; the heartbeat thread renews it; the outcome is
    recorded with a statement guarded by owner and attempt, inside the task
    call, before Celery records anything. Any ``lease_*`` setting can be given
    per task as a task option, e.g. ``@app.task(base=LeasedTask, lease_seconds=60)``.

    Beyond :class:`celery.Task`, the class adds exactly ``lease``,
    ``lease_config()`` and ``lease_run_id()`` (and the ``lease_*`` options a
    task sets), and no private name: a task may define any ``_name`` of its own.
    Each delivery runs in a :class:`~celery_lease.run.attempt.Attempt`.
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
            base = app_config(self.app)
            try:
                config = base.with_overrides(overrides)
            except ImproperlyConfigured as exc:  # a task option's value
                raise ImproperlyConfigured(f"task {self.name}: {exc}") from None
            cached = (self, config)
            configs[self.name] = cached
        return cached[1]

    def lease_run_id(self, *args: Any, **kwargs: Any) -> str:
        """The run id a keyed task uses for these arguments (``namespace:key``).

        Raises:
            InvalidLeaseKey: the task has no ``lease_key``, its signature does not
                match these arguments, or it returned a bad key.
        """
        config = self.lease_config()
        if config.key is None:
            raise InvalidLeaseKey(f"{self.name} has no lease_key: its run id is the task id")
        return scoped_run_id(
            config.namespace or self.name, key_value(self.name, config.key, args, kwargs)
        )

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

        Arguments the task itself does not take (a partial signature; Celery's own
        argument check decides) are left to the worker, which checks the full call.

        Raises:
            InvalidLeaseKey: the key function does not take the call's arguments, or
                returned None, a non-str/int or "".
        """
        config = self.lease_config()
        if config.key is not None and (args is not None or kwargs is not None):
            call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
            if takes(self.run, call_args, call_kwargs):
                key = key_value(self.name, config.key, call_args, call_kwargs)
                scoped_run_id(config.namespace or self.name, key)
        try:
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
        except (OperationalError, OSError) as exc:  # the broker, not the message
            attempt = current_attempt()
            if attempt is None or not attempt.publishing:
                raise
            # Celery's retry() publishing its retry: the refusal is recorded, and the
            # attempt keeps the delivery for the sweeper instead of Celery's
            # Reject(requeue=False).
            attempt.retry_refused(exc)
            return None

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

        Celery's own bound holds as Celery applies it: when ``max_retries`` (the
        task's, ``retry_kwargs``' with ``autoretry_for``, or this call's) is spent,
        Celery raises ``exc`` (or ``MaxRetriesExceededError``) and the run ends
        ``failed`` at once, not retried up to ``lease_max_attempts``.

        When this claim was the run's last attempt (``lease_max_attempts``), it
        behaves as Celery does when ``max_retries`` is exceeded: ``exc`` (or
        ``MaxRetriesExceededError``) is raised, so the run ends ``failed`` and
        Celery's state ``FAILURE`` with the real error.

        A retry the broker refuses is not Celery's ``Reject(requeue=False)``: the
        run is recorded ``retrying`` with the retry message, and the sweeper sends
        it at the retry's ETA.
        """
        attempt = current_attempt()
        lease = None if attempt is None else attempt.lease
        if lease is not None and lease.attempt >= ceiling(self.lease_config(), lease):
            if exc is not None:
                raise_with_context(exc)
            raise self.MaxRetriesExceededError(
                f"Can't retry {self.name}[{self.request.id}]: lease attempts spent "
                f"({lease.attempt} of {ceiling(self.lease_config(), lease)})"
            )
        # Celery publishes the retry here: no interrupt may land inside kombu.
        with (
            lease.uninterruptible() if lease is not None else contextlib.nullcontext(),
            attempt.publishing_retry()
            if attempt is not None and lease is not None
            else contextlib.nullcontext(),
        ):
            try:
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
            except (Retry, Reject):
                raise
            except BaseException:
                # Celery found its max_retries (the task's, retry_kwargs' or this
                # call's) spent and raised the error: the run fails now, as in Celery.
                if attempt is not None:
                    attempt.retries_spent()
                raise

    def on_replace(self, sig: Any) -> Any:
        """Publish the replacement, then end this run: the replacement owns the rest."""
        attempt = current_attempt()
        lease = None if attempt is None else attempt.lease
        if self.request.is_eager or lease is None:
            return super().on_replace(sig)
        with lease.uninterruptible():  # no interrupt inside kombu's publish
            sig.delay()
        raise Replaced("Replaced by new task")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run this delivery leased: one :class:`~celery_lease.run.attempt.Attempt`."""
        config = self.lease_config()
        hooks = task_hooks(self, config)
        if self.request.called_directly:
            # A plain function call: no worker request exists, so push one the
            # way Task.__call__ does and run leased, raising instead of retrying.
            self.push_request(args=args, kwargs=kwargs)
            try:
                return Attempt(self, args, kwargs, config, hooks).run()
            finally:
                self.pop_request()
        return Attempt(self, args, kwargs, config, hooks).run()
