"""The contract every database class fulfils: :class:`Database`, and what they share.

A database object owns, for its database: its SQLAlchemy dialect names and the
driver extra to install; its engines and the options that bound every wait
(:class:`~celery_lease.store.bounds.WaitBounds`); the checks of its URL made
before connecting; how its driver's errors are classified (transient or
permanent, and the cause); the SQL of the database clock; the statements that
are not the same everywhere (the ``INSERT`` construct, the claim, the
heartbeat's renewal, a kept delivery, the rate reservation, the key lock of a
concurrency-limited claim, the sweep's row locks and retention's pick); and its
schema changes: the lock that serializes ``lease migrate`` runs
(:class:`MigrationLock`) and how a change waits for its lock without holding
lease writes back (:class:`OnlineDDL`, bounded by
:class:`~celery_lease.store.bounds.MigrationBounds`). The store asks the object
to do the work; it never branches on what the database is.

:class:`Database` is abstract: it keeps only what every database does the same
way (the classification skeleton and the error it raises). One module per
database (``sqlite``, ``postgresql``, ``mysql``) gives everything else;
``databases`` keeps them by dialect name. To add a database: a subclass of
:class:`Database` in a module of its own, registered in
:data:`celery_lease.store.databases.DATABASES`; every abstract method is its to
write (the helpers below are what two of them share).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy
from sqlalchemy import Connection, Engine, Table, func, text
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL
from sqlalchemy.schema import CreateColumn

from ..errors import LeaseDatabaseError, LeaseError
from ..schema import QUEUED, metadata, partial, runs
from .bounds import MigrationBounds, WaitBounds
from .driver import DriverStatement
from .sql import claim_params, claim_upsert, reserve_rate

if TYPE_CHECKING:
    from alembic.operations import Operations

#: What a claim returns: the new attempt, its expiry, the attempt ceiling, the checkpoint,
#: the trace context and the generation.
ClaimRow = tuple[int, int, int, str | None, str | None, int]


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


class ClaimPath(Protocol):
    """How a database claims a run (built once per store by :meth:`Database.claim_path`)."""

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


class MigrationLockTimeout(LeaseError):
    """Another migration held the lock longer than the allowed wait."""

    code = "migration_lock_timeout"

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"another `celery lease migrate` held the migration lock for more than "
            f"{timeout:g} s; try again when it has finished (or raise --lock-timeout)"
        )
        self.timeout = timeout


class DDLLockTimeout(LeaseError):
    """A schema change found its table's lock held for longer than the migration may keep
    trying (see :class:`~celery_lease.store.bounds.MigrationBounds`)."""

    code = "ddl_lock_timeout"

    def __init__(self, bounds: MigrationBounds, tries: int, each: float | None = None) -> None:
        each = bounds.lock_wait if each is None else each
        waits = "without waiting (NOWAIT)" if each == 0 else f"of at most {each:g} s"
        super().__init__(
            f"{self.code}: a schema change on celery_lease_runs did not get its lock in "
            f"{bounds.total:g} s ({tries} {'try' if tries == 1 else 'tries'} {waits}; the "
            f"shortest lease in use is {bounds.shortest_lease:g} s): a transaction kept the "
            "table open; revisions before this one, if any, stay applied: run `lease "
            "migrate` again once that transaction has ended"
        )
        self.bounds = bounds
        self.tries = tries


class MigrationLock(abc.ABC):
    """Serializes ``lease migrate`` runs on one database (one class per database).

    A rolling deploy may start several ``migrate`` runs at once. Each takes this
    lock before it reads the schema's revision, so the first one migrates and
    the others wait, then find the schema at head and change nothing. Every
    wait is bounded: past ``timeout`` seconds :class:`MigrationLockTimeout`.
    """

    @abc.abstractmethod
    def acquire(self, connection: Connection, timeout: float) -> None:
        """Wait at most ``timeout`` s for the lock, as the first statement of the migration."""

    @abc.abstractmethod
    def release(self, connection: Connection) -> None:
        """Give the lock up after the migration's transactions ended."""

    @abc.abstractmethod
    def held(self, connection: Connection, timeout: float) -> AbstractContextManager[Connection]:
        """Hold the lock on ``connection``; yield the connection to migrate on."""


