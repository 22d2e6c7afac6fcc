"""The next step of a leased chain gets its run row before Celery publishes it.

A chain's first step is known to its caller. Each later step is published by the
worker that ran the step before it, from Celery's trace, once that run's success
is recorded, and nothing else knows of it. A broker can lose a message it handed
to a worker killed before taking it over (kombu's Redis transport between its
``BRPOP`` and its save to ``unacked``; the filesystem transport once the file was
read): the chain would then stop there, with no row to show for it.

So, in a worker, when a ``LeasedTask`` delivery publishes the next step of its
chain and that step is one ``LeasedTask`` task without a ``countdown`` or ``eta``,
the step gets its ``queued`` run row first (attempt 0, carrying the message, as a
leased follow-up does; one statement per step, in the step's lease database).
The sweeper sends it again if no worker claims it within ``lease_sweep_interval +
lease_seconds`` (:meth:`~celery_lease.store.LeaseStore.reclaim_stale`). The row is
written before the publish, so a worker killed between the two leaves a row the
sweeper publishes; a second copy of the step is dropped by its lease. A row that
cannot be written is logged and the step is published as before.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.app.task import Context
from kombu.serialization import dumps

from .events import Event
from .followups import keep_leased_run
from .runtime import app_runtime
from .sanitize import describe_exception


def keep_next_step(
    app: Celery,
    body: Any,
    exchange: Any,
    routing_key: Any,
    headers: Any,
    properties: Any,
) -> None:
    """``before_task_publish`` in a worker: keep the run of the message about to go out
    when it is the next step of the current ``LeasedTask`` delivery's chain (see the
    module). Never raises."""
    if not isinstance(headers, dict) or headers.get("eta"):
        return
    parent = app.current_worker_task
    if parent is None or getattr(parent, "lease_config", None) is None:
        return
    request = parent.request
    task_id = headers.get("id")
    if not task_id or not request.id or headers.get("parent_id") != request.id:
        return
    if task_id == request.id:
        return  # this delivery's own retry or replacement
    if not isinstance(body, (list, tuple)) or len(body) != 3 or not isinstance(body[2], dict):
        return  # not Celery's message protocol 2
    if not _next_step(request.chain, body[2].get("chain"), task_id):
        return  # a group or chord step, or a body's own publish
    try:
        _keep(app, body, exchange, routing_key, headers, properties or {})
    except Exception as exc:
        app_runtime(app).events.emit(
            Event.CHAIN_STEP_NOT_KEPT,
            None,
            "celery-lease: chain step %s (%s) after task %s is published without its run "
            "row (a broker that loses it leaves the chain stopped there): %s",
            task_id,
            headers.get("task"),
            request.id,
            describe_exception(exc),
            level=logging.WARNING,
            task_id=task_id,
        )


def _next_step(chain: Any, sent_chain: Any, task_id: str) -> bool:
    """True when the message ``task_id``, carrying ``sent_chain``, is the next step of the
    delivery's ``chain``. Celery 5.5 and later publish ``chain[-1]`` with ``chain[:-1]``
    and leave the request's list alone; Celery 5.4 pops the step off that very list first
    and publishes it with the same list object."""
    if not isinstance(chain, list):
        return False
    if sent_chain is chain:
        return True
    step = chain[-1] if chain else None
    options = step.get("options") if isinstance(step, dict) else None
    return isinstance(options, dict) and options.get("task_id") == task_id


def _keep(
    app: Celery,
    body: Any,
    exchange: Any,
    routing_key: Any,
    headers: dict[str, Any],
    properties: dict[str, Any],
) -> None:
    """Write the step's ``queued`` row, carrying the message its worker would keep."""
    task = app.tasks.get(headers.get("task"))
    if task is None or getattr(task, "lease_config", None) is None:
        return
    args, kwargs, embed = body
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    # The request the step's worker will see (Celery's worker builds it the same way:
    # the headers, the reply-to and delivery info, then the callbacks and chain).
    context = Context(
        {
            **headers,
            "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"),
            "delivery_info": {
                "exchange": getattr(exchange, "name", exchange) or "",
                "routing_key": routing_key,
                "priority": properties.get("priority"),
            },
            **dict(embed or {}),
        },
        args=args,
        kwargs=kwargs,
    )
    message = dict(task.signature_from_request(context, args, kwargs))
    content_type, _encoding, data = dumps(message, serializer=task.serializer or "json")  # type: ignore[no-untyped-call]
    if isinstance(data, str):
        data = data.encode("utf-8")
    keep_leased_run(
        app,
        task.name,
        context,
        args,
        kwargs,
        (data, content_type),
        int(headers.get("retries") or 0),
    )
