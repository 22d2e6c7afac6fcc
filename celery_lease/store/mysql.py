"""MySQL and MariaDB: :class:`MySQL`."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from sqlalchemy import (
    Engine,
    create_engine,
    delete,
    event,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import ConnectionPoolEntry

from ..schema import runs
from .bounds import WaitBounds
from .database import Classification, Database, permanent, transient


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

    def count_live(self, query: Any) -> Any:
        """The count as ``SELECT .. FOR UPDATE``: InnoDB's next-key locks on the key's
        ``running`` index range block any other claim from adding a live lease to it until
        this transaction ends. Two claimers that both found the range empty deadlock on
        their inserts; the loser is retried by the claim."""
        return query.with_for_update()

    def purge(self, engine: Engine, auto: Engine, oldest: Any, purgeable: Any) -> int:
        """MySQL refuses ``LIMIT`` in an ``IN`` subquery: pick, then delete, in one transaction."""
        with engine.begin() as conn:
            ids = list(conn.execute(oldest).scalars())
            if not ids:
                return 0
            return int(conn.execute(delete(runs).where(runs.c.id.in_(ids), purgeable)).rowcount)
