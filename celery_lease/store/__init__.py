"""Every SQL statement celery-lease runs.

One method per statement (or per short transaction), each documented with what
it guarantees. Guarded writes name ``id``, ``lease_owner`` and ``attempt`` and
turn zero changed rows into :class:`~celery_lease.errors.LeaseLost`. Every time
comparison uses :class:`~celery_lease.schema.db_now_ms`, the database clock.

:class:`LeaseStore` (``facade``) sets up the engines and is composed of parts:
``statements`` (the claim's SQL, built once), ``claim`` and ``refusal`` (claiming
a run), ``outcomes`` (heartbeat, fence, guarded ends), ``recovery`` (sweep,
kept deliveries, shutdown hand-back), ``admin`` (cancel, retention, operator
reads), over ``dialects`` (what differs per database), ``driver`` (the hot
path's executor) and ``engine`` (bounded engines).
"""

from ..errors import RunNotFound, RunNotRerunnable
from .driver import DriverStatement
from .engine import (
    DEFAULT_BOUNDS,
    PSYCOPG_PREPARE_THRESHOLD,
    SQLITE_AUTOCOMMIT,
    WaitBounds,
    create_lease_engine,
)
from .facade import LeaseStore
from .records import (
    CLAIM_CONTENTION_TRIES,
    PURGE_BATCH,
    Activity,
    ClaimOutcome,
    ClaimResult,
    HeartbeatResult,
    LeaseKey,
    RunRecord,
)

__all__ = [
    "CLAIM_CONTENTION_TRIES",
    "DEFAULT_BOUNDS",
    "PSYCOPG_PREPARE_THRESHOLD",
    "PURGE_BATCH",
    "SQLITE_AUTOCOMMIT",
    "Activity",
    "ClaimOutcome",
    "ClaimResult",
    "DriverStatement",
    "HeartbeatResult",
    "LeaseKey",
    "LeaseStore",
    "RunNotFound",
    "RunNotRerunnable",
    "RunRecord",
    "WaitBounds",
    "create_lease_engine",
]
