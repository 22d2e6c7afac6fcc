"""One delivery of a leased task as the run path and its features see it: :class:`Delivery`.

Its facts are worked out once, when the worker hands the delivery to the task
(the task's settings and hooks, the run id, whether it is a plain call); the
rest on first use (the runtime of the task's lease database, the concurrency
key, the stored message). Features keep what they need for this delivery in
:attr:`Delivery.feature_state`; the
:class:`~celery_lease.run.attempt.Attempt` that runs it keeps the claim, the
lease and the outcome.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from kombu.serialization import dumps

from ..config import LeaseConfig
from ..events import EventBus
from ..followups import Followups
from ..hooks import Hooks, RunHook
from ..owner import new_owner
from ..runtime import Runtime, app_runtime, runtime_for, worker_id
from ..schema import check_retries
from ..store import LeaseStore
from .outcome import kept_result
from .runids import concurrency_key, run_id_of

#: The hooks of one delivery's task.
DeliveryHooks = Hooks["Delivery"]


@contextlib.contextmanager
def _nested(managers: list[AbstractContextManager[None] | None]) -> Iterator[None]:
    """The context managers ``managers`` (None: nothing), entered in order."""
    with contextlib.ExitStack() as stack:
        for manager in managers:
            if manager is not None:
                stack.enter_context(manager)
        yield


class _Unset:
    """The type of :data:`_UNSET`: a value not worked out yet."""


_UNSET = _Unset()


class Delivery:
    """One delivery: the task, its request and arguments, settings, hooks and run id.

    Attributes:
        task: the bound ``LeasedTask``.
        request: the delivery's Celery request context.
        args: the body's positional arguments.
        kwargs: the body's keyword arguments.
        config: the task's lease settings.
        hooks: the task's run hooks (the features it uses).
        events: the app's event bus.
        direct: True for a plain function call or an eager ``apply()``: no worker delivery.
        run_id: the run this delivery claims.
        owner: the owner its claim names (unique; it ends with the worker's id).
        claim_values: keyword values the hooks add to the claim.
        feature_state: what each hook keeps for this delivery, by hook.
    """

    __slots__ = (
        "_concurrency_key",
        "_runtime",
        "args",
        "claim_values",
        "config",
        "direct",
        "events",
        "feature_state",
        "hooks",
        "kwargs",
        "owner",
        "request",
        "run_id",
        "task",
    )

    def __init__(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: LeaseConfig,
        hooks: DeliveryHooks,
    ) -> None:
        request = task.request
        self.task = task
        self.request = request
        self.args = args
        self.kwargs = kwargs
        self.config = config
        self.hooks = hooks
        self.events: EventBus = app_runtime(task.app).events
        self.direct = bool(request.called_directly or request.is_eager)
        self.run_id = run_id_of(task.name, config, request, args, kwargs)
        self.owner = new_owner(request.hostname, worker_id(task.app))
        self.claim_values: dict[str, Any] = {}
        self.feature_state: dict[RunHook[Delivery], Any] = {}
        # Worked out on first use: runtime_for may raise, and the claim's error
        # handling decides what then.
        self._runtime: Runtime | None = None
        self._concurrency_key: str | _Unset | None = _UNSET

    @property
    def task_name(self) -> str:
        """The task's name."""
        return str(self.task.name)

    @property
    def runtime(self) -> Runtime:
        """The store and heartbeat of the task's lease database in this process."""
        runtime = self._runtime
        if runtime is None:
            runtime = self._runtime = runtime_for(self.task.app, self.config)
        return runtime

    @property
    def store(self) -> LeaseStore:
        """The task's lease store."""
        return self.runtime.store

    @property
    def followups(self) -> Followups:
        """What records and publishes the follow-up tasks the body hands its lease."""
        return Followups(self.task.app, self.store)

    @property
    def concurrency_key(self) -> str | None:
        """The claim's concurrency key (see :func:`~celery_lease.run.runids.concurrency_key`)."""
        key = self._concurrency_key
        if isinstance(key, _Unset):
            key = self._concurrency_key = concurrency_key(
                self.task_name, self.config, self.args, self.kwargs
            )
        return key

    def around(self, operation: str, outcome: str) -> AbstractContextManager[None] | None:
        """What the hooks wrap the lease's ``operation`` in (None: nothing)."""
        hooks = self.hooks.around
        if not hooks:
            return None
        if len(hooks) == 1:
            return hooks[0].around(self, operation, outcome)
        return _nested([hook.around(self, operation, outcome) for hook in hooks])

    def kept_result(self, value: Any) -> tuple[bytes, str] | None:
        """``value``, the body's return value, as the run's success keeps it for a replay
        (:func:`~celery_lease.run.outcome.kept_result`), or None where it is not kept."""
        return kept_result(self.task, self.request, value)

    def stored_message(self) -> dict[str, Any]:
        """The delivery's message as Celery would re-send it, for the sweeper: the claim's
        ``payload``, ``payload_content_type`` and its Celery ``retries``.

        What ``signature_from_request`` keeps: task id, chain, chord, group,
        links, parent/root ids, headers, retries, routing, expiry, time limits.
        A plain call or an eager ``apply()`` stores none: no sweep may send it
        to workers.
        """
        retries = check_retries(self.request.retries)
        if self.direct:
            return {"payload": None, "payload_content_type": None, "retries": retries}
        signature = self.task.signature_from_request(self.request, self.args, self.kwargs)
        data, content_type = self.encode(dict(signature))
        return {"payload": data, "payload_content_type": content_type, "retries": retries}

    def encode(self, message: dict[str, Any]) -> tuple[bytes, str]:
        """``message`` serialized with the task's serializer: ``(bytes, content type)``."""
        content_type, _encoding, data = dumps(  # type: ignore[no-untyped-call]
            message, serializer=self.task.serializer or "json"
        )
        if isinstance(data, str):
            data = data.encode("utf-8")
        return data, content_type
