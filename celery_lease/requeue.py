"""Publishing a run's stored message again: for the sweep and the worker's shutdown hand-back."""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime, timezone
from typing import Any

from celery import Celery
from kombu.serialization import loads, prepare_accept_content

from .errors import LeaseError
from .events import Event
from .runtime import app_runtime
from .sanitize import describe_exception
from .schema import CANCELLED
from .store import LeaseStore, RunRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SweepReport:
    """What one sweep did, as lists of run ids."""

    requeued: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    cancelled: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    #: Steps besides the runs' recovery that failed, each ``step: error`` (held
    #: deliveries, follow-ups, retention, the sweep's record); the other steps ran.
    steps_failed: list[str] = dataclasses.field(default_factory=list)
    #: Finished rows deleted by the retention step, per status.
    purged: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Deliveries held by flow control that the sweep published.
    released: list[str] = dataclasses.field(default_factory=list)
    #: Follow-up tasks (task ids) the sweep published: their sender died after its commit.
    followups: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (the sweep task's result)."""
        return dataclasses.asdict(self)


class MessageNotAccepted(LeaseError):
    """A stored message is in a format the app's ``accept_content`` does not allow.

    It is never deserialized: a table row must not run code.
    """

    code = "payload_not_accepted"


#: Options a re-publish drops: the run is due now, whatever the stored message said.
_DELAY_OPTIONS = ("countdown", "eta")


def decode_message(app: Celery, payload: bytes, content_type: str) -> dict[str, Any]:
    """Decode a stored message, only with a serializer in the app's ``accept_content``.

    Raises:
        MessageNotAccepted: the content type is not accepted; nothing was decoded.
    """
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    if content_type not in accept:
        raise MessageNotAccepted(
            f"payload_not_accepted: stored message is {content_type!r}, "
            f"accept_content allows {sorted(accept)}"
        )
    body: Any = loads(payload, content_type, "utf-8", accept=accept)  # type: ignore[no-untyped-call]
    if not isinstance(body, dict):
        raise MessageNotAccepted("payload_not_accepted: stored message is not a mapping")
    return body


#: Message header naming the run of a delivery whose task id is not the run's id:
#: ``celery lease rerun`` publishes a run under a new task id (see :func:`rerun_headers`).
RUN_ID_HEADER = "celery_lease_run_id"
#: Message header naming the task id a rerun's new task id follows.
RERUN_OF_HEADER = "celery_lease_rerun_of"
#: Message header naming the task id a rerun's :data:`RUN_ID_HEADER` is for: the one
#: the rerun was published under.
RERUN_TASK_ID_HEADER = "celery_lease_rerun_task_id"


def header_run_id(request: Any) -> str | None:
    """The run id a delivery has from its :data:`RUN_ID_HEADER` (a rerun), else None.

    Only for the message the rerun published (:data:`RERUN_TASK_ID_HEADER` names its
    task id): a body that hands its own headers on to another message (a page of a
    paginating task, another task) must not make that message take over the rerun's
    run. A rerun published before that header existed has none and keeps its run id."""
    value = header_value(request, RUN_ID_HEADER)
    if not value:
        return None
    meant_for = header_value(request, RERUN_TASK_ID_HEADER)
    if meant_for is not None and meant_for != request.id:
        return None
    return str(value)


#: Message header of a delivery celery-lease publishes again. ``"copy"``: a copy of a
#: delivery that already claimed its run (the sweeper's, a hand-back, a retry after a
#: loss or a failure, a follow-up's publish); a later delivery of the finished run
#: under its own task id is then a duplicate, dropped. ``"caller"``: a delivery sent
#: again before it claimed (busy, a claim error, a rate slot), still the caller's.
COPY_HEADER = "celery_lease_copy"
COPY = "copy"
CALLER = "caller"


def header_value(request: Any, name: str) -> Any:
    """The custom header ``name`` of a delivery: in its headers or, as Celery's
    protocol 2 also hands custom headers over, an attribute of the request."""
    value: Any = (getattr(request, "headers", None) or {}).get(name)
    if value is None:
        value = getattr(request, name, None)
    return value


def callers_publish(request: Any) -> bool:
    """True when the delivery ``request`` is a caller's publish (``apply_async``, a canvas
    applied, again with a task id already used), not a broker redelivery (``redelivered``),
    nor Celery's own retry message (``retries`` above 0), nor a copy celery-lease made of a
    delivery that already claimed its run."""
    info = getattr(request, "delivery_info", None) or {}
    if info.get("redelivered") or header_value(request, "redelivered"):
        return False
    if (getattr(request, "retries", 0) or 0) > 0:
        return False  # Celery's own retry message, which a copy of it may have beaten
    return bool(header_value(request, COPY_HEADER) != COPY)


def copy_headers(headers: Any, kind: str) -> dict[str, Any]:
    """``headers`` marked as a copy of ``kind`` (:data:`COPY` or :data:`CALLER`)."""
    return {**dict(headers or {}), COPY_HEADER: kind}


def rerun_headers(
    run_id: str, previous_task_id: str | None, task_id: str, headers: Any
) -> dict[str, Any]:
    """``headers`` with the run id, the previous task id and the task id of a rerun
    published under ``task_id`` added."""
    return {
        **dict(headers or {}),
        RUN_ID_HEADER: run_id,
        RERUN_OF_HEADER: previous_task_id or run_id,
        RERUN_TASK_ID_HEADER: task_id,
    }


def requeue(app: Celery, record: RunRecord, *, rerun_of: str | None = None) -> None:
    """Publish the run's stored delivery again: the message Celery itself would send.

    The stored message is what ``Task.signature_from_request`` keeps of the
    delivery that claimed the run: its task id (the one the caller holds), chain,
    chord, group, links, parent and root ids, headers, retries, routing, expiry
    and time limits. With ``rerun_of`` (``celery lease rerun``: the task id the
    message carried) it goes out under the row's ``task_id`` instead, a new one
    that no revoke list holds, without its stored ``expires``, and with headers
    naming the run and ``rerun_of``, so the delivery claims the same run.
    """
    if record.payload is None or record.payload_content_type is None:
        raise ValueError(f"run {record.id} has no stored message to publish again")
    body = decode_message(app, record.payload, record.payload_content_type)
    dropped = (*_DELAY_OPTIONS, "expires", "task_id") if rerun_of else _DELAY_OPTIONS
    options = {
        key: value for key, value in dict(body.get("options") or {}).items() if key not in dropped
    }
    args = list(body.get("args") or ())
    kwargs = dict(body.get("kwargs") or {})
    # The run's own delivery claimed it: whatever this sends again is a copy of it.
    options["headers"] = copy_headers(options.get("headers"), COPY)
    options.setdefault("task_id", record.task_id or record.id)
    if rerun_of:
        options["headers"] = rerun_headers(
            record.id, rerun_of, options["task_id"], options.get("headers")
        )
    task = app.tasks.get(record.task_name)
    if task is not None:
        task.apply_async(args, kwargs, **options)
    else:
        app.send_task(record.task_name, args=args, kwargs=kwargs, **options)


def message_expired(app: Celery, record: RunRecord) -> bool:
    """True when the stored message carries an ``expires`` that has passed (worker clock).

    Celery itself revokes an expired message on arrival; publishing it again
    would only have it revoked again.
    """
    if record.payload is None or record.payload_content_type is None:
        return False
    try:
        expires = decode_message(app, record.payload, record.payload_content_type)
    except Exception:
        return False
    value = dict(expires.get("options") or {}).get("expires")
    if value is None:
        return False
    if isinstance(value, (int, float)):
        return False  # a relative expiry was already turned into a date when sent
    when = value if isinstance(value, datetime) else _parse_time(str(value))
    if when is None:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when <= datetime.now(timezone.utc)


def _parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def requeue_all(
    app: Celery,
    records: list[RunRecord],
    report: SweepReport,
    action: str,
    store: LeaseStore | None = None,
) -> None:
    """Re-enqueue each record, noting successes and failures in ``report``.

    A record whose stored message is not accepted is ended ``failed``
    (``payload_not_accepted``) through ``store``, and never decoded. A record
    with no stored message (a direct call or eager ``apply()``) is left for a
    real delivery to claim.
    """
    events = app_runtime(app).events
    for record in records:
        if record.payload is None:
            continue
        try:
            if store is not None and message_expired(app, record):
                if store.refuse_message(
                    record, "expired", "the message expired (expires)", status=CANCELLED
                ):
                    report.cancelled.append(record.id)
                    events.emit(
                        Event.SWEPT,
                        record.id,
                        "run %s: message expired",
                        record.id,
                        action="expired",
                    )
                continue
            requeue(app, record)
        except MessageNotAccepted as exc:
            report.failed.append(record.id)
            events.emit(
                Event.SWEEP_ERROR,
                record.id,
                "run %s: %s",
                record.id,
                exc,
                level=logging.ERROR,
                failure_code=exc.code,
            )
            if store is not None:
                try:
                    store.refuse_message(record, exc.code, str(exc))
                except LeaseError as db_exc:  # recorded next sweep: it is refused again
                    report.errors.append(record.id)
                    logger.warning("run %s: %s", record.id, describe_exception(db_exc))
            continue
        except Exception as exc:
            report.errors.append(record.id)
            events.emit(
                Event.SWEEP_ERROR,
                record.id,
                "run %s: could not re-enqueue: %s",
                record.id,
                describe_exception(exc),
                level=logging.ERROR,
            )
            continue
        report.requeued.append(record.id)
        events.emit(
            Event.SWEPT, record.id, "run %s: re-enqueued (%s)", record.id, action, action=action
        )
