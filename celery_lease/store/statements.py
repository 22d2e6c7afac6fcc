"""The claim's SQL statements and the guarded-write conditions, built once."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Integer, String, and_, bindparam, case, func, or_

from ..schema import QUEUED, RETRYING, RUNNING, SUCCEEDED, PayloadType, db_now_ms, runs
from .base import StoreBase
from .records import _CLEARED_MESSAGE


def ended_values(now: Any, status: str, failure_code: str, error: str | None) -> dict[str, Any]:
    """The values that end a run in ``status``, with its failure, at ``now``.

    ``lease_expires_at`` becomes the end time too: ``lease top`` counts recent ends by it.
    """
    return {
        "status": status,
        "failure_code": failure_code,
        "last_error": error,
        "lease_expires_at": now,
        "finished_at": now,
        "updated_at": now,
    }


class Statements(StoreBase):
    """Builders of the claim upsert, the takeover and the guarded writes."""

    @staticmethod
    def _attempt_ceiling(max_attempts: Any) -> Any:
        """The attempt at which a run is out of attempts: the claimer's ``max_attempts``,
        or the row's own when larger (``celery lease rerun`` raises it, so that
        ``attempt``, the fencing token, never goes back)."""
        return case((runs.c.max_attempts > max_attempts, runs.c.max_attempts), else_=max_attempts)

    def _claimable(self, max_attempts: Any) -> Any:
        now = db_now_ms()
        return and_(
            or_(
                and_(
                    # Two equalities, not IN: an IN list is expanded on every execution.
                    or_(runs.c.status == QUEUED, runs.c.status == RETRYING),
                    runs.c.available_at <= now,
                ),
                and_(runs.c.status == RUNNING, runs.c.lease_expires_at <= now),
            ),
            runs.c.attempt < self._attempt_ceiling(max_attempts),
            runs.c.cancel_requested_at.is_(None),
        )

    def _takeover_values(
        self, owner: Any, lease_ms: Any, max_attempts: Any, values: dict[str, Any]
    ) -> dict[str, Any]:
        now = db_now_ms()
        return {
            "status": RUNNING,
            "lease_owner": owner,
            # The claimer's delivery becomes the run's own: its id and message.
            "task_id": values["task_id"],
            "payload": values["payload"],
            "payload_content_type": values["payload_content_type"],
            "lease_ms": lease_ms,
            "lease_expires_at": now + lease_ms,
            "heartbeat_at": now,
            "attempt": runs.c.attempt + 1,
            "max_attempts": self._attempt_ceiling(max_attempts),
            "started_at": func.coalesce(runs.c.started_at, now),
            "finished_at": None,
            "updated_at": now,
        }

    def _insert_values(self, values: dict[str, Any], lease_ms: Any) -> dict[str, Any]:
        now = db_now_ms()
        return {
            **values,
            "lease_expires_at": now + lease_ms,
            "heartbeat_at": now,
            "available_at": now,
            "started_at": now,
            "created_at": now,
            "updated_at": now,
        }

    def _build_claim_upsert(self) -> Any:
        """``INSERT .. ON CONFLICT DO UPDATE .. WHERE claimable RETURNING`` (PG, SQLite)."""
        lease_ms = bindparam("p_lease_ms", type_=Integer)
        max_attempts = bindparam("p_max_attempts", type_=Integer)
        values = {
            "id": bindparam("p_id", type_=String),
            "task_name": bindparam("p_task_name", type_=String),
            "status": RUNNING,
            "lease_owner": bindparam("p_owner", type_=String),
            "lease_ms": lease_ms,
            "attempt": 1,
            "max_attempts": max_attempts,
            "concurrency_key": bindparam("p_concurrency_key", type_=String),
            "task_id": bindparam("p_task_id", type_=String),
            "payload": bindparam("p_payload", type_=PayloadType),
            "payload_content_type": bindparam("p_payload_content_type", type_=String),
        }
        return (
            self._ops.insert(runs)
            .values(self._insert_values(values, lease_ms))
            .on_conflict_do_update(
                index_elements=[runs.c.id],
                set_=self._takeover_values(values["lease_owner"], lease_ms, max_attempts, values),
                where=self._claimable(max_attempts),
            )
            .returning(runs.c.attempt, runs.c.lease_expires_at, runs.c.max_attempts)
        )

    def _guarded(self, run_id: Any, owner: Any, attempt: Any) -> Any:
        return and_(
            runs.c.id == run_id,
            runs.c.lease_owner == owner,
            runs.c.attempt == attempt,
            runs.c.status == RUNNING,
        )

    @staticmethod
    def _success_values(now: Any) -> dict[str, Any]:
        return {
            "status": SUCCEEDED,
            "lease_expires_at": now,
            "finished_at": now,
            "updated_at": now,
            "last_error": None,
            "failure_code": None,
            **_CLEARED_MESSAGE,
        }
