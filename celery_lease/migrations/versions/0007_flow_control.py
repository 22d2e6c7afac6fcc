"""Flow control: pauses, fleet-wide rate limits, and the deliveries they hold back.

- ``celery_lease_pauses``: one row per paused task (``pause_key = ''``) or task
  and concurrency key; the claim refuses a paused run by this table.
- ``celery_lease_rates``: per task and rate key, the theoretical arrival time of
  the next delivery (GCRA) for ``lease_rate_limit``.
- ``celery_lease_held``: deliveries held back, with their message: paused ones
  (published again on resume, in arrival order) and rate-limited ones (published
  when due).

Three new tables: nothing existing is locked or rewritten.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.schema import PayloadType

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the pauses, rates and held tables."""
    op.create_table(
        "celery_lease_pauses",
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("pause_key", sa.String(255), primary_key=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("paused_at", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "celery_lease_rates",
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("rate_key", sa.String(255), primary_key=True),
        sa.Column("tat", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "celery_lease_held",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("flow_key", sa.String(255), nullable=False),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("payload", PayloadType, nullable=False),
        sa.Column("payload_content_type", sa.String(64), nullable=False),
        sa.Column("available_at", sa.BigInteger, nullable=False),
        sa.Column("taken_at", sa.BigInteger, nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
    )
    op.create_index(
        "ix_celery_lease_held_reason_available", "celery_lease_held", ["reason", "available_at"]
    )
    op.create_index(
        "ix_celery_lease_held_task", "celery_lease_held", ["task_name", "flow_key", "seq"]
    )


def downgrade() -> None:
    """Drop the three tables (held deliveries are lost: resume first)."""
    op.drop_table("celery_lease_held")
    op.drop_table("celery_lease_rates")
    op.drop_table("celery_lease_pauses")
