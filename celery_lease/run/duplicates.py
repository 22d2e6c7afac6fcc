"""A delivery of a run that already ended: the outcome it reports instead of running."""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.exceptions import Ignore

from ..errors import LeaseDatabaseError, RunFailed
from ..runtime import Runtime
from ..sanitize import describe_exception
from ..schema import CANCELLED, SUCCEEDED
from ..store import ClaimResult
from .republish import busy_delay, reschedule
from .runids import Delivery

logger = logging.getLogger(__name__)

#: How many times a duplicate of a finished run waits for that run's result to be
#: stored by Celery before it gives up and reports ``None``.
RESULT_WAIT_TRIES = 8


def on_finished(delivery: Delivery, claim: ClaimResult) -> Any:
    """A delivery of a run that already ended: the body does not run again.

    Under the run's own task id nothing is written (Celery already has the
    outcome), except a ``FAILURE`` a dangling ``RETRY`` still hides. Under
    another task id (a keyed duplicate, a group or chain member) the caller
    gets the run's outcome as this task's own: its result, its failure, or
    ``REVOKED``, and its continuation proceeds with it.
    """
    own_id = delivery.request.id
    # A NULL task id (a direct call, a row from before migration 0002) is nobody's.
    same = claim.task_id is not None and own_id == claim.task_id
    delivery.events.emit(
        "duplicate_dropped",
        claim.run_id,
        "run %s is already %s: delivery dropped%s",
        claim.run_id,
        claim.status,
        "" if same else f" (its outcome is reported under {own_id})",
        status=claim.status,
    )
    if claim.status == CANCELLED:
        mark_revoked(delivery)
        raise Ignore()
    if claim.status == SUCCEEDED:
        if same:
            raise Ignore()
        return _result_of(delivery, claim)
    if same and _celery_state(delivery, own_id) == states.FAILURE:
        raise Ignore()
    raise _failure_of(delivery, claim)


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
    """The stored result of the run's own task id; waits (re-published) until Celery has it."""
    meta = _celery_meta(delivery, claim.task_id)
    if meta is not None and meta.get("status") == states.SUCCESS:
        return meta.get("result")
    config, retries = delivery.config, delivery.request.retries
    if (
        meta is not None
        and retries < RESULT_WAIT_TRIES
        and _finished_recently(delivery.runtime, claim.run_id, config.lease_seconds)
    ):
        # Succeeded in the lease table, not yet stored by Celery (or fenced
        # inside a body that is still running): ask again shortly.
        reschedule(delivery, busy_delay(config, 0.2, retries), Ignore())
    logger.warning(
        "celery-lease: run %s succeeded but its result (task %s) is not in the result "
        "backend: reporting None",
        claim.run_id,
        claim.task_id,
    )
    return None


def _finished_recently(runtime: Runtime, run_id: str, window: float) -> bool:
    """True when the run ended less than ``window`` s ago (its result may still come)."""
    try:
        row = runtime.store.get(run_id)
        now = runtime.store.now_ms()
    except LeaseDatabaseError:
        return True
    finished = None if row is None else (row.finished_at or row.updated_at)
    return finished is not None and now - finished < window * 1000


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
    try:
        meta: dict[str, Any] = task.backend.get_task_meta(task_id)
    except Exception:  # no result backend (DisabledBackend), or it is down
        return None
    return meta


def _celery_state(delivery: Delivery, task_id: str | None) -> str | None:
    meta = _celery_meta(delivery, task_id)
    return None if meta is None else str(meta.get("status"))
