"""The database-error taxonomy: which driver errors are worth retrying.

Every error the store raises passes through :func:`classify`, which answers one
question: could the same statement succeed later without anyone changing the
code, the schema or the settings? *Transient* errors (a disconnect, a timeout,
a deadlock, a serialization failure, a lock not available, too many
connections, a refused connection) could; *permanent* ones (a value too long
for its column, a number out of range, a missing table or column, bad SQL, a
failed login) never will, and retrying them only hides the cause.

The decision is made per dialect from the driver's own code, never from the
message text where a code exists: PostgreSQL's SQLSTATE (``exc.orig.sqlstate``),
the MySQL/MariaDB error number (``exc.orig.args[0]``), SQLite's result code
(``exc.orig.sqlite_errorcode``). Errors without a known code fall back on
SQLAlchemy's own judgement: a connection SQLAlchemy invalidated, a pool
timeout or an ``OperationalError`` is transient, anything else permanent.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import ClassVar, Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from .errors import LeaseDatabaseError


@dataclasses.dataclass(frozen=True)
class Classification:
    """``transient`` or not, and a short stable ``cause`` such as ``deadlock``."""

    transient: bool
    cause: str


def _t(cause: str) -> Classification:
    return Classification(True, cause)


def _p(cause: str) -> Classification:
    return Classification(False, cause)


#: Causes the store treats as contention between concurrent claims of one run
#: or one concurrency key (two first claims inserting the same id; InnoDB's
#: gap-lock deadlock): the claim is retried inside the store and, if it keeps
#: losing, reported busy (reason ``race``), never as an unreachable database.
CLAIM_CONTENTION = frozenset({"deadlock", "serialization_failure", "duplicate_key"})


class PostgresErrors:
    """PostgreSQL: SQLSTATE codes (``psycopg``'s ``exc.sqlstate``)."""

    codes: ClassVar[dict[str, Classification]] = {
        "40001": _t("serialization_failure"),
        "40P01": _t("deadlock"),
        "55P03": _t("lock_not_available"),
        "57014": _t("timeout"),  # query_canceled: statement_timeout
        "25P03": _t("timeout"),  # idle_in_transaction_session_timeout
        "57P01": _t("server_shutdown"),
        "57P02": _t("server_shutdown"),
        "57P03": _t("server_starting"),
        "53300": _t("too_many_connections"),
        "23505": _p("duplicate_key"),
        "22001": _p("data_too_long"),
        "22003": _p("out_of_range"),
        "42P01": _p("missing_table"),
        "42703": _p("missing_column"),
        "42501": _p("permission_denied"),
        "28000": _p("auth_failed"),
        "28P01": _p("auth_failed"),
        "3D000": _p("missing_database"),
        "25006": _p("read_only"),
    }
    classes: ClassVar[dict[str, Classification]] = {
        "08": _t("disconnect"),
        "53": _t("insufficient_resources"),
        "58": _t("system_error"),
        "22": _p("bad_data"),
        "23": _p("integrity"),
        "42": _p("bad_sql"),
    }

    #: libpq reports connection failures without a SQLSTATE: the message decides.
    messages: ClassVar[tuple[tuple[str, Classification], ...]] = (
        ("password authentication failed", _p("auth_failed")),
        ("no pg_hba.conf entry", _p("auth_failed")),
        ('role "', _p("auth_failed")),  # role "x" does not exist
        # database "x" is not currently accepting connections: it will again.
        ("not currently accepting connections", _t("server_starting")),
        ("the database system is", _t("server_starting")),  # starting up / shutting down
        ('database "', _p("missing_database")),  # database "x" does not exist
        ("connection refused", _t("connection_refused")),
        ("failed to resolve host", _t("unknown_host")),
        ("could not translate host name", _t("unknown_host")),
    )

    def classify(self, orig: BaseException) -> Classification | None:
        """The class of the driver error by SQLSTATE, else by libpq's connection message."""
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if isinstance(state, str) and state:
            return self.codes.get(state) or self.classes.get(state[:2])
        text = str(orig).lower()
        if "connection" in text or "host" in text:
            for fragment, classification in self.messages:
                if fragment in text:
                    return classification
        return None


class MySQLErrors:
    """MySQL and MariaDB: the server's (or the client's) error number, ``args[0]``."""

    codes: ClassVar[dict[int, Classification]] = {
        1213: _t("deadlock"),
        1205: _t("lock_not_available"),  # innodb_lock_wait_timeout
        3572: _t("lock_not_available"),  # NOWAIT
        1040: _t("too_many_connections"),
        1203: _t("too_many_connections"),  # max_user_connections
        3024: _t("timeout"),  # MySQL max_execution_time
        1969: _t("timeout"),  # MariaDB max_statement_time
        1317: _t("timeout"),  # query interrupted
        1053: _t("server_shutdown"),
        1927: _t("disconnect"),  # MariaDB: connection killed
        4031: _t("disconnect"),  # MySQL: idle client disconnected
        2002: _t("connection_refused"),
        2003: _t("connection_refused"),
        2005: _t("unknown_host"),
        2006: _t("disconnect"),
        2013: _t("disconnect"),
        2055: _t("disconnect"),
        1406: _p("data_too_long"),
        1264: _p("out_of_range"),
        1690: _p("out_of_range"),
        1366: _p("bad_data"),
        1292: _p("bad_data"),
        1153: _p("packet_too_large"),
        1146: _p("missing_table"),
        1054: _p("missing_column"),
        1064: _p("bad_sql"),
        1149: _p("bad_sql"),
        1045: _p("auth_failed"),
        1044: _p("permission_denied"),
        1142: _p("permission_denied"),
        1143: _p("permission_denied"),
        1049: _p("missing_database"),
        1062: _p("duplicate_key"),
        1048: _p("integrity"),
        1452: _p("integrity"),
        1792: _p("read_only"),
        1290: _p("read_only"),
    }

    def classify(self, orig: BaseException) -> Classification | None:
        """The class of the driver error, or None when it carries no known number."""
        args = getattr(orig, "args", ())
        number = args[0] if args and isinstance(args[0], int) else None
        return None if number is None else self.codes.get(number)


class SQLiteErrors:
    """SQLite: the primary result code (``sqlite_errorcode & 0xFF``) and, for the
    catch-all ``SQLITE_ERROR``, the message (SQLite gives nothing finer)."""

    extended: ClassVar[dict[int, Classification]] = {
        1555: _p("duplicate_key"),  # SQLITE_CONSTRAINT_PRIMARYKEY
        2067: _p("duplicate_key"),  # SQLITE_CONSTRAINT_UNIQUE
    }
    codes: ClassVar[dict[int, Classification]] = {
        5: _t("database_locked"),  # SQLITE_BUSY
        6: _t("database_locked"),  # SQLITE_LOCKED
        10: _t("io_error"),  # SQLITE_IOERR
        13: _t("insufficient_resources"),  # SQLITE_FULL
        15: _t("database_locked"),  # SQLITE_PROTOCOL
        3: _p("permission_denied"),  # SQLITE_PERM
        8: _p("read_only"),  # SQLITE_READONLY
        11: _p("corrupt"),  # SQLITE_CORRUPT
        14: _p("cannot_open"),  # SQLITE_CANTOPEN: a missing directory, a bad path
        18: _p("data_too_long"),  # SQLITE_TOOBIG
        19: _p("integrity"),  # SQLITE_CONSTRAINT
        20: _p("bad_data"),  # SQLITE_MISMATCH
        23: _p("permission_denied"),  # SQLITE_AUTH
        26: _p("corrupt"),  # SQLITE_NOTADB
    }
    messages = (
        ("database is locked", _t("database_locked")),
        ("no such table", _p("missing_table")),
        ("no such column", _p("missing_column")),
        ("has no column named", _p("missing_column")),
        ("syntax error", _p("bad_sql")),
        ("unable to open database", _p("cannot_open")),
        ("readonly database", _p("read_only")),
    )

    def classify(self, orig: BaseException) -> Classification | None:
        """The class of the driver error from its result code, else its message."""
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int) and code in self.extended:
            return self.extended[code]
        if isinstance(code, int) and (code & 0xFF) in self.codes:
            return self.codes[code & 0xFF]
        text = str(orig).lower()
        for fragment, classification in self.messages:
            if fragment in text:
                return classification
        return None


