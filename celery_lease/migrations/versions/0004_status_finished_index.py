"""Index finished rows by (status, finished_at) for retention and purge.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

INDEX = "ix_celery_lease_runs_status_finished"


def upgrade() -> None:
    """Create the index the retention sweep and ``lease purge`` read in order."""
    op.create_index(INDEX, "celery_lease_runs", ["status", "finished_at"])


def downgrade() -> None:
    """Drop the retention index."""
    op.drop_index(INDEX, table_name="celery_lease_runs")
