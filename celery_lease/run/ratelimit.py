"""The fleet-wide rate limit on the run path: :class:`RateLimit`, one hook per limited task.

Before its claim, a delivery of a task with ``lease_rate_limit`` takes the
next slot of its bucket in the lease database (one statement:
:meth:`~celery_lease.store.flowstore.FlowStore.reserve_rate`). A slot due now
lets it go on to its claim; a later one is recorded for this delivery alone
(:meth:`~celery_lease.store.flowstore.FlowStore.record_slot`, bound to its task
id) and the delivery is sent again for then, naming it, and dropped: due within
:data:`~celery_lease.flow.HORIZON_MS` it is published with that countdown,
later it waits in the lease database and a :class:`~celery_lease.flow.FlowPump`
publishes it when due, so no worker holds more than a horizon's worth of ETA
messages. Its claim takes the recorded slot once; a copy of its message (a
retry, a busy or claim-error re-publish) or a forged header takes a slot of its
own. Waiting for a slot is no retry: ``request.retries`` is unchanged. A
delivery whose claim is refused (paused, busy, finished) gives its slot back,
and one whose task is paused when its slot is later is held at once, taking
none: a paused task takes no slots, and resume sends its deliveries in arrival
order. No attempt is used. A task without a limit has no such hook: it pays
nothing.
"""

from __future__ import annotations

import logging

from ..config import LeaseConfig
from ..errors import LeaseError
from ..events import Event
from ..flow import HORIZON_MS, SLOT_HEADER, pump_for, slot_of
from ..hooks import RunHook
from ..sanitize import describe_exception
from ..schema import HELD_RATE
from ..store import ClaimResult
from .delivery import Delivery
from .pausing import hold
from .republish import send_again
from .runids import rate_key

#: What :meth:`RateLimit.before_claim` reports for a delivery sent to its later slot.
RATE_LIMITED = "rate_limited"


class RateLimit(RunHook[Delivery]):
    """Takes each delivery's rate slot before its claim (tasks with ``lease_rate_limit``)."""

    def for_task(self, task_name: str, config: LeaseConfig) -> RateLimit | None:
        """This hook for a task with a limit; None for one without."""
        return self if config.rate_period_ms is not None else None

    def before_claim(self, delivery: Delivery) -> str | None:
        """Take the slot; go on when it is due now, else send the delivery to it."""
        if delivery.direct:
            return None
        config = delivery.config
        period = config.rate_period_ms
        assert period is not None  # for_task keeps this hook for limited tasks only
        key = rate_key(delivery.task_name, config, delivery.args, delivery.kwargs)
        flow = delivery.store.flow
        slot = slot_of(delivery.request)
        if slot is not None and flow.use_slot(slot, str(delivery.request.id)):
            delivery.feature_state[self] = key
            return None
        wait_ms, due_ms = flow.reserve_rate(delivery.task_name, key, period, config.rate_burst)
        if wait_ms <= 0:
            delivery.feature_state[self] = key
            return None
        paused = flow.pause_of(delivery.task_name, delivery.concurrency_key)
        if paused is not None:
            # A paused task takes no slot: held now, in arrival order, until resume.
            flow.give_back_rate(delivery.task_name, key, period)
            hold(delivery, paused)
        defer(delivery, key, wait_ms, due_ms)
        return RATE_LIMITED

    def refused(self, delivery: Delivery, claim: ClaimResult) -> None:
        """The claim was refused (paused, busy, finished): no body starts on this slot,
        so it is given back."""
        key = delivery.feature_state.pop(self, None)
        period = delivery.config.rate_period_ms
        if key is not None and period is not None:
            delivery.store.flow.give_back_rate(delivery.task_name, key, period)


def defer(delivery: Delivery, key: str, wait_ms: int, due_ms: int) -> None:
    """Record the slot ``wait_ms`` from now (due at ``due_ms``) for this delivery and send
    it for then, naming the slot; its ``request.retries`` is unchanged.

    Raises:
        Reject: neither the broker nor the lease database took it.
    """
    task, request, run_id = delivery.task, delivery.request, delivery.run_id
    wait = wait_ms / 1000.0
    seq = delivery.store.flow.record_slot(
        task_name=task.name,
        flow_key=key,
        run_id=run_id,
        task_id=str(request.id),
        due_ms=due_ms,
    )
    headers = {**(request.headers or {}), SLOT_HEADER: seq}
    kept = False
    if wait_ms > HORIZON_MS:
        try:
            signature = task.signature_from_request(
                request, request.args, request.kwargs, headers=headers
            )
            data, content_type = delivery.encode(dict(signature))
            store = delivery.store
            store.flow.hold(
                HELD_RATE,
                task_name=task.name,
                flow_key=key,
                run_id=run_id,
                task_id=str(request.id),
                payload=data,
                payload_content_type=content_type,
                available_at=due_ms,
            )
            kept = True
        except LeaseError as exc:
            delivery.events.emit(
                Event.KEEP_ERROR,
                run_id,
                "delivery %s: could not keep it for its rate slot (%s); sent with a countdown",
                request.id,
                describe_exception(exc),
                level=logging.WARNING,
            )
    if kept:
        pump_for(task.app, delivery.config.database_url, delivery.store).wake()
    else:
        send_again(delivery, wait, retries=request.retries, headers=headers)
    delivery.events.emit(
        Event.DEFERRED,
        run_id,
        "celery-lease: delivery %s of %s deferred: rate limit %s of %s reached; it runs in %.3fs%s",
        request.id,
        run_id,
        delivery.config.rate_limit,
        task.name,
        wait,
        " (kept in the lease database until then)" if kept else "",
        task=task.name,
        key=key,
        retry_in=wait,
    )
