"""Sending a delivery again: busy duplicates, claim errors, backoff, the sweeper's copy.

Functions over one delivery (an :class:`~celery_lease.run.attempt.Attempt`, read
through :class:`~celery_lease.run.runids.Delivery`): they reuse its config, run
id, concurrency key and store, never work them out again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NoReturn

from celery import Celery
from celery.exceptions import Ignore, Reject

from .. import flow
from ..config import LeaseConfig
from ..errors import (
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
)
from ..sanitize import describe_exception
from ..schema import HELD_PAUSED, HELD_RATE, RUNNING
from ..store import ClaimResult
from .runids import Delivery, encode

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


#: True while ``LeasedTask.retry`` lets Celery publish the retry of a leased delivery.
_publishing_retry: ContextVar[bool] = ContextVar("celery_lease_publishing_retry", default=False)
#: The publish error of a retry the broker refused, until the attempt records the retry.
_refused_retry: ContextVar[BaseException | None] = ContextVar(
    "celery_lease_refused_retry", default=None
)


@contextlib.contextmanager
def retry_publish(leased: bool) -> Iterator[None]:
    """Around Celery's ``retry()`` of a leased delivery: a refused publish is kept.

    Celery turns a refused retry publish into ``Reject(requeue=False)``, which
    would end the run ``failed``. Inside this block ``LeasedTask.apply_async``
    records the error instead (:func:`retry_refused`) and Celery raises its
    ``Retry``; the attempt then records the run ``retrying`` with the retry
    message, available at the retry's ETA, and the sweeper sends it.
    """
    if not leased:
        yield
        return
    _refused_retry.set(None)
    token = _publishing_retry.set(True)
    try:
        yield
    finally:
        _publishing_retry.reset(token)


def publishing_retry() -> bool:
    """True inside :func:`retry_publish`: the publish being made is Celery's retry."""
    return _publishing_retry.get()


def retry_refused(error: BaseException) -> None:
    """Record that the broker refused the retry being published (see :func:`retry_publish`)."""
    _refused_retry.set(error)


