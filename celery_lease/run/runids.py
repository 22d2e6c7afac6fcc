"""Run ids, concurrency keys and rate keys: pure functions of a task's settings and a call.

:class:`~celery_lease.run.delivery.Delivery` works each out once per delivery;
``LeasedTask.lease_run_id`` and the worker's revoke receiver use the same functions.
"""

from __future__ import annotations

import hashlib
import inspect
import uuid
from collections.abc import Callable
from typing import Any

from ..config import LeaseConfig
from ..errors import InvalidLeaseKey
from ..requeue import header_run_id

#: The longest run id the ``id`` column holds; longer ids are hashed (see fit_run_id).
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
    task_name: str,
    config: LeaseConfig,
    request: Any,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """The run id of a delivery ``request`` (a Celery request context) of ``task_name``.

    ``namespace:lease_key(*args, **kwargs)`` when the task sets a key (the
    namespace is the task name unless ``lease_namespace`` names a shared one;
    ``args``/``kwargs`` default to the request's), else the task id. A
    replacement made by ``self.replace()`` inherits the task id but is a new
    run: its id gains ``~replaced-N``.
    """
    if config.key is not None:
        if args is None:
            args = tuple(request.args or ())
        if kwargs is None:
            kwargs = dict(request.kwargs or {})
        run_id = scoped_run_id(
            config.namespace or task_name, key_value(task_name, config.key, args, kwargs)
        )
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
