"""Run ids and what a claim sends: the first layer of :class:`~celery_lease.LeasedTask`."""

from __future__ import annotations

import hashlib
import inspect
import logging
import uuid
from typing import Any

from celery import Task
from kombu.serialization import dumps

from .config import SETTING_NAMES, LeaseConfig
from .errors import InvalidLeaseKey
from .events import EventBus
from .requeue import header_run_id
from .runtime import app_config, app_runtime

logger = logging.getLogger(__name__)

#: The longest run id the ``id`` column holds; longer ids are hashed (see run_id_for).
MAX_RUN_ID_LENGTH = 255


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


class TaskSettings(Task):  # type: ignore[misc]
    """The task's lease settings, run ids and stored message (a layer of ``LeasedTask``)."""

    @property
    def _events(self) -> EventBus:
        """The app's event bus (the task's leases and stores use the same one)."""
        return app_runtime(self.app).events

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
            rerun = header_run_id(request)  # `lease rerun`: a new task id, the same run
            if rerun is not None:
                return rerun
            task_id = request.id
            run_id = str(task_id) if task_id else uuid.uuid4().hex
        nesting = getattr(request, "replaced_task_nesting", 0) or 0
        if nesting:
            run_id = f"{run_id}~replaced-{nesting}"
        return fit_run_id(run_id)

    def _direct(self) -> bool:
        """True for a plain function call or an eager ``apply()``: no worker delivery."""
        return bool(self.request.called_directly or self.request.is_eager)

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
