"""One place where lease events are logged (and counted, when metrics are on).

Every record carries ``extra={"lease_event": ..., "run_id": ...}`` so log
pipelines can filter on it without parsing messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("celery_lease")

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Call ``listener(event, fields)`` for every lease event (metrics hook here)."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener``."""
    if listener in _listeners:
        _listeners.remove(listener)


def emit(
    event: str,
    run_id: str | None,
    message: str,
    *args: Any,
    level: int = logging.INFO,
    **fields: Any,
) -> None:
    """Log ``message % args`` once with the event in ``extra`` and notify listeners.

    A failing listener is logged and skipped: observability never breaks a task.
    """
    if not _listeners and not logger.isEnabledFor(level):
        return  # the hot path: two events per task, usually below the log level
    extra = {"lease_event": event, "run_id": run_id, **{f"lease_{k}": v for k, v in fields.items()}}
    logger.log(level, message, *args, extra=extra)
    data = {"run_id": run_id, **fields}
    for listener in list(_listeners):
        try:
            listener(event, data)
        except Exception:
            logger.exception("celery-lease event listener %r failed", listener)
