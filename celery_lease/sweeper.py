"""Recovery of runs whose worker died: the ``celery_lease.sweep`` task and its logic."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from celery import Celery

from . import followups
from .errors import LeadershipLost, LeaseError, migrate_hint
from .events import Event
from .flow import SLOT_KEPT_MS, release
from .requeue import SweepReport, requeue_all
from .retention import (
    SWEEP_PURGE_BUDGET,
    SWEEP_PURGE_LIMIT,
    expire_results,
    purge_rates,
    sweep_retention,
)
from .run.outcome import record_ended
from .runtime import (
    app_config,
    app_runtime,
    lease_databases,
    result_format,
    runtime_for,
    store_for,
)
from .sanitize import describe_exception, safe_url
from .schema import CANCELLED, FAILED
from .store import LeaseStore, RunRecord
from .store.leaders import LeaderTerm

logger = logging.getLogger(__name__)

SWEEP_TASK_NAME = "celery_lease.sweep"
BEAT_ENTRY_NAME = "celery-lease-sweep"
#: The name under which beat's sweep task records its sweeps (``celery_lease_sweeps``).
BEAT_SWEEPER = "beat"


def sweep(
    app: Celery,
    store: LeaseStore | None = None,
    *,
    limit: int = 500,
    stale_after: float | None = None,
    purge_limit: int = SWEEP_PURGE_LIMIT,
    purge_budget: float | None = SWEEP_PURGE_BUDGET,
    name: str = BEAT_SWEEPER,
    leader: LeaderTerm | None = None,
) -> SweepReport:
    """Recover expired and stranded runs on one lease database once, then apply
    ``lease_retention``, and record the sweep there under ``name``.

    Expired ``running`` leases are handed back and re-enqueued (or end
    ``failed``/``cancelled``), ``limit`` at a time, batch after batch while they come
    full, for at most half of ``lease_sweep_interval``; ``retrying`` runs available for longer than
    ``stale_after`` seconds (default: sweep interval + lease length) without a
    claim are re-enqueued too, since their message was lost; a run the sweeper
    already published ``max_attempts`` times since its last claim ends
    ``failed`` (``undeliverable``) instead. Last, at most ``purge_limit``
    finished rows older than ``lease_retention`` are deleted, in batches started
    within ``purge_budget`` seconds, then as many results kept for a replay past
    Celery's ``result_expires`` are dropped and idle rate keys' buckets deleted
    (0 rows skips these steps). ``store`` defaults
    to the app's ``lease_database_url``; :func:`sweep_all` sweeps every database.

    ``leader``: the in-worker sweeper's leader term. The steps that change runs
    (expired leases, stranded runs) and the sweep's record are then each fenced by
    it in their own transaction: once another worker took the lead, the next such
    step raises :class:`~celery_lease.errors.LeadershipLost` and changes nothing.
    (Publishing held deliveries and retention are guarded on their own rows.)
    """
    config = app_config(app)
    store = store or store_for(app)
    events = app_runtime(app).events
    started = time.monotonic()
    report = SweepReport()
    # Batches of ``limit`` while they come full (a worker with many runs died), for at
    # most half a sweep interval: the next sweep goes on from there.
    expired_until = started + max(1.0, config.sweep_interval / 2)
    while True:
        batch = store.sweep_expired(limit, leader=leader)
        to_requeue: list[RunRecord] = []
        for record, status in batch:
            if status == FAILED:
                report.failed.append(record.id)
                events.emit(
                    Event.SWEPT,
                    record.id,
                    "run %s: lease expired, attempts spent",
                    record.id,
                    action="failed",
                )
            elif status == CANCELLED:
                report.cancelled.append(record.id)
                events.emit(
                    Event.SWEPT, record.id, "run %s: cancelled", record.id, action="cancelled"
                )
            else:
                to_requeue.append(record)
        requeue_all(app, to_requeue, report, "expired", store)
        if len(batch) < limit or time.monotonic() >= expired_until:
            break
    if stale_after is None:
        stale_after = config.sweep_interval + config.lease_seconds
    stranded: list[RunRecord] = []
    for record, status in store.reclaim_stale(stale_after, limit, leader=leader):
        if status == FAILED:
            report.failed.append(record.id)
            events.emit(
                Event.SWEPT,
                record.id,
                "run %s: published %d times and never claimed: ended failed (undeliverable)",
                record.id,
                record.requeues,
                level=logging.WARNING,
                action="undeliverable",
            )
        else:
            stranded.append(record)
    requeue_all(app, stranded, report, "stranded", store)
    try:
        # Flow control's backstop: deliveries a resume did not publish (it died
        # halfway), and rate-limited ones coming due that no pump is sending.
        report.released.extend(release(app, store, limit=limit))
        # Retention of recorded rate slots whose delivery never came to take them.
        store.flow.drop_stale_slots(SLOT_KEPT_MS, limit)
    except LeaseError as exc:
        report.steps_failed.append(f"held deliveries: {describe_exception(exc)}")
        logger.warning(
            "celery-lease: could not publish held deliveries%s: %s",
            migrate_hint(exc),
            describe_exception(exc),
            extra={"lease_event": Event.SWEEP_ERROR},
        )
    followups.sweep(app, store, report, limit=limit)
    record_ended(app, store, report.failed + report.cancelled)
    if purge_limit:
        retained = sweep_retention(store, config.retention, purge_limit, purge_budget, events)
        report.purged.update(retained.removed)
        if retained.error is not None:
            report.steps_failed.append(f"retention: {retained.error}")
        expire_results(store, result_format(app).expires_ms, purge_limit, events)
        purge_rates(store, purge_limit, events)
    _record(app, store, name, report, time.monotonic() - started, leader)
    return report


def _record(
    app: Celery,
    store: LeaseStore,
    name: str,
    report: SweepReport,
    took: float,
    leader: LeaderTerm | None = None,
) -> None:
    """Record the sweep in ``celery_lease_sweeps``; a failure is logged, never raised
    (the runs were swept: only the liveness record is missing), except a fenced record
    refused (:class:`~celery_lease.errors.LeadershipLost`)."""
    database = store.engine.url.render_as_string(hide_password=True)
    try:
        store.record_sweep(
            name,
            sweeper=f"{socket.gethostname()}:{os.getpid()}",
            took_ms=round(took * 1000),
            requeued=len(report.requeued) + len(report.released),
            failed=len(report.failed),
            cancelled=len(report.cancelled),
            purged=sum(report.purged.values()),
            errors=len(report.errors),
            leader=leader,
        )
    except LeadershipLost:
        raise
    except LeaseError as exc:
        report.steps_failed.append(f"sweep record: {describe_exception(exc)}")
        logger.warning(
            "celery-lease: could not record the sweep of %s%s: %s",
            database,
            migrate_hint(exc),
            describe_exception(exc),
            extra={"lease_event": Event.SWEEP_RECORD_ERROR},
        )
        return
    app_runtime(app).events.emit(
        Event.SWEEP_DONE,
        None,
        "celery-lease: swept %s in %.0f ms",
        database,
        took * 1000,
        level=logging.DEBUG,
        database=database,
        swept_at=time.time(),
    )


def sweep_all(
    app: Celery, *, limit: int = 500, name: str = BEAT_SWEEPER
) -> dict[str, SweepReport | str]:
    """:func:`sweep` every lease database ``app`` uses: its ``lease_database_url`` and
    each leased task's own.

    Returns, per database URL (password masked), its report, or the one-line
    error that stopped its sweep; one unreachable database never stops the others.
    """
    reports: dict[str, SweepReport | str] = {}
    for config in lease_databases(app):
        shown = safe_url(config.database_url)
        try:
            store = runtime_for(app, config).store
            reports[shown] = sweep(app, store, limit=limit, name=name)
        except LeaseError as exc:
            reports[shown] = describe_exception(exc)
            logger.error(
                "celery-lease: could not sweep %s: %s",
                shown,
                reports[shown],
                extra={"lease_event": Event.SWEEP_ERROR},
            )
    return reports


def register_sweep_task(app: Celery) -> None:
    """Define ``celery_lease.sweep`` on ``app`` (the worker bootstep calls this at startup)."""
    if SWEEP_TASK_NAME in app.tasks:  # the bootstep runs after the app is finalized
        return

    @app.task(  # type: ignore[untyped-decorator]
        name=SWEEP_TASK_NAME, shared=False, ignore_result=True, lazy=False
    )
    def celery_lease_sweep() -> dict[str, Any]:
        return {
            database: report if isinstance(report, str) else report.as_dict()
            for database, report in sweep_all(app).items()
        }
