"""Claiming a run: the upsert, the locked claim, the concurrency-limited claim."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from sqlalchemy import Connection, func, select, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .. import dberrors
from ..schema import QUEUED, RUNNING, check_claim_inputs, db_now_ms, runs
from .base import _db_errors
from .driver import _lock_wait_ended
from .records import CLAIM_CONTENTION_TRIES, ClaimResult
from .refusal import ClaimRefusal
from .statements import Statements

logger = logging.getLogger(__name__)


class Claims(Statements, ClaimRefusal):
    """Insert a run or take it over (:meth:`claim`)."""

    @_db_errors
    def claim(
        self,
        run_id: str,
        owner: str,
        *,
        task_name: str,
        lease_ms: int,
        max_attempts: int,
        concurrency_key: str | None = None,
        max_concurrency: int | None = None,
        payload: bytes | None = None,
        payload_content_type: str | None = None,
        task_id: str | None = None,
    ) -> ClaimResult:
        """Insert the run or take it over, atomically; ``attempt`` grows by one per claim.

        A run is taken over when it is queued/retrying and available, or running
        with an expired lease, and has attempts left and no cancel request.
        Otherwise nothing changes and the result says why (busy or finished).
        With ``max_concurrency``, the claim also waits (busy, reason
        ``concurrency``) while that many live leases share ``concurrency_key``;
        the count and the claim happen under one lock on the key. ``task_id``
        is the claiming delivery's Celery task id, recorded as the run's own.
        """
        check_claim_inputs(
            run_id=run_id,
            task_name=task_name,
            owner=owner,
            lease_ms=lease_ms,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
            payload=payload,
            task_id=task_id,
        )
        values = {
            "id": run_id,
            "task_name": task_name,
            "status": RUNNING,
            "lease_owner": owner,
            "lease_ms": lease_ms,
            "attempt": 1,
            "max_attempts": max_attempts,
            "concurrency_key": concurrency_key,
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
        }
        limit = max_concurrency if concurrency_key is not None else None
        for tries in range(1, CLAIM_CONTENTION_TRIES + 1):
            try:
                return self._claim_once(values, lease_ms, max_attempts, limit)
            except SQLAlchemyError as exc:
                if isinstance(exc, DBAPIError) and _lock_wait_ended(exc):
                    # A transaction holds the row (a worker frozen inside fence()):
                    # that is a live owner as far as this claim can tell.
                    return ClaimResult(
                        "busy", run_id, owner, 0, RUNNING, self.bounds.lock, reason="locked"
                    )
                found = dberrors.classify(exc, self.dialect)
                if found.cause not in dberrors.CLAIM_CONTENTION:
                    raise
                if tries == CLAIM_CONTENTION_TRIES:
                    logger.info(
                        "celery-lease: claim of %s kept losing to concurrent claims (%s)",
                        run_id,
                        found.cause,
                        extra={"lease_event": "claim_contention", "run_id": run_id},
                    )
                    break
            # Jittered, growing pause: the winner usually commits within it.
            time.sleep(random.uniform(0, 0.002 * 2**tries))
        return ClaimResult("busy", run_id, owner, 0, QUEUED, 0.05, reason="race")

    def _claim_once(
        self, values: dict[str, Any], lease_ms: int, max_attempts: int, limit: int | None
    ) -> ClaimResult:
        """One claim attempt (see :meth:`claim`); contention errors propagate."""
        run_id, owner = values["id"], values["lease_owner"]
        if limit is not None:
            limited = self._claim_limited(values, lease_ms, max_attempts, limit)
            if isinstance(limited, ClaimResult):
                return limited
            row = limited
        elif self._upsert:
            row = self._claim_upsert(values, lease_ms, max_attempts)
        else:
            with self.engine.begin() as conn:
                row = self._claim_locked(conn, values, lease_ms, max_attempts)
        if row is not None:
            return ClaimResult("claimed", run_id, owner, row[0], RUNNING, max_attempts=row[2])
        return self._claim_refused(run_id, owner, max_attempts)

    def _claim_upsert(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> tuple[int, int, int] | None:
        """Run the prebuilt claim upsert; the new attempt and expiry, or None."""
        params = {
            "p_id": values["id"],
            "p_task_name": values["task_name"],
            "p_owner": values["lease_owner"],
            "p_lease_ms": lease_ms,
            "p_max_attempts": max_attempts,
            "p_concurrency_key": values["concurrency_key"],
            "p_task_id": values["task_id"],
            "p_payload": values["payload"],
            "p_payload_content_type": values["payload_content_type"],
        }
        if conn is not None:
            row = conn.execute(self._claim_stmt, params).first()
        elif self._claim_driver is not None:
            row = self._claim_driver.execute(params)[1]
        else:
            with self._auto.connect() as auto:
                row = auto.execute(self._claim_stmt, params).first()
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]))

    def _claim_limited(
        self, values: dict[str, Any], lease_ms: int, max_attempts: int, limit: int
    ) -> ClaimResult | tuple[int, int, int] | None:
        """Claim under a per-key lock, only while fewer than ``limit`` live leases share the key.

        The count and the claim run in one transaction, under the dialect's
        key lock (:class:`_KeyLock`): PostgreSQL a transaction-scoped advisory
        try-lock, SQLite the write lock of ``BEGIN IMMEDIATE``, MySQL the count
        as a locking read.
        """
        key = values["concurrency_key"]
        now = db_now_ms()
        with self.engine.begin() as conn:
            if not self._ops.key_lock.acquire(conn, key):
                return ClaimResult(
                    "busy",
                    values["id"],
                    values["lease_owner"],
                    0,
                    RUNNING,
                    0.5,
                    reason="concurrency",
                )
            live = conn.execute(
                self._ops.key_lock.count_live(
                    select(func.count(), func.min(runs.c.lease_expires_at - now)).where(
                        runs.c.concurrency_key == key,
                        runs.c.status == RUNNING,
                        runs.c.lease_expires_at > now,
                        runs.c.id != values["id"],
                    )
                )
            ).one()
            if int(live[0]) >= limit:
                left_ms = max(0, int(live[1] or 0))
                self._record_waiting(conn, values, left_ms)
                left = left_ms / 1000.0
                return ClaimResult(
                    "busy",
                    values["id"],
                    values["lease_owner"],
                    0,
                    RUNNING,
                    left,
                    reason="concurrency",
                )
            if self._upsert:
                return self._claim_upsert(values, lease_ms, max_attempts, conn)
            return self._claim_locked(conn, values, lease_ms, max_attempts)

    def _record_waiting(self, conn: Connection, values: dict[str, Any], wait_ms: int) -> None:
        """Record a run waiting for a concurrency slot as ``queued`` (with its arguments).

        If its re-published delivery is lost, the sweeper finds the row stranded
        after ``available_at`` (the latest a slot must free) and re-enqueues it.
        """
        now = db_now_ms()
        waiting = {
            **values,
            "status": QUEUED,
            "lease_owner": None,
            "attempt": 0,
            "available_at": now + wait_ms,
            "created_at": now,
            "updated_at": now,
        }
        bump = {"available_at": now + wait_ms, "updated_at": now}
        if self._upsert:
            conn.execute(
                self._ops.insert(runs)
                .values(waiting)
                .on_conflict_do_update(
                    index_elements=[runs.c.id], set_=bump, where=runs.c.status == QUEUED
                )
            )
            return
        changed = conn.execute(
            update(runs).where(runs.c.id == values["id"], runs.c.status == QUEUED).values(bump)
        ).rowcount
        exists = conn.execute(select(runs.c.id).where(runs.c.id == values["id"])).first()
        if not changed and exists is None:
            conn.execute(self._ops.insert(runs).values(waiting))

    def _claim_locked(
        self, conn: Connection, values: dict[str, Any], lease_ms: int, max_attempts: int
    ) -> tuple[int, int, int] | None:
        """The same claim with a row lock, inside the caller's transaction (MySQL).

        Concurrent first claims of one id can deadlock (both hold the gap lock
        of the missing row) or collide on the insert; both errors propagate to
        :meth:`claim`, which retries them as contention.
        """
        current = conn.execute(
            select(runs.c.attempt).where(runs.c.id == values["id"]).with_for_update()
        ).first()
        if current is None:
            conn.execute(self._ops.insert(runs).values(self._insert_values(values, lease_ms)))
            attempt = 1
        else:
            changed = conn.execute(
                update(runs)
                .where(runs.c.id == values["id"], self._claimable(max_attempts))
                .values(
                    self._takeover_values(values["lease_owner"], lease_ms, max_attempts, values)
                )
            ).rowcount
            if changed != 1:
                return None
            attempt = int(current[0]) + 1
        expires, ceiling = conn.execute(
            select(runs.c.lease_expires_at, runs.c.max_attempts).where(runs.c.id == values["id"])
        ).one()
        return attempt, int(expires), int(ceiling)
