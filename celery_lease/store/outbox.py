"""Follow-up tasks recorded in fenced transactions: :class:`OutboxStore` (``store.outbox``).

One object per lease database, over the same :class:`~celery_lease.store.engines.Engines`
as the lease protocol (:class:`~celery_lease.store.leasestore.LeaseStore` reaches it
as ``store.outbox``). A body's follow-ups are inserted in its own fenced transaction
(:meth:`OutboxStore.record`), so they exist only if that transaction commits; the
process that committed them publishes them right after, and the sweeper publishes
what a crash left behind. Each row is taken by a guarded ``UPDATE`` before it is
published, so two publishers never both send one, and deleted once sent. Every
method runs one statement (or one short transaction) and says in its docstring what
it guarantees. Used by :mod:`celery_lease.followups` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, and_, delete, func, insert, or_, select, update

from ..schema import db_now_ms, outbox
from .engines import Engines, db_errors
from .records import PURGE_BATCH, FollowupMessage, OutboxRecord


class OutboxStore:
    """The follow-up tasks of one lease database (``celery_lease_outbox``).

    Args:
        db: the database's engines (shared with the other store objects).
    """

    def __init__(self, db: Engines) -> None:
        self.db = db

    @db_errors
    def record(self, conn: Connection, run_id: str, messages: Sequence[FollowupMessage]) -> None:
        """Insert ``messages``, follow-ups of ``run_id``, in the caller's transaction ``conn``:
        one ``INSERT``; they commit, or roll back, with the caller's fenced writes."""
        if not messages:
            return
        now = db_now_ms()
        rows = [
            {
                "task_id": message.task_id,
                "run_id": run_id,
                "task_name": message.task_name,
                "payload": message.payload,
                "payload_content_type": message.payload_content_type,
                "created_at": now,
                "taken_at": None,
            }
            for message in messages
        ]
        conn.execute(insert(outbox).values(rows))

    @db_errors
    def take(
        self,
        task_ids: Iterable[str] | None = None,
        *,
        older_than_ms: int = 0,
        stale_ms: int,
        limit: int = 500,
    ) -> list[OutboxRecord]:
        """Committed follow-ups to publish now, each taken by a guarded
        ``UPDATE`` (two publishers never both take one; a taker that died is taken over
        after ``stale_ms``). With ``task_ids``, only those; else only rows recorded at
        least ``older_than_ms`` ago (the sweeper's: what no committing process sent).
        Rows of a transaction not committed yet are not seen. Rows never taken come
        first, then the ones taken longest ago, then the oldest."""
        now = db_now_ms()
        free = or_(outbox.c.taken_at.is_(None), outbox.c.taken_at < now - stale_ms)
        where = [free]
        if task_ids is not None:
            ids = sorted(set(task_ids))
            if not ids:
                return []
            where.append(outbox.c.task_id.in_(ids))
        if older_than_ms > 0:
            where.append(outbox.c.created_at <= now - older_than_ms)
        # Never taken first, then the longest since a take, then the oldest: rows a publish
        # keeps failing on go to the back, and never starve the ones behind them.
        stmt = (
            select(outbox)
            .where(*where)
            .order_by(
                outbox.c.taken_at.is_not(None),
                outbox.c.taken_at,
                outbox.c.created_at,
                outbox.c.task_id,
            )
            .limit(limit)
        )
        taken: list[OutboxRecord] = []
        with self.db.connect() as conn:
            for row in conn.execute(stmt).mappings().all():
                guard = and_(
                    outbox.c.task_id == row["task_id"],
                    outbox.c.taken_at.is_(None)
                    if row["taken_at"] is None
                    else outbox.c.taken_at == row["taken_at"],
                )
                if conn.execute(update(outbox).where(guard).values(taken_at=now)).rowcount == 1:
                    data = {k: v for k, v in row.items() if k != "taken_at"}
                    taken.append(OutboxRecord(**data))
        return taken

    @db_errors
    def drop(self, task_id: str) -> None:
        """Delete a follow-up once it was published (or can never be)."""
        with self.db.connect() as conn:
            conn.execute(delete(outbox).where(outbox.c.task_id == task_id))

    @db_errors
    def purge(self, older_than_ms: int, limit: int = PURGE_BATCH) -> list[str]:
        """Delete at most ``limit`` follow-ups recorded over ``older_than_ms`` ago and never
        published (retention); the task ids deleted. One short transaction: the oldest
        are picked, then deleted by id."""
        if older_than_ms < 0:
            raise ValueError(f"older_than_ms must be >= 0, got {older_than_ms}")
        cutoff = select(db_now_ms() - older_than_ms).scalar_subquery()
        oldest = (
            select(outbox.c.task_id)
            .where(outbox.c.created_at < cutoff)
            .order_by(outbox.c.created_at)
            .limit(limit)
        )
        with self.db.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if ids:
                conn.execute(delete(outbox).where(outbox.c.task_id.in_(ids)))
        return ids

    @db_errors
    def count(self, older_than_ms: int = 0) -> int:
        """How many follow-ups wait to be published, recorded at least ``older_than_ms`` ago;
        read only."""
        stmt = select(func.count()).where(outbox.c.created_at <= db_now_ms() - older_than_ms)
        with self.db.connect() as conn:
            return int(conn.execute(stmt).scalar_one())
