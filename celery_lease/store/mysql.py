"""MySQL and MariaDB: :class:`MySQL`, its claim, its migration lock and its online DDL.

No ``ON CONFLICT`` here: the claim, a kept delivery, a waiting row and a rate
reservation are each a short locked read-then-write transaction, and the
heartbeat's renewal an autocommit ``UPDATE`` then a ``SELECT`` (no ``RETURNING``),
so no lock outlives the renewal's statement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy
from sqlalchemy import (
    Connection,
    Engine,
    Table,
    and_,
    case,
    create_engine,
    delete,
    event,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from ..schema import QUEUED, db_now_ms, rates, runs
from .bounds import MigrationBounds, WaitBounds
from .database import (
    ClaimPath,
    ClaimRow,
    Classification,
    Database,
    MigrationLock,
    MigrationLockTimeout,
    OnlineDDL,
    add_column_sql,
    begin_live_on,
    permanent,
    retry_ddl,
    server_engines,
    server_single_statements,
    transient,
    unresolvable_host,
)
from .driver import DriverStatement
from .sql import claimable, insert_source, not_paused, not_stale, stale_floor, takeover_values

if TYPE_CHECKING:
    from alembic.operations import Operations


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
                .where(
                    runs.c.id == values["id"],
                    claimable(max_attempts),
                    not_stale(values["task_id"], stale_floor(values)),
                    unpaused,
                )
                # In the order given: MySQL's SET sees the columns it assigned already.
                .ordered_values(
                    *takeover_values(values["lease_owner"], lease_ms, max_attempts, values).items()
                )
            ).rowcount
            if changed != 1:
                return None
            attempt = int(current[0]) + 1
        # The read that returns the expiry also returns the checkpoint and the trace
        # context: no extra statement.
        expires, ceiling, checkpoint, trace_context, generation = conn.execute(
            select(
                runs.c.lease_expires_at,
                runs.c.max_attempts,
                runs.c.checkpoint,
                runs.c.trace_context,
                runs.c.generation,
            ).where(runs.c.id == values["id"])
        ).one()
        return attempt, int(expires), int(ceiling), checkpoint, trace_context, int(generation)


def _ping_fails(dbapi_connection: Any) -> bool:
    """True when the server does not answer a ``COM_PING`` (one round trip)."""
    try:
        dbapi_connection.ping(reconnect=False)
    except Exception:
        return True
    return False


class MySQL(Database):
    """MySQL/MariaDB: a locked read-then-write claim; the key's count is a locking read.

    The bounds are session settings and PyMySQL socket timeouts.
    """

    #: The server's (or the client's) error number, ``args[0]``.
    codes: ClassVar[dict[int, Classification]] = {
        1213: transient("deadlock"),
        1205: transient("lock_not_available"),  # innodb_lock_wait_timeout
        3572: transient("lock_not_available"),  # NOWAIT
        1040: transient("too_many_connections"),
        1203: transient("too_many_connections"),  # max_user_connections
        3024: transient("timeout"),  # MySQL max_execution_time
        1969: transient("timeout"),  # MariaDB max_statement_time
        1317: transient("timeout"),  # query interrupted
        1053: transient("server_shutdown"),
        1927: transient("disconnect"),  # MariaDB: connection killed
        4031: transient("disconnect"),  # MySQL: idle client disconnected
        2002: transient("connection_refused"),
        2003: transient("connection_refused"),
        2005: transient("unknown_host"),
        2006: transient("disconnect"),
        2013: transient("disconnect"),
        2055: transient("disconnect"),
        # A replica, or a primary being switched over: writable again after the failover.
        1290: transient("read_only"),  # --read-only / --super-read-only
        1792: transient("read_only"),  # a READ ONLY transaction
        1836: transient("read_only"),  # read-only mode
        1406: permanent("data_too_long"),
        1264: permanent("out_of_range"),
        1690: permanent("out_of_range"),
        1366: permanent("bad_data"),
        1292: permanent("bad_data"),
        1153: permanent("packet_too_large"),
        1146: permanent("missing_table"),
        1054: permanent("missing_column"),
        1064: permanent("bad_sql"),
        1149: permanent("bad_sql"),
        1045: permanent("auth_failed"),
        1044: permanent("permission_denied"),
        1142: permanent("permission_denied"),
        1143: permanent("permission_denied"),
        1049: permanent("missing_database"),
        1062: permanent("duplicate_key"),
        1048: permanent("integrity"),
        1452: permanent("integrity"),
    }

    def __init__(self) -> None:
        super().__init__(
            names=("mysql", "mariadb"),
            driver_extra="mysql",
            # UTC_TIMESTAMP, not NOW(): UNIX_TIMESTAMP(NOW()) converts through the
            # session time zone, which under daylight saving repeats an hour (the
            # clock runs an hour behind, then jumps). Both operands are DATETIMEs,
            # so no time zone is applied at all.
            clock_sql=(
                "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000"
                " AS SIGNED)"
            ),
        )

    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """Session lock-wait and statement bounds on every connection; with PyMySQL, socket
        timeouts a little past the server-side bounds (a read that outlasts them is a
        partition)."""
        parsed = make_url(url)
        connect_args = dict(kwargs.pop("connect_args", {}))
        if parsed.get_driver_name() == "pymysql":
            connect_args.setdefault("connect_timeout", bounds.connect)
            client = max(bounds.client, self._statement_bound(bounds) + 0.5)
            connect_args.setdefault("read_timeout", client)
            connect_args.setdefault("write_timeout", client)
        engine = create_engine(parsed, connect_args=connect_args, hide_parameters=True, **kwargs)
        self._bound_sessions(engine, bounds)
        return engine

    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """Two engines: transactions, and single statements in autocommit mode."""
        return server_engines(self, url, bounds, **kwargs)

    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """The autocommit engine :meth:`open` made (else ``engine``'s pool, borrowed)."""
        return server_single_statements(engine, given)

    def prepare(self, engine: Engine) -> None:
        """Nothing: an operator makes the tables with ``celery lease migrate``."""

    def unreachable(self, url: URL) -> str | None:
        """A host that does not resolve."""
        return unresolvable_host(url)

    def missing(self, url: URL) -> str | None:
        """Nothing to see without connecting (the server says so)."""
        return None

    @staticmethod
    def _lock_bound(bounds: WaitBounds) -> int:
        """``innodb_lock_wait_timeout``: whole seconds, at least 1."""
        return max(1, math.ceil(bounds.lock))

    def _statement_bound(self, bounds: WaitBounds) -> float:
        """The statement bound, longer than the (rounded up) lock wait so that one reports first."""
        return max(bounds.statement, self._lock_bound(bounds) + 0.5)

    def _bound_sessions(self, engine: Engine, bounds: WaitBounds) -> None:
        """Session lock-wait and statement bounds on every new connection.

        MySQL has no transaction pooler to lose session state to. MariaDB's
        ``max_statement_time`` (seconds) bounds every statement; MySQL's
        ``max_execution_time`` (milliseconds) bounds reads only, the lock wait
        bounds the writes.
        """
        lock_wait = self._lock_bound(bounds)
        limit = self._statement_bound(bounds)

        def on_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("SELECT VERSION()")
            mariadb = "mariadb" in str(cursor.fetchone()[0]).lower()
            statement = (
                f"max_statement_time = {limit:.3f}"
                if mariadb
                else f"max_execution_time = {round(limit * 1000)}"
            )
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {lock_wait}, {statement}")
            cursor.close()

        event.listen(engine, "connect", on_connect)

    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class by error number, or None when it carries no known number."""
        args = getattr(orig, "args", ())
        number = args[0] if args and isinstance(args[0], int) else None
        return None if number is None else self.codes.get(number)

    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """Error 1205: ``innodb_lock_wait_timeout`` ended the wait."""
        args: tuple[Any, ...] = getattr(exc.orig, "args", ())
        return bool(args) and args[0] == 1205

    def begin_live(self, engine: Engine) -> AbstractContextManager[Connection]:
        """A ``COM_PING`` first (the driver gives no socket to look at): a connection the
        server dropped is replaced (see :func:`~celery_lease.store.database.begin_live_on`)."""
        return begin_live_on(engine, _ping_fails)

    def insert(self, table: Table) -> Any:
        """The plain ``INSERT`` (no ``ON CONFLICT`` here)."""
        return sqlalchemy.insert(table)

    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> ClaimPath:
        """A locked read-then-write (:class:`LockedClaim`)."""
        return LockedClaim(self.insert, engine)

    def driver_statement(
        self, auto: Engine, statement: Any, *, returns_row: bool
    ) -> DriverStatement:
        """The driver's cursor (:class:`~celery_lease.store.driver.DriverStatement`)."""
        return DriverStatement(auto, statement, returns_row=returns_row)

    def lock_key(self, conn: Connection, key: str) -> bool:
        """Nothing to take: the locking count (:meth:`count_live`) serializes the key."""
        return True

    def count_live(self, query: Any) -> Any:
        """The count as ``SELECT .. FOR UPDATE``: InnoDB's next-key locks on the key's
        ``running`` index range block any other claim from adding a live lease to it until
        this transaction ends. Two claimers that both found the range empty deadlock on
        their inserts; the loser is retried by the claim."""
        return query.with_for_update()

    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """``bump`` a queued row, else insert ``waiting`` where no row exists."""
        run_id = waiting["id"]
        changed = conn.execute(
            update(runs).where(runs.c.id == run_id, runs.c.status == QUEUED).values(bump)
        ).rowcount
        exists = conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first()
        if not changed and exists is None:
            conn.execute(self.insert(runs).values(waiting))

    def reserve_rate(self, engine: Engine, auto: Engine, params: dict[str, Any]) -> tuple[int, int]:
        """A short locked transaction: the ``UPDATE`` (or the first ``INSERT``), then the read
        of what it wrote."""
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
        """The ``UPDATE`` on its own (autocommit), then a plain read of the rows it renewed.

        No transaction spans the two round trips. In one, a worker stopped between them
        (SIGSTOP, a frozen VM, a long pause, a partition) kept the ``UPDATE``'s row locks
        until it came back: every claim of its runs waited out the lock timeout and was
        refused as busy, and the sweep skipped them, so its leases were never taken over.
        A row the read no longer finds held (taken over, ended, expired meanwhile) is
        reported lost, as it is. The ``UPDATE`` reads the rows by primary key (an index
        hint): a range of the status index would lock other workers' live rows and the
        gaps their claims and renewals write into, and InnoDB picks it when few rows run.
        """
        with auto.connect() as conn:
            conn.execute(_by_primary_key(renew), params or {})
            return conn.execute(select(*columns).where(guard)).all()

    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """One short locked transaction. A claim inserting the row meanwhile makes it fail
        (a duplicate key or a deadlock): the caller then treats the delivery as not kept."""
        run_id = waiting["id"]
        adopted = {
            "task_id": waiting["task_id"],
            "payload": waiting["payload"],
            "payload_content_type": waiting["payload_content_type"],
            "payload_retries": waiting["payload_retries"],
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
        """``FOR UPDATE SKIP LOCKED``: a row a stalled transaction holds is skipped this time."""
        return query.with_for_update(skip_locked=True)

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """MySQL refuses ``LIMIT`` in an ``IN`` subquery: pick, then delete, in one transaction."""
        with engine.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if not ids:
                return 0
            return int(conn.execute(delete(runs).where(runs.c.id.in_(ids), purgeable)).rowcount)

    def migration_lock(self) -> MigrationLock:
        """``GET_LOCK`` (:class:`MySQLMigrationLock`)."""
        return MySQLMigrationLock()

    def online_ddl(self, operations: Operations, bounds: MigrationBounds) -> OnlineDDL:
        """InnoDB online DDL under a short ``lock_wait_timeout`` (:class:`MySQLDDL`)."""
        return MySQLDDL(operations, bounds)


class MySQLMigrationLock(MigrationLock):
    """``GET_LOCK`` named after the current database, released after the migration.

    The migration runs on a second connection and commits revision by revision
    (DDL commits implicitly here, so a transaction could not hold the lock).
    """

    NAME = "CONCAT('celery_lease.migrate.', MD5(DATABASE()))"

    def acquire(self, connection: Connection, timeout: float) -> None:
        """Take the named lock (held by this connection's session)."""
        got = connection.execute(
            text(f"SELECT GET_LOCK({self.NAME}, :timeout)"),
            {"timeout": max(1, math.ceil(timeout))},
        ).scalar()
        if got != 1:
            raise MigrationLockTimeout(timeout)

    def release(self, connection: Connection) -> None:
        """Release the named lock on the same session."""
        connection.execute(text(f"SELECT RELEASE_LOCK({self.NAME})"))
        connection.commit()

    @contextmanager
    def held(self, connection: Connection, timeout: float) -> Iterator[Connection]:
        """Hold the lock on ``connection``'s session; migrate on a second connection."""
        try:
            with connection.begin():
                self.acquire(connection, timeout)
                with connection.engine.connect() as migrating:
                    yield migrating
        finally:
            self.release(connection)


class MySQLDDL(OnlineDDL):
    """InnoDB online DDL (``ALGORITHM=INPLACE, LOCK=NONE``) under a short ``lock_wait_timeout``.

    Online DDL still takes the table's exclusive metadata lock briefly at its
    start and end; while it waits for it, writes queue behind. The wait is
    ``lock_wait_timeout``, whole seconds: ``bounds.lock_wait`` rounded down, so
    under 1 s MariaDB waits not at all (``NOWAIT``: the change is tried when no
    transaction has the table open) and MySQL, whose least wait is 1 s, 1 s.
    """

    @staticmethod
    def _timed_out(exc: sa_exc.OperationalError) -> bool:
        return getattr(exc.orig, "args", (None,))[0] == 1205  # ER_LOCK_WAIT_TIMEOUT

    def _wait_seconds(self, connection: Connection) -> int:
        seconds = math.floor(self.bounds.lock_wait)
        mariadb = bool(getattr(connection.dialect, "is_mariadb", False))
        return seconds if mariadb else max(1, seconds)

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` with the metadata-lock wait capped, retrying a timeout."""
        connection = self.op.get_bind()
        previous = connection.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
        wait = self._wait_seconds(connection)
        connection.exec_driver_sql(f"SET SESSION lock_wait_timeout = {wait}")
        try:
            retry_ddl(change, self._timed_out, self.bounds, wait)
        finally:
            connection.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(previous)}")

    def add_column(self, table: str, column: sqlalchemy.Column[Any]) -> None:
        """``ADD COLUMN, ALGORITHM=INPLACE, LOCK=NONE``: writes go on while it runs."""
        statement = f"{add_column_sql(self.op, table, column)}, ALGORITHM=INPLACE, LOCK=NONE"
        self.bounded(lambda: self.op.execute(statement))

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """``CREATE INDEX ... ALGORITHM=INPLACE LOCK=NONE``: writes go on while it builds."""
        listed = ", ".join(columns)
        statement = f"CREATE INDEX {name} ON {table} ({listed}) ALGORITHM=INPLACE LOCK=NONE"
        self.bounded(lambda: self.op.execute(statement))

    def drop_index(self, name: str, table: str) -> None:
        """``DROP INDEX, ALGORITHM=INPLACE, LOCK=NONE``."""
        statement = f"ALTER TABLE {table} DROP INDEX {name}, ALGORITHM=INPLACE, LOCK=NONE"
        self.bounded(lambda: self.op.execute(statement))

    def set_partial(self, name: str, table: str, columns: Sequence[str], where: str | None) -> None:
        """Nothing: InnoDB has no partial indexes, the full index stays."""


def _by_primary_key(statement: Any) -> Any:
    """``statement`` with ``FORCE INDEX (PRIMARY)`` on MySQL and on MariaDB: SQLAlchemy
    renders a hint for one dialect name, and ``mariadb+pymysql://`` URLs are "mariadb"."""
    hint = "FORCE INDEX (PRIMARY)"
    return statement.with_hint(hint, dialect_name="mysql").with_hint(hint, dialect_name="mariadb")
