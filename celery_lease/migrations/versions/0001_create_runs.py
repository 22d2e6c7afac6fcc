"""Create celery_lease_runs and its two indexes.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the runs table exactly as ``celery_lease.schema`` defines it."""
    op.create_table(
        "celery_lease_runs",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", sa.BigInteger(), nullable=True),
        sa.Column("lease_ms", sa.Integer(), nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("available_at", sa.BigInteger(), nullable=False),
        sa.Column("cancel_requested_at", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("failure_code", sa.String(64), nullable=True),
        sa.Column("concurrency_key", sa.String(255), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=True),
        sa.Column("payload_content_type", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
    )
    op.create_index(
        "ix_celery_lease_runs_status_expires",
        "celery_lease_runs",
        ["status", "lease_expires_at"],
    )
    op.create_index(
        "ix_celery_lease_runs_concurrency",
        "celery_lease_runs",
        ["concurrency_key", "status"],
    )


def downgrade() -> None:
    """Drop the runs table (and with it every lease record)."""
    op.drop_index("ix_celery_lease_runs_concurrency", table_name="celery_lease_runs")
    op.drop_index("ix_celery_lease_runs_status_expires", table_name="celery_lease_runs")
    op.drop_table("celery_lease_runs")
