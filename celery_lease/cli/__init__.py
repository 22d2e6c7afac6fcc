"""``celery -A proj lease ...``: the operator's commands (entry point ``celery_lease.cli:lease``).

Each command module registers its commands on the :func:`~celery_lease.cli.common.lease`
group when imported; importing this package imports them all.
"""

from __future__ import annotations

from . import maintenance, pauses, runs, top, web
from .common import lease

__all__ = ["lease", "maintenance", "pauses", "runs", "top", "web"]
