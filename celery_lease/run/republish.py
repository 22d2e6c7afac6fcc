"""Sending a delivery again: busy duplicates, claim errors, backoff, the sweeper's copy.

Functions over one :class:`~celery_lease.run.delivery.Delivery`: they reuse its
config, run id, concurrency key and store, never work them out again. The
features that hold a delivery back (a pause, the rate limit) send it again
through :func:`send_again`.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, NoReturn

from celery import Celery
from celery.exceptions import Ignore, Reject

from ..config import LeaseConfig
from ..errors import (
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
)
from ..events import Event
from ..requeue import CALLER, COPY, COPY_HEADER, callers_publish, copy_headers
from ..sanitize import describe_exception
from ..schema import RUNNING
from ..store import ClaimResult
from .delivery import Delivery

logger = logging.getLogger(__name__)

#: How many times a delivery is re-published after a transient database error
#: on its claim before the run ends ``failed`` (``lease_db_unavailable``). With
#: the default backoff (2 s doubling, capped at 600 s, full jitter) that rides
#: out about 13 minutes of outage on average, 27 at most.
CLAIM_DB_RETRIES = 10
#: Message header counting those re-publications (Celery's ``retries`` also
#: counts busy and lease-lost re-publications, which are not failures).
DB_ERRORS_HEADER = "celery_lease_db_errors"

#: How long a refused re-publish is retried before the delivery is left to the sweeper.
PUBLISH_RETRY_SECONDS = 3.0


def backoff_delay(config: LeaseConfig, attempt: int) -> float:
    """Exponential backoff with full jitter for the ``attempt``-th failure (1-based)."""
    ceiling = min(
        config.retry_backoff_max, config.retry_backoff * 2 ** min(max(attempt - 1, 0), 30)
    )
    return float(random.uniform(0, ceiling))


def busy_delay(config: LeaseConfig, time_left: float, tries: int) -> float:
    """Countdown for a busy duplicate: the lease's time left, growing with each try."""
    grown = max(time_left, 0.05) + config.retry_backoff * (2 ** min(tries, 30) - 1)
    return float(min(config.retry_backoff_max, grown))


def native_delay_countdown(app: Celery, countdown: float) -> float:
    """``countdown``, rounded up to 1 s where Celery would refuse it as under a second.

    With RabbitMQ quorum queues, Celery (5.5 and later) sends countdowns through its
    native delayed delivery, which counts whole seconds: a countdown between 0 and 1 s
    raises ``ValueError`` at publish (on a topic or fanout exchange). Other brokers and
    queues keep the exact countdown.
    """
    if not 0.0 < countdown < 1.0:
        return countdown
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # Celery before 5.5: no native delayed delivery
        return countdown
    driver = app.connection_for_write().transport.driver_type
    return 1.0 if detect_quorum_queues(app, driver)[0] else countdown


def on_busy(delivery: Delivery, claim: ClaimResult) -> NoReturn:
    """The run is held (another worker, the concurrency limit, a retry's backoff):
    apply ``lease_busy_policy``, re-publishing this delivery to try again later."""
    config, request = delivery.config, delivery.request
    reason = {
        "concurrency": "concurrency limit reached",
        "backoff": "waiting for its retry backoff",
        "due": "it came due as it was read",
    }.get(claim.reason, "held by another worker")
    busy = LeaseBusy(claim.run_id, claim.retry_in, reason)
    # Held back by the row's own backoff, not by a holder: most often the run's own
    # retry, whose ETA Celery counts from its publish, a moment before the write that
    # starts the backoff. It is sent again as that same retry (Celery's ``retries``
    # kept), for the time left, whatever the busy policy.
    own_backoff = claim.reason in ("backoff", "due")
    if claim.reason == "concurrency":
        # A slot frees when any holder finishes, usually well before its
        # lease would expire: poll with jittered backoff, capped by that.
        delay = min(claim.retry_in, backoff_delay(config, request.retries + 1))
        delay = max(delay, 0.05)
    elif own_backoff:
        delay = claim.retry_in + 0.05
    else:
        delay = busy_delay(config, claim.retry_in, request.retries)
    policy = "retry" if own_backoff else config.busy_policy
    delivery.events.emit(
        Event.BUSY,
        claim.run_id,
        "celery-lease: delivery %s of %s busy: %s; %s",
        delivery.request.id,
        claim.run_id,
        reason,
        {
            "retry": f"sent again, it runs in {delay:.2f}s (lease_busy_policy=retry)",
            "skip": "dropped, it does not run (lease_busy_policy=skip)",
        }.get(policy, "failed with LeaseBusy (lease_busy_policy=fail)"),
        retry_in=delay,
        policy=policy,
    )
    if policy == "fail":
        raise busy
    if policy == "skip":
        raise Ignore()
    if own_backoff:
        reschedule(delivery, delay, busy, retries=request.retries)
    reschedule(delivery, delay, busy)


