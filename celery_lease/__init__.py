"""celery-lease: database leases for Celery tasks.

Every run of a ``LeasedTask`` is owned by one worker at a time, renewed by a
heartbeat thread, and recorded with a statement guarded by owner and attempt.
"""

from .app import install
from .config import LeaseConfig
from .errors import (
    InvalidLeaseKey,
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
    LeaseLost,
    LeaseUsageError,
    RunCancelled,
    RunFailed,
    RunNotFound,
)
from .flow import pause, resume
from .lease.lease import Lease, current_lease
from .run.task import LeasedTask
from .runtime import store_for
from .store import LeaseStore

__all__ = [
    "InvalidLeaseKey",
    "Lease",
    "LeaseBusy",
    "LeaseConfig",
    "LeaseDatabaseError",
    "LeaseError",
    "LeaseInputError",
    "LeaseLost",
    "LeaseStore",
    "LeaseUsageError",
    "LeasedTask",
    "RunCancelled",
    "RunFailed",
    "RunNotFound",
    "current_lease",
    "install",
    "pause",
    "resume",
    "store_for",
]
__version__ = "0.1.0"
