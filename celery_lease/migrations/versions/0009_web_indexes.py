"""Index runs by (status, created_at, id) and (task_name, status, created_at, id).

The web view lists runs newest first, filtered by status and task, in pages
bounded by the last row shown (keyset), so each page is an index range whatever
the table's size. Built online (see :mod:`celery_lease.migrations.online`):
``CONCURRENTLY`` on PostgreSQL, ``ALGORITHM=INPLACE, LOCK=NONE`` on MySQL/MariaDB.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from celery_lease.migrations.online import ddl

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

INDEXES = {
    "ix_celery_lease_runs_status_created": ["status", "created_at", "id"],
    "ix_celery_lease_runs_task_created": ["task_name", "status", "created_at", "id"],
}


def upgrade() -> None:
    """Create the indexes the web view's pages read in order."""
    for name, columns in INDEXES.items():
        ddl().create_index(name, "celery_lease_runs", columns)


def downgrade() -> None:
    """Drop the web view's indexes."""
    for name in INDEXES:
        ddl().drop_index(name, "celery_lease_runs")
