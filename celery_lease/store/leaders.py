"""Leader leases and the beat schedule: :class:`Leaders`, one method per statement.

A leader lease is one row of ``celery_lease_leaders``, taken by one process at a
time for a name (``sweeper``: the in-worker sweeper of this database;
``beat:<app>``: the :class:`~celery_lease.beat.LeaseScheduler` that sends). Its
owner is unguessable and new at every acquisition and its term grows by one at
each, so ``(owner, term)`` is a fencing token: :meth:`Leaders.hold`, run first in
the transaction of a leader's write, proves the lease is still this holder's and
keeps it locked until that transaction ends, so a takeover cannot slip in before
the write commits. Every expiry is computed with the database clock.

The schedule statements are the :class:`~celery_lease.beat.LeaseScheduler`'s:
each write is fenced by the beat's leader term in the same transaction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from sqlalchemy import ColumnElement, Connection, and_, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from ..errors import LeadershipLost
from ..schema import MAX_ID_LENGTH, db_now_ms, leaders, schedule
from .engines import Engines, db_errors

#: Longest leader or scheduler name the columns hold.
MAX_LEADER_NAME = 128


@dataclasses.dataclass(frozen=True)
class LeaderTerm:
    """The fencing token of one holder of a leader lease: its name, owner and term."""

    name: str
    owner: str
    term: int


@dataclasses.dataclass(frozen=True)
class LeaderRecord:
    """A leader lease as operators read it, with the database clock (epoch ms)."""

    name: str
    owner: str
    term: int
    acquired_at: int
    renewed_at: int
    expires_at: int
    now: int

    @property
    def live(self) -> bool:
        """True while the lease has not expired (DB clock)."""
        return self.expires_at > self.now


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
    """One entry of a ``LeaseScheduler``'s schedule: its last tick's due time (epoch ms)."""

    entry: str
    last_run_at: int
    total_run_count: int


def _held(term: LeaderTerm) -> ColumnElement[bool]:
    """The rows of ``term``'s unexpired lease (DB clock)."""
    return and_(
        leaders.c.name == term.name,
        leaders.c.owner == term.owner,
        leaders.c.term == term.term,
        leaders.c.expires_at > db_now_ms(),
    )