class OnlineDDL(abc.ABC):
    """How a migration changes ``celery_lease_runs`` without holding lease writes back.

    A DDL statement that waits for a table lock makes every later statement on
    that table wait behind it: every heartbeat, claim and completion. Each
    database's class bounds that wait by ``bounds.lock_wait`` (a fraction of the
    shortest lease in use), pauses ``bounds.pause`` between tries so the writes
    that queued drain, and gives up after ``bounds.total`` (:class:`DDLLockTimeout`).
    Built on Alembic's ``operations`` (``op``) of the running migration.
    """

    def __init__(self, operations: Operations, bounds: MigrationBounds) -> None:
        self.op = operations
        self.bounds = bounds

    @abc.abstractmethod
    def add_column(self, table: str, column: sqlalchemy.Column[Any]) -> None:
        """Add a nullable column (or one with a constant default)."""

    @abc.abstractmethod
    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """Create an index."""

    @abc.abstractmethod
    def drop_index(self, name: str, table: str) -> None:
        """Drop an index."""

    @abc.abstractmethod
    def set_partial(self, name: str, table: str, columns: Sequence[str], where: str | None) -> None:
        """Build index ``name`` on ``columns`` again, holding only the rows ``where`` (SQL)
        is true for (None: every row), under the same name; where the database has no
        partial indexes, the full index stays as it is."""

    @abc.abstractmethod
    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` (one DDL statement) with its lock wait bounded."""


class PlainDDL(OnlineDDL):
    """Plain DDL, run as it comes: SQLite's (the migration holds the file's write lock
    throughout, so there is no lock to wait for statement by statement), and what an
    offline (``--sql``) script prints for the operator to run."""

    def add_column(self, table: str, column: sqlalchemy.Column[Any]) -> None:
        """``ALTER TABLE .. ADD COLUMN``."""
        self.op.add_column(table, column)

    def create_index(self, name: str, table: str, columns: Sequence[str]) -> None:
        """``CREATE INDEX``."""
        self.op.create_index(name, table, list(columns))

    def drop_index(self, name: str, table: str) -> None:
        """``DROP INDEX``."""
        self.op.drop_index(name, table_name=table)

    def set_partial(self, name: str, table: str, columns: Sequence[str], where: str | None) -> None:
        """``DROP INDEX``, then ``CREATE INDEX .. WHERE``: SQLite's migration holds the
        file's write lock throughout, so no statement sees the table without it."""
        self.op.drop_index(name, table_name=table)
        self.op.create_index(name, table, list(columns), **partial(where))

    def bounded(self, change: Callable[[], None]) -> None:
        """Run ``change`` as it is."""
        change()


def retry_ddl(
    attempt: Callable[[], None],
    timed_out: Callable[[sa_exc.OperationalError], bool],
    bounds: MigrationBounds,
    each: float | None = None,
) -> None:
    """Run ``attempt`` until it does not time out on its lock, ``bounds.pause`` apart, for at
    most ``bounds.total`` seconds (then :class:`DDLLockTimeout`; ``each``: how long one
    try waits, when not ``bounds.lock_wait``)."""
    deadline = time.monotonic() + bounds.total
    tries = 0
    while True:
        tries += 1
        try:
            attempt()
            return
        except sa_exc.OperationalError as exc:
            if not timed_out(exc):
                raise
            if time.monotonic() + bounds.pause >= deadline:
                raise DDLLockTimeout(bounds, tries, each) from exc
        time.sleep(bounds.pause)


def own_transactions(operations: Operations) -> bool:
    """Whether the running migration may commit and step outside a transaction (set by
    the migrations' ``env.py``: not inside a caller's own transaction)."""
    return bool(operations.get_context().opts.get("celery_lease_own_transactions"))


def add_column_sql(operations: Operations, table: str, column: sqlalchemy.Column[Any]) -> str:
    """``ALTER TABLE table ADD COLUMN ..`` for the running migration's dialect."""
    spec = CreateColumn(column).compile(dialect=operations.get_bind().dialect)
    return f"ALTER TABLE {table} ADD COLUMN {spec}"


class Database(abc.ABC):
    """What a database must give celery-lease. Abstract: each database's class writes every
    method that is not the same everywhere, so no database inherits another's statement."""

    def __init__(self, *, names: tuple[str, ...], driver_extra: str, clock_sql: str) -> None:
        #: The SQLAlchemy dialect names this class serves.
        self.names = names
        #: The package extra that installs its driver (``pip install 'celery-lease[x]'``).
        self.driver_extra = driver_extra
        #: The database clock in epoch milliseconds, as SQL.
        self.clock_sql = clock_sql

    def missing_driver(self, exc: ImportError) -> str:
        """What to do about this database's driver, whose import raised ``exc``: one line."""
        extra = self.driver_extra or self.names[0]
        return (
            f"needs a database driver that is not installed ({exc}): "
            f"pip install 'celery-lease[{extra}]'"
        )

    # -- engines ---------------------------------------------------------------

    @abc.abstractmethod
    def create_engine(self, url: str, bounds: WaitBounds, **kwargs: Any) -> Engine:
        """An engine for lease traffic on ``url``, every wait bounded by ``bounds``.

        No ``pool_pre_ping``: it would add a round trip to every statement. A
        connection found dead fails that one statement, SQLAlchemy then discards
        the pool, and each caller already retries.
        """

    @abc.abstractmethod
    def open(self, url: str, bounds: WaitBounds, **kwargs: Any) -> tuple[Engine, Engine | None]:
        """The store's engines for ``url``: one for transactions, and one for single
        statements, or None when single statements share the first one's pool."""

    @abc.abstractmethod
    def single_statements(
        self, engine: Engine, bounds: WaitBounds, given: Engine | None
    ) -> tuple[Engine, bool]:
        """The engine single statements run on (``given``, the one :meth:`open` made, or
        one made from ``engine``), and whether the hot path may run them at the driver
        level (:class:`DriverStatement`: its connections commit each statement)."""

    @abc.abstractmethod
    def prepare(self, engine: Engine) -> None:
        """Whatever the database needs before its first task."""

    @abc.abstractmethod
    def unreachable(self, url: URL) -> str | None:
        """Why a worker could never reach or create the database ``url`` names, seen
        without connecting (a missing directory, a host that does not resolve); None when
        nothing is wrong that way."""

    @abc.abstractmethod
    def missing(self, url: URL) -> str | None:
        """Why the database ``url`` names does not exist, when that can be seen without
        connecting (connecting would create it); None otherwise."""

    # -- errors ----------------------------------------------------------------

    def classify(self, exc: BaseException) -> Classification:
        """Transient or permanent, and why, for an error raised by SQLAlchemy or this driver.

        The driver's own code decides where this database knows it
        (:meth:`classify_driver_error`); otherwise SQLAlchemy's judgement: a
        connection it invalidated, a pool timeout or an ``OperationalError`` is
        transient, anything else permanent.
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

    @abc.abstractmethod
    def classify_driver_error(self, orig: BaseException) -> Classification | None:
        """The class of the driver's error by its code, or None when no code of this
        database covers it."""

    @abc.abstractmethod
    def lock_wait_ended(self, exc: sa_exc.DBAPIError) -> bool:
        """True when the statement gave up waiting for a row lock (the bounded lock wait)."""

    @abc.abstractmethod
    def begin_live(self, engine: Engine) -> AbstractContextManager[Connection]:
        """``engine.begin()`` for a caller's own block (``lease.transaction()``), on a
        connection known to be live before the block runs."""

    # -- statements ------------------------------------------------------------

    @abc.abstractmethod
    def insert(self, table: Table) -> Any:
        """The ``INSERT`` construct for ``table``."""

    @abc.abstractmethod
    def claim_path(self, engine: Engine, auto: Engine, *, raw: bool) -> ClaimPath:
        """How this database claims a run, built once per store."""

    @abc.abstractmethod
    def driver_statement(
        self, auto: Engine, statement: Any, *, returns_row: bool
    ) -> DriverStatement:
        """``statement`` compiled once to run below SQLAlchemy on the autocommit engine
        ``auto`` (the claim, the completion, the checkpoint)."""

    @abc.abstractmethod
    def lock_key(self, conn: Connection, key: str) -> bool:
        """Serialize the claims sharing concurrency ``key`` inside ``conn``'s transaction;
        False means another claimer holds the key (report busy)."""

    @abc.abstractmethod
    def count_live(self, query: Any) -> Any:
        """The statement counting a key's live leases (as a locking read where needed)."""

    @abc.abstractmethod
    def record_waiting(
        self, conn: Connection, waiting: dict[str, Any], bump: dict[str, Any]
    ) -> None:
        """In ``conn``'s transaction: insert the ``waiting`` row, or ``bump`` a queued one."""

    @abc.abstractmethod
    def reserve_rate(self, engine: Engine, auto: Engine, params: dict[str, Any]) -> tuple[int, int]:
        """Take the next slot of a rate bucket (see :func:`~celery_lease.store.sql.reserve_rate`);
        its theoretical arrival time and the database's now."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def keep(
        self,
        engine: Engine,
        auto: Engine,
        waiting: dict[str, Any],
        adopt: Any,
        keeps: Any,
    ) -> bool:
        """Insert the ``waiting`` row, or let an existing row that ``keeps`` the delivery adopt
        its message where ``adopt``; True when the row now carries the delivery."""

    @abc.abstractmethod
    def lock_expired(self, query: Any) -> Any:
        """The sweep's read of expired leases, never waiting for a row a stalled
        transaction holds."""

    @abc.abstractmethod
    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """Delete the rows ``oldest`` (a locked ``SELECT id .. LIMIT``) picks; how many."""

    # -- schema changes ----------------------------------------------------------

    @abc.abstractmethod
    def migration_lock(self) -> MigrationLock:
        """The lock that serializes ``lease migrate`` runs on this database."""

    @abc.abstractmethod
    def online_ddl(self, operations: Operations, bounds: MigrationBounds) -> OnlineDDL:
        """How the running migration changes the runs table here without holding lease
        writes back longer than ``bounds.lock_wait`` at a time."""


# -- what two database classes share ---------------------------------------------


#: Pooled connections a live transaction looks at before taking one as dead for good.
LIVE_TRIES = 3


@contextlib.contextmanager
def begin_live_on(engine: Engine, dropped: Callable[[Any], bool]) -> Iterator[Connection]:
    """``engine.begin()`` on a pooled connection that ``dropped`` (asked of its DBAPI
    connection) does not find dead.

    A connection the server dropped (a restart, a failover, an idle timeout) is
    invalidated and another taken, up to ``LIVE_TRIES`` times, before the caller's
    block runs anything: the block cannot be replayed, and a commit failing on a dead
    connection would run the body again.
    """
    conn = engine.connect()
    try:
        for _ in range(LIVE_TRIES - 1):
            dbapi_connection = conn.connection.dbapi_connection
            if dbapi_connection is None or not dropped(dbapi_connection):
                break
            conn.invalidate()
            conn.close()
            conn = engine.connect()
        with conn.begin():
            yield conn
    finally:
        conn.close()


def socket_dropped(dbapi_connection: Any) -> bool:
    """True when the driver says the connection is closed or broken, or its idle socket
    has something to read: an idle connection is sent nothing but the server's goodbye
    (a FATAL message, then end of file). A system call, no round trip."""
    if getattr(dbapi_connection, "closed", False) or getattr(dbapi_connection, "broken", False):
        return True
    try:
        fd = int(dbapi_connection.fileno())
    except Exception:  # no socket to look at: take it as live
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


class UpsertClaim:
    """The claim as one ``INSERT .. ON CONFLICT`` statement, compiled once per store.

    On an engine in autocommit mode it runs at the driver level
    (:class:`DriverStatement`); otherwise through SQLAlchemy.
    """

    def __init__(self, database: Database, auto: Engine, *, raw: bool) -> None:
        self.statement = claim_upsert(database.insert)
        self._auto = auto
        self._driver = (
            database.driver_statement(auto, self.statement, returns_row=True) if raw else None
        )

    def claim(
        self,
        values: dict[str, Any],
        lease_ms: int,
        max_attempts: int,
        conn: Connection | None = None,
    ) -> ClaimRow | None:
        """Insert or take over the run (in ``conn``'s transaction if given); the new
        attempt, expiry, attempt ceiling, checkpoint, trace context and generation, or None
        when it was not claimable."""
        params = claim_params(values, lease_ms, max_attempts)
        if conn is not None:
            row = conn.execute(self.statement, params).first()
        elif self._driver is not None:
            row = self._driver.execute(params)[1]
        else:
            with self._auto.connect() as auto:
                row = auto.execute(self.statement, params).first()
        if row is None:
            return None
        return int(row[0]), int(row[1]), int(row[2]), row[3], row[4], int(row[5])


def server_engines(
    database: Database, url: str, bounds: WaitBounds, **kwargs: Any
) -> tuple[Engine, Engine]:
    """A server's two engines: one for transactions, one whose connections stay in
    autocommit mode for single statements (no reset per check-out). A check-out waits for
    a pooled connection at most the connect bound (SQLAlchemy's own default is 30 s,
    twice a 15 s lease), then fails as ``pool_timeout``, a transient error."""
    if "poolclass" not in kwargs:  # a pool of the caller's may take no timeout (NullPool)
        kwargs.setdefault("pool_timeout", bounds.connect)
    engine = database.create_engine(url, bounds, **kwargs)
    # Autocommit connections never hold a transaction: no reset on check-in.
    auto_kwargs = {"pool_reset_on_return": None, **kwargs}
    auto = database.create_engine(url, bounds, isolation_level="AUTOCOMMIT", **auto_kwargs)
    return engine, auto


def server_single_statements(engine: Engine, given: Engine | None) -> tuple[Engine, bool]:
    """A server's engine for single statements: ``given`` (driver level), else ``engine``'s
    pool borrowed in autocommit mode, each check-in then resetting the isolation level."""
    if given is not None:
        return given, True
    return engine.execution_options(isolation_level="AUTOCOMMIT"), False


def unresolvable_host(url: URL) -> str | None:
    """A server's host that does not resolve (a DNS outage, ``EAI_AGAIN``, is not that:
    it may resolve again)."""
    if not url.host or url.host.startswith("/"):
        return None
    try:
        socket.getaddrinfo(url.host, url.port)
    except socket.gaierror as exc:
        if exc.errno != getattr(socket, "EAI_AGAIN", None):
            return f"host {url.host!r} does not resolve ({exc.strerror})"
    return None


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
            "payload_retries": sqlalchemy.case(
                (adopt, excluded.payload_retries), else_=runs.c.payload_retries
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


def upsert_renew(
    auto: Engine, renew: Any, columns: Sequence[Any], params: dict[str, Any] | None
) -> Sequence[Any]:
    """The heartbeat's renewal as one ``UPDATE .. RETURNING``."""
    with auto.connect() as conn:
        return conn.execute(renew.returning(*columns), params or {}).all()


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
