"""Pause on the run path: :class:`PausedWork`, the hook that holds a paused task's delivery.

The pause itself rides the claim: the claim statement refuses a run whose
task (or concurrency key) is paused, and reads the pause only on that refusal
(:meth:`~celery_lease.store.flowstore.FlowStore.pause_of`). A delivery so
refused is kept in the lease database with its message and dropped; ``lease
resume`` publishes it again (:mod:`celery_lease.flow`). It uses no attempt.
A task never paused pays nothing: this hook acts only on a refused claim.
"""

from __future__ import annotations

import logging
from typing import NoReturn

from celery.exceptions import Ignore

from ..errors import LeaseBusy, LeaseError
from ..events import Event
from ..flow import without_slot
from ..hooks import RunHook
from ..sanitize import describe_exception
from ..schema import HELD_PAUSED
from ..store import ClaimResult
from .delivery import Delivery
from .republish import reschedule


class PausedWork(RunHook[Delivery]):
    """Keeps a paused task's delivery in the lease database until resume."""

    def refused(self, delivery: Delivery, claim: ClaimResult) -> None:
        """A claim refused by a pause: hold the delivery (a plain call raises
        :class:`LeaseBusy`)."""
        if claim.outcome == "paused":
            hold(delivery, claim.reason)


def hold(delivery: Delivery, reason: str) -> NoReturn:
    """Keep this delivery, with its message, until its task is resumed, and drop it
    (``reason``: the pause's, ``""`` for none)."""
    task, request, run_id = delivery.task, delivery.request, delivery.run_id
    paused = LeaseBusy(run_id, 0.0, f"{task.name} is paused" + (f": {reason}" if reason else ""))
    if delivery.direct:
        raise paused
    signature = task.signature_from_request(
        request, request.args, request.kwargs, headers=without_slot(request.headers)
    )
    try:
        data, content_type = delivery.encode(dict(signature))
        kept = delivery.store.flow.hold(
            HELD_PAUSED,
            task_name=task.name,
            flow_key=delivery.concurrency_key,
            run_id=run_id,
            task_id=str(request.id),
            payload=data,
            payload_content_type=content_type,
        )
    except LeaseError as exc:
        delivery.events.emit(
            Event.KEEP_ERROR,
            run_id,
            "delivery %s of paused %s: could not keep it (%s); sent again in 1s",
            request.id,
            task.name,
            describe_exception(exc),
            level=logging.WARNING,
        )
        reschedule(delivery, 1.0, exc)
    if not kept:  # resumed between the claim and the hold: run it now
        reschedule(delivery, 0.0, paused)
    delivery.events.emit(
        Event.PAUSED,
        run_id,
        "celery-lease: delivery %s of %s held: task paused%s; it runs once resumed "
        "(celery lease resume %s)",
        request.id,
        run_id,
        f" ({reason})" if reason else "",
        task.name,
        task=task.name,
        key=delivery.concurrency_key or "",
    )
    raise Ignore()
