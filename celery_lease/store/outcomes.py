"""While a lease is held: heartbeat, fence, and the guarded outcomes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, and_, or_, select, tuple_, update

from ..schema import (
    CANCELLED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATUSES,
    db_now_ms,
    runs,
)
from .base import _db_errors
from .records import _CLEARED_MESSAGE, HeartbeatResult, LeaseKey, RunRecord
from .statements import Statements, ended_values


class Outcomes(Statements):
    """Renew, fence and end held leases; each write guarded."""

    @_db_errors
    def heartbeat(self, leases: Iterable[LeaseKey]) -> HeartbeatResult:
        """Renew every given lease that is still held and unexpired, in one statement.

        Each renewed lease expires ``lease_ms`` after the database's now. A lease
        not renewed (taken over, expired, ended) is reported lost. Renewed leases
        whose run has a cancel request are reported in ``cancel_requested``.
        """
        keys = list(leases)
        if not keys:
            return HeartbeatResult(frozenset(), frozenset(), frozenset())
        now = db_now_ms()
        guard = and_(
            tuple_(runs.c.id, runs.c.lease_owner, runs.c.attempt).in_(keys),
            runs.c.status == RUNNING,
            runs.c.lease_expires_at > now,
        )
        renew = (
            update(runs)
            .where(guard)
            .values(lease_expires_at=now + runs.c.lease_ms, heartbeat_at=now, updated_at=now)
        )
        columns = (runs.c.id, runs.c.lease_owner, runs.c.attempt, runs.c.cancel_requested_at)
        if self._upsert:
            with self._auto.connect() as conn:
                rows = conn.execute(renew.returning(*columns)).all()
        else:
            with self.engine.begin() as conn:
                conn.execute(renew)
                rows = conn.execute(select(*columns).where(guard)).all()
        renewed = frozenset((r[0], r[1], int(r[2])) for r in rows)
        cancel = frozenset((r[0], r[1], int(r[2])) for r in rows if r[3] is not None)
        lost = frozenset(keys) - renewed
        return HeartbeatResult(renewed, lost, cancel)

    @_db_errors
    def fence(
        self,
        connection: Connection,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        complete: bool = False,
    ) -> None:
        """Inside the caller's transaction, lock the run row and prove the lease is live.

        Raises :class:`LeaseLost` unless this owner and attempt hold an unexpired
        lease. The row stays locked until the caller's transaction ends, so a
        takeover cannot slip in before the caller's writes commit. With
        ``complete=True`` the run is also marked ``succeeded`` in that same
        transaction: the caller's writes and the completion commit together.
        """
        now = db_now_ms()
        values: dict[str, Any] = {"heartbeat_at": runs.c.heartbeat_at}
        if complete:
            values = self._success_values(now)
        stmt = (
            update(runs)
            .where(self._guarded(run_id, owner, attempt), runs.c.lease_expires_at > now)
            .values(**values)
        )
        if connection.execute(stmt).rowcount != 1:
            raise self._lost(run_id, owner, attempt, "fence refused")

    def _guarded_update(
        self, run_id: str, owner: str, attempt: int, action: str, **values: Any
    ) -> None:
        stmt = update(runs).where(self._guarded(run_id, owner, attempt)).values(**values)
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, f"{action} refused")

    @_db_errors
    def complete(self, run_id: str, owner: str, attempt: int) -> None:
        """Record success; only the current owner of a running run can. Else :class:`LeaseLost`.

        Idempotent for its owner: if this owner and attempt already completed
        the run (``fence(complete=True)``, or a retry after a lost reply), it
        returns quietly.
        """
        params = {"p_id": run_id, "p_owner": owner, "p_attempt": attempt}
        if self._complete_driver is not None:
            if self._complete_driver.execute(params)[0] == 1:
                return
        else:
            with self._auto.connect() as conn:
                if conn.execute(self._complete_stmt, params).rowcount == 1:
                    return
        row = self.get(run_id)
        if row and row.status == SUCCEEDED and row.lease_owner == owner and row.attempt == attempt:
            return
        raise self._lost(run_id, owner, attempt, "complete refused")

    @_db_errors
    def fail(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        error: str,
        failure_code: str,
        retry_in: float | None,
        message: tuple[bytes, str] | None = None,
    ) -> str:
        """Record a failed attempt: ``retrying`` after ``retry_in`` s, or ``failed`` when None.

        Guarded like :meth:`complete`. Returns the new status. ``message``
        (payload, content type) replaces the stored message of a retrying run,
        e.g. with the retry Celery published; a failed run keeps its message for
        ``lease rerun``.
        """
        now = db_now_ms()
        status = FAILED if retry_in is None else RETRYING
        values: dict[str, Any] = {
            "status": status,
            "last_error": error,
            "failure_code": failure_code,
            "updated_at": now,
        }
        values["lease_expires_at"] = now
        if retry_in is None:
            values.update(finished_at=now)
        else:
            values["available_at"] = now + round(retry_in * 1000)
            if message is not None:
                values.update(payload=message[0], payload_content_type=message[1])
        self._guarded_update(run_id, owner, attempt, "fail", **values)
        return status

    @_db_errors
    def release(self, run_id: str, owner: str, attempt: int, *, available_in: float = 0.0) -> None:
        """Hand a held lease back: ``retrying``, claimable after ``available_in`` s."""
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "release",
            status=RETRYING,
            available_at=now + round(available_in * 1000),
            lease_expires_at=now,
            updated_at=now,
        )

    @_db_errors
    def end(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        status: str,
        failure_code: str,
        error: str | None = None,
    ) -> None:
        """End a held run in the terminal ``status`` the body chose (Ignore, Reject, replace).

        Guarded like :meth:`complete`. No sweep publishes a terminal run again; its
        stored message is cleared when it succeeded (replace), kept for ``lease rerun``
        otherwise.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"end() takes a terminal status, not {status!r}")
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "end",
            **ended_values(now, status, failure_code, error),
            **(_CLEARED_MESSAGE if status == SUCCEEDED else {}),
        )

    @_db_errors
    def refuse_message(
        self, record: RunRecord, failure_code: str, error: str, *, status: str = FAILED
    ) -> bool:
        """End a waiting run whose stored message must not be published again.

        ``failed`` (or ``cancelled`` for an expired message). Guarded on the status
        and attempt the sweeper read, so a run claimed meanwhile is left alone.
        True when this call ended it.
        """
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(
                runs.c.id == record.id,
                runs.c.attempt == record.attempt,
                or_(runs.c.status == QUEUED, runs.c.status == RETRYING),
            )
            .values(**ended_values(now, status, failure_code, error), **_CLEARED_MESSAGE)
        )
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def mark_cancelled(self, run_id: str, owner: str, attempt: int) -> None:
        """End a held run as ``cancelled`` after its worker honoured a cancel request."""
        now = db_now_ms()
        self._guarded_update(
            run_id,
            owner,
            attempt,
            "cancel",
            status=CANCELLED,
            failure_code="cancelled",
            lease_expires_at=now,
            finished_at=now,
            updated_at=now,
        )