class Leaders:
    """The leader leases of one lease database, and the beat schedules they fence."""

    def __init__(self, db: Engines) -> None:
        """Statements on ``db`` (the engines every store object of this database shares)."""
        self.db = db

    # -- the leader lease ---------------------------------------------------------

    @db_errors
    def take(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Take the leader lease ``name`` for ``owner`` for ``ttl_ms`` if it is free (expired
        or resigned), with the next term; True when this call took it. One ``UPDATE``."""
        now = db_now_ms()
        stmt = (
            update(leaders)
            .where(leaders.c.name == name[:MAX_LEADER_NAME], leaders.c.expires_at <= now)
            .values(
                owner=owner[:MAX_ID_LENGTH],
                term=leaders.c.term + 1,
                acquired_at=now,
                renewed_at=now,
                expires_at=now + bindparam("ttl", ttl_ms),
            )
        )
        with self.db.connect() as conn:
            return bool(conn.execute(stmt).rowcount == 1)

    @db_errors
    def create(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Insert the first row of the leader lease ``name``, held by ``owner`` in term 1;
        False when the row exists already (someone else made it). One ``INSERT``."""
        now = db_now_ms()
        stmt = insert(leaders).values(
            name=name[:MAX_LEADER_NAME],
            owner=owner[:MAX_ID_LENGTH],
            term=1,
            acquired_at=now,
            renewed_at=now,
            expires_at=now + bindparam("ttl", ttl_ms),
        )
        try:
            with self.db.connect() as conn:
                conn.execute(stmt)
        except IntegrityError:
            return False
        return True

    @db_errors
    def term_of(self, name: str, owner: str) -> int | None:
        """The term in which ``owner`` holds the leader lease ``name`` unexpired, else None
        (read once after :meth:`take`: the owner is new at each acquisition)."""
        stmt = select(leaders.c.term).where(
            leaders.c.name == name[:MAX_LEADER_NAME],
            leaders.c.owner == owner[:MAX_ID_LENGTH],
            leaders.c.expires_at > db_now_ms(),
        )
        with self.db.connect() as conn:
            found = conn.execute(stmt).scalar()
        return None if found is None else int(found)

    @db_errors
    def renew(self, term: LeaderTerm, ttl_ms: int) -> bool:
        """Extend ``term``'s unexpired lease to ``ttl_ms`` from now; False when it is no
        longer held (expired or taken over): the holder is a leader no more."""
        now = db_now_ms()
        stmt = (
            update(leaders)
            .where(_held(term))
            .values(renewed_at=now, expires_at=now + bindparam("ttl", ttl_ms))
        )
        with self.db.connect() as conn:
            return bool(conn.execute(stmt).rowcount == 1)

    @db_errors
    def resign(self, term: LeaderTerm) -> bool:
        """End ``term``'s lease now, so a standby takes it at its next try; True when it was
        still held. Guarded by owner and term: another holder's lease is never touched."""
        stmt = update(leaders).where(_held(term)).values(expires_at=db_now_ms())
        with self.db.connect() as conn:
            return bool(conn.execute(stmt).rowcount == 1)

    def hold(self, conn: Connection, term: LeaderTerm) -> None:
        """Inside the caller's transaction ``conn``, lock ``term``'s lease row and prove it is
        unexpired; raises :class:`LeadershipLost` otherwise. The row stays locked until the
        transaction ends, so a takeover waits for the caller's writes to commit."""
        stmt = update(leaders).where(_held(term)).values(renewed_at=leaders.c.renewed_at)
        if conn.execute(stmt).rowcount != 1:
            raise LeadershipLost(term.name, term.owner, term.term)

    @db_errors
    def list_all(self) -> list[LeaderRecord]:
        """Every leader lease of this database, with the database clock; read only."""
        stmt = select(leaders, db_now_ms().label("now")).order_by(leaders.c.name)
        with self.db.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [LeaderRecord(**{key: row[key] for key in row}) for row in rows]

    # -- the beat schedule ------------------------------------------------------------

    @db_errors
    def schedule_of(self, scheduler: str) -> dict[str, ScheduleRow]:
        """The schedule of ``scheduler``, by entry name; read only."""
        stmt = select(schedule).where(schedule.c.scheduler == scheduler[:MAX_LEADER_NAME])
        with self.db.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return {
            row["entry"]: ScheduleRow(
                row["entry"], int(row["last_run_at"]), int(row["total_run_count"])
            )
            for row in rows
        }

    @db_errors
    def add_entries(self, term: LeaderTerm, scheduler: str, entries: Mapping[str, int]) -> None:
        """Add ``entries`` (name -> last run, epoch ms) to ``scheduler``'s schedule, fenced by
        ``term`` in the same transaction (:class:`LeadershipLost`: nothing is added)."""
        if not entries:
            return
        now = db_now_ms()
        with self.db.begin() as conn:
            self.hold(conn, term)
            for entry, last_run_at in entries.items():
                conn.execute(
                    insert(schedule).values(
                        scheduler=scheduler[:MAX_LEADER_NAME],
                        entry=entry,
                        last_run_at=last_run_at,
                        total_run_count=0,
                        updated_at=now,
                    )
                )

    @db_errors
    def advance(
        self, term: LeaderTerm, scheduler: str, entry: str, previous_ms: int, due_ms: int
    ) -> bool:
        """Record that ``entry``'s tick due at ``due_ms`` is sent, if its last tick is still
        ``previous_ms`` (compare and set); fenced by ``term`` in the same transaction
        (:class:`LeadershipLost`: nothing is recorded). False: the entry moved meanwhile."""
        stmt = (
            update(schedule)
            .where(
                schedule.c.scheduler == scheduler[:MAX_LEADER_NAME],
                schedule.c.entry == entry,
                schedule.c.last_run_at == previous_ms,
            )
            .values(
                last_run_at=due_ms,
                total_run_count=schedule.c.total_run_count + 1,
                updated_at=db_now_ms(),
            )
        )
        with self.db.begin() as conn:
            self.hold(conn, term)
            return bool(conn.execute(stmt).rowcount == 1)

    @db_errors
    def forget_entries(self, term: LeaderTerm, scheduler: str, keep: Collection[str]) -> int:
        """Delete the rows of ``scheduler``'s entries not in ``keep`` (gone from its
        ``beat_schedule``), fenced by ``term``; how many were deleted."""
        stmt = delete(schedule).where(schedule.c.scheduler == scheduler[:MAX_LEADER_NAME])
        if keep:
            stmt = stmt.where(schedule.c.entry.not_in(sorted(keep)))
        with self.db.begin() as conn:
            self.hold(conn, term)
            return int(conn.execute(stmt).rowcount)
