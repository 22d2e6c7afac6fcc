"""External effects: a run's generation, and the outbox of follow-up tasks.

- ``generation`` on ``celery_lease_runs`` (constant default 0): raised by one only
  when ``lease rerun --force`` puts a succeeded run back; part of every
  idempotency key the run derives (``self.lease.idempotency_key()``).
- ``celery_lease_outbox``: follow-up tasks recorded in a fenced transaction,
  published after it commits and deleted once published.

The column has a constant default (no table rewrite on PostgreSQL 11+, in place
on MySQL/MariaDB); the new table locks nothing.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl
from celery_lease.schema import PayloadType

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"


def upgrade() -> None:
    """Add the generation column and the outbox table."""
    ddl().add_column(
        TABLE, sa.Column("generation", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    op.create_table(
        "celery_lease_outbox",
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("payload", PayloadType, nullable=False),
        sa.Column("payload_content_type", sa.String(64), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("taken_at", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_celery_lease_outbox_created", "celery_lease_outbox", ["created_at"])


def downgrade() -> None:
    """Drop the outbox (follow-ups not published yet are lost) and the generation column."""
    op.drop_table("celery_lease_outbox")
    op.drop_column(TABLE, "generation")