class Classifier(Protocol):
    """One dialect's classifier of driver errors."""

    def classify(self, orig: BaseException) -> Classification | None:
        """The class of ``orig``, or None when this dialect's codes do not cover it."""


#: The per-dialect classifiers, by SQLAlchemy dialect name.
DIALECTS: dict[str, Classifier] = {
    "postgresql": PostgresErrors(),
    "mysql": MySQLErrors(),
    "mariadb": MySQLErrors(),
    "sqlite": SQLiteErrors(),
}


def classify(exc: BaseException, dialect: str) -> Classification:
    """Transient or permanent, and why, for an error raised by SQLAlchemy or its driver."""
    orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else exc
    classifier = DIALECTS.get(dialect)
    if classifier is not None and isinstance(orig, BaseException):
        found = classifier.classify(orig)
        if found is not None:
            return found
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return _t("disconnect")
    if isinstance(exc, sa_exc.TimeoutError):
        return _t("pool_timeout")
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.DisconnectionError)):
        return _t("unavailable")
    if isinstance(exc, sa_exc.DBAPIError):
        return _p(_dbapi_cause(exc))
    return _p("client_error")


def _dbapi_cause(exc: sa_exc.DBAPIError) -> str:
    if isinstance(exc, sa_exc.IntegrityError):
        return "integrity"
    if isinstance(exc, sa_exc.DataError):
        return "bad_data"
    if isinstance(exc, sa_exc.ProgrammingError):
        return "bad_sql"
    return "database_error"


def wrap(exc: BaseException, dialect: str) -> LeaseDatabaseError:
    """The :class:`LeaseDatabaseError` the store raises for ``exc`` (``raise ... from exc``).

    The message names the cause and the driver's first line, never the SQL
    parameters (they can hold task arguments).
    """
    found = classify(exc, dialect)
    orig = getattr(exc, "orig", None) if isinstance(exc, sa_exc.DBAPIError) else None
    detail = _first_line(orig if orig is not None else exc)
    return LeaseDatabaseError(
        f"{dialect} {found.cause}: {type(orig or exc).__name__}: {detail}",
        transient=found.transient,
        cause=found.cause,
    )


def backend_of(url: str) -> str:
    """The database ``url`` names (``postgresql``, ``sqlite``...), or "" if it does not parse."""
    try:
        return make_url(url).get_backend_name()
    except sa_exc.ArgumentError:
        return ""


@contextlib.contextmanager
def translated(dialect: str) -> Iterator[None]:
    """Raise the SQLAlchemy errors of the block as :func:`wrap` does (``from`` them).

    For code outside the store that runs SQLAlchemy itself (the ``migrate``
    command around :func:`celery_lease.migrations.upgrade`).
    """
    try:
        yield
    except sa_exc.SQLAlchemyError as exc:
        raise wrap(exc, dialect) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # SQLAlchemy appends "[SQL: ...]" and "[parameters: ...]" on later lines.
    return text.splitlines()[0][:300] if text else ""
