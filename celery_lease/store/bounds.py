"""How long any wait on a lease database may last: :class:`WaitBounds` for lease traffic,
:class:`MigrationBounds` for a schema change beside it."""

from __future__ import annotations

import dataclasses

from sqlalchemy import Connection, func, inspect, select

from ..schema import RUNNING, runs


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


def shortest_running_lease(connection: Connection) -> float | None:
    """The shortest lease (seconds) among running runs, whichever release's workers hold
    them; None without any (or without a runs table that has the columns)."""
    inspector = inspect(connection)
    if not inspector.has_table(runs.name):
        return None
    present = {column["name"] for column in inspector.get_columns(runs.name)}
    if not {"status", "lease_ms"} <= present:  # a foreign table: migrate refuses it
        return None
    shortest = connection.execute(
        select(func.min(runs.c.lease_ms)).where(runs.c.status == RUNNING)
    ).scalar()
    return None if shortest is None else int(shortest) / 1000.0
