"""Recovery: kept deliveries, expired leases, stale queued runs, shutdown hand-back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, case, func, or_, select, update

from ..errors import LeaseLost
from ..schema import (
    CANCELLED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    TERMINAL_STATUSES,
    db_now_ms,
    runs,
)
from .base import _db_errors
from .outcomes import Outcomes
from .records import RunRecord


class Recovery(Outcomes):
    """What the sweeper and the worker's shutdown run."""

    @_db_errors
    def keep_delivery(
        self,
        run_id: str,
        *,
        task_name: str,
        task_id: str,
        payload: bytes,
        payload_content_type: str,
        lease_ms: int,
        max_attempts: int,
        available_in: float = 0.0,
        concurrency_key: str | None = None,
    ) -> bool:
        """Leave a delivery the broker refused to the sweeper; True when a sweep will send it.

        No row: a ``queued`` row (attempt 0) carrying the message and ``task_id``,
        available after ``available_in`` s, which :meth:`reclaim_stale` finds.
        A row that is not terminal and whose own delivery is this one (or that
        has no stored message, which it then takes) is left as it is:
        ``queued``/``retrying`` rows are reclaimed, a ``running`` one ends or is
        handed back by :meth:`sweep_expired`. A terminal row, or one whose own
        delivery has another task id, cannot carry this delivery: False.
        """
        now = db_now_ms()
        waiting = {
            "id": run_id,
            "task_name": task_name,
            "status": QUEUED,
            "lease_owner": None,
            "lease_ms": lease_ms,
            "attempt": 0,
            "max_attempts": max_attempts,
            "available_at": now + round(max(0.0, available_in) * 1000),
            "concurrency_key": concurrency_key,
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
            "created_at": now,
            "updated_at": now,
        }
        adopt = runs.c.payload.is_(None)
        keeps = and_(
            runs.c.status.not_in(sorted(TERMINAL_STATUSES)),
            or_(adopt, func.coalesce(runs.c.task_id, runs.c.id) == task_id),
        )
        if self._upsert:
            insert_stmt = self._ops.insert(runs).values(waiting)
            excluded = insert_stmt.excluded
            stmt = insert_stmt.on_conflict_do_update(
                index_elements=[runs.c.id],
                set_={
                    "task_id": case((adopt, excluded.task_id), else_=runs.c.task_id),
                    "payload": func.coalesce(runs.c.payload, excluded.payload),
                    "payload_content_type": case(
                        (adopt, excluded.payload_content_type),
                        else_=runs.c.payload_content_type,
                    ),
                },
                where=keeps,
            ).returning(runs.c.id)
            with self._auto.connect() as conn:
                return conn.execute(stmt).first() is not None
        # MySQL: no upsert with a condition; the same in one short locked transaction.
        # A claim inserting the row meanwhile makes it fail (a duplicate key or a
        # deadlock): the caller then treats the delivery as not kept.
        adopted = {
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
        }
        with self.engine.begin() as conn:
            found = conn.execute(
                select(runs.c.id).where(runs.c.id == run_id).with_for_update()
            ).first()
            if found is None:
                conn.execute(self._ops.insert(runs).values(waiting))
                return True
            conn.execute(update(runs).where(runs.c.id == run_id, adopt, keeps).values(adopted))
            kept = conn.execute(select(runs.c.id).where(runs.c.id == run_id, keeps)).first()
            return kept is not None

    @_db_errors
    def sweep_expired(self, limit: int = 500) -> list[tuple[RunRecord, str]]:
        """End or hand back running runs whose lease expired (DB clock), at most ``limit``.

        Each row moves, by a statement guarded on owner, attempt, status and the
        expiry, to ``retrying`` (available now), or ``failed`` with
        ``lease_expired`` when attempts are spent, or ``cancelled`` when a cancel
        was requested. Only rows this call moved are returned, so two sweepers
        never both act on the same expired lease. On PostgreSQL and MySQL the
        rows are read ``FOR UPDATE SKIP LOCKED``: a row locked by a stalled
        transaction is skipped this time, never waited for.
        """
        # A scalar subquery is an index bound; the volatile clock itself would be
        # a filter evaluated on every running row.
        now = select(db_now_ms()).scalar_subquery()
        query = (
            select(runs)
            .where(runs.c.status == RUNNING, runs.c.lease_expires_at <= now)
            .order_by(runs.c.lease_expires_at)
            .limit(limit)
        )
        if self._ops.skip_locked:
            query = query.with_for_update(skip_locked=True)
        moved: list[tuple[RunRecord, str]] = []
        with self.engine.begin() as conn:
            for row in conn.execute(query).mappings().all():
                record = RunRecord(**dict(row))
                status = self._sweep_one(record, conn)
                if status is not None:
                    moved.append((record, status))
        return moved

    def _sweep_one(self, record: RunRecord, conn: Connection) -> str | None:
        """The guarded transition of one expired lease, in the sweep's transaction ``conn``;
        None if it changed meanwhile."""
        now = db_now_ms()
        values: dict[str, Any] = {"updated_at": now, "lease_expires_at": now}
        if record.cancel_requested_at is not None:
            status = CANCELLED
            values.update(failure_code="cancelled", finished_at=now)
        elif record.attempt >= record.max_attempts:
            status = FAILED
            values.update(
                failure_code="lease_expired",
                last_error=f"lease expired on attempt {record.attempt} of {record.max_attempts}"
                " (worker lost or stalled)",
                finished_at=now,
            )
        else:
            status = RETRYING
            values.update(
                available_at=now,
                failure_code="lease_expired",
                last_error=f"lease expired on attempt {record.attempt} (worker lost or stalled)",
            )
        stmt = (
            update(runs)
            .where(
                runs.c.id == record.id,
                runs.c.lease_owner == record.lease_owner,
                runs.c.attempt == record.attempt,
                runs.c.status == RUNNING,
                runs.c.lease_expires_at <= now,
            )
            .values(status=status, **values)
        )
        return status if conn.execute(stmt).rowcount == 1 else None

    @_db_errors
    def reclaim_stale(self, older_than: float, limit: int = 500) -> list[RunRecord]:
        """Queued/retrying runs available for ``older_than`` s yet never claimed.

        Their delivery was most likely lost (a broker that does not redeliver, a
        failed publish). Each returned row had ``available_at`` moved to now by
        a guarded statement, so concurrent sweepers return disjoint rows.
        """
        now = db_now_ms()
        with self._auto.connect() as conn:
            rows = (
                conn.execute(
                    select(runs)
                    .where(
                        runs.c.status.in_((QUEUED, RETRYING)),
                        runs.c.available_at <= now - round(older_than * 1000),
                        runs.c.cancel_requested_at.is_(None),
                        # No message: a direct call or eager apply(); never sent to workers.
                        runs.c.payload.is_not(None),
                    )
                    .order_by(runs.c.available_at)
                    .limit(limit)
                )
                .mappings()
                .all()
            )
            taken: list[RunRecord] = []
            for row in rows:
                record = RunRecord(**dict(row))
                stmt = (
                    update(runs)
                    .where(
                        runs.c.id == record.id,
                        runs.c.status == record.status,
                        runs.c.attempt == record.attempt,
                        runs.c.available_at == record.available_at,
                    )
                    .values(available_at=db_now_ms(), updated_at=db_now_ms())
                )
                if conn.execute(stmt).rowcount == 1:
                    taken.append(record)
        return taken

    @_db_errors
    def release_owned_by(self, worker_id: str) -> list[RunRecord]:
        """Hand back every running lease taken by the worker whose id is ``worker_id``.

        Used on a worker's cold shutdown. Owners taken inside a worker end in
        ``.<worker id>`` (a random id per worker, see ``celery_lease.app.worker_id``),
        so another worker is never touched, even one with the same node name.
        Each release is guarded like :meth:`release`; the released rows are returned.
        """
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        with self._auto.connect() as conn:
            rows = (
                conn.execute(
                    select(runs).where(
                        runs.c.status == RUNNING,
                        runs.c.lease_owner.endswith(f".{worker_id}", autoescape=True),
                    )
                )
                .mappings()
                .all()
            )
        released: list[RunRecord] = []
        for row in rows:
            record = RunRecord(**dict(row))
            try:
                self.release(record.id, str(record.lease_owner), record.attempt)
            except LeaseLost:
                continue
            released.append(record)
        return released