def on_claim_error(delivery: Delivery, exc: LeaseDatabaseError | LeaseInputError) -> NoReturn:
    """A claim the database (or a check before it) refused; the body never runs.

    Transient errors re-publish the delivery with backoff, at most
    ``CLAIM_DB_RETRIES`` times (counted in the ``DB_ERRORS_HEADER`` header).
    Permanent errors, and transient ones once spent, end the run ``failed``
    with the error's ``failure_code`` where a row can be written, and fail
    this delivery with the error either way. A run another worker holds
    alive is left to it: this delivery is dropped like a busy duplicate.
    """
    config, request, run_id, events = (
        delivery.config,
        delivery.request,
        delivery.run_id,
        delivery.events,
    )
    spent = db_errors_spent(request)
    transient = isinstance(exc, LeaseDatabaseError) and exc.transient
    local = request.called_directly or request.is_eager
    if transient and local:
        raise exc  # a plain call: the caller decides; the row is not touched
    if transient and spent < CLAIM_DB_RETRIES:
        delay = backoff_delay(config, spent + 1)
        events.emit(
            Event.CLAIM_ERROR,
            run_id,
            "run %s: lease database unavailable (try %d of %d), retrying in %.1fs: %s",
            run_id,
            spent + 1,
            CLAIM_DB_RETRIES,
            delay,
            describe_exception(exc),
            level=logging.WARNING,
        )
        headers = {**(request.headers or {}), DB_ERRORS_HEADER: spent + 1}
        reschedule(delivery, delay, exc, headers=headers)
    status: str | None = None
    if not isinstance(exc, LeaseInputError) or exc.field != "run_id":
        try:
            status = delivery.store.end_unclaimed(
                run_id,
                task_name=delivery.task.name,
                max_attempts=config.max_attempts,
                failure_code=exc.failure_code,
                error=describe_exception(exc),
            )
        except LeaseError as end_exc:
            events.emit(
                Event.FAIL_ERROR,
                run_id,
                "run %s: could not record failure: %s",
                run_id,
                describe_exception(end_exc),
                level=logging.WARNING,
            )
    events.emit(
        Event.CLAIM_FAILED,
        run_id,
        "run %s: claim failed for good (%s), run is %s: %s",
        run_id,
        exc.failure_code,
        status or "unrecorded",
        describe_exception(exc),
        level=logging.ERROR,
        failure_code=exc.failure_code,
    )
    if status == RUNNING and not local:
        raise Ignore()  # held alive by another worker, which owns the result
    raise exc


def db_errors_spent(request: Any) -> int:
    """Transient claim errors the lineage of ``request`` has retried so far."""
    value: Any = (request.headers or {}).get(DB_ERRORS_HEADER)
    if value is None:
        value = getattr(request, DB_ERRORS_HEADER, 0)
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def reschedule(
    delivery: Delivery, countdown: float, cause: BaseException, **options: Any
) -> NoReturn:
    """Publish this delivery again after ``countdown`` s and drop this one silently.

    Dropping with ``Ignore`` writes nothing to the result backend, which a
    duplicate shares with the run it duplicates. A plain call raises ``cause``.
    See :func:`send_again`.
    """
    if delivery.direct:
        raise cause
    send_again(delivery, countdown, **options)
    raise Ignore()


