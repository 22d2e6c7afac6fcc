"""How long any wait on a lease database may last: :class:`WaitBounds` for lease traffic,
:class:`MigrationBounds` for a schema change beside it."""

from __future__ import annotations

import dataclasses

from sqlalchemy import Connection, func, inspect, select

from ..schema import RUNNING, TERMINAL_STATUSES, db_now_ms, runs


@dataclasses.dataclass(frozen=True)
class WaitBounds:
    """How long any wait on the lease database may last, in seconds.

    Derived from ``lease_seconds`` by :meth:`for_lease` (see the settings
    docs): ``statement`` bounds one statement on the server
    (``statement_timeout``, MariaDB ``max_statement_time``, MySQL
    ``max_execution_time``, SQLite's busy timeout), ``lock`` a row-lock wait
    (``lock_timeout``, ``innodb_lock_wait_timeout``), ``connect`` opening a
    connection, and ``client`` how long this process waits for any reply on a
    checked-out connection before it cuts the connection (a network partition
    that drops packets never answers, so only the client can end that wait).
    """

    connect: float
    statement: float
    lock: float
    client: float

    @classmethod
    def for_lease(cls, lease_seconds: float) -> WaitBounds:
        """The bounds for a lease of ``lease_seconds``: a heartbeat never waits past a third."""
        statement = min(lease_seconds / 4.0, 60.0)
        return cls(
            connect=max(2.0, min(lease_seconds / 4.0, 30.0)),  # libpq's minimum is 2 s
            statement=statement,
            lock=statement * 2.0 / 3.0,
            client=min(lease_seconds / 3.0, 90.0),
        )


#: The bounds of a store made without a lease length (30 s, the default).
DEFAULT_BOUNDS = WaitBounds.for_lease(30.0)


#: The lease length assumed where none is known (``lease_seconds``' default).
DEFAULT_LEASE_SECONDS = 30.0

#: The share of the shortest lease in use one schema change may hold lease writes back.
MIGRATION_LOCK_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class MigrationBounds:
    """How long a schema change may hold lease writes back, from the shortest lease in use.

    A DDL statement waiting for its table's lock queues every later write on the
    table (heartbeats, claims, completions) behind it. ``lock_wait`` bounds that
    wait: a tenth of the shortest lease (at most 2 s), shorter than the
    heartbeat's own lock wait (a sixth), so a renewal queued behind it is late,
    never failed. Between two tries the migration pauses ``pause`` (the shortest
    lease's heartbeat interval, a third, between ``lock_wait`` and 5 s) so what
    queued drains and every heartbeat finds the table free at least once. A
    statement keeps trying for ``total`` seconds, then the migration stops.
    """

    shortest_lease: float
    lock_wait: float
    pause: float
    total: float

    @classmethod
    def for_lease(cls, shortest_lease: float, total: float = 60.0) -> MigrationBounds:
        """The bounds when the shortest lease in use is ``shortest_lease`` seconds."""
        lock_wait = min(shortest_lease * MIGRATION_LOCK_FRACTION, 2.0)
        return cls(
            shortest_lease=shortest_lease,
            lock_wait=lock_wait,
            pause=max(lock_wait, min(shortest_lease / 3.0, 5.0)),
            total=total,
        )


#: How recently a run must have ended for its lease to count as one in use (an hour).
RECENT_LEASE_MS = 3_600_000


def shortest_lease_in_use(connection: Connection) -> float | None:
    """The shortest lease (seconds) among runs running now or ended within
    :data:`RECENT_LEASE_MS`, whichever release's workers took them; None without any (or
    without a runs table that has the columns).

    A recent run counts as well as a running one: an idle worker of the previous release
    (its settings unknown to this one) may claim again while the migration runs. Read on
    index ranges: ``(status, lease_expires_at)`` for running runs, the ``(status,
    finished_at)`` index for each ending status.
    """
    inspector = inspect(connection)
    if not inspector.has_table(runs.name):
        return None
    present = {column["name"] for column in inspector.get_columns(runs.name)}
    if not {"status", "lease_ms", "finished_at"} <= present:  # a foreign table: refused
        return None
    # A scalar subquery, evaluated once: an index bound (the clock is volatile).
    since = select(db_now_ms() - RECENT_LEASE_MS).scalar_subquery()
    shortest = select(func.min(runs.c.lease_ms))
    found = [connection.execute(shortest.where(runs.c.status == RUNNING)).scalar()]
    for status in sorted(TERMINAL_STATUSES):
        ended = shortest.where(runs.c.status == status, runs.c.finished_at >= since)
        found.append(connection.execute(ended).scalar())
    known = [int(value) for value in found if value is not None]
    return min(known) / 1000.0 if known else None
