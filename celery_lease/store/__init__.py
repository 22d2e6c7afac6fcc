"""Every SQL statement celery-lease runs, and what differs per database.

:class:`~celery_lease.store.leasestore.LeaseStore` has one method per operation
(``leasestore``); the SQL every database shares is built by plain functions
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
from .leasestore import LeaseStore as LeaseStore
from .postgresql import PSYCOPG_PREPARE_THRESHOLD as PSYCOPG_PREPARE_THRESHOLD
from .records import CLAIM_CONTENTION_TRIES as CLAIM_CONTENTION_TRIES
from .records import PURGE_BATCH as PURGE_BATCH
from .records import Activity as Activity
from .records import ClaimOutcome as ClaimOutcome
from .records import ClaimResult as ClaimResult
from .records import FlowCounts as FlowCounts
from .records import HeartbeatResult as HeartbeatResult
from .records import HeldRecord as HeldRecord
from .records import LeaseKey as LeaseKey
from .records import Pause as Pause
from .records import RunPageQuery as RunPageQuery
from .records import RunRecord as RunRecord
from .records import RunSummary as RunSummary
from .records import TaskCounts as TaskCounts
from .sqlite import SQLITE_AUTOCOMMIT as SQLITE_AUTOCOMMIT
