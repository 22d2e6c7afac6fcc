"""Retention: deleting finished run rows, in bounded batches.

The sweeper calls :func:`purge` once per sweep with ``lease_retention`` and a
per-sweep limit; ``celery lease purge`` calls it with the operator's age,
statuses and batch size, and no limit. Each batch is one short transaction
(:meth:`~celery_lease.store.LeaseStore.purge_finished`), so no purge holds
locks for long, however many rows it removes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from .errors import LeaseError
from .events import LOG_ONLY, Event, EventLog
from .sanitize import describe_exception
from .schema import CANCELLED, FAILED, SUCCEEDED
from .store import PURGE_BATCH, LeaseStore

logger = logging.getLogger(__name__)

#: The finished statuses, in the order they are purged and reported.
FINISHED = (SUCCEEDED, FAILED, CANCELLED)

#: Rows one sweep deletes at most: ten batches. A larger backlog is drained over
#: later sweeps, or at once with ``celery lease purge``.
SWEEP_PURGE_LIMIT = 10 * PURGE_BATCH

#: Seconds of deleting one sweep may spend: no batch starts that would end past
#: it (judged by the batch before), so a sweep facing a backlog stays short.
SWEEP_PURGE_BUDGET = 0.025

#: Rate buckets one delete statement removes at most (each named by its key pair).
RATE_PURGE_BATCH = 200


@dataclasses.dataclass
class PurgeReport:
    """Rows deleted (or, for a dry run, found) per finished status."""

    removed: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FINISHED, 0))
    batches: int = 0
    #: Why the sweeper's retention step stopped (:func:`sweep_retention`), if it did.
    error: str | None = None

    @property
    def total(self) -> int:
        """Rows over all statuses."""
        return sum(self.removed.values())


def purge(
    store: LeaseStore,
    older_than: float,
    *,
    statuses: Iterable[str] = FINISHED,
    batch: int = PURGE_BATCH,
    limit: int | None = None,
    progress: Callable[[PurgeReport], None] | None = None,
    throttle: bool = False,
    budget: float | None = None,
) -> PurgeReport:
    """Delete rows of ``statuses`` finished more than ``older_than`` seconds ago (DB clock).

    One batch of at most ``batch`` rows per status in turn, until every status
    comes back short of a full batch, or ``limit`` rows are gone. ``progress``
    is called after each batch. Live rows are never touched. With ``throttle``
    each batch is followed by a pause as long as the batch took, so a long
    purge spends at most half its time in the database and claims keep their
    latency. With ``budget`` (seconds), no batch starts that would, at the pace
    of the batch before it, end past the budget; the first batch always runs.

    Raises:
        ValueError: a status that is not finished, or a bad age, batch or limit.
        LeaseDatabaseError: a batch failed; the batches before it stay deleted.
    """
    chosen = set(statuses)
    wanted = [s for s in FINISHED if s in chosen]
    unknown = chosen - set(FINISHED)
    if unknown:
        raise ValueError(f"only finished runs can be purged, not {sorted(unknown)}")
    if batch < 1 or (limit is not None and limit < 1):
        raise ValueError("batch and limit must be >= 1")
    older_than_ms = round(older_than * 1000)
    report = PurgeReport()
    pending = list(wanted)
    began = time.monotonic()
    last = 0.0  # how long the batch before took
    while pending:
        for status in list(pending):
            size = batch if limit is None else min(batch, limit - report.total)
            if size < 1:
                return report
            started = time.monotonic()
            if budget is not None and started - began + last > budget:
                return report
            removed = store.purge_finished(status, older_than_ms, size)
            last = time.monotonic() - started
            if throttle and removed == size:  # more to come: leave the database be a while
                time.sleep(time.monotonic() - started)
            report.removed[status] += removed
            report.batches += 1
            if removed < size:
                pending.remove(status)
            if progress is not None:
                progress(report)
    return report


def count(store: LeaseStore, older_than: float, statuses: Iterable[str] = FINISHED) -> PurgeReport:
    """What :func:`purge` would delete now, per status; read only."""
    report = PurgeReport()
    chosen = set(statuses)
    for status in FINISHED:
        if status in chosen:
            report.removed[status] = store.reads.count_finished(status, round(older_than * 1000))
    return report


def sweep_retention(
    store: LeaseStore,
    retention: float | None,
    limit: int = SWEEP_PURGE_LIMIT,
    budget: float | None = SWEEP_PURGE_BUDGET,
    events: EventLog = LOG_ONLY,
) -> PurgeReport:
    """The sweeper's retention step: at most ``limit`` rows older than ``retention`` s,
    in batches started within ``budget`` seconds.

    ``None`` keeps every row. A database error is logged (``purge_error``) and
    leaves the rest for the next sweep: retention never stops recovery. The
    step is reported on ``events`` (the app's bus, from the sweeper).
    """
    report = PurgeReport()
    if retention is None:
        return report
    try:
        report = purge(store, retention, limit=limit, budget=budget)
    except LeaseError as exc:
        events.emit(
            Event.PURGE_ERROR,
            None,
            "celery-lease: retention purge failed, retried next sweep: %s",
            describe_exception(exc),
            level=logging.WARNING,
        )
        report.error = describe_exception(exc)
        return report
    if report.total:
        events.emit(
            Event.PURGED,
            None,
            "celery-lease: deleted %d finished runs older than %.0fs (%s)",
            report.total,
            retention,
            ", ".join(f"{s} {n}" for s, n in report.removed.items() if n),
            count=report.total,
        )
    return report


def expire_results(
    store: LeaseStore,
    expires_ms: int | None,
    limit: int | None = SWEEP_PURGE_LIMIT,
    events: EventLog = LOG_ONLY,
    *,
    dry_run: bool = False,
) -> int:
    """The sweeper's and ``lease purge``'s step for Celery's ``result_expires``: drop the
    result kept for a replay in at most ``limit`` (None: every) succeeded rows that
    finished ``expires_ms`` ago or more. With ``dry_run`` only counts them.

    ``None`` (results never expire) keeps them until ``lease_retention``. A
    database error is logged (``purge_error``) and left for the next sweep.
    Returns how many results were dropped.
    """
    if expires_ms is None:
        return 0
    if dry_run:
        return store.count_expired_results(store.now_ms() - expires_ms)
    try:
        cleared = 0
        before = store.now_ms() - expires_ms
        while limit is None or cleared < limit:
            size = PURGE_BATCH if limit is None else min(PURGE_BATCH, limit - cleared)
            done = store.clear_results(before, size)
            cleared += done
            if done < size:
                break
    except LeaseError as exc:
        events.emit(
            Event.PURGE_ERROR,
            None,
            "celery-lease: expired results not cleared, retried next sweep: %s",
            describe_exception(exc),
            level=logging.WARNING,
        )
        return 0
    if cleared:
        events.emit(
            Event.RESULTS_EXPIRED,
            None,
            "celery-lease: dropped %d kept results older than result_expires (%.0fs)",
            cleared,
            expires_ms / 1000,
            count=cleared,
        )
    return cleared


def purge_rates(
    store: LeaseStore,
    limit: int | None = SWEEP_PURGE_LIMIT,
    events: EventLog = LOG_ONLY,
    *,
    dry_run: bool = False,
) -> int:
    """Delete the rate buckets of idle rate keys: rows whose last slot has passed (they
    carry nothing a fresh bucket would not), at most ``limit`` (None: every one), in
    batches. Emitted as ``rates_purged``; a database error is logged (``purge_error``)
    and left for the next sweep. With ``dry_run`` only counts them. Returns how many.
    """
    if dry_run:
        return store.flow.count_idle_rates()
    removed = 0
    try:
        while limit is None or removed < limit:
            size = RATE_PURGE_BATCH
            if limit is not None:
                size = min(size, limit - removed)
            done = store.flow.purge_idle_rates(size)
            removed += done
            if done < size:
                break
    except LeaseError as exc:
        events.emit(
            Event.PURGE_ERROR,
            None,
            "celery-lease: idle rate keys not deleted, retried next sweep: %s",
            describe_exception(exc),
            level=logging.WARNING,
        )
    if removed:
        events.emit(
            Event.RATES_PURGED,
            None,
            "celery-lease: deleted %d idle rate keys",
            removed,
            count=removed,
        )
    return removed
