"""Recovery of runs whose worker died: the ``celery_lease.sweep`` task and its logic."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from .requeue import SweepReport, requeue_all
from .retention import SWEEP_PURGE_BUDGET, SWEEP_PURGE_LIMIT, sweep_retention
from .run.outcome import record_ended
from .runtime import app_config, app_runtime, store_for
from .schema import CANCELLED, FAILED
from .store import LeaseStore, RunRecord

logger = logging.getLogger(__name__)

SWEEP_TASK_NAME = "celery_lease.sweep"
BEAT_ENTRY_NAME = "celery-lease-sweep"


def sweep(
    app: Celery,
    store: LeaseStore | None = None,
    *,
    limit: int = 500,
    stale_after: float | None = None,
    purge_limit: int = SWEEP_PURGE_LIMIT,
    purge_budget: float | None = SWEEP_PURGE_BUDGET,
) -> SweepReport:
    """Recover expired and stranded runs once, then apply ``lease_retention``.

    Expired ``running`` leases are handed back and re-enqueued (or end
    ``failed``/``cancelled``); ``retrying`` runs available for longer than
    ``stale_after`` seconds (default: sweep interval + lease length) without a
    claim are re-enqueued too, since their message was lost. Last, at most
    ``purge_limit`` finished rows older than ``lease_retention`` are deleted,
    in batches started within ``purge_budget`` seconds (0 rows skips the step).
    """
    config = app_config(app)
    store = store or store_for(app)
    events = app_runtime(app).events
    report = SweepReport()
    to_requeue: list[RunRecord] = []
    for record, status in store.sweep_expired(limit):
        if status == FAILED:
            report.failed.append(record.id)
            events.emit(
                "swept",
                record.id,
                "run %s: lease expired, attempts spent",
                record.id,
                action="failed",
            )
        elif status == CANCELLED:
            report.cancelled.append(record.id)
            events.emit("swept", record.id, "run %s: cancelled", record.id, action="cancelled")
        else:
            to_requeue.append(record)
    requeue_all(app, to_requeue, report, "expired", store)
    if stale_after is None:
        stale_after = config.sweep_interval + config.lease_seconds
    requeue_all(app, store.reclaim_stale(stale_after, limit), report, "stranded", store)
    record_ended(app, store, report.failed + report.cancelled)
    if purge_limit:
        report.purged.update(
            sweep_retention(store, config.retention, purge_limit, purge_budget, events).removed
        )
    return report


def register_sweep_task(app: Celery) -> None:
    """Define ``celery_lease.sweep`` on ``app`` (the worker bootstep calls this at startup)."""
    if SWEEP_TASK_NAME in app.tasks:  # the bootstep runs after the app is finalized
        return

    @app.task(  # type: ignore[untyped-decorator]
        name=SWEEP_TASK_NAME, shared=False, ignore_result=True, lazy=False
    )
    def celery_lease_sweep() -> dict[str, Any]:
        return sweep(app).as_dict()
