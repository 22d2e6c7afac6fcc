"""The operators' reads: :class:`RunReads`, for ``celery lease`` and the web view.

One object per lease database, over the same :class:`~celery_lease.store.engines.Engines`
as the lease protocol (reached as ``store.reads``). Read only: every method is
one statement (or a few, said in its docstring), answered from the
``(status, ...)`` indexes, never the whole table's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, case, func, or_, select, union_all

from .. import schema
from ..schema import db_now_ms, runs
from .engines import Engines, db_errors
from .records import (
    EXPIRED_ENDINGS,
    Activity,
    RateBucket,
    RunPageQuery,
    RunRecord,
    RunSummary,
    TaskCounts,
)
from .sql import lease_expired_since, oldest_running, purgeable, run_filter, run_page


class RunReads:
    """The runs as operators read them: lists, pages, counts, the last sweep.

    Args:
        db: the database's engines (shared with the other store objects).
    """

    def __init__(self, db: Engines) -> None:
        self.db = db

    @db_errors
    def list_runs(
        self, *, status: str | None = None, task_name: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        """Up to ``limit`` runs, newest first, filtered by status and task name; read only."""
        stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id).limit(max(0, limit))
        if status is not None:
            stmt = stmt.where(runs.c.status == status)
        if task_name is not None:
            stmt = stmt.where(runs.c.task_name == task_name)
        with self.db.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @db_errors
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
        oldest = oldest_running()
        # A scalar subquery is an index bound (a volatile clock is not).
        recent = lease_expired_since(select(now - window_ms).scalar_subquery()).add_columns(now)
        with self.db.connect() as conn:
            grouped = conn.execute(per_status).all()
            live, expired = conn.execute(leases).one()
            oldest_row = conn.execute(oldest).mappings().first()
            expired_recent, db_now = conn.execute(recent).one()
        return {
            "now": int(db_now),
            "counts": {str(r[0]): int(r[1]) for r in grouped},
            "live_leases": int(live or 0),
            "expired_leases": int(expired or 0),
            "oldest_running": None if oldest_row is None else RunRecord(**dict(oldest_row)),
            "lease_expired_recent": int(expired_recent),
        }

    @db_errors
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
        with self.db.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @db_errors
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
        with self.db.connect() as conn:
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

    @db_errors
    def page_runs(self, query: RunPageQuery) -> list[RunSummary]:
        """One page of runs for ``query``; read only, one statement.

        Every status is an index range from the keyset bound (see
        :func:`~celery_lease.store.sql.run_page`), so a page costs the same on
        the millionth row as on the first. The stored message, the result and
        the error text are not read.
        """
        with self.db.connect() as conn:
            rows = conn.execute(run_page(query)).mappings().all()
        return [RunSummary(**dict(row)) for row in rows]

    @db_errors
    def count_runs(self, query: RunPageQuery, cap: int | None = None) -> tuple[int, int]:
        """How many runs ``query``'s filters match (its keyset bound aside), and how many of
        them keep a stored message; read only, one statement.

        An index range like :meth:`page_runs` (one status, a task, an id prefix), the other
        filters applied to its rows; with ``cap``, at most ``cap`` rows are read (the counts
        then stop at ``cap``), so a page can say "more than ``cap``" cheaply.
        """
        stored = case((runs.c.payload.is_not(None), 1), else_=0).label("stored")
        matching = select(stored).where(*run_filter(query))
        if cap is not None:
            matching = matching.limit(max(0, cap))
        sub = matching.subquery()
        stmt = select(func.count(), func.sum(sub.c.stored)).select_from(sub)
        with self.db.connect() as conn:
            count, with_message = conn.execute(stmt).one()
        return int(count), int(with_message or 0)

    @db_errors
    def rate_buckets(self, task_names: Sequence[str], limit: int = 100) -> list[RateBucket]:
        """The rate buckets of ``task_names`` (``celery_lease_rates``), latest next slot first,
        at most ``limit``, with the database clock; read only, one statement: a range of the
        table's primary key ``(task_name, rate_key)`` per task, one row per rate key."""
        if not task_names:
            return []
        rates = schema.rates
        stmt = (
            select(rates.c.task_name, rates.c.rate_key, rates.c.tat, db_now_ms())
            .where(rates.c.task_name.in_(sorted(set(task_names))))
            .order_by(rates.c.tat.desc())
            .limit(max(0, limit))
        )
        with self.db.connect() as conn:
            rows = conn.execute(stmt).all()
        return [RateBucket(str(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows]

    @db_errors
    def task_counts(
        self, now: int, window_ms: int = 3_600_000, task_name: str | None = None
    ) -> list[TaskCounts]:
        """Per task (only ``task_name`` if given): live runs per status, runs that finished
        within ``window_ms`` before ``now`` per terminal status, running runs whose lease
        has expired, and the runs taken over, re-published by the sweeper and ended after
        an expired lease within the window; read only, one statement, by task name.

        ``now`` is the database clock (:meth:`now_ms`) passed as a value, so the
        window is an index bound: only live rows and the window's finished rows
        are read, from the ``(status, ...)`` indexes, never the whole table. Every
        run taken over or re-published within the window is among them (it is live,
        or it finished after that), so those counts are exact, from the history
        columns no claim resets (``taken_over_at``, ``republished_at``).
        """
        since = now - window_ms
        live = (schema.QUEUED, schema.RUNNING, schema.RETRYING)
        expired = and_(runs.c.status == schema.RUNNING, runs.c.lease_expires_at <= now)
        ended_expired = and_(
            runs.c.status == schema.FAILED, runs.c.failure_code.in_(EXPIRED_ENDINGS)
        )
        flags = [
            case((expired, 1), else_=0),
            case((runs.c.taken_over_at >= since, 1), else_=0),
            case((runs.c.republished_at >= since, 1), else_=0),
            case((ended_expired, 1), else_=0),
        ]
        is_live = runs.c.status.in_(live)
        ended = and_(
            runs.c.status.in_(sorted(schema.TERMINAL_STATUSES)), runs.c.finished_at >= since
        )
        where: Any = None
        if task_name is None:
            source: Any = runs
            where = or_(is_live, ended)
            columns = [runs.c.task_name, runs.c.status, *flags]
        else:
            # One task: its live rows by (task_name, status), and its window's finished
            # rows by (status, finished_at), the window's bound; the task's name there is
            # compared as an expression, which no index serves, or SQLite would read
            # every finished row of the task by (task_name, status) instead.
            parts = [
                select(runs.c.task_name, runs.c.status, *flags).where(
                    runs.c.task_name == task_name, is_live
                ),
                select(runs.c.task_name, runs.c.status, *flags).where(
                    ended, runs.c.task_name + "" == task_name
                ),
            ]
            source = union_all(*parts).subquery()
            columns = list(source.c)
        task_column, status_column, *marks = columns
        stmt = (
            select(task_column, status_column, func.count(), *(func.sum(m) for m in marks))
            .select_from(source)
            .group_by(task_column, status_column)
        )
        if where is not None:
            stmt = stmt.where(where)
        with self.db.connect() as conn:
            rows = conn.execute(stmt).all()
        found: dict[str, list[Any]] = {}
        for name, status, count, *sums in rows:
            entry = found.setdefault(str(name), [{}, {}, 0, 0, 0, 0])
            entry[0 if status in live else 1][str(status)] = int(count)
            for i, value in enumerate(sums, start=2):
                entry[i] += int(value or 0)
        return [TaskCounts(name, *found[name]) for name in sorted(found)]

    @db_errors
    def oldest_running(self) -> RunRecord | None:
        """The running run that started first (None if none runs); read only, from the
        running rows of the ``(status, ...)`` indexes."""
        with self.db.connect() as conn:
            row = conn.execute(oldest_running()).mappings().first()
        return None if row is None else RunRecord(**dict(row))

    @db_errors
    def count_finished(self, status: str, older_than_ms: int) -> int:
        """How many rows :meth:`purge_finished` would delete now, by index; read only."""
        stmt = select(func.count()).select_from(runs).where(purgeable(status, older_than_ms))
        with self.db.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    @db_errors
    def last_sweep(self) -> dict[str, Any] | None:
        """The latest sweep recorded on this database, with the database clock; read only.

        Keys: the columns of ``celery_lease_sweeps`` and ``now`` (epoch ms). None
        when no sweep was ever recorded.
        """
        stmt = (
            select(schema.sweeps, db_now_ms().label("now"))
            .order_by(schema.sweeps.c.swept_at.desc())
            .limit(1)
        )
        with self.db.connect() as conn:
            row = conn.execute(stmt).mappings().first()
        return None if row is None else dict(row)
