"""``celery -A proj lease ...``: the operator's commands (entry point ``celery_lease.cli:lease``).

Each command module registers its commands on the :func:`~celery_lease.cli.common.lease`
group when imported; importing this package imports them all.
"""

from __future__ import annotations

from . import maintenance, runs, top
from .common import (
    RECORD_FIELDS,
    TIME_FIELDS,
    format_duration,
    format_relative,
    format_time,
    lease,
    lease_left,
    record_data,
    render_table,
)
from .top import render_top

__all__ = [
    "RECORD_FIELDS",
    "TIME_FIELDS",
    "format_duration",
    "format_relative",
    "format_time",
    "lease",
    "lease_left",
    "maintenance",
    "record_data",
    "render_table",
    "render_top",
    "runs",
    "top",
]
