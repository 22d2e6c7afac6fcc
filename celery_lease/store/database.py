"""What every database class shares: :class:`Database`, the base the three extend.

A database object owns, for its database: its SQLAlchemy dialect names and the
driver extra to install; the engine options that bound every wait
(:class:`~celery_lease.store.bounds.WaitBounds`); how its driver's errors are
classified (transient or permanent, and the cause); the SQL of the database
clock; and the statements that are not the same everywhere: the ``INSERT``
construct, the claim (one upsert, or a locked read-then-write), the heartbeat's
renewal, a kept delivery, the key lock of a concurrency-limited claim, the
sweep's row locks and retention's pick. The store asks the object to do the
work; it never branches on what the database is.

One module per database (``sqlite``, ``postgresql``, ``mysql``); ``databases``
keeps them by dialect name. To add a database: a subclass of :class:`Database`
in a module of its own, registered in :data:`celery_lease.store.databases.DATABASES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import sqlalchemy
from sqlalchemy import (
    Connection,
    Engine,
    Table,
    and_,
    case,
    create_engine,
    delete,
    func,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateColumn

from ..errors import LeaseDatabaseError
from ..schema import QUEUED, db_now_ms, metadata, rates, runs
from .bounds import WaitBounds
from .driver import DriverStatement
from .sql import (
    claim_params,
    claim_upsert,
    claimable,
    insert_source,
    not_paused,
    reserve_rate,
    takeover_values,
)

#: What a claim returns: the new attempt, its expiry, the attempt ceiling, the checkpoint
#: and the trace context.
ClaimRow = tuple[int, int, int, str | None, str | None]


@dataclasses.dataclass(frozen=True)
class Classification:
    """``transient`` or not, and a short stable ``cause`` such as ``deadlock``."""

    transient: bool
    cause: str


def transient(cause: str) -> Classification:
    return Classification(True, cause)


def permanent(cause: str) -> Classification:
    return Classification(False, cause)


#: Causes the store treats as contention between concurrent claims of one run
#: or one concurrency key (two first claims inserting the same id; InnoDB's
#: gap-lock deadlock): the claim is retried inside the store and, if it keeps
#: losing, reported busy (reason ``race``), never as an unreachable database.
CLAIM_CONTENTION = frozenset({"deadlock", "serialization_failure", "duplicate_key"})


class UpsertClaim:
    """The claim as one ``INSERT .. ON CONFLICT`` statement, compiled once per store.

    On an engine in autocommit mode it runs at the driver level
    (:class:`DriverStatement`); otherwise through SQLAlchemy.
    """

    def __init__(self, insert: Any, auto: Engine, *, raw: bool) -> None:
        self.statement = claim_upsert(insert)
        self._auto = auto
        self._driver = DriverStatement(auto, self.statement, returns_row=True) if raw else None

    def claim(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> ClaimRow | None:
        """Insert or take over the run (in ``conn``'s transaction if given); the new
        attempt, expiry, attempt ceiling, checkpoint and trace context, or None when it was
        not claimable."""
        params = claim_params(values, lease_ms, max_attempts)
        if conn is not None:
            row = conn.execute(self.statement, params).first()
        elif self._driver is not None:
            row = self._driver.execute(params)[1]
        else:
            with self._auto.connect() as auto:
                row = auto.execute(self.statement, params).first()
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]), row[3], row[4])


class LockedClaim:
    """The claim as a locked read-then-write in one transaction (no ``ON CONFLICT``)."""

    def __init__(self, insert: Any, engine: Engine) -> None:
        self._insert = insert
        self._engine = engine

    def claim(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> ClaimRow | None:
        """Insert or take over the run (in ``conn``'s transaction if given, else a new one).

        Concurrent first claims of one id can deadlock (both hold the gap lock
        of the missing row) or collide on the insert; both errors propagate to
        the store's claim, which retries them as contention.
        """
        if conn is None:
            with self._engine.begin() as own:
                return self.claim(values, lease_ms, max_attempts, own)
        current = conn.execute(
            select(runs.c.attempt).where(runs.c.id == values["id"]).with_for_update()
        ).first()
        unpaused = not_paused(values["task_name"], values["concurrency_key"])
        if current is None:
            inserted = conn.execute(
                self._insert(runs).from_select(*insert_source(values, lease_ms))
            ).rowcount
            if inserted != 1:
                return None  # paused
            attempt = 1
        else:
            changed = conn.execute(
                update(runs)
                .where(runs.c.id == values["id"], claimable(max_attempts), unpaused)
                .values(takeover_values(values["lease_owner"], lease_ms, max_attempts, values))
            ).rowcount
            if changed != 1:
                return None
            attempt = int(current[0]) + 1
        # The read that returns the expiry also returns the checkpoint and the trace
        # context: no extra statement.
        expires, ceiling, checkpoint, trace_context = conn.execute(
            select(
                runs.c.lease_expires_at,
                runs.c.max_attempts,
                runs.c.checkpoint,
                runs.c.trace_context,
            ).where(runs.c.id == values["id"])
        ).one()
        return attempt, int(expires), int(ceiling), checkpoint, trace_context


class Database:
    """A server database without ``ON CONFLICT``: the base of the three, and what a
    database SQLAlchemy speaks but celery-lease does not know gets.

    Its statements are the portable ones: the claim and a kept delivery are
    locked read-then-write transactions, the heartbeat an ``UPDATE`` then a
    ``SELECT`` in one transaction, and rows are picked ``FOR UPDATE SKIP LOCKED``.
    """

    def __init__(
        self, *, names: tuple[str, ...] = (), driver_extra: str = "", clock_sql: str = ""
    ) -> None:
        #: The SQLAlchemy dialect names this class serves.
        self.names = names
        #: The package extra that installs its driver (``pip install 'celery-lease[x]'``).
        self.driver_extra = driver_extra
        #: The database clock in epoch milliseconds, as SQL ("" for none: compiling fails).
        self.clock_sql = clock_sql

    # -- engines ---------------------------------------------------------------

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """An engine for lease traffic on ``url``, every wait bounded by ``bounds``.

        No ``pool_pre_ping``: it would add a round trip to every statement. A
        connection found dead fails that one statement, SQLAlchemy then discards
        the pool, and each caller already retries.
        """
        connect_args = dict(kwargs.pop("connect_args", {}))
        return create_engine(
            make_url(url), connect_args=connect_args, hide_parameters=True, **kwargs
        )

    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """The store's engines for ``url``: one for transactions, and one of its own for
        single statements, whose connections stay in autocommit mode (no reset per
        check-out), or None when single statements share the first one's pool."""
        engine = self.create_engine(url, bounds, **kwargs)
        # Autocommit connections never hold a transaction: no reset on check-in.
        auto_kwargs = {"pool_reset_on_return": None, **kwargs}
        auto = self.create_engine(url, bounds, isolation_level="AUTOCOMMIT", **auto_kwargs)
        return engine, auto

    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """The engine single statements run on, and whether the hot path may run them at
        the driver level (:class:`DriverStatement`: its connections are in autocommit mode).

        Without an engine of their own (``given``) they borrow ``engine``'s pool in
        autocommit mode, each check-in then resetting the isolation level.
        """
        if given is not None:
            return given, True
        return engine.execution_options(isolation_level="AUTOCOMMIT"), False

    def prepare(self, engine: Engine) -> None:
        """Whatever the database needs before its first task (a server: a migration, run by
        an operator with ``celery lease migrate``; nothing here)."""

    # -- errors ----------------------------------------------------------------

    def classify(self, exc: BaseException) -> Classification:
        """Transient or permanent, and why, for an error raised by SQLAlchemy or this driver.

        The driver's own code decides where this database knows it; otherwise
        SQLAlchemy's judgement: a connection it invalidated, a pool timeout or an
        ``OperationalError`` is transient, anything else permanent.
        """
        orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else exc
        if isinstance(orig, BaseException):
            found = self.classify_driver_error(orig)
            if found is not None:
                return found
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return transient("disconnect")
        if isinstance(exc, sa_exc.TimeoutError):
            return transient("pool_timeout")
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.DisconnectionError)):
            return transient("unavailable")
        if isinstance(exc, sa_exc.IntegrityError):
            return permanent("integrity")
        if isinstance(exc, sa_exc.DataError):
            return permanent("bad_data")
        if isinstance(exc, sa_exc.ProgrammingError):
            return permanent("bad_sql")
        if isinstance(exc, sa_exc.DBAPIError):
            return permanent("database_error")
        return permanent("client_error")

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class of the driver's error by its code, or None when no code of this
        database covers it."""
        return None

    def wrap(self, exc: BaseException, name: str) -> LeaseDatabaseError:
        """The :class:`LeaseDatabaseError` the store raises for ``exc`` (``raise ... from exc``).

        ``name`` is the database's name in the message, which names the cause and the
        driver's first line, never the SQL parameters (they can hold task arguments).
        """
        found = self.classify(exc)
        orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else None
        text = str(orig if orig is not None else exc).strip()
        # SQLAlchemy appends "[SQL: ...]" and "[parameters: ...]" on later lines.
        detail = text.splitlines()[0][:300] if text else ""
        return LeaseDatabaseError(
            f"{name} {found.cause}: {type(orig or exc).__name__}: {detail}",
            transient=found.transient,
            cause=found.cause,
        )

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """True when the statement gave up waiting for a row lock (the bounded lock wait)."""
        return False

    # -- statements ------------------------------------------------------------

    def insert(self, table: Table) -> Any:
        """The ``INSERT`` construct (the dialect's own where it has ``ON CONFLICT``)."""
        return sqlalchemy.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> UpsertClaim | LockedClaim:
        """How this database claims a run, built once per store."""
        return LockedClaim(self.insert, engine)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """Serialize the claims sharing concurrency ``key`` inside ``conn``'s transaction;
        False means another claimer holds the key (report busy)."""
        return True

    def count_live(self, query: Any) -> Any:
        """The statement counting a key's live leases (as a locking read where needed)."""
        return query

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """In ``conn``'s transaction: insert the ``waiting`` row, or ``bump`` a queued one."""
        run_id = waiting["id"]
        changed = conn.execute(
            update(runs).where(runs.c.id == run_id, runs.c.status == QUEUED).values(bump)
        ).rowcount
        exists = conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first()
        if not changed and exists is None:
            conn.execute(self.insert(runs).values(waiting))

    def reserve_rate(self, engine: Engine, auto: Engine, params: dict[str, Any]) -> tuple[int, int]:
        """Take the next slot of a rate bucket (see :func:`~celery_lease.store.sql.reserve_rate`);
        its theoretical arrival time and the database's now. Here a short locked transaction:
        the ``UPDATE`` (or the first ``INSERT``), then the read of what it wrote."""
        bucket = and_(rates.c.task_name == params["p_task"], rates.c.rate_key == params["p_key"])
        now = db_now_ms()
        period = params["p_period"]
        for tries in (1, 2):
            try:
                with engine.begin() as conn:
                    moved = conn.execute(
                        update(rates)
                        .where(bucket)
                        .values(tat=case((rates.c.tat > now, rates.c.tat), else_=now) + period)
                    ).rowcount
                    if not moved:
                        conn.execute(
                            self.insert(rates).values(
                                task_name=params["p_task"],
                                rate_key=params["p_key"],
                                tat=now + period,
                            )
                        )
                    tat, at = conn.execute(select(rates.c.tat, now).where(bucket)).one()
                    return int(tat), int(at)
            except sa_exc.IntegrityError:  # another first claim inserted the bucket: update it
                if tries == 2:
                    raise
        raise AssertionError("unreachable")

    def renew(
        self,
        engine: Engine,
        auto: Engine,
        renew: Any,
        guard: Any,
        columns: Sequence[Any],
        params: dict[str, Any] | None = None,
    ) -> Sequence[Any]:
        """Run the heartbeat's ``renew`` (with bind ``params``) and return ``columns`` of the
        rows it renewed."""
        with engine.begin() as conn:
            conn.execute(renew, params or {})
            return conn.execute(select(*columns).where(guard)).all()

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """Insert the ``waiting`` row, or let an existing row that ``keeps`` the delivery adopt
        its message where ``adopt``; True when the row now carries the delivery.

        One short locked transaction. A claim inserting the row meanwhile makes it
        fail (a duplicate key or a deadlock): the caller then treats the delivery as
        not kept.
        """
        run_id = waiting["id"]
        adopted = {
            "task_id": waiting["task_id"],
            "payload": waiting["payload"],
            "payload_content_type": waiting["payload_content_type"],
        }
        with engine.begin() as conn:
            found = conn.execute(
                select(runs.c.id).where(runs.c.id == run_id).with_for_update()
            ).first()
            if found is None:
                conn.execute(self.insert(runs).values(waiting))
                return True
            conn.execute(update(runs).where(runs.c.id == run_id, adopt, keeps).values(adopted))
            kept = conn.execute(select(runs.c.id).where(runs.c.id == run_id, keeps)).first()
            return kept is not None

    def lock_expired(self, query: Any) -> Any:
        """The sweep's read of expired leases: ``FOR UPDATE SKIP LOCKED``, so a row a stalled
        transaction holds is skipped this time, never waited for."""
        return query.with_for_update(skip_locked=True)

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """Delete the rows ``oldest`` (a locked ``SELECT id .. LIMIT``) picks; how many.

        One statement, ``id IN (..)``: the rows are locked (or the writer is alone)
        and were picked by the guard, so no second filter.
        """
        with auto.connect() as conn:
            return int(conn.execute(delete(runs).where(runs.c.id.in_(oldest))).rowcount)


def upsert_waiting(
    insert: Any, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
) -> None:
    """``INSERT waiting ON CONFLICT DO UPDATE bump WHERE status = queued``."""
    conn.execute(
        insert(runs)
        .values(waiting)
        .on_conflict_do_update(index_elements=[runs.c.id], set_=bump, where=runs.c.status == QUEUED)
    )


def upsert_kept(insert: Any, auto: Engine, waiting: dict[str, Any], adopt: Any, keeps: Any) -> bool:
    """A kept delivery as one conditional ``INSERT .. ON CONFLICT .. RETURNING``."""
    insert_stmt = insert(runs).values(waiting)
    excluded = insert_stmt.excluded
    stmt = insert_stmt.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={
            "task_id": sqlalchemy.case((adopt, excluded.task_id), else_=runs.c.task_id),
            "payload": func.coalesce(runs.c.payload, excluded.payload),
            "payload_content_type": sqlalchemy.case(
                (adopt, excluded.payload_content_type),
                else_=runs.c.payload_content_type,
            ),
        },
        where=keeps,
    ).returning(runs.c.id)
    with auto.connect() as conn:
        return conn.execute(stmt).first() is not None


def upsert_rate(insert: Any, auto: Engine, params: dict[str, Any]) -> tuple[int, int]:
    """The rate reservation as one ``INSERT .. ON CONFLICT .. RETURNING``: the bucket's new
    theoretical arrival time and the database's now."""
    with auto.connect() as conn:
        tat, now = conn.execute(reserve_rate(insert), params).one()
    return int(tat), int(now)


def create_schema(engine: Engine) -> None:
    """Create the tables, and any column or index an existing runs table lacks."""
    metadata.create_all(engine, checkfirst=True)
    # A table an earlier version made lacks the columns and indexes added since
    # (each new column is nullable or has a constant default).
    present = {column["name"] for column in sa_inspect(engine).get_columns(runs.name)}
    missing = [column for column in runs.columns if column.name not in present]
    if missing:
        with engine.begin() as conn:
            for column in missing:
                spec = CreateColumn(column).compile(dialect=engine.dialect)
                conn.execute(text(f"ALTER TABLE {runs.name} ADD COLUMN {spec}"))
    for index in runs.indexes:
        index.create(engine, checkfirst=True)
