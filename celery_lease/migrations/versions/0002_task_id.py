"""Add ``task_id``: the Celery task id whose result a run records.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable ``task_id`` column (rows made before it keep NULL)."""
    ddl().add_column("celery_lease_runs", sa.Column("task_id", sa.String(255), nullable=True))


def downgrade() -> None:
    """Drop ``task_id``."""
    op.drop_column("celery_lease_runs", "task_id")
