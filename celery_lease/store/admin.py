"""Operator statements: expire, cancel, retention and the CLI's reads."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, case, delete, func, or_, select, update

from .. import schema
from ..errors import RunNotFound, RunNotRerunnable
from ..schema import db_now_ms, runs
from .base import StoreBase, _db_errors
from .records import PURGE_BATCH, Activity, RunRecord


class Control(StoreBase):
    """Expire and cancel runs; purge finished ones."""

    @_db_errors
    def expire(self, run_id: str) -> bool:
        """End a running run's lease now, so another worker may take it over.

        For operators and tests of the lease-lost path. Returns True when a
        running lease was expired.
        """
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status == schema.RUNNING)
            .values(lease_expires_at=now, updated_at=now)
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def cancel(self, run_id: str, *, task_id: str | None = None) -> str:
        """Cancel a run: queued/retrying end ``cancelled`` at once; running get a request.

        Returns the resulting status (``cancelled``, or ``running`` with
        ``cancel_requested_at`` set, or the status it has when nothing changed).
        With ``task_id``, only a run whose own delivery has that Celery task id
        is touched (a revoked duplicate never cancels the run it duplicates).
        Raises :class:`RunNotFound` for an unknown id.
        """
        now = db_now_ms()
        own = (
            runs.c.id == run_id
            if task_id is None
            else and_(runs.c.id == run_id, runs.c.task_id == task_id)
        )
        at_once = (
            update(runs)
            .where(own, runs.c.status.in_((schema.QUEUED, schema.RETRYING)))
            .values(
                status=schema.CANCELLED,
                failure_code="cancelled",
                cancel_requested_at=now,
                lease_expires_at=now,  # when it ended: `lease top` counts recent ends by it
                finished_at=now,
                updated_at=now,
            )
        )
        request = (
            update(runs)
            .where(own, runs.c.status == schema.RUNNING)
            .values(
                cancel_requested_at=func.coalesce(runs.c.cancel_requested_at, now),
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            if conn.execute(at_once).rowcount == 1:
                return schema.CANCELLED
            if conn.execute(request).rowcount == 1:
                return schema.RUNNING
            row = conn.execute(
                select(runs.c.status, runs.c.task_id).where(runs.c.id == run_id)
            ).first()
        if row is None:
            raise RunNotFound(run_id)
        status, own_task_id = row
        if status not in schema.TERMINAL_STATUSES and (task_id is None or own_task_id == task_id):
            return self.cancel(run_id, task_id=task_id)  # it changed status between statements
        return str(status)

    @staticmethod
    def _purgeable(status: str, older_than_ms: int) -> Any:
        """Rows of finished ``status`` that finished more than ``older_than_ms`` ago (DB clock)."""
        if status not in schema.TERMINAL_STATUSES:
            raise ValueError(f"only finished runs can be purged, not {status!r} ones")
        if older_than_ms < 0:
            raise ValueError(f"older_than_ms must be >= 0, got {older_than_ms}")
        # A scalar subquery, evaluated once: an index bound (clock_timestamp() is
        # volatile, so PostgreSQL would filter every row of the status instead).
        cutoff = select(db_now_ms() - older_than_ms).scalar_subquery()
        return and_(runs.c.status == status, runs.c.finished_at < cutoff)

    @_db_errors
    def purge_finished(self, status: str, older_than_ms: int, limit: int = PURGE_BATCH) -> int:
        """Delete the oldest ``limit`` rows of ``status`` finished over ``older_than_ms`` ago.

        Only terminal rows (``succeeded``, ``failed``, ``cancelled``) are ever
        touched. One short transaction, in the order of the
        ``(status, finished_at)`` index; on PostgreSQL and MySQL the rows are
        picked ``FOR UPDATE SKIP LOCKED``, so a concurrent purge or a locked row
        is skipped, never waited for. Returns how many rows were deleted.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        purgeable = self._purgeable(status, older_than_ms)
        oldest = (
            select(runs.c.id)
            .where(purgeable)
            .order_by(runs.c.finished_at)
            .limit(limit)
            .with_for_update(skip_locked=True)  # SQLite compiles no FOR UPDATE
        )
        if self._ops.delete_by_subquery:
            # The rows are locked (PostgreSQL) or the writer is alone (SQLite) and
            # were picked by the guard: no second filter.
            with self._auto.connect() as conn:
                return int(conn.execute(delete(runs).where(self._ops.picked(oldest))).rowcount)
        # MySQL refuses LIMIT in an IN subquery: pick, then delete, in one transaction.
        with self.engine.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if not ids:
                return 0
            return int(conn.execute(delete(runs).where(runs.c.id.in_(ids), purgeable)).rowcount)

    @_db_errors
    def count_finished(self, status: str, older_than_ms: int) -> int:
        """How many rows :meth:`purge_finished` would delete now, by index; read only."""
        stmt = select(func.count()).select_from(runs).where(self._purgeable(status, older_than_ms))
        with self._auto.connect() as conn:
            return int(conn.execute(stmt).scalar_one())


