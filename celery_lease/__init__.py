"""celery-lease: database leases for Celery tasks.

Every run of a ``LeasedTask`` is owned by one worker at a time, renewed by a
heartbeat thread, and recorded with a statement guarded by owner and attempt.
"""

from .app import install, store_for
from .config import LeaseConfig
from .errors import (
    InvalidLeaseKey,
    LeaseBusy,
    LeaseDatabaseError,
    LeaseError,
    LeaseInputError,
    LeaseLost,
    RunCancelled,
    RunFailed,
)
from .lease import Lease, current_lease
from .run.task import LeasedTask
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
    "LeasedTask",
    "RunCancelled",
    "RunFailed",
    "current_lease",
    "install",
    "store_for",
]
__version__ = "0.1.0"
