"""Flow control's statements: :class:`FlowStore` (pauses, held deliveries, rate slots).

One object per lease database, over the same :class:`~celery_lease.store.engines.Engines`
as the lease protocol (:class:`~celery_lease.store.leasestore.LeaseStore`, which
reaches it as ``store.flow``). Used by :mod:`celery_lease.flow` (pause, resume,
the pump), the run path's flow features (the rate slot, a paused delivery held)
and the sweeper's backstop. Every method runs one statement (or one short
transaction) and says in its docstring what it guarantees.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, delete, func, insert, literal, or_, select, update
from sqlalchemy.exc import IntegrityError

from .. import schema
from ..schema import (
    HELD_PAUSED,
    HELD_RATE,
    HELD_SLOT,
    RUNNING,
    db_now_ms,
    held,
    pauses,
    rates,
    runs,
)
from .engines import Engines, db_errors
from .records import FlowCounts, HeldRecord, Pause
from .sql import not_paused


class FlowStore:
    """Pauses, held deliveries and rate slots on one lease database.

    Args:
        db: the database's engines (shared with the other store objects).
    """

    def __init__(self, db: Engines) -> None:
        self.db = db

    def pause_of(self, task_name: str, key: str | None) -> str | None:
        """The reason (``""`` if none given) of a pause holding ``task_name`` (or ``key``),
        else None; read only (the claim's refusal path)."""
        stmt = (
            select(pauses.c.reason)
            .where(
                pauses.c.task_name == task_name,
                or_(pauses.c.pause_key == "", pauses.c.pause_key == (key or "")),
            )
            .order_by(pauses.c.pause_key)
            .limit(1)
        )
        with self.db.connect() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else str(row[0] or "")

    @db_errors
    def pause(self, task_name: str, key: str | None = None, reason: str | None = None) -> bool:
        """Pause ``task_name`` (or only its runs of concurrency ``key``): from now on no claim
        of it succeeds. True when this call paused it; a pause already there keeps its time
        and gets ``reason`` if one is given."""
        schema.check_run_id(task_name, "task_name")
        if key is not None:
            schema.check_run_id(key, "key")
        row = pauses.c.task_name == task_name, pauses.c.pause_key == (key or "")
        values = {"task_name": task_name, "pause_key": key or "", "reason": reason}
        with self.db.begin() as conn:
            found = conn.execute(select(pauses.c.task_name).where(*row)).first()
            if found is None:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(pauses).values(paused_at=db_now_ms(), **values))
                    return True
                except IntegrityError:  # paused by another call meanwhile
                    pass
            if reason is not None:
                conn.execute(update(pauses).where(*row).values(reason=reason))
        return False

    @db_errors
    def resume(self, task_name: str, key: str | None = None) -> bool:
        """Remove the pause of ``task_name`` (or of its concurrency ``key``); True when there
        was one. Held deliveries are published by :meth:`take_held` and its caller."""
        stmt = delete(pauses).where(
            pauses.c.task_name == task_name, pauses.c.pause_key == (key or "")
        )
        with self.db.connect() as conn:
            return int(conn.execute(stmt).rowcount) == 1

    @db_errors
    def list_pauses(self) -> list[Pause]:
        """Every pause, oldest first, with the deliveries it holds back now; read only."""
        with self.db.connect() as conn:
            rows = conn.execute(
                select(pauses).order_by(pauses.c.paused_at, pauses.c.task_name)
            ).all()
            counts = conn.execute(
                select(held.c.task_name, held.c.flow_key, func.count())
                .where(held.c.reason == HELD_PAUSED)
                .group_by(held.c.task_name, held.c.flow_key)
            ).all()
        found: list[Pause] = []
        for task_name, key, reason, paused_at in rows:
            waiting = sum(
                int(n) for name, flow, n in counts if name == task_name and key in ("", flow)
            )
            found.append(Pause(task_name, key, reason, int(paused_at), waiting))
        return found

    @db_errors
    def flow_counts(self) -> FlowCounts:
        """Deliveries held back now per task and key, paused and deferred; one read."""
        now = db_now_ms()
        stmt = select(held.c.reason, held.c.task_name, held.c.flow_key, func.count(), now).group_by(
            held.c.reason, held.c.task_name, held.c.flow_key
        )
        with self.db.connect() as conn:
            rows = conn.execute(stmt).all()
            db_now = int(conn.execute(select(now)).scalar_one()) if not rows else int(rows[0][4])
        paused = {(r[1], r[2]): int(r[3]) for r in rows if r[0] == HELD_PAUSED}
        deferred = {(r[1], r[2]): int(r[3]) for r in rows if r[0] == HELD_RATE}
        return FlowCounts(db_now, paused, deferred)

    @db_errors
    def request_cancel_running(self, task_name: str, key: str | None = None) -> int:
        """Ask every running run of ``task_name`` (of concurrency ``key`` if given) to stop, as
        :meth:`cancel` does; how many were asked. Each worker sees it within one heartbeat."""
        now = db_now_ms()
        where = [runs.c.status == RUNNING, runs.c.task_name == task_name]
        if key is not None:
            where.append(runs.c.concurrency_key == key)
        stmt = (
            update(runs)
            .where(*where, runs.c.cancel_requested_at.is_(None))
            .values(cancel_requested_at=now, updated_at=now)
        )
        with self.db.connect() as conn:
            return int(conn.execute(stmt).rowcount)

    @db_errors
    def reserve_rate(self, task_name: str, key: str, period_ms: int, burst: int) -> tuple[int, int]:
        """Take the next slot of the rate bucket ``(task_name, key)``: one slot per
        ``period_ms``, ``burst`` at once. Returns ``(wait_ms, due_ms)``: how long the caller
        must wait for its slot (0: now) and when it is due, by the database clock.

        GCRA with reservation, in one statement where the database has ``ON CONFLICT ..
        RETURNING`` (a short transaction on MySQL): every caller's slot is its own, so
        across all workers no more than ``burst`` start within one period.
        """
        if key:  # the same refusal of a NUL or a lone surrogate on every database
            schema.check_run_id(key, "rate_key")
        params = {"p_task": task_name, "p_key": key, "p_period": period_ms}
        tat, now = self.db.database.reserve_rate(self.db.engine, self.db.auto, params)
        due = tat - period_ms * burst
        return max(0, due - now), max(due, now)

    @db_errors
    def give_back_rate(self, task_name: str, key: str, period_ms: int) -> None:
        """Give one slot of the rate bucket ``(task_name, key)`` back (a delivery that took
        it started no body: its claim was refused, or its task is paused): the bucket's
        next slot comes one period earlier. One statement."""
        stmt = (
            update(rates)
            .where(rates.c.task_name == task_name, rates.c.rate_key == key)
            .values(tat=rates.c.tat - period_ms)
        )
        with self.db.connect() as conn:
            conn.execute(stmt)

    @db_errors
    def record_slot(
        self, *, task_name: str, flow_key: str, run_id: str, task_id: str, due_ms: int
    ) -> int:
        """Record the rate slot (due at ``due_ms``) a deferred delivery is sent for, bound
        to its ``task_id``; its ``seq``, which the delivery's message carries. One statement."""
        now = db_now_ms()
        row = {
            "reason": HELD_SLOT,
            "task_name": task_name,
            "flow_key": flow_key,
            "run_id": run_id,
            "task_id": task_id,
            "payload": b"",
            "payload_content_type": "",
            "available_at": due_ms,
            "created_at": now,
        }
        with self.db.connect() as conn:
            key = conn.execute(insert(held).values(row)).inserted_primary_key
            assert key is not None
            return int(key[0])

    @db_errors
    def use_slot(self, seq: int, task_id: str) -> bool:
        """Take the recorded rate slot ``seq`` for the delivery ``task_id``: True once, for
        that task id only (a copy of its message, a retry, or a forged slot gets False and
        takes a slot of its own). One statement."""
        stmt = delete(held).where(
            held.c.seq == seq, held.c.reason == HELD_SLOT, held.c.task_id == task_id
        )
        with self.db.connect() as conn:
            return int(conn.execute(stmt).rowcount) == 1

    @db_errors
    def drop_stale_slots(self, older_than_ms: int, limit: int = 500) -> int:
        """Delete at most ``limit`` recorded rate slots due more than ``older_than_ms`` ago
        (their delivery never came, or came as a copy); how many. Retention, by the sweep."""
        now = db_now_ms()
        stale = (
            select(held.c.seq)
            .where(held.c.reason == HELD_SLOT, held.c.available_at < now - older_than_ms)
            .order_by(held.c.available_at)
            .limit(limit)
        )
        with self.db.connect() as conn:
            seqs = [int(row[0]) for row in conn.execute(stale).all()]
            if not seqs:
                return 0
            return int(conn.execute(delete(held).where(held.c.seq.in_(seqs))).rowcount)

    @db_errors
    def hold(
        self,
        reason: str,
        *,
        task_name: str,
        flow_key: str | None,
        run_id: str,
        task_id: str,
        payload: bytes,
        payload_content_type: str,
        available_at: int | None = None,
    ) -> bool:
        """Keep a delivery held back by flow control, with its message; one statement.

        ``paused``: kept only while a pause still holds it (False: resumed meanwhile, the
        caller sends it on). ``rate``: due at ``available_at`` (epoch ms, DB clock).
        """
        now = db_now_ms()
        key = flow_key or ""
        row = {
            "reason": reason,
            "task_name": task_name,
            "flow_key": key,
            "run_id": run_id,
            "task_id": task_id,
            "payload": payload,
            "payload_content_type": payload_content_type,
            "available_at": now if available_at is None else available_at,
            "created_at": now,
        }
        if reason == HELD_RATE:
            stmt: Any = insert(held).values(row)
        elif reason == HELD_PAUSED:
            source = select(
                *[
                    (v if hasattr(v, "label") else literal(v, held.c[k].type)).label(k)
                    for k, v in row.items()
                ]
            ).where(~not_paused(task_name, key))
            stmt = insert(held).from_select(list(row), source)
        else:
            raise ValueError(f"unknown hold reason {reason!r}")
        with self.db.connect() as conn:
            if not self.db.engine.dialect.insert_returning:
                return int(conn.execute(stmt).rowcount) == 1
            # psycopg reports no row count for INSERT .. SELECT: ask for the row.
            return conn.execute(stmt.returning(held.c.seq)).first() is not None

    @db_errors
    def take_held(
        self,
        *,
        horizon_ms: int,
        task_name: str | None = None,
        key: str | None = None,
        limit: int = 500,
        stale_ms: int = 60_000,
    ) -> list[HeldRecord]:
        """Held deliveries to publish now, in arrival order, each taken by a guarded
        ``UPDATE`` (so two publishers never both take one; a taker that died is taken over
        after ``stale_ms``): paused ones no pause holds any more, and rate-limited ones due
        within ``horizon_ms``. With ``task_name`` (and ``key``), only that task's paused ones.
        """
        now = db_now_ms()
        free = or_(held.c.taken_at.is_(None), held.c.taken_at < now - stale_ms)
        resumed = and_(held.c.reason == HELD_PAUSED, not_paused(held.c.task_name, held.c.flow_key))
        if task_name is not None:
            resumed = and_(resumed, held.c.task_name == task_name)
            if key is not None:
                resumed = and_(resumed, held.c.flow_key == key)
            where: Any = resumed
        else:
            due = and_(held.c.reason == HELD_RATE, held.c.available_at <= now + horizon_ms)
            where = or_(resumed, due)
        stmt = select(held, now.label("now")).where(where, free).order_by(held.c.seq).limit(limit)
        taken: list[HeldRecord] = []
        with self.db.connect() as conn:
            for row in conn.execute(stmt).mappings().all():
                guard = and_(
                    held.c.seq == row["seq"],
                    held.c.taken_at.is_(None)
                    if row["taken_at"] is None
                    else held.c.taken_at == row["taken_at"],
                )
                if conn.execute(update(held).where(guard).values(taken_at=now)).rowcount == 1:
                    data = {k: v for k, v in row.items() if k != "taken_at"}
                    taken.append(HeldRecord(**data))
        return taken

    @db_errors
    def drop_held(self, seq: int) -> None:
        """Forget a held delivery once it was published again."""
        with self.db.connect() as conn:
            conn.execute(delete(held).where(held.c.seq == seq))

    @db_errors
    def next_held_due(self) -> int | None:
        """Milliseconds until the next rate-limited delivery is due (0: overdue), or None
        when none is held; read only."""
        now = db_now_ms()
        stmt = select(func.min(held.c.available_at) - now).where(held.c.reason == HELD_RATE)
        with self.db.connect() as conn:
            left = conn.execute(stmt).scalar()
        return None if left is None else max(0, int(left))

    @db_errors
    def purge_idle_rates(self, limit: int) -> int:
        """Delete at most ``limit`` rate buckets whose last slot has passed (their
        theoretical arrival time is before now, DB clock): such a row carries nothing, as
        the next reservation of its key starts from now either way. Two short
        statements: the pick, then the delete of the picked keys with the condition
        re-checked, so a key reserved meanwhile keeps its row. Returns how many."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        idle = rates.c.tat < db_now_ms()
        pick = select(rates.c.task_name, rates.c.rate_key).where(idle).limit(limit)
        with self.db.connect() as conn:
            keys = conn.execute(pick).all()
        if not keys:
            return 0
        picked = or_(*(and_(rates.c.task_name == t, rates.c.rate_key == k) for t, k in keys))
        with self.db.connect() as conn:
            return int(conn.execute(delete(rates).where(picked, idle)).rowcount)

    @db_errors
    def count_idle_rates(self) -> int:
        """How many rate buckets :meth:`purge_idle_rates` would delete now; read only."""
        stmt = select(func.count()).select_from(rates).where(rates.c.tat < db_now_ms())
        with self.db.connect() as conn:
            return int(conn.execute(stmt).scalar() or 0)
