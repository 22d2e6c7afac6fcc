"""Run ids, concurrency keys and the stored message: what a claim sends.

The ``Delivery`` protocol names what the run modules read from an
:class:`~celery_lease.run.attempt.Attempt`, so :mod:`~celery_lease.run.republish`
and :mod:`~celery_lease.run.duplicates` take an attempt without importing it.
"""

from __future__ import annotations

import hashlib
import inspect
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from kombu.serialization import dumps

from ..config import LeaseConfig
from ..errors import InvalidLeaseKey
from ..events import EventBus
from ..requeue import header_run_id
from ..runtime import Runtime

#: The longest run id the ``id`` column holds; longer ids are hashed (see fit_run_id).
MAX_RUN_ID_LENGTH = 255


class Delivery(Protocol):
    """What republish and duplicates read from a delivery (an ``Attempt``)."""

    @property
    def task(self) -> Any:
        """The bound ``LeasedTask``."""

    @property
    def request(self) -> Any:
        """The delivery's Celery request context."""

    @property
    def config(self) -> LeaseConfig:
        """The task's lease settings."""

    @property
    def run_id(self) -> str:
        """The run this delivery claims."""

    @property
    def args(self) -> tuple[Any, ...]:
        """The body's positional arguments."""

    @property
    def kwargs(self) -> dict[str, Any]:
        """The body's keyword arguments."""

    @property
    def runtime(self) -> Runtime:
        """The store and heartbeat of the task's lease database."""

    @property
    def concurrency_key(self) -> str | None:
        """The claim's concurrency key."""

    @property
    def events(self) -> EventBus:
        """The app's event bus."""

    @property
    def direct(self) -> bool:
        """True for a plain function call or an eager ``apply()``: no worker delivery."""


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


def takes(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when ``function``'s signature accepts ``args``/``kwargs`` (or cannot be read)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C callable: no signature to check
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def key_value(
    task_name: str, key: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``key(*args, **kwargs)``, the task's ``lease_key`` applied to a call's arguments.

    Raises:
        InvalidLeaseKey: the key's signature does not accept the arguments (told
            apart from a ``TypeError`` raised inside the key function, which propagates).
    """
    if not takes(key, args, kwargs):
        try:
            signature = str(inspect.signature(key))
        except (TypeError, ValueError):
            signature = "(...)"
        shown = ", ".join([*(type(a).__name__ for a in args), *(f"{k}=" for k in kwargs)])
        raise InvalidLeaseKey(
            f"{task_name}: lease_key{signature} does not match the call's arguments "
            f"({shown}); give lease_key the task's own signature"
        )
    return key(*args, **kwargs)


def fit_run_id(run_id: str) -> str:
    """``run_id`` itself, or ``prefix:sha256:<hex>`` when it is longer than the column."""
    if len(run_id) <= MAX_RUN_ID_LENGTH:
        return run_id
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()
    return f"{run_id[:100]}:sha256:{digest}"


def run_id_of(
    task: Any,
    request: Any,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """The run id of ``task``'s delivery ``request`` (a Celery request context).

    ``namespace:lease_key(*args, **kwargs)`` when the task sets a key (the
    namespace is the task name unless ``lease_namespace`` names a shared one;
    ``args``/``kwargs`` default to the request's), else the task id. A
    replacement made by ``self.replace()`` inherits the task id but is a new
    run: its id gains ``~replaced-N``.
    """
    if task.lease_config().key is not None:
        if args is None:
            args = tuple(request.args or ())
        if kwargs is None:
            kwargs = dict(request.kwargs or {})
        run_id = str(task.lease_run_id(*args, **kwargs))
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


def concurrency_key(
    task_name: str, config: LeaseConfig, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The claim's concurrency key: ``lease_concurrency_key(...)``, else the task name
    when only ``lease_max_concurrency`` is set, else None."""
    if config.concurrency_key is not None:
        key: Any = config.concurrency_key(*args, **kwargs)
        return None if key is None else str(key)
    if config.max_concurrency is not None:
        return task_name
    return None


def rate_key(
    task_name: str, config: LeaseConfig, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The rate bucket of a call: ``lease_rate_key(...)`` as a string (hashed when longer
    than the column), ``""`` (the task's one bucket) without a key or for None."""
    if config.rate_key is None:
        return ""
    key = key_value(task_name, config.rate_key, args, kwargs)
    return "" if key is None else fit_run_id(str(key))


def payload(delivery: Delivery) -> dict[str, Any]:
    """The delivery's message as Celery would re-send it, for the sweeper.

    What ``signature_from_request`` keeps: task id, chain, chord, group,
    links, parent/root ids, headers, retries, routing, expiry, time limits.
    A plain call or an eager ``apply()`` stores none: no sweep may send it
    to workers.
    """
    if delivery.direct:
        return {"payload": None, "payload_content_type": None}
    signature = delivery.task.signature_from_request(
        delivery.request, delivery.args, delivery.kwargs
    )
    data, content_type = encode(delivery, dict(signature))
    return {"payload": data, "payload_content_type": content_type}


def encode(delivery: Delivery, message: dict[str, Any]) -> tuple[bytes, str]:
    """``message`` serialized with the task's serializer: ``(bytes, content type)``."""
    content_type, _encoding, data = dumps(  # type: ignore[no-untyped-call]
        message, serializer=delivery.task.serializer or "json"
    )
    if isinstance(data, str):
        data = data.encode("utf-8")
    return data, content_type
