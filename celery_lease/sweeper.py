"""Recovery of runs whose worker died: the ``celery_lease.sweep`` task and its logic."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from celery import Celery
from kombu.serialization import loads

from .config import LeaseConfig
from .events import emit
from .sanitize import describe_exception
from .schema import CANCELLED, FAILED
from .store import LeaseStore, RunRecord

logger = logging.getLogger(__name__)

SWEEP_TASK_NAME = "celery_lease.sweep"
BEAT_ENTRY_NAME = "celery-lease-sweep"


@dataclasses.dataclass
class SweepReport:
    """What one sweep did, as lists of run ids."""

    requeued: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    cancelled: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        """The report as plain data (the sweep task's result)."""
        return dataclasses.asdict(self)


def requeue(app: Celery, record: RunRecord) -> None:
    """Publish the run again from its stored arguments, under its run id as task id."""
    if record.payload is None or record.payload_content_type is None:
        raise ValueError(f"run {record.id} has no stored arguments to re-enqueue from")
    body: dict[str, Any] = loads(  # type: ignore[no-untyped-call]
        record.payload, record.payload_content_type, "utf-8", accept={record.payload_content_type}
    )
    options = dict(body.get("options") or {})
    exchange = options.pop("exchange", None)
    routing_key = options.pop("routing_key", None)
    if exchange:
        options.update(exchange=exchange, routing_key=routing_key)
    elif routing_key:
        options["queue"] = routing_key
    app.send_task(
        record.task_name,
        args=body.get("args") or [],
        kwargs=body.get("kwargs") or {},
        task_id=record.id,
        **options,
    )


def requeue_all(app: Celery, records: list[RunRecord], report: SweepReport, action: str) -> None:
    """Re-enqueue each record, noting successes and failures in ``report``."""
    for record in records:
        try:
            requeue(app, record)
        except Exception as exc:
            report.errors.append(record.id)
            emit(
                "sweep_error",
                record.id,
                "run %s: could not re-enqueue: %s",
                record.id,
                describe_exception(exc),
                level=logging.ERROR,
            )
            continue
        report.requeued.append(record.id)
        emit("swept", record.id, "run %s: re-enqueued (%s)", record.id, action, action=action)


def sweep(
    app: Celery,
    store: LeaseStore | None = None,
    *,
    limit: int = 500,
    stale_after: float | None = None,
) -> SweepReport:
    """Recover expired and stranded runs once.

    Expired ``running`` leases are handed back and re-enqueued (or end
    ``failed``/``cancelled``); ``retrying`` runs available for longer than
    ``stale_after`` seconds (default: sweep interval + lease length) without a
    claim are re-enqueued too, since their message was lost.
    """
    from .app import store_for

    config = LeaseConfig.from_app(app)
    store = store or store_for(app)
    report = SweepReport()
    to_requeue: list[RunRecord] = []
    for record, status in store.sweep_expired(limit):
        if status == FAILED:
            report.failed.append(record.id)
            emit(
                "swept",
                record.id,
                "run %s: lease expired, attempts spent",
                record.id,
                action="failed",
            )
        elif status == CANCELLED:
            report.cancelled.append(record.id)
            emit("swept", record.id, "run %s: cancelled", record.id, action="cancelled")
        else:
            to_requeue.append(record)
    requeue_all(app, to_requeue, report, "expired")
    if stale_after is None:
        stale_after = config.sweep_interval + config.lease_seconds
    requeue_all(app, store.reclaim_stale(stale_after, limit), report, "stranded")
    return report


def register_sweep_task(app: Celery) -> None:
    """Define ``celery_lease.sweep`` on ``app`` (the worker bootstep calls this at startup)."""
    if SWEEP_TASK_NAME in app._tasks:
        return

    @app.task(  # type: ignore[untyped-decorator]
        name=SWEEP_TASK_NAME, shared=False, ignore_result=True, lazy=False
    )
    def celery_lease_sweep() -> dict[str, list[str]]:
        return sweep(app).as_dict()
