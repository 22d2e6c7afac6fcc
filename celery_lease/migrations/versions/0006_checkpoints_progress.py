"""Checkpoints and progress carried across attempts.

- ``checkpoint`` (JSON text, at most 64 KiB; ``LONGTEXT`` on MySQL/MariaDB,
  whose ``TEXT`` stops at 64 KiB of bytes) and ``checkpoint_at`` (epoch ms):
  the latest state a holder of the run saved with ``self.lease.checkpoint()``
  or ``fence(conn, checkpoint=...)``.
- ``progress_done``, ``progress_total``, ``progress_note``, ``progress_at``:
  the body's last ``self.lease.progress()``, written by a heartbeat renewal.

Every column is added nullable (no table rewrite on PostgreSQL, in place on
MySQL/MariaDB).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.migrations.online import ddl
from celery_lease.schema import MAX_PROGRESS_NOTE, CheckpointType, ProgressType

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TABLE = "celery_lease_runs"

COLUMNS = (
    "checkpoint",
    "checkpoint_at",
    "progress_done",
    "progress_total",
    "progress_note",
    "progress_at",
)


def upgrade() -> None:
    """Add the checkpoint and progress columns."""
    change = ddl()
    change.add_column(TABLE, sa.Column("checkpoint", CheckpointType, nullable=True))
    change.add_column(TABLE, sa.Column("checkpoint_at", sa.BigInteger, nullable=True))
    change.add_column(TABLE, sa.Column("progress_done", ProgressType, nullable=True))
    change.add_column(TABLE, sa.Column("progress_total", ProgressType, nullable=True))
    change.add_column(
        TABLE, sa.Column("progress_note", sa.String(MAX_PROGRESS_NOTE), nullable=True)
    )
    change.add_column(TABLE, sa.Column("progress_at", sa.BigInteger, nullable=True))


def downgrade() -> None:
    """Drop the checkpoint and progress columns."""
    for column in reversed(COLUMNS):
        op.drop_column(TABLE, column)
