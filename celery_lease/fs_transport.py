"""The old home of :mod:`celery_lease.contrib.fs_transport`, kept for configs that name it.

``broker_transport = "celery_lease.fs_transport:Transport"`` keeps working.
"""

from __future__ import annotations

from .contrib.fs_transport import Channel, Transport

__all__ = ["Channel", "Transport"]
