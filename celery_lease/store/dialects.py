"""What differs between the SQL dialects the store speaks."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import (
    Connection,
    func,
    select,
)

logger = logging.getLogger(__name__)


class _KeyLock:
    """How a dialect serializes the claims sharing one concurrency key, inside the
    claim's transaction. SQLite: ``BEGIN IMMEDIATE`` already holds the write lock."""

    def acquire(self, conn: Connection, key: str) -> bool:
        """Take the key's lock; False means another claimer holds it (report busy)."""
        return True

    def count_live(self, query: Any) -> Any:
        """The statement counting the key's live leases (as a locking read where needed)."""
        return query


class _PostgresKeyLock(_KeyLock):
    """A transaction-scoped advisory try-lock on the key's hash."""

    def acquire(self, conn: Connection, key: str) -> bool:
        """Try-lock: a holder frozen inside this short transaction must not stall
        every other claim on the key; they report busy instead."""
        return bool(
            conn.execute(
                select(func.pg_try_advisory_xact_lock(func.hashtextextended(key, 0)))
            ).scalar()
        )


class _MySQLKeyLock(_KeyLock):
    """The count itself is a locking read (``FOR UPDATE``): InnoDB's next-key locks on
    the key's ``running`` index range block any other claim from adding a live
    lease to it until this transaction ends. Two claimers that both found the range
    empty deadlock on their inserts; the loser is retried by the claim."""

    def count_live(self, query: Any) -> Any:
        """The count as ``SELECT .. FOR UPDATE``."""
        return query.with_for_update()


_KEY_LOCKS: dict[str, _KeyLock] = {
    "postgresql": _PostgresKeyLock(),
    "mysql": _MySQLKeyLock(),
    "mariadb": _MySQLKeyLock(),
}
