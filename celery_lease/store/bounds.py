"""How long any wait on a lease database may last: :class:`WaitBounds`."""

from __future__ import annotations

import dataclasses


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
