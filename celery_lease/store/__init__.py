"""Every SQL statement celery-lease runs, and what differs per database.

:class:`~celery_lease.store.leasestore.LeaseStore` has one method per operation of
the lease protocol (``leasestore``); flow control's statements are a
:class:`~celery_lease.store.flowstore.FlowStore` (``store.flow``) and the
operators' reads a :class:`~celery_lease.store.reads.RunReads` (``store.reads``),
follow-up tasks an :class:`~celery_lease.store.outbox.OutboxStore` (``store.outbox``),
each over the same :class:`~celery_lease.store.engines.Engines`. The SQL every
database shares is built by plain functions
(``sql``); each database (SQLite, PostgreSQL, MySQL/MariaDB) is one class that
owns what differs: engines and wait bounds, error classification, the clock,
upserts, locks, the claim and retention (``databases``). ``bounds`` holds
:class:`WaitBounds`, ``driver`` the hot path's executor, ``records`` the values
the store returns.
"""

from ..errors import RunNotFound as RunNotFound
from ..errors import RunNotRerunnable as RunNotRerunnable
from .bounds import DEFAULT_BOUNDS as DEFAULT_BOUNDS
from .bounds import WaitBounds as WaitBounds
from .databases import create_lease_engine as create_lease_engine
from .driver import DriverStatement as DriverStatement
from .engines import Engines as Engines
from .flowstore import FlowStore as FlowStore
from .leasestore import LeaseStore as LeaseStore
from .outbox import OutboxStore as OutboxStore
from .postgresql import PSYCOPG_PREPARE_THRESHOLD as PSYCOPG_PREPARE_THRESHOLD
from .reads import RunReads as RunReads
from .records import CLAIM_CONTENTION_TRIES as CLAIM_CONTENTION_TRIES
from .records import OTHER_DELIVERY as OTHER_DELIVERY
from .records import PURGE_BATCH as PURGE_BATCH
from .records import Activity as Activity
from .records import ClaimOutcome as ClaimOutcome
from .records import ClaimResult as ClaimResult
from .records import FlowCounts as FlowCounts
from .records import FollowupMessage as FollowupMessage
from .records import HeartbeatResult as HeartbeatResult
from .records import HeldRecord as HeldRecord
from .records import LeaseKey as LeaseKey
from .records import OutboxRecord as OutboxRecord
from .records import Pause as Pause
from .records import RateBucket as RateBucket
from .records import RunPageQuery as RunPageQuery
from .records import RunRecord as RunRecord
from .records import RunSummary as RunSummary
from .records import TaskCounts as TaskCounts
from .sqlite import SQLITE_AUTOCOMMIT as SQLITE_AUTOCOMMIT