def send_again(delivery: Delivery, countdown: float, **options: Any) -> None:
    """Publish this delivery again after ``countdown`` s, or leave it to the sweeper.

    A delivery the broker refuses is kept for the sweeper (see
    :func:`publish_again`); only when the lease database refuses it too is it
    rejected with ``requeue=True``, which brings it back only under ``acks_late``.

    Raises:
        Reject: neither the broker nor the lease database took it.
    """
    try:
        publish_again(delivery, countdown, **options)
    except Exception as exc:
        logger.error(
            "celery-lease: could not re-publish %s (%s) nor keep it for the sweeper: "
            "asking the broker to requeue; without acks_late this delivery may be lost",
            delivery.request.id,
            describe_exception(exc),
            extra={"lease_event": Event.DELIVERY_LOST},
        )
        raise Reject(requeue=True) from exc


def publish_again(
    delivery: Delivery, countdown: float, *, retries: int | None = None, **options: Any
) -> None:
    """Send this delivery again after ``countdown`` s, or leave it to the sweeper.

    ``retries``: the message's ``retries`` (by default one more than this delivery's;
    a delivery waiting for its rate slot keeps its own).

    A refused publish is retried with backoff for up to
    ``PUBLISH_RETRY_SECONDS`` (kombu retries each one briefly as well). Then
    the delivery is recorded in the lease database
    (:meth:`~celery_lease.store.LeaseStore.keep_delivery`), and the sweeper
    sends it once the broker is back.

    Raises:
        Exception: the last publish error, when the delivery could not be kept.
    """
    task, request = delivery.task, delivery.request
    countdown = native_delay_countdown(task.app, max(0.0, countdown))
    # What the copy is: a delivery that never claimed stays the caller's (a used task id
    # applied again still gets the outcome); one after a claim is a copy (see COPY_HEADER).
    given = dict(options.pop("headers", None) or {})
    kind = given.get(COPY_HEADER) or (CALLER if callers_publish(request) else COPY)
    headers = {**(request.headers or {}), **given}
    signature = task.signature_from_request(
        request,
        request.args,
        request.kwargs,
        countdown=countdown,
        retries=request.retries + 1 if retries is None else retries,
        headers=copy_headers(headers, kind),
        **options,
    )
    deadline = time.monotonic() + PUBLISH_RETRY_SECONDS
    delay = 0.25
    while True:
        try:
            signature.clone().apply_async()
            return
        except Exception as exc:
            if time.monotonic() + delay >= deadline:
                if keep_for_sweeper(delivery, signature, countdown, exc):
                    return
                raise
            time.sleep(delay)
            delay *= 2


def keep_for_sweeper(
    delivery: Delivery, signature: Any, countdown: float, error: Exception
) -> bool:
    """Record the unsent ``signature`` for the sweeper; True when a sweep will send it."""
    request, run_id, events = delivery.request, delivery.run_id, delivery.events
    try:
        config = delivery.config
        message = dict(signature)
        data, content_type = delivery.encode(message)
        kept = delivery.store.keep_delivery(
            run_id,
            task_name=delivery.task.name,
            task_id=str(request.id),
            payload=data,
            payload_content_type=content_type,
            retries=int((message.get("options") or {}).get("retries") or 0),
            lease_ms=config.lease_ms,
            max_attempts=config.max_attempts,
            available_in=countdown,
            concurrency_key=delivery.concurrency_key,
        )
    except Exception as exc:
        events.emit(
            Event.KEEP_ERROR,
            run_id,
            "delivery %s: could not keep it for the sweeper either: %s",
            request.id,
            describe_exception(exc),
            level=logging.WARNING,
        )
        return False
    if kept:
        events.emit(
            Event.PUBLISH_DEFERRED,
            run_id,
            "run %s: the broker refused the re-publish of %s (%s); kept in the lease "
            "database, the sweeper sends it",
            run_id,
            request.id,
            describe_exception(error),
            level=logging.WARNING,
        )
    return kept
