"""Index finished rows by (status, finished_at) for retention and purge.

Built online (see :mod:`celery_lease.migrations.online`): ``CONCURRENTLY`` on
PostgreSQL, ``ALGORITHM=INPLACE, LOCK=NONE`` on MySQL/MariaDB.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from celery_lease.migrations.online import ddl

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

INDEX = "ix_celery_lease_runs_status_finished"


def upgrade() -> None:
    """Create the index the retention sweep and ``lease purge`` read in order."""
    ddl().create_index(INDEX, "celery_lease_runs", ["status", "finished_at"])


def downgrade() -> None:
    """Drop the retention index."""
    ddl().drop_index(INDEX, "celery_lease_runs")
