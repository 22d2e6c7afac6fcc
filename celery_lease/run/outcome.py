"""A run's outcome, recorded where Celery's caller sees it: the result backend.

One owner for every path that ends a run outside Celery's own trace of the
body: the sweeper (attempts spent, cancelled), ``lease cancel``, a delivery of
a run that already ended. From the lease row (the source of truth) it writes
``SUCCESS`` with the stored result, ``FAILURE`` with :class:`RunFailed` and the
failure code, or ``REVOKED``, through Celery's own backend API
(``mark_as_done``, ``mark_as_failure``, ``mark_as_revoked``), so the chord
counter, the chain and ``link_error`` behave as Celery's. The Celery request
context those need (chord, group, chain, links) is rebuilt from the run's
stored message; a row's message is decoded only with a serializer in the app's
``accept_content``, its result only under ``result_accept_content`` (else
``accept_content``, as Celery does): a row never runs code.

The body's return value is kept in the row by the guarded completion itself
(:func:`kept_result`: the app's ``result_serializer``, at most
``MAX_RESULT_BYTES``, a content type the result is decoded under; not at all
under ``ignore_result`` or without a result backend). It is not cleared with
the message on success: a replay may need it, until Celery's ``result_expires``
(the sweeper clears it, and an older one is never replayed) or ``lease_retention``
deletes the row.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signature, states
from celery.app.task import Context
from kombu.serialization import dumps, loads

from ..errors import LeaseError, RunFailed
from ..requeue import MessageNotAccepted, decode_message
from ..runtime import result_format
from ..sanitize import describe_exception
from ..schema import CANCELLED, FAILED, MAX_RESULT_BYTES, SUCCEEDED
from ..store import LeaseStore, RunRecord

logger = logging.getLogger(__name__)


def encode_result(app: Celery, value: Any) -> tuple[bytes, str] | None:
    """``value`` serialized for the row, ``(bytes, content type)``; None when it is not kept.

    Not kept: it does not serialize with the app's ``result_serializer``, it is
    over ``MAX_RESULT_BYTES``, or its content type is not one a result is decoded
    under (``result_accept_content``, else ``accept_content``).
    """
    fmt = result_format(app)
    try:
        content_type, _encoding, data = dumps(value, serializer=fmt.serializer)  # type: ignore[no-untyped-call]
    except Exception:
        return None
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > MAX_RESULT_BYTES or content_type not in fmt.accept:
        return None
    return bytes(data), str(content_type)


def kept_result(task: Any, request: Any, value: Any) -> tuple[bytes, str] | None:
    """What the completion keeps in the row for a replay: ``value`` encoded
    (:func:`encode_result`), or None where nobody can ask for it: ``ignore_result``
    on the task or the call, or an app without a result backend."""
    if task.ignore_result or getattr(request, "ignore_result", False):
        return None
    if not result_format(task.app).backend:
        return None
    return encode_result(task.app, value)


def decode_result(app: Celery, data: bytes, content_type: str) -> Any:
    """A stored result, decoded only under ``result_accept_content`` (``accept_content``
    when unset, as Celery's result backends do).

    Raises:
        MessageNotAccepted: the content type is not accepted; nothing was decoded.
    """
    accept = result_format(app).accept
    if content_type not in accept:
        raise MessageNotAccepted(
            f"payload_not_accepted: stored result is {content_type!r}, "
            f"result_accept_content allows {sorted(accept)}"
        )
    return loads(data, content_type, "utf-8", accept=accept)  # type: ignore[no-untyped-call]


def result_expired(app: Celery, record: RunRecord, now_ms: int) -> bool:
    """True when ``record``'s kept result is older than Celery's ``result_expires``
    (by the database clock ``now_ms``): Celery would no longer have it either."""
    expires_ms = result_format(app).expires_ms
    ended = record.finished_at or record.updated_at
    return expires_ms is not None and ended is not None and now_ms - ended >= expires_ms


class NoStoredResult(Exception):
    """The row keeps no result for the run (too big, not accepted, or ended by ``fence``)."""


class Outcome:
    """The outcome of one ended run (``record``), as Celery's result backend should hold it.

    Attributes:
        app: the Celery app whose result backend is written.
        record: the run's row.
    """

    def __init__(self, app: Celery, record: RunRecord) -> None:
        self.app = app
        self.record = record

    @property
    def task_id(self) -> str | None:
        """The task id the caller holds: the delivery that ran the run."""
        return self.record.task_id

    def has_result(self) -> bool:
        """True when the row keeps the body's return value."""
        return self.record.result is not None and self.record.result_content_type is not None

    def result(self) -> Any:
        """The body's return value, decoded from the row.

        Raises:
            NoStoredResult: the row keeps none.
            MessageNotAccepted: its content type is not in ``result_accept_content``.
        """
        record = self.record
        if record.result is None or record.result_content_type is None:
            raise NoStoredResult(record.id)
        return decode_result(self.app, bytes(record.result), record.result_content_type)

    def failure(self) -> RunFailed:
        """The exception a failed run reports: :class:`RunFailed` with its failure code."""
        record = self.record
        return RunFailed(record.id, record.failure_code, record.last_error)

    def backend_state(self, task_id: str | None = None) -> str | None:
        """Celery's stored state of ``task_id`` (default: the run's), None without a backend."""
        task_id = task_id or self.task_id
        if not task_id:
            return None
        try:
            return str(self.app.backend.get_task_meta(task_id).get("status"))
        except Exception:  # no result backend (DisabledBackend), or it is down
            return None

    def request(self) -> Context | None:
        """The Celery request context of the run's delivery, rebuilt from its stored message."""
        record = self.record
        if record.payload is None or record.payload_content_type is None:
            return None
        try:
            body = decode_message(self.app, bytes(record.payload), record.payload_content_type)
        except MessageNotAccepted:
            return None
        options = dict(body.get("options") or {})
        return Context(
            id=self.task_id,
            task=record.task_name,
            args=list(body.get("args") or ()),
            kwargs=dict(body.get("kwargs") or {}),
            root_id=options.get("root_id"),
            parent_id=options.get("parent_id"),
            group=options.get("group_id"),
            group_index=options.get("group_index"),
            chord=options.get("chord"),
            chain=options.get("chain"),
            callbacks=options.get("link"),
            errbacks=options.get("link_error"),
            reply_to=options.get("reply_to"),
            ignore_result=bool(options.get("ignore_result", False)),
            delivery_info={},
        )

    def record_in_celery(self) -> bool:
        """Write the run's outcome to Celery's result backend and fire its continuation.

        Once per run: nothing is written when the backend already holds a ready
        state for the task id, or the run has no task id (a direct call).
        Returns True when something was recorded.
        """
        record, task_id = self.record, self.task_id
        if not task_id or record.status not in (SUCCEEDED, FAILED, CANCELLED):
            return False
        if self.backend_state() in states.READY_STATES:
            return False
        request = self.request()
        store = request is None or not request.ignore_result
        backend = self.app.backend
        try:
            if record.status == FAILED:
                backend.mark_as_failure(
                    task_id, self.failure(), None, request=request, store_result=store
                )
            elif record.status == CANCELLED:
                backend.mark_as_revoked(
                    task_id, record.failure_code or "cancelled", request=request, store_result=store
                )
            else:
                result = self.result()
                self._dispatch_continuation(request, result)
                backend.mark_as_done(task_id, result, request=request, store_result=store)
        except NoStoredResult:
            logger.warning(
                "celery-lease: run %s succeeded but keeps no result to record for task %s",
                record.id,
                task_id,
            )
            return False
        except Exception as exc:
            logger.warning(
                "celery-lease: could not record the outcome of run %s (task %s): %s",
                record.id,
                task_id,
                describe_exception(exc),
            )
            return False
        return True

    def _dispatch_continuation(self, request: Context | None, result: Any) -> None:
        """Links, then the next chain step (Celery's trace order, before the result store)."""
        if request is None:
            return
        root_id = request.root_id or self.task_id
        for link in request.callbacks or ():
            signature(link, app=self.app).apply_async(
                (result,), parent_id=self.task_id, root_id=root_id
            )
        chain = request.chain
        if chain:
            step = signature(chain[-1], app=self.app)
            step.apply_async((result,), chain=chain[:-1], parent_id=self.task_id, root_id=root_id)


def record_outcome(app: Celery, record: RunRecord | None) -> bool:
    """Record ``record``'s outcome in Celery's result backend (see :class:`Outcome`)."""
    if record is None:
        return False
    return Outcome(app, record).record_in_celery()


def record_ended(app: Celery, store: LeaseStore, run_ids: list[str]) -> None:
    """Record the outcome of runs the sweeper or a hand-back ended (FAILURE with
    ``RunFailed``, or REVOKED), so their callers resolve and ``link_error`` runs once."""
    for run_id in run_ids:
        try:
            record_outcome(app, store.get(run_id))
        except LeaseError as exc:
            logger.warning(
                "celery-lease: run %s: outcome not recorded: %s", run_id, describe_exception(exc)
            )
