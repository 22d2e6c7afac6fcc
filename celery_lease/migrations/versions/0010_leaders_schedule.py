"""Leader leases and the beat schedule: no single point of failure.

- ``celery_lease_leaders``: one row per leader lease (the in-worker sweeper of the
  database, each ``LeaseScheduler`` beat): its owner, term and expiry.
- ``celery_lease_schedule``: per ``LeaseScheduler`` and entry, the due time of the
  last tick sent, so a beat taking over neither skips nor repeats a tick.

Two new tables: nothing existing is locked or rewritten.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the leaders and schedule tables."""
    op.create_table(
        "celery_lease_leaders",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("term", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", sa.BigInteger, nullable=False),
        sa.Column("renewed_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "celery_lease_schedule",
        sa.Column("scheduler", sa.String(128), primary_key=True),
        sa.Column("entry", sa.String(255), primary_key=True),
        sa.Column("last_run_at", sa.BigInteger, nullable=False),
        sa.Column("total_run_count", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    """Drop both tables (a LeaseScheduler then starts its entries afresh)."""
    op.drop_table("celery_lease_schedule")
    op.drop_table("celery_lease_leaders")