def take_refused_retry() -> BaseException | None:
    """The refused retry publish of this delivery, if any, forgetting it."""
    error = _refused_retry.get()
    _refused_retry.set(None)
    return error


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
    }.get(claim.reason, "held by another worker")
    busy = LeaseBusy(claim.run_id, claim.retry_in, reason)
    if claim.reason == "concurrency":
        # A slot frees when any holder finishes, usually well before its
        # lease would expire: poll with jittered backoff, capped by that.
        delay = min(claim.retry_in, backoff_delay(config, request.retries + 1))
        delay = max(delay, 0.05)
    else:
        delay = busy_delay(config, claim.retry_in, request.retries)
    # A retry that arrived before its backoff ended is this run's own next
    # attempt, not a duplicate: it always waits, whatever the busy policy.
    policy = "retry" if claim.reason == "backoff" else config.busy_policy
    delivery.events.emit(
        "busy",
        claim.run_id,
        "%s: %s",
        busy,
        f"retrying in {delay:.2f}s" if policy == "retry" else policy,
        retry_in=delay,
        policy=policy,
    )
    if policy == "fail":
        raise busy
    if policy == "skip":
        raise Ignore()
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
            "claim_error",
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
            status = delivery.runtime.store.end_unclaimed(
                run_id,
                task_name=delivery.task.name,
                max_attempts=config.max_attempts,
                failure_code=exc.failure_code,
                error=describe_exception(exc),
            )
        except LeaseError as end_exc:
            events.emit(
                "fail_error",
                run_id,
                "run %s: could not record failure: %s",
                run_id,
                describe_exception(end_exc),
                level=logging.WARNING,
            )
    events.emit(
        "claim_failed",
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
    duplicate shares with the run it duplicates. A delivery the broker
    refuses is kept for the sweeper (see :func:`publish_again`); only when
    the lease database refuses it too is it rejected with ``requeue=True``,
    which brings it back only under ``acks_late``.
    """
    if delivery.direct:
        raise cause
    try:
        publish_again(delivery, countdown, **options)
    except Exception as exc:
        logger.error(
            "celery-lease: could not re-publish %s (%s) nor keep it for the sweeper: "
            "asking the broker to requeue; without acks_late this delivery may be lost",
            delivery.request.id,
            describe_exception(exc),
            extra={"lease_event": "delivery_lost"},
        )
        raise Reject(requeue=True) from exc
    raise Ignore()


def publish_again(delivery: Delivery, countdown: float, **options: Any) -> None:
    """Send this delivery again after ``countdown`` s, or leave it to the sweeper.

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
    signature = task.signature_from_request(
        request,
        request.args,
        request.kwargs,
        countdown=countdown,
        retries=request.retries + 1,
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
        data, content_type = encode(delivery, dict(signature))
        kept = delivery.runtime.store.keep_delivery(
            run_id,
            task_name=delivery.task.name,
            task_id=str(request.id),
            payload=data,
            payload_content_type=content_type,
            lease_ms=config.lease_ms,
            max_attempts=config.max_attempts,
            available_in=countdown,
            concurrency_key=delivery.concurrency_key,
        )
    except Exception as exc:
        events.emit(
            "keep_error",
            run_id,
            "delivery %s: could not keep it for the sweeper either: %s",
            request.id,
            describe_exception(exc),
            level=logging.WARNING,
        )
        return False
    if kept:
        events.emit(
            "publish_deferred",
            run_id,
            "run %s: the broker refused the re-publish of %s (%s); kept in the lease "
            "database, the sweeper sends it",
            run_id,
            request.id,
            describe_exception(error),
            level=logging.WARNING,
        )
    return kept


def on_paused(delivery: Delivery, claim: ClaimResult) -> NoReturn:
    """The run's task (or its concurrency key) is paused: keep this delivery in the lease
    database, with its message, and drop it; ``resume`` publishes it again. No attempt is
    used. A plain call raises :class:`LeaseBusy`."""
    task, request, run_id = delivery.task, delivery.request, delivery.run_id
    paused = LeaseBusy(
        run_id, 0.0, f"{task.name} is paused" + (f": {claim.reason}" if claim.reason else "")
    )
    if delivery.direct:
        raise paused
    signature = task.signature_from_request(
        request, request.args, request.kwargs, headers=flow.without_slot(request.headers)
    )
    try:
        data, content_type = encode(delivery, dict(signature))
        kept = delivery.runtime.store.hold(
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
            "keep_error",
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
        "paused",
        run_id,
        "run %s: %s paused, delivery %s held until resume",
        run_id,
        task.name,
        request.id,
        task=task.name,
        key=delivery.concurrency_key or "",
    )
    raise Ignore()


def defer(delivery: Delivery, key: str, wait_ms: int, due_ms: int) -> NoReturn:
    """The task's ``lease_rate_limit`` gave this delivery a slot ``wait_ms`` from now: send it
    for then, carrying its slot, and drop this one. No attempt is used. Due within
    ``flow.HORIZON_MS``: re-published with that countdown; later: kept in the lease
    database and published when due (:class:`~celery_lease.flow.FlowPump`), so no worker
    holds more than a horizon's worth of ETA messages."""
    task, request, run_id = delivery.task, delivery.request, delivery.run_id
    wait = wait_ms / 1000.0
    delivery.events.emit(
        "deferred",
        run_id,
        "run %s: rate limit %s of %s reached, deferred %.3fs",
        run_id,
        delivery.config.rate_limit,
        task.name,
        wait,
        level=logging.DEBUG,
        task=task.name,
        key=key,
        retry_in=wait,
    )
    headers = {**(request.headers or {}), flow.SLOT_HEADER: due_ms}
    over = LeaseBusy(run_id, wait, "rate limit reached")
    if wait_ms <= flow.HORIZON_MS:
        reschedule(delivery, wait, over, headers=headers)
    try:
        signature = task.signature_from_request(
            request, request.args, request.kwargs, headers=headers
        )
        data, content_type = encode(delivery, dict(signature))
        store = delivery.runtime.store
        store.hold(
            HELD_RATE,
            task_name=task.name,
            flow_key=key,
            run_id=run_id,
            task_id=str(request.id),
            payload=data,
            payload_content_type=content_type,
            available_at=due_ms,
        )
    except LeaseError as exc:
        delivery.events.emit(
            "keep_error",
            run_id,
            "delivery %s: could not keep it for its rate slot (%s); sent with a countdown",
            request.id,
            describe_exception(exc),
            level=logging.WARNING,
        )
        reschedule(delivery, wait, over, headers=headers)
    flow.pump_for(task.app, delivery.config.database_url, store).wake()
    raise Ignore()
