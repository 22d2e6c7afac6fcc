"""Why a claim changed nothing, and ending runs no claim can take."""

from __future__ import annotations

from sqlalchemy import and_, case, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from .. import dberrors, schema
from ..schema import db_now_ms, runs
from .base import StoreBase, _db_errors
from .records import ClaimResult
from .statements import ended_values


class ClaimRefusal(StoreBase):
    """Explain a refused claim; end runs that can never be claimed."""

    def _claim_refused(self, run_id: str, owner: str, max_attempts: int) -> ClaimResult:
        """Why a claim changed nothing; ends runs that can never be claimed again."""
        for _ in range(5):
            now = db_now_ms()
            with self._auto.connect() as conn:
                row = conn.execute(
                    select(
                        runs.c.status,
                        runs.c.attempt,
                        runs.c.cancel_requested_at,
                        runs.c.lease_expires_at - now,
                        runs.c.available_at - now,
                        runs.c.task_id,
                        runs.c.max_attempts,
                    ).where(runs.c.id == run_id)
                ).first()
            if row is None:
                return ClaimResult("busy", run_id, owner, 0, schema.QUEUED, 0.0)
            status, attempt, cancel_requested, lease_left, available_left, task_id, ceiling = row
            max_attempts = max(max_attempts, int(ceiling))
            if status in schema.TERMINAL_STATUSES:
                return ClaimResult("finished", run_id, owner, attempt, status, task_id=task_id)
            wait_ms = lease_left if status == schema.RUNNING else available_left
            claimable = wait_ms is None or wait_ms <= 0
            if claimable and cancel_requested is not None:
                if self._end_unclaimable(
                    run_id, status, attempt, schema.CANCELLED, "cancelled", None
                ):
                    return ClaimResult(
                        "finished", run_id, owner, attempt, schema.CANCELLED, task_id=task_id
                    )
                continue
            if claimable and attempt >= max_attempts:
                code = "lease_expired" if status == schema.RUNNING else "attempts_exhausted"
                error = f"attempts exhausted: {attempt} of {max_attempts} used"
                if self._end_unclaimable(run_id, status, attempt, schema.FAILED, code, error):
                    return ClaimResult(
                        "finished", run_id, owner, attempt, schema.FAILED, task_id=task_id
                    )
                continue
            if claimable:
                # It became claimable between our two statements: try again soon.
                return ClaimResult("busy", run_id, owner, attempt, status, 0.0, reason="race")
            return ClaimResult(
                "busy",
                run_id,
                owner,
                attempt,
                status,
                max(0, wait_ms) / 1000.0,
                reason="lease" if status == schema.RUNNING else "backoff",
            )
        return ClaimResult("busy", run_id, owner, 0, schema.RUNNING, 0.0)

    def _end_unclaimable(
        self,
        run_id: str,
        status: str,
        attempt: int,
        new_status: str,
        failure_code: str,
        error: str | None,
    ) -> bool:
        """Move a run nobody may claim any more to a terminal status, if unchanged since read."""
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status == status, runs.c.attempt == attempt)
            .values(
                status=new_status,
                failure_code=failure_code,
                last_error=case((runs.c.last_error.is_(None), error), else_=runs.c.last_error)
                if error
                else runs.c.last_error,
                lease_expires_at=now,  # when it ended: `lease top` counts recent ends by it
                finished_at=now,
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def end_unclaimed(
        self, run_id: str, *, task_name: str, max_attempts: int, failure_code: str, error: str
    ) -> str:
        """End a run whose claim cannot succeed: ``failed`` with ``failure_code``.

        For a claim that failed on a database error (permanent, or transient
        with its retries spent). A run held by a live lease of another owner
        is left alone (that owner finishes it); a terminal run keeps its
        status; a run with no row gets a ``failed`` row without arguments.
        Returns the run's status afterwards.
        """
        now = db_now_ms()
        ended = ended_values(now, schema.FAILED, failure_code, error)
        stmt = (
            update(runs)
            .where(
                runs.c.id == run_id,
                or_(
                    runs.c.status == schema.QUEUED,
                    runs.c.status == schema.RETRYING,
                    and_(runs.c.status == schema.RUNNING, runs.c.lease_expires_at <= now),
                ),
            )
            .values(ended)
        )
        with self._auto.connect() as conn:
            if conn.execute(stmt).rowcount == 1:
                return schema.FAILED
            status = conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar()
            if status is not None:
                return str(status)
            row = {
                "id": run_id,
                "task_name": task_name,
                "lease_ms": 1,
                "attempt": 0,
                "max_attempts": max_attempts,
                "available_at": now,
                "created_at": now,
                **ended,
            }
            try:
                conn.execute(self._ops.insert(runs).values(row))
            except SQLAlchemyError as exc:
                if dberrors.classify(exc, self.dialect).cause != "duplicate_key":
                    raise
                return self.end_unclaimed(
                    run_id,
                    task_name=task_name,
                    max_attempts=max_attempts,
                    failure_code=failure_code,
                    error=error,
                )
        return schema.FAILED
