"""The lease store: :class:`LeaseStore`, one method per operation on the runs table.

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
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    case,
    delete,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from .. import schema
from ..errors import LeaseLost, LeaseUsageError, RunNotFound, RunNotRerunnable
from ..schema import (
    CANCELLED,
    FAILED,
    HELD_PAUSED,
    HELD_RATE,
    QUEUED,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATUSES,
    check_claim_inputs,
    db_now_ms,
    held,
    pauses,
    runs,
)
from .bounds import DEFAULT_BOUNDS, WaitBounds
from .database import CLAIM_CONTENTION, ClaimRow, create_schema
from .databases import backend_of, database_for
from .driver import DriverStatement
from .records import (
    _CLEARED_MESSAGE,
    _CLEARED_ON_SUCCESS,
    CLAIM_CONTENTION_TRIES,
    PURGE_BATCH,
    Activity,
    ClaimResult,
    FlowCounts,
    HeartbeatResult,
    HeldRecord,
    LeaseKey,
    Pause,
    Progress,
    RunPageQuery,
    RunRecord,
    RunSummary,
    TaskCounts,
)
from .sql import (
    checkpoint_by_binds,
    checkpoint_values,
    complete_by_binds,
    ended_values,
    guarded,
    lease_expired_since,
    not_paused,
    oldest_running,
    progress_values,
    purgeable,
    run_page,
    success_values,
)

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: What ``rerun(from_scratch=True)`` clears: the run starts again with no checkpoint.
_FROM_SCRATCH: dict[str, Any] = {
    "checkpoint": None,
    "checkpoint_at": None,
    "progress_done": None,
    "progress_total": None,
    "progress_note": None,
    "progress_at": None,
}


def _db_errors(method: F) -> F:
    """Raise SQLAlchemy and driver errors of a store method as :class:`LeaseDatabaseError`.

    Classified by the store's database object (transient or permanent, and the
    cause); the driver's exception is kept as ``__cause__``.
    """

    @functools.wraps(method)
    def wrapper(self: LeaseStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise self.database.wrap(exc, self.dialect) from exc

    return cast(F, wrapper)


class LeaseStore:
    """All lease SQL, over one SQLAlchemy engine.

    Single statements run in autocommit mode (one round trip each); the few
    read-then-write paths run in one short transaction.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        autocommit_engine: Engine | None = None,
        bounds: WaitBounds = DEFAULT_BOUNDS,
    ) -> None:
        """Use ``engine`` for transactions and ``autocommit_engine`` for single statements.

        ``bounds`` sets SQLite's busy timeout; on servers the waits are bounded
        by the engines themselves (:func:`create_lease_engine`).

        Without ``autocommit_engine``, single statements borrow ``engine``'s pool
        in autocommit mode (each check-in then resets the isolation level). On
        SQLite they borrow it as it is: pysqlite's own transaction handling is
        off on this store's connections, so a statement outside ``BEGIN``
        commits by itself, with no isolation-level switch.
        """
        self.engine = engine
        self.dialect = engine.dialect.name
        #: What differs on this database: the store asks it to do that work.
        self.database = database_for(self.dialect)
        self.bounds = bounds
        self._own_auto = autocommit_engine
        self._auto, raw = self.database.single_statements(engine, bounds, autocommit_engine)
        # The hot path's two statements are compiled once; on an engine in
        # autocommit mode they run at the driver level (DriverStatement).
        self._claim_path = self.database.claim_path(engine, self._auto, raw=raw)
        self._complete_stmt = complete_by_binds()
        self._complete_driver = (
            DriverStatement(self._auto, self._complete_stmt, returns_row=False) if raw else None
        )
        self._checkpoint_stmt = checkpoint_by_binds()
        self._checkpoint_driver = (
            DriverStatement(self._auto, self._checkpoint_stmt, returns_row=False) if raw else None
        )

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float | None = None, **engine_kwargs: Any
    ) -> LeaseStore:
        """A store on new engines for ``url``, its waits bounded for ``lease_seconds``.

        On servers, single statements get an engine of their own whose
        connections stay in autocommit mode (no reset per check-out); SQLite
        shares one pool, whose connections commit each statement outside
        ``BEGIN`` by themselves. Without ``lease_seconds`` the bounds are those
        of the default 30 s lease.

        Raises:
            LeaseDatabaseError: SQLAlchemy could not make an engine (a malformed
                URL, an unknown dialect) or reach the database while setting it
                up; the SQLAlchemy error is ``__cause__``.
        """
        bounds = DEFAULT_BOUNDS if lease_seconds is None else WaitBounds.for_lease(lease_seconds)
        backend = backend_of(url)
        database = database_for(backend)
        try:
            engine, auto = database.open(url, bounds, **engine_kwargs)
            return cls(engine, autocommit_engine=auto, bounds=bounds)
        except SQLAlchemyError as exc:
            raise database.wrap(exc, backend) from exc

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine this store runs statements on (for instrumentation)."""
        return (self.engine,) if self._own_auto is None else (self.engine, self._own_auto)

    def dispose(self) -> None:
        """Close every pooled connection of this store."""
        for engine in self.engines:
            engine.dispose()

    def dispose_after_fork(self) -> None:
        """Drop pooled connections inherited from a parent process without closing them."""
        for engine in self.engines:
            engine.dispose(close=False)

    # -- schema ---------------------------------------------------------------

    @_db_errors
    def create_schema(self) -> None:
        """Create the runs table and any index it lacks (the embedded default; else migrate)."""
        create_schema(self.engine)

    @_db_errors
    def has_schema(self) -> bool:
        """True when the runs table exists."""
        return bool(inspect(self.engine).has_table(runs.name))

    @_db_errors
    def prepare(self) -> None:
        """Make the database ready for tasks: SQLite, the embedded default, gets its table;
        a server's is made by ``celery lease migrate``."""
        self.database.prepare(self.engine)

    # -- reads every operation uses ----------------------------------------------

    @_db_errors
    def get(self, run_id: str) -> RunRecord | None:
        """The run row, or None."""
        with self._auto.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.id == run_id)).mappings().first()
        return None if row is None else RunRecord(**dict(row))

    @_db_errors
    def now_ms(self) -> int:
        """The database clock, in epoch milliseconds."""
        with self._auto.connect() as conn:
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
        ``trace_context`` is the claiming attempt's W3C ``traceparent``: a
        takeover keeps it with the first ``traceparent`` the row held (the
        attempt it continues) in the same statement, and the result returns both.
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
            "trace_context": trace_context,
        }
        limit = max_concurrency if concurrency_key is not None else None
        for tries in range(1, CLAIM_CONTENTION_TRIES + 1):
            try:
                return self._claim_once(values, lease_ms, max_attempts, limit)
            except SQLAlchemyError as exc:
                if isinstance(exc, DBAPIError) and self.database.lock_wait_ended(exc):
                    # A transaction holds the row (a worker frozen inside fence()):
                    # that is a live owner as far as this claim can tell.
                    return ClaimResult(
                        "busy", run_id, owner, 0, RUNNING, self.bounds.lock, reason="locked"
                    )
                found = self.database.classify(exc)
                if found.cause not in CLAIM_CONTENTION:
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
        with self.engine.begin() as conn:
            if not self.database.lock_key(conn, key):
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
                self.database.count_live(
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
            return self._claim_path.claim(values, lease_ms, max_attempts, conn)

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
            # No attempt ran: the trace context the row keeps is a claimer's.
            "trace_context": None,
            "available_at": now + wait_ms,
            "created_at": now,
            "updated_at": now,
        }
        bump = {"available_at": now + wait_ms, "updated_at": now}
        self.database.record_waiting(conn, waiting, bump)

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
            with self._auto.connect() as conn:
                row = conn.execute(
                    select(
                        runs.c.status,
                        runs.c.attempt,
                        runs.c.cancel_requested_at,
                        runs.c.lease_expires_at - now,
                        runs.c.available_at - now,
                        runs.c.task_id,
                        runs.c.max_attempts,
                    ).where(runs.c.id == run_id)
                ).first()
            if row is None:
                paused = self._pause_of(values["task_name"], values["concurrency_key"])
                if paused is not None:
                    return ClaimResult("paused", run_id, owner, 0, schema.QUEUED, reason=paused)
                return ClaimResult("busy", run_id, owner, 0, schema.QUEUED, 0.0)
            status, attempt, cancel_requested, lease_left, available_left, task_id, ceiling = row
            max_attempts = max(max_attempts, int(ceiling))
            if status in schema.TERMINAL_STATUSES:
                return ClaimResult("finished", run_id, owner, attempt, status, task_id=task_id)
            wait_ms = lease_left if status == schema.RUNNING else available_left
            claimable = wait_ms is None or wait_ms <= 0
            if claimable and cancel_requested is not None:
                if self._end_unclaimable(
                    run_id, status, attempt, schema.CANCELLED, "cancelled", None
                ):
                    return ClaimResult(
                        "finished", run_id, owner, attempt, schema.CANCELLED, task_id=task_id
                    )
                continue
            if claimable and attempt >= max_attempts:
                code = "lease_expired" if status == schema.RUNNING else "attempts_exhausted"
                error = f"attempts exhausted: {attempt} of {max_attempts} used"
                if self._end_unclaimable(run_id, status, attempt, schema.FAILED, code, error):
                    return ClaimResult(
                        "finished", run_id, owner, attempt, schema.FAILED, task_id=task_id
                    )
                continue
            if claimable:
                paused = self._pause_of(values["task_name"], values["concurrency_key"])
                if paused is not None:
                    return ClaimResult("paused", run_id, owner, attempt, status, reason=paused)
                # It became claimable between our two statements: try again soon.
                return ClaimResult("busy", run_id, owner, attempt, status, 0.0, reason="race")
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
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
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
        with self._auto.connect() as conn:
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
                conn.execute(self.database.insert(runs).values(row))
            except SQLAlchemyError as exc:
                if self.database.classify(exc).cause != "duplicate_key":
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

    @_db_errors
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
        rows = self.database.renew(self.engine, self._auto, renew, guard, columns, params)
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
        checkpoint: str | None = None,
    ) -> None:
        """Inside the caller's transaction, lock the run row and prove the lease is live.

        Raises :class:`LeaseLost` unless this owner and attempt hold an unexpired
        lease. The row stays locked until the caller's transaction ends, so a
        takeover cannot slip in before the caller's writes commit. With
        ``complete=True`` the run is also marked ``succeeded`` in that same
        transaction: the caller's writes and the completion commit together.
        ``checkpoint`` (JSON text) is saved by the same statement, so it commits
        with the caller's writes; success clears it, as any success does.
        """
        now = db_now_ms()
        values: dict[str, Any] = {"heartbeat_at": runs.c.heartbeat_at}
        if checkpoint is not None:
            values = checkpoint_values(now, checkpoint)
        if complete:
            values = success_values(now)
        stmt = (
            update(runs)
            .where(guarded(run_id, owner, attempt), runs.c.lease_expires_at > now)
            .values(**values)
        )
        if connection.execute(stmt).rowcount != 1:
            if self._holds(run_id, owner, attempt):
                raise LeaseUsageError(
                    f"fence() on run {run_id}: the connection is not on the lease database "
                    f"({self.engine.url.render_as_string(hide_password=True)}), where this "
                    "lease is held; use `with self.lease.transaction() as conn:`"
                )
            raise self._lost(run_id, owner, attempt, "fence refused")

    def _holds(self, run_id: str, owner: str, attempt: int) -> bool:
        """True when the lease database shows this owner's unexpired lease (fence diagnosis)."""
        stmt = select(runs.c.id).where(
            guarded(run_id, owner, attempt), runs.c.lease_expires_at > db_now_ms()
        )
        try:
            with self._auto.connect() as conn:
                return conn.execute(stmt).first() is not None
        except SQLAlchemyError:  # the diagnosis must never hide the refusal itself
            return False

    @_db_errors
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
            with self._auto.connect() as conn:
                changed = conn.execute(self._checkpoint_stmt, params).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, "checkpoint refused")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection to the lease database inside a transaction, committed on success."""
        with self.engine.begin() as conn:
            yield conn

    def _guarded_update(
        self, run_id: str, owner: str, attempt: int, action: str, **values: Any
    ) -> None:
        stmt = update(runs).where(guarded(run_id, owner, attempt)).values(**values)
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        if changed != 1:
            raise self._lost(run_id, owner, attempt, f"{action} refused")

    @_db_errors
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
            with self._auto.connect() as conn:
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
            with self._auto.connect() as conn:
                if conn.execute(kept).rowcount == 1:
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
            **(_CLEARED_ON_SUCCESS if status == SUCCEEDED else {}),
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

    # -- recovery: kept deliveries, expired leases, shutdown hand-back -------------

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
        return self.database.keep(self.engine, self._auto, waiting, adopt, keeps)

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
        query = self.database.lock_expired(query)
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
                # The sweeper publishes it now: one more re-publish since the last claim.
                requeues=runs.c.requeues + 1,
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
    def reclaim_stale(self, older_than: float, limit: int = 500) -> list[tuple[RunRecord, str]]:
        """Queued/retrying runs available for ``older_than`` s yet never claimed.

        Their delivery was most likely lost (a broker that does not redeliver, a
        failed publish, a task no worker runs leased). Each returned row was
        moved by a statement guarded on its status, attempt, ``available_at``
        and ``requeues``, so concurrent sweepers return disjoint rows, with the
        status it has now:

        - the row's own status (``queued``/``retrying``): ``available_at`` moved
          to now and ``requeues`` grown by one; the caller publishes it again;
        - ``failed`` with ``undeliverable``: the sweeper had already published it
          ``max_attempts`` times since a worker last claimed it, so it is ended
          instead (its message is kept for ``celery lease rerun``).
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
                if record.requeues >= record.max_attempts:
                    status = FAILED
                    error = (
                        f"published {record.requeues} times by the sweeper and never claimed "
                        "(the task is unregistered or not leased on the workers, or routes to "
                        "a queue no worker consumes)"
                    )
                    values = ended_values(db_now_ms(), FAILED, "undeliverable", error)
                else:
                    status = record.status
                    values = {
                        "available_at": db_now_ms(),
                        "updated_at": db_now_ms(),
                        "requeues": runs.c.requeues + 1,
                    }
                if conn.execute(update(runs).where(unchanged).values(**values)).rowcount == 1:
                    taken.append((record, status))
        return taken

    @_db_errors
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
    ) -> None:
        """Record that the sweeper ``name`` swept this database now (DB clock): who swept,
        how long it took and what it did. One row per name, replaced each sweep; one
        short transaction (an ``UPDATE``, and an ``INSERT`` the first time)."""
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
                with self.engine.begin() as conn:
                    changed = conn.execute(update(schema.sweeps).where(row).values(**values))
                    if changed.rowcount == 0:
                        conn.execute(insert(schema.sweeps).values(name=name[:64], **values))
                return
            except IntegrityError:  # another sweeper of that name inserted first: update
                if tries == 2:
                    raise

    @_db_errors
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
        with self._auto.connect() as conn:
            row = conn.execute(stmt).mappings().first()
        return None if row is None else dict(row)

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

    # -- flow control: pauses, rate limits, held deliveries --------------------------

    def _pause_of(self, task_name: str, key: str | None) -> str | None:
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
        with self._auto.connect() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else str(row[0] or "")

    @_db_errors
    def pause(self, task_name: str, key: str | None = None, reason: str | None = None) -> bool:
        """Pause ``task_name`` (or only its runs of concurrency ``key``): from now on no claim
        of it succeeds. True when this call paused it; a pause already there keeps its time
        and gets ``reason`` if one is given."""
        schema.check_run_id(task_name, "task_name")
        if key is not None:
            schema.check_run_id(key, "key")
        row = pauses.c.task_name == task_name, pauses.c.pause_key == (key or "")
        values = {"task_name": task_name, "pause_key": key or "", "reason": reason}
        with self.engine.begin() as conn:
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

    @_db_errors
    def resume(self, task_name: str, key: str | None = None) -> bool:
        """Remove the pause of ``task_name`` (or of its concurrency ``key``); True when there
        was one. Held deliveries are published by :meth:`take_held` and its caller."""
        stmt = delete(pauses).where(
            pauses.c.task_name == task_name, pauses.c.pause_key == (key or "")
        )
        with self._auto.connect() as conn:
            return int(conn.execute(stmt).rowcount) == 1

    @_db_errors
    def list_pauses(self) -> list[Pause]:
        """Every pause, oldest first, with the deliveries it holds back now; read only."""
        with self._auto.connect() as conn:
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

    @_db_errors
    def flow_counts(self) -> FlowCounts:
        """Deliveries held back now per task and key, paused and deferred; one read."""
        now = db_now_ms()
        stmt = select(held.c.reason, held.c.task_name, held.c.flow_key, func.count(), now).group_by(
            held.c.reason, held.c.task_name, held.c.flow_key
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).all()
            db_now = int(conn.execute(select(now)).scalar_one()) if not rows else int(rows[0][4])
        paused = {(r[1], r[2]): int(r[3]) for r in rows if r[0] == HELD_PAUSED}
        deferred = {(r[1], r[2]): int(r[3]) for r in rows if r[0] == HELD_RATE}
        return FlowCounts(db_now, paused, deferred)

    @_db_errors
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
        with self._auto.connect() as conn:
            return int(conn.execute(stmt).rowcount)

    @_db_errors
    def reserve_rate(self, task_name: str, key: str, period_ms: int, burst: int) -> tuple[int, int]:
        """Take the next slot of the rate bucket ``(task_name, key)``: one slot per
        ``period_ms``, ``burst`` at once. Returns ``(wait_ms, due_ms)``: how long the caller
        must wait for its slot (0: now) and when it is due, by the database clock.

        GCRA with reservation, in one statement where the database has ``ON CONFLICT ..
        RETURNING`` (a short transaction on MySQL): every caller's slot is its own, so
        across all workers no more than ``burst`` start within one period.
        """
        params = {"p_task": task_name, "p_key": key, "p_period": period_ms}
        tat, now = self.database.reserve_rate(self.engine, self._auto, params)
        due = tat - period_ms * burst
        return max(0, due - now), max(due, now)

    @_db_errors
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
        with self._auto.connect() as conn:
            if not self.engine.dialect.insert_returning:
                return int(conn.execute(stmt).rowcount) == 1
            # psycopg reports no row count for INSERT .. SELECT: ask for the row.
            return conn.execute(stmt.returning(held.c.seq)).first() is not None

    @_db_errors
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
        with self._auto.connect() as conn:
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

    @_db_errors
    def drop_held(self, seq: int) -> None:
        """Forget a held delivery once it was published again."""
        with self._auto.connect() as conn:
            conn.execute(delete(held).where(held.c.seq == seq))

    @_db_errors
    def next_held_due(self) -> int | None:
        """Milliseconds until the next rate-limited delivery is due (0: overdue), or None
        when none is held; read only."""
        now = db_now_ms()
        stmt = select(func.min(held.c.available_at) - now).where(held.c.reason == HELD_RATE)
        with self._auto.connect() as conn:
            left = conn.execute(stmt).scalar()
        return None if left is None else max(0, int(left))

    # -- operators: expire, cancel, retention --------------------------------------

    @_db_errors
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
        with self._auto.connect() as conn:
            return conn.execute(stmt).rowcount == 1

    @_db_errors
    def cancel(self, run_id: str, *, task_id: str | None = None, running: bool = True) -> str:
        """Cancel a run: queued/retrying end ``cancelled`` at once; running get a request.

        Returns the resulting status (``cancelled``, or ``running`` with
        ``cancel_requested_at`` set, or the status it has when nothing changed).
        With ``task_id``, only a run whose own delivery has that Celery task id
        is touched (a revoked duplicate never cancels the run it duplicates).
        With ``running=False`` a running run is left alone (an expired copy of
        its message must not stop the delivery that runs it).
        Raises :class:`RunNotFound` for an unknown id.
        """
        now = db_now_ms()
        own = (
            runs.c.id == run_id
            if task_id is None
            else and_(runs.c.id == run_id, runs.c.task_id == task_id)
        )
        at_once = (
            update(runs)
            .where(own, runs.c.status.in_((schema.QUEUED, schema.RETRYING)))
            .values(
                status=schema.CANCELLED,
                failure_code="cancelled",
                cancel_requested_at=now,
                lease_expires_at=now,  # when it ended: `lease top` counts recent ends by it
                finished_at=now,
                updated_at=now,
            )
        )
        request = (
            update(runs)
            .where(own, runs.c.status == schema.RUNNING)
            .values(
                cancel_requested_at=func.coalesce(runs.c.cancel_requested_at, now),
                updated_at=now,
            )
        )
        with self._auto.connect() as conn:
            if conn.execute(at_once).rowcount == 1:
                return schema.CANCELLED
            if running and conn.execute(request).rowcount == 1:
                return schema.RUNNING
            row = conn.execute(
                select(runs.c.status, runs.c.task_id).where(runs.c.id == run_id)
            ).first()
        if row is None:
            raise RunNotFound(run_id)
        status, own_task_id = row
        if status == schema.RUNNING and not running:
            return str(status)
        if status not in schema.TERMINAL_STATUSES and (task_id is None or own_task_id == task_id):
            # It changed status between the statements: try again.
            return self.cancel(run_id, task_id=task_id, running=running)
        return str(status)

    @_db_errors
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
        return self.database.purge(self.engine, self._auto, oldest, finished)

    @_db_errors
    def count_finished(self, status: str, older_than_ms: int) -> int:
        """How many rows :meth:`purge_finished` would delete now, by index; read only."""
        stmt = select(func.count()).select_from(runs).where(purgeable(status, older_than_ms))
        with self._auto.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    # -- the CLI's reads and rerun ------------------------------------------------

    @_db_errors
    def list_runs(
        self, *, status: str | None = None, task_name: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        """Up to ``limit`` runs, newest first, filtered by status and task name; read only."""
        stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id).limit(max(0, limit))
        if status is not None:
            stmt = stmt.where(runs.c.status == status)
        if task_name is not None:
            stmt = stmt.where(runs.c.task_name == task_name)
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
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
        with self._auto.connect() as conn:
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

    @_db_errors
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
        Returns the row as it is now. Raises
        :class:`RunNotFound`, or :class:`RunNotRerunnable` with the status found.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        allowed = [schema.FAILED, schema.CANCELLED] + ([schema.SUCCEEDED] if force else [])
        now = db_now_ms()
        stmt = (
            update(runs)
            .where(runs.c.id == run_id, runs.c.status.in_(allowed))
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
                **({} if task_id is None else {"task_id": task_id}),
                **(_FROM_SCRATCH if from_scratch else {}),
            )
        )
        with self._auto.connect() as conn:
            changed = conn.execute(stmt).rowcount
        record = self.get(run_id)
        if record is None:
            raise RunNotFound(run_id)
        if changed != 1:
            raise RunNotRerunnable(run_id, record.status)
        return record

    @_db_errors
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
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [RunRecord(**dict(row)) for row in rows]

    @_db_errors
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
        with self._auto.connect() as conn:
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

    # -- the web view's reads ---------------------------------------------------------

    @_db_errors
    def page_runs(self, query: RunPageQuery) -> list[RunSummary]:
        """One page of runs for ``query``; read only, one statement.

        Every status is an index range from the keyset bound (see
        :func:`~celery_lease.store.sql.run_page`), so a page costs the same on
        the millionth row as on the first. The stored message, the result and
        the error text are not read.
        """
        with self._auto.connect() as conn:
            rows = conn.execute(run_page(query)).mappings().all()
        return [RunSummary(**dict(row)) for row in rows]

    @_db_errors
    def task_counts(self, now: int, window_ms: int = 3_600_000) -> list[TaskCounts]:
        """Per task: live runs per status, runs that finished within ``window_ms`` before
        ``now`` per terminal status, running runs whose lease has expired, and runs whose
        lease expired (``failure_code = 'lease_expired'``) updated within the window; read
        only, one statement, by task name.

        ``now`` is the database clock (:meth:`now_ms`) passed as a value, so the
        window is an index bound: only live rows and the window's finished rows
        are read, from the ``(status, ...)`` indexes, never the whole table.
        """
        since = now - window_ms
        live = (schema.QUEUED, schema.RUNNING, schema.RETRYING)
        expired = and_(runs.c.status == schema.RUNNING, runs.c.lease_expires_at <= now)
        stmt = (
            select(
                runs.c.task_name,
                runs.c.status,
                func.count(),
                func.sum(case((expired, 1), else_=0)),
                func.sum(case((lease_expired_since(since).whereclause, 1), else_=0)),
            )
            .where(
                or_(
                    runs.c.status.in_(live),
                    and_(
                        runs.c.status.in_(sorted(schema.TERMINAL_STATUSES)),
                        runs.c.finished_at >= since,
                    ),
                )
            )
            .group_by(runs.c.task_name, runs.c.status)
        )
        with self._auto.connect() as conn:
            rows = conn.execute(stmt).all()
        found: dict[str, list[Any]] = {}
        for task_name, status, count, expired_leases, lease_expired in rows:
            entry = found.setdefault(str(task_name), [{}, {}, 0, 0])
            entry[0 if status in live else 1][str(status)] = int(count)
            entry[2] += int(expired_leases or 0)
            entry[3] += int(lease_expired or 0)
        return [TaskCounts(name, *found[name]) for name in sorted(found)]

    @_db_errors
    def oldest_running(self) -> RunRecord | None:
        """The running run that started first (None if none runs); read only, from the
        running rows of the ``(status, ...)`` indexes."""
        with self._auto.connect() as conn:
            row = conn.execute(oldest_running()).mappings().first()
        return None if row is None else RunRecord(**dict(row))
