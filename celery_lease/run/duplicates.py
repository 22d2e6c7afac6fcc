"""A delivery of a run that already ended: the outcome it reports instead of running."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery import states
from celery.exceptions import Ignore

from ..errors import LeaseDatabaseError, LeaseInputError, RunFailed
from ..events import Event
from ..requeue import callers_publish
from ..runtime import result_format
from ..sanitize import describe_exception
from ..schema import CANCELLED, SUCCEEDED
from ..store import ClaimResult
from .delivery import Delivery
from .outcome import Outcome, result_expired
from .republish import busy_delay, reschedule

logger = logging.getLogger(__name__)

#: How many times a duplicate of a finished run waits for that run's result to be
#: stored by Celery (or a redelivery waits before replaying it) before it gives up.
RESULT_WAIT_TRIES = 8

#: A redelivery of the run's own succeeded delivery waits before replaying it (or
#: reporting that it cannot) until the run ended ``lease_seconds`` ago, and at least
#: this long: the worker that ran it may still be storing the result. Celery stores it
#: just after the lease commit, but the row's end time is its completion statement's,
#: and ``fence(complete=True)`` runs inside the body's transaction, which may commit
#: (and the body return) well after it. A live worker gets one lease period to store
#: its result, as a dead one gets one lease period before its run is taken over.
REPLAY_GRACE_SECONDS = 2.0


def on_finished(delivery: Delivery, claim: ClaimResult) -> Any:
    """A delivery of a run that already ended: the body does not run again.

    Under the run's own task id (a redelivery) nothing is written when Celery
    already has a ready state for it; otherwise (the worker died between the
    lease commit and Celery's result store) the outcome is replayed from the
    row: the stored result is returned, so Celery stores ``SUCCESS`` and fires
    the continuation once. Under another task id (a keyed duplicate, a group or
    chain member) the caller gets the run's outcome as this task's own: its
    result (from Celery, else from the row, else it waits), its failure, or
    ``REVOKED``, and its continuation proceeds with it.
    """
    own_id = delivery.request.id
    _check_same_task(delivery, claim)
    # A NULL task id (a direct call, a row from before migration 0002) is nobody's.
    same = claim.task_id is not None and own_id == claim.task_id
    # The run's own task id published again by a caller (a frozen signature or canvas
    # applied twice) is answered like another task id: the body does not run, but the
    # caller's result and its continuation get the run's outcome. A redelivery, or a
    # copy celery-lease sent, stays a duplicate that writes nothing.
    applied_again = same and callers_publish(delivery.request)
    if applied_again:
        same = False
        reported = "reported again under its task id (applied again)"
    else:
        # Under another task id the outcome is reported as that task's result, where
        # anyone can ask for it (not under ignore_result, nor without a result backend).
        asked = not same and _asked(delivery)
        reported = f"its outcome is reported under {own_id}" if asked else ""
    delivery.events.emit(
        Event.DUPLICATE_DROPPED,
        claim.run_id,
        "run %s is already %s: delivery dropped%s",
        claim.run_id,
        claim.status,
        f" ({reported})" if reported else "",
        status=claim.status,
    )
    if claim.status == CANCELLED:
        mark_revoked(delivery)
        raise Ignore()
    if claim.status == SUCCEEDED:
        if same:
            return _replay_own(delivery, claim)
        if applied_again:
            # Celery's result if it has one, else the row's, or the reason it has none:
            # nothing stores a result for this id later.
            meta = _celery_meta(delivery, own_id)
            if meta is not None and meta.get("status") == states.SUCCESS:
                return meta.get("result")
            return _replay_row(delivery, claim)
        return _result_of(delivery, claim)
    if same:
        if _celery_state(delivery, own_id) in states.READY_STATES:
            raise Ignore()
        # The worker that ended the run may be storing its FAILURE right now (and
        # calling link_error): reporting it too would call link_error twice.
        _wait_for_its_worker(delivery, claim)
    raise _failure_of(delivery, claim)


def _check_same_task(delivery: Delivery, claim: ClaimResult) -> None:
    """:class:`LeaseInputError` when the finished run is another task's: this delivery's
    task id is that run's id (a caller chose it so), which would drop it and hand its
    caller the other task's outcome. Tasks sharing a ``lease_namespace`` share runs."""
    other = claim.task_name
    if other is None or other == delivery.task_name or delivery.config.namespace is not None:
        return
    raise LeaseInputError(
        "task_id",
        f"run {claim.run_id} is a run of task {other!r}, not of {delivery.task_name!r}: "
        "this delivery's id names another task's run (give each task ids of its own, or "
        "both tasks one lease_namespace to share runs)",
    )


def on_stale(delivery: Delivery, claim: ClaimResult) -> NoReturn:
    """An older copy of the run's own message: the body does not run, nothing is written.

    Same task id, fewer Celery ``retries`` than the message the run keeps, such as the
    original of a retry that the broker delivered again because its ack failed (a broker
    outage under ``acks_late``). The run goes on with the message it keeps (the retry, sent
    by Celery or by the sweeper), whose outcome Celery stores under this same task id.
    """
    delivery.events.emit(
        Event.DUPLICATE_DROPPED,
        claim.run_id,
        "run %s is %s and keeps a later message of task %s (retries %s): delivery dropped "
        "(an older copy, retries %d)",
        claim.run_id,
        claim.status,
        delivery.request.id,
        claim.reason,
        delivery.request.retries or 0,
        status=claim.status,
    )
    raise Ignore()


def _replay_own(delivery: Delivery, claim: ClaimResult) -> Any:
    """A redelivery of the run's own succeeded delivery: replay the result unless Celery has it.

    When the row has no result to replay (too large to keep, never kept, older
    than ``result_expires``, or of a content type ``result_accept_content``
    refuses), the delivery fails with :class:`RunFailed` (``result_not_kept``,
    ``result_expired``, ``result_not_accepted``): Celery stores ``FAILURE``, so
    the caller, the chord and ``link_error`` resolve instead of waiting for a
    result nobody will store. Under ``ignore_result`` or without a result
    backend nobody waits: the delivery is dropped.
    """
    own_id = delivery.request.id
    if not own_id or _celery_state(delivery, own_id) in states.READY_STATES:
        raise Ignore()
    return _replay_row(delivery, claim)


def _replay_row(delivery: Delivery, claim: ClaimResult) -> Any:
    """The row's kept result for the run's own task id, or RunFailed saying why there is none."""
    own_id = delivery.request.id
    found = _wait_for_its_worker(delivery, claim)
    if not _asked(delivery):
        raise Ignore()  # nobody can ask for the result: nothing to resolve
    if found is None or not found.has_result():
        raise _not_replayed(
            claim,
            "result_not_kept",
            "it was not kept (recorded by fence(complete=True) before the body returned it, "
            "over 64 KiB, or not serializable)",
        )
    if _expired(delivery, found):
        raise _not_replayed(claim, "result_expired", "it was kept longer ago than result_expires")
    try:
        result = found.result()
    except Exception as exc:
        raise _not_replayed(
            claim, "result_not_accepted", f"it could not be decoded: {describe_exception(exc)}"
        ) from None
    logger.info(
        "celery-lease: run %s succeeded before Celery stored it: result replayed for task %s",
        claim.run_id,
        own_id,
    )
    return result


def _wait_for_its_worker(delivery: Delivery, claim: ClaimResult) -> Outcome | None:
    """The run's row as an :class:`Outcome` (None when unreadable), once it ended at least
    ``lease_seconds`` ago (:data:`REPLAY_GRACE_SECONDS` at least): before that, the
    worker that ended it may be storing its outcome in Celery right now (a redelivery
    racing it), so this delivery is sent again to look after that (Celery's ``Ignore``),
    :data:`RESULT_WAIT_TRIES` times at most."""
    found = _row_outcome(delivery, claim.run_id)
    if found is not None and delivery.request.retries < RESULT_WAIT_TRIES:
        grace = max(REPLAY_GRACE_SECONDS, delivery.config.lease_seconds)
        left = _grace_left(delivery, found, grace)
        if left > 0:
            reschedule(delivery, max(left, REPLAY_GRACE_SECONDS / 2), Ignore())
    return found


def _asked(delivery: Delivery) -> bool:
    """False where nobody can ask for this delivery's result: ``ignore_result`` (on the
    task or the call) or no result backend."""
    task = delivery.task
    if task.ignore_result or delivery.request.ignore_result:
        return False
    return result_format(task.app).backend


def _not_replayed(claim: ClaimResult, code: str, why: str) -> RunFailed:
    """What a redelivery reports when the run succeeded but its result cannot be replayed."""
    text = f"the run succeeded, but Celery has no result for task {claim.task_id} and {why}"
    logger.warning("celery-lease: run %s: %s: reporting RunFailed(%s)", claim.run_id, text, code)
    return RunFailed(claim.run_id, code, text)


def _expired(delivery: Delivery, found: Outcome) -> bool:
    """True when the row's result is older than ``result_expires`` (database clock)."""
    try:
        now = delivery.runtime.store.now_ms()
    except LeaseDatabaseError:
        return False
    return result_expired(delivery.task.app, found.record, now)


def _grace_left(delivery: Delivery, found: Outcome, seconds: float) -> float:
    """How long until the run ended ``seconds`` ago (database clock); 0 once it has."""
    ended = found.record.finished_at or found.record.updated_at
    if ended is None:
        return 0.0
    try:
        now = delivery.runtime.store.now_ms()
    except LeaseDatabaseError:
        return seconds
    return max(0.0, (ended + seconds * 1000 - now) / 1000)


def _row_outcome(delivery: Delivery, run_id: str) -> Outcome | None:
    try:
        row = delivery.runtime.store.get(run_id)
    except LeaseDatabaseError:
        return None
    return None if row is None else Outcome(delivery.task.app, row)


def mark_revoked(delivery: Delivery) -> None:
    """Record this delivery's task as ``REVOKED`` in the result backend (a cancelled run)."""
    task, request = delivery.task, delivery.request
    task_id = request.id
    if not task_id or request.called_directly or task.ignore_result:
        return
    try:
        task.backend.mark_as_revoked(task_id, "cancelled", request=request)
    except Exception as exc:
        logger.warning(
            "celery-lease: could not mark %s revoked: %s", task_id, describe_exception(exc)
        )


def _result_of(delivery: Delivery, claim: ClaimResult) -> Any:
    """The run's result for a duplicate: Celery's stored one, else the row's; else it waits.

    Where nobody can ask for the result (``ignore_result``, no result backend)
    the delivery is dropped. It never reports a result it does not have: while
    neither holds it (a ``replace()`` still running, Celery's ``result_expires``
    passed), the delivery is published again
    like a busy duplicate, at most ``RESULT_WAIT_TRIES`` times, then fails
    with :class:`RunFailed` (``result_unavailable``).
    """
    if not _asked(delivery):
        raise Ignore()  # nobody can ask for this delivery's result: nothing to report
    meta = _celery_meta(delivery, claim.task_id)
    if meta is not None and meta.get("status") == states.SUCCESS:
        return meta.get("result")
    found = _row_outcome(delivery, claim.run_id)
    if found is not None and found.has_result() and not _expired(delivery, found):
        try:
            return found.result()
        except Exception as exc:
            logger.warning(
                "celery-lease: run %s: stored result not used: %s",
                claim.run_id,
                describe_exception(exc),
            )
    config, retries = delivery.config, delivery.request.retries
    if retries < RESULT_WAIT_TRIES:
        # Succeeded in the lease table, not (yet) stored anywhere we can read:
        # ask again shortly (a replacement still running, a replay to come).
        reschedule(delivery, busy_delay(config, 0.2, retries), Ignore())
    logger.warning(
        "celery-lease: run %s succeeded but its result (task %s) is neither in the result "
        "backend nor kept in the row: reporting RunFailed(result_unavailable)",
        claim.run_id,
        claim.task_id,
    )
    raise RunFailed(claim.run_id, "result_unavailable", "the run's result is not available")


def _failure_of(delivery: Delivery, claim: ClaimResult) -> BaseException:
    """The exception a failed run ended with: Celery's stored one, else :class:`RunFailed`."""
    meta = _celery_meta(delivery, claim.task_id) if claim.task_id else None
    if meta is not None and meta.get("status") == states.FAILURE:
        try:
            error = delivery.task.backend.exception_to_python(meta.get("result"))
        except Exception:
            error = None
        if isinstance(error, BaseException):
            return error
    try:
        row = delivery.runtime.store.get(claim.run_id)
    except LeaseDatabaseError:
        row = None
    return RunFailed(
        claim.run_id,
        row.failure_code if row is not None else None,
        row.last_error if row is not None else None,
    )


def _celery_meta(delivery: Delivery, task_id: str | None) -> dict[str, Any] | None:
    """Celery's stored state of ``task_id``, or None without a readable result backend."""
    task = delivery.task
    if not task_id or task.ignore_result:
        return None
    if delivery.request.is_eager and not task.app.conf.task_store_eager_result:
        return None  # Celery stores no eager result (and warns when asked for one)
    try:
        meta: dict[str, Any] = task.backend.get_task_meta(task_id)
    except Exception:  # no result backend (DisabledBackend), or it is down
        return None
    return meta


def _celery_state(delivery: Delivery, task_id: str | None) -> str | None:
    meta = _celery_meta(delivery, task_id)
    return None if meta is None else str(meta.get("status"))