class OperatorReads(StoreBase):
    """The CLI's reads (``runs``, ``show``, ``stats``, ``top``) and ``rerun``."""

    @_db_errors
    def list_runs(
        self, *, status: str | None = None, task_name: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        """Up to ``limit`` runs, newest first, filtered by status and task name; read only."""
        stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id).limit(max(0, limit))
        if status is not None:
            stmt = stmt.where(runs.c.status == status)
        if task_name is not None:
            stmt = stmt.where(runs.c.task_name == task_name)
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
    def stats(self, *, window_ms: int = 3_600_000) -> dict[str, Any]:
        """Per-status counts, live and expired leases, oldest running run, recent expiries.

        Read only, four statements (not one snapshot), each answered from the
        ``(status, ...)`` indexes: the counts from the status index alone, the
        rest from live rows and recently failed ones, never the whole table's
        rows. Keys: ``now`` (DB clock,
        epoch ms), ``counts`` (status -> rows), ``live_leases`` (running, lease
        unexpired), ``expired_leases`` (running, lease expired: awaiting takeover
        or the sweeper), ``oldest_running`` (a :class:`RunRecord` or None),
        ``lease_expired_recent`` (rows with ``failure_code = 'lease_expired'``
        updated within ``window_ms``; a finished row is last updated when it finished).
        """
        now = db_now_ms()
        running = runs.c.status == schema.RUNNING
        per_status = select(runs.c.status, func.count()).group_by(runs.c.status)
        leases = select(
            func.sum(case((runs.c.lease_expires_at > now, 1), else_=0)),
            func.sum(case((runs.c.lease_expires_at <= now, 1), else_=0)),
        ).where(running)
        oldest = (
            select(runs)
            .where(running)
            .order_by(runs.c.started_at.is_(None), runs.c.started_at, runs.c.id)
            .limit(1)
        )
        # A scalar subquery is an index bound (a volatile clock is not); only
        # live rows and runs that failed within the window can carry the code.
        since = select(now - window_ms).scalar_subquery()
        recent = select(now, func.count()).where(
            runs.c.failure_code == "lease_expired",
            or_(
                and_(
                    runs.c.status.in_((schema.QUEUED, schema.RUNNING, schema.RETRYING)),
                    runs.c.updated_at >= since,
                ),
                and_(runs.c.status == schema.FAILED, runs.c.finished_at >= since),
            ),
        )
        with self._auto.connect() as conn:
            grouped = conn.execute(per_status).all()
            live, expired = conn.execute(leases).one()
            oldest_row = conn.execute(oldest).mappings().first()
            db_now, expired_recent = conn.execute(recent).one()
        return {
            "now": int(db_now),
            "counts": {str(r[0]): int(r[1]) for r in grouped},
            "live_leases": int(live or 0),
            "expired_leases": int(expired or 0),
            "oldest_running": None if oldest_row is None else RunRecord(**dict(oldest_row)),
            "lease_expired_recent": int(expired_recent),
        }

    @_db_errors
    def rerun(self, run_id: str, *, attempts: int, force: bool = False) -> RunRecord:
        """Put a ``failed``/``cancelled`` run (``succeeded`` too with ``force``) back to ``queued``.

        One guarded UPDATE (``WHERE status IN (...)``), so a run a worker holds
        or has queued is never touched. The run gets ``attempts`` fresh attempts
        without lowering ``attempt``, the fencing token: ``max_attempts`` becomes
        ``attempt + attempts``. Owner, lease, cancel request, failure and times
        of the ended series are cleared; the stored message (if any) and the
        run's own ``task_id`` are kept. Returns the row as it is now. Raises
        :class:`RunNotFound`, or :class:`RunNotRerunnable` with the status found.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        allowed = [schema.FAILED, schema.CANCELLED] + ([schema.SUCCEEDED] if force else [])
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status.in_(allowed))
            .values(
                status=schema.QUEUED,
                max_attempts=runs.c.attempt + attempts,
                lease_owner=None,
                lease_expires_at=None,
                heartbeat_at=None,
                available_at=now,
                cancel_requested_at=None,
                started_at=None,
                finished_at=None,
                last_error=None,
                failure_code=None,
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        record = self.get(run_id)
        if record is None:
            raise RunNotFound(run_id)
        if changed != 1:
            raise RunNotRerunnable(run_id, record.status)
        return record

    @_db_errors
    def live_leases(self, limit: int = 50) -> list[RunRecord]:
        """Up to ``limit`` running runs, soonest lease expiry first; read only.

        An index range on ``(status, lease_expires_at)``: the expired leases
        (awaiting takeover or the sweeper) come first.
        """
        stmt = (
            select(runs)
            .where(runs.c.status == schema.RUNNING)
            .order_by(runs.c.lease_expires_at, runs.c.id)
            .limit(max(0, limit))
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
    def activity(self, now: int, window_ms: int = 60_000) -> Activity:
        """Counts of live runs per status, and of the runs that ended or went
        ``retrying`` within ``window_ms`` before ``now``; one read-only statement.

        ``now`` is the database clock (:meth:`now_ms`), passed as a value: the
        planner then sees the window's bound and reads only index ranges on
        ``(status, lease_expires_at)``, never the whole table (a bound computed
        in the statement from the volatile clock hides its selectivity, and
        PostgreSQL scans the table). Read: every live row, plus the terminal and
        ``retrying`` rows whose lease ended inside the window (each end of an
        attempt sets ``lease_expires_at`` to that moment).
        """
        since = now - window_ms
        live = (schema.QUEUED, schema.RUNNING, schema.RETRYING)
        recent = runs.c.lease_expires_at >= since
        stmt = (
            select(
                runs.c.status,
                func.count(),
                func.sum(case((recent, 1), else_=0)),
                func.sum(case((runs.c.attempt > 1, 1), else_=0)),
                func.sum(case((runs.c.lease_expires_at <= now, 1), else_=0)),
            )
            .where(
                or_(
                    runs.c.status.in_(live),
                    and_(runs.c.status.in_(sorted(schema.TERMINAL_STATUSES)), recent),
                )
            )
            .group_by(runs.c.status)
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).all()
        counts = {str(r[0]): int(r[1]) for r in rows if r[0] in live}
        ended = {str(r[0]): int(r[1]) for r in rows if r[0] not in live}
        by_status = {str(r[0]): r for r in rows}
        retrying = by_status.get(schema.RETRYING)
        running = by_status.get(schema.RUNNING)
        return Activity(
            now=now,
            window_ms=window_ms,
            counts={status: counts.get(status, 0) for status in live},
            ended_recently={
                status: ended.get(status, 0) for status in sorted(schema.TERMINAL_STATUSES)
            },
            retried_recently=0 if retrying is None else int(retrying[2] or 0),
            running_retries=0 if running is None else int(running[3] or 0),
            expired_leases=0 if running is None else int(running[4] or 0),
        )
