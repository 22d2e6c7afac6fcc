"""The lease protocol: :class:`LeaseStore`, one method per operation on the runs table.

Each method runs one statement (or one short transaction) and says in its
docstring what it guarantees. Guarded writes name ``id``, ``lease_owner`` and
``attempt`` and turn zero changed rows into :class:`~celery_lease.errors.LeaseLost`.
Every time comparison uses :class:`~celery_lease.schema.db_now_ms`, the database
clock. What differs between databases is asked of the store's database object
(:mod:`celery_lease.store.databases`); the SQL shared by all of them is built by
the functions of :mod:`celery_lease.store.sql`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    case,
    func,
    insert,
    inspect,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from .. import schema
from ..errors import LeaseLost, LeaseUsageError, RunNotFound, RunNotRerunnable
from ..events import Event
from ..schema import (
    CANCELLED,
    FAILED,
    QUEUED,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATUSES,
    check_claim_inputs,
    db_now_ms,
    runs,
)
from .bounds import DEFAULT_BOUNDS, WaitBounds
from .database import CLAIM_CONTENTION, ClaimRow, Database, create_schema
from .engines import Engines, db_errors
from .flowstore import FlowStore
from .leaders import Leaders, LeaderTerm
from .outbox import OutboxStore
from .reads import RunReads
from .records import (
    _CLEARED_MESSAGE,
    _CLEARED_ON_SUCCESS,
    CLAIM_CONTENTION_TRIES,
    OTHER_DELIVERY,
    PURGE_BATCH,
    ClaimResult,
    HeartbeatResult,
    LeaseKey,
    Progress,
    RunRecord,
)
from .sql import (
    checkpoint_by_binds,
    checkpoint_values,
    complete_by_binds,
    ended_values,
    guarded,
    not_paused,
    progress_values,
    purgeable,
    stranded_wait,
    success_values,
)

logger = logging.getLogger(__name__)

#: The fewest re-sends of a run nobody claims before it ends ``undeliverable``, whatever
#: its ``max_attempts``: re-sends are no attempts, and a run with two attempts waiting
#: behind a busy worker's backlog must not end after two (see ``stranded_wait``).
STRANDED_RESENDS = 5

#: What ``rerun(from_scratch=True)`` clears: the run starts again with no checkpoint.
_FROM_SCRATCH: dict[str, Any] = {
    "checkpoint": None,
    "checkpoint_at": None,
    "progress_done": None,
    "progress_total": None,
    "progress_note": None,
    "progress_at": None,
}


class LeaseStore:
    """The lease protocol on one database: claim, renew, fence, outcomes, recovery.

    Flow control's statements are :attr:`flow` (:class:`FlowStore`), the
    operators' reads :attr:`reads` (:class:`RunReads`): objects of their own
    over the same :class:`Engines`. Single statements run in autocommit mode
    (one round trip each); the few read-then-write paths run in one short
    transaction.
    """

    def __init__(
        self,
        engine: Engine | Engines,
        *,
        autocommit_engine: Engine | None = None,
        bounds: WaitBounds = DEFAULT_BOUNDS,
    ) -> None:
        """The store of the database ``engine`` (an :class:`Engines`, or an engine for
        transactions with ``autocommit_engine`` for single statements; see :class:`Engines`).

        ``bounds`` sets SQLite's busy timeout; on servers the waits are bounded
        by the engines themselves (:func:`create_lease_engine`).
        """
        db = (
            engine
            if isinstance(engine, Engines)
            else Engines(engine, autocommit_engine=autocommit_engine, bounds=bounds)
        )
        #: The database's engines, shared with :attr:`flow` and :attr:`reads`.
        self.db = db
        #: Flow control's statements (pauses, held deliveries, rate slots).
        self.flow = FlowStore(db)
        #: The operators' reads (``celery lease``, the web view).
        self.reads = RunReads(db)
        #: Leader leases (the in-worker sweeper, LeaseScheduler beats) and beat schedules.
        self.leaders = Leaders(db)
        #: Follow-up tasks recorded in fenced transactions (``fence(conn, send=...)``).
        self.outbox = OutboxStore(db)
        # Every kept result of a run finished before this (DB clock) is cleared
        # (:meth:`clear_results` reads only the rows finished since).
        self._results_cleared_to = 0
        # The hot path's two statements are compiled once; on an engine in
        # autocommit mode they run at the driver level (DriverStatement).
        self._claim_path = db.database.claim_path(db.engine, db.auto, raw=db.raw)
        self._complete_stmt = complete_by_binds()
        self._complete_driver = db.driver(self._complete_stmt, returns_row=False)
        self._checkpoint_stmt = checkpoint_by_binds()
        self._checkpoint_driver = db.driver(self._checkpoint_stmt, returns_row=False)

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float | None = None, **engine_kwargs: Any
    ) -> LeaseStore:
        """A store on new engines for ``url``, its waits bounded for ``lease_seconds``
        (see :meth:`Engines.from_url`).

        Raises:
            LeaseDatabaseError: SQLAlchemy could not make an engine or reach the database.
        """
        return cls(Engines.from_url(url, lease_seconds=lease_seconds, **engine_kwargs))

    @property
    def engine(self) -> Engine:
        """The engine for transactions (its ``url`` names the database)."""
        return self.db.engine

    @property
    def database(self) -> Database:
        """What differs on this database."""
        return self.db.database

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine this store runs statements on (for instrumentation)."""
        return self.db.engines

    def dispose(self) -> None:
        """Close every pooled connection of this store."""
        self.db.dispose()

    def dispose_after_fork(self) -> None:
        """Drop pooled connections inherited from a parent process without closing them."""
        self.db.dispose_after_fork()

    # -- schema ---------------------------------------------------------------

    @db_errors
    def create_schema(self) -> None:
        """Create the runs table and any index it lacks (the embedded default; else migrate)."""
        create_schema(self.db.engine)

    @db_errors
    def has_schema(self) -> bool:
        """True when the runs table exists."""
        return bool(inspect(self.db.engine).has_table(runs.name))

    @db_errors
    def schema_gaps(self, *, runs_only: bool = False) -> list[str]:
        """What this version's schema has and the database lacks (``table <name>``, ``column
        <table>.<name>``): a schema an earlier version made, not yet migrated. Empty when
        current; one catalog read per table (``runs_only``: the runs table's columns only,
        what every read of a run needs)."""
        inspector = inspect(self.db.engine)
        present = set(inspector.get_table_names())
        gaps: list[str] = []
        for table in [runs] if runs_only else schema.metadata.sorted_tables:
            if table.name not in present:
                gaps.append(f"table {table.name}")
                continue
            columns = {column["name"] for column in inspector.get_columns(table.name)}
            gaps.extend(
                f"column {table.name}.{column.name}"
                for column in table.columns
                if column.name not in columns
            )
        return gaps

    @db_errors
    def prepare(self) -> None:
        """Make the database ready for tasks: SQLite, the embedded default, gets its table;
        a server's is made by ``celery lease migrate``."""
        self.db.database.prepare(self.db.engine)

    # -- reads every operation uses ----------------------------------------------

    @db_errors
    def get(self, run_id: str) -> RunRecord | None:
        """The run row, or None."""
        with self.db.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.id == run_id)).mappings().first()
        return None if row is None else RunRecord(**dict(row))

    @db_errors
    def now_ms(self) -> int:
        """The database clock, in epoch milliseconds."""
        with self.db.connect() as conn:
            return int(conn.execute(select(db_now_ms())).scalar_one())

    def _lost(self, run_id: str, owner: str, attempt: int, action: str) -> LeaseLost:
        """A :class:`LeaseLost` whose reason says what the row holds now (failure path only)."""
        try:
            row = self.get(run_id)
        except Exception:  # the diagnosis must never hide the lease loss itself
            row = None
        if row is None:
            reason = f"{action}: run row not found"
        elif row.attempt != attempt or row.lease_owner != owner:
            reason = f"{action}: taken over by attempt {row.attempt} (status {row.status})"
        else:
            reason = f"{action}: run is {row.status}"
        return LeaseLost(run_id, owner, attempt, reason)

    # -- claiming a run --------------------------------------------------------

    @db_errors
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
        retries: int = 0,
        trace_context: str | None = None,
    ) -> ClaimResult:
        """Insert the run or take it over, atomically; ``attempt`` grows by one per claim.

        A run is taken over when it is queued/retrying and available, or running
        with an expired lease, and has attempts left and no cancel request.
        Otherwise nothing changes and the result says why (busy or finished).
        With ``max_concurrency``, the claim also waits (busy, reason
        ``concurrency``) while that many live leases share ``concurrency_key``;
        the count and the claim happen under one lock on the key. ``task_id``
        is the claiming delivery's Celery task id, recorded as the run's own.
        ``retries`` is the delivery's Celery ``retries``, kept with its message: a later
        delivery under the same task id with fewer is an older copy of the run's message
        (the original of a retry, delivered again), refused as ``stale``.
        ``trace_context`` is the claiming attempt's W3C ``traceparent``: a
        takeover keeps it with the first ``traceparent`` the row held (the
        attempt it continues) in the same statement, and the result returns both.
        The result also carries the run's ``generation`` (idempotency keys), read
        by the same statement.
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
            trace_context=trace_context,
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
            "payload_retries": retries,
            "trace_context": trace_context,
        }
        limit = max_concurrency if concurrency_key is not None else None
        for tries in range(1, CLAIM_CONTENTION_TRIES + 1):
            try:
                return self._claim_once(values, lease_ms, max_attempts, limit)
            except SQLAlchemyError as exc:
                if isinstance(exc, DBAPIError) and self.db.database.lock_wait_ended(exc):
                    # A transaction holds the row (a worker frozen inside fence()):
                    # that is a live owner as far as this claim can tell.
                    return ClaimResult(
                        "busy", run_id, owner, 0, RUNNING, self.db.bounds.lock, reason="locked"
                    )
                found = self.db.database.classify(exc)
                if found.cause not in CLAIM_CONTENTION:
                    raise
                if tries == CLAIM_CONTENTION_TRIES:
                    logger.info(
                        "celery-lease: claim of %s kept losing to concurrent claims (%s)",
                        run_id,
                        found.cause,
                        extra={"lease_event": Event.CLAIM_CONTENTION, "run_id": run_id},
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
        else:
            row = self._claim_path.claim(values, lease_ms, max_attempts)
        if row is not None:
            return ClaimResult(
                "claimed",
                run_id,
                owner,
                row[0],
                RUNNING,
                max_attempts=row[2],
                checkpoint=row[3],
                trace_context=row[4],
                generation=row[5],
            )
        return self._claim_refused(run_id, owner, max_attempts, values)

    def _claim_limited(
        self, values: dict[str, Any], lease_ms: int, max_attempts: int, limit: int
    ) -> ClaimResult | ClaimRow | None:
        """Claim under a per-key lock, only while fewer than ``limit`` live leases share the key.

        The count and the claim run in one transaction, under the database's
        key lock (``Database.lock_key`` and ``count_live``): PostgreSQL a
        transaction-scoped advisory try-lock, SQLite the write lock of ``BEGIN
        IMMEDIATE``, MySQL the count as a locking read.
        """
        key = values["concurrency_key"]
        now = db_now_ms()
        with self.db.begin() as conn:
            if not self.db.database.lock_key(conn, key):
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
                self.db.database.count_live(
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
                self._record_waiting(conn, values)
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
            return self._claim_path.claim(values, lease_ms, max_attempts, conn)

    def _record_waiting(self, conn: Connection, values: dict[str, Any]) -> None:
        """Record a run waiting for a concurrency slot as ``queued`` (with its arguments).

        The row is claimable at once (``available_at`` now): only the slot count, read
        under the key's lock, holds it back, so the delivery re-published to poll for
        a slot claims it as soon as one is free. (A later ``available_at``, such as the
        holder's lease end, also held that delivery back as a retry's backoff: the slot
        stayed idle until then.) Each refused poll moves ``available_at`` to now, never
        earlier than it was: if the re-published delivery is lost, the sweeper finds the
        row stranded ``stale_after`` seconds after the last poll and re-enqueues it.
        """
        now = db_now_ms()
        waiting = {
            **values,
            "status": QUEUED,
            "lease_owner": None,
            "attempt": 0,
            # No attempt ran: the trace context the row keeps is a claimer's.
            "trace_context": None,
            "available_at": now,
            "created_at": now,
            "updated_at": now,
        }
        later = case((runs.c.available_at > now, runs.c.available_at), else_=now)
        bump = {"available_at": later, "updated_at": now}
        self.db.database.record_waiting(conn, waiting, bump)

    # -- why a claim changed nothing ----------------------------------------------

    def _claim_refused(
        self, run_id: str, owner: str, max_attempts: int, values: dict[str, Any]
    ) -> ClaimResult:
        """Why a claim changed nothing; ends runs that can never be claimed again.

        A run with no row, or one the claim could have taken, was refused by a pause:
        the pause is read here, on the refusal path only.
        """
        for _ in range(5):
            now = db_now_ms()
            with self.db.connect() as conn:
                row = conn.execute(
                    select(
                        runs.c.status,
                        runs.c.attempt,
                        runs.c.cancel_requested_at,
                        runs.c.lease_expires_at - now,
                        runs.c.available_at - now,
                        runs.c.task_id,
                        runs.c.max_attempts,
                        runs.c.payload_retries,
                        runs.c.task_name,
                    ).where(runs.c.id == run_id)
                ).first()
            if row is None:
                paused = self.flow.pause_of(values["task_name"], values["concurrency_key"])
                if paused is not None:
                    return ClaimResult("paused", run_id, owner, 0, schema.QUEUED, reason=paused)
                return ClaimResult("busy", run_id, owner, 0, schema.QUEUED, 0.0)
            status, attempt, cancel_requested, lease_left, available_left, task_id = row[:6]
            max_attempts = max(max_attempts, int(row[6]))
            if status in schema.TERMINAL_STATUSES:
                return ClaimResult(
                    "finished", run_id, owner, attempt, status, task_id=task_id, task_name=row[8]
                )
            # An older copy of the run's own message (same task id, fewer retries).
            stale = task_id is not None and task_id == values["task_id"]
            if stale and int(row[7]) > values["payload_retries"]:
                kept = str(row[7])  # the retries of the message the run keeps
                return ClaimResult(
                    "stale", run_id, owner, attempt, status, reason=kept, task_id=task_id
                )
            wait_ms = lease_left if status == schema.RUNNING else available_left
            claimable = wait_ms is None or wait_ms <= 0
            if claimable and cancel_requested is not None:
                if self._end_unclaimable(
                    run_id, status, attempt, schema.CANCELLED, "cancelled", None
                ):
                    return ClaimResult(
                        "finished",
                        run_id,
                        owner,
                        attempt,
                        schema.CANCELLED,
                        task_id=task_id,
                        task_name=row[8],
                    )
                continue
            if claimable and attempt >= max_attempts:
                if status == schema.RUNNING:  # its last attempt's holder died: as a sweep says
                    code, error = "lease_expired", _expired_last(attempt, max_attempts)
                else:
                    code = "attempts_exhausted"
                    error = f"attempts exhausted: {attempt} of {max_attempts} used"
                if self._end_unclaimable(run_id, status, attempt, schema.FAILED, code, error):
                    return ClaimResult(
                        "finished",
                        run_id,
                        owner,
                        attempt,
                        schema.FAILED,
                        task_id=task_id,
                        task_name=row[8],
                    )
                continue
            if claimable:
                paused = self.flow.pause_of(values["task_name"], values["concurrency_key"])
                if paused is not None:
                    return ClaimResult("paused", run_id, owner, attempt, status, reason=paused)
                # It became claimable between our two statements: try again soon.
                return ClaimResult("busy", run_id, owner, attempt, status, 0.0, reason="due")
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
        with self.db.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @db_errors
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
        with self.db.connect() as conn:
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
                conn.execute(self.db.database.insert(runs).values(row))
            except SQLAlchemyError as exc:
                if self.db.database.classify(exc).cause != "duplicate_key":
                    raise
                return self.end_unclaimed(
                    run_id,
                    task_name=task_name,
                    max_attempts=max_attempts,
                    failure_code=failure_code,
                    error=error,
                )
        return schema.FAILED

    # -- while a lease is held: heartbeat, fence, guarded outcomes -----------------

    @db_errors
    def heartbeat(
        self, leases: Iterable[LeaseKey], progress: Mapping[LeaseKey, Progress] | None = None
    ) -> HeartbeatResult:
        """Renew every given lease that is still held and unexpired, in one statement.

        Each renewed lease expires ``lease_ms`` after the database's now. A lease
        not renewed (taken over, expired, ended) is reported lost. Renewed leases
        whose run has a cancel request are reported in ``cancel_requested``.
        ``progress`` (per lease, what its body reported since the last write) is
        written by the same statement, on the renewed rows only.
        """
        keys = list(leases)
        if not keys:
            return HeartbeatResult(frozenset(), frozenset(), frozenset())
        now = db_now_ms()
        reported, params = progress_values(progress or {})
        guard = and_(
            # The ids alone as well: InnoDB then reads the rows by primary key and
            # waits for no other run's lock (a fence holds its run's row lock).
            runs.c.id.in_([key[0] for key in keys]),
            tuple_(runs.c.id, runs.c.lease_owner, runs.c.attempt).in_(keys),
            runs.c.status == RUNNING,
            runs.c.lease_expires_at > now,
        )
        renew = (
            update(runs)
            .where(guard)
            .values(
                lease_expires_at=now + runs.c.lease_ms,
                heartbeat_at=now,
                updated_at=now,
                **reported,
            )
        )
        columns = (runs.c.id, runs.c.lease_owner, runs.c.attempt, runs.c.cancel_requested_at)
        rows = self.db.database.renew(self.db.engine, self.db.auto, renew, guard, columns, params)
        renewed = frozenset((r[0], r[1], int(r[2])) for r in rows)
        cancel = frozenset((r[0], r[1], int(r[2])) for r in rows if r[3] is not None)
        lost = frozenset(keys) - renewed
        return HeartbeatResult(renewed, lost, cancel)

    @db_errors
    def fence(
        self,
        connection: Connection,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        complete: bool = False,
        checkpoint: str | None = None,
        result: tuple[bytes, str] | None = None,
    ) -> None:
        """Inside the caller's transaction, lock the run row and prove the lease is live.

        Raises :class:`LeaseLost` unless this owner and attempt hold an unexpired
        lease. The row stays locked until the caller's transaction ends, so a
        takeover cannot slip in before the caller's writes commit. With
        ``complete=True`` the run is also marked ``succeeded`` in that same
        transaction: the caller's writes and the completion commit together.
        ``checkpoint`` (JSON text) is saved by the same statement, so it commits
        with the caller's writes; success clears it, as any success does.
        ``result`` (the body's return value serialized, ``(bytes, content type)``)
        is kept with a success by the same statement, as :meth:`complete` keeps it.
        """
        other = self._other_database(connection)
        if other is not None:
            raise self._not_lease_database(run_id, other)
        now = db_now_ms()
        values: dict[str, Any] = {"heartbeat_at": runs.c.heartbeat_at}
        if checkpoint is not None:
            values = checkpoint_values(now, checkpoint)
        if complete:
            values = success_values(now)
            if result is not None:
                values.update(result=result[0], result_content_type=result[1])
        stmt = (
            update(runs)
            .where(guarded(run_id, owner, attempt), runs.c.lease_expires_at > now)
            .values(**values)
        )
        try:
            changed = connection.execute(stmt).rowcount
        except SQLAlchemyError as exc:
            error = self.db.database.wrap(exc, self.db.dialect)
            if not error.transient and self._holds(run_id, owner, attempt):
                # The lease database shows the lease held, yet this connection has no
                # (usable) run table: it is another database, not a missing migration.
                raise self._not_lease_database(run_id, f"it failed there ({error.cause})") from exc
            raise
        if changed != 1:
            if self._holds(run_id, owner, attempt):
                raise self._not_lease_database(run_id, "the run is not held there")
            raise self._lost(run_id, owner, attempt, "fence refused")

    def _not_lease_database(self, run_id: str, why: str) -> LeaseUsageError:
        """The error of ``fence()`` on a connection to another database than the lease's."""
        lease_url = self.db.engine.url.render_as_string(hide_password=True)
        return LeaseUsageError(
            f"fence() on run {run_id}: the connection is not on the lease database "
            f"{lease_url} ({why}); fence a transaction of the lease database: "
            "`with self.lease.transaction() as conn:` (the lease is still held)"
        )

    def _other_database(self, connection: Connection) -> str | None:
        """Why ``connection`` is plainly on another database than the lease's, read from
        the two engines' URLs (no SQL); None when they may be the same one.

        A server's database is told apart only on the same host and port (a pooler
        may name it otherwise); a URL without a database (a wrapped DBAPI connection,
        Django's) is told apart by its dialect only.
        """
        ours = self.db.engine.url
        theirs = connection.engine.url
        if connection.dialect.name != self.db.dialect:
            return f"it is {connection.dialect.name}, the lease database is {self.db.dialect}"
        if not theirs.database or not ours.database:
            return None
        if self.db.dialect == "sqlite":
            mine, other = _sqlite_file(ours.database), _sqlite_file(theirs.database)
            if mine is not None and other is not None and mine != other:
                return f"it is the SQLite file {theirs.database}"
            return None
        same_server = (theirs.host, theirs.port) == (ours.host, ours.port)
        if same_server and theirs.database != ours.database:
            return f"it is the database {theirs.database!r}"
        return None

    def _holds(self, run_id: str, owner: str, attempt: int) -> bool:
        """True when the lease database shows this owner's unexpired lease (fence diagnosis)."""
        stmt = select(runs.c.id).where(
            guarded(run_id, owner, attempt), runs.c.lease_expires_at > db_now_ms()
        )
        try:
            with self.db.connect() as conn:
                return conn.execute(stmt).first() is not None
        except SQLAlchemyError:  # the diagnosis must never hide the refusal itself
            return False

    @db_errors
    def checkpoint(self, run_id: str, owner: str, attempt: int, state: str) -> None:
        """Save ``state`` (JSON text) as the run's checkpoint: one guarded UPDATE.

        Only this owner and attempt of a running run whose lease has not expired
        (DB clock) can; else :class:`LeaseLost`, and the row keeps the checkpoint
        it had. Durable when it returns (the statement commits by itself).
        """
        params = {"p_id": run_id, "p_owner": owner, "p_attempt": attempt, "p_checkpoint": state}
        if self._checkpoint_driver is not None:
            changed = self._checkpoint_driver.execute(params)[0]
        else:
            with self.db.connect() as conn:
                changed = conn.execute(self._checkpoint_stmt, params).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, "checkpoint refused")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection to the lease database inside a transaction, committed on success.

        The connection is proved live first (``Engines.begin_live``): after a
        database restart the caller's block, which cannot be replayed, never meets a
        dropped pooled connection. Errors there are :class:`LeaseDatabaseError`.
        """
        with contextlib.ExitStack() as stack:
            try:
                conn = stack.enter_context(self.db.begin_live())
            except SQLAlchemyError as exc:
                raise self.db.database.wrap(exc, self.db.dialect) from exc
            yield conn

    def _guarded_update(
        self, run_id: str, owner: str, attempt: int, action: str, **values: Any
    ) -> None:
        stmt = update(runs).where(guarded(run_id, owner, attempt)).values(**values)
        with self.db.connect() as conn:
            changed = conn.execute(stmt).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, f"{action} refused")

    @db_errors
    def complete(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        result: tuple[bytes, str] | None = None,
    ) -> None:
        """Record success; only the current owner of a running run can. Else :class:`LeaseLost`.

        ``result`` is the body's return value serialized, ``(bytes, content type)``,
        kept in the row by the same statement (for a replay of the outcome to
        Celery's result backend); the caller bounds its size.

        Idempotent for its owner: if this owner and attempt already completed
        the run (``fence(complete=True)``, or a retry after a lost reply), it
        returns quietly.
        """
        params: dict[str, Any] = {"p_id": run_id, "p_owner": owner, "p_attempt": attempt}
        if result is not None:
            params["p_result"], params["p_result_ct"] = result
        if self._complete_driver is not None:
            if self._complete_driver.execute(params)[0] == 1:
                return
        else:
            with self.db.connect() as conn:
                if conn.execute(self._complete_stmt, params).rowcount == 1:
                    return
        if result is not None:
            # Completed already by this owner's fence(complete=True): keep the
            # result now (this statement stands in for the read below).
            kept = (
                update(runs)
                .where(
                    runs.c.id == run_id,
                    runs.c.lease_owner == owner,
                    runs.c.attempt == attempt,
                    runs.c.status == SUCCEEDED,
                )
                .values(result=result[0], result_content_type=result[1])
            )
            with self.db.connect() as conn:
                if conn.execute(kept).rowcount == 1:
                    return
        row = self.get(run_id)
        if row and row.status == SUCCEEDED and row.lease_owner == owner and row.attempt == attempt:
            return
        raise self._lost(run_id, owner, attempt, "complete refused")

    @db_errors
    def fail(
        self,
        run_id: str,
        owner: str,
        attempt: int,
        *,
        error: str,
        failure_code: str,
        retry_in: float | None,
        message: tuple[bytes, str, int] | None = None,
    ) -> str:
        """Record a failed attempt: ``retrying`` after ``retry_in`` s, or ``failed`` when None.

        Guarded like :meth:`complete`. Returns the new status. ``message``
        (payload, content type, its Celery ``retries``) replaces the stored message of a
        retrying run, e.g. with the retry Celery published; a failed run keeps its message
        for ``lease rerun``.
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
                values.update(
                    payload=message[0], payload_content_type=message[1], payload_retries=message[2]
                )
        self._guarded_update(run_id, owner, attempt, "fail", **values)
        return status

    @db_errors
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

    @db_errors
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
            **(_CLEARED_ON_SUCCESS if status == SUCCEEDED else {}),
        )

    @db_errors
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
        with self.db.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @db_errors
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

    # -- recovery: kept deliveries, expired leases, shutdown hand-back -------------

    @db_errors
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
        retries: int = 0,
    ) -> bool:
        """Leave a delivery the broker refused to the sweeper; True when a sweep will send it.

        No row: a ``queued`` row (attempt 0) carrying the message and ``task_id``,
        available after ``available_in`` s, which :meth:`reclaim_stale` finds.
        A row that is not terminal and whose own delivery is this one (or that
        has no stored message, which it then takes) is left as it is:
        ``queued``/``retrying`` rows are reclaimed, a ``running`` one ends or is
        handed back by :meth:`sweep_expired`. A terminal row, or one whose own
        delivery has another task id, cannot carry this delivery: False. ``retries`` is
        the message's Celery ``retries``, kept with it.
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
            "payload_retries": retries,
            "created_at": now,
            "updated_at": now,
        }
        adopt = runs.c.payload.is_(None)
        keeps = and_(
            runs.c.status.not_in(sorted(TERMINAL_STATUSES)),
            or_(adopt, func.coalesce(runs.c.task_id, runs.c.id) == task_id),
        )
        return self.db.database.keep(self.db.engine, self.db.auto, waiting, adopt, keeps)

    @db_errors
    def sweep_expired(
        self, limit: int = 500, *, leader: LeaderTerm | None = None
    ) -> list[tuple[RunRecord, str]]:
        """End or hand back running runs whose lease expired (DB clock), at most ``limit``.

        Each row moves, by a statement guarded on owner, attempt, status and the
        expiry, to ``retrying`` (available now; ``requeues`` and ``republishes`` grow by
        one, ``republished_at`` is now), or ``failed`` with
        ``lease_expired`` when attempts are spent, or ``cancelled`` when a cancel
        was requested. Only rows this call moved are returned, so two sweepers
        never both act on the same expired lease. On PostgreSQL and MySQL the
        rows are read ``FOR UPDATE SKIP LOCKED``: a row locked by a stalled
        transaction is skipped this time, never waited for. With ``leader``, the
        transaction is fenced by that leader term (:meth:`Leaders.hold`): a sweeper
        that lost its leader lease changes nothing (:class:`LeadershipLost`).
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
        query = self.db.database.lock_expired(query)
        moved: list[tuple[RunRecord, str]] = []
        with self.db.begin() as conn:
            if leader is not None:
                self.leaders.hold(conn, leader)
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
                last_error=_expired_last(record.attempt, record.max_attempts),
                finished_at=now,
            )
        else:
            status = RETRYING
            values.update(
                available_at=now,
                failure_code="lease_expired",
                last_error=f"lease expired on attempt {record.attempt} (worker lost or stalled)",
                # The sweeper publishes it now: one more re-publish since the last claim,
                # and in all (the history no claim resets).
                requeues=runs.c.requeues + 1,
                republishes=runs.c.republishes + 1,
                republished_at=now,
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

    @db_errors
    def reclaim_stale(
        self, older_than: float, limit: int = 500, *, leader: LeaderTerm | None = None
    ) -> list[tuple[RunRecord, str]]:
        """Queued/retrying runs available for ``older_than`` s yet never claimed, and after
        each re-send twice as long again (:func:`~celery_lease.store.sql.stranded_wait`).

        Their delivery was most likely lost (a broker that does not redeliver, a
        failed publish, a task no worker runs leased). Each returned row was
        moved by a statement guarded on its status, attempt, ``available_at``
        and ``requeues``, so concurrent sweepers return disjoint rows, with the
        status it has now:

        - the row's own status (``queued``/``retrying``): ``available_at`` moved
          to now, ``requeues`` and ``republishes`` grown by one and ``republished_at``
          now; the caller publishes it again;
        - ``failed`` with ``undeliverable``: the sweeper had already published it
          ``max_attempts`` times (at least :data:`STRANDED_RESENDS`) since a worker
          last claimed it, so it is ended instead (its message is kept for ``celery
          lease rerun``).

        With ``leader``, it runs in one transaction fenced by that leader term, as
        :meth:`sweep_expired`.
        """
        now = db_now_ms()
        first_ms = round(older_than * 1000)
        with self.db.begin() if leader is not None else self.db.connect() as conn:
            if leader is not None:
                self.leaders.hold(conn, leader)
            rows = (
                conn.execute(
                    select(runs)
                    .where(
                        runs.c.status.in_((QUEUED, RETRYING)),
                        runs.c.available_at <= now - first_ms,
                        runs.c.available_at + stranded_wait(first_ms) <= now,
                        runs.c.cancel_requested_at.is_(None),
                        # No message: a direct call or eager apply(); never sent to workers.
                        runs.c.payload.is_not(None),
                        # A paused run waits for its resume, however long.
                        not_paused(runs.c.task_name, runs.c.concurrency_key),
                    )
                    .order_by(runs.c.available_at)
                    .limit(limit)
                )
                .mappings()
                .all()
            )
            taken: list[tuple[RunRecord, str]] = []
            for row in rows:
                record = RunRecord(**dict(row))
                unchanged = and_(
                    runs.c.id == record.id,
                    runs.c.status == record.status,
                    runs.c.attempt == record.attempt,
                    runs.c.available_at == record.available_at,
                    runs.c.requeues == record.requeues,
                )
                if record.requeues >= max(record.max_attempts, STRANDED_RESENDS):
                    status = FAILED
                    error = (
                        f"published {record.requeues} times by the sweeper and never claimed "
                        "(the task is unregistered or not leased on the workers, routes to a "
                        "queue no worker consumes, or its workers stayed busy all that time)"
                    )
                    values = ended_values(db_now_ms(), FAILED, "undeliverable", error)
                else:
                    status = record.status
                    values = {
                        "available_at": db_now_ms(),
                        "updated_at": db_now_ms(),
                        "requeues": runs.c.requeues + 1,
                        "republishes": runs.c.republishes + 1,
                        "republished_at": db_now_ms(),
                    }
                if conn.execute(update(runs).where(unchanged).values(**values)).rowcount == 1:
                    taken.append((record, status))
        return taken

    @db_errors
    def record_sweep(
        self,
        name: str,
        *,
        sweeper: str,
        took_ms: int,
        requeued: int = 0,
        failed: int = 0,
        cancelled: int = 0,
        purged: int = 0,
        errors: int = 0,
        leader: LeaderTerm | None = None,
    ) -> None:
        """Record that the sweeper ``name`` swept this database now (DB clock): who swept,
        how long it took and what it did. One row per name, replaced each sweep; one
        short transaction (an ``UPDATE``, and an ``INSERT`` the first time), fenced by
        ``leader`` when given."""
        values: dict[str, Any] = {
            "swept_at": db_now_ms(),
            "took_ms": max(0, int(took_ms)),
            "sweeper": sweeper[: schema.MAX_ID_LENGTH],
            "requeued": requeued,
            "failed": failed,
            "cancelled": cancelled,
            "purged": purged,
            "errors": errors,
        }
        row = schema.sweeps.c.name == name[:64]
        for tries in (1, 2):
            try:
                with self.db.begin() as conn:
                    if leader is not None:
                        self.leaders.hold(conn, leader)
                    changed = conn.execute(update(schema.sweeps).where(row).values(**values))
                    if changed.rowcount == 0:
                        conn.execute(insert(schema.sweeps).values(name=name[:64], **values))
                return
            except IntegrityError:  # another sweeper of that name inserted first: update
                if tries == 2:
                    raise

    @db_errors
    def release_owned_by(self, worker_id: str) -> list[RunRecord]:
        """Hand back every running lease taken by the worker whose id is ``worker_id``.

        Used on a worker's cold shutdown. Owners taken inside a worker end in
        ``.<worker id>`` (a random id per worker, see ``celery_lease.app.worker_id``),
        so another worker is never touched, even one with the same node name.
        Each release is guarded like :meth:`release`; the released rows are returned.
        """
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        with self.db.connect() as conn:
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

    # -- flow control: pauses, rate limits, held deliveries --------------------------

    # -- operators: expire, cancel, retention --------------------------------------

    @db_errors
    def expire(self, run_id: str) -> bool:
        """End a running run's lease now, so another worker may take it over.

        For operators and tests of the lease-lost path. Returns True when a
        running lease was expired.
        """
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status == schema.RUNNING)
            .values(lease_expires_at=now, updated_at=now)
        )
        with self.db.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @db_errors
    def cancel(
        self,
        run_id: str,
        *,
        task_id: str | None = None,
        running: bool = True,
        terminated_in: str | None = None,
    ) -> str:
        """Cancel a run: queued/retrying end ``cancelled`` at once; running get a request.

        Returns the resulting status (``cancelled``, or ``running`` with
        ``cancel_requested_at`` set, or the status it has when nothing changed).
        With ``task_id``, only a run whose own delivery has that Celery task id
        is touched (a revoked duplicate never cancels the run it duplicates):
        another's run returns :data:`OTHER_DELIVERY`.
        With ``running=False`` a running run is left alone (an expired copy of
        its message must not stop the delivery that runs it).
        ``terminated_in``: the id of the worker in which ``revoke(terminate=True)``
        killed the run's body. A running run a process of that worker holds (under
        ``task_id``: the killed body's) ends ``cancelled`` at once, as the sweeper would
        end it once the lease expired; one held elsewhere gets a request.
        Raises :class:`RunNotFound` for an unknown id.
        """
        now = db_now_ms()
        own = (
            runs.c.id == run_id
            if task_id is None
            else and_(runs.c.id == run_id, runs.c.task_id == task_id)
        )
        ended = {
            "status": schema.CANCELLED,
            "failure_code": "cancelled",
            "cancel_requested_at": func.coalesce(runs.c.cancel_requested_at, now),
            "lease_expires_at": now,  # when it ended: `lease top` counts recent ends by it
            "finished_at": now,
            "updated_at": now,
        }
        at_once = (
            update(runs)
            .where(own, runs.c.status.in_((schema.QUEUED, schema.RETRYING)))
            .values({**ended, "cancel_requested_at": now})
        )
        held_by_killed = None
        if terminated_in:
            held_by_killed = (
                update(runs)
                .where(
                    own,
                    runs.c.status == schema.RUNNING,
                    runs.c.lease_owner.endswith(f".{terminated_in}", autoescape=True),
                )
                .values(ended)
            )
        request = (
            update(runs)
            .where(own, runs.c.status == schema.RUNNING)
            .values(
                cancel_requested_at=func.coalesce(runs.c.cancel_requested_at, now),
                updated_at=now,
            )
        )
        with self.db.connect() as conn:
            if conn.execute(at_once).rowcount == 1:
                return schema.CANCELLED
            if held_by_killed is not None and conn.execute(held_by_killed).rowcount == 1:
                return schema.CANCELLED
            if running and conn.execute(request).rowcount == 1:
                return schema.RUNNING
            row = conn.execute(
                select(runs.c.status, runs.c.task_id).where(runs.c.id == run_id)
            ).first()
        if row is None:
            raise RunNotFound(run_id)
        status, own_task_id = row
        if task_id is not None and own_task_id != task_id:
            return OTHER_DELIVERY
        if status == schema.RUNNING and not running:
            return str(status)
        if status not in schema.TERMINAL_STATUSES:
            # It changed status between the statements: try again.
            return self.cancel(
                run_id, task_id=task_id, running=running, terminated_in=terminated_in
            )
        return str(status)

    @db_errors
    def purge_finished(self, status: str, older_than_ms: int, limit: int = PURGE_BATCH) -> int:
        """Delete the oldest ``limit`` rows of ``status`` finished over ``older_than_ms`` ago.

        Only terminal rows (``succeeded``, ``failed``, ``cancelled``) are ever
        touched. One short transaction, in the order of the
        ``(status, finished_at)`` index; on PostgreSQL and MySQL the rows are
        picked ``FOR UPDATE SKIP LOCKED``, so a concurrent purge or a locked row
        is skipped, never waited for. Returns how many rows were deleted.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        finished = purgeable(status, older_than_ms)
        oldest = (
            select(runs.c.id)
            .where(finished)
            .order_by(runs.c.finished_at)
            .limit(limit)
            .with_for_update(skip_locked=True)  # SQLite compiles no FOR UPDATE
        )
        return self.db.database.purge(self.db.engine, self.db.auto, oldest, finished)

    @db_errors
    def clear_results(self, finished_before_ms: int, limit: int = PURGE_BATCH) -> int:
        """Drop the kept result of at most ``limit`` succeeded runs that finished before
        ``finished_before_ms`` (DB clock): Celery's ``result_expires`` has passed for them.

        Two short statements, oldest first in the order of the ``(status,
        finished_at)`` index: the pick, then the update of the picked ids (the
        condition re-checked). The store remembers up to when every result is
        cleared, so a later call reads only the rows finished since (the first
        call in a process reads the index from the start). Returns how many
        results were cleared.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        expired = and_(
            runs.c.status == SUCCEEDED,
            runs.c.finished_at >= self._results_cleared_to,
            runs.c.finished_at < finished_before_ms,
            runs.c.result.is_not(None),
        )
        pick = (
            select(runs.c.id, runs.c.finished_at)
            .where(expired)
            .order_by(runs.c.finished_at)
            .limit(limit)
        )
        with self.db.connect() as conn:
            picked = conn.execute(pick).all()
        if len(picked) < limit:
            self._results_cleared_to = max(self._results_cleared_to, finished_before_ms)
        else:
            self._results_cleared_to = max(self._results_cleared_to, int(picked[-1][1]))
        if not picked:
            return 0
        stmt = (
            update(runs)
            .where(runs.c.id.in_([row[0] for row in picked]), expired)
            .values(result=None, result_content_type=None)
        )
        with self.db.connect() as conn:
            return int(conn.execute(stmt).rowcount)

    @db_errors
    def count_expired_results(self, finished_before_ms: int) -> int:
        """How many results :meth:`clear_results` would drop for ``finished_before_ms``;
        read only (``lease purge --dry-run``)."""
        stmt = (
            select(func.count())
            .select_from(runs)
            .where(
                runs.c.status == SUCCEEDED,
                runs.c.finished_at < finished_before_ms,
                runs.c.result.is_not(None),
            )
        )
        with self.db.connect() as conn:
            return int(conn.execute(stmt).scalar() or 0)

    # -- the CLI's reads and rerun ------------------------------------------------

    @db_errors
    def rerun(
        self,
        run_id: str,
        *,
        attempts: int,
        force: bool = False,
        task_id: str | None = None,
        from_scratch: bool = False,
    ) -> RunRecord:
        """Put a ``failed``/``cancelled`` run (``succeeded`` too with ``force``) back to ``queued``.

        One guarded UPDATE (``WHERE status IN (...)``), so a run a worker holds
        or has queued is never touched. The run gets ``attempts`` fresh attempts
        without lowering ``attempt``, the fencing token: ``max_attempts`` becomes
        ``attempt + attempts``. Owner, lease, cancel request, failure and times
        of the ended series are cleared; the stored message (if any) is kept,
        and the run's own ``task_id`` too unless ``task_id`` gives the one it is
        published under now. The checkpoint is kept (the next attempt resumes
        from it) unless ``from_scratch``, which clears it and the progress.
        A ``succeeded`` run's ``generation`` grows by one (only then): its
        idempotency keys change, so the rerun's external effects happen anew.
        Returns the row as it is now. Raises
        :class:`RunNotFound`, or :class:`RunNotRerunnable` with the status found.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        allowed = [schema.FAILED, schema.CANCELLED] + ([schema.SUCCEEDED] if force else [])
        now = db_now_ms()
        values: dict[str, Any] = {
            "status": schema.QUEUED,
            "max_attempts": runs.c.attempt + attempts,
            "lease_owner": None,
            "lease_expires_at": None,
            "heartbeat_at": None,
            "available_at": now,
            "cancel_requested_at": None,
            "started_at": None,
            "finished_at": None,
            "last_error": None,
            "failure_code": None,
            "requeues": 0,
            "updated_at": now,
            # A new task id starts a new line of messages: none is older than its first.
            **({} if task_id is None else {"task_id": task_id, "payload_retries": 0}),
            **(_FROM_SCRATCH if from_scratch else {}),
        }
        bump = case((runs.c.status == SUCCEEDED, runs.c.generation + 1), else_=runs.c.generation)
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status.in_(allowed))
            # The generation first: MySQL evaluates SET left to right, so a later
            # assignment would read the status this statement already set.
            .ordered_values(("generation", bump), *values.items())
        )
        with self.db.connect() as conn:
            changed = conn.execute(stmt).rowcount
        record = self.get(run_id)
        if record is None:
            raise RunNotFound(run_id)
        if changed != 1:
            raise RunNotRerunnable(run_id, record.status)
        return record

    @db_errors
    def rerun_many(
        self, task_ids: Mapping[str, str], *, status: str, attempts: int
    ) -> list[RunRecord]:
        """Put the runs ``task_ids`` names (run id -> the new task id to publish each under)
        back to ``queued``, as :meth:`rerun` does, if each is still ``status`` (``failed`` or
        ``cancelled``) and keeps a stored message; the rows changed, as they are now.

        One short transaction: one guarded ``UPDATE .. WHERE id IN (..) AND status = ..``
        (the new task ids by one ``CASE`` on the id), then the read of the rows it changed
        (found by their new task ids, which nothing else writes). A run that changed
        meanwhile, or has no message to publish, is left alone and not returned.
        """
        if status not in (schema.FAILED, schema.CANCELLED):
            raise ValueError(f"only failed or cancelled runs are rerun in bulk, not {status!r}")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        if not task_ids:
            return []
        ids = list(task_ids)
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(
                runs.c.id.in_(ids),
                runs.c.status == status,
                runs.c.payload.is_not(None),
            )
            .values(
                status=schema.QUEUED,
                max_attempts=runs.c.attempt + attempts,
                lease_owner=None,
                lease_expires_at=None,
                heartbeat_at=None,
                available_at=now,
                cancel_requested_at=None,
                started_at=None,
                finished_at=None,
                last_error=None,
                failure_code=None,
                requeues=0,
                updated_at=now,
                task_id=case(task_ids, value=runs.c.id, else_=runs.c.task_id),
                payload_retries=0,  # each under a new task id (see rerun)
            )
        )
        changed = select(runs).where(
            runs.c.id.in_(ids), runs.c.task_id.in_(list(task_ids.values()))
        )
        with self.db.begin() as conn:
            if conn.execute(stmt).rowcount == 0:
                return []
            rows = conn.execute(changed).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    # -- the web view's reads ---------------------------------------------------------


def _sqlite_file(database: str) -> str | None:
    """The real path of a SQLite URL's file; None for an in-memory or URI database."""
    if database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.realpath(database)


def _expired_last(attempt: int, max_attempts: int) -> str:
    """``last_error`` of a run whose last attempt's lease expired."""
    return f"lease expired on attempt {attempt} of {max_attempts} (worker lost or stalled)"
